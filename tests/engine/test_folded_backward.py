"""The backward pass over K cotangents with K folded into the rows
(``_engine/_folded_backward.py``).

Reference: torch's autograd, one backward pass per cotangent (a Python loop of
``torch.autograd.grad``, no ``vmap``), on graphs made of the registered nodes:
two convolutions with a moved output at per-row ``t`` (the probe's), ReLU,
max-pools with overlapping and padded windows, slices of the logits and of the
log-softmax as roots, linear layers with and without bias, a broadcast operand, a
transposed and a strided, grouped convolution. Then the probe with the folded
route against the probe with ``is_grads_batched`` (its factors and a whole
decomposition, with the sum identity), and the graphs it must not fold.
"""


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel._engine import _probe
from sklearn_pathkernel._engine._folded_backward import FOLDED_VJPS, folded_grad
from sklearn_pathkernel._training import SolverSettings

DTYPE = torch.float64
K = 4


def _loop_reference(roots, inputs, grad_roots):
    """One autograd backward pass per cotangent, stacked: (K, *input.shape)."""
    per_k = []
    for k in range(grad_roots[0].shape[0]):
        grads = torch.autograd.grad(
            roots, inputs, [g[k] for g in grad_roots], allow_unused=True, retain_graph=True
        )
        per_k.append(grads)
    return [
        None if per_k[0][i] is None else torch.stack([grads[i] for grads in per_k])
        for i in range(len(inputs))
    ]


