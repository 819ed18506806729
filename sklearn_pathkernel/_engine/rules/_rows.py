"""Sums over the rows of a batch of quadrature nodes, shared by the layer rules.

Node ``e`` of a batch belongs to row ``rows[e]`` (rows in any order, any number
of nodes each); these helpers sum node values into their rows.
"""

from typing import NamedTuple

import torch


def row_sums(rows, weights, values, n_rows):
    """``out[r] = sum of weights[e] * values[e] over the e with rows[e] == r``.

    ``weights`` (E,), ``values`` (E, ...) -> (n_rows, ...): one scaling pass and
    one scatter (``index_add_``), ``O(E)`` work per value and no padding (the
    values may be large: materialised gradients).
    """
    scaled = weights.view(-1, *([1] * (values.ndim - 1))) * values
    return values.new_zeros((n_rows, *values.shape[1:])).index_add_(0, rows, scaled)


class _Padding(NamedTuple):
    """Where each node goes in a zero-padded (n_rows, width) block of its row."""

    order: torch.Tensor  # the nodes sorted by row (stable)
    rows: torch.Tensor  # their rows, sorted
    position: torch.Tensor  # their position in their row's block
    width: int  # the most nodes of a row


def _padding(rows, n_rows):
    order = torch.argsort(rows, stable=True)
    sorted_rows = rows[order]
    counts = torch.bincount(rows, minlength=n_rows)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(rows.numel(), device=rows.device) - starts[sorted_rows]
    width = int(counts.max()) if rows.numel() else 0
    return _Padding(order, sorted_rows, position, width)


def _padded(values, padding, n_rows):
    """(n_rows, width, F): each row's entries of ``values`` (E, F), zero-padded."""
    block = values.new_zeros((n_rows, padding.width, values.shape[1]))
    block[padding.rows, padding.position] = values[padding.order]
    return block


def padded_row_sums(rows, weights, values, n_rows):
    """``row_sums`` for several weightings at once, for small values.

    ``weights`` (E,) or (P, E) for P weightings -> (n_rows, ...) or
    (P, n_rows, ...). Each row's entries are gathered into a zero-padded block
    and summed by one batched matrix product, ``O(E)`` work per value and
    weighting (on a CPU several times faster than scaling and scattering with
    ``index_add_``), ``n_rows x width`` values of padding.
    """
    weights = weights if weights.ndim == 2 else weights[None]
    n_weightings = weights.shape[0]
    padding = _padding(rows, n_rows)
    flat = values.reshape(rows.numel(), -1)
    padded = _padded(flat, padding, n_rows)
    padded_weights = weights.new_zeros((n_rows, n_weightings, padding.width))
    padded_weights[padding.rows, :, padding.position] = weights[:, padding.order].T
    sums = torch.bmm(padded_weights, padded).transpose(0, 1)  # (P, n_rows, F)
    sums = sums.reshape(n_weightings, n_rows, *values.shape[1:])
    return sums if n_weightings > 1 else sums[0]


def padded_by_row(rows, n_rows, *values):
    """Each of ``values`` (E, F) as a zero-padded (n_rows, width, F) block: row
    ``r``'s entries in their order, then zeros (``width`` the most entries of a
    row). The blocks of :func:`row_outer_sums`, for products written elsewhere."""
    padding = _padding(rows, n_rows)
    return [_padded(value, padding, n_rows) for value in values]


def row_outer_sums(rows, left, right, n_rows):
    """``out[r] = sum of outer(left[e], right[e]) over the e with rows[e] == r``.

    ``left`` (E, P), ``right`` (E, Q) -> (n_rows, P, Q), as one batched matrix
    product: each row's entries are gathered into a zero-padded block, instead of
    forming the (E, P, Q) outer products. Cost ``O(n_rows width P Q)``.
    """
    padding = _padding(rows, n_rows)
    return _padded(left, padding, n_rows).transpose(1, 2) @ _padded(right, padding, n_rows)


def first_of_rows(rows, n_rows):
    """Per row, the position of its first entry in ``rows`` (rows without entries:
    the last position, so that indexing stays valid)."""
    positions = torch.arange(rows.numel(), device=rows.device)
    first = torch.full((n_rows,), rows.numel() - 1, dtype=positions.dtype, device=rows.device)
    return first.scatter_reduce_(0, rows, positions, "amin")
