"""The rule of :class:`~sklearn_pathkernel._nn._distance_conv.DistanceConv2d`: per-example
gradients in closed form from the unfolded patches.

Notation: the patches of example ``i`` are the columns ``u_ip`` (D,) of its
unfolded input (``F.unfold``, as in the ``nn.Conv2d`` rule), the memories ``m_j``,
the output ``z_ijp = k(u_ip, m_j) + b_j`` and ``delta_ikjp = d f_k / d z_ijp``.
Per position, the memory gradient of every kernel is a coefficient times a
direction, and for all kernels but the laplacian the direction is affine in the
memory, so the per-example gradient is a sum over positions that never forms a
per-position gradient:

- ``"sqeuclidean"``, ``"euclidean"``, ``"rbf"`` (``e = u - m``, ``msd = |e|^2 / D``):
  ``d k / d m = s e`` with ``s = -2 / D``, ``-1 / (sqrt(D) |e|)`` (0 at ``e = 0``, the
  layer's convention) and ``2 gamma k / D``, so with ``a_ikjp = delta_ikjp s_ijp``

      d f_k / d m_j = sum_p a_ikjp u_ip - (sum_p a_ikjp) m_j;

  rbf's ``d f_k / d log_gamma_j = -sum_p delta_ikjp gamma_j msd_ijp k_ijp``.
- ``"cosine"`` (norms clamped at ``COSINE_EPS`` like the layer):
  ``d k / d m = u / (|u| |m|) - [|m| > eps] k m / |m|^2``, so
  ``d f_k / d m_j = (sum_p delta u_p / |u_p|) / |m_j| - (sum_p delta k_p) m_j / |m_j|^2``.
- ``"laplacian"``: ``d k / d m = gamma k sign(u - m) / D`` and
  ``d k / d log_gamma = -gamma mad k``; the sign pattern has no affine form, so
  its sum over positions is formed from (rows, P, J, D) signs, in chunks of rows.
- bias: ``d f_k / d b_j = sum_p delta_ikjp``.

Cost: ``O(n K J P D)`` to form the gradients (n, K, J (D + 1 or 2)), and
``O(n m K K' J D)`` for their inner products (:class:`Gradients`). A factored form
like the convolution's (patches and cotangents kept, products summed over position
pairs) would cost ``O(P^2 (D + K K' J))`` per pair of rows instead of ``O(K K' J D)``:
more for every geometry where ``P^2 > J D``, which holds for the small patches of
image layers (digits, 3x3 patches on 8x8: ``P^2 = 1296``, ``J D = 144`` for 16
memories), so the rule keeps the gradients.

Accuracy: measured against per-sample Jacobians (the tests' cases, a patch on a
memory included), at most 5e-16 relative to the largest entry for every kernel.
The affine form rounds ``a (u - m)`` as ``a u - a m``: an estimated relative error
``eps |u| / |e|`` on ``"euclidean"``'s unit-direction terms where a patch is close
to (but not on) a memory (not measured).

Rows at their own weights (``RowEvaluation.OUTPUT_AT``): row ``i`` of a batch may
sit at ``w + t_i dw`` (quadrature nodes of several queries, kink-search points,
the step's training rows at ``t = 0``), each row's patches compared with its own
memories ``mu_ij = m_j + t_i dm_j`` (:func:`patch_values`), so the probe
evaluates them all in one forward and one backward pass instead of one pass per
distinct ``t`` (on digits, 16 memories, 200 training images and Adam's 500 steps:
about 30 passes per step and query before). The gradients above hold with ``mu_ij``
in place of ``m_j``. Rows at ``t = 0`` get the layer's own values bit for bit.
Measured against the layer at each row's weights and its per-sample Jacobians
(``tests/engine/rules/test_distance_conv.py``): 1e-12 relative or better.

Cotangents at a min-pool's winners (``takes_pooled_cotangents``): the image
networks put ``MinPool2d`` right after the layer, so the probe's folded backward
pass gives ``delta`` as a :class:`PooledCotangent` (per row, output, memory and
window the cotangent at the window's winner, zero at every other position). The
squared-distance kernels and rbf then sum over the winners alone (the patches at
the winners gathered per row and memory: ``O(n K J P' D)`` with ``P' = P / 4``
for 2x2 windows, and no zero-filled full-resolution cotangents); cosine and the
laplacian take them at full resolution. The same terms as the sums over every
position without the zeros: equal to rounding (measured: 3e-16 relative on the
digits cell's training rows).

Switching points: none for the squared-distance kernels and rbf; ``"laplacian"``'s
``|u_d - mu_d|`` and ``"cosine"``'s norm clamps go through ``torch.abs`` and
``torch.clamp`` per row, which the engine's generic switch recording sees; the
per-row distances avoid every other recorded operation.
"""

