"""The distance layer at its own weights with a closed-form backward pass (``_backward``).

References: the layer's own forward (values bit for bit), torch's autograd through
it (``torch.cdist``'s backward pass, batched over cotangents), the probe with the
layer's own forward in place, and the brute-force path kernel of
``tests/_reference.py`` through a network whose distance layer is not the first.
"""

import numpy as np
import pytest
import torch
from _reference import NaivePathKernelEngine
from torch import nn

from sklearn_pathkernel import DistanceConv2d, DistanceLayer
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine.rules._distance import DistanceRule
from sklearn_pathkernel._engine.rules._distance._backward import AFFINE_KERNELS, own_output
from sklearn_pathkernel._nn._distance import KERNELS
from sklearn_pathkernel._training import SolverSettings
from sklearn_pathkernel._training._loop import train_module

DT = torch.float64
N, D, J, K = 6, 5, 4, 3


def constant_layer(kernel, bias=True, seed=0):
    """A layer with non-trivial bias and widths, its parameters constants (no grad)."""
    torch.manual_seed(seed)
    layer = DistanceLayer(D, J, kernel, bias=bias, dtype=DT)
    with torch.no_grad():
        if layer.bias is not None:
            layer.bias.normal_()
        if layer.log_gamma is not None:
            layer.log_gamma.normal_(0.0, 0.5)
    return layer.requires_grad_(False)


def rows(layer, seed=1):
    """Inputs with a row on a memory (zero distance), requiring grad."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, dtype=DT, generator=generator)
    x[1] = layer.memories.detach()[2]
    return x.requires_grad_(True)


def batched_input_grads(forward, x, cotangents):
    """``d <cotangent_k, forward(x)> / d x`` for every k at once (K, N, D), through
    ``log1p(z^2)`` so that the cotangents reaching the layer depend on its values."""
    out = torch.log1p(forward(x).square())
    (grads,) = torch.autograd.grad(out, x, cotangents, is_grads_batched=True)
    return grads


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_values_are_the_layers_own_bit_for_bit(kernel, bias):
    layer = constant_layer(kernel, bias)
    x = rows(layer)
    assert torch.equal(own_output(layer, x), layer(x))


@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_batched_input_gradients_are_torchs(kernel):
    layer = constant_layer(kernel)
    x = rows(layer)
    cotangents = torch.randn(K, N, J, dtype=DT, generator=torch.Generator().manual_seed(2))
    actual = batched_input_grads(lambda v: own_output(layer, v), x, cotangents)
    expected = batched_input_grads(layer, x, cotangents)
    assert actual.shape == (K, N, D)
    scale = expected.abs().max()
    assert (actual - expected).abs().max() <= 1e-14 * scale
    # the row on a memory: no gradient from that memory (the layer's convention at
    # distance 0 for euclidean), the other memories' as torch's
    assert torch.isfinite(actual).all()


@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_single_cotangent_gradients_are_torchs(kernel):
    layer = constant_layer(kernel)
    x = rows(layer)
    g = torch.randn(N, J, dtype=DT, generator=torch.Generator().manual_seed(3))
    (actual,) = torch.autograd.grad(own_output(layer, x), x, g)
    (expected,) = torch.autograd.grad(layer(x), x, g)
    assert (actual - expected).abs().max() <= 1e-14 * expected.abs().max()


def test_the_layers_own_forward_where_the_parameters_take_gradients():
    """A gradient to the parameters is never dropped: the layer's own forward."""
    layer = constant_layer("sqeuclidean").requires_grad_(True)
    x = rows(layer)
    out = own_output(layer, x)
    assert out.grad_fn is not None and "Affine" not in type(out.grad_fn).__name__
    (memories_grad,) = torch.autograd.grad(out.sum(), layer.memories)
    (expected,) = torch.autograd.grad(layer(x).sum(), layer.memories)
    assert torch.equal(memories_grad, expected)


