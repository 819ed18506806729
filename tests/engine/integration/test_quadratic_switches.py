"""Closed-form kinks of switching values quadratic in t, and the first distance layer's
integrated features, against independent computations."""

import numpy as np
import pytest
import torch
from torch import nn

import sklearn_pathkernel._engine._planning as planning_module
import sklearn_pathkernel._engine.integration._kinks as kinks_module
from sklearn_pathkernel import DistanceKernelClassifier
from sklearn_pathkernel._engine._modes import OutputMode
from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._engine.integration._kinks import polynomial_switches, row_kinks
from sklearn_pathkernel._engine.integration._switches import SwitchState, switch_state
from sklearn_pathkernel._engine.rules._contract import contract
from sklearn_pathkernel._engine.rules._distance import DistanceRule
from sklearn_pathkernel._engine.rules._protocol import RowWeights
from sklearn_pathkernel._nn._distance import DistanceLayer, Transform
from sklearn_pathkernel._path import WeightPath


def _states(values):
    """SwitchStates at u = 0, 1/3, 2/3, 1 of [0, 1] from ``values(u) -> (n, m)``."""
    return [
        SwitchState(torch.full((values(0.0).shape[0],), u, dtype=torch.float64), [values(u)], [])
        for u in (0.0, 1 / 3, 2 / 3, 1.0)
    ]


def _solve(values):
    found = polynomial_switches(_states(values))
    return found.solved[0], found.rows, found.t


def test_quadratic_roots_inside_the_interval():
    # row 0: roots 0.2 and 0.7 (same sign at both ends); row 1: one root at 0.4;
    # row 2: roots outside (0, 1); row 3: linear, root at 0.25
    def values(u):
        u = torch.tensor(u, dtype=torch.float64)
        return torch.stack(
            [
                3.0 * (u - 0.2) * (u - 0.7),
                -2.0 * (u - 0.4) * (u + 1.5),
                (u - 1.5) * (u + 0.5) + 0.0 * u,
                4.0 * (u - 0.25),
            ]
        )[None].expand(1, 4)

    mask, rows, t = _solve(values)
    assert mask.all()
    np.testing.assert_array_equal(rows, 0)
    np.testing.assert_allclose(np.sort(t), [0.2, 0.25, 0.4, 0.7], rtol=0, atol=1e-14)


def test_cubic_values_are_left_to_the_search():
    def values(u):
        u = torch.tensor(u, dtype=torch.float64)
        return torch.stack([(u - 0.3) ** 3, (u - 0.5) ** 2 - 0.01])[None]

    mask, rows, t = _solve(values)
    assert not mask[0, 0] and mask[0, 1]  # the cubic is searched, the quadratic solved
    np.testing.assert_allclose(np.sort(t), [0.4, 0.6], atol=1e-14)


def _distance_probe(seed, depth):
    """A probe of DistanceLayer -> relu-like clamp (log1p transform) [-> DistanceLayer
    -> clamp] -> Linear, with a random step whose memories pass near the inputs."""
    torch.manual_seed(seed)
    layers = [DistanceLayer(3, 6, dtype=torch.float64), Transform("log1p")]
    if depth == 2:
        layers += [DistanceLayer(6, 5, dtype=torch.float64), Transform("log1p")]
    layers.append(nn.Linear(layers[-2].n_memories, 3, dtype=torch.float64))
    module = nn.Sequential(*layers)
    with torch.no_grad():
        for layer in module:
            if isinstance(layer, DistanceLayer):
                layer.bias.uniform_(-1.2, -0.2)  # distances cross zero along the step
    named = list(module.named_parameters())
    start = torch.cat([p.detach().reshape(-1) for _, p in named])
    direction = 0.6 * torch.randn_like(start)
    path = WeightPath(
        weights=torch.stack([start, start + direction]),
        param_names=[name for name, _ in named],
        param_shapes=[tuple(p.shape) for _, p in named],
    )
    X = torch.randn(7, 3, dtype=torch.float64)
    return NetworkProbe(module, path, X[:1]), start, direction, X


