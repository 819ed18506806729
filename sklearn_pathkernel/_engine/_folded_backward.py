"""A backward pass over ``K`` cotangents at once, with ``K`` folded into the rows.

The probe back-propagates every output of a row (``K`` cotangents per row) to the
captured layer outputs. ``torch.autograd.grad(..., is_grads_batched=True)`` runs
that under ``vmap``: on the CPU the convolution's and the max-pool's backward of
a ``vmap``-batched gradient cost more than a Python loop over the ``K``
cotangents (28x28 two-convolution CNN: 28 ms against 25 ms for 9 rows and 10
outputs), and both cost more than one backward operation on a ``(K n)``-row stack.

:func:`folded_grad` walks the autograd graph from the roots to the wanted tensors
itself, as the autograd engine does, with each gradient of shape ``(K, *shape)``
and each node's backward taken by a :class:`FoldedVJP` that applies the node's
own backward operation to all ``K`` cotangents at once: the convolution's input
gradient by ``aten.convolution_backward`` on the ``(K n)``-row stack, the
max-pool's as a ``scatter_add`` of its saved indices expanded over ``K``, ReLU's
mask broadcast over ``K``, the products by batched matrix products. The same
numbers as the engine's backward up to the order of the sums (rounding).

The rules live in one table, :data:`FOLDED_VJPS`, keyed by the autograd node's
class name (``type(tensor.grad_fn).__name__``); a graph with any other node on
the way to the wanted tensors, or a node whose wanted edge its rule does not
give (a weight's gradient), is not folded: :func:`folded_grad` returns None and
the caller takes torch's ``is_grads_batched`` route, which handles any graph.

A max-pool's backward pass puts each window's gradient at the window's winner,
zeros elsewhere. The walk keeps that as a :class:`PooledCotangent` (the winners'
values and the pool's saved indices) through pointwise nodes (``MinPool2d``'s
negations, a clone) to the wanted tensors whose caller takes it (``pooled``: the
layer rules with ``takes_pooled_cotangents``, the convolutional distance layer
before a min-pool), and forms the full-resolution tensor only for a node that
needs it (a ReLU before a CNN's max-pool), for a gradient that meets another,
or for a caller that did not ask: a quarter of the numbers for 2x2 windows, no
zero fill, and the min-pool's inner negation on the winners alone.

A layer evaluated with each row at its own weights ``w + t_i dw`` (the probe adds
``t_i`` times its moved output) can be passed through whole
(:class:`LayerShortcut`): its rule maps the cotangents of its output to those of
its input at the rows' own weights (``LayerRule.input_vjp``), one operation in
place of the backward of its output at ``w`` and of its moved output (for a
convolution, one grouped convolution with a kernel per row instead of two).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch.autograd.graph import get_gradient_edge

from .rules._distance._backward import AffineInputBackward
from .rules._protocol import PooledCotangent


class FoldedVJP(ABC):
    """The backward of one kind of autograd node over ``K`` cotangents at once.

    ``edges`` lists, for each of the node's ``next_functions``, whether this rule
    can give that input's gradient (``True``) or not (``False``: a graph that needs
    it is not folded). ``backward`` gets the node and the gradient of each of its
    forward outputs, of shape ``(K, *output_shape)`` (None for outputs no gradient
    reached), and returns one gradient per ``next_functions`` edge, of shape
    ``(K, *input_shape)``, or None where ``wanted[i]`` is False. ``writable``: the
    first output's gradient is the walk's own (no caller's tensor, no result, no
    other edge's), so the rule may overwrite it. ``fresh``: the gradients it
    returns are the walk's own too (new tensors, or ``grads[0]`` overwritten when
    writable), each given to one edge; False for rules that pass a gradient on
    (views, the same tensor to two edges). ``pointwise``: the node has one
    input and its backward is a pointwise map of its one gradient that takes
    zeros to zeros (negation, a copy), so it applies to the winners' values of
    a :class:`PooledCotangent` alone; other rules get the pooled gradient
    formed at full resolution (:meth:`PooledCotangent.dense`).
    """

    fresh = True
    pointwise = False

    @abstractmethod
    def edges(self, node):
        """One bool per ``node.next_functions`` edge: whether ``backward`` gives it."""

    @abstractmethod
    def backward(self, node, grads, wanted, writable):
        """The inputs' gradients (see the class)."""


