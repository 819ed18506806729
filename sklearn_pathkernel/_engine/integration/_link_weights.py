"""How the quadrature's nodes weight the backward pass: scalars, or K x K matrices.

The test copy ``phi_s = int_0^1 grad_w f(w_s(t)) dt`` is a sum over nodes. Today's
rule (:class:`GaussWeights`) back-propagates every output of ``f`` at each node and
weighs the gradients with scalar Gauss-Legendre weights: exact when ``grad f`` is a
polynomial in ``t`` of degree at most ``2 n - 1`` on each smooth piece, only
certified otherwise (the log-softmax of the classifiers).

:class:`JacobianWeights` is exact for any link with a closed-form Jacobian. On a
smooth piece ``[a, b]`` the logits ``z(t)`` are a polynomial of degree ``D`` and
``grad_w z_j(t)`` one of degree ``D - 1`` (see :mod:`._degree`), while ``grad_w f_k
= sum_j J_kj(z(t)) grad_w z_j(t)``. Interpolating ``grad_w z`` at ``D`` nodes
``t_q`` is exact, so

.. math::

    \\int_a^b \\nabla_w f_k\\, dt = \\sum_q \\sum_j W_q[k, j]\\, \\nabla_w z_j(t_q),
    \\qquad W_q = \\int_a^b L_q(t)\\, J(z(t))\\, dt,

with ``L_q`` the Lagrange basis on the nodes. ``W_q`` depends on ``z(t)`` alone: the
logits at ``D + 1`` points of the piece (one forward pass, no backward) give
``z(t)`` everywhere on it, and the scalar integrals are taken with a Gauss-Legendre
rule of ``M`` points, ``M`` raised (16 and 24, then 48 and 64, ... 512 and 1024) until
two orders agree to ``ROUNDING`` (Gauss-Legendre converges geometrically on these
analytic integrands: the finer of two agreeing orders is exact to rounding). The
probe back-propagates, at each node, the ``K`` rows of ``W_q`` as cotangents at the
logits: ``D`` nodes of ``K`` cotangents
per piece, where the Gauss rule takes ``n_nodes`` (4) nodes of ``K``.

Cost per step: one forward pass of ``(D + 1) / D`` times the nodes' rows, and
``P M K (D + 1)`` numbers for ``P`` pieces (the log-softmax's Jacobian is ``I - 1
p^T``: :meth:`~sklearn_pathkernel._training._losses.LogSoftmaxLink.weighted_jacobians`).

A scalar target :math:`T(f)` per query (:class:`~.._targets.QueryTargets`) needs
one cotangent per node, not ``K`` (:class:`TargetWeighting` chooses how):
:class:`JacobianTargetWeights` integrates :math:`w_q = \\int_a^b L_q(t)
\\nabla_z T(\\mathrm{link}(z(t)))\\, dt` as above (exact: ``T`` composed with the
link is analytic in the logits), :class:`GaussTargetWeights` back-propagates
:math:`\\nabla_f T` at each node's own ``f`` (one forward pass of the nodes more)
with the nodes' weights: exact where ``T`` is linear and ``f`` polynomial,
certified otherwise.
"""

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.linalg import block_diag

from ._degree import NodeCounts

#: The integrals' orders, tried in pairs; a piece's ``W_q`` is accepted when the
#: two orders of a pair agree to ``ROUNDING`` (relative; else the last one is
#: kept, and the certificate measures the rest).
ORDERS = (16, 24, 48, 64, 128, 256, 512, 1024)
ROUNDING = 64 * np.finfo(np.float64).eps


@dataclass(frozen=True)
class NodeWeights:
    """The weights of some nodes for the sums over them.

    Attributes
    ----------
    weights : np.ndarray of shape (n,)
        The scalar weight of each node's gradients.
    cotangents : torch.Tensor of shape (n, K', K) or None
        Per node, the cotangents at the logits whose gradients are the node's
        ``K'`` terms (row ``k`` for output ``k``; one row for a scalar target);
        None: ``f`` itself is back-propagated.
    outputs : torch.Tensor of shape (n, K) or None
        With ``cotangents`` None: per node, one cotangent on ``f`` (a scalar
        target's gradient, the node's one term); None: every output of ``f``.
    """

    weights: np.ndarray
    cotangents: torch.Tensor | None = None
    outputs: torch.Tensor | None = None