from dataclasses import dataclass

import torch

from ...._nn import COSINE_EPS, SIMILARITIES, DistanceConv2d, kernel_values
from .._gradients import Gradients, MaterialisedRule
from .._protocol import PerRowWeights, PooledCotangent, RowEvaluation
from .._registry import register_rule
from ._geometry import NEAR_PAIRS, memories_at, squared_norm

_LOCAL_NAMES = ("memories", "bias", "log_gamma")
# Memory for one chunk of the laplacian's (rows, P, J, D) sign patterns.
_SIGN_CHUNK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class _LayerView:
    """What ``kernel_values`` reads of a layer, at given weights."""

    kernel: str
    in_features: int
    memories: torch.Tensor
    log_gamma: torch.Tensor | None


@dataclass(frozen=True)
class _KernelParameters:
    """The kernel's parameters for a batch of rows, row ``i`` at ``w + t_i dw``.

    Parameters
    ----------
    kernel : str
    in_features : int
        The patch width ``D``.
    m, dm : torch.Tensor of shape (J, D); dm None when the memories do not move
    log_gamma, d_log_gamma : torch.Tensor of shape (J,) or None
        rbf's and laplacian's log-widths and their step.
    t : torch.Tensor of shape (n,) or None
        Each row's point on the step; None for rows at ``m``.
    """

    kernel: str
    in_features: int
    m: torch.Tensor
    dm: torch.Tensor | None = None
    log_gamma: torch.Tensor | None = None
    d_log_gamma: torch.Tensor | None = None
    t: torch.Tensor | None = None

    @property
    def moves(self):
        """Whether some row's kernel differs from the one at the step's start."""
        return self.t is not None and (self.dm is not None or self.d_log_gamma is not None)

    @property
    def at_start(self):
        return _LayerView(self.kernel, self.in_features, self.m, self.log_gamma)

    @property
    def memories(self):
        """``mu_ij = m_j + t_i dm_j``, (n, J, D); (1, J, D) when they do not move."""
        if self.t is None or self.dm is None:
            return self.m[None]
        return memories_at(self.m, self.dm, self.t)

    @property
    def gamma(self):
        """``exp(log_gamma + t_i d log_gamma)``, (n, J) or (1, J); None without widths."""
        if self.log_gamma is None:
            return None
        log_gamma = self.log_gamma[None]
        if self.t is not None and self.d_log_gamma is not None:
            log_gamma = log_gamma + self.t[:, None] * self.d_log_gamma
        return log_gamma.exp()


