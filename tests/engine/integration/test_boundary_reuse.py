"""The kink search of step ``s + 1`` starts from the switch states at the end of step ``s``.

Checked against the search without them: the same kinks and ends (to rounding:
``w_s + (w_{s+1} - w_s)`` is ``w_{s+1}`` to an ulp), the same decomposition, and
fewer rows evaluated.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine.integration import _kinks
from sklearn_pathkernel._engine.integration._quadrature import BoundaryCache
from sklearn_pathkernel._training._loop import train_module
from sklearn_pathkernel._training._updates import SolverSettings

DTYPE = torch.float64


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Linear(3 * 3 * 3, 3)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv(x.view(-1, 1, 6, 6))), 2)
        return self.head(x.flatten(1))


def trained(solver):
    torch.manual_seed(0)
    module = CNN().to(DTYPE)
    rng = np.random.RandomState(0)
    X, y = torch.tensor(rng.rand(30, 36)), torch.tensor(rng.randint(0, 3, 30))
    path = train_module(
        module, X, y, solver=solver, learning_rate=0.5, max_iter=6, random_state=0
    ).path
    return module, path, X


class Counted:
    """Wraps ``_kinks.switch_state``, counting the rows it evaluates."""

    def __init__(self, monkeypatch):
        self.rows = 0
        original = _kinks.switch_state

        def counted(probe, start, direction, X, t):
            self.rows += X.shape[0]
            return original(probe, start, direction, X, t)

        monkeypatch.setattr(_kinks, "switch_state", counted)


def test_a_search_from_known_ends_finds_the_same_kinks(monkeypatch):
    module, path, X = trained(SolverSettings("sgd"))
    engine = PathKernelEngine(module, path, X)
    probe, steps = engine.probe, engine._steps
    Q = torch.tensor(np.random.RandomState(1).rand(8, 36) * 2)
    rows = np.arange(Q.shape[0])
    counted = Counted(monkeypatch)
    previous = _kinks.row_kinks(probe, steps.step(2).start, steps.step(2).direction, Q, rows)
    step = steps.step(3)
    before = counted.rows
    fresh = _kinks.row_kinks(probe, step.start, step.direction, Q, rows)
    fresh_rows = counted.rows - before
    known = previous.boundary._replace(start=previous.boundary.end, end=None)
    before = counted.rows
    reused = _kinks.row_kinks(probe, step.start, step.direction, Q, rows, known=known)
    assert counted.rows - before <= fresh_rows - Q.shape[0]
    assert sum(k.size for k in fresh.kinks) > 0
    for a, b in zip(fresh.kinks, reused.kinks, strict=True):
        assert a.shape == b.shape and np.abs(a - b).max(initial=0.0) < 1e-12
    for a, b in zip(fresh.ends, reused.ends, strict=True):
        assert torch.allclose(a, b, rtol=1e-13, atol=1e-14)


def _no_reuse(self, X, index):
    return None


def _decomposition_and_rows(module, path, X, Q, monkeypatch, reuse):
    with monkeypatch.context() as patch:
        if not reuse:
            patch.setattr(BoundaryCache, "known", _no_reuse)
        counted = Counted(patch)
        parts = PathKernelEngine(module, path, X).decompose(Q)
        return parts, counted.rows


def test_consecutive_steps_share_their_ends(monkeypatch):
    """Forward over the steps (SGD) and backward (momentum accumulates): both
    evaluate fewer rows and give the same decomposition."""
    Q = torch.tensor(np.random.RandomState(1).rand(6, 36) * 2)
    for solver in (SolverSettings("sgd"), SolverSettings("sgd", momentum=0.9)):
        module, path, X = trained(solver)
        ours, ours_rows = _decomposition_and_rows(module, path, X, Q, monkeypatch, True)
        theirs, their_rows = _decomposition_and_rows(module, path, X, Q, monkeypatch, False)
        # one end of every step but the first is known (each level reuses both ends)
        assert ours_rows <= their_rows - (path.n_steps - 1) * Q.shape[0]
        scale = np.abs(theirs.contributions).max()
        assert np.abs(ours.contributions - theirs.contributions).max() <= 1e-12 * scale
        assert np.abs(ours.bias + ours.contributions.sum(1) + ours.decay - ours.output).max() < 1e-9


def test_the_cache_holds_for_the_same_rows_only():
    cache = BoundaryCache()
    X = torch.zeros(3, 2)
    states = _kinks.BoundaryStates("start of 4", "end of 4")
    cache.store(X, 4, states)
    assert cache.known(X, 4) == states
    assert cache.known(X, 5) == ("end of 4", None)
    assert cache.known(X, 3) == (None, "start of 4")
    assert cache.known(X, 6) is None
    assert cache.known(X.clone(), 5) is None  # equal values, another tensor
    X += 1.0  # changed in place
    assert cache.known(X, 5) is None
