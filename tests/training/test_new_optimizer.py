"""The contributor recipe for a new optimiser, as written: ``torch.optim.Adagrad`` in one
class plus its registration, read from a user's own loop and offered as a solver.

Adagrad (``_single_tensor_adagrad``): ``g = G + lambda w``, ``v += g^2``,
``w -= clr g / (sqrt(v) + eps)`` with ``clr = lr / (1 + (t - 1) lr_decay)``: no
buffer, a coupled weight decay, and the preconditioner ``1 / (sqrt(v) + eps)`` taken
from the run, which is Adam's form with a bias correction of 1. Independent checks:
the network's own float64 output (the identity), torch.optim run by hand (training).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import make_blobs
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._engine import PathKernelEngine
from sklearn_pathkernel._training import SOLVERS, RecordingRefused, SolverSettings, train_module
from sklearn_pathkernel._training._hyperparameters import EPSILON
from sklearn_pathkernel._training._optimizers import (
    OPTIMIZER_RULES,
    LinearForm,
    OptimizerRule,
    StepScales,
    register_optimizer,
)


class AdagradRule(OptimizerRule):
    """``torch.optim.Adagrad`` (any ``lr_decay``, ``initial_accumulator_value``,
    L2 weight decay)."""

    optimizer_class = torch.optim.Adagrad
    hyperparameters = (EPSILON,)
    summary = "Adagrad"

    @classmethod
    def optimizer_arguments(cls, values):
        return {"eps": float(values["epsilon"]), "weight_decay": float(values["weight_decay"])}

    def check_options(self, step):
        for group in self.groups():
            if group.get("maximize", False):
                raise RecordingRefused(f"Step {step}: Adagrad with maximize=True is not supported.")

    def form_settings(self, group):
        return (float(group["weight_decay"]),)

    def linear_form(self, step):
        decay = self.per_parameter(lambda group: float(group["weight_decay"]))
        return LinearForm(0.0, 1.0, decay, 1.0, 0.0, preconditioned=True)

    def before_step(self, step, active, removed):
        self.check_options(step)
        self.check_skips(step, active, self.form(step), removed)

    def after_step(self, step, active):
        groups, states = self.optimizer.param_groups, self.optimizer.state
        sums, sizes, terms = [], [], []
        for param, k, on in zip(self.params, self.group_of, active, strict=True):
            group, state = groups[k], states[param]
            count = float(state["step"])
            sizes.append(group["lr"] / (1 + (count - 1) * group["lr_decay"]) if on else 0.0)
            sums.append(state["sum"] if on else 0.0)
        rate = max(sizes)
        for size, k in zip(sizes, self.group_of, strict=True):
            terms.append((size / rate, 1.0, groups[k]["eps"]) if size else (0.0, 1.0, 1.0))
        return StepScales(sums, 0.0, terms, rate)


@pytest.fixture
def adagrad():
    """Registers the rule as the recipe says, and takes the registration back after."""
    before = dict(OPTIMIZER_RULES), dict(SOLVERS)
    yield register_optimizer("adagrad")(AdagradRule)  # the one registration
    for registry, saved in zip((OPTIMIZER_RULES, SOLVERS), before, strict=True):
        registry.clear()
        registry.update(saved)


def data():
    X, y = make_blobs(30, n_features=4, centers=3, random_state=0)
    return torch.tensor(X), torch.tensor(y)


def tanh_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def identity_error(engine, module, queries):
    parts = engine.decompose(queries)
    with torch.no_grad():
        output = module(queries).numpy()
    return np.abs(parts.bias + parts.contributions.sum(1) + parts.decay - output).max()


def test_unregistered_adagrad_is_refused_by_name():
    model = tanh_mlp()
    X, y = data()
    with pytest.raises(RecordingRefused, match="Adagrad cannot be recorded exactly"):
        TrainingRecorder(model, torch.optim.Adagrad(model.parameters()), X, y=y)


def test_a_recorded_adagrad_loop_is_exact(adagrad):
    X, y = data()
    model = tanh_mlp()
    optimizer = torch.optim.Adagrad(
        [
            {"params": model[0].parameters(), "lr": 0.1, "weight_decay": 0.01},
            {"params": model[2].parameters(), "lr": 0.05},
        ],
        lr_decay=0.05,
        initial_accumulator_value=0.1,
    )
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    for epoch in range(4):
        for rows in np.array_split(np.random.default_rng(epoch).permutation(len(y)), 3):
            optimizer.zero_grad()
            logits = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(logits, y[rows]).backward()
            optimizer.step()
    recording = recorder.finish()
    queries = X[:5] + 0.2
    parts = recording.decompose(queries)
    with torch.no_grad():
        output = model(queries).numpy()
    total = parts.bias + parts.contributions.sum(1) + parts.decay
    np.testing.assert_allclose(total, output, rtol=0, atol=1e-9)
    assert parts.residual.max() <= 1e-9
    assert np.abs(parts.decay).max() > 0  # the first group's weight decay


def test_adagrad_as_a_solver_trains_as_torch_optim_and_stays_exact(adagrad):
    X, y = data()
    module = tanh_mlp()
    settings = SolverSettings("adagrad", epsilon=1e-6, weight_decay=0.01)
    path = train_module(module, X, y, solver=settings, learning_rate=0.1, max_iter=8).path

    by_hand = tanh_mlp()
    optimizer = torch.optim.Adagrad(by_hand.parameters(), lr=0.1, eps=1e-6, weight_decay=0.01)
    for _ in range(8):
        optimizer.zero_grad()
        F.cross_entropy(by_hand(X), y).backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in by_hand.parameters()])
    torch.testing.assert_close(path.weights[-1], flat, rtol=0, atol=1e-14)

    engine = PathKernelEngine(module, path, X)

    class LogSoftmax(nn.Module):
        def forward(self, out):
            return F.log_softmax(out, dim=1)

    assert identity_error(engine, nn.Sequential(module, LogSoftmax()), X[:5] - 0.1) <= 1e-9
