"""A convolutional distance layer: every patch of an image compared with learned memories.

:class:`DistanceConv2d` is to :class:`~sklearn_pathkernel._nn._distance.DistanceLayer`
what ``nn.Conv2d`` is to ``nn.Linear``: the same comparison applied at every
position of an image, with memories of a patch's shape. It unfolds the input
into patches (``F.unfold``, the im2col of ``nn.Conv2d``) and applies the
distance layer's kernels to the (n P, C kh kw) patch rows, so both layers share
one implementation of the kernels (``kernel_values``) and of the data-based
initialisation (``init_memories`` on :meth:`DistanceConv2d.patch_rows`).
"""

import torch.nn.functional as F
from torch import nn

from ._distance import MemoryBank, check_kernel, check_positive_int, kernel_values


def _pair(value, name, minimum):
    """``value`` as a pair of ints ``>= minimum`` (an int is used for both sides)."""
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= minimum for v in pair):
        raise ValueError(f"{name} must be an int >= {minimum} or a pair of them, got {value!r}.")
    return pair


class DistanceConv2d(MemoryBank):
    """Compare every patch of an image with ``n_memories`` learned patches ("memories").

    For an input of shape (n, C, H, W), the patch ``u_p`` at output position
    ``p`` is the (C, kh, kw) window that ``nn.Conv2d`` with the same
    ``kernel_size``, ``stride`` and ``padding`` (zeros) multiplies by its weights,
    flattened to ``D = C kh kw`` numbers. Output channel ``j`` at position ``p``
    is ``k(u_p, m_j) + b_j``, with the kernels of
    :class:`~sklearn_pathkernel.DistanceLayer` (``msd(u, m) = mean_d (u_d - m_d)^2``):
    ``"sqeuclidean"`` ``msd``; ``"euclidean"`` ``sqrt(msd)``; ``"rbf"``
    ``exp(-gamma_j msd)``; ``"laplacian"`` ``exp(-gamma_j mean_d |u_d - m_d|)``;
    ``"cosine"`` ``u.m / (max(|u|, eps) max(|m|, eps))``.

    Parameters
    ----------
    in_channels : int
        Channels ``C`` of the input.
    n_memories : int
        Number of memories, the output's channels.
    kernel_size : int or (int, int)
        Patch height and width ``(kh, kw)``.
    stride : int or (int, int), default=1
    padding : int or (int, int), default=0
        Zero padding on each side, as in ``nn.Conv2d``.
    kernel : {"sqeuclidean", "euclidean", "rbf", "laplacian", "cosine"}, \
            default="sqeuclidean"
    bias : bool, default=True
        Learn an additive bias per memory (initialised at 0).
    gamma : float, default=1.0
        Initial width of ``"rbf"`` and ``"laplacian"``.
    dtype, device : as in ``nn.Conv2d``.

    Attributes
    ----------
    memories : torch.nn.Parameter of shape (n_memories, C * kh * kw)
        The memories as flat patches (:attr:`memory_images` views them as
        (n_memories, C, kh, kw)), uniform in ``[-1/sqrt(D), 1/sqrt(D)]``.
    bias : torch.nn.Parameter of shape (n_memories,) or None
    log_gamma : torch.nn.Parameter of shape (n_memories,) or None
        Only for ``"rbf"`` and ``"laplacian"``.
    in_features : int
        The patch width ``D = C kh kw`` (the width the kernels compare).

    Notes
    -----
    Cost of a forward pass: ``O(n P J D)`` for ``P`` output positions, with
    (n P, D) patches and (n P, J) kernel values in memory; ``"laplacian"``
    broadcasts (n P, J, D) differences through ``torch.abs`` (as the dense layer),
    so that the path kernel engine sees its kinks.

    Examples
    --------
    >>> import torch
    >>> from sklearn_pathkernel import DistanceConv2d
    >>> layer = DistanceConv2d(1, 4, 3, padding=1, dtype=torch.float64)
    >>> layer(torch.zeros(2, 1, 8, 8, dtype=torch.float64)).shape
    torch.Size([2, 4, 8, 8])
    """

    def __init__(
        self,
        in_channels,
        n_memories,
        kernel_size,
        stride=1,
        padding=0,
        kernel="sqeuclidean",
        bias=True,
        gamma=1.0,
        dtype=None,
        device=None,
    ):
        super().__init__()
        check_kernel(kernel, gamma)
        check_positive_int(in_channels, "in_channels")
        check_positive_int(n_memories, "n_memories")
        self.in_channels = in_channels
        self.kernel_size = _pair(kernel_size, "kernel_size", 1)
        self.stride = _pair(stride, "stride", 1)
        self.padding = _pair(padding, "padding", 0)
        in_features = in_channels * self.kernel_size[0] * self.kernel_size[1]
        self._create_memories(in_features, n_memories, kernel, bias, gamma, dtype, device)

    @property
    def memory_images(self):
        """The memories as patches, a (n_memories, C, kh, kw) view."""
        return self.memories.view(self.n_memories, self.in_channels, *self.kernel_size)

    def output_size(self, height, width):
        """``(H_out, W_out)`` for an input of ``height`` x ``width`` (as ``nn.Conv2d``).

        Raises a ValueError naming the sizes when the (padded) input is smaller
        than a patch."""
        sizes = []
        for size, patch, stride, pad, axis in zip(
            (height, width),
            self.kernel_size,
            self.stride,
            self.padding,
            ("height", "width"),
            strict=True,
        ):
            if size + 2 * pad < patch:
                raise ValueError(
                    f"DistanceConv2d's patch {axis} {patch} is larger than the padded input "
                    f"{axis} {size} + 2 * {pad}."
                )
            sizes.append((size + 2 * pad - patch) // stride + 1)
        return tuple(sizes)

    def check_input(self, x):
        """The output size for input ``x``; a ValueError naming the problem for a
        tensor that is not (n, in_channels, H, W) with room for a patch."""
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"DistanceConv2d expects input of shape (n, {self.in_channels}, H, W) "
                f"(in_channels={self.in_channels}), got {tuple(x.shape)}."
            )
        return self.output_size(x.shape[2], x.shape[3])

    def unfold(self, x):
        """The patches as columns, (n, D, P), in ``F.unfold``'s (im2col) layout."""
        return F.unfold(x, self.kernel_size, padding=self.padding, stride=self.stride)

    def patch_rows(self, x):
        """Every patch of every image as a row, (n P, D): the rows the kernels compare
        with the memories, and the data of ``init_memories``."""
        self.check_input(x)
        return self.unfold(x).transpose(1, 2).reshape(-1, self.in_features)

    def forward(self, x):
        height, width = self.check_input(x)
        values = kernel_values(self, self.patch_rows(x))  # (n P, J)
        out = values.view(x.shape[0], height, width, self.n_memories).permute(0, 3, 1, 2)
        return out if self.bias is None else out + self.bias[:, None, None]

    def extra_repr(self):
        return (
            f"{self.in_channels}, {self.n_memories}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, kernel={self.kernel!r}, "
            f"bias={self.bias is not None}"
        )