def test_no_gradient_taken_the_layers_own_forward():
    layer = constant_layer("rbf")
    x = rows(layer)
    with torch.no_grad():
        assert torch.equal(own_output(layer, x), layer(x))
    assert torch.equal(own_output(layer, x.detach()), layer(x.detach()))


def test_only_the_affine_kernels_replace_the_forward():
    for kernel in KERNELS:
        if kernel == "laplacian":  # (no factored rule: the generic one)
            continue
        layer = DistanceLayer(D, J, kernel, dtype=DT)
        rule = DistanceRule(layer, {"memories": "m"})
        assert rule.replaces_own_forward == (kernel in AFFINE_KERNELS)
    with pytest.raises(ValueError, match="cosine"):
        own_output(constant_layer("cosine"), rows(constant_layer("cosine")))


class ConvThenDistance(nn.Module):
    """DistanceConv2d on 4x4 images, log1p, a DistanceLayer (not the first layer),
    log1p, a linear head: the image network's shape."""

    def __init__(self, kernel):
        super().__init__()
        self.conv = DistanceConv2d(1, 2, 3, padding=1, dtype=DT)
        self.dense = DistanceLayer(2 * 16, 5, kernel, dtype=DT)
        self.head = nn.Linear(5, 3, dtype=DT)

    def forward(self, x):
        z = torch.log1p(self.conv(x.view(-1, 1, 4, 4)).flatten(1))
        return self.head(torch.log1p(self.dense(z).square()))


def network_case(kernel, solver):
    rng = np.random.RandomState(0)
    y = rng.randint(0, 3, 12)
    X = torch.tensor(rng.rand(3, 16)[y] + 0.3 * rng.rand(12, 16))
    torch.manual_seed(0)
    module = ConvThenDistance(kernel)
    path = train_module(
        module,
        X,
        torch.tensor(y),
        solver=SolverSettings(solver),
        learning_rate=0.05,
        max_iter=3,
        batch_size=None,
        random_state=0,
    ).path
    return module, path, X


@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_probe_factors_equal_those_of_the_layers_own_backward(kernel, monkeypatch):
    """Every output's factors at one point of the path (the training rows of a
    Gram), with the rule's backward and with torch's through the layer's own."""
    module, path, X = network_case(kernel, "sgd")
    engine = PathKernelEngine(module, path, X)
    probe = engine.probe
    start = path.weights[1]
    actual = probe.factors(start, X)
    # (the class's forward: the probe replaced the instance's)
    monkeypatch.setattr(
        DistanceRule,
        "own_output",
        lambda self, inputs: type(self.module).forward(self.module, *inputs),
    )
    expected = probe.factors(start, X)
    for rule, a, b in zip(probe.rules, actual, expected, strict=True):
        ga, gb = rule.materialise(a), rule.materialise(b)
        assert (ga - gb).abs().max() <= 1e-13 * gb.abs().max(), type(rule).__name__


@pytest.mark.parametrize("solver", ["sgd", "adam"])
@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_grams_match_the_brute_force_reference(kernel, solver):
    """The training Gram (every row's factors at the steps' starts, by the rule's
    backward pass) and the cross Gram."""
    module, path, X = network_case(kernel, solver)
    engine = PathKernelEngine(module, path, X, quadrature="riemann", n_points=3)
    assert any(rule.replaces_own_forward for rule in engine.probe.rules)
    reference = NaivePathKernelEngine(module, path, X, quadrature="riemann", n_points=3)
    np.testing.assert_allclose(
        engine.gram(X, a_train=True, output="full"),
        reference.gram(X, a_train=True, output="full"),
        rtol=1e-10,
        atol=1e-12,
    )
    A = torch.tensor(np.random.RandomState(1).rand(2, 16))
    np.testing.assert_allclose(
        engine.gram(A, X, b_train=True, output="full"),
        reference.gram(A, X, b_train=True, output="full"),
        rtol=1e-10,
        atol=1e-12,
    )
