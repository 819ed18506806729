"""Typed factors of a :class:`~sklearn_pathkernel._nn._distance.DistanceLayer` batch.

Notation as in the package: inputs ``x_i`` (n, D), memories ``m_j`` (J, D), their
step ``dm_j``, a row's point ``t_i`` on the step, cotangents ``delta_ikj`` of the
layer's output for K outputs. Every factor object holds per-row tensors (leading
axis n; None for what the layer's parameters in the path do not need) and the
batch's :class:`Memories` (shared by its rows).
"""

import dataclasses
from dataclasses import dataclass, field

import torch

from ._geometry import memory_dots


@dataclass(frozen=True)
class Memories:
    """What the rows of a batch share: the memories and their step.

    Parameters
    ----------
    m : torch.Tensor of shape (J, D)
        The memories at the step's start.
    dm : torch.Tensor of shape (J, D) or None
        Their step; None when they do not move or the rows sit at the step's start.
    n_outputs : int
        K, the outputs kept per row.
    centre : torch.Tensor of shape (D,) or None
        The mean memory (the squared-distance kernels' expansion centre).
    """

    m: torch.Tensor
    dm: torch.Tensor | None
    n_outputs: int
    centre: torch.Tensor | None = None

    def compatible(self, other):
        """Whether two batches refer to the same memories (and steps, where both move)."""
        if not (self.m is other.m or torch.equal(self.m, other.m)):
            return False
        if self.dm is None or other.dm is None:
            return True
        return self.dm is other.dm or torch.equal(self.dm, other.dm)


@dataclass(frozen=True)
class DistanceFactors:
    """Per-row factors common to every kernel family.

    Parameters
    ----------
    memories : Memories
    x : torch.Tensor of shape (n, D)
    t : torch.Tensor of shape (n,) or None
        Each row's point on the step; None for rows at the step's start.
    bias : torch.Tensor of shape (n, K, J) or None
        The bias gradients ``d f_k / d b_j = delta_kj`` (bias in the path).
    """

    memories: Memories
    x: torch.Tensor
    t: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    # Per-step dot products (keyed by name, for the step they were computed for).
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    #: Row fields computed from the step for moving rows (see :meth:`at_zero`).
    STEP_DOTS = ()

    def _row_fields(self):
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ("memories", "_cache") and getattr(self, f.name) is not None
        ]

    def take(self, index):
        """The factors of a subset of rows."""
        values = {name: getattr(self, name)[index] for name in self._row_fields()}
        return dataclasses.replace(self, _cache={}, **values)

    @property
    def nbytes(self):
        """Memory held per row (the shared memories are not counted)."""
        return sum(getattr(self, name).nbytes for name in self._row_fields())

    @property
    def extra_coefficients(self):
        """The (n, K, J) gradients of the per-memory parameters other than the
        memories (bias, then widths), in the layout order."""
        values = (self.bias, self.widths)
        return [value for value in values if value is not None]

    @property
    def widths(self):
        """The per-memory widths' gradients (n, K, J), for a family with widths in
        the path; None here (no width parameter)."""
        return None

    @staticmethod
    def cat(parts):
        """Stack the rows of several factors of the same layer and step; rows at the
        step's start next to moving rows become moving rows with ``t = 0``."""
        moving = [p for p in parts if p.t is not None]
        if moving and len(moving) < len(parts):
            parts = [p if p.t is not None else p.at_zero(moving[0]) for p in parts]
        names = parts[0]._row_fields()
        values = {name: torch.cat([getattr(p, name) for p in parts]) for name in names}
        return dataclasses.replace(parts[0], _cache={}, **values)

    def at_zero(self, moving):
        """These rows (at the step's start) as moving rows with ``t = 0``, with the
        memories and step of ``moving`` and its step dot products."""
        x = self.x
        t = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        moved = dataclasses.replace(self, memories=moving.memories, t=t, _cache={})
        dots = {
            name: getattr(moved, method)(moving.memories.dm)
            for name, method in self.STEP_DOTS
            if getattr(moving, name) is not None
        }
        return dataclasses.replace(moved, **dots)

    def _cached(self, key, dm, compute):
        hit = self._cache.get(key)
        if hit is None or hit[0] is not dm:
            hit = (dm, compute())
            self._cache[key] = hit
        return hit[1]


@dataclass(frozen=True)
class SquaredDistanceFactors(DistanceFactors):
    """Factors of the kernels of the mean squared distance ``msd = |e|^2 / D``
    ("sqeuclidean", "euclidean", "rbf"), ``e_ij = x_i - mu_ij``.

    Parameters
    ----------
    near : torch.Tensor of shape (n, J), bool
        The pairs whose distances were summed from explicit differences.
    sigma : torch.Tensor of shape (n, K, J) or None
        The memory gradients' coefficients, ``d f_k / d m_j = sigma_kj e_j``
        (memories in the path). For integrated factors, ``S = sum_q w_q sigma_q``.
    h : torch.Tensor of shape (n, J) or None
        ``e_ij . e_ij / 2`` (moving rows: expanded about the step's start, see
        ``SquaredDistanceFamily``); with ``sigma``.
    q : torch.Tensor of shape (n, J) or None
        ``(x_i - c) . dm_j`` for moving rows with the memories in the path.
    sigma_t : torch.Tensor of shape (n, K, J) or None
        Integrated factors only: ``T = sum_q w_q t_q sigma_q``.
    log_gamma : torch.Tensor of shape (n, K, J) or None
        rbf's width gradients ``d f_k / d log_gamma_j`` (widths in the path).
    """

    near: torch.Tensor | None = None
    sigma: torch.Tensor | None = None
    h: torch.Tensor | None = None
    q: torch.Tensor | None = None
    sigma_t: torch.Tensor | None = None
    log_gamma: torch.Tensor | None = None

    STEP_DOTS = (("q", "centred_dot"),)

    @property
    def widths(self):
        """rbf's width gradients ``log_gamma`` (None for the other kernels)."""
        return self.log_gamma

    def centred_dot(self, dm):
        """``(x_i - c) . dm_j`` with ``c`` the mean memory, (n, J)."""
        if self.q is not None:
            return self.q
        return self._cached("q", dm, lambda: (self.x - self.memories.centre) @ dm.T)

    def step_dots(self, dm):
        """``e_ij . dm_j`` (explicit on the near pairs), (n, J)."""
        memories = self.memories
        return self._cached(
            "e_dm", dm, lambda: memory_dots(self.x, memories.m, memories.dm, self.t, dm, self.near)
        )


@dataclass(frozen=True)
class CosineFactors(DistanceFactors):
    """Factors of the cosine kernel, ``d f_k / d m_j = alpha_kj x + beta_kj mu_j``.

    Parameters
    ----------
    alpha, beta : torch.Tensor of shape (n, K, J) or None
        ``alpha = delta / (|x| |mu|)``, ``beta = -delta k / |mu|^2`` (memories in
        the path; no ``beta`` where the memory's norm is clamped).
    P : torch.Tensor of shape (n, J) or None
        ``x_i . m_j`` (memories in the path).
    Q : torch.Tensor of shape (n, J) or None
        ``x_i . dm_j`` for moving rows.
    """

    alpha: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    P: torch.Tensor | None = None
    Q: torch.Tensor | None = None

    STEP_DOTS = (("Q", "plain_dot"),)

    def plain_dot(self, dm):
        """``x_i . dm_j``, (n, J)."""
        if self.Q is not None:
            return self.Q
        return self._cached("Q", dm, lambda: self.x @ dm.T)
