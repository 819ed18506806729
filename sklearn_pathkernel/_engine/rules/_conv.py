"""The rule of ``nn.Conv2d``: per-example gradients from the unfolded input (im2col).

With columns ``u_p`` (the unfolded input at output position ``p``, plus a
constant 1 for the bias) and back-propagated cotangents ``delta_p``, the
per-example gradient is ``g_k = sum_p delta_kp u_p^T``, and

    <g_ik, g_jk'> = sum_{p, q} (u_ip . u_jq) (delta_ikp . delta_jk'q).

The factored form costs ``P^2 (d_in + d_out)`` per pair of rows (``P``
positions), the materialised one ``d_out d_in`` (plus ``d_out d_in`` numbers per
row and output to form): the rule picks the factored form when it is cheaper,
typically for late layers with many channels on few positions, and the
materialised one (the gradient formed per layer: one kernel's worth of
weights) otherwise.
"""

from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from .._modes import OutputMode
from ._contract import contract
from ._gradients import FactoredGradients, Gradients, WeightAndBiasRule, factored
from ._registry import register_rule
from ._rows import first_of_rows, row_sums

# Memory for one chunk of the factored convolution's (rows, rows, P, P) intermediates.
_CONV_CHUNK_BYTES = 64 * 2**20


@register_rule(nn.Conv2d)
class Conv2dRule(WeightAndBiasRule):
    """``nn.Conv2d`` (one group, zero padding given as numbers).

    Factors are :class:`FactoredGradients` of the columns (n, d_in', P) and the
    cotangents (n, K, d_out, P), or :class:`ConvGradients`: the gradients (n, K,
    d_out d_in'), per output channel its kernel's weights then its bias, formed
    from the same columns and cotangents when first needed (a first convolution's
    quadrature nodes are summed per row before: its columns do not move).
    """

    integrates_gradients = True  # (materialised factors: ``row_sums``)

    @classmethod
    def for_module(cls, module, names):
        local = {name for name, _ in module.named_parameters(recurse=False)}
        supported = (
            local <= {"weight", "bias"}
            and module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
        return cls(module, names.get("weight"), names.get("bias")) if supported else None

    def materialise(self, factors):
        if factored(factors):
            return _conv_grads(factors.inputs, factors.deltas)
        return factors.grads

    def flatten(self, weights):
        """Per output channel: its kernel's weights, then its bias (the column layout)."""
        return self._step_matrix(weights).reshape(-1)

    def moved_output(self, inputs, steps):
        """The convolution applied with the weight change ``steps`` (it is linear in them)."""
        conv = self.module
        weight = steps[self.weight_name] if self.weight_name else torch.zeros_like(conv.weight)
        bias = steps[self.bias_name] if self.bias_name else None
        return F.conv2d(inputs[0], weight, bias, conv.stride, conv.padding, conv.dilation)

    def row_output(self, inputs, weights):
        """The output with row ``i`` at its own kernel ``W + t_i dW`` (and bias
        ``b + t_i db``): one grouped convolution, a group per row, where the output
        at ``W`` plus ``t_i`` times the moved output takes two convolutions of the
        same size. Rows at ``t_i = 0`` take the layer's own convolution (its
        values bit for bit)."""
        if not weights.moving or len(inputs) != 1 or inputs[0].ndim != 4:
            return None
        conv, x = self.module, inputs[0]
        t = weights.t.to(x.dtype)
        still = t == 0
        if bool(still.all()):
            return None
        moving = ~still
        some_still = bool(still.any())
        rows, t = (x[moving], t[moving]) if some_still else (x, t)
        n = rows.shape[0]
        if self.weight_name is None:
            kernel = conv.weight.expand(n, *conv.weight.shape)
        else:
            step = weights.steps[self.weight_name]
            kernel = weights.params[self.weight_name] + t.view(-1, 1, 1, 1, 1) * step
        bias = conv.bias
        if self.bias_name is not None:
            bias = weights.params[self.bias_name] + t.view(-1, 1) * weights.steps[self.bias_name]
        elif bias is not None:
            bias = bias.expand(n, *bias.shape)
        out = F.conv2d(
            rows.reshape(1, -1, *rows.shape[2:]),
            kernel.reshape(-1, *kernel.shape[2:]),
            None if bias is None else bias.reshape(-1),
            conv.stride,
            conv.padding,
            conv.dilation,
            n,
        )
        out = out.view(n, -1, *out.shape[2:])
        if not some_still:
            return out
        own = conv._conv_forward(x[still], conv.weight, conv.bias)
        result = out.new_empty((x.shape[0], *out.shape[1:]))
        result[still] = own
        result[moving] = out
        return result

    def input_vjp(self, inputs, weights):
        """The input's cotangents through the convolution at each row's own kernel
        ``W + t_i dW``: one grouped convolution's input gradient over the ``K``
        cotangents, a group per row, where the output at ``W`` plus ``t_i`` times
        the moved output would take two (the same sum, rounded once less)."""
        if not weights.moving or inputs[0].ndim != 4:
            return None
        conv, x = self.module, inputs[0]
        if self.weight_name is None:
            kernel = conv.weight.expand(x.shape[0], *conv.weight.shape)
        else:
            kernel = weights.params[self.weight_name] + weights.t.to(x.dtype).view(
                -1, 1, 1, 1, 1
            ) * weights.steps[self.weight_name].unsqueeze(0)
        n, d_out = kernel.shape[0], kernel.shape[1]
        kernel = kernel.reshape(n * d_out, *kernel.shape[2:])
        shape = x.shape

        def vjp(cotangents):  # (K, n, d_out, h, w) -> (K, n, d_in, H, W)
            k = cotangents.shape[0]
            stacked = cotangents.reshape(k, n * d_out, *cotangents.shape[3:])
            gradient = torch.ops.aten.convolution_backward(
                stacked,
                stacked.new_empty((k, n * shape[1], *shape[2:])),  # (its shape only)
                kernel,
                None,
                conv.stride,
                conv.padding,
                conv.dilation,
                False,
                [0, 0],
                n,
                [True, False, False],
            )[0]
            return gradient.view(k, *shape)

        return vjp

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

    def factors(self, inputs, delta, weights):
        """Columns and cotangents, or the gradients ``sum_p delta_p u_p^T`` when
        that is cheaper (:meth:`factored_is_cheaper`)."""
        delta = delta.flatten(3)  # (n, K, C_out, H_out, W_out) -> (n, K, C_out, P)
        columns = self._columns(inputs[0], delta.shape[-1])  # (n, d_in', P)
        if self.factored_is_cheaper(delta.shape[-1], columns.shape[1], delta.shape[2]):
            return FactoredGradients(columns, delta)
        return ConvGradients(columns, delta)

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Each row's weighted sum of materialised gradients over its nodes (None
        for the factored form: its columns change from node to node). Where a
        row's columns are the same at all its nodes (a first convolution: they
        are ``x``'s), the cotangents are summed first and the gradients formed
        once per row, ``sum_e w_e g_e = sum_p (sum_e w_e delta_ep) u_p^T``."""
        if factored(factors):
            return None
        return factors.row_sums(rows, weights, n_rows)

    def integrate_chunks(self, chunks, n_rows, outputs_per_pair=1):
        """:meth:`integrate` of the nodes of all ``chunks``, chunk by chunk, without
        joining them: the cotangents of a first convolution (``E x K x d_out x P``
        numbers, 325 MiB a step for one 28x28 query of a 16-channel convolution)
        are never copied into one tensor (see :meth:`ConvGradients.summed`)."""
        chunks = [chunk for chunk in chunks if chunk[0].numel()]
        if not chunks or any(factored(f) for _, _, f in chunks):
            return None
        return ConvGradients.summed(chunks, n_rows)

    def inner(self, left, right, mode):
        """The factored sum over position pairs when both sides are factored
        (``O(n m P Q (d_in' + K K' d_out))`` in PAIRS mode), else a contraction
        of the gradients (``O(n m K K' d_out d_in')``)."""
        if factored(left, right):
            return _factored_conv_inner(left.inputs, left.deltas, right.inputs, right.deltas, mode)
        return contract(self.materialise(left), self.materialise(right), mode)

    def directional(self, factors, direction):
        """``sum_p delta_kp . (dW u_p)`` per row and output, (n, K)."""
        step = self._step_matrix(direction)  # (d_out, d_in')
        if not factored(factors):
            return factors.directional(step.reshape(-1))
        moved = torch.einsum("od,ndp->nop", step, factors.inputs)
        return torch.einsum("nkop,nop->nk", factors.deltas, moved)


class ConvGradients(Gradients):
    """A convolution's per-example gradients, kept as the columns (n, d_in', P)
    and cotangents (n, K, d_out, P) they are formed from; ``grads`` (n, K,
    d_out d_in') formed when first asked for (``O(n K d_out d_in' P)``), then
    kept: :class:`Gradients` to every reader.
    """

    def __init__(self, columns, deltas):  # (frozen: set once, here)
        object.__setattr__(self, "columns", columns)
        object.__setattr__(self, "deltas", deltas)

    def __repr__(self):
        shapes = f"columns={tuple(self.columns.shape)}, deltas={tuple(self.deltas.shape)}"
        return f"ConvGradients({shapes})"

    @cached_property
    def grads(self):
        return _conv_grads(self.columns, self.deltas)

    def take(self, rows):
        """The gradients of a subset of rows."""
        return ConvGradients(self.columns[rows], self.deltas[rows])

    @staticmethod
    def cat(parts):
        """Stack the rows of several batches of the same layer."""
        return ConvGradients(
            torch.cat([part.columns for part in parts]), torch.cat([part.deltas for part in parts])
        )

    @property
    def nbytes(self):
        """Memory held: the columns and cotangents, and the gradients once formed."""
        formed = self.__dict__.get("grads")
        extra = 0 if formed is None else formed.nbytes
        return self.columns.nbytes + self.deltas.nbytes + extra

    def inner(self, other, mode):
        """See :meth:`Gradients.inner`."""
        return contract(self.grads, other.grads, mode)

    def directional(self, step):
        """``<g_k, step>`` per row and output, (n, K), for a flat ``step`` (W_layer,)
        laid out (d_out, d_in'): ``sum_p delta_kp . (step u_p)``, no gradient formed."""
        step = step.view(self.deltas.shape[2], self.columns.shape[1])
        moved = torch.einsum("od,ndp->nop", step, self.columns)
        return torch.einsum("nkop,nop->nk", self.deltas, moved)

    def row_sums(self, rows, weights, n_rows):
        """Each row's weighted sum of its nodes' gradients: the cotangents summed
        first where the row's columns are the same at all its nodes."""
        return ConvGradients.summed([(rows, weights, self)], n_rows)

    @staticmethod
    def summed(chunks, n_rows):
        """Each row's weighted sum of its nodes' gradients over several chunks of
        nodes ``(rows, weights, ConvGradients)``, none of them copied into one.

        Where every row's columns are the same at all its nodes, in all chunks
        (a first convolution), the cotangents are summed and the columns kept
        (:class:`ConvGradients`); otherwise the gradients are summed without
        forming them node by node (:class:`Gradients`): per row, one matrix
        product over its nodes and positions at once (:func:`_weighted_grads`).
        The values are those of :func:`row_sums` of the joined chunks' formed
        gradients, up to the order of the sums.
        """
        columns = _shared_columns(chunks, n_rows)
        if columns is not None:
            deltas = sum(_weighted_sums(rows, w, f.deltas, n_rows) for rows, w, f in chunks)
            return ConvGradients(columns, deltas)
        return Gradients(sum(_weighted_grads(rows, w, f, n_rows) for rows, w, f in chunks))


def _shared_columns(chunks, n_rows):
    """(n_rows, d_in', P): each row's columns when they are the same at all its
    nodes in all ``chunks`` (rows without nodes: zeros), else None."""
    reference, present = None, None
    for rows, _, factors in chunks:
        if not rows.numel():
            continue
        first = first_of_rows(rows, n_rows)
        columns = factors.columns[first]
        # (one column entry first: a moving input differs there already)
        if not (
            torch.equal(columns[rows, 0], factors.columns[:, 0])
            and torch.equal(columns[rows], factors.columns)
        ):
            return None
        here = torch.bincount(rows, minlength=n_rows) > 0
        if reference is None:
            reference = torch.zeros_like(columns)
            present = torch.zeros_like(here)
        both = present & here
        if not torch.equal(reference[both], columns[both]):
            return None
        new = here & ~present
        reference[new] = columns[new]
        present |= here
    return reference


def _row_segments(rows, n_rows):
    """``(row, slice)`` of each row's nodes when the nodes come sorted by row
    (their usual order), else None."""
    if rows.numel() > 1 and bool((rows[1:] < rows[:-1]).any()):
        return None
    counts = torch.bincount(rows, minlength=n_rows).tolist()
    segments, begin = [], 0
    for row, count in enumerate(counts):
        if count:
            segments.append((row, slice(begin, begin + count)))
        begin += count
    return segments


def _weighted_sums(rows, weights, values, n_rows):
    """:func:`row_sums` of ``values`` (E, K, ...) without a scaled copy of them: per
    row, one product of its weights with its nodes' values."""
    segments = _row_segments(rows, n_rows)
    if segments is None:
        return row_sums(rows, weights, values, n_rows)
    dtype = torch.promote_types(weights.dtype, values.dtype)
    out = values.new_zeros((n_rows, *values.shape[1:]), dtype=dtype)
    for row, nodes in segments:
        part = values[nodes].to(dtype)
        # (E, K, F) taken as (K, E, F): the probe's cotangents are laid out
        # output first, and a batched product reads them in place
        part = part.reshape(*part.shape[:2], -1).transpose(0, 1)
        out[row] = torch.matmul(weights[nodes].to(dtype), part).view(values.shape[1:])
    return out


def _weighted_grads(rows, weights, factors, n_rows):
    """:func:`row_sums` of the formed gradients of ``factors`` (ConvGradients),
    (n_rows, K, d_out d_in'): per row, ``sum_e w_e sum_p delta_ep u_ep^T`` as one
    matrix product over its nodes and positions, no gradient formed per node."""
    segments = _row_segments(rows, n_rows)
    if segments is None:
        return row_sums(rows, weights, factors.grads, n_rows)
    columns, deltas = factors.columns, factors.deltas
    n_outputs, d_out, d_in = deltas.shape[1], deltas.shape[2], columns.shape[1]
    dtype = torch.promote_types(weights.dtype, deltas.dtype)
    out = deltas.new_zeros((n_rows, n_outputs, d_out * d_in), dtype=dtype)
    for row, nodes in segments:
        scaled = weights[nodes].to(dtype).view(-1, 1, 1) * columns[nodes].to(dtype)
        out[row] = torch.einsum("ekop,eip->koi", deltas[nodes].to(dtype), scaled).flatten(1)
    return out


def _conv_grads(columns, delta):
    """Materialised per-example gradients (n, K, d_out * d_in') of a convolution."""
    return torch.einsum("nkop,nip->nkoi", delta, columns).flatten(2)


def _factored_conv_inner(u, du, v, dv, mode):
    """``sum_{p,q} (u_ip . v_jq) (du_ikp . dv_jk'q)`` in ``mode`` (see ``contract``).

    ``u`` (n, d, P) and ``v`` (m, d, Q) are columns; ``du`` (n, K, o, P) and
    ``dv`` (m, K', o, Q) back-propagated gradients. Rows of the left side are
    taken in chunks so the (chunk, m, P, Q) intermediates stay small.
    """
    if mode == OutputMode.DIAG:
        columns = torch.einsum("ndp,ndq->npq", u, v)
        deltas = torch.einsum("nkop,nkoq->npq", du, dv)
        return (columns * deltas).sum((1, 2))
    trace = mode == OutputMode.TRACE
    n, m = u.shape[0], v.shape[0]
    P, Q, K, J, o = u.shape[-1], v.shape[-1], du.shape[1], dv.shape[1], du.shape[2]
    # Per left row: the (m, P, Q) column Gram and the (K, P) x (m, J, Q) delta Gram.
    width = m * P * Q * (2 if trace else 1 + K * J)
    chunk = max(1, int(_CONV_CHUNK_BYTES // (8 * max(width, 1))))
    right = dv.permute(0, 1, 3, 2).reshape(m * J * Q, o)  # rows (j, q) of each right row
    parts = []
    for begin in range(0, n, chunk):
        rows = slice(begin, begin + chunk)
        columns = torch.einsum("cdp,mdq->cmpq", u[rows], v)
        if trace:
            deltas = torch.einsum("ckop,mkoq->cmpq", du[rows], dv)
            parts.append((columns * deltas).sum((2, 3)))
            continue
        c = columns.shape[0]
        left = du[rows].permute(0, 1, 3, 2).reshape(c * K * P, o)
        deltas = (left @ right.T).view(c, K, P, m, J, Q)  # one matrix product
        parts.append(torch.einsum("cmpq,ckpmjq->cmkj", columns, deltas))
    if not parts:
        shape = (0, m) if trace else (0, m, K, J)
        return torch.zeros(shape, dtype=u.dtype, device=u.device)
    return torch.cat(parts)
