"""DistanceConv2dRule: closed-form per-example gradients against per-sample Jacobians,
and the engine's kernels and sum identity through networks with the layer.

References: per-sample Jacobians of the layer by ``torch.func.jacrev`` (independent
of the rule's formulas), and the brute-force path kernel of ``tests/_reference.py``.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _reference import NaivePathKernelEngine
from torch import nn
from torch.autograd.functional import jacobian
from torch.func import functional_call

from sklearn_pathkernel import DistanceConv2d
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine.rules import make_rule
from sklearn_pathkernel._engine.rules._distance import DistanceConv2dRule
from sklearn_pathkernel._engine.rules._protocol import PooledCotangent, RowWeights
from sklearn_pathkernel._nn._distance import KERNELS
from sklearn_pathkernel._nn._distance_conv import MinPool2d
from sklearn_pathkernel._training import SolverSettings
from sklearn_pathkernel._training._loop import train_module

DT = torch.float64
GEOMETRIES = {
    "plain": {"kernel_size": 3},
    "strided-padded": {"kernel_size": (2, 3), "stride": (2, 1), "padding": 1},
}


def make_layer(kernel, geometry="plain", bias=True, seed=0):
    torch.manual_seed(seed)
    layer = DistanceConv2d(2, 3, kernel=kernel, bias=bias, dtype=DT, **GEOMETRIES[geometry])
    with torch.no_grad():
        if layer.bias is not None:
            layer.bias.normal_()
        if layer.log_gamma is not None:
            layer.log_gamma.normal_(0.0, 0.3)
        layer.memories.mul_(3.0)
    return layer


def rows_and_cotangents(layer, n=4, n_outputs=2, seed=1):
    """Images with a patch equal to a memory (distance 0 there), and cotangents."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 5, 6, dtype=DT, generator=generator)
    kh, kw = layer.kernel_size
    ph, pw = layer.padding
    with torch.no_grad():  # the patch at (row 1, col 1) of the padded image 0
        x[0, :, 1 - ph : 1 - ph + kh, 1 - pw : 1 - pw + kw] = layer.memory_images[1]
    out_shape = layer(x).shape[1:]
    delta = torch.randn(n, n_outputs, *out_shape, dtype=DT, generator=generator)
    return x, delta


def jacobian_grads(layer, local, x, delta):
    """Per example and output, ``d (delta_k . layer(x_i)) / d theta`` from the per-sample
    Jacobian of the layer's output, (n, K, W) in ``local`` order.

    ``torch.autograd.functional.jacobian`` without vectorisation: one backward pass per
    output entry (``jacrev``'s vmap has a wrong batching rule for ``cdist``)."""
    values = tuple(getattr(layer, name).detach() for name in local)

    def output(row, *theta):
        return functional_call(layer, dict(zip(local, theta, strict=True)), (row[None],))[0]

    rows = []
    for i in range(x.shape[0]):
        jac = jacobian(lambda *theta, row=x[i]: output(row, *theta), values)
        per_name = [
            torch.einsum("kjhw,jhw...->k...", delta[i], part).reshape(delta.shape[1], -1)
            for part in jac
        ]
        rows.append(torch.cat(per_name, 1))
    return torch.stack(rows)


def assert_close(actual, expected, rtol=1e-12):
    scale = expected.abs().max()
    error = (actual - expected).abs().max() / scale
    assert error <= rtol, error.item()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_equal_per_sample_jacobians(kernel, geometry, bias):
    layer = make_layer(kernel, geometry, bias)
    local = [name for name, _ in layer.named_parameters()]
    x, delta = rows_and_cotangents(layer)
    rule = make_rule(layer, "", set(local))
    assert isinstance(rule, DistanceConv2dRule)
    params = {name: getattr(layer, name).detach() for name in local}
    grads = rule.factors((x,), delta, RowWeights(params)).grads
    assert_close(grads, jacobian_grads(layer, local, x, delta))


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradients_of_cotangents_laid_out_output_first(kernel):
    """The probe's batched backward pass hands cotangents (n, K, ...) as a view of
    (K, n, ...) memory, which the rule reads in place: the same gradients as the
    per-sample Jacobians'."""
    layer = make_layer(kernel)
    local = [name for name, _ in layer.named_parameters()]
    x, delta = rows_and_cotangents(layer, n_outputs=3)
    output_first = delta.transpose(0, 1).contiguous().transpose(0, 1)
    assert not output_first.is_contiguous() and torch.equal(output_first, delta)
    rule = make_rule(layer, "", set(local))
    params = {name: getattr(layer, name).detach() for name in local}
    grads = rule.factors((x,), output_first, RowWeights(params)).grads
    assert_close(grads, jacobian_grads(layer, local, x, delta))


