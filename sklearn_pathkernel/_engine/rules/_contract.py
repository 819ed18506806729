"""Inner products of stacked per-example gradients, shared by the layer rules."""

from .._modes import OutputMode


def contract(left, right, mode):
    """Inner products over the last axis of (n, K1, W) and (m, K2, W) tensors.

    ``mode`` TRACE sums matching outputs (K1 == K2) -> (n, m); PAIRS keeps every
    output pair -> (n, m, K1, K2); DIAG pairs row i with row i of the same batch
    and sums outputs -> (n,). Each is one matrix product (no einsum): cost
    ``O(n m K1 W)`` (``O(n m K1 K2 W)`` for PAIRS, ``O(n K1 W)`` for DIAG).
    """
    if mode == OutputMode.TRACE:
        return left.reshape(left.shape[0], -1) @ right.reshape(right.shape[0], -1).T
    if mode == OutputMode.PAIRS:
        n, k1, width = left.shape
        m, k2 = right.shape[:2]
        out = left.reshape(n * k1, width) @ right.reshape(m * k2, width).T
        return out.view(n, k1, m, k2).permute(0, 2, 1, 3)
    return (left * right).sum(dim=(1, 2))


def weighted(matrix, left, right, mode):
    """``matrix[i, l] * sum_j left[i, k, j] right[l, k', j]`` in ``mode`` (``matrix``
    (n,) for DIAG): a contraction scaled per pair of rows."""
    inner = contract(left, right, mode)
    return matrix[:, :, None, None] * inner if mode == OutputMode.PAIRS else matrix * inner
