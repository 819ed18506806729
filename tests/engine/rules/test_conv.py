"""Conv2d rule: factored and materialised forms against each other and brute force.

The factored form (column Gram times back-propagated Gram over pairs of output
positions) is chosen for layers with many channels on few positions; both forms
must give the same inner products, directional derivatives and kernels as the
materialised Jacobians of the reference engine.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _reference import NaivePathKernelEngine
from torch import nn

from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine.rules._conv import Conv2dRule
from sklearn_pathkernel._engine.rules._gradients import FactoredGradients, Gradients
from sklearn_pathkernel._engine.rules._protocol import RowWeights
from sklearn_pathkernel._training._loop import train_module

DTYPE = torch.float64


def conv_case(seed=0, weight=True, bias=True, **conv_kwargs):
    torch.manual_seed(seed)
    conv = nn.Conv2d(3, 5, 3, **conv_kwargs).to(DTYPE)
    rule = Conv2dRule(conv, "weight" if weight else None, "bias" if bias else None)
    x_left = torch.randn(4, 3, 5, 5, dtype=DTYPE)
    x_right = torch.randn(6, 3, 5, 5, dtype=DTYPE)
    out_shape = conv(x_left).shape[1:]
    delta_left = torch.randn(4, 2, *out_shape, dtype=DTYPE)
    delta_right = torch.randn(6, 2, *out_shape, dtype=DTYPE)
    return rule, (x_left,), delta_left, (x_right,), delta_right


def both_forms(rule, inputs, delta, monkeypatch):
    """The factors of one batch, factored and materialised."""
    monkeypatch.setattr(Conv2dRule, "factored_is_cheaper", staticmethod(lambda *a: True))
    factored = rule.factors(inputs, delta, RowWeights({}))
    monkeypatch.setattr(Conv2dRule, "factored_is_cheaper", staticmethod(lambda *a: False))
    materialised = rule.factors(inputs, delta, RowWeights({}))
    assert isinstance(factored, FactoredGradients) and isinstance(materialised, Gradients)
    return factored, materialised


def brute_force_grads(rule, inputs, delta):
    """Per-example, per-output gradients by autograd, one row and output at a time."""
    conv, rows = rule.module, []
    for i in range(inputs[0].shape[0]):
        per_output = []
        for k in range(delta.shape[1]):
            params = [
                p
                for name, p in (("weight", conv.weight), ("bias", conv.bias))
                if getattr(rule, f"{name}_name") is not None
            ]
            out = conv(inputs[0][i : i + 1])
            grads = torch.autograd.grad((out * delta[i, k]).sum(), params)
            per_output.append(torch.cat([g.reshape(-1) for g in grads]))
        rows.append(torch.stack(per_output))
    return torch.stack(rows)  # (n, K, W) in the order (weight, bias)


@pytest.mark.parametrize(
    "weight, bias, conv_kwargs",
    [
        (True, True, {}),
        (True, False, {"padding": 1}),
        (False, True, {"stride": 2}),
        (True, True, {"dilation": 2, "padding": 2, "stride": (1, 2)}),
    ],
    ids=["weight+bias", "weight-padding", "bias-stride", "dilation-stride"],
)
def test_factored_and_materialised_forms_agree_with_autograd(
    weight, bias, conv_kwargs, monkeypatch
):
    rule, in_l, d_l, in_r, d_r = conv_case(weight=weight, bias=bias, **conv_kwargs)
    fac_l, mat_l = both_forms(rule, in_l, d_l, monkeypatch)
    fac_r, mat_r = both_forms(rule, in_r, d_r, monkeypatch)
    g_l, g_r = brute_force_grads(rule, in_l, d_l), brute_force_grads(rule, in_r, d_r)
    expected = {
        "trace": torch.einsum("nkw,mkw->nm", g_l, g_r),
        "pairs": torch.einsum("nkw,mjw->nmkj", g_l, g_r),
    }
    for mode, value in expected.items():
        for left, right in ((fac_l, fac_r), (mat_l, mat_r), (fac_l, mat_r), (mat_l, fac_r)):
            torch.testing.assert_close(rule.inner(left, right, mode), value, rtol=1e-12, atol=0)
    diag = torch.einsum("nkw,nkw->n", g_l, g_l)
    for factors in (fac_l, mat_l):
        torch.testing.assert_close(rule.inner(factors, factors, "diag"), diag, rtol=1e-12, atol=0)

    conv = rule.module
    direction = {"weight": torch.randn_like(conv.weight), "bias": torch.randn_like(conv.bias)}
    step = torch.cat(
        [direction[n].reshape(-1) for n in ("weight", "bias") if getattr(rule, f"{n}_name")]
    )
    for factors in (fac_l, mat_l):
        torch.testing.assert_close(
            rule.directional(factors, direction), g_l @ step, rtol=1e-12, atol=1e-13
        )


def test_cost_model_prefers_factored_for_many_channels_on_few_positions():
    assert Conv2dRule.factored_is_cheaper(n_positions=4, d_in=577, d_out=128)
    assert not Conv2dRule.factored_is_cheaper(n_positions=64, d_in=10, d_out=8)


class DeepCNN(nn.Module):
    """conv(1->4) on 6x6, max-pool to 3x3, conv(4->8, 3x3) to 1x1: its last
    convolution (P=1, d_in=37, d_out=8) takes the factored form."""

    def __init__(self, n_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.head = nn.Linear(8, n_classes)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x.view(-1, 1, 6, 6))), 2)
        return self.head(torch.tanh(self.conv2(x)).flatten(1))


@pytest.fixture(scope="module")
def cnn_case():
    rng = np.random.RandomState(0)
    y = rng.randint(0, 3, 24)
    X = torch.tensor(rng.randn(3, 36)[y] + rng.randn(24, 36))
    torch.manual_seed(0)
    module = DeepCNN(3).to(DTYPE)
    path = train_module(module, X, torch.tensor(y), learning_rate=0.3, max_iter=4).path
    return module, path, X, torch.tensor(y)


def test_cnn_kernels_with_a_factored_layer_match_the_reference(cnn_case):
    module, path, X, y = cnn_case
    engine = PathKernelEngine(module, path, X, quadrature="riemann", n_points=3)
    kinds = [type(rule).__name__ for rule in engine.probe.rules]
    assert kinds == ["Conv2dRule", "Conv2dRule", "LinearRule"]
    factors = engine.probe.factors(path.weights[0], X[:2])
    assert isinstance(factors[0], Gradients) and isinstance(factors[1], FactoredGradients)
    reference = NaivePathKernelEngine(module, path, X, quadrature="riemann", n_points=3)
    A = torch.cat([X[:4], torch.tensor(np.random.RandomState(1).randn(3, 36))])
    mask = np.arange(7) < 4
    for output in ("trace", "full"):
        np.testing.assert_allclose(
            engine.gram(A, a_train=mask, output=output),
            reference.gram(A, a_train=mask, output=output),
            rtol=1e-10,
            atol=1e-12,
        )
    np.testing.assert_allclose(
        engine.decompose(A[4:]).contributions,
        reference.decompose(A[4:]).contributions,
        rtol=1e-10,
        atol=1e-12,
    )


def test_cnn_sum_identity_with_a_factored_layer(cnn_case):
    module, path, X, y = cnn_case
    A = torch.tensor(np.random.RandomState(2).randn(4, 36))
    parts = PathKernelEngine(module, path, X).decompose(A)
    with torch.no_grad():
        network = F.log_softmax(module(A), 1).numpy()
    assert np.abs(parts.bias + parts.contributions.sum(1) - network).max() < 1e-9
    assert parts.quadrature_error.max() < 1e-9


def test_conv_gradients_sum_a_first_layers_nodes_before_forming_them():
    """``ConvGradients``: the row sums of nodes with the same columns (a first
    convolution) keep the columns and sum the cotangents; with different columns
    the gradients are formed; both equal the sums of the formed gradients, and the
    directional derivative needs no gradient formed."""
    from sklearn_pathkernel._engine.rules._conv import ConvGradients
    from sklearn_pathkernel._engine.rules._rows import row_sums

    torch.manual_seed(0)
    columns = torch.randn(3, 10, 16, dtype=torch.float64)
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    deltas = torch.randn(6, 4, 5, 16, dtype=torch.float64)
    weights = torch.rand(6, dtype=torch.float64)
    same = ConvGradients(columns[rows], deltas)
    moved = ConvGradients(columns[rows] + torch.randn(6, 10, 16, dtype=torch.float64), deltas)
    for factors, kept in ((same, ConvGradients), (moved, Gradients)):
        expected = row_sums(rows, weights, factors.grads, 3)
        summed = factors.row_sums(rows, weights, 3)
        assert type(summed) is kept and isinstance(summed, Gradients)
        torch.testing.assert_close(summed.grads, expected, rtol=1e-13, atol=1e-13)
    step = torch.randn(5 * 10, dtype=torch.float64)
    fresh = ConvGradients(columns[rows], deltas)
    torch.testing.assert_close(fresh.directional(step), same.grads @ step, rtol=1e-13, atol=1e-13)
    assert "grads" not in vars(fresh)


def _conv_chunks(moving, rows_per_chunk, seed=0):
    """Node chunks of ConvGradients over 4 rows: each row's columns fixed
    (``moving`` False) or different at every node, and the formed gradients of
    all nodes joined (the reference sums)."""
    from sklearn_pathkernel._engine._features import NodeChunk
    from sklearn_pathkernel._engine.rules._conv import ConvGradients

    generator = torch.Generator().manual_seed(seed)
    row_columns = torch.randn(4, 10, 16, dtype=torch.float64, generator=generator)
    chunks = []
    for rows in rows_per_chunk:
        rows = torch.tensor(rows, dtype=torch.long)
        columns = row_columns[rows].clone()
        if moving:
            columns += torch.randn(columns.shape, dtype=torch.float64, generator=generator)
        deltas = torch.randn(rows.numel(), 3, 5, 16, dtype=torch.float64, generator=generator)
        weights = torch.rand(rows.numel(), dtype=torch.float64, generator=generator)
        chunks.append(NodeChunk(rows, weights, ConvGradients(columns, deltas)))
    return chunks


@pytest.mark.parametrize("moving", [False, True])
@pytest.mark.parametrize(
    "rows_per_chunk",
    [
        [[0, 0, 1], [1, 2, 2, 2]],  # sorted, a row across two chunks, row 3 without nodes
        [[2, 0, 2], [1, 0]],  # unsorted: the scatter route
        [[], [0, 1, 1, 3]],  # an empty chunk
    ],
)
def test_conv_integrate_chunks_equals_the_joined_sums(moving, rows_per_chunk):
    """``Conv2dRule.integrate_chunks`` sums each chunk's nodes without joining
    them; the result equals the row sums of all nodes' formed gradients (an
    independent einsum and scatter), keeps the columns of a first convolution
    (``ConvGradients``) and forms the gradients otherwise."""
    from sklearn_pathkernel._engine.rules._conv import ConvGradients
    from sklearn_pathkernel._engine.rules._rows import row_sums

    chunks = _conv_chunks(moving, rows_per_chunk)
    rows = torch.cat([c.rows for c in chunks])
    weights = torch.cat([c.weights for c in chunks])
    columns = torch.cat([c.factors.columns for c in chunks])
    deltas = torch.cat([c.factors.deltas for c in chunks])
    formed = torch.einsum("nkop,nip->nkoi", deltas, columns).flatten(2)
    expected = row_sums(rows, weights, formed, 4)
    rule = Conv2dRule(torch.nn.Conv2d(2, 5, 3), "w", "b")
    summed = rule.integrate_chunks(chunks, 4)
    assert type(summed) is (Gradients if moving else ConvGradients)
    torch.testing.assert_close(summed.grads, expected, rtol=1e-13, atol=1e-13)


def test_conv_integrate_chunks_rows_with_other_columns_in_another_chunk():
    """A row whose columns differ between two chunks (not a first layer) is not
    taken for fixed columns: the gradients are formed, and equal the joined sums."""
    from sklearn_pathkernel._engine._features import NodeChunk
    from sklearn_pathkernel._engine.rules._conv import ConvGradients
    from sklearn_pathkernel._engine.rules._rows import row_sums

    chunks = _conv_chunks(False, [[0, 1], [1, 1]])
    first = chunks[1].factors
    chunks[1] = NodeChunk(
        chunks[1].rows, chunks[1].weights, ConvGradients(first.columns + 1.0, first.deltas)
    )
    rule = Conv2dRule(torch.nn.Conv2d(2, 5, 3), "w", "b")
    summed = rule.integrate_chunks(chunks, 2)
    assert type(summed) is Gradients
    expected = sum(row_sums(c.rows, c.weights, c.factors.grads, 2) for c in chunks)
    torch.testing.assert_close(summed.grads, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("moving", [False, True])
def test_conv_integrate_chunks_in_float32(moving):
    """A float32 run's factors and node weights: the sums stay float32 and equal
    ``row_sums`` of the formed gradients."""
    from sklearn_pathkernel._engine._features import NodeChunk
    from sklearn_pathkernel._engine.rules._conv import ConvGradients
    from sklearn_pathkernel._engine.rules._rows import row_sums

    chunks = [
        NodeChunk(rows, weights.float(), ConvGradients(f.columns.float(), f.deltas.float()))
        for rows, weights, f in _conv_chunks(moving, [[0, 0, 1], [1, 2]])
    ]
    rule = Conv2dRule(torch.nn.Conv2d(2, 5, 3), "w", "b")
    summed = rule.integrate_chunks(chunks, 3)
    expected = sum(row_sums(c.rows, c.weights, c.factors.grads, 3) for c in chunks)
    assert summed.grads.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(summed.grads, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "weight, bias, conv_kwargs",
    [
        (True, True, {}),
        (True, False, {"stride": 2, "padding": 1}),
        (False, True, {"dilation": 2, "padding": 2}),
    ],
)
def test_input_vjp_at_per_row_weights_matches_autograd_per_cotangent(weight, bias, conv_kwargs):
    """``input_vjp``: the input's cotangents through the convolution at each row's
    own kernel ``W + t_i dW``, all K at once, against autograd through the
    probe's form (output at ``W`` plus ``t_i`` times the moved output), one
    backward pass per cotangent."""
    rule, (x,), _, _, _ = conv_case(weight=weight, bias=bias, **conv_kwargs)
    conv = rule.module
    g = torch.Generator().manual_seed(5)
    params = {"weight": conv.weight.detach(), "bias": conv.bias.detach()}
    steps = {name: torch.randn(p.shape, generator=g, dtype=DTYPE) for name, p in params.items()}
    t = torch.tensor([0.0, 0.3, 0.7, 1.0], dtype=DTYPE)
    weights = RowWeights(params, steps, t)
    x = x.clone().requires_grad_(True)
    moved = rule.moved_output((x,), steps)
    output = conv(x) + t.view(-1, 1, 1, 1) * moved
    cotangents = torch.randn(3, *output.shape, generator=g, dtype=DTYPE)
    expected = torch.stack(
        [torch.autograd.grad(output, x, c, retain_graph=True)[0] for c in cotangents]
    )
    found = rule.input_vjp((x.detach(),), weights)(cotangents)
    assert found.shape == expected.shape
    assert (found - expected).abs().max() <= 1e-14 * expected.abs().max()
    # rows at one point: no per-row form (the layer's own backward does)
    assert rule.input_vjp((x.detach(),), RowWeights(params)) is None


@pytest.mark.parametrize(
    "weight, bias, conv_kwargs",
    [
        (True, True, {}),
        (True, False, {"stride": 2, "padding": 1}),
        (False, True, {"dilation": 2, "padding": 2}),
    ],
)
def test_row_output_matches_one_convolution_per_row(weight, bias, conv_kwargs):
    """``row_output``: the output with each row at its own kernel ``W + t_i dW``
    (bias ``b + t_i db``), one grouped convolution, against one ``F.conv2d`` per
    row at its own weights; rows at ``t = 0`` are the layer's own values bit for
    bit; the input's gradient equals autograd through the probe's other form
    (output at ``W`` plus ``t_i`` times the moved output)."""
    rule, (x,), _, _, _ = conv_case(weight=weight, bias=bias, **conv_kwargs)
    conv = rule.module
    g = torch.Generator().manual_seed(6)
    params = {"weight": conv.weight.detach(), "bias": conv.bias.detach()}
    steps = {name: torch.randn(p.shape, generator=g, dtype=DTYPE) for name, p in params.items()}
    t = torch.tensor([0.0, 0.3, 0.7, 1.0], dtype=DTYPE)
    weights = RowWeights(params, steps, t)
    x = x.clone().requires_grad_(True)
    found = rule.row_output((x,), weights)
    expected = []
    for i in range(x.shape[0]):
        kernel = params["weight"] + (t[i] * steps["weight"] if weight else 0.0)
        offset = params["bias"] + (t[i] * steps["bias"] if bias else 0.0)
        expected.append(
            F.conv2d(x[i : i + 1], kernel, offset, conv.stride, conv.padding, conv.dilation)
        )
    expected = torch.cat(expected)
    assert found.shape == expected.shape
    assert (found - expected).abs().max() <= 1e-14 * expected.abs().max()
    assert torch.equal(found[0], conv(x[:1])[0])  # t = 0: the layer's own values
    # the input's gradient: autograd through both forms
    moved = rule.moved_output((x,), steps)
    other = conv(x) + t.view(-1, 1, 1, 1) * moved
    assert (found - other).abs().max() <= 1e-14 * other.abs().max()
    cotangent = torch.randn(other.shape, generator=g, dtype=DTYPE)
    (grad_found,) = torch.autograd.grad(found, x, cotangent)
    (grad_other,) = torch.autograd.grad(other, x, cotangent)
    assert (grad_found - grad_other).abs().max() <= 1e-14 * grad_other.abs().max()
    # every row moving: no row kept apart
    inner = RowWeights(params, steps, t[1:])
    assert torch.equal(rule.row_output((x[1:].detach(),), inner), found[1:].detach())
    # rows at one point, or all at the start: the layer's own forward does
    assert rule.row_output((x.detach(),), RowWeights(params)) is None
    assert rule.row_output((x.detach(),), RowWeights(params, steps, torch.zeros(4))) is None