def _assert_close(found, expected):
    assert len(found) == len(expected)
    for a, b in zip(found, expected, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.shape == b.shape
        scale = b.abs().max()
        assert scale > 0
        assert (a - b).abs().max() <= 1e-14 * scale


def _two_conv_graph(n=5, seed=0):
    """The probe's graph of the 28x28 CNN, small: the first convolution's output
    a leaf, the second's moved output added at per-row ``t``, a linear head,
    log-softmax; roots: the first rows' logits and the other rows' outputs."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=DTYPE) * scale

    x = randn(n, 1, 12, 12)
    w1, w2, dw2 = randn(4, 1, 3, 3), randn(6, 4, 3, 3), randn(6, 4, 3, 3, scale=0.1)
    w3, b3, dw3 = randn(3, 6 * 2 * 2), randn(3), randn(3, 6 * 2 * 2, scale=0.1)
    t = torch.rand(n, generator=g, dtype=DTYPE)
    o1 = F.conv2d(x, w1).requires_grad_(True)  # (n, 4, 10, 10)
    h = F.max_pool2d(torch.relu(o1.clone()), 2)  # (n, 4, 5, 5)
    o2 = F.conv2d(h, w2) + t.view(-1, 1, 1, 1) * F.conv2d(h, dw2)  # (n, 6, 3, 3)
    h2 = F.max_pool2d(torch.relu(o2.clone()), 3, stride=1, padding=1)  # overlapping
    h2 = F.max_pool2d(h2, 2, ceil_mode=True).flatten(1)  # (n, 24)
    o3 = F.linear(h2, w3, b3) + t.view(-1, 1) * F.linear(h2, dw3)
    f = torch.log_softmax(o3, 1)
    first = 2
    cotangents = randn(K, first, 3)
    on_outputs = randn(K, n - first, 3)
    roots, grad_roots = [o3[:first], f[first:]], [cotangents, on_outputs]
    return roots, [o1, o2, o3], grad_roots


def test_two_conv_graph_matches_a_loop_of_backward_passes():
    roots, inputs, grad_roots = _two_conv_graph()
    found = folded_grad(roots, inputs, grad_roots)
    assert found is not None
    _assert_close(found, _loop_reference(roots, inputs, grad_roots))
    # and torch's own batched route
    batched = torch.autograd.grad(
        roots, inputs, grad_roots, allow_unused=True, is_grads_batched=True, retain_graph=True
    )
    _assert_close(found, list(batched))


def test_results_are_not_overwritten_by_later_nodes():
    """A wanted tensor whose gradient the walk then masks in place (a ReLU's
    output feeding a max-pool: the pool's gradient is the walk's own tensor)."""
    g = torch.Generator().manual_seed(1)
    o = torch.randn(3, 2, 6, 6, generator=g, dtype=DTYPE).requires_grad_(True)
    r = torch.relu(o * 1.0)
    pooled = F.max_pool2d(r, 2).flatten(1)
    out = pooled @ torch.randn(18, 5, generator=g, dtype=DTYPE)
    grad_roots = [torch.randn(K, 3, 5, generator=g, dtype=DTYPE)]
    found = folded_grad([out], [r, o], grad_roots)
    expected = _loop_reference([out], [r, o], grad_roots)
    _assert_close(found, expected)
    assert (found[0] != 0).sum() > (found[1] != 0).sum()  # r's gradient is not masked


@pytest.mark.parametrize("case", ["transposed", "strided_grouped", "broadcast", "mm"])
def test_other_registered_forms(case):
    g = torch.Generator().manual_seed(2)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=DTYPE)

    x = randn(3, 4, 7, 7).requires_grad_(True)
    if case == "transposed":
        out = F.conv_transpose2d(torch.relu(x * 1.0), randn(4, 2, 3, 3), stride=2)
    elif case == "strided_grouped":
        out = F.conv2d(x * 1.0, randn(6, 2, 3, 3), stride=2, padding=1, groups=2)
    elif case == "broadcast":
        bias = randn(1, 4, 1, 1).requires_grad_(True)
        out = torch.relu(x * 1.0 + bias)
        x = [x, bias]
    else:
        out = torch.mm(x.flatten(1), randn(4 * 7 * 7, 5))
    inputs = x if isinstance(x, list) else [x]
    grad_roots = [randn(K, *out.shape)]
    found = folded_grad([out], inputs, grad_roots)
    assert found is not None
    _assert_close(found, _loop_reference([out], inputs, grad_roots))


def test_unregistered_nodes_and_weight_gradients_are_not_folded():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, generator=g, dtype=DTYPE).requires_grad_(True)
    w = torch.randn(5, 2, generator=g, dtype=DTYPE).requires_grad_(True)
    grad_roots = [torch.randn(K, 3, 2, generator=g, dtype=DTYPE)]
    assert "TanhBackward0" not in FOLDED_VJPS
    assert folded_grad([torch.tanh(x) @ w.detach()], [x], grad_roots) is None
    # a weight's gradient: the product's rule gives the input's only
    assert folded_grad([x.detach() @ w], [w], grad_roots) is None
    # a node off the way to the wanted tensors does not matter
    out = (x * 1.0) @ w.detach() + torch.tanh(torch.ones(3, 2, dtype=DTYPE, requires_grad=True))
    found = folded_grad([out], [x], grad_roots)
    _assert_close(found, _loop_reference([out], [x], grad_roots))


def test_a_node_without_the_saved_tensors_a_rule_reads_is_not_folded(monkeypatch):
    """A torch whose nodes name their saved tensors otherwise: torch's own route
    (None), not an error, and the caller's cotangents untouched."""
    roots, inputs, grad_roots = _two_conv_graph()
    before = [g.clone() for g in grad_roots]
    rule = FOLDED_VJPS["MaxPool2DWithIndicesBackward0"]

    def renamed(node, grads, wanted, writable):
        return node._saved_indices_under_another_name

    monkeypatch.setattr(rule, "backward", renamed)
    assert folded_grad(roots, inputs, grad_roots) is None
    for g, b in zip(grad_roots, before, strict=True):
        assert torch.equal(g, b)


class _TwoConvCNN(nn.Module):
    """The 28x28 CNN's layers on 10x10 images: conv, ReLU, max-pool, conv, ReLU,
    max-pool, linear (functional ReLU and max-pool, as a user writes them)."""

    def __init__(self, n_classes=3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3)
        self.conv2 = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 1 * 1, n_classes)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x.view(-1, 1, 10, 10))), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def _cnn_engine(engine_cases, solver="adam"):
    torch.manual_seed(0)
    module = _TwoConvCNN()
    settings = SolverSettings(solver="adamw", weight_decay=0.01) if solver == "adam" else None
    kwargs = {} if settings is None else {"solver": settings}
    module, path, X, y = engine_cases.trained(
        module, n=24, n_features=100, steps=4, lr=0.01 if settings else 0.1, batch_size=8, **kwargs
    )
    return engine_cases.engine_for(module, path, X, y), path, X


