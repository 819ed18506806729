"""The squared-distance family: kernels of ``msd = |e|^2 / D``, ``e_ij = x_i - mu_ij``.

``"sqeuclidean"`` (``msd``), ``"euclidean"`` (``sqrt(msd)``) and ``"rbf"``
(``exp(-gamma msd)``) have memory gradients ``d f_k / d m_j = sigma_kj e_j``
with ``sigma = -2 delta / D``, ``-delta / (sqrt(D) |e|)`` (0 at ``e = 0``) and
``2 delta gamma k / D``; rbf's ``d f_k / d log_gamma_j = -delta gamma msd k``.

Inner products use the polarisation identity
``e_ij . e_i'j = (|e_ij|^2 + |e_i'j|^2 - |e_ij - e_i'j|^2) / 2`` with
``e_ij - e_i'j = (x_i - x_i') - (t_i - t_i') dm_j``: contractions over ``j`` of
(n, K, J) blocks and one (n, m) matrix of input distances, ``O(n m (D + K J))``.
"""

import math
from abc import ABC, abstractmethod

import torch

from ..._modes import OutputMode
from ..._planning import dots_chunk_bytes, rows_per_tile
from .._contract import contract, weighted
from .._rows import first_of_rows, padded_row_sums, row_outer_sums, row_sums
from ._backward import moving_input_vjp
from ._factors import SquaredDistanceFactors
from ._family import KernelFamily
from ._geometry import memory_dots, pair_sq_distances, sq_distances, squared_norm


class _Profile(ABC):
    """The kernel as a function of the mean squared distance."""

    uses_width = False

    @abstractmethod
    def value(self, msd, gamma):
        """``k(msd)``, (n, J)."""

    @abstractmethod
    def slope(self, squared, msd, gamma, width):
        """``sigma / delta``: the memory gradient's coefficient per unit cotangent."""


class _SqEuclidean(_Profile):
    def value(self, msd, gamma):
        return msd

    def slope(self, squared, msd, gamma, width):
        return torch.full_like(msd, -2.0 / width)


class _Euclidean(_Profile):
    def value(self, msd, gamma):
        positive = msd > 0
        return torch.where(positive, torch.sqrt(torch.where(positive, msd, 1.0)), 0.0)

    def slope(self, squared, msd, gamma, width):
        distance = torch.sqrt(squared)
        positive = distance > 0
        return torch.where(
            positive, -1.0 / (math.sqrt(width) * torch.where(positive, distance, 1.0)), 0.0
        )


class _Rbf(_Profile):
    uses_width = True

    def value(self, msd, gamma):
        return torch.exp(-gamma * msd)

    def slope(self, squared, msd, gamma, width):
        return 2.0 * gamma * torch.exp(-gamma * msd) / width


