"""Influence matrices of many queries without the whole (n, M, K) array in memory.

The engine decomposes a tile of queries at a time (``batch_size`` rows: ``8
batch_size M K`` bytes); each tile is reduced before the next: its top-k kept
(:func:`stream_top_k`) or its columns written to a file-backed array
(:func:`influence_matrix`). Cost: that of ``decompose`` on all rows; memory: one
tile, plus the result.
"""

import numpy as np

from ._topk import TopK


def query_tiles(n_rows, batch_size):
    """Consecutive slices of ``batch_size`` query rows."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    return [slice(b, min(b + batch_size, n_rows)) for b in range(0, n_rows, batch_size)]


def stream_decompositions(engine, X, batch_size):
    """``(tile, engine.decompose(X[tile]))`` for consecutive tiles of query rows."""
    for tile in query_tiles(X.shape[0], batch_size):
        yield tile, engine.decompose(X[tile])


class StreamedTopK:
    """Top-k proponents and opponents of every query, one tile of queries at a time.

    Attributes (after :meth:`run`)
    ------------------------------
    proponents, opponents : TopK
        (n, K, k) each; opponents' values are the most negative first.
    mass : ndarray of shape (n, K)
        ``sum_i |c_i|`` per query and output (the denominator of the shares).
    total : ndarray of shape (n, K)
        ``sum_i c_i``, what the training points moved in all.
    bias, decay, output : ndarray of shape (n, K)
        As ``decompose`` returns them.
    """

    def __init__(self, engine, k, batch_size, transform=None):
        self.engine, self.k, self.batch_size = engine, k, batch_size
        self.transform = transform

    def run(self, X):
        """Select over the rows of ``X`` (a tensor on the engine's device); returns self."""
        n, K = X.shape[0], self.engine.n_outputs
        parts = {name: [] for name in ("pro_i", "pro_v", "con_i", "con_v")}
        self.mass, self.total = np.zeros((n, K)), np.zeros((n, K))
        self.bias, self.decay, self.output = np.zeros((n, K)), np.zeros((n, K)), np.zeros((n, K))
        for tile, parts_of_tile in stream_decompositions(self.engine, X, self.batch_size):
            contributions = parts_of_tile.contributions
            self.total[tile] = contributions.sum(axis=1)
            self.bias[tile], self.decay[tile] = parts_of_tile.bias, parts_of_tile.decay
            self.output[tile] = parts_of_tile.output
            if self.transform is not None:
                contributions = self.transform(contributions)
            self.mass[tile] = np.abs(contributions).sum(axis=1)
            top, bottom = TopK.of(contributions, self.k), TopK.of(-contributions, self.k)
            parts["pro_i"].append(top.indices)
            parts["pro_v"].append(top.values)
            parts["con_i"].append(bottom.indices)
            parts["con_v"].append(-bottom.values)
        joined = {name: np.concatenate(chunks) for name, chunks in parts.items()}
        self.proponents = TopK(joined["pro_i"], joined["pro_v"])
        self.opponents = TopK(joined["con_i"], joined["con_v"])
        return self


def influence_matrix(engine, X, *, columns=None, filename=None, batch_size=64, transform=None):
    """The contributions of every training point to every query, streamed.

    Parameters
    ----------
    engine : PathKernelEngine
    X : torch.Tensor of shape (n, ...)
    columns : ndarray of shape (n,) or None
        One output per query (e.g. the predicted class): the result is (n, M);
        None keeps every output, (n, M, K).
    filename : path-like or None
        Write into a new ``numpy.memmap`` there (float64, C order, shape as
        returned) instead of memory.
    batch_size : int
        Queries per decomposition.
    transform : callable or None
        Applied to each tile's (rows, M, K) contributions (normalisation).

    Returns
    -------
    ndarray or numpy.memmap
    """
    n, M, K = X.shape[0], engine.n_train, engine.n_outputs
    if columns is not None:
        columns = np.asarray(columns)
        if columns.shape != (n,) or columns.dtype.kind not in "iu":
            raise ValueError(f"columns must be {n} integer output indices, one per query.")
        if n and (columns.min() < 0 or columns.max() >= K):
            raise ValueError(f"columns must be output indices in [0, {K}).")
    shape = (n, M) if columns is not None else (n, M, K)
    if filename is None:
        out = np.zeros(shape)
    else:
        out = np.lib.format.open_memmap(filename, mode="w+", dtype=np.float64, shape=shape)
    for tile, parts in stream_decompositions(engine, X, batch_size):
        contributions = parts.contributions
        if transform is not None:
            contributions = transform(contributions)
        if columns is None:
            out[tile] = contributions
        else:
            picked = columns[tile]
            out[tile] = np.take_along_axis(contributions, picked[:, None, None], axis=2)[..., 0]
    if filename is not None:
        out.flush()
    return out
