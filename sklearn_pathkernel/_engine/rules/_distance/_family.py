"""What a kernel family of the distance layer implements for :class:`DistanceRule`.

The rule handles the bias and width coefficients (plain (n, K, J) tensors, one
contraction) and asks the layer's family for everything about the memories:
the layer's output at per-row weights, the factors, and the memory blocks of
the inner products, directional derivatives and materialised gradients.
"""

import weakref
from abc import ABC, abstractmethod

import torch

from ._geometry import memories_at


class KernelFamily(ABC):
    """The memory part of :class:`DistanceRule` for one family of kernels.

    Parameters
    ----------
    rule : DistanceRule
        The rule (its layer, its parameter names and their values). The family
        belongs to it and keeps a weak reference (a proxy): rule and family are
        then freed with the last reference to the rule, not at a garbage
        collection.
    """

    def __init__(self, rule):
        self.rule = weakref.proxy(rule)

    @abstractmethod
    def output(self, x, weights):
        """The kernel values ``k(x_i, mu_ij)`` (n, J), rows at their own weights
        (a ``RowWeights`` with ``t``); not differentiated in the parameters."""

    @abstractmethod
    def factors(self, x, delta, weights, common):
        """The family's factors of the rows (``common``: the fields every family
        shares, ``memories``, ``x``, ``t``, ``bias``)."""

    @abstractmethod
    def memory_blocks(self, left, right, dm, mode):
        """The memory part of the inner products as ``(lefts, rights, extra)``:
        coefficient blocks (n, K, J) of both sides to contract over ``j``, and a
        term added to that contraction."""

    @abstractmethod
    def memory_directional(self, factors, step):
        """``<d f_k / d m, step>`` per row and output, (n, K)."""

    @abstractmethod
    def memory_coefficient(self, factors):
        """A (n, K, J) coefficient tensor of the memory gradients (for their shape)."""

    @abstractmethod
    def _memory_gradients(self, factors, mu, grads):
        """Fill ``grads`` (n, K, J, D), a view of this family's buffer, with the
        memory gradients at the per-row memories ``mu``."""

    def integrate(self, rows, weights, factors, n_rows):
        """Factors of each row's weighted sum over its nodes, or None (keep the nodes)."""
        return None

    def input_vjp(self, x, weights):
        """For rows at their own weights (``weights.moving``): the map from ``K``
        cotangents of the layer's output, (K, n, J), to those of its input ``x``,
        (K, n, D), in closed form; or None (the default: the probe's backward pass
        differentiates :meth:`output`'s operations). See ``LayerRule.input_vjp``."""
        return None

    def materialise_sums(self, rows, weights, factors, n_rows):
        """Each row's weighted sum of its nodes' gradients (n_rows, K, W) without
        materialising the nodes, or None (the rule then materialises them)."""
        return None

    def _assemble(self, memory_sums, extra_sums, n_rows):
        """(n_rows, K, W) from the memory block (n_rows, K, J, D) or None and the
        extra coefficients' sums (n_rows, K, J), in :meth:`materialise`'s layout."""
        parts = [] if memory_sums is None else [memory_sums.flatten(2)]
        return torch.cat([*parts, *extra_sums], 2)

    def has_dense_form(self, factors, dense):
        """Whether :meth:`dense_inner` contracts ``dense`` (n, K, W) with ``factors``
        without materialising them, at lower cost."""
        return False

    def has_metric_form(self, left, right):
        """Whether :meth:`metric_inner` can contract these factors per memory (TRACE)."""
        return False

    def dense_inner(self, dense, factors, mode):
        raise NotImplementedError(f"{type(self).__name__} has no factored dense products.")

    def metric_inner(self, left, right, scale, mode):
        raise NotImplementedError(f"{type(self).__name__} has no factored metric products.")

    def materialise(self, factors):
        """Per-example gradients (n, K, W) in the order memories, bias, log_gamma,
        written in place into one buffer (no concatenation pass over it)."""
        memories, x, t = factors.memories, factors.x, factors.t
        n, width = x.shape
        extra = factors.extra_coefficients
        n_outputs, n_memories = (extra[0] if extra else self.memory_coefficient(factors)).shape[1:]
        memory_width = n_memories * width if "memories" in self.rule.names else 0
        out = x.new_empty((n, n_outputs, memory_width + n_memories * len(extra)))
        if memory_width:
            grads = out[..., :memory_width].view(n, n_outputs, n_memories, width)
            mu = memories.m[None] if t is None else memories_at(memories.m, memories.dm, t)
            self._memory_gradients(factors, mu, grads)
        for index, values in enumerate(extra):
            begin = memory_width + index * n_memories
            out[..., begin : begin + n_memories] = values
        return out
