"""Factored per-example gradients of a :class:`DistanceLayer` (kernels other than laplacian).

Notation: layer input ``x_i`` (n, D), memories ``m_j`` (J, D), layer output
``z_ij = k(x_i, m_j) + b_j`` and ``delta_ikj = d f_k / d z_ij`` for K outputs.
A row may sit at its own point of a step, weights ``w + t_i dw``: its memories
are then ``mu_ij = m_j + t_i dm_j`` (and its bias and widths move likewise).

Per-example gradients, with ``e_ij = x_i - mu_ij``:

- ``"sqeuclidean"``, ``"euclidean"``, ``"rbf"`` (functions of ``msd = |e|^2 / D``):
  ``d f_k / d m_j = sigma_ikj e_ij`` with ``sigma = -2 delta / D``,
  ``-delta / (sqrt(D) |e|)`` (0 at ``e = 0``, the layer's convention) and
  ``2 delta gamma k / D``; rbf's ``d f_k / d log_gamma_j = -delta gamma msd k``.
- ``"cosine"``: ``d f_k / d m_j = alpha_ikj x_i + beta_ikj mu_ij`` with
  ``alpha = delta / (|x| |mu|)``, ``beta = -delta k / |mu|^2`` (norms clamped
  at ``COSINE_EPS`` like the layer; no ``beta`` where the memory's norm is clamped).
- bias: ``d f_k / d b_j = delta_ikj``.

Inner products of two batches are then contractions over ``j`` of (n, K, J)
coefficient tensors with a few (n, J) and (n, m) matrices: cost
``O(n m (D + K J))`` instead of ``O(n m K J D)`` for materialised gradients.

Accuracy. The memory term of the squared-distance kernels needs
``e_ij . e_i'j``; expanding it as ``x.x' - x.m - m.x' + |m|^2`` loses every digit
when ``x`` is near ``m`` (the gradient of ``"euclidean"`` is then a unit vector
scaled by ``1 / |e|``). The rule uses the polarisation identity instead,

    e_ij . e_i'j = (|e_ij|^2 + |e_i'j|^2 - |e_ij - e_i'j|^2) / 2,

with ``e_ij - e_i'j = (x_i - x_i') - (t_i - t_i') dm_j``: it is translation
invariant and its error is about ``eps max(|e|^2, |e'|^2, |x_i - x_i'|^2)`` times
``|sigma sigma'|``, not ``eps |x|^2``. Squared distances (``|e_ij|^2``,
``|x_i - x_i'|^2``) and directional products ``e_ij . v_j`` are expanded about a
centre by matrix products and recomputed from explicit differences for the
(few) pairs where the expansion cancels, so they keep ~1e-14 relative accuracy
and exact zeros (:func:`._geometry.sq_distances`). Measured against materialised
gradients: ~1e-15 relative in general; for ``"euclidean"`` with a memory at
distance ``r`` from a point, about ``1e-16 R / r`` with ``R`` the other
distances (5e-14 at ``r / R = 1e-4``), because its gradient ``e / |e|`` is
a direction. Cosine's gradient is expanded: its terms are bounded by
``|delta| / |mu|`` and cancel only to the size of the terms themselves.

Integrated features. When the layer's input does not move along the step (a
first layer: its input is ``x``), the test copy's memory gradient integrates in
closed form over a row's quadrature nodes ``(t_q, w_q)``,

    sum_q w_q sigma_qkj (x - m_j - t_q dm_j) = S_kj (x - m_j) - T_kj dm_j,

with ``S = sum_q w_q sigma_q`` and ``T = sum_q w_q t_q sigma_q`` (n, K, J)
(``SquaredDistanceFamily.integrate``): its inner product with another row's
gradient ``sigma'_j e'_j`` is ``S_j (x - m_j) . e'_j`` (the polarisation above,
a row at the step's start) minus ``T_j dm_j . e'_j``, once per row instead of
once per node.

Per-row ``t``: :meth:`DistanceRule.output_at` evaluates the layer with every row
at its own weights, so the probe evaluates a whole batch of quadrature nodes in
one pass (instead of one pass per distinct ``t``). The laplacian kernel keeps
``GenericRule``: its memory gradient ``sign(x - m)`` has no low-rank form (the
best contraction, per-memory sign Grams, costs ``O(n m J D)``, only K times less
than materialising), and networks with it keep one pass per distinct ``t``.

Modules: ``_geometry`` (distances accurate where the expansion cancels),
``_factors`` (typed factors per kernel family), ``_family`` (what a family
implements), ``_squared`` and ``_cosine`` (the families), ``_rule`` (the rule),
``_backward`` (the layer at its own weights with a closed-form backward pass to its
input, which the probe uses for every output at once); ``_conv``, the rule of the
convolutional layer ``DistanceConv2d``.
"""

from ._conv import DistanceConv2dRule
from ._factors import CosineFactors, DistanceFactors, Memories, SquaredDistanceFactors
from ._rule import FACTORED_KERNELS, DistanceRule

__all__ = [
    "FACTORED_KERNELS",
    "CosineFactors",
    "DistanceConv2dRule",
    "DistanceFactors",
    "DistanceRule",
    "Memories",
    "SquaredDistanceFactors",
]