class Identity(FoldedVJP):
    """``clone`` and friends: the gradient passes through."""

    fresh = False
    pointwise = True

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        return (grads[0],)


class Add(FoldedVJP):
    """``a + alpha b``: the gradient to both, times ``alpha`` to ``b`` (broadcast
    operands are reduced by :func:`folded_grad`, as the engine reduces them)."""

    fresh = False

    def edges(self, node):
        return (True, True)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        alpha = node._saved_alpha
        return grad, (grad if alpha == 1 else grad * alpha) if wanted[1] else None


class Mul(FoldedVJP):
    """``a * b``: each operand's gradient is the other times the gradient."""

    def edges(self, node):
        return (True, True)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        return (
            grad * node._saved_other if wanted[0] else None,
            grad * node._saved_self if wanted[1] else None,
        )


class Relu(FoldedVJP):
    """``relu``: the gradient where the saved result is positive (the engine's own
    ``threshold_backward``, broadcast over ``K``)."""

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        grad, result = grads[0], node._saved_result
        if writable:  # (in place: a fresh tensor of this size costs twice the pass)
            return (torch.ops.aten.threshold_backward.grad_input(grad, result, 0, grad_input=grad),)
        return (torch.ops.aten.threshold_backward(grad, result, 0),)


class Reshape(FoldedVJP):
    """``view``/``reshape``/``flatten``: the gradient in the input's shape."""

    fresh = False

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        return (grad.reshape(grad.shape[0], *node._saved_self_sym_sizes),)


class Slice(FoldedVJP):
    """``x[a:b:c]`` along one dimension: the gradient placed into zeros."""

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        sizes = node._saved_self_sym_sizes
        out = grad.new_zeros((grad.shape[0], *sizes))
        index = [slice(None)] * (len(sizes) + 1)
        dim = node._saved_dim % len(sizes) + 1
        index[dim] = slice(node._saved_start, node._saved_end, node._saved_step)
        out[tuple(index)] = grad
        return (out,)


class LogSoftmax(FoldedVJP):
    """``log_softmax``: ``g - exp(result) sum(g)`` along its dimension."""

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        result = node._saved_result
        dim = node._saved_dim % result.ndim + 1
        return (grad - result.exp() * grad.sum(dim, keepdim=True),)


class MatrixProduct(FoldedVJP):
    """``mm(a, b)`` and ``addmm(c, a, b)`` (``nn.Linear``) with a constant ``b``: the
    gradient of ``a`` is ``g b^T`` (times ``alpha``), all ``K`` in one product."""

    def __init__(self, first_edge):
        self.first_edge = first_edge  # the edge of ``a`` (addmm: 1, after ``c``)

    def edges(self, node):
        return tuple(i == self.first_edge for i in range(len(node.next_functions)))

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        out = [None] * len(wanted)
        mat2 = node._saved_mat2
        product = torch.matmul(grad, mat2.transpose(0, 1).conj())
        alpha = getattr(node, "_saved_alpha", 1)
        out[self.first_edge] = product if alpha == 1 else product * alpha
        return tuple(out)


class Convolution(FoldedVJP):
    """``conv{1,2,3}d`` and their transposes with constant weights: the input's
    gradient by ``aten.convolution_backward`` on the ``(K n)``-row stack (the
    input only; it reads the saved input's shape, not its values)."""

    def edges(self, node):
        return tuple(i == 0 for i in range(len(node.next_functions)))

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        weight, shape = node._saved_weight, node._saved_input.shape
        if len(shape) != weight.ndim:  # an unbatched input: K is its batch
            stacked, rows = grad, ()
        else:
            stacked, rows = grad.reshape(-1, *grad.shape[2:]), (shape[0],)
        size = (stacked.shape[0], *shape[len(rows) :])
        (gradient, _, _) = torch.ops.aten.convolution_backward(
            stacked,
            grad.new_empty(size),  # (the input's shape only: never written or read)
            weight,
            None,
            node._saved_stride,
            node._saved_padding,
            node._saved_dilation,
            node._saved_transposed,
            node._saved_output_padding,
            node._saved_groups,
            [True, False, False],
        )
        out = [None] * len(wanted)
        out[0] = gradient.view(grad.shape[0], *shape)
        return tuple(out)


