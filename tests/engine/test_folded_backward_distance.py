"""The folded backward pass (``_engine/_folded_backward.py``) through the image
distance networks' nodes: ``MinPool2d`` (a max-pool between two negations), the
transforms' clamps, ``log1p`` and ``sqrt``, the dense distance layer at its own
weights (``AffineInput``, the rule's closed form) and at the rows' own weights (a
``LayerShortcut`` by ``DistanceRule.input_vjp``).

Reference: torch's autograd, one backward pass per cotangent (a Python loop of
``torch.autograd.grad``); then the probe, Grams and a decomposition of
``DistanceKernelClassifier(image_shape=...)`` with the folded route against the
probe with ``is_grads_batched``. The min-pool's winners (``PooledCotangent``,
``pooled``): at full resolution the walk's own gradient exactly, and the
convolutional layer's per-example gradients from them against plain autograd of
the network, one backward pass per row and output.
"""

import numpy as np
import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call

from sklearn_pathkernel import DistanceLayer
from sklearn_pathkernel._engine import _probe
from sklearn_pathkernel._engine._folded_backward import (
    FOLDED_VJPS,
    LayerShortcut,
    folded_grad,
)
from sklearn_pathkernel._engine.rules._distance import DistanceConv2dRule, DistanceRule
from sklearn_pathkernel._engine.rules._distance._backward import AFFINE_KERNELS, own_output
from sklearn_pathkernel._engine.rules._protocol import PooledCotangent, RowWeights
from sklearn_pathkernel._nn._distance import Transform
from sklearn_pathkernel._nn._distance_conv import MinPool2d

DTYPE = torch.float64
K = 4


def _loop_reference(roots, inputs, grad_roots):
    """One autograd backward pass per cotangent, stacked: (K, *input.shape)."""
    per_k = [
        torch.autograd.grad(
            roots, inputs, [g[k] for g in grad_roots], allow_unused=True, retain_graph=True
        )
        for k in range(grad_roots[0].shape[0])
    ]
    return [
        None if per_k[0][i] is None else torch.stack([grads[i] for grads in per_k])
        for i in range(len(inputs))
    ]


def _assert_close(found, expected, tolerance=1e-14):
    assert found is not None
    assert len(found) == len(expected)
    for a, b in zip(found, expected, strict=True):
        assert a.shape == b.shape
        scale = b.abs().max()
        assert scale > 0
        assert (a - b).abs().max() <= tolerance * scale


def _memory_layer(kernel, width, n_memories, generator):
    """A dense distance layer with a bias and (rbf) widths, parameters constant."""
    layer = DistanceLayer(width, n_memories, kernel, dtype=DTYPE)
    with torch.no_grad():
        layer.memories.copy_(torch.rand(n_memories, width, generator=generator, dtype=DTYPE))
        layer.bias.copy_(torch.randn(n_memories, generator=generator, dtype=DTYPE))
        if layer.log_gamma is not None:
            layer.log_gamma.copy_(0.3 * torch.randn(n_memories, generator=generator, dtype=DTYPE))
    return layer.requires_grad_(False)