def _brute_force_changes(probe, start, direction, X, n_points=4001):
    """Per row, the grid intervals where some switching value changes sign."""
    t = np.linspace(0.0, 1.0, n_points)
    n = X.shape[0]
    t_rows = torch.as_tensor(np.repeat(t, n))
    state = switch_state(probe, start, direction, X.repeat(n_points, 1), t_rows)
    signs = torch.cat([z > 0 for z in state.switches], 1).numpy().reshape(n_points, n, -1)
    changes = signs[1:] != signs[:-1]
    return t, [np.flatnonzero(changes[:, row].any(1)) for row in range(n)]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_kinks_match_dense_grid_sign_changes(seed, depth, monkeypatch):
    probe, start, direction, X = _distance_probe(seed, depth)
    searched = []
    locate = kinks_module.locate_kinks
    monkeypatch.setattr(
        kinks_module, "locate_kinks", lambda *a, **k: searched.append(1) or locate(*a, **k)
    )
    found = row_kinks(probe, start, direction, X, np.arange(X.shape[0])).kinks
    t, changes = _brute_force_changes(probe, start, direction, X)
    assert sum(len(c) for c in changes) > 0
    for row_kinks_found, row_changes in zip(found, changes, strict=True):
        # every sign change on the dense grid has a kink in its interval ...
        for index in row_changes:
            inside = (row_kinks_found >= t[index] - 1e-12) & (row_kinks_found <= t[index + 1])
            assert inside.any()
        # ... and every kink is a sign change of the grid (none invented)
        for kink in row_kinks_found:
            index = np.searchsorted(t, kink) - 1
            assert np.isin([index - 1, index, index + 1], row_changes).any()
    if depth == 1:
        assert not searched  # every first-layer switching value is quadratic: no search


def _fitted(kernel, solver):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 4))
    y = (X[:, 0] + X[:, 1] ** 2 > 1).astype(int)
    clf = DistanceKernelClassifier(
        hidden_layer_sizes=(8,), kernel=kernel, solver=solver, max_iter=15, random_state=0
    )
    if solver == "sgd":
        clf.set_params(learning_rate=0.5)
    return clf.fit(X[:50], y[:50]), X[:50], X[50:]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["sqeuclidean", "euclidean", "rbf"])
@pytest.mark.parametrize("solver", ["sgd", "adam"])
def test_integrated_features_match_per_node_products(kernel, solver, monkeypatch):
    clf, X_train, Q = _fitted(kernel, solver)
    parts = clf.decompose(Q)
    gram = clf._engine().gram(
        torch.as_tensor(Q), torch.as_tensor(X_train), b_train=True, output="full"
    )
    identity = parts.bias + parts.contributions.sum(1) + parts.decay - parts.output
    assert np.abs(identity).max() <= 1e-9
    assert parts.residual.max() <= 1e-9
    monkeypatch.setattr(DistanceRule, "integrate", lambda self, *args, **kwargs: None)
    per_node = clf._engine().decompose(torch.as_tensor(Q))
    per_node_gram = clf._engine().gram(
        torch.as_tensor(Q), torch.as_tensor(X_train), b_train=True, output="full"
    )
    scale = np.abs(per_node.contributions).max()
    np.testing.assert_allclose(parts.contributions, per_node.contributions, atol=1e-13 * scale)
    np.testing.assert_allclose(gram, per_node_gram, atol=1e-13 * np.abs(gram).max())


@pytest.mark.parametrize("kernel", ["sqeuclidean", "euclidean", "rbf"])
@pytest.mark.parametrize("mode", [OutputMode.TRACE, OutputMode.PAIRS])
@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["all-memories", "one-memory-chunks"])
def test_dense_inner_against_autograd(
    kernel, mode, chunk_bytes, per_example_gradients, monkeypatch
):
    """The factored dense products against autograd's per-example gradients, the
    memories in one chunk and one by one (the near pair in a chunk of its own)."""
    if chunk_bytes is not None:
        monkeypatch.setattr(planning_module, "DOTS_CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    layer = DistanceLayer(5, 4, kernel, dtype=torch.float64)
    x = torch.randn(6, 5, dtype=torch.float64)
    with torch.no_grad():
        layer.memories[1] = x[2]  # a memory on an input: the expansion cancels there
    names = [name for name, _ in layer.named_parameters()]
    rule = DistanceRule(layer, {name: name for name in names})
    params = {name: p.detach() for name, p in layer.named_parameters()}
    steps = {name: 0.1 * torch.randn_like(p) for name, p in params.items()}
    t = torch.rand(6, dtype=torch.float64)
    t[2] = 0.0
    delta = torch.randn(6, 3, 4, dtype=torch.float64)
    factors = rule.factors((x,), delta, RowWeights(params, steps, t))
    dense = torch.randn(
        7, 3 if mode is OutputMode.TRACE else 2, 4 * 5 + 4 * (2 if kernel == "rbf" else 1)
    )
    dense = dense.to(torch.float64)
    expected = contract(dense, per_example_gradients(layer, names, x, delta, steps, t), mode)
    got = rule.dense_inner(dense, factors, mode)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())