@pytest.mark.parametrize("kernel", ["rbf", "cosine"])
def test_parameters_outside_the_path_are_constants(kernel):
    layer = make_layer(kernel)
    x, delta = rows_and_cotangents(layer)
    rule = make_rule(layer, "c.", {"c.memories"})
    assert rule.path_names == ["c.memories"]
    grads = rule.factors((x,), delta, RowWeights({"c.memories": layer.memories.detach()})).grads
    assert_close(grads, jacobian_grads(layer, ["memories"], x, delta))


def test_gradients_at_the_given_weights_not_the_modules():
    layer = make_layer("euclidean")
    x, delta = rows_and_cotangents(layer)
    moved = {"memories": layer.memories.detach() + 0.5, "bias": layer.bias.detach()}
    rule = make_rule(layer, "", set(moved))
    grads = rule.factors((x,), delta, RowWeights(moved)).grads
    with torch.no_grad():
        layer.memories.add_(0.5)
    assert_close(grads, jacobian_grads(layer, ["memories", "bias"], x, delta))


def test_inner_and_directional_are_those_of_the_gradients():
    layer = make_layer("sqeuclidean")
    x, delta = rows_and_cotangents(layer)
    local = ["memories", "bias"]
    rule = make_rule(layer, "", set(local))
    params = {name: getattr(layer, name).detach() for name in local}
    factors = rule.factors((x,), delta, RowWeights(params))
    g = jacobian_grads(layer, local, x, delta)
    assert_close(rule.inner(factors, factors, "pairs"), torch.einsum("nkw,mlw->nmkl", g, g))
    direction = {name: torch.randn_like(value) for name, value in params.items()}
    flat = torch.cat([direction[name].reshape(-1) for name in local])
    assert_close(rule.directional(factors, direction), g @ flat)


def moving_weights(layer, local, n, seed=3):
    """A step ``dw`` of every parameter in ``local`` and a point ``t_i`` per row."""
    generator = torch.Generator().manual_seed(seed)
    params = {name: getattr(layer, name).detach() for name in local}
    steps = {
        name: 0.3 * torch.randn(value.shape, dtype=DT, generator=generator)
        for name, value in params.items()
    }
    t = torch.rand(n, dtype=DT, generator=generator)
    t[0] = 0.0
    return RowWeights(params, steps, t)


def moved_layer(layer, weights, row):
    """A copy of ``layer`` at row ``row``'s weights ``params + t_row steps``."""
    moved = DistanceConv2d(
        layer.in_channels,
        layer.n_memories,
        layer.kernel_size,
        layer.stride,
        layer.padding,
        layer.kernel,
        bias=layer.bias is not None,
        dtype=DT,
    )
    moved.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for name, value in weights.params.items():
            getattr(moved, name).copy_(value + weights.t[row] * weights.steps[name])
    return moved


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_rows_at_their_own_weights(kernel, geometry):
    """``output_at`` and the factors of moving rows: each row's patches meet its own
    memories ``m + t_i dm`` (the layer itself at those weights, and its Jacobians)."""
    layer = make_layer(kernel, geometry)
    local = [name for name, _ in layer.named_parameters()]
    x, delta = rows_and_cotangents(layer)
    weights = moving_weights(layer, local, x.shape[0])
    rule = make_rule(layer, "", set(local))
    assert rule.row_evaluation.value == "output_at"
    out = rule.output_at((x,), weights)
    grads = rule.factors((x,), delta, weights).grads
    for row in range(x.shape[0]):
        moved = moved_layer(layer, weights, row)
        with torch.no_grad():
            assert_close(out[row], moved(x[row : row + 1])[0])
        expected = jacobian_grads(moved, local, x[row : row + 1], delta[row : row + 1])
        assert_close(grads[row : row + 1], expected)


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_at_the_step_start_get_the_layers_own_values(kernel):
    """Bit for bit (a pool over positions must pick training's winners, ties
    included): rows at ``t = 0`` among moving rows, on pixels of a 1/16 grid with
    memories on that grid too, where distinct patches tie exactly."""
    layer = make_layer(kernel)
    with torch.no_grad():
        layer.memories.copy_(torch.round(16 * layer.memories) / 16)
    local = [name for name, _ in layer.named_parameters()]
    x = torch.randint(0, 17, (4, 2, 5, 6)).to(DT) / 16
    weights = moving_weights(layer, local, x.shape[0])
    weights.t[2] = 0.0
    rule = make_rule(layer, "", set(local))
    out = rule.output_at((x,), weights)
    with torch.no_grad():
        own = layer(x)
    for row in (0, 2):
        assert torch.equal(out[row], own[row])


