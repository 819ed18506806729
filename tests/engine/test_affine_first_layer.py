"""The first layer's output along a step from its two per-step products
(``StepQueries`` in ``_engine/_probe.py``).

The first parameterised layer sees the query itself; linear in its weights, its
output at ``w_s + t dw_s`` is ``z_s + t dz_s``. Checked against the route that
evaluates the layer at every point (``NetworkProbe.affine_first_layer = False``)
for plain SGD, momentum and Adam, ReLU and tanh, the full K outputs and a scalar
target, to 1e-12 of the contributions' scale, and against the network's own
output (the sum identity); the probe's evaluations against an independent
forward pass at ``w_s + t dw_s``.
"""

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_pathkernel._engine import QueryTargets, _probe
from sklearn_pathkernel._engine._targets import OutputTarget
from sklearn_pathkernel._training import SolverSettings

SOLVERS = {
    "sgd": (dict(solver="sgd"), 8),
    "momentum": (dict(solver="sgd", momentum=0.9), 8),
    "adam": (dict(solver="adam"), 8),
}


def _fit(engine_cases, solver, activation):
    settings, batch_size = SOLVERS[solver]
    module = engine_cases.mlp([5, 7, 6, 3], activation)
    lr = 0.01 if solver == "adam" else 0.1
    module, path, X, y = engine_cases.trained(
        module, n=24, steps=6, lr=lr, solver=SolverSettings(**settings),
        batch_size=batch_size,
    )  # fmt: skip
    return engine_cases.engine_for(module, path, X, y), module, path


def _both_routes(engine, A, monkeypatch, targets=None):
    found = {}
    for flag in (True, False):
        monkeypatch.setattr(_probe.NetworkProbe, "affine_first_layer", flag)
        found[flag] = engine.decompose(A, targets=targets)
    return found[True], found[False]


def _assert_same(fast, generic):
    scale = np.abs(generic.contributions).max()
    assert scale > 0
    assert np.abs(fast.contributions - generic.contributions).max() <= 1e-12 * scale
    assert np.abs(fast.decay - generic.decay).max() <= 1e-12 * max(1.0, np.abs(generic.decay).max())
    np.testing.assert_array_equal(fast.output, generic.output)


def _check_identity(result, tolerance):
    total = result.bias + result.contributions.sum(1) + result.decay
    scale = max(1.0, np.abs(result.output).max())
    assert np.abs(total - result.output).max() <= tolerance * scale


@pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh])
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_affine_first_layer_equals_the_per_point_route(
    engine_cases, monkeypatch, solver, activation
):
    engine, _, _ = _fit(engine_cases, solver, activation)
    A = engine_cases.queries(5, n=6)
    used = []
    output = _probe.StepQueries.output

    def recording(self, rows, t):
        used.append(rows.numel())
        return output(self, rows, t)

    monkeypatch.setattr(_probe.StepQueries, "output", recording)
    fast, generic = _both_routes(engine, A, monkeypatch)
    assert used  # the new route was taken
    _assert_same(fast, generic)
    targets = QueryTargets(OutputTarget(), torch.tensor([0, 2, 1, 1, 0, 2]))
    fast_t, generic_t = _both_routes(engine, A, monkeypatch, targets)
    _assert_same(fast_t, generic_t)
    tolerance = 1e-12 if activation is nn.ReLU else 1e-9
    for result in (fast, generic, fast_t, generic_t):
        _check_identity(result, tolerance)
        assert float(np.max(result.quadrature_error)) <= tolerance


def test_probe_evaluations_match_a_forward_pass_at_each_point(engine_cases):
    """Logits of query rows at per-row points of a step, with their first layer
    from the step's products, against the module at ``w_s + t_i dw_s``."""
    _, module, path = _fit(engine_cases, "sgd", nn.ReLU)
    probe = _probe.NetworkProbe(module, path)
    X = engine_cases.queries(5, n=4)
    start, end = path.weights[2], path.weights[3]
    direction = end - start
    rows = torch.tensor([0, 3, 3, 1, 2, 0])
    t = torch.tensor([0.0, 0.25, 0.9, 1.0, 0.5, 0.7], dtype=torch.float64)
    assert probe.along(start, direction, X, rows, t) is not None
    got = probe.logits(start, X, direction, t, rows=rows)
    for i in range(rows.numel()):
        point = probe.path.unflatten(start + t[i] * direction)
        expected = torch.func.functional_call(probe.module, point, (X[rows[i] : rows[i] + 1],))
        assert torch.allclose(got[i : i + 1], expected, rtol=0, atol=1e-13)


