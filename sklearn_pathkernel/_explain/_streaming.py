"""Influence matrices of many queries without the whole (n, M, K) array in memory.

An attribution scores a tile of queries at a time (``batch_size`` rows: ``8
batch_size M K`` bytes); each tile is reduced before the next: its top-k kept
(:class:`StreamedTopK`) or its columns written to a file-backed array
(:func:`influence_matrix`). Cost: that of the attribution on all rows; memory: one
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


class StreamedTopK:
    """Top-k proponents and opponents of every query, one tile of queries at a time.

    Attributes (after :meth:`run`)
    ------------------------------
    proponents, opponents : TopK
        (n, K, k) each; opponents' values are the most negative first.
    mass : ndarray of shape (n, K)
        ``sum_i |s_i|`` per query and output (the denominator of the shares).
    total : ndarray of shape (n, K)
        ``sum_i s_i``, what the training points moved in all (before ``transform``).
    bias, decay, output : ndarray of shape (n, K)
        As the attribution's tiles give them.
    """

    def __init__(self, k, transform=None):
        self.k, self.transform = k, transform

    def run(self, tiles, n, n_outputs):
        """Select over ``tiles`` (``(slice, ScoreTile)`` pairs covering ``n``
        queries); returns self."""
        K = n_outputs
        parts = {name: [] for name in ("pro_i", "pro_v", "con_i", "con_v")}
        self.mass, self.total = np.zeros((n, K)), np.zeros((n, K))
        self.bias, self.decay, self.output = np.zeros((n, K)), np.zeros((n, K)), np.zeros((n, K))
        for tile, found in tiles:
            scores = found.scores
            self.total[tile] = scores.sum(axis=1)
            self.bias[tile], self.decay[tile] = found.bias, found.decay
            self.output[tile] = found.output
            if self.transform is not None:
                scores = self.transform(scores)
            self.mass[tile] = np.abs(scores).sum(axis=1)
            top, bottom = TopK.of(scores, self.k), TopK.of(-scores, self.k)
            parts["pro_i"].append(top.indices)
            parts["pro_v"].append(top.values)
            parts["con_i"].append(bottom.indices)
            parts["con_v"].append(-bottom.values)
        joined = {
            name: np.concatenate(chunks) if chunks else np.zeros((0, K, self.k))
            for name, chunks in parts.items()
        }
        self.proponents = TopK(joined["pro_i"].astype(np.int64), joined["pro_v"])
        self.opponents = TopK(joined["con_i"].astype(np.int64), joined["con_v"])
        return self


def check_columns(columns, n, n_outputs):
    """One output index per query (``columns``), checked; None stays None."""
    if columns is None:
        return None
    columns = np.asarray(columns)
    if columns.shape != (n,) or columns.dtype.kind not in "iu":
        raise ValueError(f"columns must be {n} integer output indices, one per query.")
    if n and (columns.min() < 0 or columns.max() >= n_outputs):
        raise ValueError(f"columns must be output indices in [0, {n_outputs}).")
    return columns


def result_array(shape, filename):
    """Zeros of ``shape`` in memory, or a new ``.npy`` memmap at ``filename``."""
    if filename is None:
        return np.zeros(shape)
    return np.lib.format.open_memmap(filename, mode="w+", dtype=np.float64, shape=shape)


def influence_matrix(tiles, n, n_train, n_outputs, *, columns=None, filename=None, transform=None):
    """The scores of every training point for every query, streamed.

    Parameters
    ----------
    tiles : iterable of (slice, ScoreTile)
        The attribution's tiles, covering ``n`` queries.
    n, n_train, n_outputs : int
    columns : ndarray of shape (n,) or None
        One output per query (e.g. the predicted class): the result is (n, M);
        None keeps every output, (n, M, K).
    filename : path-like or None
        Write into a new ``numpy.memmap`` there (float64, C order, shape as
        returned) instead of memory.
    transform : callable or None
        Applied to each tile's (rows, M, K) scores (normalisation).

    Returns
    -------
    ndarray or numpy.memmap
    """
    columns = check_columns(columns, n, n_outputs)
    shape = (n, n_train) if columns is not None else (n, n_train, n_outputs)
    out = result_array(shape, filename)
    for tile, found in tiles:
        scores = found.scores if transform is None else transform(found.scores)
        if columns is None:
            out[tile] = scores
        else:
            picked = columns[tile]
            out[tile] = np.take_along_axis(scores, picked[:, None, None], axis=2)[..., 0]
    if filename is not None:
        out.flush()
    return out
