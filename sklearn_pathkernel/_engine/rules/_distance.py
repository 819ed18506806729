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
and exact zeros (:func:`_sq_distances`). Measured against materialised
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
(:meth:`DistanceRule.integrate`): its inner product with another row's
gradient ``sigma'_j e'_j`` is ``S_j (x - m_j) . e'_j`` (the polarisation above,
a row at the step's start) minus ``T_j dm_j . e'_j``, once per row instead of
once per node.

Per-row ``t``: :meth:`DistanceRule.output_at` evaluates the layer with every row
at its own weights, so the probe evaluates a whole batch of quadrature nodes in
one pass (instead of one pass per distinct ``t``). The laplacian kernel keeps
``GenericRule``: its memory gradient ``sign(x - m)`` has no low-rank form (the
best contraction, per-memory sign Grams, costs ``O(n m J D)``, only K times less
than materialising), and networks with it keep one pass per distinct ``t``.
"""

import math

import torch

from ..._nn._distance import COSINE_EPS, DistanceLayer
from .._planning import rows_per_tile
from ._contract import contract as _contract
from ._protocol import LayerRule, RowEvaluation

# Kernels with a factored rule ("laplacian" keeps the generic torch.func rule:
# its memory gradient is a sign pattern per (example, memory), with no low-rank form).
FACTORED_KERNELS = ("sqeuclidean", "euclidean", "rbf", "cosine")
# Squared distances expanded about a centre c are recomputed from explicit
# differences where they are below this fraction of their rounding bound, e.g.
# (|x - c| + |m - c|)^2: elsewhere the expansion keeps a relative error ~1e-14.
NEAR_PAIRS = 1.0 / 16
_LOCAL_NAMES = ("memories", "bias", "log_gamma")


def make_distance_rule(module, names):
    """A :class:`DistanceRule` for ``module``, or None when it has no factored form.

    ``names`` maps the module's local parameter names that are part of the path
    to their names in the path.
    """
    if type(module) is not DistanceLayer or module.kernel not in FACTORED_KERNELS:
        return None
    local = {name for name, _ in module.named_parameters(recurse=False)}
    if not local <= set(_LOCAL_NAMES):
        return None
    return DistanceRule(module, names)


def _memories_at(m, dm, t):
    """Per-row memories ``m + t_i dm``, shape (rows, J, D) (like ``w + t dw`` flat)."""
    return m[None] + t[:, None, None] * dm[None]


def _squared_norm(e):
    return (e * e).sum(-1)


def _sq_distances(x, m, dm=None, t=None, centre=None):
    """``|x_i - mu_ij|^2`` with ``mu_ij = m_j + t_i dm_j``, and where it was summed exactly.

    Expanded about ``centre`` (default: the mean memory) by matrix products; the
    expansion's rounding error is a few ``eps (|x_i - c| + |m_j - c| + |t_i dm_j|)^2``,
    so the pairs below ``NEAR_PAIRS`` times that bound (``x`` near ``mu``) are summed
    from explicit differences instead: relative error ~1e-14 everywhere, and exact
    zeros. Differentiable (the explicit pairs too). Returns (n, J) values and the
    (n, J) boolean mask of the explicit pairs.
    """
    if centre is None:
        centre = m.detach().mean(0)
    xc, mc = x - centre, m - centre
    cross = xc @ mc.T
    memory_sq = _squared_norm(mc)[None]
    norm = torch.linalg.vector_norm
    bound = norm(xc.detach(), dim=1)[:, None] + norm(mc.detach(), dim=1)
    if dm is not None:
        t_col = t[:, None]
        cross = cross + t_col * (xc @ dm.T)
        memory_sq = (
            memory_sq + t_col * (2.0 * (mc * dm).sum(1)) + t_col.square() * _squared_norm(dm)
        )
        # |t| without abs(), which the kink recorder would take for a switch.
        bound = bound + t_col.detach().square().sqrt() * norm(dm, dim=1)
    squared = _squared_norm(xc)[:, None] + memory_sq - 2.0 * cross
    near = squared.detach() < NEAR_PAIRS * bound.square()
    rows, cols = torch.nonzero(near, as_tuple=True)
    if rows.numel():
        mu = m[cols] if dm is None else m[cols] + t[rows, None] * dm[cols]
        squared = squared.index_put((rows, cols), _squared_norm(x[rows] - mu))
    return squared, near


def _memory_dots(x, m, dm, t, vectors, near):
    """``e_ij . v_j`` with ``e_ij = x_i - mu_ij`` (n, J), explicit on the ``near`` pairs."""
    centre = m.mean(0)
    dots = (x - centre) @ vectors.T - ((m - centre) * vectors).sum(1)
    if t is None:
        dm = None
    if dm is not None:
        dots = dots - t[:, None] * (dm * vectors).sum(1)
    rows, cols = torch.nonzero(near, as_tuple=True)
    if rows.numel():
        mu = m[cols] if dm is None else m[cols] + t[rows, None] * dm[cols]
        dots[rows, cols] = ((x[rows] - mu) * vectors[cols]).sum(1)
    return dots


def _memory_norms(m, dm, t):
    """``|m_j + t_i dm_j|``, shape (n, J)."""
    origin = torch.zeros(t.shape[0], m.shape[1], dtype=m.dtype, device=m.device)
    return torch.sqrt(_sq_distances(origin, m, dm, t, centre=torch.zeros_like(m[0]))[0])


def _pair_sq_distances(x, y, centre):
    """``|x_i - y_l|^2`` (n, m): expanded about ``centre``, exact where that cancels."""
    xc, yc = x - centre, y - centre
    x2, y2 = _squared_norm(xc), _squared_norm(yc)
    scale = x2[:, None] + y2[None, :]
    d2 = scale - 2.0 * (xc @ yc.T)
    near = torch.nonzero(d2 < NEAR_PAIRS * scale, as_tuple=True)
    if near[0].numel():
        d2[near] = _squared_norm(x[near[0]] - y[near[1]])
    return d2


def _weighted(matrix, left, right, mode):
    """``matrix[i, l] * sum_j left[i, k, j] right[l, k', j]`` (``matrix`` (n,) for diag)."""
    inner = _contract(left, right, mode)
    return matrix[:, :, None, None] * inner if mode == "pairs" else matrix * inner


def _row_sums(rows, weights, values, n_rows):
    """``out[r] = sum of weights[e] * values[e] over the e with rows[e] == r``.

    ``weights`` (E,) or (P, E) for P weightings at once -> (n_rows, ...) or
    (P, n_rows, ...). Each row's entries are gathered into a zero-padded block
    and summed by one batched matrix product, ``O(E)`` work per value (on a CPU
    several times faster than scaling and scattering with ``index_add_``).
    """
    weights = weights if weights.ndim == 2 else weights[None]
    n_weightings, n_entries = weights.shape
    counts = torch.bincount(rows, minlength=n_rows)
    order = torch.argsort(rows, stable=True)
    sorted_rows = rows[order]
    offsets = torch.cumsum(counts, 0) - counts
    position = torch.arange(n_entries, device=rows.device) - offsets[sorted_rows]
    width = int(counts.max()) if n_entries else 0
    flat = values.reshape(n_entries, -1)
    padded = flat.new_zeros((n_rows, width, flat.shape[1]))
    padded[sorted_rows, position] = flat[order]
    padded_weights = weights.new_zeros((n_rows, n_weightings, width))
    padded_weights[sorted_rows, :, position] = weights[:, order].T
    sums = torch.bmm(padded_weights, padded).transpose(0, 1)  # (P, n_rows, F)
    sums = sums.reshape(n_weightings, n_rows, *values.shape[1:])
    return sums if n_weightings > 1 else sums[0]


def _first_of_rows(rows, n_rows):
    """Per row, the position of its first entry in ``rows`` (the last position for
    rows without entries, so that indexing stays valid)."""
    positions = torch.arange(rows.numel(), device=rows.device)
    first = torch.full((n_rows,), rows.numel() - 1, dtype=positions.dtype, device=rows.device)
    return first.scatter_reduce_(0, rows, positions, "amin")


class DistanceFactors:
    """Factors of a batch for :class:`DistanceRule`.

    ``rows`` holds per-row tensors (leading axis n): ``x``, coefficient tensors
    (n, K, J) and (n, J) matrices; ``shared`` the memories ``m`` and their step
    ``dm`` (None when they do not move or the rows sit at the step's start).
    Integrated factors (:meth:`DistanceRule.integrate`) hold a row's sums over
    its nodes: ``sigma`` is then ``S``, ``sigma_t`` is ``T``, and the rows sit at
    the step's start (no ``t``).
    """

    __slots__ = ("rows", "shared", "_cache")

    def __init__(self, rows, shared):
        self.rows, self.shared, self._cache = rows, shared, {}

    def take(self, index):
        return DistanceFactors({k: v[index] for k, v in self.rows.items()}, self.shared)

    @property
    def nbytes(self):
        """Memory held per row (the shared memories are not counted)."""
        return sum(v.nbytes for v in self.rows.values())

    @staticmethod
    def cat(parts):
        """Stack the rows of several factors of the same layer and step."""
        moving = [p for p in parts if "t" in p.rows]
        if moving and len(moving) < len(parts):  # rows at the step's start: t = 0
            parts = [p if "t" in p.rows else p._at_zero(moving[0].shared) for p in parts]
        shared = parts[0].shared
        keys = parts[0].rows.keys()
        return DistanceFactors({k: torch.cat([p.rows[k] for p in parts]) for k in keys}, shared)

    def _at_zero(self, shared):
        """These rows (at the step's start) as moving rows with ``t = 0``."""
        x = self.rows["x"]
        rows = dict(self.rows, t=torch.zeros(x.shape[0], dtype=x.dtype, device=x.device))
        moved = DistanceFactors(rows, shared)
        for key, dot in (("q", _centred_dot), ("Q", _plain_dot)):
            if key in shared["row_keys"]:
                rows[key] = dot(moved, shared["dm"])
        return moved


def _centred_dot(factors, dm):
    """``(x_i - c) . dm_j`` with ``c`` the mean memory, cached per ``dm``; (n, J)."""
    return _cached(factors, "q", dm, lambda: (factors.rows["x"] - factors.shared["c"]) @ dm.T)


def _plain_dot(factors, dm):
    """``x_i . dm_j``, cached per ``dm``; (n, J)."""
    return _cached(factors, "Q", dm, lambda: factors.rows["x"] @ dm.T)


def _step_dots(factors, dm):
    """``e_ij . dm_j`` with ``e_ij = x_i - mu_ij`` (explicit on the near pairs), cached
    per ``dm``; (n, J)."""
    rows, shared = factors.rows, factors.shared
    return _cached(
        factors,
        "e_dm",
        dm,
        lambda: _memory_dots(rows["x"], shared["m"], shared["dm"], rows.get("t"), dm, rows["near"]),
    )


def _cached(factors, key, dm, compute):
    if key in factors.rows:
        return factors.rows[key]
    hit = factors._cache.get(key)
    if hit is None or hit[0] is not dm:
        hit = (dm, compute())
        factors._cache[key] = hit
    return hit[1]


class DistanceRule(LayerRule):
    """Factored rule for :class:`DistanceLayer` ("sqeuclidean", "euclidean", "rbf", "cosine").

    Parameters
    ----------
    module : DistanceLayer
    names : dict
        The module's parameters that are in the path: local name -> path name.
        Parameters not in the path are constants (the module's own values).
    """

    # Not linear in its weights: output_at computes the layer at per-row weights.
    row_evaluation = RowEvaluation.OUTPUT_AT

    def __init__(self, module, names):
        self.module = module
        self.names = dict(names)
        self.path_names = [self.names[name] for name in _LOCAL_NAMES if name in self.names]

    # -- parameter values ---------------------------------------------------------

    def _param(self, local, params, steps):
        """(value at the step's start, its step or None); None value if the layer has none."""
        full = self.names.get(local)
        if full is None:
            value = getattr(self.module, local)
            return (None if value is None else value.detach()), None
        step = None if steps is None else steps[full]
        return params[full], step

    # -- per-row evaluation ---------------------------------------------------------

    def output_at(self, inputs, params, steps, t):
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
        m, dm = self._param("memories", params, steps)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in params.values())
        )
        t_col = t[:, None]
        if layer.kernel == "cosine":
            x_norm = torch.clamp(torch.linalg.vector_norm(x, dim=1, keepdim=True), min=COSINE_EPS)
            dot = x @ m.T
            if dm is None:  # per row, so that the kink recorder sees (n, J) values
                m_norm = torch.linalg.vector_norm(m.detach(), dim=1).expand(x.shape[0], -1)
            else:
                dot = dot + t_col * (x @ dm.T)
                with torch.no_grad():
                    m_norm = _memory_norms(m.detach(), dm, t)
            out = dot / (x_norm * torch.clamp(m_norm, min=COSINE_EPS))
        else:
            D = layer.in_features
            msd = _sq_distances(x, m, dm, t)[0] / D
            if layer.kernel == "euclidean":
                positive = msd > 0
                out = torch.where(positive, torch.sqrt(torch.where(positive, msd, 1.0)), 0.0)
            elif layer.kernel == "sqeuclidean":
                out = msd
            else:
                log_gamma, d_log_gamma = self._param("log_gamma", params, steps)
                if d_log_gamma is not None:
                    log_gamma = log_gamma + t_col * d_log_gamma
                out = torch.exp(-torch.exp(log_gamma.detach()) * msd)
        bias, d_bias = self._param("bias", params, steps)
        if bias is not None:
            out = out + (bias.detach() if d_bias is None else bias.detach() + t_col * d_bias)
        if needs_grad and not out.requires_grad:
            out = out.detach().requires_grad_(True)
        return out

    # -- factors --------------------------------------------------------------------

    def factors(self, inputs, delta, params, steps=None, t=None):
        """Factors of rows ``x`` with back-propagated ``delta`` (n, K, J).

        ``params`` are the weights at the step's start; with ``steps`` and ``t``
        (n,), row ``i`` is at ``params + t_i steps``.
        """
        with torch.no_grad():
            return self._factors(inputs[0].detach(), delta.detach(), params, steps, t)

    def _factors(self, x, delta, params, steps, t):
        layer = self.module
        if t is None:
            steps = None
        m, dm = self._param("memories", params, steps)
        m = m.detach()
        moving = dm is not None
        rows = {"x": x}
        shared = {"m": m, "dm": dm, "row_keys": (), "n_outputs": delta.shape[1]}
        if moving:
            rows["t"] = t
        t_col = None if t is None else t[:, None]
        mem_in_path = "memories" in self.names
        if layer.kernel == "cosine":
            x_norm = torch.clamp(torch.linalg.vector_norm(x, dim=1), min=COSINE_EPS)[:, None]
            dot = x @ m.T
            if moving:
                rows["Q"] = x @ dm.T
                shared["row_keys"] = ("Q",)
                dot = dot + t_col * rows["Q"]
                m_norm = _memory_norms(m, dm, t)
            else:
                m_norm = torch.linalg.vector_norm(m, dim=1).expand(x.shape[0], -1)
            m_norm_c = torch.clamp(m_norm, min=COSINE_EPS)
            kernel = dot / (x_norm * m_norm_c)
            if mem_in_path:
                rows["alpha"] = delta / (x_norm * m_norm_c)[:, None]
                rows["beta"] = (
                    delta * (-(kernel / m_norm_c.square()) * (m_norm >= COSINE_EPS))[:, None]
                )
                rows["P"] = x @ m.T if moving else dot
        else:
            D = layer.in_features
            squared, rows["near"] = _sq_distances(x, m, dm, t)
            distance = torch.sqrt(squared)
            msd = squared / D
            if layer.kernel == "sqeuclidean":
                coefficient = torch.full_like(msd, -2.0 / D)
            elif layer.kernel == "euclidean":
                positive = distance > 0
                coefficient = torch.where(
                    positive, -1.0 / (math.sqrt(D) * torch.where(positive, distance, 1.0)), 0.0
                )
            else:
                log_gamma, d_log_gamma = self._param("log_gamma", params, steps)
                log_gamma = log_gamma.detach()
                if d_log_gamma is not None:
                    log_gamma = log_gamma + t_col * d_log_gamma
                gamma = torch.exp(log_gamma).expand_as(msd)
                kernel = torch.exp(-gamma * msd)
                coefficient = 2.0 * gamma * kernel / D
                if "log_gamma" in self.names:
                    rows["c_lg"] = delta * (-gamma * msd * kernel)[:, None]
            if mem_in_path:
                shared["c"] = m.mean(0)
                rows["sigma"] = delta * coefficient[:, None]
                half = 0.5 * squared
                if moving:
                    factors = DistanceFactors(rows, shared)
                    rows["q"] = _centred_dot(factors, dm)
                    shared["row_keys"] = ("q",)
                    half = half + t_col * rows["q"] - 0.5 * t_col.square() * _squared_norm(dm)
                rows["h"] = half
        if "bias" in self.names:
            rows["c_b"] = delta
        return DistanceFactors(rows, shared)

    # -- integration over quadrature nodes ------------------------------------------

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Factors of each row's weighted sum of gradients over its nodes, or None.

        Node ``e`` belongs to row ``rows[e]`` with weight ``weights[e]``. Where the
        layer's input is the same at all of a row's nodes (a first layer), the sum
        keeps the factored form: with ``S = sum_e w_e sigma_e`` and
        ``T = sum_e w_e t_e sigma_e``, the memory gradient's sum is
        ``S_kj (x - m_j) - T_kj dm_j``; the bias and width coefficients are
        summed as they are. None (keep the nodes) for a deeper layer and for
        ``"cosine"``.
        """
        x = factors.rows["x"]
        if self.module.kernel == "cosine":
            return None
        first = _first_of_rows(rows, n_rows)
        if not torch.equal(x[first[rows]], x):
            return None
        node_rows, shared = factors.rows, factors.shared
        integrated = {"x": x[first]}
        keys = [key for key in ("sigma", "c_b", "c_lg") if key in node_rows]
        moving = "sigma" in node_rows and "t" in node_rows
        if moving:  # both weightings in one product: S (and the rest), T
            weights = torch.stack([weights, weights * node_rows["t"]])
        sums = _row_sums(rows, weights, torch.stack([node_rows[key] for key in keys], 1), n_rows)
        if moving:
            integrated["sigma_t"] = sums[1][:, keys.index("sigma")]
            sums = sums[0]
        integrated.update((key, sums[:, index]) for index, key in enumerate(keys))
        if "sigma" in node_rows:
            squared, integrated["near"] = _sq_distances(integrated["x"], shared["m"])
            integrated["h"] = 0.5 * squared
        return DistanceFactors(integrated, dict(shared, row_keys=()))

    # -- inner products -----------------------------------------------------------------

    def inner(self, left, right, mode):
        """Inner products of per-example gradients: (n, m), (n, m, K, K') or (n,)."""
        blocks_left, blocks_right, extra = [], [], 0.0
        if "memories" in self.names:
            if not self._compatible(left, right):
                grads = self._materialise(left), self._materialise(right)
                return _contract(*grads, mode)
            dm = left.shared["dm"] if left.shared["dm"] is not None else right.shared["dm"]
            kernel_blocks = self._cosine if self.module.kernel == "cosine" else self._msd
            extra = kernel_blocks(left, right, dm, mode, blocks_left, blocks_right)
        for key in ("c_b", "c_lg"):
            if key in left.rows:
                blocks_left.append(left.rows[key])
                blocks_right.append(right.rows[key])
        return extra + _contract(torch.cat(blocks_left, 2), torch.cat(blocks_right, 2), mode)

    @staticmethod
    def _compatible(left, right):
        a, b = left.shared, right.shared
        if not (a["m"] is b["m"] or torch.equal(a["m"], b["m"])):
            return False
        if a["dm"] is None or b["dm"] is None:
            return True
        return a["dm"] is b["dm"] or torch.equal(a["dm"], b["dm"])

    @staticmethod
    def _msd(left, right, dm, mode, blocks_left, blocks_right):
        """Blocks of ``sum_j sigma sigma' e_ij . e_i'j`` by polarisation; returns the
        ``-|x_i - x_i'|^2 / 2`` term."""
        L, R = left.rows, right.rows
        sigma, sigma_r = L["sigma"], R["sigma"]
        blocks_left += [sigma * L["h"][:, None], sigma]
        blocks_right += [sigma_r, sigma_r * R["h"][:, None]]
        # Integrated rows (S e - T dm): the T terms, - T_j dm_j . e'_j and back.
        T, T_r = L.get("sigma_t"), R.get("sigma_t")
        if T is not None:
            blocks_left.append(-T)
            blocks_right.append(sigma_r * _step_dots(right, dm)[:, None])
        if T_r is not None:
            blocks_left.append(sigma * _step_dots(left, dm)[:, None])
            blocks_right.append(-T_r)
        if T is not None and T_r is not None:
            blocks_left.append(T * _squared_norm(dm))
            blocks_right.append(T_r)
        t_left, t_right = L.get("t"), R.get("t")
        if t_left is not None:  # - t_i q_i'j
            blocks_left.append(-t_left[:, None, None] * sigma)
            blocks_right.append(sigma_r * _centred_dot(right, dm)[:, None])
        if t_right is not None:  # - t_i' q_ij + t_i t_i' |dm_j|^2
            coefficient = -_centred_dot(left, dm)
            if t_left is not None:
                coefficient = coefficient + t_left[:, None] * _squared_norm(dm)
            blocks_left.append(sigma * coefficient[:, None])
            blocks_right.append(t_right[:, None, None] * sigma_r)
        centre = left.shared["c"]
        if mode == "diag":
            pairs = _squared_norm(L["x"] - R["x"])
        else:
            pairs = _pair_sq_distances(L["x"], R["x"], centre)
        return _weighted(-0.5 * pairs, sigma, sigma_r, mode)

    @staticmethod
    def _cosine(left, right, dm, mode, blocks_left, blocks_right):
        """Blocks of ``sum_j (alpha x + beta mu) . (alpha' x' + beta' mu')``; returns the
        ``x . x'`` term."""
        L, R = left.rows, right.rows
        alpha, beta, alpha_r, beta_r = L["alpha"], L["beta"], R["alpha"], R["beta"]
        m = left.shared["m"]
        t_left, t_right = L.get("t"), R.get("t")
        first = alpha * L["P"][:, None] + beta * _squared_norm(m)
        third = alpha_r * R["P"][:, None]
        if dm is not None:
            m_dm = (m * dm).sum(1)
        if t_left is not None:
            first = first + t_left[:, None, None] * beta * m_dm
        if t_right is not None:
            third = third + t_right[:, None, None] * beta_r * m_dm
        blocks_left += [first, beta]
        blocks_right += [beta_r, third]
        if t_right is not None:
            second = alpha * _plain_dot(left, dm)[:, None]
            if t_left is not None:
                second = second + t_left[:, None, None] * beta * _squared_norm(dm)
            blocks_left.append(second)
            blocks_right.append(t_right[:, None, None] * beta_r)
        if t_left is not None:
            blocks_left.append(t_left[:, None, None] * beta)
            blocks_right.append(alpha_r * _plain_dot(right, dm)[:, None])
        x, x_r = L["x"], R["x"]
        dots = (x * x_r).sum(1) if mode == "diag" else x @ x_r.T
        return _weighted(dots, alpha, alpha_r, mode)

    def dense_inner(self, dense, factors, mode):
        """``contract(dense, materialise(factors), mode)`` without materialising the factors.

        ``dense`` (n, K, W_layer) is a weight-space vector per row and output in
        this rule's layout (e.g. Adam's ``psi_s``, or ``P_s phi_s``); ``factors``
        those of m rows; ``mode`` "trace" or "pairs". For the squared-distance
        kernels the memory block is, with ``a_ikj`` the dense block of memory
        ``j`` and ``e_lj = x_l - mu_lj``,

            sum_j sigma_lk'j (a_ikj . e_lj),
            a_ikj . e_lj = a_ikj . (x_l - c) - a_ikj . (m_j - c) - t_l a_ikj . dm_j,

        one (n K J, D) x (D, m) matrix product (``c`` the mean memory) and a
        contraction over ``j``: ``O(n K J m (D + K'))`` instead of forming
        ``m K' J D`` gradients and an ``O(n K m K' J D)`` product. Pairs where
        the expansion cancels (``x_l`` near ``mu_lj``, the factors' ``near``
        mask) are summed from explicit differences. With one output per row
        (``K' = 1``) both forms take about the same products, and the
        materialised one fewer passes over memory: it is used then, and for
        cosine and integrated factors.
        """
        rows, shared = factors.rows, factors.shared
        if (
            self.module.kernel == "cosine"
            or "sigma_t" in rows
            or "sigma" not in rows
            or rows["sigma"].shape[1] == 1
        ):
            return _contract(dense, self._materialise(factors), mode)
        x, m, dm, t = rows["x"], shared["m"], shared["dm"], rows.get("t")
        (n_memories, width), n, n_outputs = m.shape, dense.shape[0], dense.shape[1]
        a = dense[..., : n_memories * width].reshape(n, n_outputs, n_memories, width)
        centre = m.mean(0)
        # (n, K, J, m): a_ikj . e_lj
        dots = (a.reshape(-1, width) @ (x - centre).T).view(n, n_outputs, n_memories, -1)
        dots -= (a * (m - centre)).sum(-1)[..., None]
        if t is not None:
            dots -= (a * dm).sum(-1)[..., None] * t
        near_rows, near_memories = torch.nonzero(rows["near"], as_tuple=True)
        if near_rows.numel():
            mu = m[near_memories]
            if t is not None:
                mu = mu + t[near_rows, None] * dm[near_memories]
            exact = (a[:, :, near_memories] * (x[near_rows] - mu)).sum(-1)
            dots[:, :, near_memories, near_rows] = exact
        sigma = rows["sigma"]  # (m, K', J)
        if mode == "trace":
            out = torch.einsum("ikjl,lkj->il", dots, sigma)
        else:  # per training row l: (n K, J) x (J, K')
            out = torch.bmm(
                dots.permute(3, 0, 1, 2).reshape(-1, n * n_outputs, n_memories),
                sigma.transpose(1, 2),
            )
            out = out.view(-1, n, n_outputs, sigma.shape[1]).permute(1, 0, 2, 3)
        rest = [rows[key] for key in ("c_b", "c_lg") if key in rows]
        if rest:
            out = out + _contract(dense[..., n_memories * width :], torch.cat(rest, 2), mode)
        return out

    def metric_inner(self, left, right, scale, mode):
        """``<g(left row), scale * g(right row)>``, contracted per memory.

        With ``P_j`` memory ``j``'s block of ``scale`` (Adam's preconditioner),
        the squared-distance kernels' memory gradients ``sigma_ikj e_ij`` (minus
        ``T_ikj dm_j`` for integrated factors, see :meth:`integrate`) give, in
        "trace" mode,

            sum_j (sum_k sigma_ikj sigma'_lkj) (e_ij . P_j e'_lj)
              - sum_kj T_ikj sigma'_lkj (dm_j . P_j e'_lj):

        per block of memories, one (J n, D) x (D, m) product for the weighted
        distances and a batched (n, K) x (K, m) product per memory, then one
        pass over (J, n, m): ``O(n m J (D + K))`` instead of the materialised
        ``O(n m K J D)``. ``e'_lj`` is expanded about the mean memory and summed
        from explicit differences where that cancels (the right factors'
        ``near`` pairs), as in :meth:`dense_inner`. Other modes, cosine, and
        one or two outputs (where materialising costs no more) take the default.
        """
        L, R = left.rows, right.rows
        if (
            mode != "trace"
            or self.module.kernel == "cosine"
            or "sigma" not in L
            or "sigma_t" in R
            or not self._compatible(left, right)
        ):
            return super().metric_inner(left, right, scale, mode)
        m = left.shared["m"]
        dm = left.shared["dm"] if left.shared["dm"] is not None else right.shared["dm"]
        (n_memories, width), (n, n_outputs) = m.shape, L["sigma"].shape[:2]
        if n_outputs * width <= width + 2 * n_outputs:
            return super().metric_inner(left, right, scale, mode)
        x, t, x_r, t_r = L["x"], L.get("t"), R["x"], R.get("t")
        sigma, sigma_r = L["sigma"], R["sigma"]
        memory_width = n_memories * width
        p = scale[:memory_width].view(n_memories, width)
        centre = m.mean(0)
        x_rc = x_r - centre
        # memory-major and contiguous, for the batched products (several times
        # faster than on the strided views)
        by_memory = sigma.permute(2, 0, 1).contiguous()  # (J, n, K)
        by_memory_r = sigma_r.permute(2, 1, 0).contiguous()  # (J, K, m)
        out = x.new_zeros(n, x_r.shape[0])
        step = rows_per_tile(n_memories, 2 * x.element_size() * n * x_r.shape[0])
        for begin in range(0, n_memories, step):
            chunk = slice(begin, begin + step)
            mu, weight = m[chunk], p[chunk][:, None]
            u = x[None] - mu[:, None]  # (c, n, D): P_j e_ij
            if t is not None:
                u -= t[None, :, None] * dm[chunk][:, None]
            u *= weight
            # (c, n, m): P_j e_ij . e'_lj with e'_lj = (x'_l - c) - (m_j - c) - t'_l dm_j
            dots = (u.reshape(-1, width) @ x_rc.T).view(u.shape[0], n, -1)
            dots -= (u * (mu - centre)[:, None]).sum(-1)[..., None]
            if t_r is not None:
                dots -= (u * dm[chunk][:, None]).sum(-1)[..., None] * t_r
            near_rows, near_memories = torch.nonzero(R["near"][:, chunk], as_tuple=True)
            if near_rows.numel():
                mu_near = mu[near_memories]
                if t_r is not None:
                    mu_near = mu_near + t_r[near_rows, None] * dm[chunk][near_memories]
                exact = (u[near_memories] * (x_r[near_rows] - mu_near)[:, None]).sum(-1)
                dots[near_memories, :, near_rows] = exact
            out += torch.bmm(by_memory[chunk], by_memory_r[chunk]).mul_(dots).sum(0)
        if "sigma_t" in L:  # - T_ikj sigma'_lkj (e'_lj . P_j dm_j)
            steps = _memory_dots(x_r, m, dm, t_r, p * dm, R["near"])
            moved = (sigma_r * steps[:, None]).reshape(x_r.shape[0], -1)
            out -= L["sigma_t"].reshape(n, -1) @ moved.T
        rest = [key for key in ("c_b", "c_lg") if key in L]
        if rest:
            scaled = torch.cat([L[key] for key in rest], 2) * scale[memory_width:]
            out += _contract(scaled, torch.cat([R[key] for key in rest], 2), mode)
        return out

    # -- directional derivatives ---------------------------------------------------------

    def directional(self, factors, direction):
        """``<g_k(x), direction>`` per row and output: (n, K)."""
        rows, shared = factors.rows, factors.shared
        x = rows["x"]
        out = torch.zeros(x.shape[0], shared["n_outputs"], dtype=x.dtype, device=x.device)
        if "memories" in self.names:
            step = direction[self.names["memories"]]
            m, dm, t = shared["m"], shared["dm"], rows.get("t")
            if self.module.kernel == "cosine":
                mu_dot = (m * step).sum(1)
                if t is not None:
                    mu_dot = mu_dot + t[:, None] * (dm * step).sum(1)
                out = out + torch.einsum("nkj,nj->nk", rows["alpha"], x @ step.T)
                out = out + torch.einsum("nkj,nj->nk", rows["beta"], mu_dot.expand(x.shape[0], -1))
            else:
                dots = _memory_dots(x, m, dm, t, step, rows["near"])
                out = out + torch.einsum("nkj,nj->nk", rows["sigma"], dots)
                if "sigma_t" in rows:  # integrated: - T_kj dm_j . step_j
                    out = out - rows["sigma_t"] @ (dm * step).sum(1)
        for local, key in (("bias", "c_b"), ("log_gamma", "c_lg")):
            if key in rows:
                out = out + rows[key] @ direction[self.names[local]]
        return out

    # -- materialised gradients (factors at different memories) -----------------------------

    def flatten(self, weights):
        return torch.cat([weights[name].reshape(-1) for name in self.path_names])

    def materialise(self, factors):
        return self._materialise(factors)

    def _materialise(self, factors):
        """Per-example gradients (n, K, W) in the order memories, bias, log_gamma."""
        rows, shared = factors.rows, factors.shared
        x, m, dm, t = rows["x"], shared["m"], shared["dm"], rows.get("t")
        n, D = x.shape
        extra = [rows[key] for key in ("c_b", "c_lg") if key in rows]
        n_outputs, n_memories = extra[0].shape[1:] if extra else rows["sigma"].shape[1:]
        memory_width = n_memories * D if "memories" in self.names else 0
        # Written in place into one buffer (no concatenation pass over it).
        out = x.new_empty((n, n_outputs, memory_width + n_memories * len(extra)))
        if memory_width:
            grads = out[..., :memory_width].view(n, n_outputs, n_memories, D)
            mu = m[None] if t is None else _memories_at(m, dm, t)
            if self.module.kernel == "cosine":
                torch.mul(rows["alpha"][..., None], x[:, None, None, :], out=grads)
                grads.addcmul_(rows["beta"][..., None], mu[:, None])
            else:
                torch.mul(rows["sigma"][..., None], (x[:, None, :] - mu)[:, None], out=grads)
                if "sigma_t" in rows:  # integrated: S (x - m) - T dm
                    grads.sub_(rows["sigma_t"][..., None] * dm)
        for index, values in enumerate(extra):
            begin = memory_width + index * n_memories
            out[..., begin : begin + n_memories] = values
        return out
