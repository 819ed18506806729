"""Momentum's accumulation with a first layer of fixed input kept factored
(``FixedInputLayers`` in ``_engine/_decomposition.py``).

Under updates that mix steps by scalars, a first ``nn.Linear``'s accumulated test
feature is ``D_s [x, 1]^T``: the decomposition keeps ``D_s`` alone. Checked
against the generic route (every layer's features materialised and accumulated,
``Decomposition.fixed_input_layers = False``) for the full K outputs and a scalar
target, to 1e-12 of the contributions' scale, and against the network's own
output (the sum identity); Adam, and a first layer whose input moves, take the
generic route with the same values.
"""

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_pathkernel._engine import QueryTargets, _decomposition
from sklearn_pathkernel._engine._targets import OutputTarget
from sklearn_pathkernel._training import SolverSettings

SOLVERS = {
    "sgd-mini": (dict(solver="sgd"), 8),
    "momentum-mini": (dict(solver="sgd", momentum=0.9), 8),
    "momentum-full": (dict(solver="sgd", momentum=0.9), None),
    "nesterov-mini": (dict(solver="sgd", momentum=0.8, nesterovs_momentum=True), 10),
    "momentum-decay": (dict(solver="sgd", momentum=0.9, weight_decay=0.05), 8),
    "nesterov-decay-full": (
        dict(solver="sgd", momentum=0.8, nesterovs_momentum=True, weight_decay=0.05),
        None,
    ),
    "adam": (dict(solver="adam"), 8),
}


class Scaled(nn.Module):
    """A trainable elementwise scale before the first linear layer: its input moves."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width, dtype=torch.float64))

    def forward(self, x):
        return x * self.scale


def _fit(engine_cases, solver, activation, module=None, steps=6):
    settings, batch_size = SOLVERS[solver]
    if module is None:
        module = engine_cases.mlp([5, 7, 6, 3], activation)
    lr = 0.01 if solver == "adam" else 0.1
    module, path, X, y = engine_cases.trained(
        module, n=24, steps=steps, lr=lr, solver=SolverSettings(**settings),
        batch_size=batch_size,
    )  # fmt: skip
    return engine_cases.engine_for(module, path, X, y), X, y


def _both_routes(engine, A, targets=None):
    found = {}
    for flag in (True, False):
        engine._decomposition.fixed_input_layers = flag
        found[flag] = engine.decompose(A, targets=targets)
    engine._decomposition.fixed_input_layers = True
    return found[True], found[False]


def _spy(monkeypatch):
    """The layer indices kept factored at every step, where the route is enabled."""
    seen = []
    of = _decomposition.FixedInputLayers.of

    def recording(self, features):
        found = of(self, features)
        if self.enabled:
            seen.append(sorted(found))
        return found

    monkeypatch.setattr(_decomposition.FixedInputLayers, "of", recording)
    return seen


def _check_identity(result, tolerance=1e-12):
    total = result.bias + result.contributions.sum(1) + result.decay
    scale = max(1.0, np.abs(result.output).max())
    assert np.abs(total - result.output).max() <= tolerance * scale


def _assert_same(fast, generic):
    scale = np.abs(generic.contributions).max()
    assert scale > 0
    assert np.abs(fast.contributions - generic.contributions).max() <= 1e-12 * scale
    assert np.abs(fast.decay - generic.decay).max() <= 1e-12 * max(1.0, np.abs(generic.decay).max())
    np.testing.assert_array_equal(fast.bias, generic.bias)
    np.testing.assert_array_equal(fast.output, generic.output)


@pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh])
@pytest.mark.parametrize("solver", [s for s in SOLVERS if s != "adam"])
def test_factored_first_layer_equals_the_generic_route(
    engine_cases, monkeypatch, solver, activation
):
    engine, X, y = _fit(engine_cases, solver, activation)
    A = engine_cases.queries(5, n=6)
    seen = _spy(monkeypatch)
    fast, generic = _both_routes(engine, A)
    _assert_same(fast, generic)
    columns = torch.tensor([0, 2, 1, 1, 0, 2])
    targets = QueryTargets(OutputTarget(), columns)
    fast_t, generic_t = _both_routes(engine, A, targets)
    _assert_same(fast_t, generic_t)
    # the scalar target is the column of the full decomposition (tanh: each takes
    # its own certified nodes, held to the certificate's tolerance)
    tolerance = 1e-12 if activation is nn.ReLU else 1e-9
    rows = np.arange(6)
    picked = generic.contributions[rows, :, columns.numpy()]
    scale = np.abs(picked).max()
    assert np.abs(fast_t.contributions[..., 0] - picked).max() <= tolerance * scale
    for result in (fast, generic, fast_t, generic_t):
        _check_identity(result, tolerance)
    if engine._fitted.path.update.per_step:
        # plain SGD: each step meets phi_s alone, every layer already factored
        assert seen == []
    else:
        # momentum: the first layer (the query is its input), and it alone
        assert seen and all(layers == [0] for layers in seen)


def test_adam_takes_the_generic_route(engine_cases, monkeypatch):
    engine, _, _ = _fit(engine_cases, "adam", nn.ReLU)
    assert not engine._fitted.path.update.scalar_mixing
    A = engine_cases.queries(5, n=4)
    seen = _spy(monkeypatch)
    fast, generic = _both_routes(engine, A)
    assert seen == []  # (no step kept a layer factored)
    np.testing.assert_array_equal(fast.contributions, generic.contributions)
    np.testing.assert_array_equal(fast.decay, generic.decay)
    _check_identity(fast)


def test_a_trainable_module_before_the_first_linear_layer(engine_cases, monkeypatch):
    """The first linear layer's input moves with the scale: it is not kept factored."""
    torch.manual_seed(0)
    module = nn.Sequential(Scaled(5), engine_cases.mlp([5, 7, 3], nn.Tanh))
    engine, _, _ = _fit(engine_cases, "momentum-mini", nn.Tanh, module=module)
    A = engine_cases.queries(5, n=4)
    seen = _spy(monkeypatch)
    fast, generic = _both_routes(engine, A)
    assert all(layers == [] for layers in seen)
    _assert_same(fast, generic)
    _check_identity(fast, 1e-9)


def test_an_input_that_moves_between_steps_falls_back(engine_cases, monkeypatch):
    """A layer taken as of fixed input whose input differs at a later step: the
    task reruns on the generic route, with its values."""
    engine, _, _ = _fit(engine_cases, "momentum-mini", nn.ReLU)
    A = engine_cases.queries(5, n=5)
    generic = _both_routes(engine, A)[1]
    of = _decomposition.FixedInputLayers.of
    calls = []

    def moving(self, features):
        calls.append(self.enabled)
        if self.enabled and len(calls) == 3:
            self.inputs = {index: inputs + 1.0 for index, inputs in self.inputs.items()}
        return of(self, features)

    monkeypatch.setattr(_decomposition.FixedInputLayers, "of", moving)
    fallen_back = engine.decompose(A)
    assert calls[:3] == [True] * 3 and not any(calls[3:])  # rerun from the last step
    _assert_same(fallen_back, generic)
    _check_identity(fallen_back)


def test_scalar_mixing_of_update_records(engine_cases):
    for solver, expected in (("sgd-mini", True), ("momentum-decay", True), ("adam", False)):
        engine, _, _ = _fit(engine_cases, solver, nn.ReLU, steps=2)
        assert engine._fitted.path.update.scalar_mixing is expected
