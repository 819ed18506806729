"""Test-copy features: integrating over a row's nodes before the inner products.

``StepFeatures`` sums a layer's factors over each row's quadrature nodes when the
rule can (``integrate``): the result must equal the per-node inner products summed
afterwards, computed here from materialised per-example gradients (autograd, one
node at a time).
"""

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_pathkernel._engine._features import StepFeatures
from sklearn_pathkernel._engine._modes import OutputMode
from sklearn_pathkernel._engine.integration._quadrature import pieces, piecewise_nodes
from sklearn_pathkernel._engine.rules._gradients import FactoredGradients
from sklearn_pathkernel._engine.rules._linear import LinearRule
from sklearn_pathkernel._engine.rules._rows import first_of_rows, row_outer_sums, row_sums

DTYPE = torch.float64


def linear_case(d_in, d_out, n_outputs, nodes_per_row, constant_input, seed=0):
    """A linear layer's factors at the nodes of 3 rows, in shuffled node order."""
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(d_in, d_out).to(DTYPE)
    n_rows = 3
    rows = torch.arange(n_rows).repeat_interleave(torch.tensor(nodes_per_row))
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    weights = torch.rand(rows.numel(), generator=gen, dtype=DTYPE)
    if constant_input:
        inputs = torch.randn(n_rows, d_in, generator=gen, dtype=DTYPE)[rows]
    else:
        inputs = torch.randn(rows.numel(), d_in, generator=gen, dtype=DTYPE)
    deltas = torch.randn(rows.numel(), n_outputs, d_out, generator=gen, dtype=DTYPE)
    return layer, rows, weights, FactoredGradients(inputs=inputs, deltas=deltas), n_rows


def autograd_gradients(layer, inputs, deltas):
    """(n, K, W) per-example gradients of ``delta_k . layer(x)``, weight then bias."""
    out = []
    for x, delta in zip(inputs, deltas, strict=True):
        per_output = []
        for d in delta:
            layer.zero_grad()
            (layer(x[None])[0] * d).sum().backward()
            per_output.append(torch.cat([layer.weight.grad.reshape(-1), layer.bias.grad]))
        out.append(torch.stack(per_output))
    return torch.stack(out)


def integrated_gradients(layer, rows, weights, factors, n_rows):
    grads = autograd_gradients(layer, factors.inputs, factors.deltas)
    return torch.zeros(n_rows, *grads.shape[1:], dtype=DTYPE).index_add_(
        0, rows, weights[:, None, None] * grads
    )


CASES = {
    # first layer: the input is the same at every node of a row -> factored sum
    "constant-input": dict(d_in=6, d_out=5, n_outputs=3, constant_input=True),
    # a small layer with many nodes per row -> materialised sum
    "materialised": dict(d_in=3, d_out=2, n_outputs=2, constant_input=False),
    # a wide layer with few nodes per row -> kept per node
    "per-node": dict(d_in=9, d_out=8, n_outputs=3, constant_input=False),
}


