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

Switching points: none for the squared-distance kernels and rbf; ``"laplacian"``'s
``|u_d - m_d|`` and ``"cosine"``'s norm clamps are computed by the layer's own
forward pass (``torch.abs``, ``torch.clamp``), which the engine's generic switch
recording sees: this rule evaluates rows at one weight per pass
(``RowEvaluation.NONE``), so every forward pass is the layer's own.
"""

from dataclasses import dataclass

import torch

from ...._nn import COSINE_EPS, SIMILARITIES, DistanceConv2d, kernel_values
from .._gradients import Gradients, MaterialisedRule
from .._protocol import RowEvaluation
from .._registry import register_rule

_LOCAL_NAMES = ("memories", "bias", "log_gamma")
# Memory for one chunk of the laplacian's (rows, P, J, D) sign patterns.
_SIGN_CHUNK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class _KernelParameters:
    """The parameters ``kernel_values`` reads, at the weights of a batch."""

    kernel: str
    in_features: int
    memories: torch.Tensor
    log_gamma: torch.Tensor | None


@register_rule(DistanceConv2d)
class DistanceConv2dRule(MaterialisedRule):
    """Closed-form per-example gradients of a :class:`DistanceConv2d` (every kernel).

    Factors are :class:`Gradients` (n, K, W) laid out as the memories (J, D) flat,
    then the bias (J,), then ``log_gamma`` (J,), each only when in the path.

    Parameters
    ----------
    module : DistanceConv2d
    names : dict
        The module's parameters that are in the path: local name -> path name.
        Parameters not in the path are constants (the module's own values).
    """

    row_evaluation = RowEvaluation.NONE

    def __init__(self, module, names):
        self.module = module
        self.names = dict(names)
        self.path_names = [self.names[name] for name in _LOCAL_NAMES if name in self.names]

    @classmethod
    def for_module(cls, module, names):
        local = {name for name, _ in module.named_parameters(recurse=False)}
        return cls(module, names) if local <= set(_LOCAL_NAMES) else None

    def _value(self, local, weights):
        """Parameter ``local`` at ``weights`` (the module's own value when not in the path)."""
        full = self.names.get(local)
        value = getattr(self.module, local) if full is None else weights.params[full]
        return None if value is None else value.detach()

    def factors(self, inputs, delta, weights):
        """The per-example gradients (n, K, W) of rows ``inputs[0]`` (n, C, H, W) with
        cotangents ``delta`` (n, K, J, H_out, W_out), at ``weights.params``."""
        layer = self.module
        with torch.no_grad():
            x = inputs[0].detach()
            layer.check_input(x)
            delta = delta.detach().flatten(3)  # (n, K, J, P)
            n, n_outputs, n_memories, n_positions = delta.shape
            params = _KernelParameters(
                layer.kernel,
                layer.in_features,
                self._value("memories", weights),
                self._value("log_gamma", weights),
            )
            columns = layer.unfold(x)  # (n, D, P)
            patches = columns.transpose(1, 2).reshape(-1, layer.in_features)
            values = kernel_values(params, patches).view(n, n_positions, n_memories)
            values = values.transpose(1, 2)  # (n, J, P)
            parts = []
            if "memories" in self.names:
                grads = _MEMORY_GRADIENTS[layer.kernel](params, columns, values, delta)
                parts.append(grads.flatten(2))
            if "bias" in self.names:
                parts.append(delta.sum(-1))
            if "log_gamma" in self.names:
                stat = _width_statistic(params, patches).view(n, n_positions, n_memories)
                slope = -params.log_gamma.exp()[:, None] * stat.transpose(1, 2) * values
                parts.append(torch.einsum("nkjp,njp->nkj", delta, slope))
            return Gradients(torch.cat(parts, 2))


def _affine(coefficients, columns, offsets, memories):
    """``sum_p c_kjp u_p - o_kj m_j`` per row: (n, K, J, D) from coefficients
    (n, K, J, P), columns (n, D, P) and offsets (n, K, J)."""
    return torch.einsum("nkjp,ndp->nkjd", coefficients, columns) - offsets[..., None] * memories


def _squared_family(params, columns, values, delta):
    """``sum_p a_p (u_p - m_j)`` with ``a = delta s`` (see the module docstring)."""
    width = params.in_features
    if params.kernel == "sqeuclidean":
        coefficients = delta * (-2.0 / width)
    elif params.kernel == "euclidean":
        # values = |e| / sqrt(D); s = -1 / (sqrt(D) |e|) = -1 / (D values), 0 at e = 0.
        inverse = torch.where(values > 0, 1.0 / (width * values), torch.zeros_like(values))
        coefficients = -delta * inverse[:, None]
    else:  # rbf
        gamma = params.log_gamma.exp()[:, None]
        coefficients = delta * (2.0 / width * gamma * values)[:, None]
    return _affine(coefficients, columns, coefficients.sum(-1), params.memories)


def _cosine(params, columns, values, delta):
    """``(sum_p delta u_p / |u_p|) / |m| - (sum_p delta k_p) m / |m|^2`` (clamped norms)."""
    memories = params.memories
    patch_norms = torch.clamp(torch.linalg.vector_norm(columns, dim=1), min=COSINE_EPS)
    raw_norms = torch.linalg.vector_norm(memories, dim=1)
    memory_norms = torch.clamp(raw_norms, min=COSINE_EPS)
    coefficients = delta / patch_norms[:, None, None] / memory_norms[:, None]
    # The clamped norm is a constant: no memory term where |m| <= eps.
    radial = torch.where(raw_norms > COSINE_EPS, 1.0 / memory_norms.square(), 0.0)
    offsets = torch.einsum("nkjp,njp->nkj", delta, values) * radial
    return _affine(coefficients, columns, offsets, memories)


def _laplacian(params, columns, values, delta):
    """``sum_p (delta gamma k / D)_p sign(u_p - m_j)``, chunked over rows."""
    memories, width = params.memories, params.in_features
    gamma = params.log_gamma.exp()[:, None]
    coefficients = delta * (gamma * values / width)[:, None]  # (n, K, J, P)
    n, n_positions = columns.shape[0], columns.shape[2]
    per_row = 8 * n_positions * memories.numel()
    chunk = max(1, int(_SIGN_CHUNK_BYTES // per_row))
    out = []
    for begin in range(0, n, chunk):
        rows = slice(begin, begin + chunk)
        patches = columns[rows].transpose(1, 2)  # (c, P, D)
        signs = torch.sign(patches[:, :, None, :] - memories)  # (c, P, J, D)
        out.append(torch.einsum("ckjp,cpjd->ckjd", coefficients[rows], signs))
    if not out:
        return columns.new_zeros((0, delta.shape[1], *memories.shape))
    return torch.cat(out)


#: The memory gradients (n, K, J, D) of each kernel.
_MEMORY_GRADIENTS = {
    "sqeuclidean": _squared_family,
    "euclidean": _squared_family,
    "rbf": _squared_family,
    "cosine": _cosine,
    "laplacian": _laplacian,
}


def _width_statistic(params, patches):
    """``msd`` (rbf) or ``mad`` (laplacian) of patch rows (n P, D) and memories, (n P, J),
    computed as the layer computes them (so ``k = exp(-gamma stat)`` exactly)."""
    if params.kernel == "rbf":
        return SIMILARITIES["sqeuclidean"](params, patches)
    return torch.abs(patches[:, None, :] - params.memories[None, :, :]).mean(-1)