class _Calls(list):
    """Per folded call, whether it folded (the list) and its layer shortcuts."""


def _counting(monkeypatch):
    """Counts the probe's folded passes (those ``folded_grad`` did not decline)."""
    folded = _Calls()

    def counted(*args):
        result = folded_grad(*args)
        folded.append(result is not None)
        shortcuts.append(len(args[3]) if len(args) > 3 else 0)
        return result

    shortcuts = []
    folded.shortcuts = shortcuts

    monkeypatch.setattr(_probe, "folded_grad", counted)
    return folded


@pytest.mark.parametrize("with_cotangents", [False, True])
def test_probe_factors_equal_the_batched_route(engine_cases, monkeypatch, with_cotangents):
    """The probe's factors of rows at per-row points of a step, every output (or
    the classifiers' cotangents at the logits), folded and by ``is_grads_batched``."""
    _, path, X = _cnn_engine(engine_cases)
    probe = _probe.NetworkProbe(_TwoConvCNN().to(DTYPE), path, X[:1])
    start, direction = path.weights[1], path.step_direction(1)
    t = torch.linspace(0.1, 0.9, 6, dtype=DTYPE)
    g = torch.Generator().manual_seed(4)
    cotangents = torch.randn(6, 3, 3, generator=g, dtype=DTYPE) if with_cotangents else None
    found, folded = {}, _counting(monkeypatch)
    for flag in (True, False):
        monkeypatch.setattr(_probe.NetworkProbe, "folded_backward", flag)
        found[flag] = probe.output_and_factors(
            start, X[:6], direction=direction, t=t, cotangents=cotangents
        )
    assert folded == [True]  # (the batched route's call did not ask)
    assert folded.shortcuts == [1]  # the second convolution (the first one's output is a leaf)
    torch.testing.assert_close(found[True][0], found[False][0], rtol=0, atol=0)
    compared = 0
    for folded, batched in zip(found[True][1], found[False][1], strict=True):
        for name, value in engine_cases.factor_tensors(batched).items():
            other = engine_cases.factor_tensors(folded)[name]
            assert other.shape == value.shape
            if value.is_floating_point() and value.abs().max() > 0:
                assert (other - value).abs().max() <= 1e-14 * value.abs().max()
                compared += 1
    assert compared >= 3  # (the three layers' cotangents, at least)


def test_decomposition_equals_the_batched_route(engine_cases, monkeypatch):
    """A whole decomposition (AdamW, mini-batches) with both routes: the
    contributions to 1e-13 of their scale, the sum identity to 1e-12."""
    engine, _, X = _cnn_engine(engine_cases)
    A = X[-3:] + 0.1
    found, folded = {}, _counting(monkeypatch)
    for flag in (True, False):
        monkeypatch.setattr(_probe.NetworkProbe, "folded_backward", flag)
        found[flag] = engine.decompose(A)
        if flag:
            assert folded and all(folded)
    folded, batched = found[True], found[False]
    scale = np.abs(batched.contributions).max()
    assert scale > 0
    assert np.abs(folded.contributions - batched.contributions).max() <= 1e-13 * scale
    np.testing.assert_array_equal(folded.output, batched.output)
    total = folded.bias + folded.contributions.sum(1) + folded.decay
    assert np.abs(total - folded.output).max() <= 1e-12 * max(1.0, np.abs(folded.output).max())