@pytest.mark.parametrize("case", CASES)
def test_linear_integrate_takes_the_expected_form(case):
    nodes_per_row = [6, 5, 7] if case == "materialised" else [2, 1, 3]
    layer, rows, weights, factors, n_rows = linear_case(**CASES[case], nodes_per_row=nodes_per_row)
    rule = LinearRule(layer, "weight", "bias")
    integral = rule.integrate(rows, weights, factors, n_rows)
    if case == "per-node":
        assert integral is None
        return
    assert isinstance(integral, FactoredGradients) == (case == "constant-input")
    expected = integrated_gradients(layer, rows, weights, factors, n_rows)
    torch.testing.assert_close(rule.materialise(integral), expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("case", CASES)
def test_materialised_sums_match_autograd(case):
    """``materialise_sums`` (the linear rule's padded products, and the protocol's
    default through per-node gradients) and ``StepFeatures.materialised``."""
    layer, rows, weights, factors, n_rows = linear_case(**CASES[case], nodes_per_row=[2, 4, 3])
    rule = LinearRule(layer, "weight", "bias")
    expected = integrated_gradients(layer, rows, weights, factors, n_rows)
    for sums in (
        rule.materialise_sums(rows, weights, factors, n_rows),
        super(LinearRule, rule).materialise_sums(rows, weights, factors, n_rows),
        StepFeatures([rule], [(rows, weights, [factors])], n_rows).materialised()[0],
    ):
        torch.testing.assert_close(sums, expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", [OutputMode.TRACE, OutputMode.PAIRS])
def test_step_features_inner_and_directional_match_autograd(case, mode):
    nodes_per_row = [6, 5, 7] if case == "materialised" else [2, 1, 3]
    layer, rows, weights, factors, n_rows = linear_case(**CASES[case], nodes_per_row=nodes_per_row)
    rule = LinearRule(layer, "weight", "bias")
    # split the nodes in two chunks, as the engine evaluates them tile by tile
    half = rows.numel() // 2
    evaluated = [
        (rows[:half], weights[:half], [factors.take(slice(0, half))]),
        (rows[half:], weights[half:], [factors.take(slice(half, None))]),
    ]
    features = StepFeatures([rule], evaluated, n_rows)
    phi = integrated_gradients(layer, rows, weights, factors, n_rows)  # (n_rows, K, W)

    gen = torch.Generator().manual_seed(1)
    n_right = 4
    right_inputs = torch.randn(n_right, factors.inputs.shape[1], generator=gen, dtype=DTYPE)
    n_right_outputs = factors.deltas.shape[1] if mode is OutputMode.TRACE else 1
    right_deltas = torch.randn(
        n_right, n_right_outputs, factors.deltas.shape[2], generator=gen, dtype=DTYPE
    )
    right = FactoredGradients(inputs=right_inputs, deltas=right_deltas)
    g_right = autograd_gradients(layer, right_inputs, right_deltas)
    if mode is OutputMode.TRACE:
        expected = torch.einsum("nkw,mkw->nm", phi, g_right)
        out = torch.zeros(n_rows, n_right, dtype=DTYPE)
    else:
        expected = torch.einsum("nkw,mjw->nmkj", phi, g_right)
        out = torch.zeros(n_rows, n_right, phi.shape[1], 1, dtype=DTYPE)
    features.add_inner([right], mode, out)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)

    step = {"weight": torch.randn_like(layer.weight), "bias": torch.randn_like(layer.bias)}
    flat_step = torch.cat([step["weight"].reshape(-1), step["bias"]])
    torch.testing.assert_close(features.directional(step), phi @ flat_step, rtol=1e-12, atol=1e-12)


def test_row_helpers():
    rows = torch.tensor([2, 0, 2, 1, 0])
    assert first_of_rows(rows, 4).tolist()[:3] == [1, 3, 0]
    values = torch.arange(5, dtype=DTYPE)[:, None]
    sums = row_sums(rows, torch.full((5,), 2.0, dtype=DTYPE), values, 4)
    assert sums[:, 0].tolist() == [2 * (1 + 4), 2 * 3, 2 * (0 + 2), 0]


def test_row_outer_sums_match_a_loop():
    gen = torch.Generator().manual_seed(0)
    rows = torch.tensor([3, 0, 3, 1, 0, 3, 0])
    left = torch.randn(7, 4, generator=gen, dtype=DTYPE)
    right = torch.randn(7, 2, generator=gen, dtype=DTYPE)
    expected = torch.zeros(5, 4, 2, dtype=DTYPE)  # row 2 and row 4 have no entries
    for e, r in enumerate(rows.tolist()):
        expected[r] += torch.outer(left[e], right[e])
    torch.testing.assert_close(row_outer_sums(rows, left, right, 5), expected)


def reference_pieces(rows, kinks):
    out = []
    for row, k in zip(rows, kinks, strict=True):
        edges = np.unique(np.concatenate([[0.0], k, [1.0]]))
        out += [(row, a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return sorted(out)


def test_pieces_match_a_per_row_construction():
    rng = np.random.RandomState(0)
    rows = np.array([4, 1, 7, 2])
    # repeated kinks, kinks at the ends, unsorted kinks and a row without kinks
    kinks = [
        np.array([0.5, 0.25, 0.5]),
        np.array([0.0, 1.0, 0.3]),
        rng.rand(6),
        np.array([]),
    ]
    piece_rows, a, b = pieces(rows, kinks)
    assert sorted(zip(piece_rows, a, b, strict=True)) == reference_pieces(rows, kinks)
    assert np.all(b > a)
    nodes = piecewise_nodes(rows, kinks, 3)
    for row in rows:  # each row's weights add up to the length of [0, 1]
        np.testing.assert_allclose(nodes.weights[nodes.rows == row].sum(), 1.0, rtol=1e-14)
        t = nodes.t[nodes.rows == row]
        assert np.all((t > 0) & (t < 1))


# -- one pass for the nodes and the training rows ---------------------------------------


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.head = nn.Linear(2 * 2 * 2, 3)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv(x.view(-1, 1, 4, 4))), 2)
        return self.head(x.flatten(1))


def distance_network():
    from sklearn_pathkernel._nn._distance import DistanceLayer

    return nn.Sequential(DistanceLayer(16, 5), nn.Linear(5, 3))


NETWORKS = {
    "mlp": lambda: nn.Sequential(nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 3)),
    "cnn": SmallCNN,
    "distance": distance_network,
}


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("labels", [False, True])
def test_factors_with_matches_separate_passes(network, labels):
    """The training rows' factors from the nodes' passes equal their own pass."""
    from sklearn_pathkernel._engine._probe import NetworkProbe
    from sklearn_pathkernel._training._loop import train_module

    torch.manual_seed(0)
    module = NETWORKS[network]().to(DTYPE)
    X = torch.randn(12, 16, dtype=DTYPE)
    y = torch.arange(12) % 3
    path = train_module(module, X, y, learning_rate=0.3, max_iter=2, random_state=0).path
    probe = NetworkProbe(module, path)
    start, direction = path.weights[1], path.step_direction(1)
    t = torch.rand(5, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    outputs = y[5:] if labels else None

    factors = probe.factors(start, X[:5], direction=direction, t=t)
    start_factors = probe.factors(start, X[5:], outputs)
    shared, shared_start = probe.factors_with(
        start, X[:5], X[5:], outputs, direction=direction, t=t
    )
    for rule, a, b, a_start, b_start in zip(
        probe.rules, shared, factors, shared_start, start_factors, strict=True
    ):
        # compared through the inner products they define
        torch.testing.assert_close(
            rule.inner(a, b, OutputMode.PAIRS),
            rule.inner(b, b, OutputMode.PAIRS),
            rtol=1e-12,
            atol=1e-13,
        )
        torch.testing.assert_close(
            rule.inner(a_start, b_start, OutputMode.PAIRS),
            rule.inner(b_start, b_start, OutputMode.PAIRS),
            rtol=1e-12,
            atol=1e-13,
        )


@pytest.mark.parametrize("mode", [OutputMode.TRACE, OutputMode.PAIRS])
@pytest.mark.parametrize("names", [("weight", "bias"), ("weight", None), (None, "bias")])
def test_linear_node_inner_weights_each_node(mode, names):
    """``node_inner`` folds the node weights into the factored product: it equals
    ``weights[e] * <g_e, g_j>`` from autograd's per-example gradients."""
    layer, rows, weights, nodes, _ = linear_case(4, 3, 2, [2, 3, 1], constant_input=False)
    rule = LinearRule(layer, *names)
    gen = torch.Generator().manual_seed(1)
    right = FactoredGradients(
        inputs=torch.randn(5, 4, generator=gen, dtype=DTYPE),
        deltas=torch.randn(5, 2, 3, generator=gen, dtype=DTYPE),
    )
    left_grads = autograd_gradients(layer, nodes.inputs, nodes.deltas)
    right_grads = autograd_gradients(layer, right.inputs, right.deltas)
    keep = torch.cat(
        [
            torch.ones(12, dtype=torch.bool) * (names[0] is not None),
            torch.ones(3, dtype=torch.bool) * (names[1] is not None),
        ]
    )
    pairs = torch.einsum("ekw,jlw->ejkl", left_grads[..., keep], right_grads[..., keep])
    expected = pairs.diagonal(dim1=2, dim2=3).sum(-1) if mode is OutputMode.TRACE else pairs
    expected = expected * weights.view(-1, *([1] * (expected.ndim - 1)))
    actual = rule.node_inner(nodes, weights, right, mode)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    # the protocol's default (weights applied after the product) agrees
    default = super(LinearRule, rule).node_inner(nodes, weights, right, mode)
    torch.testing.assert_close(default, expected, rtol=1e-12, atol=1e-12)