class MaxPool(FoldedVJP):
    """``max_pool{1,2,3}d`` (with indices): each output's gradient at its window's
    saved winner. A batched input (N, C, ...) gets a :class:`PooledCotangent`
    (the gradients and the winners, no full-resolution tensor: the walk forms
    that only for a node or a caller that needs it); an unbatched one (C, ...)
    the gradients added at the winners, one ``scatter_add`` with the indices
    expanded over ``K`` (the engine's kernel adds the same terms; overlapping
    windows add)."""

    fresh = False  # (a PooledCotangent's values are the gradient it got)

    def __init__(self, spatial):
        self.spatial = spatial  # 1, 2 or 3 pooled dimensions

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        grad = grads[0]
        shape, indices = node._saved_self.shape, node._saved_result1
        lead = len(shape) - self.spatial  # (N, C) or (C,)
        if lead == 2:
            return (PooledCotangent(grad.transpose(0, 1), indices, tuple(shape[lead:])),)
        flat = indices.flatten(lead)
        out = grad.new_zeros((grad.shape[0], *shape[:lead], _prod(shape[lead:])))
        out.scatter_add_(lead + 1, flat.expand(grad.shape[0], *flat.shape), grad.flatten(lead + 1))
        return (out.view(grad.shape[0], *shape),)


class Neg(FoldedVJP):
    """``-a`` (``MinPool2d`` is ``-max_pool2d(-z)``): the gradient negated, in place
    when the walk owns it (pointwise: a pooled gradient's values only)."""

    pointwise = True

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        return (grad.neg_() if writable else torch.neg(grad),)


class Clamp(FoldedVJP):
    """``clamp(a, min, max)`` with number bounds (``ClampBackward1``, and with
    ``has_max`` False ``clamp_min``'s ``ClampMinBackward0``): the gradient where
    ``min <= a <= max`` (the engine's ``clamp_backward``: bounds included), zero
    elsewhere."""

    def __init__(self, has_max):
        self.has_max = has_max

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        value, low = node._saved_self, node._saved_min
        high = node._saved_max if self.has_max else None
        inside = None if low is None else value >= low
        if high is not None:
            below = value <= high
            inside = below if inside is None else inside.logical_and_(below)
        if inside is None:  # (no bound: the gradient passes)
            return (grad if writable else grad.clone(),)
        if writable:
            return (grad.masked_fill_(inside.logical_not_(), 0.0),)
        return (torch.where(inside, grad, 0.0),)


class Log1p(FoldedVJP):
    """``log1p(a)``: the gradient divided by ``1 + a`` (as the engine's
    ``log1p_backward``)."""

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        denominator = node._saved_self + 1
        return (grad.div_(denominator) if writable else grad / denominator,)


class Sqrt(FoldedVJP):
    """``sqrt(a)``: the gradient divided by twice the result (``sqrt_backward``)."""

    def edges(self, node):
        return (True,)

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        denominator = 2 * node._saved_result
        return (grad.div_(denominator) if writable else grad / denominator,)


class AffineInput(FoldedVJP):
    """A squared-distance layer at its own weights (``DistanceRule.own_output``): its
    input's gradient by the layer's closed form, :class:`AffineInputBackward`'s own
    backward, which broadcasts over the ``K`` cotangents (two matrix products for
    all of them, where torch's batched backward runs it once per cotangent). The
    node's other inputs (values, slopes, centred rows) carry no gradient."""

    def edges(self, node):
        return tuple(i == 0 for i in range(len(node.next_functions)))

    def backward(self, node, grads, wanted, writable):
        (grad,) = grads
        out = [None] * len(wanted)
        out[0] = AffineInputBackward.backward(node, grad)[0]
        return tuple(out)


def _prod(sizes):
    result = 1
    for size in sizes:
        result *= int(size)
    return result


