"""DistanceLayer: values against the formulas, gradients, vectorisation, initialisation."""

import math

import numpy as np
import pytest
import torch
from torch.func import grad, vmap

from sklearn_pathkernel import DistanceLayer
from sklearn_pathkernel._nn._distance import KERNELS, Transform, init_memories

DT = torch.float64


def brute_force(layer, x):
    """The layer's output by a Python loop over examples and memories (numpy, float64)."""
    X = x.detach().numpy()
    M = layer.memories.detach().numpy()
    gamma = None if layer.log_gamma is None else np.exp(layer.log_gamma.detach().numpy())
    out = np.empty((X.shape[0], M.shape[0]))
    for i, xi in enumerate(X):
        for j, mj in enumerate(M):
            msd = ((xi - mj) ** 2).mean()  # the seed's formula
            if layer.kernel == "sqeuclidean":
                value = msd
            elif layer.kernel == "euclidean":
                value = math.sqrt(msd)
            elif layer.kernel == "rbf":
                value = math.exp(-gamma[j] * msd)
            elif layer.kernel == "laplacian":
                value = math.exp(-gamma[j] * np.abs(xi - mj).mean())
            else:
                nx, nm = max(np.linalg.norm(xi), 1e-12), max(np.linalg.norm(mj), 1e-12)
                value = xi @ mj / (nx * nm)
            out[i, j] = value
    if layer.bias is not None:
        out = out + layer.bias.detach().numpy()
    return out


def make_layer(kernel, in_features=4, n_memories=3, seed=0, **kwargs):
    torch.manual_seed(seed)
    layer = DistanceLayer(in_features, n_memories, kernel, dtype=DT, **kwargs)
    with torch.no_grad():  # non-trivial bias and widths
        if layer.bias is not None:
            layer.bias.normal_()
        if layer.log_gamma is not None:
            layer.log_gamma.normal_(0.0, 0.5)
    return layer


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [True, False])
def test_values_equal_the_formula(kernel, bias):
    layer = make_layer(kernel, bias=bias)
    x = torch.randn(7, 4, dtype=DT)
    x[0] = 0.0  # zero vector: cosine 0, distances to the memories
    x[1] = layer.memories.detach()[2]  # a point on a memory: distance exactly 0
    out = layer(x)
    assert out.shape == (7, 3) and out.dtype == DT
    np.testing.assert_allclose(out.detach().numpy(), brute_force(layer, x), rtol=1e-13, atol=1e-14)


def test_distance_to_own_memory_is_exactly_zero_and_gradient_finite():
    layer = make_layer("euclidean", bias=False)
    x = layer.memories.detach()[:2].clone().requires_grad_(True)
    for kernel in ("sqeuclidean", "euclidean"):
        layer.kernel = kernel
        out = layer(x)
        assert out[0, 0].item() == 0.0 and out[1, 1].item() == 0.0
        grads = torch.autograd.grad(out.sum(), [x, layer.memories])
        assert all(torch.isfinite(g).all() for g in grads)


def test_no_cancellation_near_the_memories():
    # Data far from the origin, memories within 1e-6 of the data: the expansion
    # |x|^2 - 2 x.m + |m|^2 would keep no correct digit (absolute error ~1e-14).
    torch.manual_seed(1)
    layer = DistanceLayer(10, 5, "sqeuclidean", bias=False, dtype=DT)
    x = 100.0 + torch.randn(20, 10, dtype=DT)
    with torch.no_grad():
        layer.memories.copy_(x[:5] + 1e-6 * torch.randn(5, 10, dtype=DT))
    exact = brute_force(layer, x)
    out = layer(x).detach().numpy()
    np.testing.assert_allclose(out, exact, rtol=1e-12, atol=0)
    expansion = ((x * x).sum(1, keepdim=True) - 2 * x @ layer.memories.T).detach() + (
        layer.memories.detach() ** 2
    ).sum(1)
    near = (expansion.numpy() / 10)[:5, :5].diagonal()
    assert np.abs(near - exact[:5, :5].diagonal()).max() > 1e-3 * exact[:5, :5].diagonal().max()


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradcheck(kernel):
    layer = make_layer(kernel, in_features=3, n_memories=2)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    params = [p for p in layer.parameters()]
    names = [n for n, _ in layer.named_parameters()]

    def run(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values, strict=True)), (x,))

    assert torch.autograd.gradcheck(
        run, (x, *[p.detach().clone().requires_grad_() for p in params])
    )


