"""What a Gram product keeps of the output axes."""

import enum


class OutputMode(str, enum.Enum):
    """The output axes of an inner product of per-example gradients.

    For per-example gradients of two batches, ``g_i`` of shape (K, W) and ``h_j``
    of shape (K', W):

    ``TRACE``
        ``sum_k <g_ik, h_jk>``, shape (n, m): the scalar kernel (K == K'). Cost:
        one product of (n, K W) by (K W, m), less through the layers' factors.
    ``PAIRS``
        ``<g_ik, h_jk'>`` for every output pair, shape (n, m, K, K'): the
        matrix-valued kernel, K K' times the numbers of ``TRACE``.
    ``DIAG``
        ``sum_k <g_ik, h_ik>`` of row ``i`` with row ``i`` of the same batch,
        shape (n,): the diagonal, linear in n.

    The public ``output="trace"`` and ``output="full"`` of
    :meth:`~sklearn_pathkernel.ExactPathKernel` are ``TRACE`` and ``PAIRS``.
    """

    TRACE = "trace"
    PAIRS = "pairs"
    DIAG = "diag"