def test_first_layer_kinks_are_the_roots_of_its_affine_output(engine_cases, monkeypatch):
    """A one-hidden-layer ReLU network: its kinks along a step are the first
    layer's roots ``t = -z_s / dz_s`` in (0, 1), computed here from the weights."""
    from sklearn_pathkernel._engine.integration._kinks import row_kinks

    module, path, X, _ = engine_cases.trained(engine_cases.mlp([5, 9, 3], nn.ReLU), steps=6)
    A = engine_cases.queries(5, n=6)
    index = 3
    before, after = path.unflatten(path.weights[index]), path.unflatten(path.weights[index + 1])
    z = A @ before["0.weight"].T + before["0.bias"]
    dz = A @ (after["0.weight"] - before["0.weight"]).T + (after["0.bias"] - before["0.bias"])
    roots = -z / dz
    for flag in (True, False):
        monkeypatch.setattr(_probe.NetworkProbe, "affine_first_layer", flag)
        probe = _probe.NetworkProbe(module, path)
        start = path.weights[index]
        direction = path.weights[index + 1] - start
        found = row_kinks(probe, start, direction, A, np.arange(A.shape[0])).kinks
        n_kinks = 0
        for row, kinks in enumerate(found):
            expected = roots[row][(roots[row] > 0) & (roots[row] < 1)].sort().values.numpy()
            assert kinks.shape == expected.shape
            np.testing.assert_allclose(kinks, expected, rtol=0, atol=1e-12)
            n_kinks += kinks.size
        assert n_kinks > 0


class _InputSkip(nn.Module):
    """The query read twice: by the first layer and again by the head."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(5, 7)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(torch.cat([torch.relu(self.first(x)), x], 1))


class _OwnForward(nn.Sequential):
    def forward(self, x):
        return super().forward(2.0 * x)


def test_query_rows_nothing_reads_are_a_view_only_for_a_plain_sequential(engine_cases, monkeypatch):
    """Output passes along a step skip gathering the query rows only where the
    module's input reaches the first layer alone (a plain ``nn.Sequential``
    starting with it); the decomposition is then bitwise the gathered one, and
    a module that reads the query again gets its rows gathered (its logits along
    the step those of a forward pass)."""
    engine, module, path = _fit(engine_cases, "momentum", nn.ReLU)
    assert _probe.NetworkProbe(module, path)._input_reaches_first_layer_alone
    A = engine_cases.queries(5, n=6)
    targets = QueryTargets(OutputTarget(), torch.tensor([0, 2, 1, 1, 0, 2]))
    viewed = engine.decompose(A, targets=targets)
    monkeypatch.setattr(_probe, "_input_reaches_first_alone", lambda module, layers: False)
    engine, _, _ = _fit(engine_cases, "momentum", nn.ReLU)
    gathered = engine.decompose(A, targets=targets)
    np.testing.assert_array_equal(viewed.contributions, gathered.contributions)
    monkeypatch.undo()

    hooked = engine_cases.mlp([5, 7, 3])
    hooked[0].register_forward_pre_hook(lambda layer, inputs: None)
    others = (
        _InputSkip().double(),
        _OwnForward(*engine_cases.mlp([5, 7, 3])),
        hooked,
        nn.Sequential(nn.Identity(), *engine_cases.mlp([5, 7, 3])),
    )
    for other in others:
        linear = [layer for layer in other.modules() if isinstance(layer, nn.Linear)]
        assert not _probe._input_reaches_first_alone(other, linear)

    module, path, X, _ = engine_cases.trained(_InputSkip().double(), steps=4)
    probe = _probe.NetworkProbe(module, path)
    assert not probe._input_reaches_first_layer_alone
    start, direction = path.weights[1], path.weights[2] - path.weights[1]
    rows = torch.tensor([0, 3, 3, 1])
    t = torch.tensor([0.0, 0.25, 0.9, 1.0], dtype=torch.float64)
    X = engine_cases.queries(5, n=4)
    assert probe.along(start, direction, X, rows, t) is not None
    got = probe.logits(start, X, direction, t, rows=rows)
    for i in range(rows.numel()):
        point = path.unflatten(start + t[i] * direction)
        expected = torch.func.functional_call(probe.module, point, (X[rows[i] : rows[i] + 1],))
        assert torch.allclose(got[i : i + 1], expected, rtol=0, atol=1e-13)


def test_step_queries_output_is_the_affine_sum_bit_for_bit():
    """``StepQueries.output`` (computed in the rows' own copy): ``z_s[rows] + t *
    dz_s[rows]`` bit for bit, rows repeated and in any order, ``z_s`` and ``dz_s``
    untouched; rows at ``t = 0`` are ``z_s`` itself."""
    g = torch.Generator().manual_seed(3)
    start = torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64)
    moved = torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64)
    kept = start.clone(), moved.clone()
    queries = _probe.StepQueries(0, start, moved)
    rows = torch.tensor([2, 0, 0, 1, 2])
    t = torch.tensor([0.0, 0.25, 1.0, 1 / 3, 0.9], dtype=torch.float64)
    found = queries.output(rows, t)
    expected = start[rows] + t.view(-1, 1, 1, 1) * moved[rows]
    assert torch.equal(found, expected)
    assert torch.equal(found[0], start[2])
    assert torch.equal(start, kept[0]) and torch.equal(moved, kept[1])