@pytest.mark.parametrize("kind", ["none", "sqrt", "log1p", "standardize"])
def test_transform_values_and_gradcheck(kind):
    z = torch.rand(5, 4, dtype=DT) * 3 + 0.1
    out = Transform(kind)(z).numpy()
    Z = z.numpy()
    expected = {
        "none": Z,
        "sqrt": np.sqrt(Z),
        "log1p": np.log1p(Z),
        "standardize": (Z - Z.mean(1, keepdims=True)) / np.sqrt(Z.var(1, keepdims=True) + 1e-8),
    }[kind]
    np.testing.assert_allclose(out, expected, rtol=1e-13)
    assert torch.autograd.gradcheck(Transform(kind), (z.clone().requires_grad_(),))


def test_transforms_finite_at_zero():
    z = torch.zeros(2, 3, dtype=DT, requires_grad=True)
    for kind in ("sqrt", "log1p", "standardize"):
        (g,) = torch.autograd.grad(Transform(kind)(z).sum(), z)
        assert torch.isfinite(g).all(), kind


@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_equals_loop_over_examples(kernel):
    # Vectorised forward == one example at a time: outputs depend on their own row only.
    layer = make_layer(kernel, in_features=5, n_memories=4)
    x = torch.randn(9, 5, dtype=DT)
    batched = layer(x)
    looped = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    torch.testing.assert_close(batched, looped, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("kernel", KERNELS)
def test_per_example_gradients_by_vmap_match_a_loop(kernel):
    # The path-kernel engine takes per-example gradients with torch.func.
    layer = make_layer(kernel, in_features=3, n_memories=2)
    x = torch.randn(5, 3, dtype=DT)
    params = {n: p.detach() for n, p in layer.named_parameters()}

    def first_output(params, row):
        return torch.func.functional_call(layer, params, (row[None],))[0].sum()

    batched = vmap(grad(first_output), in_dims=(None, 0))(params, x)
    for i in range(5):
        single = grad(first_output)(params, x[i])
        for name in params:
            torch.testing.assert_close(batched[name][i], single[name], rtol=1e-13, atol=1e-15)


def test_uniform_init_range_and_learnable_width():
    torch.manual_seed(0)
    layer = DistanceLayer(16, 50, "rbf", gamma=0.5, dtype=DT)
    assert layer.memories.abs().max() <= 1 / 4
    assert torch.allclose(layer.log_gamma.exp(), torch.full((50,), 0.5, dtype=DT))
    assert {n for n, _ in layer.named_parameters()} == {"memories", "bias", "log_gamma"}
    assert DistanceLayer(3, 2).log_gamma is None


@pytest.mark.parametrize("method", ["samples", "kmeans++"])
def test_data_init_takes_distinct_training_rows(method):
    X = torch.randn(30, 4, dtype=DT)
    torch.manual_seed(0)
    layer = init_memories(DistanceLayer(4, 10, dtype=DT), X, method)
    rows = [int(torch.nonzero((X == m).all(1)).squeeze()) for m in layer.memories.detach()]
    assert len(set(rows)) == 10
    torch.manual_seed(0)
    again = init_memories(DistanceLayer(4, 10, dtype=DT), X, method)
    assert torch.equal(layer.memories, again.memories)


def test_kmeans_plusplus_spreads_over_clusters():
    # Three tight clusters far apart: k-means++ with 3 memories takes one from each.
    centres = torch.tensor([[0.0, 0.0], [50.0, 0.0], [0.0, 50.0]], dtype=DT)
    X = (centres[:, None, :] + 0.01 * torch.randn(3, 20, 2, dtype=DT)).reshape(60, 2)
    for seed in range(5):
        torch.manual_seed(seed)
        layer = init_memories(DistanceLayer(2, 3, dtype=DT), X, "kmeans++")
        nearest = torch.cdist(layer.memories.detach(), centres).argmin(1)
        assert sorted(nearest.tolist()) == [0, 1, 2]


def test_more_memories_than_samples_keeps_uniform_extras():
    X = 10.0 + torch.randn(3, 2, dtype=DT)
    torch.manual_seed(0)
    layer = init_memories(DistanceLayer(2, 8, dtype=DT), X, "samples")
    assert sorted(map(tuple, layer.memories[:3].tolist())) == sorted(map(tuple, X.tolist()))
    assert layer.memories[3:].abs().max() <= 1 / math.sqrt(2)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="Unknown kernel 'manhattan'"):
        DistanceLayer(3, 2, "manhattan")
    with pytest.raises(ValueError, match="n_memories"):
        DistanceLayer(3, 0)
    with pytest.raises(ValueError, match=r"shape \(n, 3\), got \(4, 2\)"):
        DistanceLayer(3, 2)(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="Unknown init"):
        init_memories(DistanceLayer(3, 2), torch.zeros(4, 3), "pca")
    with pytest.raises(ValueError, match="Unknown transform"):
        Transform("cbrt")