class SquaredDistanceFamily(KernelFamily):
    """The memory part of the rule for "sqeuclidean", "euclidean" and "rbf"."""

    PROFILES = {"sqeuclidean": _SqEuclidean, "euclidean": _Euclidean, "rbf": _Rbf}

    def __init__(self, rule):
        super().__init__(rule)
        self.profile = self.PROFILES[rule.module.kernel]()

    def _gamma(self, weights, t_col):
        """rbf's widths ``exp(log_gamma + t_i d log_gamma)``, (J,) or (n, J)."""
        log_gamma, d_log_gamma = self.rule.param("log_gamma", weights)
        log_gamma = log_gamma.detach()
        if d_log_gamma is not None:
            log_gamma = log_gamma + t_col * d_log_gamma
        return torch.exp(log_gamma)

    def output(self, x, weights):
        m, dm = self.rule.param("memories", weights)
        msd = sq_distances(x, m, dm, weights.t)[0] / self.rule.module.in_features
        gamma = self._gamma(weights, weights.t[:, None]) if self.profile.uses_width else None
        return self.profile.value(msd, gamma)

    def input_vjp(self, x, weights):
        """The input's cotangents at per-row memories ``mu_ij = m_j + t_i dm_j``:
        ``d k(x_i, mu_ij) / d x_i = s_ij (x_i - mu_ij)`` with ``s`` minus the memory
        gradient's slope (``k`` depends on ``x - mu``), pulled back in two or three
        matrix products whatever the number of cotangents
        (:func:`._backward.moving_input_vjp`)."""
        with torch.no_grad():
            x = x.detach()
            m, dm = self.rule.param("memories", weights)
            m = m.detach()
            width = self.rule.module.in_features
            squared = sq_distances(x, m, dm, weights.t)[0]
            gamma = self._gamma(weights, weights.t[:, None]) if self.profile.uses_width else None
            slope = -self.profile.slope(squared, squared / width, gamma, width)
        return moving_input_vjp(x, m, dm, weights.t, slope)

    def factors(self, x, delta, weights, common):
        """``sigma``, ``h = |e|^2 / 2`` (about the step's start for moving rows:
        ``|x - m|^2 / 2 + t q - t^2 |dm|^2 / 2`` with ``q = (x - c) . dm``), the
        near pairs and rbf's width coefficients: ``O(n J (D + K))``."""
        memories, t = common["memories"], common["t"]
        m, dm = memories.m, memories.dm
        t_col = None if weights.t is None else weights.t[:, None]
        width = self.rule.module.in_features
        squared, near = sq_distances(x, m, dm, t)
        msd = squared / width
        fields = {"near": near}
        gamma = None
        if self.profile.uses_width:
            gamma = self._gamma(weights, t_col).expand_as(msd)
            if "log_gamma" in self.rule.names:
                kernel = torch.exp(-gamma * msd)
                fields["log_gamma"] = delta * (-gamma * msd * kernel)[:, None]
        if "memories" in self.rule.names:
            slope = self.profile.slope(squared, msd, gamma, width)
            fields["sigma"] = delta * slope[:, None]
            half = 0.5 * squared
            if dm is not None:
                fields["q"] = (x - memories.centre) @ dm.T
                t_col = t[:, None]
                half = half + t_col * fields["q"] - 0.5 * t_col.square() * squared_norm(dm)
            fields["h"] = half
        return SquaredDistanceFactors(**common, **fields)

    def integrate(self, rows, weights, factors, n_rows):
        """Where the layer's input is the same at all of a row's nodes (a first
        layer), ``S = sum_e w_e sigma_e`` and ``T = sum_e w_e t_e sigma_e`` (the
        memory gradient's sum is ``S_kj (x - m_j) - T_kj dm_j``), the bias and
        width coefficients summed as they are; None for a deeper layer."""
        x = factors.x
        first = first_of_rows(rows, n_rows)
        if not torch.equal(x[first[rows]], x):
            return None
        named = {"sigma": factors.sigma, "bias": factors.bias, "log_gamma": factors.log_gamma}
        keys = [key for key, value in named.items() if value is not None]
        moving = factors.sigma is not None and factors.t is not None
        if moving:  # both weightings in one product: S (and the rest), T
            weights = torch.stack([weights, weights * factors.t])
        sums = padded_row_sums(rows, weights, torch.stack([named[k] for k in keys], 1), n_rows)
        fields = {"x": x[first]}
        if moving:
            fields["sigma_t"] = sums[1][:, keys.index("sigma")]
            sums = sums[0]
        fields.update((key, sums[:, index]) for index, key in enumerate(keys))
        if factors.sigma is not None:
            squared, fields["near"] = sq_distances(fields["x"], factors.memories.m)
            fields["h"] = 0.5 * squared
        return SquaredDistanceFactors(memories=factors.memories, **fields)

    def memory_blocks(self, left, right, dm, mode):
        """Blocks of ``sum_j sigma sigma' e_ij . e_i'j`` by polarisation; the extra
        term is ``-|x_i - x_i'|^2 / 2`` times ``sigma . sigma'``."""
        sigma, sigma_r = left.sigma, right.sigma
        lefts = [sigma * left.h[:, None], sigma]
        rights = [sigma_r, sigma_r * right.h[:, None]]
        # Integrated rows (S e - T dm): the T terms, - T_j dm_j . e'_j and back.
        T, T_r = left.sigma_t, right.sigma_t
        if T is not None:
            lefts.append(-T)
            rights.append(sigma_r * right.step_dots(dm)[:, None])
        if T_r is not None:
            lefts.append(sigma * left.step_dots(dm)[:, None])
            rights.append(-T_r)
        if T is not None and T_r is not None:
            lefts.append(T * squared_norm(dm))
            rights.append(T_r)
        t_left, t_right = left.t, right.t
        if t_left is not None:  # - t_i q_i'j
            lefts.append(-t_left[:, None, None] * sigma)
            rights.append(sigma_r * right.centred_dot(dm)[:, None])
        if t_right is not None:  # - t_i' q_ij + t_i t_i' |dm_j|^2
            coefficient = -left.centred_dot(dm)
            if t_left is not None:
                coefficient = coefficient + t_left[:, None] * squared_norm(dm)
            lefts.append(sigma * coefficient[:, None])
            rights.append(t_right[:, None, None] * sigma_r)
        if mode == OutputMode.DIAG:
            pairs = squared_norm(left.x - right.x)
        else:
            pairs = pair_sq_distances(left.x, right.x, left.memories.centre)
        return lefts, rights, weighted(-0.5 * pairs, sigma, sigma_r, mode)

    def memory_directional(self, factors, step):
        """``sum_j sigma_kj e_j . step_j`` (minus ``T_kj dm_j . step_j`` when integrated)."""
        memories = factors.memories
        dots = memory_dots(factors.x, memories.m, memories.dm, factors.t, step, factors.near)
        out = torch.einsum("nkj,nj->nk", factors.sigma, dots)
        if factors.sigma_t is not None:
            out = out - factors.sigma_t @ (memories.dm * step).sum(1)
        return out

    def memory_coefficient(self, factors):
        return factors.sigma

    def _memory_gradients(self, factors, mu, grads):
        x = factors.x
        torch.mul(factors.sigma[..., None], (x[:, None, :] - mu)[:, None], out=grads)
        if factors.sigma_t is not None:  # integrated: S (x - m) - T dm
            grads.sub_(factors.sigma_t[..., None] * factors.memories.dm)

    def materialise_sums(self, rows, weights, factors, n_rows):
        """Each row's weighted sum of its nodes' gradients, node ``e`` (row
        ``rows[e]``, weight ``w_e``) at its own memories ``mu_ej = m_j + t_e dm_j``:

            sum_e w_e sigma_ekj (x_e - mu_ej)
              = sum_e (w_e sigma_ekj) (x_e - c) - S_kj (m_j - c) - T_kj dm_j,

        with ``S = sum_e w_e sigma_e``, ``T = sum_e w_e t_e sigma_e`` and ``c`` the
        mean memory: one zero-padded (J K, nodes) x (nodes, D) product per row
        (``row_outer_sums``) instead of (E, K, J, D) node gradients scaled and
        scattered. The node pairs where the expansion cancels (the factors'
        ``near`` mask) are left out of it and summed from explicit differences.
        None for integrated factors or without the memories in the path.
        """
        sigma = factors.sigma
        if sigma is None or factors.sigma_t is not None:
            return None
        memories = factors.memories
        x, t, near = factors.x, factors.t, factors.near
        m, dm, centre = memories.m, memories.dm, memories.centre
        (n_nodes, n_outputs, n_memories), width = sigma.shape, x.shape[1]
        weighted_sigma = weights[:, None, None] * sigma  # (E, K, J)
        far = weighted_sigma.masked_fill(near[:, None, :], 0.0)
        by_memory = far.transpose(1, 2).reshape(n_nodes, -1)  # (E, J K)
        sums = row_outer_sums(rows, by_memory, x - centre, n_rows)
        sums = sums.view(n_rows, n_memories, n_outputs, width)
        scalars = [far] if t is None else [far, far * t[:, None, None]]
        totals = padded_row_sums(rows, weights.new_ones(n_nodes), torch.stack(scalars, 1), n_rows)
        sums -= totals[:, 0].transpose(1, 2)[..., None] * (m - centre)[None, :, None]
        if t is not None and dm is not None:
            sums -= totals[:, 1].transpose(1, 2)[..., None] * dm[None, :, None]
        near_nodes, near_memories = torch.nonzero(near, as_tuple=True)
        if near_nodes.numel():
            mu = m[near_memories]
            if t is not None and dm is not None:
                mu = mu + t[near_nodes, None] * dm[near_memories]
            exact = (
                weighted_sigma[near_nodes, :, near_memories, None] * (x[near_nodes] - mu)[:, None]
            )
            sums.index_put_((rows[near_nodes], near_memories), exact, accumulate=True)
        extra = [row_sums(rows, weights, values, n_rows) for values in factors.extra_coefficients]
        return self._assemble(sums.transpose(1, 2), extra, n_rows)

    def has_dense_form(self, factors, dense):
        """Node or row factors with several outputs, or with one output when the
        dense rows are few: both forms take the same matrix product, and the
        factored one passes over (n, K, J, m) dots where the materialised one
        forms (m, K', J, D) gradients, so it is taken when ``n K <= K' D``."""
        sigma = factors.sigma
        if factors.sigma_t is not None or sigma is None:
            return False
        n_outputs = sigma.shape[1]
        return n_outputs > 1 or dense.shape[0] * dense.shape[1] <= n_outputs * factors.x.shape[1]

    def dense_inner(self, dense, factors, mode):
        """``contract(dense, materialise(factors), mode)`` without materialising the factors.

        ``dense`` (n, K, W_layer) is a weight-space vector per row and output in
        the rule's layout (e.g. Adam's ``psi_s``, or ``P_s phi_s``), ``factors``
        those of m rows, ``mode`` TRACE or PAIRS. The memory block is, with
        ``a_ikj`` the dense block of memory ``j`` and ``e_lj = x_l - mu_lj``,

            sum_j sigma_lk'j (a_ikj . e_lj),
            a_ikj . e_lj = a_ikj . (x_l - c) - a_ikj . (m_j - c) - t_l a_ikj . dm_j,

        one (n K J, D) x (D, m) matrix product (``c`` the mean memory) and a
        contraction over ``j``: ``O(n K J m (D + K'))`` instead of forming
        ``m K' J D`` gradients and an ``O(n K m K' J D)`` product. Pairs where
        the expansion cancels (the factors' ``near`` mask) are summed from
        explicit differences.

        The memories are taken in chunks whose block of ``dense`` (c, n, K, D)
        and (c, n, K, m) dots stay in the cache (``DOTS_CHUNK_BYTES``; on a GPU
        ``BLOCK_BUDGET_BYTES``): ``dense`` is read once, and each chunk's dots are
        contracted with ``sigma`` while they are there, by a broadcast product and
        a sum over the chunk's memories (a batched product over the rows where
        each row keeps ``K' > 1`` outputs): on the image cells of
        ``benchmarks/bench_matrix.py --images`` the products took 1.7x less time
        than with the dots of all memories at once, contracted by a batched
        product over the rows.
        """
        memories = factors.memories
        x, m, dm, t = factors.x, memories.m, memories.dm, factors.t
        (n_memories, width), n, n_outputs = m.shape, dense.shape[0], dense.shape[1]
        a = dense[..., : n_memories * width].reshape(n, n_outputs, n_memories, width)
        centre = m.mean(0)
        x_c = (x - centre).T
        near_rows, near_memories = torch.nonzero(factors.near, as_tuple=True)
        by_memory = factors.sigma.permute(2, 1, 0).contiguous()  # (J, K', m)
        # a chunk holds its block of ``dense`` memory-major and its dots
        chunk_row_bytes = x.element_size() * n * n_outputs * (x.shape[0] + width)
        step = rows_per_tile(n_memories, chunk_row_bytes, dots_chunk_bytes(x.device))
        out = 0.0
        for begin in range(0, n_memories, step):
            chunk = slice(begin, begin + step)
            # (c, n, K, D), contiguous: the product's left side
            block = a[:, :, chunk].permute(2, 0, 1, 3).contiguous()
            # (c, n, K, m): a_ikj . e_lj
            dots = (block.view(-1, width) @ x_c).view(*block.shape[:3], -1)
            dots -= (block * (m[chunk] - centre)[:, None, None]).sum(-1)[..., None]
            if t is not None:
                dots -= (block * dm[chunk][:, None, None]).sum(-1)[..., None] * t
            inside = (near_memories >= begin) & (near_memories < begin + block.shape[0])
            if inside.any():
                rows, local = near_rows[inside], near_memories[inside] - begin
                mu = m[chunk][local]
                if t is not None:
                    mu = mu + t[rows, None] * dm[chunk][local]
                dots[local, :, :, rows] = (block[local] * (x[rows] - mu)[:, None, None]).sum(-1)
            out = out + _sum_over_memories(dots, by_memory[chunk], mode)
        rest = factors.extra_coefficients
        if rest:
            out = out + contract(dense[..., n_memories * width :], torch.cat(rest, 2), mode)
        return out

    def has_metric_form(self, left, right):
        """Memory gradients on both sides (the right ones per node), several outputs."""
        if left.sigma is None or right.sigma_t is not None:
            return False
        n_outputs, width = left.sigma.shape[1], left.memories.m.shape[1]
        return n_outputs * width > width + 2 * n_outputs

    def metric_inner(self, left, right, scale, mode):
        """``<g(left row), scale * g(right row)>`` in TRACE mode, contracted per memory.

        With ``P_j`` memory ``j``'s block of ``scale`` (Adam's preconditioner),
        the memory gradients ``sigma_ikj e_ij`` (minus ``T_ikj dm_j`` for
        integrated factors) give

            sum_j (sum_k sigma_ikj sigma'_lkj) (e_ij . P_j e'_lj)
              - sum_kj T_ikj sigma'_lkj (dm_j . P_j e'_lj):

        per block of memories, one (J n, D) x (D, m) product for the weighted
        distances and a batched (n, K) x (K, m) product per memory, then one
        pass over (J, n, m): ``O(n m J (D + K))`` instead of the materialised
        ``O(n m K J D)``. ``e'_lj`` is expanded about the mean memory and summed
        from explicit differences where that cancels (the right factors'
        ``near`` pairs), as in :meth:`dense_inner`.
        """
        memories = left.memories
        m = memories.m
        dm = memories.dm if memories.dm is not None else right.memories.dm
        (n_memories, width), n = m.shape, left.sigma.shape[0]
        x, t, x_r, t_r = left.x, left.t, right.x, right.t
        sigma, sigma_r = left.sigma, right.sigma
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
            near_rows, near_memories = torch.nonzero(right.near[:, chunk], as_tuple=True)
            if near_rows.numel():
                mu_near = mu[near_memories]
                if t_r is not None:
                    mu_near = mu_near + t_r[near_rows, None] * dm[chunk][near_memories]
                exact = (u[near_memories] * (x_r[near_rows] - mu_near)[:, None]).sum(-1)
                dots[near_memories, :, near_rows] = exact
            out += torch.bmm(by_memory[chunk], by_memory_r[chunk]).mul_(dots).sum(0)
        if left.sigma_t is not None:  # - T_ikj sigma'_lkj (e'_lj . P_j dm_j)
            steps = memory_dots(x_r, m, dm, t_r, p * dm, right.near)
            moved = (sigma_r * steps[:, None]).reshape(x_r.shape[0], -1)
            out -= left.sigma_t.reshape(n, -1) @ moved.T
        rest_left, rest_right = left.extra_coefficients, right.extra_coefficients
        if rest_left:
            scaled = torch.cat(rest_left, 2) * scale[memory_width:]
            out += contract(scaled, torch.cat(rest_right, 2), mode)
        return out


def _sum_over_memories(dots, sigma, mode):
    """``sum_j sigma_lk'j dots_jikl`` of a chunk of memories.

    ``dots`` (c, n, K, m), ``sigma`` (c, K', m) memory-major. TRACE (K' = K):
    (n, m), summed over the outputs too; PAIRS: (n, m, K, K'). One output per
    row (``K' = 1``, the decomposition's training side) and the trace are a
    broadcast product and a sum, read while the chunk is in the cache; several
    outputs per row in PAIRS take a batched product over the rows.
    """
    if mode == OutputMode.TRACE:
        return (dots * sigma[:, None]).sum((0, 2))
    if sigma.shape[1] == 1:
        return (dots * sigma[:, None]).sum(0).permute(0, 2, 1)[..., None]
    return torch.einsum("jikl,jpl->ilkp", dots, sigma)
