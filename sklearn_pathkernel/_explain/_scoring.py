"""Normalised contributions and per-class aggregation.

TracIn's users see the same few training points, those with large gradients,
top every query's list; its cosine variant divides by the gradient norms. The
path's own norm of training point ``i`` is ``n_i = sqrt(K_train(x_i, x_i))``,
the trace over outputs of the path kernel's training-copy diagonal,
``sum_s <g(x_i; w_s), P_s g(x_i; w_s)>`` (``PathKernelEngine.diag``, linear in M);
the normalised contribution is ``c_i(x) / n_i``. Normalised values no longer sum
to the output: they rank, they do not decompose.
"""

import weakref

import numpy as np

#: Engine -> the path norms of its training points (dropped with the engine).
_NORMS = weakref.WeakKeyDictionary()


def path_norms(engine):
    """``n_i`` (M,) of an engine's training points, computed once per engine.

    Zero norms (a point whose gradient vanished on the whole path) are left at 1
    so that its zero contributions stay zero. Cost: ``engine.diag`` of the
    training rows on the training copy, linear in M.
    """
    norms = _NORMS.get(engine)
    if norms is None:
        diagonal = engine.diag(engine.X_train, a_train=True)
        norms = np.sqrt(np.clip(diagonal, 0.0, None))
        norms = _NORMS[engine] = np.where(norms > 0, norms, 1.0)
    return norms


def normaliser(engine):
    """A function dividing (n, M, K) contributions by the training points' norms."""
    norms = path_norms(engine)
    return lambda contributions: contributions / norms[None, :, None]


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
