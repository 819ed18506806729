"""LinearRule: factored inner products against per-example gradients by autograd.

``<g(x), P g(x')>`` (Adam's elementwise metric ``P``) is contracted per output
unit, and dense weight-space vectors meet the inputs first, instead of
materialising the gradients; every mode must equal the autograd reference
(one row and one output at a time).
"""

import pytest
import torch
from torch import nn

from sklearn_pathkernel._engine._modes import OutputMode
from sklearn_pathkernel._engine.rules._contract import contract
from sklearn_pathkernel._engine.rules._gradients import FactoredGradients, Gradients
from sklearn_pathkernel._engine.rules._linear import LinearRule
from sklearn_pathkernel._engine.rules._protocol import LayerRule

DTYPE = torch.float64
MODES = ("trace", "pairs", "diag")


# -- linear layers ------------------------------------------------------------------


@pytest.mark.parametrize("names", [("weight", "bias"), ("weight", None), (None, "bias")])
@pytest.mark.parametrize("n_outputs", [1, 3])
def test_linear_metric_inner_against_autograd(
    names, n_outputs, per_example_gradients, metric_reference, assert_metric_close
):
    """Per-unit contraction (3 outputs) and the default (1 output, no weight)."""
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(4, 5).to(DTYPE)
    rule = LinearRule(layer, *names)
    path = [name for name in names if name is not None]

    def side(n):
        x = torch.randn(n, 4, generator=gen, dtype=DTYPE)
        delta = torch.randn(n, n_outputs, 5, generator=gen, dtype=DTYPE)
        return FactoredGradients(inputs=x, deltas=delta), per_example_gradients(
            layer, path, x, delta
        )

    (left, g_left), (right, g_right) = side(6), side(7)
    scale = torch.rand(g_left.shape[2], generator=gen, dtype=DTYPE) + 0.1
    for mode in MODES:
        other, g_other = (left, g_left) if mode == "diag" else (right, g_right)
        reference = metric_reference(g_left, scale, g_other, mode)
        assert_metric_close(rule.metric_inner(left, other, scale, mode), reference)
        # the protocol's default (materialised) agrees
        assert_metric_close(LayerRule.metric_inner(rule, left, other, scale, mode), reference)
        # materialised factors take the default
        dense = Gradients(grads=g_left)
        assert_metric_close(rule.metric_inner(dense, other, scale, mode), reference)


def test_linear_metric_inner_in_blocks_of_units(
    monkeypatch, per_example_gradients, metric_reference, assert_metric_close
):
    """Blocks of one unit (a tiny budget) give the same contraction."""
    gen = torch.Generator().manual_seed(1)
    layer = nn.Linear(3, 4).to(DTYPE)
    rule = LinearRule(layer, "weight", "bias")
    x = torch.randn(5, 3, generator=gen, dtype=DTYPE)
    delta = torch.randn(5, 4, 4, generator=gen, dtype=DTYPE)
    factors = FactoredGradients(inputs=x, deltas=delta)
    scale = torch.rand(16, generator=gen, dtype=DTYPE)
    whole = rule.metric_inner(factors, factors, scale, "trace")
    monkeypatch.setattr("sklearn_pathkernel._engine._planning.BLOCK_BUDGET_BYTES", 1)
    grads = per_example_gradients(layer, ["weight", "bias"], x, delta)
    assert_metric_close(rule.metric_inner(factors, factors, scale, "trace"), whole)
    assert_metric_close(whole, metric_reference(grads, scale, grads, "trace"))


@pytest.mark.parametrize("names", [("weight", "bias"), ("weight", None), (None, "bias")])
@pytest.mark.parametrize("n_dense", [2, 9])
def test_linear_dense_inner_against_autograd(
    names, n_dense, per_example_gradients, metric_reference, assert_metric_close
):
    """Dense vectors (Adam's scaled features) against factored gradients: through
    the inputs first (2 rows) or materialised (9 rows), for 3 and 1 right outputs."""
    gen = torch.Generator().manual_seed(2)
    layer = nn.Linear(8, 4).to(DTYPE)
    rule = LinearRule(layer, *names)
    path = [name for name in names if name is not None]
    for k_right, modes in ((3, ("trace", "pairs")), (1, ("pairs",))):
        x = torch.randn(7, 8, generator=gen, dtype=DTYPE)
        delta = torch.randn(7, k_right, 4, generator=gen, dtype=DTYPE)
        grads = per_example_gradients(layer, path, x, delta)
        dense = torch.randn(n_dense, 3, grads.shape[2], generator=gen, dtype=DTYPE)
        for mode in modes:
            actual = rule.dense_inner(dense, FactoredGradients(inputs=x, deltas=delta), mode)
            assert_metric_close(actual, contract(dense, grads, mode))


@pytest.mark.parametrize("names", [("weight", "bias"), ("weight", None), (None, "bias")])
@pytest.mark.parametrize("n_outputs", [1, 3])
def test_linear_materialise_sums_against_per_node_gradients(names, n_outputs):
    """Each row's weighted sum of its nodes' gradients, written into the layout
    by the products (weight then bias): the per-node gradients materialised,
    scaled and scattered (the protocol's default), rows in any order, one row
    without nodes."""
    gen = torch.Generator().manual_seed(3)
    layer = nn.Linear(6, 5).to(DTYPE)
    rule = LinearRule(layer, *names)
    rows = torch.tensor([2, 0, 2, 3, 0, 2, 2, 0])  # row 1 has no nodes
    weights = torch.randn(8, generator=gen, dtype=DTYPE)
    factors = FactoredGradients(
        inputs=torch.randn(8, 6, generator=gen, dtype=DTYPE),
        deltas=torch.randn(8, n_outputs, 5, generator=gen, dtype=DTYPE),
    )
    actual = rule.materialise_sums(rows, weights, factors, 4)
    expected = LayerRule.materialise_sums(rule, rows, weights, factors, 4)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-14, atol=1e-15)
    assert not actual[1].any()


@pytest.mark.parametrize("names", [("weight", "bias"), ("weight", None), (None, "bias")])
@pytest.mark.parametrize("mode", [OutputMode.TRACE, OutputMode.PAIRS])
@pytest.mark.parametrize("materialised", [False, True])
def test_linear_add_inner_adds_inner(names, mode, materialised):
    """``add_inner`` (fused for a trace with weight and bias: the engine's on a
    GPU; else the protocol's default) adds what ``inner`` gives into ``out``,
    in place."""
    gen = torch.Generator().manual_seed(3)
    rule = LinearRule(nn.Linear(5, 4).to(DTYPE), *names)

    def side(n):
        factors = FactoredGradients(
            inputs=torch.randn(n, 5, generator=gen, dtype=DTYPE),
            deltas=torch.randn(n, 3, 4, generator=gen, dtype=DTYPE),
        )
        return Gradients(grads=rule.materialise(factors)) if materialised else factors

    left, right = side(7), side(6)
    start = torch.randn((7, 6) + mode.output_shape(3), generator=gen, dtype=DTYPE)
    out = start.clone()
    assert rule.add_inner(left, right, mode, out) is out
    torch.testing.assert_close(out, start + rule.inner(left, right, mode), rtol=1e-13, atol=1e-13)
    default = LayerRule.add_inner(rule, left, right, mode, start.clone())
    torch.testing.assert_close(out, default, rtol=1e-13, atol=1e-13)