class MinPool2d(nn.Module):
    """The smallest value of each ``pool_size`` x ``pool_size`` window of positions.

    ``-max_pool2d(-z)`` with stride ``pool_size`` (``nn.MaxPool2d(pool_size)``'s
    windows, the last partial row and column dropped): after a convolutional
    distance layer it keeps, per memory and window, the best match, the distance
    of the patch closest to the memory. Piecewise linear, like max-pooling: along
    a training step the winner of a window changes where two of its values cross
    (the path kernel engine finds those switches).

    Parameters
    ----------
    pool_size : int
        Window height and width, and the stride.

    Examples
    --------
    >>> import torch
    >>> from sklearn_pathkernel._nn._distance_conv import MinPool2d
    >>> MinPool2d(2)(torch.arange(16.0).view(1, 1, 4, 4))
    tensor([[[[ 0.,  2.],
              [ 8., 10.]]]])
    """

    def __init__(self, pool_size):
        super().__init__()
        if not (isinstance(pool_size, int) and pool_size >= 1):
            raise ValueError(f"pool_size must be a positive int, got {pool_size!r}.")
        self.pool_size = pool_size

    def forward(self, z):
        return -F.max_pool2d(-z, self.pool_size)

    def extra_repr(self):
        return f"pool_size={self.pool_size}"
