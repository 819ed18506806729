"""Factor objects of the rules whose per-example gradients are outer products.

A layer applied as ``z = W a + b`` (along extra axes: positions of a
convolution) has per-example gradients ``g_k = delta_k [a, 1]^T`` (summed over
the positions): :class:`FactoredGradients` keeps ``a`` and ``delta``, which is
what the factored inner products need; :class:`Gradients` keeps the gradients
themselves (the generic and whole-network rules, and layers where the
factored form would cost more).
"""

from dataclasses import dataclass

import torch

from ._contract import contract
from ._protocol import LayerRule, LinearInWeights
from ._rows import row_sums


@dataclass(frozen=True, slots=True)
class Gradients:
    """Materialised per-example gradients of a batch.

    Parameters
    ----------
    grads : torch.Tensor of shape (n, K, W_layer)
        Per row and kept output, the gradient in the rule's layout.
    """

    grads: torch.Tensor

    def take(self, rows):
        """The gradients of a subset of rows."""
        return Gradients(self.grads[rows])

    @staticmethod
    def cat(parts):
        """Stack the rows of several batches of the same layer."""
        return Gradients(torch.cat([part.grads for part in parts]))

    @property
    def nbytes(self):
        """Memory held by the gradients."""
        return self.grads.nbytes

    def inner(self, other, mode):
        """Inner products with another batch's gradients (see ``contract``):
        ``O(n m K W)``."""
        return contract(self.grads, other.grads, mode)

    def directional(self, step):
        """``<g_k, step>`` per row and output, (n, K), for a flat ``step`` (W_layer,)."""
        return self.grads @ step

    def row_sums(self, rows, weights, n_rows):
        """Each row's weighted sum of its nodes' gradients (see ``row_sums``)."""
        return Gradients(row_sums(rows, weights, self.grads, n_rows))

    def zero_sums(self, n_rows):
        """Zeros for the row sums of :meth:`add_row_sums`: (n_rows, K, W_layer)."""
        return self.grads.new_zeros((n_rows, *self.grads.shape[1:]))

    def add_row_sums(self, out, rows, weights):
        """Add each row's weighted sum of these nodes' gradients into ``out``
        (n_rows, K, W_layer), node ``e`` into row ``rows[e]``; returns ``out``.
        Over the chunks of a step's nodes, in order, the same sums as
        :meth:`row_sums` of the chunks joined."""
        scaled = weights.view(-1, *([1] * (self.grads.ndim - 1))) * self.grads
        return out.index_add_(0, rows, scaled)


class MaterialisedRule(LayerRule):
    """A rule whose factors are materialised :class:`Gradients` (the generic,
    whole-network and convolutional-distance rules): inner products, directional
    derivatives and the sums over a row's quadrature nodes are those of the
    gradients themselves, ``O(n m K K' W)`` and ``O(n K W)``."""

    integrates_gradients = True

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Each row's weighted sum of its nodes' gradients (always cheaper than one
        inner product per node: the gradients are materialised anyway)."""
        return factors.row_sums(rows, weights, n_rows)

    def inner(self, left, right, mode):
        return left.inner(right, mode)

    def materialise(self, factors):
        return factors.grads

    def directional(self, factors, direction):
        return factors.directional(self.flatten(direction))


@dataclass(frozen=True, slots=True)
class FactoredGradients:
    """Per-example gradients ``g_k = sum_p delta_kp [a_p, 1]^T`` kept as their factors.

    Parameters
    ----------
    inputs : torch.Tensor of shape (n, d_in) or (n, d_in', P)
        The layer's input per row (a linear layer), or its columns per output
        position ``p`` (a convolution's unfolded input, with a row of ones for
        the bias).
    deltas : torch.Tensor of shape (n, K, d_out) or (n, K, d_out, P)
        The back-propagated cotangents of the layer's output, per kept output.
    """

    inputs: torch.Tensor
    deltas: torch.Tensor

    def take(self, rows):
        """The factors of a subset of rows."""
        return FactoredGradients(self.inputs[rows], self.deltas[rows])

    @staticmethod
    def cat(parts):
        """Stack the rows of several batches of the same layer."""
        return FactoredGradients(
            torch.cat([part.inputs for part in parts]), torch.cat([part.deltas for part in parts])
        )

    @property
    def nbytes(self):
        """Memory held by the factors."""
        return self.inputs.nbytes + self.deltas.nbytes


def factored(*factors):
    """Whether every one of ``factors`` is a :class:`FactoredGradients`."""
    return all(isinstance(f, FactoredGradients) for f in factors)


class WeightAndBiasRule(LinearInWeights):
    """A rule for a layer ``z = W * a + b`` with a weight and a bias (either may be
    outside the path), whose gradients are outer products (:class:`FactoredGradients`).

    Parameters
    ----------
    module : torch.nn.Module
    weight_name, bias_name : str or None
        The path names of the weight and the bias; None for one not in the path.
    """

    def __init__(self, module, weight_name, bias_name):
        self.module = module
        self.weight_name, self.bias_name = weight_name, bias_name
        self.path_names = [name for name in (weight_name, bias_name) if name is not None]
