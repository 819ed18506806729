"""The polynomial degree in ``t`` of a network's output along a step, by one traced pass.

Along a step the path's parameters move on a line, ``w(t) = w_s + t (w_{s+1} - w_s)``:
each is a polynomial of degree 1 in ``t``; the inputs, buffers and frozen
parameters are constants (degree 0). On a smooth piece of the step (every ReLU
sign, max-pool winner and other switch fixed) a network made of operations that
are *multilinear* in their tensor operands (``linear``, ``conv``, ``matmul``,
``mul``: the degrees add) and *piecewise linear* or *linear* in them (``add``,
``cat``, ``reshape``, ``relu``, ``max_pool2d``, ``abs``...: the largest degree
passes through) is a polynomial in ``t`` of a degree ``D`` that one forward pass
with degree-tagged tensors bounds from above: an MLP of ``L`` moving linear
layers has ``D = L``, a convolution and a linear layer ``D = 2``. Any other
operation on a tensor that moves (``log_softmax``, ``tanh``, a division by a
moving tensor, a comparison, ``item()``) makes ``f`` no polynomial: the analysis
answers ``None``.

What it buys (:class:`NodeCounts`): the test copy's integrand ``<grad_w f(w(t)),
v>`` has degree ``D - 1`` on each piece, so ``ceil(D / 2)`` Gauss-Legendre nodes
integrate it exactly (``n`` nodes are exact to degree ``2 n - 1``); the test x
test integrand, a product of two gradients, has degree ``2 D - 2`` and needs
``D`` nodes.

The rules live in one table, :data:`DEGREE_RULES`, keyed by the torch function
that a :class:`~torch.overrides.TorchFunctionMode` sees. Cost: one forward pass
of one example row, once per engine.
"""

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..._path import nested_tensors

#: Degree of a tensor the analysis met no rule for: not a polynomial in ``t``.
NOT_POLYNOMIAL = None


class DegreeRule(ABC):
    """How an operation's output degree follows from its tensor operands' degrees.

    ``degrees`` lists the degree of each tensor operand, in the order
    :func:`~sklearn_pathkernel._nested.nested_tensors` yields them from
    ``(args, kwargs)``; ``args`` and ``kwargs`` are the call's own.
    """

    @abstractmethod
    def degree(self, degrees, args, kwargs):
        """The output's degree (int), or ``None`` when it is no polynomial."""


class Linear(DegreeRule):
    """Linear or piecewise linear in each operand, the operands added or
    concatenated: the largest degree passes through."""

    def degree(self, degrees, args, kwargs):
        return max(degrees, default=0)


class Product(DegreeRule):
    """Multilinear in all its tensor operands (``mul``, ``matmul``, ``einsum``):
    the degrees add."""

    def degree(self, degrees, args, kwargs):
        return sum(degrees)


class AffineProduct(DegreeRule):
    """Multilinear in its operands but for one added term (``linear``'s and
    ``conv``'s ``bias``, ``addmm``'s ``input``): ``max(sum of the others, bias)``.

    Parameters
    ----------
    position : int
        The added term's position among the positional arguments.
    name : str
        Its keyword.
    """

    def __init__(self, position, name):
        self.position, self.name = position, name

    def degree(self, degrees, args, kwargs):
        added = args[self.position] if len(args) > self.position else kwargs.get(self.name)
        tagged = list(zip(degrees, nested_tensors((args, kwargs)), strict=True))
        others = sum(d for d, x in tagged if x is not added)
        return max([others] + [d for d, x in tagged if x is added])


class DividedByConstant(DegreeRule):
    """``a / b``: the numerator's degree when the denominator does not move."""

    def degree(self, degrees, args, kwargs):
        moving_denominator = len(degrees) > 1 and degrees[1] > 0
        if moving_denominator or not torch.is_tensor(args[0]) or kwargs.get("rounding_mode"):
            return NOT_POLYNOMIAL
        return degrees[0]