@register_rule(DistanceConv2d)
class DistanceConv2dRule(MaterialisedRule, PerRowWeights):
    """Closed-form per-example gradients of a :class:`DistanceConv2d` (every kernel).

    Factors are :class:`Gradients` (n, K, W) laid out as the memories (J, D) flat,
    then the bias (J,), then ``log_gamma`` (J,), each only when in the path.

    Rows at their own points of a step (quadrature nodes, kink-search points,
    the batch's rows at the step's start) are evaluated in one pass
    (:meth:`output_at`, see :func:`patch_values`), so that a step's nodes of
    every query share one forward and one backward pass instead of one pass per
    distinct ``t``.

    Parameters
    ----------
    module : DistanceConv2d
    names : dict
        The module's parameters that are in the path: local name -> path name.
        Parameters not in the path are constants (the module's own values).
    """

    row_evaluation = RowEvaluation.OUTPUT_AT
    #: A min-pool's winners (the image networks' ``MinPool2d`` after the layer):
    #: the squared-distance kernels sum over them alone (:class:`_Positions`).
    takes_pooled_cotangents = True

    def __init__(self, module, names):
        self.module = module
        self.names = dict(names)
        self.path_names = [self.names[name] for name in _LOCAL_NAMES if name in self.names]

    @classmethod
    def for_module(cls, module, names):
        local = {name for name, _ in module.named_parameters(recurse=False)}
        return cls(module, names) if local <= set(_LOCAL_NAMES) else None

    def param(self, local, weights):
        """(value at ``weights.params``, its step or None) of parameter ``local``; the
        module's own value (no step) when it is not in the path, None if the layer
        has none."""
        full = self.names.get(local)
        if full is None:
            value = getattr(self.module, local)
            return (None if value is None else value.detach()), None
        step = weights.steps[full] if weights.moving else None
        return weights.params[full].detach(), step

    def _parameters(self, weights):
        """The kernel's :class:`_KernelParameters` at ``weights``."""
        m, dm = self.param("memories", weights)
        log_gamma, d_log_gamma = self.param("log_gamma", weights)
        t = weights.t if weights.moving else None
        layer = self.module
        return _KernelParameters(layer.kernel, layer.in_features, m, dm, log_gamma, d_log_gamma, t)

    def output_at(self, inputs, weights):
        """The layer's output (n, J, H_out, W_out) with row ``i`` at ``params + t_i
        steps``: differentiable with respect to the input, not the parameters."""
        x = inputs[0]
        layer = self.module
        height, width = layer.check_input(x)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in weights.params.values())
        )
        values = patch_values(self._parameters(weights), layer.patch_rows(x), x.shape[0])
        out = values.view(x.shape[0], height, width, layer.n_memories).permute(0, 3, 1, 2)
        bias, d_bias = self.param("bias", weights)
        if bias is not None:
            if d_bias is not None:
                bias = bias + weights.t[:, None] * d_bias
            out = out + bias[..., None, None]
        if needs_grad and not out.requires_grad:
            out = out.detach().requires_grad_(True)
        return out

    def factors(self, inputs, delta, weights):
        """The per-example gradients (n, K, W) of rows ``inputs[0]`` (n, C, H, W) with
        cotangents ``delta`` (n, K, J, H_out, W_out), or a :class:`PooledCotangent`
        (a min-pool's winners), row ``i`` at its own weights (``weights``: a
        :class:`RowWeights`, moving or not)."""
        layer = self.module
        with torch.no_grad():
            x = inputs[0].detach()
            layer.check_input(x)
            params = self._parameters(weights)
            columns = layer.unfold(x)  # (n, D, P)
            patches = columns.transpose(1, 2).reshape(-1, layer.in_features)
            positions, delta = _Positions.of(columns, patches, delta, layer.kernel)
            n, n_memories, n_positions = x.shape[0], layer.n_memories, columns.shape[2]
            values = None  # (sqeuclidean's gradients do not read them)
            if layer.kernel != "sqeuclidean":
                values = patch_values(params, patches, n).view(n, n_positions, n_memories)
                values = positions.at(values.transpose(1, 2))  # (n, J, P')
            parts = []
            if "memories" in self.names:
                grads = _MEMORY_GRADIENTS[layer.kernel](params, positions, values, delta)
                parts.append(grads.flatten(2))
            if "bias" in self.names:
                parts.append(delta.sum(-1))
            if "log_gamma" in self.names:
                stat = positions.at(_width_statistic(params, patches, n))  # (n, J, P')
                slope = -params.gamma[..., None] * stat * values
                parts.append(torch.einsum("nkjp,njp->nkj", delta, slope))
            return Gradients(torch.cat(parts, 2))


