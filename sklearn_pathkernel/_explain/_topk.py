"""Top-k selection: the largest and the most negative contributions per query and output."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TopK:
    """The ``k`` largest values along the training axis, in decreasing order.

    Attributes
    ----------
    indices : ndarray of shape (n, K, k)
        Training indices, per query and output, largest value first.
    values : ndarray of shape (n, K, k)
        Their values.
    """

    indices: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, values, k):
        """The top ``k`` of ``values`` (n, M, K) along axis 1.

        Ties are broken by the smaller training index (a stable order), so the
        result equals ``np.argsort(-values, axis=1, kind="stable")[:, :k]``.
        Cost: ``O(n M K)`` (a partition, then a sort of ``k`` per row).
        """
        values = np.moveaxis(np.asarray(values), 1, -1)  # (n, K, M)
        M = values.shape[-1]
        if k < M:
            # candidates: the partition's k largest, and every value tied with the k-th
            kth = -np.partition(-values, k - 1, axis=-1)[..., k - 1 : k]
            candidates = values >= kth
        else:
            candidates = np.ones(values.shape, dtype=bool)
        keys = np.where(candidates, -values, np.inf)
        order = np.argsort(keys, axis=-1, kind="stable")[..., :k]
        return cls(order, np.take_along_axis(values, order, axis=-1))


def check_k(k, n_train):
    """``k`` as an int in [1, M], or a clear error."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}.")
    if not 1 <= k <= n_train:
        raise ValueError(
            f"k={k} is out of range: the model has {n_train} training points, so k "
            f"must be between 1 and {n_train}."
        )
    return int(k)
