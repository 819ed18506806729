"""Per-layer rules: inner products of per-example gradients without Jacobians.

For a layer with parameters ``theta`` and input ``a``, the per-example gradient of
an output ``f_k`` is a function of ``a`` and of ``delta_k = d f_k / d(layer output)``
only. Each rule turns the captured ``(a, delta)`` of a batch into *factors* and
computes inner products between the factors of two batches:

- Linear: ``<g_i, g_j> = (a_i . a_j + 1) (delta_i . delta_j)`` (the ``+1`` is the
  bias), never forming the ``d_out x d_in`` gradient.
- Conv2d: the per-example weight gradient ``delta @ unfold(a)^T`` is formed per
  layer (it is small: one kernel's worth of weights), then contracted.
- Anything else with parameters: per-example gradients by ``torch.func``
  (``vmap`` of ``grad``), then contracted.

Factors hold ``delta`` for several outputs at once: shape (n, n_outputs, ...).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from .._output_subspace import OutputSubspace
from .._planning import rows_per_tile
from ._contract import contract as _contract
from ._distance import make_distance_rule
from ._protocol import LayerRule, RowEvaluation


class Factors:
    """Per-layer factors of a batch: either ``(inputs, deltas)`` or materialised grads."""

    __slots__ = ("inputs", "deltas", "grads")

    def __init__(self, inputs=None, deltas=None, grads=None):
        self.inputs, self.deltas, self.grads = inputs, deltas, grads

    @staticmethod
    def cat(parts):
        """Stack the rows of several Factors of the same layer."""
        fields = zip(*((p.inputs, p.deltas, p.grads) for p in parts), strict=True)
        return Factors(*(None if f[0] is None else torch.cat(f) for f in fields))

    def take(self, rows):
        """The factors of a subset of rows."""
        return Factors(
            *(None if f is None else f[rows] for f in (self.inputs, self.deltas, self.grads))
        )

    @property
    def nbytes(self):
        """Memory held by the factors."""
        return sum(f.nbytes for f in (self.inputs, self.deltas, self.grads) if f is not None)


def row_sums(rows, weights, values, n_rows):
    """``out[r] = sum of weights[e] * values[e] over the e with rows[e] == r``."""
    scaled = weights.view(-1, *([1] * (values.ndim - 1))) * values
    return values.new_zeros((n_rows, *values.shape[1:])).index_add_(0, rows, scaled)


def row_outer_sums(rows, left, right, n_rows):
    """``out[r] = sum of outer(left[e], right[e]) over the e with rows[e] == r``.

    ``left`` (E, P), ``right`` (E, Q) -> (n_rows, P, Q), as one batched matrix
    product: each row's entries are gathered into a zero-padded block, instead of
    forming the (E, P, Q) outer products.
    """
    order = torch.argsort(rows, stable=True)
    sorted_rows = rows[order]
    counts = torch.bincount(rows, minlength=n_rows)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(rows.numel(), device=rows.device) - starts[sorted_rows]
    width = int(counts.max()) if rows.numel() else 0
    blocks = []
    for values in (left, right):
        block = values.new_zeros((n_rows, width, values.shape[1]))
        block[sorted_rows, position] = values[order]
        blocks.append(block)
    return blocks[0].transpose(1, 2) @ blocks[1]


def first_of_rows(rows, n_rows):
    """Per row, the position of its first entry in ``rows`` (rows without entries:
    the last position, so that indexing stays valid)."""
    positions = torch.arange(rows.numel(), device=rows.device)
    first = torch.full((n_rows,), rows.numel() - 1, dtype=positions.dtype, device=rows.device)
    return first.scatter_reduce_(0, rows, positions, "amin")


def _flat_direction(direction, names):
    return torch.cat([direction[name].reshape(-1) for name in names if name is not None])


# Flops a memory-bound pass over one output value is worth next to a dense matrix
# product. It decides per-node vs materialised sums; 32 makes the cost model pick
# the faster form in both cases timed on the paper's toy (its 64-3 output layer,
# ~4 nodes per row): per node for a trace, materialised for every output pair.
PER_NODE_OUTPUT_COST = 32


class LinearRule(LayerRule):
    """``nn.Linear`` on 2-D input: factored form, cost O(n m (d_in + K d_out))."""

    # Linear in its weights: a row at w + t dw adds t times the layer applied with dw.
    row_evaluation = RowEvaluation.MOVED_OUTPUT

    def __init__(self, module, weight_name, bias_name):
        self.module = module
        self.weight_name, self.bias_name = weight_name, bias_name
        self.path_names = [name for name in (weight_name, bias_name) if name is not None]

    def materialise(self, factors):
        return self._materialised(factors)

    def flatten(self, weights):
        return _flat_direction(weights, self.path_names)

    def zero_weight(self):
        return torch.zeros_like(self.module.weight)

    def moved_output(self, inputs, steps):
        """The layer applied with the weight change ``steps`` (it is linear in them)."""
        weight = steps[self.weight_name] if self.weight_name else None
        bias = steps[self.bias_name] if self.bias_name else None
        if weight is None:
            return torch.zeros_like(F.linear(inputs[0], self.zero_weight())) + bias
        return F.linear(inputs[0], weight, bias)

    def factors(self, inputs, delta, params):
        a = inputs[0]
        if a.ndim == 2:
            return Factors(inputs=a, deltas=delta)
        # Applied along extra axes (sequence, pixels): sum the outer products.
        return Factors(grads=self._gradients(a, delta))

    def _gradients(self, a, delta):
        """Materialised per-example gradients (n, K, W_layer), weight then bias,
        summed over any axes between the batch and the features."""
        parts = []
        if self.weight_name is not None:
            parts.append(torch.einsum("nk...o,n...i->nkoi", delta, a).flatten(2))
        if self.bias_name is not None:
            parts.append(delta.reshape(*delta.shape[:2], -1, delta.shape[-1]).sum(2))
        return torch.cat(parts, dim=2)

    def _materialised(self, factors):
        if factors.grads is not None:
            return factors.grads
        return self._gradients(factors.inputs, factors.deltas)

    def _integrated_gradients(self, rows, weights, factors, n_rows):
        """Each row's weighted sum of its nodes' gradients, (n_rows, K, W_layer):
        ``sum_e (weights_e delta_e)^T [a_e, 1]``, one padded product per row."""
        deltas = weights[:, None, None] * factors.deltas  # (E, K, d_out)
        n_nodes, n_outputs, d_out = deltas.shape
        a = factors.inputs
        columns = [a] if self.weight_name is not None else []
        if self.bias_name is not None:
            columns.append(torch.ones((n_nodes, 1), dtype=a.dtype, device=a.device))
        sums = row_outer_sums(rows, deltas.reshape(n_nodes, -1), torch.cat(columns, 1), n_rows)
        sums = sums.view(n_rows, n_outputs, d_out, -1)
        parts = []
        if self.weight_name is not None:
            parts.append(sums[..., : a.shape[1]].flatten(2))
        if self.bias_name is not None:
            parts.append(sums[..., -1])
        return torch.cat(parts, dim=2)

    def materialise_sums(self, rows, weights, factors, n_rows):
        """Each row's weighted sum of its nodes' gradients, from the factors: one
        padded (K d_out, nodes) x (nodes, d_in + 1) product per row, no per-node
        gradient formed."""
        if factors.grads is not None:
            return super().materialise_sums(rows, weights, factors, n_rows)
        return self._integrated_gradients(rows, weights, factors, n_rows)

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Factors of each row's weighted sum of gradients over its nodes, or None.

        Node ``e`` belongs to row ``rows[e]`` with weight ``weights[e]``. The sum
        keeps the factored form when the layer's input is the same at all of a
        row's nodes (a first layer: its input is ``x``): only the deltas are
        summed. Otherwise it is materialised when that makes the inner products
        that follow cheaper (``outputs_per_pair``: values per pair of rows they
        produce, 1 for a trace), and None (keep the nodes) when it does not.
        """
        if factors.grads is not None:
            return Factors(grads=row_sums(rows, weights, factors.grads, n_rows))
        a, deltas = factors.inputs, factors.deltas
        first = first_of_rows(rows, n_rows)
        if torch.equal(a[first[rows]], a):
            return Factors(inputs=a[first], deltas=row_sums(rows, weights, deltas, n_rows))
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
            return Factors(grads=self._integrated_gradients(rows, weights, factors, n_rows))
        return None

    def inner(self, left, right, mode):
        if left.grads is not None or right.grads is not None:
            return _contract(self._materialised(left), self._materialised(right), mode)
        return self._factored_inner(left, right, mode)

    def node_inner(self, nodes, weights, right, mode):
        if nodes.grads is not None or right.grads is not None:
            return super().node_inner(nodes, weights, right, mode)
        return self._factored_inner(nodes, right, mode, weights)

    def _factored_inner(self, left, right, mode, weights=None):
        """``(a_i . a_j + 1) (delta_i . delta_j)``, times ``weights[i]`` if given.

        The product is taken in place in the delta Gram (the large one, K K'
        values per pair in "pairs" mode), whose memory layout it keeps: the
        weights and the input Gram meet first, at one value per pair.
        """
        a, b = left.inputs, right.inputs
        if self.weight_name is None:
            input_gram = a.new_zeros(a.shape[:1] if mode == "diag" else (a.shape[0], b.shape[0]))
        elif mode == "diag":
            input_gram = (a * b).sum(1)
        else:
            input_gram = a @ b.T
        if self.bias_name is not None:
            input_gram += 1.0
        if weights is not None:
            input_gram *= weights.view(-1, *([1] * (input_gram.ndim - 1)))
        delta_gram = _contract(left.deltas, right.deltas, mode)
        if mode == "pairs":
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
        if factors.grads is not None or mode == "diag":
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
        if mode == "trace":  # (m, n, K d_out) x (m, K d_out, 1)
            out = torch.matmul(moved.reshape(m, n, -1), deltas.reshape(m, -1, 1))
            return out.view(m, n).T
        out = torch.matmul(moved, deltas.transpose(1, 2))  # (m, n K, K')
        return out.view(m, n, k_left, k_right).permute(1, 0, 2, 3)

    def output_subspace(self, factors, n_left):
        """The span of each unit's K-vectors ``delta[:, o]`` over these rows (see
        :mod:`~sklearn_pathkernel._engine._output_subspace`): two directions per unit
        for the last two layers of a classifier, whatever ``K``."""
        if factors.grads is not None:
            return None
        return OutputSubspace.of(factors.deltas, n_left)

    def project_outputs(self, factors, subspace):
        """Deltas, or materialised gradients (weight then bias, per unit), projected
        unit by unit."""
        if factors.grads is None:
            return Factors(inputs=factors.inputs, deltas=subspace.project(factors.deltas))
        grads = factors.grads
        n, n_outputs = grads.shape[:2]
        d_out = self.module.out_features
        parts = []
        if self.weight_name is not None:
            weight = grads[..., : d_out * self.module.in_features].view(n, n_outputs, d_out, -1)
            parts.append(subspace.project(weight).flatten(2))
        if self.bias_name is not None:
            parts.append(subspace.project(grads[..., -d_out:]))
        return Factors(grads=torch.cat(parts, dim=2))

    def metric_inner(self, left, right, scale, mode):
        """``<g(left row), scale * g(right row)>``, contracted per output unit.

        The gradient of output ``k`` is ``delta_k a^T`` (and ``delta_k`` for the
        bias), so with ``P_o`` and ``p_o`` unit ``o``'s rows of ``scale`` (Adam's
        preconditioner), in "trace" mode

            sum_o (sum_k delta_iko delta'_lko) (a_i . P_o a'_l + p_o):

        per block of units, one (d_out n, d_in) x (d_in, m) product of weighted
        inputs, a batched (n, K) x (K, m) product per unit, then one pass over
        (d_out, n, m): ``O(n m d_out (d_in + K))`` instead of the materialised
        ``O(n m K d_out d_in)``. Other modes, materialised factors, a layer
        without its weight in the path, and one or two outputs (where
        materialising costs no more) take the default.
        """
        if (
            mode != "trace"
            or left.grads is not None
            or right.grads is not None
            or self.weight_name is None
        ):
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

    def directional(self, factors, direction):
        """``<g_k(x), direction>`` per row and output: (n, K)."""
        if factors.grads is not None:
            step = _flat_direction(direction, (self.weight_name, self.bias_name))
            return factors.grads @ step
        deltas = factors.deltas
        moved = torch.zeros(deltas.shape[::2], dtype=deltas.dtype, device=deltas.device)
        if self.weight_name is not None:
            moved = factors.inputs @ direction[self.weight_name].T
        if self.bias_name is not None:
            moved = moved + direction[self.bias_name]
        return torch.einsum("nko,no->nk", factors.deltas, moved)