def _image_graph(kernel, transform, n=5, seed=0):
    """The probe's graph of the image network at one point (the training rows of a
    Gram): the convolutional layer's output a leaf, its min-pool and transform,
    the dense layer by its rule's own output, ``log1p``, a linear head,
    log-softmax; roots: the first rows' logits and the other rows' outputs. The
    leaf has tied windows and values exactly 0 (the clamp's bound)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.rand(n, 3, 4, 4, generator=g, dtype=DTYPE)
    z[0, 0, :2, :2] = 0.25  # a tie: the pool's saved winner decides
    z[1, 1, :2, :2] = 0.0  # clamp(min=0) at its bound
    z[2, 2] = -z[2, 2]  # negative values: the clamp cuts them
    z = z.requires_grad_(True)
    pooled = Transform(transform)(MinPool2d(2)(z.clone())).flatten(1)  # (n, 12)
    layer = _memory_layer(kernel, 12, 6, g)
    dense = own_output(layer, pooled)
    head = nn.Linear(6, 3, dtype=DTYPE).requires_grad_(False)
    logits = head(Transform("log1p")(dense.clone()))
    f = torch.log_softmax(logits, 1)
    first = 2
    grad_roots = [
        torch.randn(K, first, 3, generator=g, dtype=DTYPE),
        torch.randn(K, n - first, 3, generator=g, dtype=DTYPE),
    ]
    return [logits[:first], f[first:]], [z, dense], grad_roots


@pytest.mark.parametrize("transform", ["log1p", "sqrt", "none"])
@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_image_graph_at_one_point_matches_a_loop_of_backward_passes(kernel, transform):
    roots, inputs, grad_roots = _image_graph(kernel, transform)
    names = {type(node).__name__ for node in _nodes(roots)}
    assert {"NegBackward0", "AffineInputBackwardBackward"} <= names
    before = [g.clone() for g in grad_roots]
    found = folded_grad(roots, inputs, grad_roots)
    _assert_close(found, _loop_reference(roots, inputs, grad_roots))
    batched = torch.autograd.grad(
        roots, inputs, grad_roots, allow_unused=True, is_grads_batched=True, retain_graph=True
    )
    _assert_close(found, list(batched))
    for g, b in zip(grad_roots, before, strict=True):  # (the rules' in-place steps)
        assert torch.equal(g, b)


def _nodes(roots):
    seen, stack = set(), [root.grad_fn for root in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return seen


@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_a_min_pools_input_gets_the_winners_where_asked(kernel):
    """``pooled``: the convolutional layer's output (a leaf behind ``MinPool2d``'s
    negations and a clone) gets a :class:`PooledCotangent`: at full resolution the
    walk's gradient without ``pooled`` exactly (the pool's own backward pass:
    the winners' values are the pooled output's cotangents, negated twice), a
    loop of torch's backward passes to rounding; the other input as before."""
    roots, inputs, grad_roots = _image_graph(kernel, "log1p")
    before = [g.clone() for g in grad_roots]
    found = folded_grad(roots, inputs, grad_roots, pooled=[0])
    assert isinstance(found[0], PooledCotangent)
    dense = found[0].dense().transpose(0, 1)  # (n, K, ...) -> (K, n, ...)
    unpooled = folded_grad(roots, inputs, grad_roots)
    assert torch.equal(dense, unpooled[0]) and torch.equal(found[1], unpooled[1])
    _assert_close([dense, found[1]], _loop_reference(roots, inputs, grad_roots))
    for g, b in zip(grad_roots, before, strict=True):
        assert torch.equal(g, b)


@pytest.mark.parametrize(
    "graph",
    ["relu_after_the_pool", "input_used_twice", "unbatched_pool", "overlapping_windows"],
)
def test_a_pooled_gradient_meets_other_nodes_at_full_resolution(graph):
    """Where the pool's gradient meets a node that is not pointwise (a ReLU, as in
    a CNN), another gradient of the same tensor, or a pool of an unbatched input,
    the walk forms it at full resolution: torch's numbers (overlapping windows
    add), with or without ``pooled`` asked for."""
    g = torch.Generator().manual_seed(8)
    z = torch.randn(
        *((2,) if graph == "unbatched_pool" else (3, 2)), 5, 6, generator=g, dtype=DTYPE
    )
    z[..., :2, :2] = 0.5  # (a tie)
    z = z.requires_grad_(True)
    if graph == "relu_after_the_pool":
        out = MinPool2d(2)(torch.relu(z * 2.0))
    elif graph == "input_used_twice":
        out = MinPool2d(2)(z.clone()) + z[..., ::2, ::2][..., :2, :3]
    elif graph == "unbatched_pool":  # (C, H, W)
        out = nn.functional.max_pool2d(-z, 2)
    else:
        out = nn.functional.max_pool2d(-z, 3, stride=1, padding=1)
    grad_roots = [torch.randn(K, *out.shape, generator=g, dtype=DTYPE)]
    reference = _loop_reference([out], [z], grad_roots)
    for pooled in ((), (0,)):
        (found,) = folded_grad([out], [z], grad_roots, pooled=pooled)
        if isinstance(found, PooledCotangent):  # (a pool's input, its gradient alone)
            assert graph == "overlapping_windows" and pooled
            found = found.dense().transpose(0, 1)
        tolerance = 1e-15 if graph == "overlapping_windows" else 0.0  # (windows add)
        _assert_close([found], reference, tolerance)