class NodeWeighting(ABC):
    """How the nodes of a smooth piece are placed and weighted.

    Attributes
    ----------
    nodes_per_piece : int
    """

    nodes_per_piece = 1

    @abstractmethod
    def weigh(self, probe, step, X, nodes):
        """The :class:`NodeWeights` of ``nodes`` (a :class:`._quadrature.Nodes`, with
        ``nodes_per_piece`` consecutive Gauss-Legendre nodes per piece)."""


class GaussWeights(NodeWeighting):
    """The nodes' own Gauss-Legendre (or fixed-rule) weights; ``f`` back-propagated."""

    def __init__(self, nodes_per_piece):
        self.nodes_per_piece = nodes_per_piece

    def weigh(self, probe, step, X, nodes):
        return NodeWeights(nodes.weights)


class JacobianWeights(NodeWeighting):
    """``W_q = int_a^b L_q(t) J(z(t)) dt`` at ``degree`` Gauss nodes per piece.

    Parameters
    ----------
    link : Link
        With a closed-form Jacobian (``link.closed_form``).
    degree : int
        ``D``, the logits' degree in ``t`` on a smooth piece: ``D`` nodes.
    """

    def __init__(self, link, degree):
        self.link, self.degree = link, degree
        self.nodes_per_piece = max(1, degree)

    def weigh(self, probe, step, X, nodes):
        n = self.nodes_per_piece
        if nodes.rows.size % n:
            raise ValueError(f"{nodes.rows.size} nodes are no whole number of pieces of {n}.")
        like = {"dtype": step.start.dtype, "device": step.start.device}
        rows = nodes.rows[::n]
        width = nodes.weights.reshape(-1, n).sum(1)  # Gauss weights sum to the width
        start = nodes.t[::n] - width * gauss_on_unit(n)[0][0]
        points = start[:, None] + width[:, None] * interpolation_points(self.degree)
        logits = probe.logits(
            step.start,
            X,
            step.direction,
            torch.as_tensor(points.ravel(), **like),
            rows=torch.as_tensor(np.repeat(rows, self.degree + 1), device=like["device"]),
        )
        logits = logits.reshape(rows.size, self.degree + 1, logits.shape[-1])
        matrices = self._pieces(logits, torch.as_tensor(width, **like), rows)
        return NodeWeights(np.ones(nodes.rows.size), matrices.flatten(0, 1))

    def _pieces(self, logits, widths, rows):
        """The pieces' weight matrices from their logits at the interpolation points."""
        return self.piece_weights(logits, widths)

    def piece_weights(self, logits, widths, targets=None):
        """``W_q`` (P, D, K, K) of ``P`` pieces from their logits at the
        :func:`interpolation_points` (P, D + 1, K) and their widths (P,)
        (``targets``: the pieces' :class:`~.._targets.QueryTargets`, for
        :class:`JacobianTargetWeights`).

        Each pair of ``ORDERS`` is taken in one evaluation of the link's
        Jacobians; a piece whose two results differ by more than ``ROUNDING``
        (relative) goes on to the next pair.
        """
        result = None
        pending = torch.arange(logits.shape[0], device=logits.device)
        for orders in zip(ORDERS[::2], ORDERS[1::2], strict=True):
            of_pending = None if targets is None else targets.take(pending)
            coarse, fine = self._integrals(logits[pending], orders, of_pending).chunk(2, dim=1)
            if result is None:
                result = fine
            else:
                result[pending] = fine
            change = (fine - coarse).abs().flatten(1).amax(1)
            pending = pending[change > ROUNDING * (1.0 + fine.abs().flatten(1).amax(1))]
            if pending.numel() == 0:
                break
        return widths.to(result.dtype)[:, None, None, None] * result

    def _integrals(self, logits, orders, targets=None):
        """``int_0^1 L_q(u) J(z(u)) du`` with Gauss-Legendre rules of each of
        ``orders`` points: (P, len(orders) D, K, K), the orders one after the other."""
        coefficients, interpolation = _unit_integrals(self.degree, self.nodes_per_piece, orders)
        like = {"dtype": logits.dtype, "device": logits.device}
        z = torch.einsum("mi,pik->pmk", torch.as_tensor(interpolation, **like), logits)
        return self._weighted(torch.as_tensor(coefficients, **like), z, targets)

    def _weighted(self, coefficients, z, targets):
        """``sum_m coefficients[q, m] J(z[p, m])`` (P, Q, K, K)."""
        return self.link.weighted_jacobians(coefficients, z)