#: Pools after the layer: (the pool, its winners' flat indices).
POOLS = {
    "min_pool": (MinPool2d(2), lambda out: F.max_pool2d_with_indices(-out, 2)[1]),
    "overlapping_max_pool": (  # (a position can win several windows: their terms add)
        lambda out: F.max_pool2d(out, 3, stride=1, padding=1),
        lambda out: F.max_pool2d_with_indices(out, 3, stride=1, padding=1)[1],
    ),
}


def pool_cotangents(pool, out, n_outputs=3, seed=4):
    """Cotangents of ``pool(out)`` (n, K, J, H', W'), and those of ``out`` by torch's
    own backward pass of the pool (one pass per output), (n, K, J, H, W)."""
    generator = torch.Generator().manual_seed(seed)
    out = out.detach().requires_grad_(True)
    pooled = pool(out)
    g = torch.randn(out.shape[0], n_outputs, *pooled.shape[1:], dtype=DT, generator=generator)
    dense = torch.stack(
        [torch.autograd.grad(pooled, out, g[:, k], retain_graph=True)[0] for k in range(n_outputs)],
        1,
    )
    return g, dense


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("moving", [False, True], ids=["one_point", "own_weights"])
@pytest.mark.parametrize("pool", list(POOLS))
def test_a_pools_winners_give_the_gradients_of_its_backward_pass(kernel, moving, pool):
    """The cotangents of a pool after the layer as its windows' winners
    (:class:`PooledCotangent`, what the folded backward pass gives): the per-example
    gradients of the pool's own full-resolution cotangents (torch's backward pass
    of the pool, then per-sample Jacobians of the layer at each row's weights),
    with tied windows (pixels and memories on a 1/16 grid); ``MinPool2d(2)`` drops
    the last row of positions (3 rows, windows of 2), the overlapping max-pool
    puts several windows' terms on one position."""
    layer = make_layer(kernel)
    with torch.no_grad():
        layer.memories.copy_(torch.round(16 * layer.memories) / 16)
    local = [name for name, _ in layer.named_parameters()]
    x = torch.randint(0, 17, (4, 2, 5, 6)).to(DT) / 16
    rule = make_rule(layer, "", set(local))
    if moving:
        weights = moving_weights(layer, local, x.shape[0])
    else:
        weights = RowWeights({name: getattr(layer, name).detach() for name in local})
    out = rule.output_at((x,), weights)
    forward, winners = POOLS[pool]
    g, dense = pool_cotangents(forward, out)
    pooled = PooledCotangent(g, winners(out), tuple(out.shape[2:]))
    if pool == "min_pool":
        assert (dense == 0).sum() >= 3 * dense.numel() // 4  # (a quarter at most: the winners)
        assert torch.equal(pooled.dense(), dense)  # the pool's own backward pass
    else:
        assert_close(pooled.dense(), dense, rtol=1e-15)  # (the windows' terms added)
    found = rule.factors((x,), pooled, weights).grads
    expected = rule.factors((x,), dense, weights).grads
    assert_close(found, expected, rtol=1e-15)
    for row in range(x.shape[0]):
        at = moved_layer(layer, weights, row) if moving else layer
        reference = jacobian_grads(at, local, x[row : row + 1], dense[row : row + 1])
        assert_close(found[row : row + 1], reference)