@pytest.mark.parametrize(
    "op",
    [
        lambda a: torch.clamp(a, min=0.0),
        lambda a: torch.clamp(a, min=-0.25, max=0.5),
        lambda a: torch.clamp(a, max=0.5),
        lambda a: torch.clamp_min(a, 0.0),
        lambda a: torch.sqrt(torch.clamp(a, min=torch.finfo(DTYPE).tiny)),
        lambda a: torch.log1p(torch.clamp(a, min=0.0)),
        lambda a: -a,
    ],
    ids=["clamp_min", "clamp_both", "clamp_max", "clamp_min_op", "sqrt", "log1p", "neg"],
)
@pytest.mark.parametrize("owned", [False, True], ids=["callers_cotangent", "walks_own"])
def test_elementwise_nodes_match_a_loop(op, owned):
    """Each new node, on the caller's cotangents (not overwritten) and on a
    gradient the walk owns (overwritten in place), with values on the bounds."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 8, generator=g, dtype=DTYPE)
    a[0, :4] = torch.tensor([0.0, -0.25, 0.5, -0.0], dtype=DTYPE)
    a = a.requires_grad_(True)
    out = op(a * 2.0 if owned else a)  # (a product: the walk's own gradient below)
    if owned:
        out = out * torch.linspace(0.5, 1.5, 8, dtype=DTYPE)
    grad_roots = [torch.randn(K, 3, 8, generator=g, dtype=DTYPE)]
    before = grad_roots[0].clone()
    found = folded_grad([out], [a], grad_roots)
    _assert_close(found, _loop_reference([out], [a], grad_roots), tolerance=0.0)
    assert torch.equal(grad_roots[0], before)


def test_the_distance_nodes_are_registered():
    for name in ("NegBackward0", "ClampBackward1", "ClampMinBackward0", "Log1PBackward0"):
        assert name in FOLDED_VJPS
    assert "AffineInputBackwardBackward" in FOLDED_VJPS


def _moving_weights(rule, layer, t, generator):
    names = rule.names
    params = {names["memories"]: layer.memories.detach(), names["bias"]: layer.bias.detach()}
    if layer.log_gamma is not None:
        params[names["log_gamma"]] = layer.log_gamma.detach()
    steps = {
        name: 0.1 * torch.randn(value.shape, generator=generator, dtype=DTYPE)
        for name, value in params.items()
    }
    return RowWeights(params, steps, t)


@pytest.mark.parametrize("at_start", ["one", "none", "all"])
@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_rows_at_their_own_weights_through_the_layer_shortcut(kernel, at_start):
    """The dense layer evaluated by ``output_at`` (rows at ``w + t_i dw``; one, none
    or all of them at ``t = 0``, row 1 on a memory), passed through whole by its
    rule's ``input_vjp``: the same gradients as torch's through ``output_at``."""
    g = torch.Generator().manual_seed(6)
    n, width, n_memories = 6, 5, 4
    layer = _memory_layer(kernel, width, n_memories, g)
    local = ["memories", "bias"] + (["log_gamma"] if layer.log_gamma is not None else [])
    rule = DistanceRule(layer, {name: f"dense.{name}" for name in local})
    t = torch.rand(n, generator=g, dtype=DTYPE)
    t[1] = 0.0 if at_start == "one" else t[1]
    t = torch.zeros_like(t) if at_start == "all" else t
    weights = _moving_weights(rule, layer, t, g)
    a = torch.rand(n, width, generator=g, dtype=DTYPE)
    a[1] = layer.memories[2] / 1.5  # (x = 1.5 a sits on memory 2 at t = 0)
    a = a.requires_grad_(True)
    x = a * 1.5
    out = rule.output_at((x,), weights)
    scale = torch.rand(n, n_memories, generator=g, dtype=DTYPE)
    logits = (out * scale) @ torch.randn(n_memories, 3, generator=g, dtype=DTYPE)
    grad_roots = [torch.randn(K, n, 3, generator=g, dtype=DTYPE)]
    vjp = rule.input_vjp((x,), weights)
    assert vjp is not None
    shortcut = LayerShortcut(out, get_gradient_edge(x), vjp)
    found = folded_grad([logits], [a, out], grad_roots, [shortcut])
    _assert_close(found, _loop_reference([logits], [a, out], grad_roots))
    assert torch.isfinite(found[0]).all()


def test_cosine_rows_keep_torchs_backward():
    layer = DistanceLayer(5, 4, "cosine", dtype=DTYPE).requires_grad_(False)
    rule = DistanceRule(layer, {"memories": "m", "bias": "b"})
    t = torch.rand(3, dtype=DTYPE)
    weights = _moving_weights(rule, layer, t, torch.Generator().manual_seed(7))
    x = torch.rand(3, 5, dtype=DTYPE)
    assert rule.input_vjp((x,), weights) is None
    assert rule.input_vjp((x,), RowWeights(weights.params)) is None  # (not moving)


# -- the probe and the engine ----------------------------------------------------------


def _counting(monkeypatch):
    """Per folded call: whether it folded, and its layer shortcuts."""
    calls = []

    def counted(roots, inputs, grad_roots, shortcuts=(), pooled=()):
        result = folded_grad(roots, inputs, grad_roots, shortcuts, pooled)
        calls.append((result is not None, len(shortcuts)))
        return result

    monkeypatch.setattr(_probe, "folded_grad", counted)
    return calls


def _both_routes(monkeypatch, compute):
    found, calls = {}, _counting(monkeypatch)
    for flag in (True, False):
        monkeypatch.setattr(_probe.NetworkProbe, "folded_backward", flag)
        found[flag] = compute()
    return found[True], found[False], calls


def _recording_deltas(monkeypatch):
    """The kinds of cotangents the convolutional distance rule gets."""
    kinds, factors = [], DistanceConv2dRule.factors

    def recorded(self, inputs, delta, weights):
        kinds.append(type(delta).__name__)
        return factors(self, inputs, delta, weights)

    monkeypatch.setattr(DistanceConv2dRule, "factors", recorded)
    return kinds


@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
@pytest.mark.parametrize("moving", [False, True], ids=["step_start", "own_weights"])
def test_the_image_networks_factors_equal_autograd_of_the_network(
    kernel, moving, monkeypatch, engine_cases
):
    """Every output of rows at a step's start (the training rows of a Gram) or at
    their own points of the step (query nodes): the convolutional layer's
    per-example gradients from the min-pool's winners (the rule gets a
    ``PooledCotangent``) against plain autograd of the network at each row's
    weights, one backward pass per row and output."""
    clf, X, _ = engine_cases.image_distance_classifier(6, 1, kernel=kernel)
    engine = clf.kernel_.engine
    probe, kinds = engine.probe, _recording_deltas(monkeypatch)
    start, direction = engine._steps.weights(1), engine._steps.weights(2) - engine._steps.weights(1)
    rows = engine.X_train
    t = torch.linspace(0.0, 1.0, rows.shape[0], dtype=DTYPE) if moving else None
    if moving:
        found = probe.factors(start, rows, direction=direction, t=t)[0].grads
    else:
        found = probe.factors(start, rows)[0].grads  # (n, K, W_conv)
    assert kinds == ["PooledCotangent"]
    names = probe.rules[0].path_names
    expected = torch.empty_like(found)
    for i in range(rows.shape[0]):
        at = start if t is None else start + t[i] * direction
        params = probe.params(at.clone())
        theta = {name: params[name].clone().requires_grad_(True) for name in names}
        logits = functional_call(probe.module, {**params, **theta}, (rows[i : i + 1],))
        f = torch.log_softmax(logits, 1)[0]
        for k in range(f.shape[0]):
            grads = torch.autograd.grad(f[k], [theta[name] for name in names], retain_graph=True)
            expected[i, k] = torch.cat([grad.reshape(-1) for grad in grads])
    _assert_close([found], [expected], tolerance=1e-12)


@pytest.mark.parametrize("with_cotangents", [False, True])
def test_nodes_with_training_rows_that_keep_their_class(with_cotangents, monkeypatch, engine_cases):
    """``factors_with``: query nodes at their own points (every output, or ``K``
    cotangents at the logits) and training rows at the step's start keeping
    their class (the winners' values of those rows picked per row): the folded
    route with the min-pool's winners equals torch's ``is_grads_batched`` route."""
    clf, X, Q = engine_cases.image_distance_classifier(8, 4)
    engine = clf.kernel_.engine
    probe, kinds = engine.probe, _recording_deltas(monkeypatch)
    start, direction = engine._steps.weights(1), engine._steps.weights(2) - engine._steps.weights(1)
    nodes = torch.tensor(Q)
    t = torch.linspace(0.1, 0.9, nodes.shape[0], dtype=DTYPE)
    classes = torch.arange(engine.X_train.shape[0]) % engine.n_outputs
    generator = torch.Generator().manual_seed(9)
    shape = (nodes.shape[0], engine.n_outputs, engine.n_outputs)
    cotangents = torch.randn(*shape, generator=generator, dtype=DTYPE) if with_cotangents else None
    found = {}
    for flag in (True, False):
        monkeypatch.setattr(_probe.NetworkProbe, "folded_backward", flag)
        kinds.clear()
        found[flag] = probe.factors_with(
            start, nodes, engine.X_train, classes, direction=direction, t=t,
            cotangents=cotangents,
        )  # fmt: skip
        assert kinds == (["PooledCotangent"] * 2 if flag else ["Tensor"] * 2)
    for folded, batched in zip(found[True], found[False], strict=True):
        _assert_close([folded[0].grads], [batched[0].grads])


@pytest.mark.parametrize("kernel", AFFINE_KERNELS)
def test_grams_equal_the_batched_route(kernel, monkeypatch, engine_cases):
    """The training Gram (rows at the steps' starts: the rule's own output) and the
    cross Gram (query nodes at their own ``t`` with the training rows: the
    shortcut) of an image network, folded and by ``is_grads_batched``."""
    clf, X, Q = engine_cases.image_distance_classifier(18, 2, kernel=kernel)
    engine = clf.kernel_.engine
    X_train = engine.X_train
    A = torch.tensor(Q)
    kinds = _recording_deltas(monkeypatch)
    for compute in (
        lambda: engine.gram(X_train, a_train=True, output="full"),
        lambda: engine.gram(A, X_train, b_train=True, output="full"),
    ):
        folded, batched, calls = _both_routes(monkeypatch, compute)
        assert calls and all(ok for ok, _ in calls)
        assert "PooledCotangent" in kinds  # (the folded route: the min-pool's winners)
        kinds.clear()
        folded, batched = np.asarray(folded), np.asarray(batched)
        scale = np.abs(batched).max()
        assert scale > 0
        assert np.abs(folded - batched).max() <= 1e-14 * scale
    assert any(n_shortcuts for _, n_shortcuts in calls)  # (the cross Gram's query nodes)


def test_decomposition_equals_the_batched_route(monkeypatch, engine_cases):
    clf, _, Q = engine_cases.image_distance_classifier(18, 2, kernel="sqeuclidean")
    engine = clf.kernel_.engine
    A = torch.tensor(Q)
    folded, batched, calls = _both_routes(monkeypatch, lambda: engine.decompose(A))
    scale = np.abs(batched.contributions).max()
    assert np.abs(folded.contributions - batched.contributions).max() <= 1e-14 * scale
    np.testing.assert_array_equal(folded.output, batched.output)
    total = folded.bias + folded.contributions.sum(1) + folded.decay
    assert np.abs(total - folded.output).max() <= 1e-12 * max(1.0, np.abs(folded.output).max())
    # the certificate: rounding-level on both routes (its digits are rounding)
    assert calls and all(ok for ok, _ in calls)
    assert np.abs(folded.quadrature_error - batched.quadrature_error).max() <= 1e-14
    assert folded.quadrature_error.max() <= 1e-12
