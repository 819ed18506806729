"""Output subspaces: fewer outputs in a layer's trace products, exactly.

A trace kernel sums matching outputs. For a layer whose per-example gradient of
output ``f_k`` factors through the back-propagated gradient ``delta_k`` (``K``
outputs, ``d_out`` units), the delta Gram of two rows is a sum over units ``o``
of inner products of K-vectors,

.. math::

    \\sum_k \\delta_{ik} \\cdot \\delta_{jk} = \\sum_o \\langle \\delta_i[:, o],
    \\delta_j[:, o] \\rangle .

Where the right rows' K-vectors at unit ``o`` span only ``r < K`` dimensions,
with ``B_o`` (K, r) an orthonormal basis of that span,
``<u, v> = <B_o^T u, B_o^T v>`` for every ``u`` and every ``v`` in the span: both
sides' deltas can be projected to ``r`` values per unit first, and the delta
Gram shrinks from ``K d_out`` to ``r d_out`` columns. Only the right side has to
lie in the span, so the left side may be anything (the test copy's quadrature
nodes, at other weights of the step).

This is the rule at the top of a network, not the exception:

- the logits' layer under a log-softmax has ``delta_ik = e_k - p_i``, whose
  unit-``o`` vector ``e_o - p_io 1`` lies in span(e_o, 1);
- a layer followed by an elementwise activation and a linear head ``V`` has
  ``sigma'(z_io) (V[:, o] - (p_i . V[:, o]) 1)``, in span(V[:, o], 1).

Both have ``r = 2`` whatever ``K`` (``r = 1`` under the identity link of a
regressor); deeper layers mix the units and keep ``r = K``. For a ReLU MLP
64-128-128-10 the trace products of a pair of rows fall from 2983 to 1879
multiply-adds over the three layers.

The span is found, not assumed: per unit, a QR factorisation of the right
rows' (n, K) matrix and the singular values of its ``R`` factor say how many
directions carry them, each vector scaled to unit norm first (which leaves the
span as it is). Directions whose singular value is below ``RANK_RTOL`` are
dropped: each right vector ``v`` then loses at most that fraction of its own norm,
and a unit's inner product ``<u, v>`` changes by at most ``RANK_RTOL |u| |v|``,
the form (if not the size) of a matrix product's own rounding error. The
structural zeros above sit at rounding level (about ``1e-16 sqrt(n)``).

Cost: ``O(n K^2 d_out)`` per layer and step and a few memory passes over the
right rows' deltas, against the ``O(n' n K d_out)`` of the products it shrinks:
it is looked for only where there are enough left rows ``n'`` to pay (the
training Gram of two thousand rows or more; a cross Gram of about 500 queries or
more).
"""

import torch

#: Singular values of a unit's K-vectors, each scaled to unit norm, below this
#: are taken as zero (see the module docstring).
RANK_RTOL = 1e-12

#: Rows whose span is checked first: when a few rows already span every output
#: direction at some unit (deeper layers), the full factorisation is skipped.
_PROBE_ROWS_PER_OUTPUT = 2

#: Left rows per output below which a subspace is not looked for: finding it and
#: projecting the right rows cost about as much as the products they shrink save
#: at a few hundred left rows (K = 10, d_out = 128; ``python
#: benchmarks/bench_output_subspace.py`` measures it); 200 K left rows keep a margin.
_MIN_LEFT_ROWS_PER_OUTPUT = 200

#: On a GPU, rows per chunk of the two-level QR of :func:`_r_factor`. For 128
#: matrices of 16 000 (32 000) x 10 on an H100: 6.8 (9.4) ms with 256-row chunks,
#: 101 (207) ms with 1024, 36 (72) ms with 4096, against 20.6 (38.8) ms for one
#: batched QR (``python benchmarks/bench_gpu.py --micro``).
TSQR_ROWS = 256