#: The kernels whose memory gradients sum over a pool's winners alone
#: (:class:`_Positions`); the others take the full-resolution cotangents.
_AT_WINNERS = ("sqeuclidean", "euclidean", "rbf")


@dataclass(frozen=True)
class _Positions:
    """The output positions a batch's cotangents are summed over: all ``P`` of
    them (``winners`` None), or per row and memory the winners of a min-pool's
    windows (a :class:`PooledCotangent`: the cotangent is zero elsewhere, so
    the sums over positions are sums over the winners, a quarter of the terms
    for 2x2 windows; the same terms in another order, rounding).

    Parameters
    ----------
    columns : torch.Tensor of shape (n, D, P)
        The rows' patches (``F.unfold``).
    patches : torch.Tensor of shape (n P, D)
        The same patches as rows.
    winners : torch.Tensor of shape (n, J, P') or None
        Each window's winner, a flat output position (the pool's saved indices).
    """

    columns: torch.Tensor
    patches: torch.Tensor
    winners: torch.Tensor | None = None

    @classmethod
    def of(cls, columns, patches, delta, kernel):
        """The positions of ``delta`` and its values (n, K, J, P'): a pooled
        cotangent's winners for the kernels of ``_AT_WINNERS``, every position
        (the pooled one formed at full resolution for the others)."""
        if isinstance(delta, PooledCotangent) and kernel in _AT_WINNERS:
            values, winners = delta.flat()
            return cls(columns, patches, winners), values.detach()
        if isinstance(delta, PooledCotangent):
            delta = delta.dense()
        return cls(columns, patches), delta.detach().flatten(3)

    def at(self, per_position):
        """Values per row, memory and output position (n, J, P) at these
        positions (n, J, P')."""
        return per_position if self.winners is None else per_position.gather(2, self.winners)

    def affine(self, coefficients, offsets, memories):
        """``sum_p c_kjp u_p - o_kj mu_j`` (n, K, J, D) over these positions, from
        coefficients (n, K, J, P'), offsets (n, K, J) and memories (r, J, D)."""
        if self.winners is None:
            return _affine(coefficients, self.columns, offsets, memories)
        n, width, n_positions = self.columns.shape
        rows = torch.arange(n, device=self.patches.device)[:, None, None]
        flat = (rows * n_positions + self.winners).flatten()
        at_winners = self.patches.index_select(0, flat).view(*self.winners.shape, width)
        out = torch.einsum("nkjw,njwd->nkjd", coefficients, at_winners)  # (n, J, P', D) patches
        return out.sub_(offsets[..., None] * memories[:, None])


def patch_values(params, patches, n):
    """``k(u_ip, mu_ij)`` (n P, J) of the patch rows (n P, D) of ``n`` rows, row ``i``
    at its own point ``t_i`` of the step (``params``: :class:`_KernelParameters`).

    At ``t_i = 0`` (a training batch's rows) the values are the layer's own,
    bit for bit: a pool over positions then picks the winners that training
    picked, ties included (patches of pixels on a grid of 1/16 tie exactly).
    Moving rows add the step's terms to the start's exact distances,

        |u - m - t dm|^2 = |u - m|^2 + t (t |dm|^2 - 2 (u - m) . dm),

    with ``(u - m) . dm`` expanded about the mean memory, and sum the pairs where
    that cancels (below ``NEAR_PAIRS`` of its rounding bound) from explicit
    differences; cosine's dot products and norms and the laplacian's absolute
    differences are those of each row's memories. No operation that the kink
    search records but the kernel's own (the laplacian's ``abs``, cosine's
    norm clamps).
    """
    if not params.moves:
        return kernel_values(params.at_start, patches)
    n_positions = patches.shape[0] // max(n, 1)
    t = params.t.repeat_interleave(n_positions)[:, None]  # (n P, 1)
    kernel = params.kernel
    if kernel == "laplacian":
        mad = _mean_abs(patches, params.memories, n, n_positions)
        return torch.exp(-_per_patch(params.gamma, n, n_positions) * mad)
    if kernel == "cosine":
        m, dm = params.m, params.dm
        dot = patches @ m.T
        if dm is not None:
            dot = dot + t * (patches @ dm.T)
        x_norm = torch.clamp(torch.linalg.vector_norm(patches, dim=1, keepdim=True), min=COSINE_EPS)
        m_norm = torch.linalg.vector_norm(params.memories, dim=-1)
        m_norm = torch.clamp(_per_patch(m_norm, n, n_positions), min=COSINE_EPS)
        return dot / (x_norm * m_norm)
    msd, root = _moving_msd(params, patches, t)
    if kernel == "sqeuclidean":
        return msd
    if kernel == "euclidean":
        moved = torch.sqrt(torch.where(msd > 0, msd, 0.0))
        return torch.where(t == 0, root, moved)
    return torch.exp(-_per_patch(params.gamma, n, n_positions) * msd)  # rbf


