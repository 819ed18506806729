"""The factored rule of :class:`~sklearn_pathkernel._nn._distance.DistanceLayer`."""

import torch

from ...._nn import DistanceLayer
from ..._modes import OutputMode
from .._contract import contract
from .._protocol import PerRowWeights
from .._registry import register_rule
from ._backward import AFFINE_KERNELS, own_output
from ._cosine import CosineFamily
from ._factors import Memories
from ._squared import SquaredDistanceFamily

#: The kernel families with a factored rule, by the layer's ``kernel``
#: ("laplacian" keeps the generic torch.func rule: its memory gradient is a sign
#: pattern per (example, memory), with no low-rank form).
FAMILIES = {
    "sqeuclidean": SquaredDistanceFamily,
    "euclidean": SquaredDistanceFamily,
    "rbf": SquaredDistanceFamily,
    "cosine": CosineFamily,
}
FACTORED_KERNELS = tuple(FAMILIES)
_LOCAL_NAMES = ("memories", "bias", "log_gamma")


@register_rule(DistanceLayer)
class DistanceRule(PerRowWeights):
    """Factored rule for :class:`DistanceLayer` ("sqeuclidean", "euclidean", "rbf", "cosine").

    The bias and width gradients are (n, K, J) coefficient tensors, contracted
    as they are; the memories' part is the layer's kernel family's
    (``SquaredDistanceFamily``, ``CosineFamily``). Inner products cost
    ``O(n m (D + K J))`` instead of ``O(n m K J D)`` for materialised gradients.

    Parameters
    ----------
    module : DistanceLayer
    names : dict
        The module's parameters that are in the path: local name -> path name.
        Parameters not in the path are constants (the module's own values).
    """

    def __init__(self, module, names):
        self.module = module
        self.names = dict(names)
        self.path_names = [self.names[name] for name in _LOCAL_NAMES if name in self.names]
        self.family = FAMILIES[module.kernel](self)
        # The batched backward pass through ``torch.cdist`` runs once per output:
        # the squared-distance kernels pull back in closed form (``_backward``).
        self.replaces_own_forward = module.kernel in AFFINE_KERNELS

    @classmethod
    def for_module(cls, module, names):
        local = {name for name, _ in module.named_parameters(recurse=False)}
        if module.kernel not in FAMILIES or not local <= set(_LOCAL_NAMES):
            return None
        return cls(module, names)

    def param(self, local, weights):
        """(value at the step's start, its step or None) of parameter ``local``; the
        module's own value (no step) when it is not in the path, None if the layer
        has none."""
        full = self.names.get(local)
        if full is None:
            value = getattr(self.module, local)
            return (None if value is None else value.detach()), None
        step = weights.steps[full] if weights.moving else None
        return weights.params[full], step

    # -- per-row evaluation ---------------------------------------------------------

    def output_at(self, inputs, weights):
        """The layer's output with row ``i`` at weights ``params + t_i steps``, (n, J).

        Differentiable with respect to the input; the output requires grad
        whenever the input or the parameters do (so that the probe can
        back-propagate to it), but it is not differentiated with respect to
        the parameters. Avoids the operations the kink recorder watches except
        cosine's norm clamps, which are genuine kinks of the layer.
        """
        x = inputs[0]
        layer = self.module
        if x.ndim != 2 or x.shape[1] != layer.in_features:
            raise ValueError(
                f"DistanceLayer expects input of shape (n, {layer.in_features}), "
                f"got {tuple(x.shape)}."
            )
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in weights.params.values())
        )
        out = self.family.output(x, weights)
        bias, d_bias = self.param("bias", weights)
        if bias is not None:
            t_col = weights.t[:, None]
            out = out + (bias.detach() if d_bias is None else bias.detach() + t_col * d_bias)
        if needs_grad and not out.requires_grad:
            out = out.detach().requires_grad_(True)
        return out

    def own_output(self, inputs):
        """The layer's own output, bit for bit, with the closed-form backward pass to
        its input of ``_backward.own_output`` (the squared-distance kernels)."""
        return own_output(self.module, inputs[0])

    def input_vjp(self, inputs, weights):
        """For rows at their own weights: ``K`` cotangents of the output (K, n, J) to
        those of the input (K, n, D) in closed form (the squared-distance kernels,
        ``SquaredDistanceFamily.input_vjp``), or None (cosine: the backward pass
        differentiates :meth:`output_at`)."""
        x = inputs[0]
        if not weights.moving or x.ndim != 2 or x.shape[1] != self.module.in_features:
            return None
        return self.family.input_vjp(x, weights)

    # -- factors --------------------------------------------------------------------

    def factors(self, inputs, delta, weights):
        """Factors of rows ``x`` with back-propagated ``delta`` (n, K, J), the rows
        at ``weights``: ``O(n J (D + K))``."""
        with torch.no_grad():
            x, delta = inputs[0].detach(), delta.detach()
            m, dm = self.param("memories", weights)
            m = m.detach()
            centre = m.mean(0) if isinstance(self.family, SquaredDistanceFamily) else None
            memories = Memories(m, dm, delta.shape[1], centre)
            common = {
                "memories": memories,
                "x": x,
                "t": None if dm is None else weights.t,
                "bias": delta if "bias" in self.names else None,
            }
            return self.family.factors(x, delta, weights, common)

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Factors of each row's weighted sum of gradients over its nodes, or None
        (the family's closed form; see ``SquaredDistanceFamily.integrate``)."""
        return self.family.integrate(rows, weights, factors, n_rows)

    # -- inner products -----------------------------------------------------------------

    def inner(self, left, right, mode):
        """Inner products of per-example gradients: (n, m), (n, m, K, K') or (n,).

        The memory blocks of the family and the bias and width coefficients, in
        one contraction over ``j``; factors at different memories are
        materialised (``O(n m K J D)``)."""
        lefts, rights, extra = [], [], 0.0
        if "memories" in self.names:
            if not left.memories.compatible(right.memories):
                return contract(self.materialise(left), self.materialise(right), mode)
            dm = left.memories.dm if left.memories.dm is not None else right.memories.dm
            lefts, rights, extra = self.family.memory_blocks(left, right, dm, mode)
        lefts = lefts + left.extra_coefficients
        rights = rights + right.extra_coefficients
        return extra + contract(torch.cat(lefts, 2), torch.cat(rights, 2), mode)

    def dense_inner(self, dense, factors, mode):
        """``contract(dense, materialise(factors), mode)``, without materialising the
        factors where the family can (``SquaredDistanceFamily.dense_inner``)."""
        if self.family.has_dense_form(factors, dense):
            return self.family.dense_inner(dense, factors, mode)
        return contract(dense, self.materialise(factors), mode)

    def metric_inner(self, left, right, scale, mode):
        """``<g(left row), scale * g(right row)>``, contracted per memory in TRACE mode
        where the family can (``SquaredDistanceFamily.metric_inner``); otherwise the
        protocol's default."""
        if (
            mode != OutputMode.TRACE
            or not self.family.has_metric_form(left, right)
            or not left.memories.compatible(right.memories)
        ):
            return super().metric_inner(left, right, scale, mode)
        return self.family.metric_inner(left, right, scale, mode)

    # -- directional derivatives ---------------------------------------------------------

    def directional(self, factors, direction):
        """``<g_k(x), direction>`` per row and output: (n, K)."""
        x = factors.x
        out = torch.zeros(x.shape[0], factors.memories.n_outputs, dtype=x.dtype, device=x.device)
        if "memories" in self.names:
            out = out + self.family.memory_directional(factors, direction[self.names["memories"]])
        for local, values in (("bias", factors.bias), ("log_gamma", factors.widths)):
            if values is not None:
                out = out + values @ direction[self.names[local]]
        return out

    # -- materialised gradients ------------------------------------------------------------

    def materialise(self, factors):
        """Per-example gradients (n, K, W) in the order memories, bias, log_gamma."""
        return self.family.materialise(factors)

    def materialise_sums(self, rows, weights, factors, n_rows):
        """Each row's weighted sum of its nodes' gradients (n_rows, K, W), from the
        factors where the family can (``SquaredDistanceFamily.materialise_sums``:
        no per-node gradient formed), else by materialising the nodes."""
        sums = self.family.materialise_sums(rows, weights, factors, n_rows)
        if sums is None:
            return super().materialise_sums(rows, weights, factors, n_rows)
        return sums
