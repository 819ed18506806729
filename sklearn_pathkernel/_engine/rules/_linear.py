"""The rule of ``nn.Linear``: inner products from the layer's inputs and cotangents.

For ``z = W a + b`` and cotangents ``delta_k = d f_k / dz``, the per-example
gradient of output ``k`` is ``delta_k [a, 1]^T`` (the ``1`` for the bias), so

    <g_ik, g_jk'> = (a_i . a_j + 1) (delta_ik . delta_jk'),

an input Gram times a cotangent Gram, never forming the ``d_out x d_in``
gradients: ``O(n m (d_in + K d_out))`` for a trace against ``O(n m K d_out d_in)``
materialised. A linear layer applied along extra axes (sequence, pixels) sums
the outer products over them and keeps the materialised form.
"""

import torch
from torch import nn

from .._modes import OutputMode
from .._output_subspace import OutputSubspace
from .._planning import rows_per_tile
from ._contract import contract
from ._gradients import FactoredGradients, Gradients, WeightAndBiasRule, factored
from ._registry import register_rule
from ._rows import first_of_rows, padded_by_row, row_sums

# Flops a memory-bound pass over one output value is worth next to a dense matrix
# product. It decides per-node vs materialised sums; 32 makes the cost model pick
# the faster form in both cases timed on the paper's toy (its 64-3 output layer,
# ~4 nodes per row): per node for a trace, materialised for every output pair.
PER_NODE_OUTPUT_COST = 32