def _per_patch(values, n, n_positions):
    """(r, J) per-row values as (n P, J) per-patch values (r = 1: shared)."""
    return values.expand(n, -1).repeat_interleave(n_positions, 0)


def _moving_msd(params, patches, t):
    """``msd(u_ip, mu_ij)`` (n P, J) for patch rows at ``t`` (n P, 1), and the
    layer's own ``sqrt(msd)`` at the step's start (see :func:`patch_values`)."""
    m, dm, width = params.m, params.dm, params.in_features
    root = SIMILARITIES["euclidean"](params.at_start, patches)
    msd = root.square()
    if dm is None:
        return msd, root
    centre = m.mean(0)
    centred = patches - centre
    e_dm = centred @ dm.T - ((m - centre) * dm).sum(1)  # (u - m) . dm
    squared = width * msd + t * (t * squared_norm(dm) - 2.0 * e_dm)
    # |t| without abs(), which the kink search would take for a switch.
    bound = (
        torch.linalg.vector_norm(centred, dim=1)[:, None]
        + torch.linalg.vector_norm(m - centre, dim=1)
        + t.square().sqrt() * torch.linalg.vector_norm(dm, dim=1)
    )
    near = (squared.detach() < NEAR_PAIRS * bound.square()) & (t != 0)
    rows, cols = torch.nonzero(near, as_tuple=True)
    if rows.numel():
        mu = m[cols] + t[rows] * dm[cols]
        squared = squared.index_put((rows, cols), squared_norm(patches[rows] - mu))
    moved = squared / width
    return torch.where(t == 0, msd, moved), root


def _affine(coefficients, columns, offsets, memories):
    """``sum_p c_kjp u_p - o_kj mu_j`` per row: (n, K, J, D) from coefficients
    (n, K, J, P), columns (n, D, P), offsets (n, K, J) and memories (r, J, D).

    One batched product over the rows per output ``k``: the probe's cotangents
    are laid out output first, (K, n, J, P) in memory, so ``coefficients[:, k]``
    is read in place (a product over (n, K J, P) copied all of them first, the
    largest pass of the every-output factors of a training batch)."""
    n, n_outputs, n_memories = coefficients.shape[:3]
    patches = columns.transpose(1, 2)  # (n, P, D)
    out = columns.new_empty((n_outputs, n, n_memories, columns.shape[1]))
    for k in range(n_outputs):
        torch.bmm(coefficients[:, k], patches, out=out[k])
    return out.transpose(0, 1).sub_(offsets[..., None] * memories[:, None])


def _squared_family(params, positions, values, delta):
    """``sum_p a_p (u_p - mu_j)`` with ``a = delta s`` (see the module docstring),
    over ``positions`` (:class:`_Positions`)."""
    width = params.in_features
    if params.kernel == "sqeuclidean":  # a constant slope: scaled after the sums
        grads = positions.affine(delta, delta.sum(-1), params.memories)
        return grads.mul_(-2.0 / width)
    if params.kernel == "euclidean":
        # values = |e| / sqrt(D); s = -1 / (sqrt(D) |e|) = -1 / (D values), 0 at e = 0.
        inverse = torch.where(values > 0, 1.0 / (width * values), torch.zeros_like(values))
        coefficients = -delta * inverse[:, None]
    else:  # rbf
        coefficients = delta * (2.0 / width * params.gamma[..., None] * values)[:, None]
    return positions.affine(coefficients, coefficients.sum(-1), params.memories)