class OutputSubspace:
    """Per unit, an orthonormal basis of the span of some rows' K-vectors.

    Parameters
    ----------
    basis : torch.Tensor of shape (K, r, d_out)
        ``basis[:, :, o]`` spans the K-vectors ``delta[:, o]`` of the rows it was
        found for (:meth:`of`).
    """

    __slots__ = ("basis",)

    def __init__(self, basis):
        self.basis = basis

    @property
    def rank(self):
        """``r``: values per unit after projection."""
        return self.basis.shape[1]

    @classmethod
    def of(cls, deltas, n_left, rtol=RANK_RTOL):
        """The subspace of ``deltas`` (n, K, d_out), or None when it is all of it.

        None also when there is nothing to gain: a single output, ``r = K``
        (found on a few rows first, which is enough to rule a reduction out), or
        fewer than ``_MIN_LEFT_ROWS_PER_OUTPUT`` K left rows to take products
        with (finding the subspace, ``O(n K^2 d_out)`` and a few memory passes,
        would cost more than it saves, ``O(n_left n (K - r) d_out)``).
        """
        n, n_outputs, d_out = deltas.shape
        if n_outputs < 2 or n == 0 or n_left < _MIN_LEFT_ROWS_PER_OUTPUT * n_outputs:
            return None
        # Each K-vector scaled to unit norm (zero ones stay zero): the span is the
        # same, and a dropped direction is then small next to every row's own
        # vector, not only next to the largest one.
        norms = deltas.square().sum(1, keepdim=True).sqrt_()
        unit = deltas / norms.clamp_min(torch.finfo(deltas.dtype).tiny)
        head = unit[: _PROBE_ROWS_PER_OUTPUT * n_outputs]
        if head.shape[0] < n and _rank(_row_space(head)[0], rtol) == n_outputs:
            return None
        values, directions = _row_space(unit)
        rank = _rank(values, rtol)
        if rank >= n_outputs:
            return None
        # each unit's leading right singular vectors (any one where all vectors
        # are zero), laid out (K, r, d_out) for the projection
        return cls(directions[:, : max(rank, 1)].permute(2, 1, 0).contiguous())

    def project(self, values):
        """``values`` (n, K, d_out, ...) projected unit by unit to (n, r, d_out, ...).

        Only for trace products (sums over matching outputs): the projected
        outputs are directions of the subspace, not the network's outputs.
        Trailing axes (a materialised gradient's inputs) are carried along. One
        multiply-add per output over contiguous (n, d_out, ...) slabs: several
        times faster than a batched product per unit over strided views
        (``python benchmarks/bench_output_subspace.py``).
        """
        n, n_outputs, d_out = values.shape[:3]
        trailing = values.shape[3:]
        out = values.new_zeros((n, self.rank, d_out, *trailing))
        basis = self.basis.view(n_outputs, 1, self.rank, d_out, *([1] * len(trailing)))
        for k in range(n_outputs):
            out.addcmul_(values[:, k, None], basis[k])
        return out


def in_output_subspace(rule, right, lefts, n_left):
    """``right`` and every factors of ``lefts`` (one rule's) projected onto the
    output subspace of ``right``'s rows, where ``rule`` finds one (else as they
    are). For trace products only: those between ``right`` and any of ``lefts``
    are unchanged, with fewer outputs."""
    subspace = rule.output_subspace(right, n_left)
    if subspace is None:
        return right, lefts
    return (
        rule.project_outputs(right, subspace),
        [rule.project_outputs(left, subspace) for left in lefts],
    )


def _row_space(deltas):
    """Per unit, the singular values (d_out, k) and right singular vectors
    (d_out, k, K) of the (n, K) matrix of the rows' K-vectors, ``k = min(n, K)``:
    from the ``R`` of a QR factorisation, whose singular values and right
    singular vectors are the matrix's (it is ``Q R`` with orthonormal ``Q``)."""
    by_unit = deltas.permute(2, 0, 1)  # (d_out, n, K)
    triangle = _r_factor(by_unit)  # (d_out, k, K)
    _, values, directions = torch.linalg.svd(triangle, full_matrices=False)
    return values, directions


def _r_factor(matrices):
    """The ``R`` of a QR factorisation of each (n, K) matrix of a batch.

    On a GPU, tall matrices (128 of 32 000 x 10) by :func:`_tall_skinny_r` in
    chunks of ``TSQR_ROWS`` rows: cuSOLVER runs many small factorisations far
    faster than a few tall ones. On the host, and for matrices of at most
    ``2 TSQR_ROWS`` rows, one batched QR.
    """
    n, k = matrices.shape[1:]
    if matrices.device.type != "cuda" or n <= 2 * TSQR_ROWS or k > TSQR_ROWS:
        return torch.linalg.qr(matrices, mode="r")[1]
    return _tall_skinny_r(matrices, TSQR_ROWS)


def _tall_skinny_r(matrices, rows):
    """An ``R`` of each (n, K) matrix of a batch, in two levels (a tall-skinny QR).

    The ``R`` of each chunk of ``rows`` rows (zero rows pad the last one), then
    the ``R`` of the stacked ``R`` factors: an ``R`` of the whole matrix by
    orthogonal transformations alone, as stable as one QR (``R^T R`` is the
    matrix's Gram; its singular values and right singular vectors are the
    matrix's), though not the same one (rows may differ in sign).

    Cost: ``O(n K^2)`` per matrix, as one QR; ``ceil(n / rows)`` small
    factorisations and one of ``ceil(n / rows) K`` rows.
    """
    batch, n, k = matrices.shape
    chunks = -(-n // rows)
    padded = matrices.new_zeros((batch, chunks * rows, k))
    padded[:, :n] = matrices
    partial = torch.linalg.qr(padded.view(batch * chunks, rows, k), mode="r")[1]
    return torch.linalg.qr(partial.reshape(batch, chunks * k, k), mode="r")[1]


def _rank(values, tolerance):
    """The largest number, over units, of singular values above ``tolerance``."""
    return int((values > tolerance).sum(1).amax())