#: autograd node class name -> its :class:`FoldedVJP`.
FOLDED_VJPS = {
    **dict.fromkeys(("CloneBackward0", "AliasBackward0"), Identity()),
    "AddBackward0": Add(),
    "MulBackward0": Mul(),
    "ReluBackward0": Relu(),
    **dict.fromkeys(("ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"), Reshape()),
    "SliceBackward0": Slice(),
    "LogSoftmaxBackward0": LogSoftmax(),
    "MmBackward0": MatrixProduct(0),
    "AddmmBackward0": MatrixProduct(1),
    "ConvolutionBackward0": Convolution(),
    "MaxPool2DWithIndicesBackward0": MaxPool(2),
    "MaxPool3DWithIndicesBackward0": MaxPool(3),
    # The image distance networks: min-pools, transforms, distance layers.
    "NegBackward0": Neg(),
    "ClampBackward1": Clamp(has_max=True),
    "ClampMinBackward0": Clamp(has_max=False),
    "Log1PBackward0": Log1p(),
    "SqrtBackward0": Sqrt(),
    AffineInputBackward._backward_cls.__name__: AffineInput(),
}


@dataclass(frozen=True)
class LayerShortcut:
    """A layer the walk passes through whole.

    Parameters
    ----------
    output : torch.Tensor
        The layer's output (as the probe captured it: its gradient is wanted too).
    input_edge : torch.autograd.graph.GradientEdge or None
        Where the layer's input joins the graph (None: the input needs no gradient).
    vjp : callable
        ``(K, *output.shape) -> (K, *input.shape)``: the input's cotangents.
    """

    output: torch.Tensor
    input_edge: object
    vjp: object


def folded_grad(roots, inputs, grad_roots, shortcuts=(), pooled=()):
    """``torch.autograd.grad(roots, inputs, grad_roots, allow_unused=True,
    is_grads_batched=True)`` by the rules of :data:`FOLDED_VJPS`, or None where the
    graph needs a node (or a node's edge) they do not give.

    Parameters
    ----------
    roots : list of torch.Tensor
    inputs : list of torch.Tensor
        The tensors whose gradients are wanted (leaves or not).
    grad_roots : list of torch.Tensor
        Per root, its ``K`` cotangents, of shape ``(K, *root.shape)``.
    shortcuts : sequence of LayerShortcut
        Layers passed through by their own ``vjp`` (their operations are not
        walked).
    pooled : collection of int
        Positions of ``inputs`` whose gradient may come as a
        :class:`PooledCotangent` (rows first) where a max-pool's backward reaches
        them through pointwise nodes only (a min-pool's negations): the pool's
        winners without the full-resolution tensor.

    Returns
    -------
    list of torch.Tensor or PooledCotangent or None, or None
        Per input, its gradients ``(K, *input.shape)`` (None where no root reaches
        it; a :class:`PooledCotangent` (n, K, ...) for a position in ``pooled``);
        None when the graph cannot be folded.
    """
    with torch.no_grad():  # (as the engine's backward without create_graph)
        try:
            return _walk(roots, inputs, grad_roots, shortcuts, frozenset(pooled))
        except AttributeError:
            # The rules read the nodes' saved tensors by the names this torch gives
            # them (``_saved_indices``...); a torch that names them otherwise takes
            # torch's own route: the walk has written none of the caller's tensors.
            return None


def _full(grad):
    """A pooled gradient at full resolution, output first (K, n, ...): a new
    tensor, the walk's own."""
    return grad.dense().transpose(0, 1)


