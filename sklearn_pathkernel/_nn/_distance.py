"""Distance layers: a layer whose units compare the input with learned "memories".

A :class:`DistanceLayer` holds ``n_memories`` vectors ``m_j`` of the input's
width and outputs, per example and memory, a distance or a similarity between
the example and the memory (the "Distance Kernel based Neural Networks" seed,
whose layer is the mean squared difference). Every output depends on its own
example only and every operation is a plain differentiable torch op, so the
exact path kernel engine can differentiate through it.

Exactness of the distances: the expansion ``|x|^2 - 2 x.m + |m|^2`` loses all
significant digits when ``x`` is close to ``m`` (a memory initialised on a
training point is at distance ~1e-14 instead of 0), and broadcasting
``x[:, None] - m`` materialises an (n, n_memories, D) tensor (about 90x slower
on digits). ``torch.cdist`` without the matrix-product shortcut sums the
squared differences directly, is as accurate as the broadcast, nearly as fast
as the expansion, and its gradient is finite (zero) at distance 0.
"""

import math

import torch
from sklearn.cluster import kmeans_plusplus
from torch import nn

KERNELS = ("sqeuclidean", "euclidean", "rbf", "laplacian", "cosine")
DISTANCE_KERNELS = ("sqeuclidean", "euclidean")  # larger = farther; the others are similarities
INITS = ("uniform", "kmeans++", "samples")
TRANSFORMS = ("none", "sqrt", "log1p", "standardize")

# Smallest norm used to normalise in the cosine kernel (a zero vector has cosine 0).
COSINE_EPS = 1e-12
# Variance floor of the per-example standardisation (constant outputs stay finite).
STANDARDIZE_EPS = 1e-8


def _euclidean(x, memories):
    """Exact pairwise Euclidean distances (see the module docstring), shape (n, J)."""
    return torch.cdist(x, memories, compute_mode="donot_use_mm_for_euclid_dist")


def _root_msd(layer, x):
    """``sqrt(msd(x, m_j))``, exact (see the module docstring), shape (n, J)."""
    return _euclidean(x, layer.memories) / math.sqrt(layer.in_features)


def _sqeuclidean(layer, x):
    return _root_msd(layer, x).square()


def _rbf(layer, x):
    return torch.exp(-torch.exp(layer.log_gamma) * _sqeuclidean(layer, x))


def _laplacian(layer, x):
    mad = torch.abs(x[:, None, :] - layer.memories[None, :, :]).mean(-1)
    return torch.exp(-torch.exp(layer.log_gamma) * mad)


def _cosine(layer, x):
    memories = layer.memories
    x_norm = torch.clamp(torch.linalg.vector_norm(x, dim=1, keepdim=True), min=COSINE_EPS)
    m_norm = torch.clamp(torch.linalg.vector_norm(memories, dim=1), min=COSINE_EPS)
    return (x @ memories.T) / (x_norm * m_norm)


#: ``k(x, m_j)`` of each kernel, as a function of the layer and its input.
SIMILARITIES = {
    "sqeuclidean": _sqeuclidean,
    "euclidean": _root_msd,
    "rbf": _rbf,
    "laplacian": _laplacian,
    "cosine": _cosine,
}


def kernel_values(layer, x):
    """``k(x_i, m_j)`` (n, J) of ``layer``'s kernel for rows ``x`` (n, layer.in_features).

    Shared by every layer with ``memories`` (J, in_features), ``in_features``,
    ``kernel`` and ``log_gamma`` (:class:`DistanceLayer`, and
    :class:`~sklearn_pathkernel._nn._distance_conv.DistanceConv2d` on its patches).
    """
    return SIMILARITIES[layer.kernel](layer, x)


def check_kernel(kernel, gamma):
    if kernel not in KERNELS:
        raise ValueError(f"Unknown kernel {kernel!r}; expected one of {KERNELS}.")
    if not gamma > 0:
        raise ValueError(f"gamma must be positive, got {gamma!r}.")


def check_positive_int(value, name):
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}.")


