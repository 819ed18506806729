"""DistanceRule under Adam's metric: ``metric_inner`` and the contractions that avoid
materialising, against per-example gradients by autograd.

``<g(x), P g(x')>`` with ``P`` a positive weight-space vector is contracted per
memory instead of materialising both gradients; every mode, with and without the
override's conditions, must equal ``sum_w g_w(x) P_w g_w(x')``.
"""

import itertools

import pytest
import torch
from torch import nn

from sklearn_pathkernel._engine.rules._distance import DistanceRule
from sklearn_pathkernel._engine.rules._distance._family import KernelFamily
from sklearn_pathkernel._engine.rules._gradients import FactoredGradients
from sklearn_pathkernel._engine.rules._linear import LinearRule
from sklearn_pathkernel._engine.rules._protocol import RowWeights
from sklearn_pathkernel._nn._distance import DistanceLayer

DTYPE = torch.float64
MODES = ("trace", "pairs", "diag")


# -- distance layers ----------------------------------------------------------------


def distance_case(kernel, seed=0):
    torch.manual_seed(seed)
    layer = DistanceLayer(5, 4, kernel, dtype=DTYPE)
    with torch.no_grad():
        layer.bias.normal_()
        if layer.log_gamma is not None:
            layer.log_gamma.normal_(0.0, 0.5)
    names = [name for name, _ in layer.named_parameters()]
    rule = DistanceRule(layer, {name: name for name in names})
    params = {name: p.detach() for name, p in layer.named_parameters()}
    steps = {name: 0.2 * torch.randn_like(p) for name, p in params.items()}
    return layer, names, rule, params, steps


def distance_rows(layer, n, n_outputs, seed):
    """Rows with one exactly on a memory (the expansion cancels there)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen, dtype=DTYPE)
    x[1] = layer.memories.detach()[2]
    delta = torch.randn(n, n_outputs, 4, generator=gen, dtype=DTYPE)
    t = torch.rand(n, generator=gen, dtype=DTYPE)
    t[1] = 0.0
    return x, delta, t


@pytest.mark.parametrize("kernel", ["sqeuclidean", "euclidean", "rbf", "cosine"])
@pytest.mark.parametrize("n_outputs", [1, 3])
def test_distance_metric_inner_against_autograd(
    kernel, n_outputs, per_example_gradients, metric_reference, assert_metric_close
):
    """Both sides at the step's start or at their own points of it."""
    layer, names, rule, params, steps = distance_case(kernel)
    x, dx, tx = distance_rows(layer, 6, n_outputs, seed=1)
    y, dy, ty = distance_rows(layer, 7, n_outputs, seed=2)
    gen = torch.Generator().manual_seed(3)
    width = sum(p.numel() for p in params.values())
    scale = torch.rand(width, generator=gen, dtype=DTYPE) + 0.1

    def side(x, delta, t, moving):
        t = t if moving else None
        factors = rule.factors((x,), delta, RowWeights(params, steps if moving else None, t))
        return factors, per_example_gradients(layer, names, x, delta, steps, t)

    for left_moving, right_moving in itertools.product([False, True], repeat=2):
        left, g_left = side(x, dx, tx, left_moving)
        right, g_right = side(y, dy, ty, right_moving)
        for mode in MODES:
            other, g_other = (left, g_left) if mode == "diag" else (right, g_right)
            reference = metric_reference(g_left, scale, g_other, mode)
            assert_metric_close(rule.metric_inner(left, other, scale, mode), reference)


@pytest.mark.parametrize("kernel", ["sqeuclidean", "euclidean", "rbf"])
def test_distance_metric_inner_of_integrated_features(
    kernel, monkeypatch, per_example_gradients, metric_reference, assert_metric_close
):
    """A first layer's features summed over each row's nodes in closed form
    (``S (x - m) - T dm``) against the per-node autograd gradients summed."""
    layer, names, rule, params, steps = distance_case(kernel, seed=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, generator=gen, dtype=DTYPE)
    x[0] = layer.memories.detach()[1]
    node_rows = torch.tensor([0, 1, 2, 0, 1, 2, 0, 2])
    t = torch.rand(node_rows.numel(), generator=gen, dtype=DTYPE)
    weights = torch.rand(node_rows.numel(), generator=gen, dtype=DTYPE)
    delta = torch.randn(node_rows.numel(), 3, 4, generator=gen, dtype=DTYPE)
    nodes = rule.factors((x[node_rows],), delta, RowWeights(params, steps, t))
    integrated = rule.integrate(node_rows, weights, nodes, 3)
    assert integrated.sigma_t is not None
    g_nodes = per_example_gradients(layer, names, x[node_rows], delta, steps, t)
    g_left = torch.zeros(3, *g_nodes.shape[1:], dtype=DTYPE).index_add_(
        0, node_rows, weights[:, None, None] * g_nodes
    )
    y, dy, _ = distance_rows(layer, 7, 3, seed=6)
    right = rule.factors((y,), dy, RowWeights(params))
    g_right = per_example_gradients(layer, names, y, dy)
    scale = torch.rand(g_left.shape[2], generator=gen, dtype=DTYPE) + 0.1
    for mode in ("trace", "pairs"):
        reference = metric_reference(g_left, scale, g_right, mode)
        assert_metric_close(rule.metric_inner(integrated, right, scale, mode), reference)
    # in blocks of one memory
    monkeypatch.setattr("sklearn_pathkernel._engine._planning.BLOCK_BUDGET_BYTES", 1)
    reference = metric_reference(g_left, scale, g_right, "trace")
    assert_metric_close(rule.metric_inner(integrated, right, scale, "trace"), reference)


def test_the_contractions_do_not_materialise(monkeypatch):
    """With several outputs, "trace" mode never forms a per-example gradient."""

    def refuse(self, factors):
        raise AssertionError("materialised")

    gen = torch.Generator().manual_seed(7)
    linear = LinearRule(nn.Linear(4, 5).to(DTYPE), "weight", "bias")
    factors = FactoredGradients(
        inputs=torch.randn(6, 4, generator=gen, dtype=DTYPE),
        deltas=torch.randn(6, 3, 5, generator=gen, dtype=DTYPE),
    )
    layer, _, distance, params, steps = distance_case("rbf")
    x, delta, t = distance_rows(layer, 6, 3, seed=8)
    left = distance.factors((x,), delta, RowWeights(params, steps, t))
    right = distance.factors((x,), delta, RowWeights(params))
    monkeypatch.setattr(LinearRule, "materialise", refuse)
    monkeypatch.setattr(DistanceRule, "materialise", refuse)
    monkeypatch.setattr(KernelFamily, "materialise", refuse)
    linear.metric_inner(factors, factors, torch.ones(25, dtype=DTYPE), "trace")
    distance.metric_inner(left, right, torch.ones(28, dtype=DTYPE), "trace")