class JacobianTargetWeights(JacobianWeights):
    """``w_q = int_a^b L_q(t) grad_z T(link(z(t))) dt`` at ``degree`` Gauss nodes per
    piece: one cotangent row per node for a scalar target per query row.

    Exact as :class:`JacobianWeights` (``T`` composed with the link is analytic in
    the logits); the gradients at the ``M`` sample points are taken by
    ``torch.func`` (``P M`` gradients of a K-vector function per order).

    Parameters
    ----------
    link : Link
    degree : int
    targets : QueryTargets
        The target of each row of the ``X`` that :meth:`weigh` is given.
    """

    def __init__(self, link, degree, targets):
        super().__init__(link, degree)
        self.targets = targets

    def _pieces(self, logits, widths, rows):
        targets = self.targets.take(torch.as_tensor(rows, device=logits.device))
        return self.piece_weights(logits, widths, targets)

    def _weighted(self, coefficients, z, targets):
        """``sum_m coefficients[q, m] grad_z T(link(z[p, m]))`` (P, Q, 1, K).

        A target linear in ``f`` has a constant ``c = grad_f T``: its weights are
        ``c^T W_q`` from the link's own weighted Jacobians (closed form, ``P Q K^2``);
        another takes the gradient of ``T(link(z))`` at every sample point
        (autograd, one backward pass of ``P M`` rows).
        """
        if targets.target.linear:
            slope = targets.output_gradients(z.new_zeros((z.shape[0], z.shape[2])))
            matrices = self.link.weighted_jacobians(coefficients, z)  # (P, Q, K, K)
            return torch.einsum("pk,pqkj->pqj", slope, matrices)[:, :, None, :]
        n_points = z.shape[1]
        gradients = targets.repeated(n_points).logit_gradients(self.link, z.flatten(0, 1))
        gradients = gradients.reshape(z.shape)
        return torch.einsum("qm,pmk->pqk", coefficients.to(z.dtype), gradients)[:, :, None, :]


class GaussTargetWeights(NodeWeighting):
    """The nodes' own weights, with the cotangent :math:`\\nabla_f T` of each node's
    row at its own ``f`` (a forward pass of the nodes): one term per node.

    Parameters
    ----------
    nodes_per_piece : int
    targets : QueryTargets
        The target of each row of the ``X`` that :meth:`weigh` is given.
    """

    def __init__(self, nodes_per_piece, targets):
        self.nodes_per_piece, self.targets = nodes_per_piece, targets

    def weigh(self, probe, step, X, nodes):
        device = step.start.device
        rows = torch.as_tensor(nodes.rows, device=device)
        t = torch.as_tensor(nodes.t, dtype=step.start.dtype, device=device)
        targets = self.targets.take(rows)
        if targets.target.linear:  # a constant gradient: f anywhere gives it
            f = probe.output(step.start, X)[rows]
        else:
            f = probe.output(step.start, X, step.direction, t, rows=rows)
        return NodeWeights(nodes.weights, outputs=targets.output_gradients(f))


class TargetWeighting:
    """How the nodes of a scalar target per query are weighted.

    :meth:`bind` gives, for the targets of some query rows, a
    :class:`NodeWeighting` with one term per node: :class:`JacobianTargetWeights`
    where the logits are a polynomial in ``t`` of known degree ``D <= n_nodes``,
    the link has a closed form and the probe per-layer rules (exact), except for a
    target linear in ``f`` of an affine link (``f`` polynomial itself: the
    engine's Gauss nodes are exact, ``ceil(D / 2)`` of them); else
    :class:`GaussTargetWeights` with the engine's nodes (certified, refined by an
    adaptive rule).

    Parameters
    ----------
    link : Link
    degree : int or None
        The logits' degree where the Jacobian route applies, else None.
    gauss_nodes : int
        The engine's nodes per piece for the Gauss route.
    """

    def __init__(self, link, degree, gauss_nodes):
        self.link, self.degree, self.gauss_nodes = link, degree, gauss_nodes

    def bind(self, targets):
        """The :class:`NodeWeighting` of ``targets`` (a ``QueryTargets``)."""
        if self.degree is None or (targets.target.linear and self.link.affine):
            return GaussTargetWeights(self.gauss_nodes, targets)
        return JacobianTargetWeights(self.link, self.degree, targets)