def test_output_at_is_differentiable_in_the_input():
    layer = make_layer("rbf")
    local = [name for name, _ in layer.named_parameters()]
    x, _ = rows_and_cotangents(layer)
    weights = moving_weights(layer, local, x.shape[0])
    rule = make_rule(layer, "", set(local))
    x = x.requires_grad_(True)
    (grad,) = torch.autograd.grad(rule.output_at((x,), weights).square().sum(), x)
    moved = moved_layer(layer, weights, 2)
    row = x[2:3].detach().requires_grad_(True)
    (expected,) = torch.autograd.grad(moved(row).square().sum(), row)
    assert_close(grad[2:3], expected)


class ConvDistanceNet(nn.Module):
    """DistanceConv2d(1 -> 3 memories, 3x3, padding 1) on 5x5 images, log1p(z^2) (tanh for
    cosine), then a linear head."""

    def __init__(self, kernel, n_classes):
        super().__init__()
        self.conv = DistanceConv2d(1, 3, 3, padding=1, kernel=kernel, dtype=DT)
        self.head = nn.Linear(3 * 5 * 5, n_classes, dtype=DT)

    def forward(self, x):
        z = self.conv(x.view(-1, 1, 5, 5))
        # Smooth transforms (no kinks but the layer's own): log1p(z^2), tanh for cosine.
        z = torch.tanh(z) if self.conv.kernel == "cosine" else torch.log1p(z.square())
        return self.head(z.flatten(1))


def network_case(kernel, solver, batch_size, seed=0):
    rng = np.random.RandomState(seed)
    y = rng.randint(0, 3, 18)
    X = torch.tensor(rng.randn(3, 25)[y] + rng.randn(18, 25))
    torch.manual_seed(seed)
    module = ConvDistanceNet(kernel, 3)
    path = train_module(
        module,
        X,
        torch.tensor(y),
        solver=SolverSettings(solver),
        learning_rate=0.05,
        max_iter=3,
        batch_size=batch_size,
        random_state=0,
    ).path
    return module, path, X


@pytest.mark.parametrize("kernel", ["sqeuclidean", "rbf", "cosine"])
def test_engine_kernels_match_the_brute_force_reference(kernel):
    module, path, X = network_case(kernel, "sgd", None)
    engine = PathKernelEngine(module, path, X, quadrature="riemann", n_points=3)
    assert [type(rule).__name__ for rule in engine.probe.rules] == [
        "DistanceConv2dRule",
        "LinearRule",
    ]
    reference = NaivePathKernelEngine(module, path, X, quadrature="riemann", n_points=3)
    A = torch.cat([X[:3], torch.tensor(np.random.RandomState(1).randn(2, 25))])
    mask = np.arange(5) < 3
    for output in ("trace", "full"):
        np.testing.assert_allclose(
            engine.gram(A, a_train=mask, output=output),
            reference.gram(A, a_train=mask, output=output),
            rtol=1e-10,
            atol=1e-12,
        )
    np.testing.assert_allclose(
        engine.decompose(A[3:]).contributions,
        reference.decompose(A[3:]).contributions,
        rtol=1e-10,
        atol=1e-12,
    )


SMOOTH_KERNELS = ("sqeuclidean", "euclidean", "rbf", "cosine")
SOLVERS = [("sgd", None), ("adam", None), ("adam", 6), ("sgd", 6)]
# The laplacian's |u_d - m_d| switch at every (position, memory, pixel): 0.1 s with
# every row of a pass at its own t, 25 s with one pass per distinct t (57855f5).
CASES = [(k, s, b) for k in SMOOTH_KERNELS for s, b in SOLVERS] + [("laplacian", "sgd", None)]


@pytest.mark.parametrize(("kernel", "solver", "batch_size"), CASES)
def test_sum_identity(kernel, solver, batch_size):
    module, path, X = network_case(kernel, solver, batch_size)
    A = torch.tensor(np.random.RandomState(2).randn(3, 25))
    parts = PathKernelEngine(module, path, X).decompose(A)
    with torch.no_grad():
        network = F.log_softmax(module(A), 1).numpy()
    assert np.abs(parts.bias + parts.contributions.sum(1) - network).max() < 1e-9