@register_rule(nn.Linear)
class LinearRule(WeightAndBiasRule):
    """``nn.Linear``: factored form on 2-D input (:class:`FactoredGradients`),
    materialised gradients (:class:`Gradients`) along extra axes.
    """

    integrates_gradients = True  # (materialised factors: ``row_sums``)

    @classmethod
    def for_module(cls, module, names):
        if {name for name, _ in module.named_parameters(recurse=False)} - {"weight", "bias"}:
            return None
        return cls(module, names.get("weight"), names.get("bias"))

    # -- evaluation -------------------------------------------------------------

    def moved_output(self, inputs, steps):
        """The layer applied with the weight change ``steps`` (it is linear in them)."""
        weight = steps[self.weight_name] if self.weight_name else None
        bias = steps[self.bias_name] if self.bias_name else None
        if weight is None:
            zero = torch.zeros_like(self.module.weight)
            return torch.zeros_like(nn.functional.linear(inputs[0], zero)) + bias
        return nn.functional.linear(inputs[0], weight, bias)

    def factors(self, inputs, delta, weights):
        """``FactoredGradients(a, delta)`` for 2-D input; along extra axes the
        gradients, summed over those axes: ``O(n K d_out d_in)``."""
        a = inputs[0]
        if a.ndim == 2:
            return FactoredGradients(a, delta)
        return Gradients(self._gradients(a, delta))

    def outer_factors(self, factors):
        """The factors themselves on 2-D input (:class:`FactoredGradients`), else None."""
        return factors if factored(factors) else None

    # -- materialised gradients ---------------------------------------------------

    def _gradients(self, a, delta):
        """Materialised per-example gradients (n, K, W_layer), weight then bias,
        summed over any axes between the batch and the features."""
        parts = []
        if self.weight_name is not None:
            parts.append(torch.einsum("nk...o,n...i->nkoi", delta, a).flatten(2))
        if self.bias_name is not None:
            parts.append(delta.reshape(*delta.shape[:2], -1, delta.shape[-1]).sum(2))
        return torch.cat(parts, dim=2)

    def materialise(self, factors):
        """(n, K, d_out d_in [+ d_out]): per unit its weights, then the bias."""
        if factored(factors):
            return self._gradients(factors.inputs, factors.deltas)
        return factors.grads

    def _integrated_gradients(self, rows, weights, factors, n_rows):
        """Each row's weighted sum of its nodes' gradients, (n_rows, K, W_layer):
        ``sum_e (weights_e delta_e)^T [a_e, 1]``, one padded product per row and
        output, written into the layout (weight then bias) by the product itself;
        the bias's part is the nodes' deltas summed in order (what a product with
        a column of ones gave, without copying the products into the layout: a
        pass over n K W fewer)."""
        deltas = weights[:, None, None] * factors.deltas  # (E, K, d_out)
        n_nodes, n_outputs, d_out = deltas.shape
        a = factors.inputs
        d_in = a.shape[1] if self.weight_name is not None else 0
        width = d_out * d_in + (d_out if self.bias_name is not None else 0)
        blocks = [deltas.reshape(n_nodes, -1)] + ([a] if self.weight_name is not None else [])
        left, *inputs = padded_by_row(rows, n_rows, *blocks)  # (n_rows, nodes, K d_out)
        out = left.new_empty((n_rows, n_outputs, width))
        for k in range(n_outputs if self.weight_name is not None else 0):
            by_unit = left[..., k * d_out : (k + 1) * d_out].transpose(1, 2)
            weight = out[:, k, : d_out * d_in].view(n_rows, d_out, d_in)
            torch.bmm(by_unit, inputs[0], out=weight)
        if self.bias_name is not None:
            total = left[:, 0]
            for node in range(1, left.shape[1]):
                total = total + left[:, node]
            out[..., d_out * d_in :] = total.view(n_rows, n_outputs, d_out)
        return out

    def materialise_sums(self, rows, weights, factors, n_rows):
        """Each row's weighted sum of its nodes' gradients, from the factors: one
        padded (d_out, nodes) x (nodes, d_in) product per row and output, no per-node
        gradient formed."""
        if not factored(factors):
            return super().materialise_sums(rows, weights, factors, n_rows)
        return self._integrated_gradients(rows, weights, factors, n_rows)

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Factors of each row's weighted sum of gradients over its nodes, or None.

        Node ``e`` belongs to row ``rows[e]`` with weight ``weights[e]``. The sum
        keeps the factored form when the layer's input is the same at all of a
        row's nodes (a first layer: its input is ``x``): only the deltas are
        summed, ``(a, sum_e w_e delta_e)``. Otherwise it is materialised when
        that makes the inner products that follow cheaper (``outputs_per_pair``:
        values per pair of rows they produce, 1 for a trace), and None (keep the
        nodes) when it does not.
        """
        if not factored(factors):
            return factors.row_sums(rows, weights, n_rows)
        a, deltas = factors.inputs, factors.deltas
        first = first_of_rows(rows, n_rows)
        if torch.equal(a.index_select(0, first.index_select(0, rows)), a):
            deltas = row_sums(rows, weights, deltas, n_rows)
            return FactoredGradients(a.index_select(0, first), deltas)
        # Work per pair of (row, other row). Per node: the input and delta Grams,
        # then memory-bound passes over every output value (product, node weight,
        # sum into the row), each worth ~PER_NODE_OUTPUT_COST flops on a CPU.
        # Materialised: one dense product over the layer's weights.
        n_outputs, d_out, d_in = deltas.shape[1], deltas.shape[2], a.shape[1] + 1
        products = max(n_outputs, outputs_per_pair)
        nodes_per_row = rows.numel() / n_rows
        per_node = nodes_per_row * (
            d_in + products * d_out + PER_NODE_OUTPUT_COST * outputs_per_pair
        )
        if products * d_out * d_in <= per_node:
            return Gradients(self._integrated_gradients(rows, weights, factors, n_rows))
        return None

    # -- inner products -------------------------------------------------------------

    def inner(self, left, right, mode):
        """``(a_i . a_j + 1) (delta_i . delta_j)`` from the factors,
        ``O(n m (d_in + K K' d_out))`` in PAIRS mode; materialised otherwise."""
        if factored(left, right):
            return self._factored_inner(left, right, mode)
        return contract(self.materialise(left), self.materialise(right), mode)

    def add_inner(self, left, right, mode, out):
        """``out += inner(left, right, mode)`` in fewer passes over the (n, m)
        temporaries, for a trace of factored gradients with weight and bias: the
        input Gram's ``+ 1`` from a column of ones in its product, and the delta
        Gram multiplied into ``out`` in one ``addcmul_`` (two passes over (n, m)
        fewer than ``inner`` and an addition). Same cost in multiply-adds; the
        sums round differently (the ``1`` inside the product). Otherwise as the
        protocol's default."""
        if (
            mode != OutputMode.TRACE
            or not factored(left, right)
            or self.weight_name is None
            or self.bias_name is None
        ):
            return super().add_inner(left, right, mode, out)
        a, b = left.inputs, right.inputs
        input_gram = (
            torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
            @ torch.cat([b, b.new_ones(b.shape[0], 1)], 1).T
        )
        return out.addcmul_(input_gram, contract(left.deltas, right.deltas, mode))

    def node_inner(self, nodes, weights, right, mode):
        if factored(nodes, right):
            return self._factored_inner(nodes, right, mode, weights)
        return super().node_inner(nodes, weights, right, mode)

    def _factored_inner(self, left, right, mode, weights=None):
        """``(a_i . a_j + 1) (delta_i . delta_j)``, times ``weights[i]`` if given.

        The product is taken in place in the delta Gram (the large one, K K'
        values per pair in PAIRS mode), whose memory layout it keeps: the
        weights and the input Gram meet first, at one value per pair.
        """
        a, b = left.inputs, right.inputs
        diag = mode == OutputMode.DIAG
        if self.weight_name is None:
            input_gram = a.new_zeros(a.shape[:1] if diag else (a.shape[0], b.shape[0]))
        elif diag:
            input_gram = (a * b).sum(1)
        else:
            input_gram = a @ b.T
        if self.bias_name is not None:
            input_gram += 1.0
        if weights is not None:
            input_gram *= weights.view(-1, *([1] * (input_gram.ndim - 1)))
        delta_gram = contract(left.deltas, right.deltas, mode)
        if mode == OutputMode.PAIRS:
            return delta_gram.mul_(input_gram[:, :, None, None])
        return delta_gram.mul_(input_gram)

    def dense_inner(self, dense, factors, mode):
        """Dense weight-space vectors ``dense`` (n, K, W_layer) against the factored
        gradients ``delta'_k [a', 1]^T`` of m rows.

        Each vector meets the inputs first, ``v_ko = dense_ko . [a', 1]``, one
        (m, d_in) x (d_in, n K d_out) product, then the deltas per row: the same
        flops as materialising the m K' W gradients, but n K d_out m values
        written instead of m K' d_out d_in. Used when that is less (n K < K'
        d_in: a few query rows against many training rows); otherwise the default.
        """
        if not factored(factors) or mode == OutputMode.DIAG:
            return super().dense_inner(dense, factors, mode)
        a, deltas = factors.inputs, factors.deltas
        (m, k_right, d_out), d_in = deltas.shape, a.shape[1]
        n, k_left = dense.shape[:2]
        if n * k_left >= k_right * d_in:
            return super().dense_inner(dense, factors, mode)
        if self.weight_name is not None:
            weight = dense[..., : d_out * d_in].reshape(-1, d_in)
            moved = (a @ weight.T).view(m, n * k_left, d_out)
            if self.bias_name is not None:
                moved += dense[..., -d_out:].reshape(n * k_left, d_out)
        else:
            moved = dense.reshape(1, n * k_left, d_out).expand(m, -1, -1)
        if mode == OutputMode.TRACE:  # (m, n, K d_out) x (m, K d_out, 1)
            out = torch.matmul(moved.reshape(m, n, -1), deltas.reshape(m, -1, 1))
            return out.view(m, n).T
        out = torch.matmul(moved, deltas.transpose(1, 2))  # (m, n K, K')
        return out.view(m, n, k_left, k_right).permute(1, 0, 2, 3)

    def metric_inner(self, left, right, scale, mode):
        """``<g(left row), scale * g(right row)>``, contracted per output unit.

        The gradient of output ``k`` is ``delta_k a^T`` (and ``delta_k`` for the
        bias), so with ``P_o`` and ``p_o`` unit ``o``'s rows of ``scale`` (Adam's
        preconditioner), in TRACE mode

            sum_o (sum_k delta_iko delta'_lko) (a_i . P_o a'_l + p_o):

        per block of units, one (d_out n, d_in) x (d_in, m) product of weighted
        inputs, a batched (n, K) x (K, m) product per unit, then one pass over
        (d_out, n, m): ``O(n m d_out (d_in + K))`` instead of the materialised
        ``O(n m K d_out d_in)``. Other modes, materialised factors, a layer
        without its weight in the path, and one or two outputs (where
        materialising costs no more) take the default.
        """
        if mode != OutputMode.TRACE or not factored(left, right) or self.weight_name is None:
            return super().metric_inner(left, right, scale, mode)
        a, b, deltas, deltas_r = left.inputs, right.inputs, left.deltas, right.deltas
        (n, n_outputs, d_out), d_in = deltas.shape, a.shape[1]
        if n_outputs * d_in <= d_in + 2 * n_outputs:
            return super().metric_inner(left, right, scale, mode)
        weight = scale[: d_out * d_in].view(d_out, d_in)
        bias = scale[d_out * d_in :] if self.bias_name is not None else None
        out = a.new_zeros(n, b.shape[0])
        # unit-major and contiguous, for the batched products
        by_unit = deltas.permute(2, 0, 1).contiguous()  # (d_out, n, K)
        by_unit_r = deltas_r.permute(2, 1, 0).contiguous()  # (d_out, K, m)
        step = rows_per_tile(d_out, 2 * a.element_size() * n * b.shape[0])
        for begin in range(0, d_out, step):
            units = slice(begin, begin + step)
            weighted = (a[None] * weight[units][:, None]).reshape(-1, d_in)
            inputs = (weighted @ b.T).view(-1, n, b.shape[0])  # (c, n, m)
            if bias is not None:
                inputs += bias[units][:, None, None]
            out += torch.bmm(by_unit[units], by_unit_r[units]).mul_(inputs).sum(0)
        return out

    # -- output subspaces -------------------------------------------------------------

    def output_subspace(self, factors, n_left):
        """The span of each unit's K-vectors ``delta[:, o]`` over these rows (see
        :mod:`~sklearn_pathkernel._engine._output_subspace`): two directions per unit
        for the last two layers of a classifier, whatever ``K``. None for
        materialised gradients."""
        if not factored(factors):
            return None
        return OutputSubspace.of(factors.deltas, n_left)

    def project_outputs(self, factors, subspace):
        """Deltas, or materialised gradients (weight then bias, per unit), projected
        unit by unit."""
        if factored(factors):
            return FactoredGradients(factors.inputs, subspace.project(factors.deltas))
        grads = factors.grads
        n, n_outputs = grads.shape[:2]
        d_out = self.module.out_features
        parts = []
        if self.weight_name is not None:
            weight = grads[..., : d_out * self.module.in_features].view(n, n_outputs, d_out, -1)
            parts.append(subspace.project(weight).flatten(2))
        if self.bias_name is not None:
            parts.append(subspace.project(grads[..., -d_out:]))
        return Gradients(torch.cat(parts, dim=2))

    # -- directional derivatives ----------------------------------------------------------

    def directional(self, factors, direction):
        """``<g_k(x), direction>`` per row and output, (n, K): ``delta_k . (dW a + db)``,
        ``O(n (d_out d_in + K d_out))`` from the factors."""
        if not factored(factors):
            return factors.directional(self.flatten(direction))
        deltas = factors.deltas
        moved = torch.zeros(deltas.shape[::2], dtype=deltas.dtype, device=deltas.device)
        if self.weight_name is not None:
            moved = factors.inputs @ direction[self.weight_name].T
        if self.bias_name is not None:
            moved = moved + direction[self.bias_name]
        return torch.einsum("nko,no->nk", factors.deltas, moved)
