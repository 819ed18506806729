"""What a Gram product keeps of the output axes: the :class:`OutputMode` enum."""

import enum

import torch

#: Rows a side of the squares :meth:`OutputMode.symmetrize` works in.
SYMMETRIZE_ROWS = 1024


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
    :meth:`~sklearn_pathkernel.ExactPathKernel` are ``TRACE`` and ``PAIRS``
    (:meth:`of_output`).
    """

    TRACE = "trace"
    PAIRS = "pairs"
    DIAG = "diag"

    @classmethod
    def of_output(cls, output):
        """The mode of a public ``output`` setting: ``"trace"`` or ``"full"``."""
        try:
            return _PUBLIC_OUTPUTS[output]
        except (KeyError, TypeError):
            raise ValueError(f"output must be 'trace' or 'full', got {output!r}.") from None

    @property
    def public_output(self):
        """The public ``output`` setting of this mode (``TRACE`` or ``PAIRS``)."""
        return next(name for name, mode in _PUBLIC_OUTPUTS.items() if mode is self)

    def output_shape(self, n_outputs):
        """The trailing axes of a block of this mode: ``(K, K)`` for ``PAIRS``, else ``()``."""
        return (n_outputs, n_outputs) if self is OutputMode.PAIRS else ()

    def values_per_pair(self, n_outputs):
        """Numbers per pair of rows: ``K**2`` for ``PAIRS``, else 1."""
        return n_outputs**2 if self is OutputMode.PAIRS else 1

    def transpose(self, block):
        """The block of the swapped sides: (n, m) -> (m, n), (n, m, K, K') -> (m, n, K', K).

        ``block`` is a numpy array or a tensor; a view, no copy.
        """
        axes = (1, 0, 3, 2) if self is OutputMode.PAIRS else (1, 0)
        return block.permute(*axes) if torch.is_tensor(block) else block.transpose(axes)

    def symmetrize(self, gram, size=SYMMETRIZE_ROWS):
        """``gram`` (a numpy array or a tensor) made exactly symmetric, in place,
        and returned: ``0.5 (gram + transpose(gram))``, the same values, computed
        square by square (``size`` rows a side).

        Cost: one read and one write of every entry, and a temporary of one
        square; no copy of the whole Gram (two of 8 GB at M = 32 000).
        """
        n = gram.shape[0]
        for i in range(0, n, size):
            for j in range(i, n, size):
                upper, lower = gram[i : i + size, j : j + size], gram[j : j + size, i : i + size]
                mean = 0.5 * (upper + self.transpose(lower))
                upper[...] = mean
                lower[...] = self.transpose(mean)
        return gram


_PUBLIC_OUTPUTS = {"trace": OutputMode.TRACE, "full": OutputMode.PAIRS}