def _walk(roots, inputs, grad_roots, shortcuts, pooled):
    through = {}
    for shortcut in shortcuts:
        edge = get_gradient_edge(shortcut.output)
        if edge.output_nr != 0 or len(edge.node._input_metadata) != 1:
            return None  # (a layer output is a node's only output)
        through[edge.node] = shortcut

    def _next(node):
        """A node's children: the layer's input for a shortcut, none for a leaf."""
        if node in through:
            edge = through[node].input_edge
            return () if edge is None else ((edge.node, edge.output_nr),)
        return () if type(node).__name__ == "AccumulateGrad" else node.next_functions

    targets = {}
    for position, tensor in enumerate(inputs):
        edge = get_gradient_edge(tensor)
        targets.setdefault((edge.node, edge.output_nr), []).append(position)
    starts = [
        (get_gradient_edge(root), grad)
        for root, grad in zip(roots, grad_roots, strict=True)
        if root.requires_grad
    ]
    needed = _needed(
        [edge.node for edge, _ in starts], {node for node, _ in targets}, _next, through
    )
    if needed is None:
        return None
    waiting = dict.fromkeys(needed, 0)  # per needed node, its needed parents not yet run
    for node in needed:
        for child, _ in _next(node):
            if child in waiting:
                waiting[child] += 1
    buffers = {}  # node -> the gradients of its outputs summed so far
    owned = set()  # the nodes whose first gradient is the walk's own (see FoldedVJP)

    def add(node, slot, grad, own):
        slots = buffers.setdefault(node, [None] * len(node._input_metadata))
        shape = node._input_metadata[slot].shape
        if isinstance(grad, PooledCotangent):  # kept pooled where it is the only one
            if slots[slot] is None and (grad.shape[0], *grad.shape[2:]) == tuple(shape):
                slots[slot] = grad
                if slot == 0:
                    (owned.add if own else owned.discard)(node)
                return
            grad, own = _full(grad), True
        expected = (grad.shape[0], *shape)
        if grad.shape != expected:  # a broadcast operand, reduced as the engine does
            grad, own = grad.sum_to_size(expected), False
        if slots[slot] is None:
            slots[slot] = grad
        elif isinstance(slots[slot], PooledCotangent):
            slots[slot], own = _full(slots[slot]).add_(grad), True
        elif slot == 0 and node in owned:
            slots[slot].add_(grad)
        else:
            slots[slot], own = slots[slot] + grad, True
        if slot == 0:
            (owned.add if own else owned.discard)(node)

    for edge, grad in starts:
        if edge.node in needed:
            add(edge.node, edge.output_nr, grad, False)
    results = [None] * len(inputs)
    ready = [node for node, count in waiting.items() if count == 0]
    while ready:
        node = ready.pop()
        grads = buffers.pop(node, [None])
        writable = node in owned
        for slot, grad in enumerate(grads):
            for position in targets.get((node, slot), ()):
                if isinstance(grad, PooledCotangent) and position not in pooled:
                    grad = grads[slot] = _full(grad)
                results[position], writable = grad, False
        children = _next(node)
        wanted = [child in needed for child, _ in children]
        rule = None if node in through else FOLDED_VJPS.get(type(node).__name__)
        if isinstance(grads[0], PooledCotangent) and any(wanted):
            if rule is not None and rule.pointwise:  # (one edge: the winners' values)
                (values,) = rule.backward(node, [grads[0].values], wanted, writable)
                ((child, slot),) = children
                add(child, slot, grads[0].with_values(values), rule.fresh)
                grads = [None]  # (passed on)
            else:
                grads[0], writable = _full(grads[0]), True
        if grads[0] is not None and any(wanted) and node in through:
            (child, slot), grad = children[0], through[node].vjp(grads[0])
            add(child, slot, grad, True)
        elif grads[0] is not None and any(wanted):
            # (the registered nodes' other outputs, max-pool's indices, carry none)
            for (child, slot), keep, grad in zip(
                children, wanted, rule.backward(node, grads, wanted, writable), strict=True
            ):
                if keep and grad is not None:
                    add(child, slot, grad, rule.fresh)
        for (child, _), keep in zip(children, wanted, strict=True):
            if keep:
                waiting[child] -= 1
                if waiting[child] == 0:
                    ready.append(child)
    return results


def _needed(starts, target_nodes, _next, through):
    """The nodes on a way from ``starts`` to ``target_nodes``, or None when one of
    them has no rule, or needs an edge its rule does not give."""
    reaches, order, seen = {}, [], set()
    stack = [(node, False) for node in starts]
    while stack:  # depth first; a node is settled after its children (post-order)
        node, children_done = stack.pop()
        if children_done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in _next(node) if child is not None)
    for node in order:
        reaches[node] = node in target_nodes or any(
            reaches.get(child, False) for child, _ in _next(node) if child is not None
        )
    needed = {node for node, on_way in reaches.items() if on_way}
    for node in needed:
        if node in through or type(node).__name__ == "AccumulateGrad":
            continue
        rule = FOLDED_VJPS.get(type(node).__name__)
        if rule is None:
            return None
        for (child, _), given in zip(node.next_functions, rule.edges(node), strict=True):
            if child in needed and not given:
                return None
    return needed
