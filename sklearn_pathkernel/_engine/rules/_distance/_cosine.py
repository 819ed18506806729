"""The cosine family: ``k(x, mu) = x . mu / (|x| |mu|)``.

Memory gradients ``d f_k / d m_j = alpha_kj x + beta_kj mu_j`` with
``alpha = delta / (|x| |mu|)`` and ``beta = -delta k / |mu|^2`` (norms clamped at
``COSINE_EPS`` like the layer; no ``beta`` where the memory's norm is clamped).
Their inner products expand into contractions over ``j`` of (n, K, J) blocks
and the (n, m) input Gram, ``O(n m (D + K J))``; the expansion's terms are
bounded by ``|delta| / |mu|`` and cancel only to their own size.
"""

import torch

from ...._nn import COSINE_EPS
from ..._modes import OutputMode
from .._contract import weighted
from ._factors import CosineFactors
from ._family import KernelFamily
from ._geometry import memory_norms, squared_norm


class CosineFamily(KernelFamily):
    """The memory part of the rule for "cosine" (no integrated or dense forms)."""

    def output(self, x, weights):
        m, dm = self.rule.param("memories", weights)
        t_col = weights.t[:, None]
        x_norm = torch.clamp(torch.linalg.vector_norm(x, dim=1, keepdim=True), min=COSINE_EPS)
        dot = x @ m.T
        if dm is None:  # per row, so that the kink recorder sees (n, J) values
            m_norm = torch.linalg.vector_norm(m.detach(), dim=1).expand(x.shape[0], -1)
        else:
            dot = dot + t_col * (x @ dm.T)
            with torch.no_grad():
                m_norm = memory_norms(m.detach(), dm, weights.t)
        return dot / (x_norm * torch.clamp(m_norm, min=COSINE_EPS))

    def factors(self, x, delta, weights, common):
        """``alpha``, ``beta``, ``P = x . m`` and for moving rows ``Q = x . dm``:
        ``O(n J (D + K))``."""
        memories, t = common["memories"], common["t"]
        m, dm = memories.m, memories.dm
        fields = {}
        x_norm = torch.clamp(torch.linalg.vector_norm(x, dim=1), min=COSINE_EPS)[:, None]
        dot = x @ m.T
        if dm is not None:
            fields["Q"] = x @ dm.T
            dot = dot + t[:, None] * fields["Q"]
            m_norm = memory_norms(m, dm, t)
        else:
            m_norm = torch.linalg.vector_norm(m, dim=1).expand(x.shape[0], -1)
        m_norm_c = torch.clamp(m_norm, min=COSINE_EPS)
        kernel = dot / (x_norm * m_norm_c)
        if "memories" in self.rule.names:
            fields["alpha"] = delta / (x_norm * m_norm_c)[:, None]
            fields["beta"] = (
                delta * (-(kernel / m_norm_c.square()) * (m_norm >= COSINE_EPS))[:, None]
            )
            fields["P"] = x @ m.T if dm is not None else dot
        return CosineFactors(**common, **fields)

    def memory_blocks(self, left, right, dm, mode):
        """Blocks of ``sum_j (alpha x + beta mu) . (alpha' x' + beta' mu')``; the extra
        term is ``x . x'`` times ``alpha . alpha'``."""
        alpha, beta, alpha_r, beta_r = left.alpha, left.beta, right.alpha, right.beta
        m = left.memories.m
        t_left, t_right = left.t, right.t
        first = alpha * left.P[:, None] + beta * squared_norm(m)
        third = alpha_r * right.P[:, None]
        if dm is not None:
            m_dm = (m * dm).sum(1)
        if t_left is not None:
            first = first + t_left[:, None, None] * beta * m_dm
        if t_right is not None:
            third = third + t_right[:, None, None] * beta_r * m_dm
        lefts, rights = [first, beta], [beta_r, third]
        if t_right is not None:
            second = alpha * left.plain_dot(dm)[:, None]
            if t_left is not None:
                second = second + t_left[:, None, None] * beta * squared_norm(dm)
            lefts.append(second)
            rights.append(t_right[:, None, None] * beta_r)
        if t_left is not None:
            lefts.append(t_left[:, None, None] * beta)
            rights.append(alpha_r * right.plain_dot(dm)[:, None])
        x, x_r = left.x, right.x
        dots = (x * x_r).sum(1) if mode == OutputMode.DIAG else x @ x_r.T
        return lefts, rights, weighted(dots, alpha, alpha_r, mode)

    def memory_directional(self, factors, step):
        """``alpha_kj x . step_j + beta_kj mu_j . step_j`` summed over ``j``."""
        memories, x, t = factors.memories, factors.x, factors.t
        mu_dot = (memories.m * step).sum(1)
        if t is not None:
            mu_dot = mu_dot + t[:, None] * (memories.dm * step).sum(1)
        out = torch.einsum("nkj,nj->nk", factors.alpha, x @ step.T)
        return out + torch.einsum("nkj,nj->nk", factors.beta, mu_dot.expand(x.shape[0], -1))

    def memory_coefficient(self, factors):
        return factors.alpha

    def _memory_gradients(self, factors, mu, grads):
        torch.mul(factors.alpha[..., None], factors.x[:, None, None, :], out=grads)
        grads.addcmul_(factors.beta[..., None], mu[:, None])