@lru_cache
def gauss_on_unit(n):
    """Gauss-Legendre nodes and weights on ``[0, 1]``: exact to degree ``2 n - 1``."""
    nodes, weights = np.polynomial.legendre.leggauss(n)
    return 0.5 * (nodes + 1.0), 0.5 * weights


@lru_cache
def interpolation_points(degree):
    """``degree + 1`` Chebyshev points inside ``[0, 1]`` (none at the piece's ends,
    which a kink search knows only to its tolerance)."""
    j = np.arange(degree + 1)
    return 0.5 * (1.0 - np.cos((2 * j + 1) * math.pi / (2 * (degree + 1))))


def lagrange_basis(points, at):
    """``L_i(at_m)`` (len(at), len(points)): the Lagrange basis on ``points``."""
    basis = np.ones((len(at), len(points)))
    for i, p_i in enumerate(points):
        for j, p_j in enumerate(points):
            if i != j:
                basis[:, i] *= (at - p_j) / (p_i - p_j)
    return basis


@lru_cache
def _unit_integrals(degree, n_nodes, orders):
    """On ``[0, 1]``, the Gauss-Legendre rules of ``orders`` points side by side
    (points ``u_m``, weights ``omega_m``): ``omega_m L_q(u_m)`` (len(orders)
    n_nodes, sum(orders)), block diagonal, with ``L_q`` the Lagrange basis on the
    ``n_nodes`` Gauss nodes, and ``l_i(u_m)`` (sum(orders), degree + 1), the basis
    on the :func:`interpolation_points` that gives ``z(u_m)`` from the logits."""
    nodes = gauss_on_unit(n_nodes)[0]
    blocks, interpolation = [], []
    for order in orders:
        u, omega = gauss_on_unit(order)
        blocks.append((omega[:, None] * lagrange_basis(nodes, u)).T)
        interpolation.append(lagrange_basis(interpolation_points(degree), u))
    coefficients = block_diag(*blocks)
    return coefficients, np.concatenate(interpolation)


def node_weighting(link, degrees, n_nodes, test_test_factor, per_layer):
    """The :class:`NodeWeighting` and :class:`NodeCounts` of the exact rule.

    Parameters
    ----------
    link : Link
    degrees : tuple (f_degree, z_degree)
        ``f``'s and the logits' degrees in ``t`` (int, or None: no polynomial).
    n_nodes : int
        The engine's nodes per piece where nothing is exact.
    test_test_factor : int
    per_layer : bool
        Whether the probe has per-layer rules (the per-node cotangent matrices
        need them; the whole-network Jacobian rule back-propagates ``f``).

    Returns
    -------
    weighting : NodeWeighting
    counts : NodeCounts
        ``per_piece`` the weighting's; ``test_test`` from ``f``'s degree.
    """
    f_degree, z_degree = degrees
    counts = NodeCounts.of(f_degree, n_nodes, test_test_factor)
    matrices = (
        per_layer
        and link.closed_form
        and not link.affine
        and z_degree is not None
        and max(1, z_degree) <= n_nodes
    )
    if not matrices:
        return GaussWeights(counts.per_piece), counts
    weighting = JacobianWeights(link, z_degree)
    return weighting, NodeCounts(weighting.nodes_per_piece, counts.test_test, f_degree)


def target_weighting(link, degrees, n_nodes, per_layer):
    """The exact rule's :class:`TargetWeighting` (arguments as :func:`node_weighting`)."""
    f_degree, z_degree = degrees
    jacobian = (
        per_layer and link.closed_form and z_degree is not None and max(1, z_degree) <= n_nodes
    )
    gauss = NodeCounts.of(f_degree, n_nodes, 1).per_piece
    return TargetWeighting(link, z_degree if jacobian else None, gauss)