class Conv2dRule(LayerRule):
    """``nn.Conv2d``: per-example gradients from the unfolded input (im2col).

    With columns ``u_p`` (the unfolded input at output position ``p``, plus a
    constant 1 for the bias) and back-propagated gradients ``delta_p``, the
    per-example gradient is ``sum_p delta_p u_p^T``, and

        <g_i, g_j> = sum_{p, q} (u_ip . u_jq) (delta_ip . delta_jq).

    The factored form costs ``P^2 (d_in + d_out)`` per pair of rows (``P``
    positions), the materialised one ``d_out d_in`` plus ``d_out d_in`` numbers
    per row and output: factored is chosen when it is cheaper, typically for late
    layers with many channels on few positions.
    """

    # Linear in its weights: a row at w + t dw adds t times the layer applied with dw.
    row_evaluation = RowEvaluation.MOVED_OUTPUT

    def __init__(self, module, weight_name, bias_name):
        self.module = module
        self.weight_name, self.bias_name = weight_name, bias_name
        self.path_names = [name for name in (weight_name, bias_name) if name is not None]

    def materialise(self, factors):
        return _materialised(factors)

    def flatten(self, weights):
        """Per output channel: its kernel's weights, then its bias (the column layout)."""
        return self._step_matrix(weights).reshape(-1)

    def moved_output(self, inputs, steps):
        """The convolution applied with the weight change ``steps`` (it is linear in them)."""
        conv = self.module
        weight = steps[self.weight_name] if self.weight_name else torch.zeros_like(conv.weight)
        bias = steps[self.bias_name] if self.bias_name else None
        return F.conv2d(inputs[0], weight, bias, conv.stride, conv.padding, conv.dilation)

    def _columns(self, x, n_positions):
        """(n, d_in', P): unfolded input, with a row of ones when the bias is in the path."""
        conv, parts = self.module, []
        if self.weight_name is not None:
            parts.append(F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride))
        if self.bias_name is not None:
            parts.append(torch.ones((x.shape[0], 1, n_positions), dtype=x.dtype, device=x.device))
        return torch.cat(parts, dim=1)

    def _step_matrix(self, direction):
        """The weight change as (d_out, d_in'), laid out like the columns."""
        parts = []
        if self.weight_name is not None:
            weight = direction[self.weight_name]
            parts.append(weight.reshape(weight.shape[0], -1))
        if self.bias_name is not None:
            parts.append(direction[self.bias_name][:, None])
        return torch.cat(parts, dim=1)

    @staticmethod
    def factored_is_cheaper(n_positions, d_in, d_out):
        """Per pair of rows: ``P^2 (d_in + d_out)`` (factored) vs ``d_in d_out``."""
        return n_positions**2 * (d_in + d_out) < d_in * d_out

    def factors(self, inputs, delta, params):
        delta = delta.flatten(3)  # (n, K, C_out, H_out, W_out) -> (n, K, C_out, P)
        columns = self._columns(inputs[0], delta.shape[-1])  # (n, d_in', P)
        if self.factored_is_cheaper(delta.shape[-1], columns.shape[1], delta.shape[2]):
            return Factors(inputs=columns, deltas=delta)
        return Factors(grads=_conv_grads(columns, delta))

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Each row's weighted sum of materialised gradients over its nodes (None
        for the factored form: its columns change from node to node)."""
        if factors.grads is None:
            return None
        return Factors(grads=row_sums(rows, weights, factors.grads, n_rows))

    def inner(self, left, right, mode):
        if left.grads is not None or right.grads is not None:
            return _contract(_materialised(left), _materialised(right), mode)
        return _factored_conv_inner(left.inputs, left.deltas, right.inputs, right.deltas, mode)

    def directional(self, factors, direction):
        step = self._step_matrix(direction)  # (d_out, d_in')
        if factors.grads is not None:
            return factors.grads @ step.reshape(-1)
        moved = torch.einsum("od,ndp->nop", step, factors.inputs)
        return torch.einsum("nkop,nop->nk", factors.deltas, moved)


def _conv_grads(columns, delta):
    """Materialised per-example gradients (n, K, d_out * d_in') of a convolution."""
    return torch.einsum("nkop,nip->nkoi", delta, columns).flatten(2)


def _materialised(factors):
    return (
        factors.grads if factors.grads is not None else _conv_grads(factors.inputs, factors.deltas)
    )


# Memory for one chunk of the factored convolution's (rows, rows, P, P) intermediates.
_CONV_CHUNK_BYTES = 64 * 2**20


def _factored_conv_inner(u, du, v, dv, mode):
    """``sum_{p,q} (u_ip . v_jq) (du_ikp . dv_jk'q)`` in ``mode`` (see ``_contract``).

    ``u`` (n, d, P) and ``v`` (m, d, Q) are columns; ``du`` (n, K, o, P) and
    ``dv`` (m, K', o, Q) back-propagated gradients. Rows of the left side are
    taken in chunks so the (chunk, m, P, Q) intermediates stay small.
    """
    if mode == "diag":
        columns = torch.einsum("ndp,ndq->npq", u, v)
        deltas = torch.einsum("nkop,nkoq->npq", du, dv)
        return (columns * deltas).sum((1, 2))
    n, m = u.shape[0], v.shape[0]
    P, Q, K, J, o = u.shape[-1], v.shape[-1], du.shape[1], dv.shape[1], du.shape[2]
    # Per left row: the (m, P, Q) column Gram and the (K, P) x (m, J, Q) delta Gram.
    width = m * P * Q * (2 if mode == "trace" else 1 + K * J)
    chunk = max(1, int(_CONV_CHUNK_BYTES // (8 * max(width, 1))))
    right = dv.permute(0, 1, 3, 2).reshape(m * J * Q, o)  # rows (j, q) of each right row
    parts = []
    for begin in range(0, n, chunk):
        rows = slice(begin, begin + chunk)
        columns = torch.einsum("cdp,mdq->cmpq", u[rows], v)
        if mode == "trace":
            deltas = torch.einsum("ckop,mkoq->cmpq", du[rows], dv)
            parts.append((columns * deltas).sum((2, 3)))
            continue
        c = columns.shape[0]
        left = du[rows].permute(0, 1, 3, 2).reshape(c * K * P, o)
        deltas = (left @ right.T).view(c, K, P, m, J, Q)  # one matrix product
        parts.append(torch.einsum("cmpq,ckpmjq->cmkj", columns, deltas))
    if not parts:
        shape = (0, m) if mode == "trace" else (0, m, K, J)
        return torch.zeros(shape, dtype=u.dtype, device=u.device)
    return torch.cat(parts)


class GenericRule(LayerRule):
    """Any module with parameters: per-example gradients via ``torch.func``.

    Only the module's own (direct) parameters are differentiated; the forward
    must treat batch rows independently.
    """

    # No per-row form: its factors re-run the module at one set of weights.
    row_evaluation = RowEvaluation.NONE

    def __init__(self, module, local_names, path_names):
        self.module = module
        self.local_names = local_names  # names inside the module
        self.path_names = path_names  # the same parameters' names in the path

    def factors(self, inputs, delta, params):
        module, names = self.module, self.local_names
        theta = {
            name: params[full].detach() for name, full in zip(names, self.path_names, strict=False)
        }
        constants = {
            name: value.detach()
            for name, value in module.named_parameters(recurse=False)
            if name not in theta
        }

        def output_dot(theta, args, cotangent):
            batched = tuple(arg.unsqueeze(0) for arg in args)
            out = functional_call(module, {**constants, **theta}, batched)
            return (out.squeeze(0) * cotangent).sum()

        # One vmap over (example, output) pairs. (A nested vmap over the outputs,
        # with unbatched inputs, hits wrong batching rules, e.g. for cdist.)
        n, k = delta.shape[:2]
        pairs = tuple(arg.repeat_interleave(k, dim=0) for arg in inputs)
        per_pair = vmap(grad(output_dot), in_dims=(None, 0, 0))
        grads = per_pair(theta, pairs, delta.reshape(n * k, *delta.shape[2:]))
        return Factors(grads=torch.cat([grads[name].reshape(n, k, -1) for name in names], 2))

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Each row's weighted sum of gradients over its nodes."""
        return Factors(grads=row_sums(rows, weights, factors.grads, n_rows))

    def inner(self, left, right, mode):
        return _contract(left.grads, right.grads, mode)

    def materialise(self, factors):
        return factors.grads

    def flatten(self, weights):
        return _flat_direction(weights, self.path_names)

    def directional(self, factors, direction):
        return factors.grads @ self.flatten(direction)


def make_rule(module, prefix, path_names):
    """The rule for ``module``'s direct parameters that are part of the path, or None."""
    local = [name for name, _ in module.named_parameters(recurse=False)]
    in_path = [name for name in local if f"{prefix}{name}" in path_names]
    if not in_path:
        return None
    full = {name: f"{prefix}{name}" for name in in_path}
    exact_type = type(module)
    if exact_type in (nn.Linear, nn.Conv2d) and set(local) <= {"weight", "bias"}:
        rule = LinearRule if exact_type is nn.Linear else Conv2dRule
        supported = exact_type is nn.Linear or (
            module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
        if supported:
            return rule(module, full.get("weight"), full.get("bias"))
    distance_rule = make_distance_rule(module, full)
    if distance_rule is not None:
        return distance_rule
    return GenericRule(module, in_path, [full[name] for name in in_path])