def _cosine(params, positions, values, delta):
    """``(sum_p delta u_p / |u_p|) / |mu| - (sum_p delta k_p) mu / |mu|^2`` (clamped
    norms), over every position."""
    columns, memories = positions.columns, params.memories  # (r, J, D)
    patch_norms = torch.clamp(torch.linalg.vector_norm(columns, dim=1), min=COSINE_EPS)
    raw_norms = torch.linalg.vector_norm(memories, dim=-1)  # (r, J)
    memory_norms = torch.clamp(raw_norms, min=COSINE_EPS)
    coefficients = delta / patch_norms[:, None, None] / memory_norms[:, None, :, None]
    # The clamped norm is a constant: no memory term where |mu| <= eps.
    radial = torch.where(raw_norms > COSINE_EPS, 1.0 / memory_norms.square(), 0.0)
    offsets = torch.einsum("nkjp,njp->nkj", delta, values) * radial[:, None]
    return _affine(coefficients, columns, offsets, memories)


def _laplacian(params, positions, values, delta):
    """``sum_p (delta gamma k / D)_p sign(u_p - mu_j)`` over every position,
    chunked over rows."""
    columns = positions.columns
    memories, width = params.memories, params.in_features  # (r, J, D)
    coefficients = delta * (params.gamma[..., None] * values / width)[:, None]  # (n, K, J, P)
    n, n_positions = columns.shape[0], columns.shape[2]
    per_row = 8 * n_positions * memories[0].numel()
    chunk = max(1, int(_SIGN_CHUNK_BYTES // per_row))
    out = []
    for begin in range(0, n, chunk):
        rows = slice(begin, begin + chunk)
        patches = columns[rows].transpose(1, 2)  # (c, P, D)
        mu = memories[rows] if memories.shape[0] > 1 else memories
        signs = torch.sign(patches[:, :, None, :] - mu[:, None])  # (c, P, J, D)
        out.append(torch.einsum("ckjp,cpjd->ckjd", coefficients[rows], signs))
    if not out:
        return columns.new_zeros((0, delta.shape[1], *memories.shape[1:]))
    return torch.cat(out)


#: The memory gradients (n, K, J, D) of each kernel.
_MEMORY_GRADIENTS = {
    "sqeuclidean": _squared_family,
    "euclidean": _squared_family,
    "rbf": _squared_family,
    "cosine": _cosine,
    "laplacian": _laplacian,
}


def _mean_abs(patches, memories, n, n_positions):
    """``mean_d |u_ipd - mu_ijd|`` (n P, J) of patch rows (n P, D) and memories
    (r, J, D), through ``torch.abs`` on (n, P, J, D) differences (the layer's own
    operation: bit for bit its values at the step's start)."""
    rows = patches.view(n, n_positions, 1, -1)
    return torch.abs(rows - memories[:, None]).mean(-1).reshape(n * n_positions, -1)


def _width_statistic(params, patches, n):
    """``msd`` (rbf) or ``mad`` (laplacian) of the patch rows (n P, D) and each row's
    memories, (n, J, P), as :func:`patch_values` computes them (so ``k = exp(-gamma
    stat)``)."""
    n_positions = patches.shape[0] // max(n, 1)
    if params.kernel == "laplacian":
        stat = _mean_abs(patches, params.memories, n, n_positions)
    elif params.moves:
        t = params.t.repeat_interleave(n_positions)[:, None]
        stat = _moving_msd(params, patches, t)[0]
    else:
        stat = SIMILARITIES["sqeuclidean"](params.at_start, patches)
    return stat.view(n, n_positions, -1).transpose(1, 2)
