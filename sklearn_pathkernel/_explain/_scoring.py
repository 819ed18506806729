"""Normalised contributions and per-class aggregation.

TracIn's users see the same few training points, those with large gradients,
top every query's list; its cosine variant divides by the gradient norms. The
path's own norm of training point ``i`` is ``n_i = sqrt(K_train(x_i, x_i))``,
the trace over outputs of the path kernel's training-copy diagonal,
``sum_s <g(x_i; w_s), P_s g(x_i; w_s)>`` (``PathKernelEngine.diag``, linear in M);
the normalised contribution is ``c_i(x) / n_i``. Normalised values no longer sum
to the output: they rank, they do not decompose.
"""

import numpy as np


class PathNorms:
    """The path-kernel norms ``n_i`` of the training points, computed once per engine.

    Parameters
    ----------
    engine : PathKernelEngine
    """

    def __init__(self, engine):
        self.engine = engine
        self._norms = None

    def norms(self):
        """``n_i`` (M,); zero norms (a point whose gradient vanished on the whole
        path) are left at 1 so that its zero contributions stay zero."""
        if self._norms is None:
            diagonal = self.engine.diag(self.engine.X_train, a_train=True)
            norms = np.sqrt(np.clip(diagonal, 0.0, None))
            self._norms = np.where(norms > 0, norms, 1.0)
        return self._norms

    def normalised(self, contributions):
        """``contributions`` (n, M, K) divided by the training points' norms."""
        return contributions / self.norms()[None, :, None]


def class_totals(contributions, codes, n_classes):
    """Contributions summed over the training points of each class.

    Parameters
    ----------
    contributions : ndarray of shape (n, M, K)
    codes : ndarray of shape (M,)
        Each training point's class index.
    n_classes : int

    Returns
    -------
    ndarray of shape (n, C, K)
        Entry ``[q, c, k]``: what the training points of class ``c`` added to
        output ``k`` at query ``q``; the classes sum to the contributions' total.
    """
    one_hot = np.zeros((codes.shape[0], n_classes))
    one_hot[np.arange(codes.shape[0]), codes] = 1.0
    return np.einsum("nmk,mc->nck", contributions, one_hot)
