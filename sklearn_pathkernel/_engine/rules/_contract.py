"""Inner products of stacked per-example gradients, shared by the layer rules."""


def contract(left, right, mode):
    """Inner products over the last axis of (n, K1, W) and (m, K2, W) tensors.

    ``mode="trace"`` sums matching outputs (K1 == K2) -> (n, m); ``"pairs"`` keeps
    every output pair -> (n, m, K1, K2); ``"diag"`` pairs row i with row i of the
    same batch and sums outputs -> (n,). Each is one matrix product (no einsum).
    """
    if mode == "trace":
        return left.reshape(left.shape[0], -1) @ right.reshape(right.shape[0], -1).T
    if mode == "pairs":
        n, k1, width = left.shape
        m, k2 = right.shape[:2]
        out = left.reshape(n * k1, width) @ right.reshape(m * k2, width).T
        return out.view(n, k1, m, k2).permute(0, 2, 1, 3)
    return (left * right).sum(dim=(1, 2))