class MemoryBank(nn.Module):
    """What the distance layers share: ``n_memories`` learned memories of width
    ``in_features`` (a patch, for :class:`DistanceConv2d`), one bias per memory and,
    for ``"rbf"`` and ``"laplacian"``, the memories' log-widths."""

    def _create_memories(self, in_features, n_memories, kernel, bias, gamma, dtype, device):
        check_positive_int(n_memories, "n_memories")
        self.in_features, self.n_memories, self.kernel = in_features, n_memories, kernel
        factory = {"dtype": dtype, "device": device}
        self.memories = nn.Parameter(torch.empty(n_memories, in_features, **factory))
        self.bias = nn.Parameter(torch.zeros(n_memories, **factory)) if bias else None
        if kernel in ("rbf", "laplacian"):
            self.log_gamma = nn.Parameter(torch.full((n_memories,), math.log(gamma), **factory))
        else:
            self.log_gamma = None
        self.reset_parameters()

    def reset_parameters(self):
        """Memories uniform in ``[-1/sqrt(D), 1/sqrt(D)]`` (the range of ``nn.Linear``'s
        and ``nn.Conv2d``'s weights, ``D`` the fan-in)."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.memories, -bound, bound)


class DistanceLayer(MemoryBank):
    """Compare each example with ``n_memories`` learned vectors ("memories").

    For an input ``x`` of shape (n, D) and memories ``m_j`` of shape
    (n_memories, D), output ``j`` of example ``x`` is ``k(x, m_j) + b_j`` with
    ``msd(x, m) = mean_d (x_d - m_d)^2`` and the kernel ``k``:

    - ``"sqeuclidean"``: ``msd(x, m)``, the seed's mean squared difference;
    - ``"euclidean"``: ``sqrt(msd(x, m))``, with a finite (zero) gradient at 0;
    - ``"rbf"``: ``exp(-gamma_j * msd(x, m))``;
    - ``"laplacian"``: ``exp(-gamma_j * mean_d |x_d - m_d|)``;
    - ``"cosine"``: ``x.m / (max(|x|, eps) max(|m|, eps))`` (0 for a zero vector).

    The widths ``gamma_j = exp(log_gamma_j)`` of ``"rbf"`` and ``"laplacian"``
    are learned, one per memory, log-parameterised so they stay positive.
    Distances use means over features, not sums, so their scale does not grow
    with the input width.

    Parameters
    ----------
    in_features : int
        Width ``D`` of the input.
    n_memories : int
        Number of memories, the width of the output.
    kernel : {"sqeuclidean", "euclidean", "rbf", "laplacian", "cosine"}, \
            default="sqeuclidean"
        The comparison of an input with a memory.
    bias : bool, default=True
        Learn an additive bias per memory (initialised at 0).
    gamma : float, default=1.0
        Initial width of ``"rbf"`` and ``"laplacian"`` (ignored otherwise).
    dtype : torch.dtype or None, default=None
        Dtype of the parameters (torch's default when None).
    device : torch.device, str or None, default=None
        Device of the parameters (torch's default when None), as in ``nn.Linear``.

    Attributes
    ----------
    memories : torch.nn.Parameter of shape (n_memories, in_features)
        Initialised uniformly in ``[-1/sqrt(D), 1/sqrt(D)]`` like ``nn.Linear``'s
        weights; see :func:`init_memories` for data-based initialisations.
    bias : torch.nn.Parameter of shape (n_memories,) or None
    log_gamma : torch.nn.Parameter of shape (n_memories,) or None
        Only for ``"rbf"`` and ``"laplacian"``.

    Notes
    -----
    ``"laplacian"`` broadcasts ``x[:, None] - m`` through ``torch.abs`` (memory
    ``n * n_memories * D``), so that the path kernel engine sees the kinks of
    the absolute value; the other kernels need only (n, n_memories) memory.

    Examples
    --------
    >>> import torch
    >>> from sklearn_pathkernel import DistanceLayer
    >>> layer = DistanceLayer(3, 2, dtype=torch.float64)
    >>> layer(torch.zeros(5, 3, dtype=torch.float64)).shape
    torch.Size([5, 2])
    """

    def __init__(
        self,
        in_features,
        n_memories,
        kernel="sqeuclidean",
        bias=True,
        gamma=1.0,
        dtype=None,
        device=None,
    ):
        super().__init__()
        check_kernel(kernel, gamma)
        check_positive_int(in_features, "in_features")
        self._create_memories(in_features, n_memories, kernel, bias, gamma, dtype, device)

    def forward(self, x):
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"DistanceLayer expects input of shape (n, {self.in_features}), "
                f"got {tuple(x.shape)}."
            )
        out = self.similarity(x)
        return out if self.bias is None else out + self.bias

    def similarity(self, x):
        """The kernel values ``k(x, m_j)`` without the bias, shape (n, n_memories)."""
        return kernel_values(self, x)

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, n_memories={self.n_memories}, "
            f"kernel={self.kernel!r}, bias={self.bias is not None}"
        )


def _sqrt(z):
    # clamp at the smallest normal number: finite gradient at 0.
    return torch.sqrt(torch.clamp(z, min=torch.finfo(z.dtype).tiny))


def _log1p(z):
    return torch.log1p(torch.clamp(z, min=0.0))


def _standardize(z):
    centred = z - z.mean(dim=1, keepdim=True)
    variance = centred.square().mean(dim=1, keepdim=True)
    return centred / torch.sqrt(variance + STANDARDIZE_EPS)


#: Each transform of :class:`Transform`, as a function of the layer outputs.
_TRANSFORMS = {"none": lambda z: z, "sqrt": _sqrt, "log1p": _log1p, "standardize": _standardize}


class Transform(nn.Module):
    """Per-example reshaping of a distance layer's outputs before the next layer.

    Squared distances of (roughly Gaussian) inputs are chi-squared: skewed to
    the right, with a long tail that the next layer sees as outliers.

    - ``"none"``: identity.
    - ``"sqrt"``: ``sqrt(max(z, 0))`` (chi-squared -> chi, nearly symmetric).
    - ``"log1p"``: ``log(1 + max(z, 0))`` (compresses the tail; smooth, slope 1 at 0).
    - ``"standardize"``: per example, subtract the mean over the layer's outputs
      and divide by their standard deviation (LayerNorm without affine part; no
      statistics across examples). Over dimension 1: for a convolutional distance
      layer's (n, J, H, W) outputs, over its memories at each position.

    Parameters
    ----------
    kind : {"none", "sqrt", "log1p", "standardize"}
    """

    def __init__(self, kind):
        super().__init__()
        if kind not in TRANSFORMS:
            raise ValueError(f"Unknown transform {kind!r}; expected one of {TRANSFORMS}.")
        self.kind = kind

    def forward(self, z):
        return _TRANSFORMS[self.kind](z)

    def extra_repr(self):
        return repr(self.kind)


class Negate(nn.Module):
    """``-z``: turns distances into logits (closer memory, larger logit)."""

    def forward(self, z):
        return -z


def _sample_rows(X, k):
    """``k`` distinct rows of ``X`` in random order (torch's global generator)."""
    # Drawn by the CPU generator (the same rows on every device).
    return X[torch.randperm(X.shape[0], device="cpu")[:k].to(X.device)]


def _kmeans_plusplus_rows(X, k):
    """k-means++ seeding (scikit-learn's greedy version) on ``k <= n`` rows of ``X``."""
    # scikit-learn draws from a numpy generator; seed it from torch's so that the
    # estimator's random_state (which seeds torch) makes it deterministic.
    seed = int(torch.randint(0, 2**31 - 1, (), device="cpu").item())
    _, indices = kmeans_plusplus(X.detach().cpu().numpy(), k, random_state=seed)
    return X[torch.as_tensor(indices, device=X.device)]


def init_memories(layer, X, method):
    """Initialise ``layer.memories`` in place from the layer's inputs ``X``.

    Parameters
    ----------
    layer : DistanceLayer or DistanceConv2d
    X : torch.Tensor of shape (n, layer.in_features)
        The rows the layer compares with its memories (for deeper layers, the
        previous layers' outputs on the training data; for a convolutional
        layer, the training images' patches, ``DistanceConv2d.patch_rows``).
    method : {"uniform", "kmeans++", "samples"}
        ``"uniform"`` keeps ``nn.Linear``'s range; ``"samples"`` copies random
        distinct rows of ``X``; ``"kmeans++"`` picks rows by k-means++ seeding
        (spread over the data). With more memories than rows, the extra memories
        keep their uniform initialisation. Draws use torch's global generator.

    Returns
    -------
    layer : DistanceLayer or DistanceConv2d
    """
    if method not in INITS:
        raise ValueError(f"Unknown init {method!r}; expected one of {INITS}.")
    layer.reset_parameters()
    if method == "uniform":
        return layer
    k = min(layer.n_memories, X.shape[0])
    rows = _sample_rows(X, k) if method == "samples" else _kmeans_plusplus_rows(X, k)
    with torch.no_grad():
        layer.memories[:k] = rows.to(layer.memories.dtype)
    return layer