class IntegerPower(DegreeRule):
    """``a ** n`` for a natural number ``n``: ``n`` times ``a``'s degree."""

    def degree(self, degrees, args, kwargs):
        exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
        if len(degrees) != 1 or not torch.is_tensor(args[0]) or not _natural(exponent):
            return NOT_POLYNOMIAL
        return int(exponent) * degrees[0]


class Metadata(DegreeRule):
    """Shapes, sizes and types, and new tensors of the same shape (``zeros_like``):
    no value of the tensor is read, the result does not move."""

    def degree(self, degrees, args, kwargs):
        return 0


def _natural(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_T = torch.Tensor
_LINEAR_OPS = (
    # sums and differences
    torch.add, _T.add, _T.__add__, _T.__radd__, _T.__iadd__,
    torch.sub, _T.sub, _T.__sub__, _T.__rsub__, _T.__isub__,
    torch.neg, _T.neg, _T.__neg__, _T.__pos__,
    torch.sum, _T.sum, torch.mean, _T.mean,
    # shapes and copies
    torch.cat, torch.concat, torch.stack, torch.hstack, torch.vstack,
    torch.reshape, _T.reshape, _T.view, _T.view_as, _T.reshape_as,
    torch.flatten, _T.flatten, torch.unflatten, _T.unflatten,
    torch.squeeze, _T.squeeze, torch.unsqueeze, _T.unsqueeze,
    torch.transpose, _T.transpose, _T.t, torch.permute, _T.permute,
    _T.__getitem__, torch.narrow, _T.narrow, torch.select, _T.select,
    torch.split, _T.split, torch.chunk, _T.chunk, torch.unbind, _T.unbind,
    _T.expand, _T.expand_as, _T.repeat, torch.tile, _T.tile,
    _T.contiguous, torch.clone, _T.clone, _T.to, _T.double, _T.float, _T.detach,
    F.pad, F.unfold, F.fold,
    # piecewise linear (their switches are the kink search's)
    torch.relu, _T.relu, F.relu, F.relu6, F.leaky_relu, F.hardtanh,
    torch.abs, _T.abs, _T.__abs__,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, torch.max_pool1d, torch.max_pool2d,
    F.max_pool2d_with_indices, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
    F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
    # a fixed mask (eval: identity)
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
)  # fmt: skip
_PRODUCTS = (
    torch.mul, _T.mul, _T.__mul__, _T.__rmul__, torch.multiply,
    torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__,
    torch.mm, _T.mm, torch.bmm, _T.bmm, torch.mv, torch.outer, torch.einsum,
)  # fmt: skip
_WITH_BIAS = (F.linear, F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d)
_METADATA = (
    _T.size, _T.dim, _T.numel, _T.stride, _T.__len__,
    _T.shape.__get__, _T.ndim.__get__, _T.dtype.__get__, _T.device.__get__,
    _T.requires_grad.__get__, _T.is_cuda.__get__, _T.layout.__get__,
    torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
    torch.rand_like, torch.randn_like, _T.new_zeros, _T.new_ones, _T.new_full, _T.new_empty,
)  # fmt: skip

#: The registry: torch function -> :class:`DegreeRule`. An operation on a moving
#: tensor that is not here makes the network no polynomial (``None``).
DEGREE_RULES = {
    **dict.fromkeys(_LINEAR_OPS, Linear()),
    **dict.fromkeys(_PRODUCTS, Product()),
    **dict.fromkeys(_WITH_BIAS, AffineProduct(2, "bias")),
    **dict.fromkeys((torch.addmm, torch.addmv, torch.baddbmm), AffineProduct(0, "input")),
    **dict.fromkeys((torch.div, _T.div, _T.__truediv__, torch.true_divide), DividedByConstant()),
    **dict.fromkeys((torch.pow, _T.pow, _T.__pow__), IntegerPower()),
    **dict.fromkeys(_METADATA, Metadata()),
}


class _DegreeTracer(TorchFunctionMode):
    """Tags every tensor computed from a moving one with its degree in ``t``.

    ``degrees`` maps ``id(tensor)`` to its degree; the tensors themselves are
    kept alive in ``alive`` so that no id is reused during the pass. ``failure``
    names the first operation without a rule that met a moving tensor.
    """

    def __init__(self, degrees, alive):
        super().__init__()
        self.degrees, self.alive, self.failure = degrees, alive, None

    def degree_of(self, tensor):
        return self.degrees.get(id(tensor), 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        degrees = [self.degree_of(x) for x in nested_tensors((args, kwargs))]
        if self.failure is not None or not any(degrees):
            return result
        rule = DEGREE_RULES.get(func)
        degree = NOT_POLYNOMIAL if rule is None else rule.degree(degrees, args, kwargs)
        if degree is NOT_POLYNOMIAL:
            self.failure = getattr(func, "__name__", repr(func))
            return result
        for tensor in nested_tensors(result):
            self.degrees[id(tensor)] = degree
            self.alive.append(tensor)
        return result


@dataclass(frozen=True)
class PathDegree:
    """The degree ``D`` of ``f`` in ``t`` on a smooth piece of a step.

    Attributes
    ----------
    degree : int or None
        ``None`` when ``f`` is no polynomial in ``t`` (some operation without a
        rule, named by ``reason``, met a moving tensor).
    reason : str or None
    """

    degree: int | None
    reason: str | None = None


def path_degree(module, path_names, example, link):
    """The degree in ``t`` of ``link(module(example))`` when the parameters named
    ``path_names`` move linearly in ``t`` and everything else is constant.

    Parameters
    ----------
    module : torch.nn.Module
        Evaluated once, with its own values (its buffers and random state are
        left as they were).
    path_names : collection of str
        The path's (trainable) parameter names.
    example : torch.Tensor of shape (n, ...)
    link : callable
        ``f`` from the module's output.

    Returns
    -------
    PathDegree
    """
    names = set(path_names)
    degrees, alive = {}, []
    # (buffers in the path: BatchNorm running statistics that move along a step)
    moving = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
    for name, param in moving:
        if name in names:
            degrees[id(param)] = 1
            alive.append(param)
    tracer = _DegreeTracer(degrees, alive)
    buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]
    devices = [example.device] if example.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), tracer:
            out = link(module(example))
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    if tracer.failure is not None:
        return PathDegree(NOT_POLYNOMIAL, f"{tracer.failure} of a moving tensor")
    if not torch.is_tensor(out):
        return PathDegree(NOT_POLYNOMIAL, f"the output is a {type(out).__name__}")
    return PathDegree(tracer.degree_of(out))


@dataclass(frozen=True)
class NodeCounts:
    """Gauss-Legendre nodes per smooth piece of a step, for the exact rule.

    Attributes
    ----------
    per_piece : int
        For one gradient against a fixed vector (the test copy ``phi_s``: the
        decomposition, the cross Gram): exact to degree ``2 per_piece - 1``.
    test_test : int
        For a product of two gradients (the test x test Gram and diagonal).
    degree : int or None
        The path degree they were derived from (None: not a polynomial).
    """

    per_piece: int
    test_test: int
    degree: int | None = None

    @classmethod
    def of(cls, degree, n_nodes, test_test_factor):
        """The counts for a path of ``degree``, at most ``n_nodes`` and
        ``test_test_factor * n_nodes`` (what an unknown degree gets).

        ``f`` of degree ``D`` has gradients of degree ``D - 1``: ``ceil(D / 2)``
        nodes integrate them exactly, ``D`` nodes their products (degree
        ``2 D - 2``); at least one node.
        """
        default = cls(n_nodes, test_test_factor * n_nodes, None)
        if degree is None:
            return default
        return cls(
            min(default.per_piece, max(1, math.ceil(degree / 2))),
            min(default.test_test, max(1, degree)),
            degree,
        )
