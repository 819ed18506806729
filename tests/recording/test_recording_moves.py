"""A float64 recording's moves are checked against its recorded output gradients
before its first query: a loss that is not a function of the module's output at
some step (a penalty switched on mid-run, an auxiliary loss) is refused naming
that step, for every query (``gram`` and the explanations carry no residual of
their own).

Independent computation: the residual of ``decompose`` with the check bypassed
(the identity of the recorded path, which the check predicts fails), and
``torch.optim``'s own runs for the honest loops.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._training import _replay
from sklearn_pathkernel._training._optimizers import RecordingRefused

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.01),
}


def recorded(optimizer, penalty=0.0, from_step=3, n_steps=12, dtype=torch.float64):
    """An MLP trained on mini-batches; from ``from_step`` on, the loss adds
    ``penalty * |w|^2`` (not a function of the output)."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(48, 4, generator=generator, dtype=torch.float64).to(dtype)
    y = (X[:, 0] + X[:, 1] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)
    opt = OPTIMIZERS[optimizer](model.parameters())
    recorder = TrainingRecorder(model, opt, X, y=y)
    for step in range(n_steps):
        rows = (np.arange(16) + 16 * step) % 48
        opt.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        loss = F.cross_entropy(out, y[rows])
        if penalty and step >= from_step:
            loss = loss + penalty * sum((p**2).sum() for p in model.parameters())
        loss.backward()
        opt.step()
    return recorder.finish(), X


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_honest_runs_pass_the_check(optimizer):
    recording, X = recorded(optimizer, n_steps=40)
    parts = recording.decompose(X[:4] + 0.1)
    assert parts.residual.max() <= 1e-9


@pytest.mark.parametrize("query", ["gram", "decompose", "explain", "kernel"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_penalty_switched_on_mid_run_is_refused_at_its_step(optimizer, query):
    recording, X = recorded(optimizer, penalty=1e-8, from_step=5)
    calls = {
        "gram": lambda: recording.gram(X[:3]),
        "decompose": lambda: recording.decompose(X[:3]),
        "explain": lambda: recording.explain(X[:1]),
        "kernel": lambda: recording.kernel_(X[:2], X[:3]),
    }
    with pytest.raises(RecordingRefused, match="Step 5: the recorded move of"):
        calls[query]()


def test_the_check_predicts_the_residual(monkeypatch):
    """With the check bypassed, the penalised run's decomposition misses the network
    by far more than rounding, and the honest run's does not."""
    monkeypatch.setattr(_replay, "check_moves", lambda *args: None)
    penalised, X = recorded("sgd", penalty=0.05, from_step=5)
    honest, _ = recorded("sgd")
    assert penalised.decompose(X[:4] + 0.1).residual.max() > 1e-4
    assert honest.decompose(X[:4] + 0.1).residual.max() <= 1e-12


def test_a_float32_run_with_a_penalty_is_refused_at_its_step():
    recording, X = recorded("adamw", penalty=0.05, from_step=5, dtype=torch.float32)
    with pytest.raises(RecordingRefused, match=r"Step 5: .* beyond the step's rounding"):
        recording.gram(X[:3])
