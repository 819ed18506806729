"""Quadrature along a training step: the rules for the test copy, in one table.

The test-copy feature of step ``s`` is ``phi_s(x) = int_0^1 grad_w f(x; w_s(t)) dt``.
A rule gives every row its *nodes*: (row, t, weight) triples (:class:`Nodes`).
:class:`Quadrature` lists the rules, each member with its cost; its
:meth:`~Quadrature.rule` is the strategy object the engine integrates with
(:class:`QuadratureRule`: :class:`KinkSplittingRule` or :class:`FixedRule`), and
:meth:`~Quadrature.fixed_nodes` the nodes and weights of the non-adaptive members
(the one table of them, which the brute-force reference of the tests uses too).

Cost, per step and query row: the factors of one forward and backward pass per
node (``n_nodes`` per smooth piece for ``EXACT``, ``T`` for the fixed rules),
plus, for ``EXACT``, the kink search (:mod:`._kinks`: forward passes only).
"""

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ._degree import NodeCounts
from ._kinks import StepEnds, row_kinks
from ._link_weights import GaussWeights, TargetWeighting, node_weighting, target_weighting
from ._link_weights import gauss_on_unit as gauss_legendre

#: The test x test integrand is a product of two gradients (twice the polynomial
#: degree of one) and carries no certificate: it gets this many times the nodes
#: where the path's degree is unknown (:class:`._degree.NodeCounts`).
TEST_TEST_NODES = 3


@dataclass
class Nodes:
    """Quadrature nodes of a batch: row ``rows[e]`` is evaluated at ``t[e]`` with ``weights[e]``."""

    rows: np.ndarray
    t: np.ndarray
    weights: np.ndarray

    @staticmethod
    def cat(parts):
        return Nodes(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("rows", "t", "weights"))
        )

    def take(self, mask):
        return Nodes(self.rows[mask], self.t[mask], self.weights[mask])


class SharedNodes(NamedTuple):
    """Nodes ``t`` and weights on ``[0, 1]`` valid for every row of a batch."""

    t: np.ndarray
    weights: np.ndarray


class RowNodes(NamedTuple):
    """A rule's nodes for the rows of a batch.

    Attributes
    ----------
    nodes : Nodes
    kinks : list of ndarray or None
        Per row, the breakpoints its pieces were split at (None: a fixed rule).
    ends : StepEnds or None
        The rows' ``f`` and scale at both ends of the step, when the rule's own
        passes computed them (else None: the certificate evaluates them).
    """

    nodes: Nodes
    kinks: list | None
    ends: StepEnds | None

    def of_rows(self, picked):
        """These nodes for the rows ``picked`` (indices into this batch's rows),
        renumbered ``0 .. len(picked) - 1`` in that order."""
        picked = np.asarray(picked, dtype=np.int64)
        parts = []
        for position, row in enumerate(picked):
            part = self.nodes.take(self.nodes.rows == row)
            parts.append(Nodes(np.full(part.rows.size, position), part.t, part.weights))
        nodes = Nodes.cat(parts) if parts else self.nodes.take(slice(0, 0))
        kinks = None if self.kinks is None else [self.kinks[row] for row in picked]
        ends = None
        if self.ends is not None:
            index = torch.as_tensor(picked, device=self.ends.f_start.device)
            ends = type(self.ends)(*(value[index] for value in self.ends))
        return RowNodes(nodes, kinks, ends)


def pieces(rows, kinks):
    """The pieces of ``[0, 1]`` that each row's kinks split it into.

    ``kinks[i]`` are the breakpoints of ``rows[i]``. Returns ``(rows, a, b)``:
    one entry per piece ``[a, b]`` of positive width, by row, then increasing.
    """
    rows = np.asarray(rows)
    counts = np.fromiter((k.size for k in kinks), int, len(kinks))
    edge_rows = np.concatenate([rows, np.repeat(rows, counts), rows])
    edge_t = np.concatenate([np.zeros(rows.size), *kinks, np.ones(rows.size)])
    order = np.lexsort((edge_t, edge_rows))
    edge_rows, edge_t = edge_rows[order], edge_t[order]
    piece = (edge_rows[1:] == edge_rows[:-1]) & (edge_t[1:] > edge_t[:-1])
    return edge_rows[:-1][piece], edge_t[:-1][piece], edge_t[1:][piece]


def gauss_on_pieces(piece_rows, a, b, n_nodes):
    """``n_nodes`` Gauss-Legendre nodes on every piece ``[a, b]`` of ``piece_rows``."""
    base_nodes, base_weights = gauss_legendre(n_nodes)
    width = (b - a)[:, None]
    return Nodes(
        np.repeat(piece_rows, n_nodes),
        (a[:, None] + width * base_nodes).ravel(),
        (width * base_weights).ravel(),
    )


def piecewise_nodes(rows, kinks, n_nodes):
    """Gauss-Legendre nodes on every piece of every row split at its kinks."""
    return gauss_on_pieces(*pieces(rows, kinks), n_nodes)


def same_nodes(rows, t, weights):
    """Every row of ``rows`` with the same nodes ``t`` and ``weights``."""
    rows = np.asarray(rows)
    return Nodes(np.repeat(rows, len(t)), np.tile(t, len(rows)), np.tile(weights, len(rows)))


class QuadratureRule(ABC):
    """How the engine integrates ``phi_s``: the strategy behind a :class:`Quadrature`.

    ``step`` arguments have the step's start ``w_s`` and ``direction``
    ``w_{s+1} - w_s`` (flat, on the device).
    """

    #: Whether rows whose certificate fails are integrated again (finer kink
    #: grids, then bisection): only a rule that is exact by design can be.
    adaptive = False

    @abstractmethod
    def row_nodes(self, probe, step, X, n_nodes):
        """Each row of ``X`` with its own nodes: a :class:`RowNodes`."""

    def node_counts(self, degree, n_nodes):
        """The :class:`NodeCounts` this rule integrates with, given the path's
        degree in ``t`` (an int, or None when unknown): a fixed rule's own nodes
        do not depend on it."""
        return NodeCounts.of(None, n_nodes, TEST_TEST_NODES)

    def node_weighting(self, link, degrees, n_nodes, per_layer):
        """The :class:`~._link_weights.NodeWeighting` of the nodes and the
        :class:`NodeCounts`, given the link, ``(f_degree, logits_degree)`` and
        whether the probe has per-layer rules: a fixed rule's own weights."""
        return GaussWeights(n_nodes), self.node_counts(degrees[0], n_nodes)

    def target_weighting(self, link, degrees, n_nodes, per_layer):
        """The :class:`~._link_weights.TargetWeighting` of scalar targets per query
        (arguments as :meth:`node_weighting`): a fixed rule's own nodes."""
        return TargetWeighting(link, None, self.node_counts(degrees[0], n_nodes).per_piece)

    @abstractmethod
    def shared_nodes(self, probe, step, X, n_nodes):
        """One set of nodes valid for every row of ``X``: a :class:`SharedNodes`.

        Needed where two rows are integrated against each other at the same
        ``t`` (the test x test kernel).
        """


class KinkSplittingRule(QuadratureRule):
    """``n_nodes`` Gauss-Legendre nodes on every smooth piece of each row's step.

    The pieces are those between the row's kinks (:func:`._kinks.row_kinks`):
    exact to machine precision for a piecewise-polynomial integrand of degree
    up to ``2 n_nodes - 1``, and certified for any other. The engine asks for
    no more nodes than the path's degree needs (:meth:`node_counts`).
    """

    adaptive = True

    def node_counts(self, degree, n_nodes):
        """At most ``n_nodes`` per piece, fewer where they are exact already: a
        path of degree ``D`` has gradients of degree ``D - 1`` on each piece,
        integrated exactly by ``ceil(D / 2)`` nodes, and their products by ``D``
        (see :class:`NodeCounts`)."""
        return NodeCounts.of(degree, n_nodes, TEST_TEST_NODES)

    def node_weighting(self, link, degrees, n_nodes, per_layer):
        """Exact nodes on every piece: ``ceil(D / 2)`` with Gauss weights where
        ``f`` has degree ``D``, the logits' degree with Jacobian weights where
        ``f`` is a closed-form link of polynomial logits
        (:func:`~._link_weights.node_weighting`), else ``n_nodes``."""
        return node_weighting(link, degrees, n_nodes, TEST_TEST_NODES, per_layer)

    def target_weighting(self, link, degrees, n_nodes, per_layer):
        """Exact nodes for a scalar target per query: the logits' degree with
        target-gradient weights where :meth:`node_weighting` would take Jacobian
        weights (and for nonlinear targets of an affine link), else the Gauss
        nodes of :meth:`node_weighting` (:func:`~._link_weights.target_weighting`)."""
        return target_weighting(link, degrees, n_nodes, per_layer)

    def row_nodes(self, probe, step, X, n_nodes):
        return self.refined_nodes(probe, step, X, np.arange(X.shape[0]), (0.0, 1.0), n_nodes)

    def refined_nodes(self, probe, step, X, rows, grid, n_nodes):
        """The nodes of ``rows`` with kinks searched on the finer ``grid``."""
        rows = np.asarray(rows)
        search = row_kinks(probe, step.start, step.direction, X, rows, tuple(grid))
        return RowNodes(piecewise_nodes(rows, search.kinks, n_nodes), search.kinks, search.ends)

    def shared_nodes(self, probe, step, X, n_nodes):
        kinks = row_kinks(probe, step.start, step.direction, X, np.arange(X.shape[0])).kinks
        breakpoints = np.concatenate(kinks) if kinks else np.array([])
        nodes = piecewise_nodes(np.zeros(1, int), [np.asarray(breakpoints, float)], n_nodes)
        return SharedNodes(nodes.t, nodes.weights)


class FixedRule(QuadratureRule):
    """The same nodes ``t`` and weights for every row and step."""

    def __init__(self, t, weights):
        self.t, self.weights = t, weights

    def row_nodes(self, probe, step, X, n_nodes):
        return RowNodes(same_nodes(np.arange(X.shape[0]), self.t, self.weights), None, None)

    def shared_nodes(self, probe, step, X, n_nodes):
        return SharedNodes(self.t, self.weights)


class Quadrature(enum.Enum):
    """The quadrature rules of ``phi_s = int_0^1 g(x; w_s(t)) dt``, with their cost.

    ``EXACT``
        Splits each row's step at its kinks and puts ``n_nodes`` Gauss-Legendre
        nodes on every smooth piece; rows whose certificate fails are searched
        on finer grids, then bisected. Exact to the certificate's tolerance.
        Cost: ``n_nodes`` gradient nodes per piece (one piece per row of a
        smooth network, a few more per kink), and a kink search of
        forward passes only.
    ``RIEMANN``
        The EPK paper's left Riemann sum, ``t = 0, 1/T, ..., (T - 1)/T``.
        Cost: ``T = n_points`` gradient nodes per row; error O(1/T).
    ``DPK``
        The single left point ``t = 0`` of the Discrete Path Kernel. Cost: one
        gradient node per row, shared with the training copy; error O(step).
    ``MIDPOINT``
        The ``T`` midpoints ``(j + 1/2) / T``. Cost: ``T`` gradient nodes per row;
        error O(1/T) across kinks, O(1/T^2) on a smooth path.
    ``GAUSS``
        ``T`` Gauss-Legendre nodes on the whole step. Cost: ``T`` gradient nodes
        per row; exact to degree ``2 T - 1`` (spectral on a smooth network), O(1/T)
        across kinks.

    The string of a member (``"exact"``...) is the engine's ``quadrature``
    parameter; the estimators offer ``"exact"``, ``"riemann"`` and ``"dpk"``.
    """

    EXACT = "exact"
    RIEMANN = "riemann"
    DPK = "dpk"
    MIDPOINT = "midpoint"
    GAUSS = "gauss"

    @classmethod
    def of(cls, name):
        """The member named ``name`` (``"exact"``...), or a ``ValueError``."""
        try:
            return cls(name)
        except ValueError:
            names = [member.value for member in cls]
            raise ValueError(f"Unknown quadrature {name!r}; use one of {names}.") from None

    def fixed_nodes(self, n_points):
        """Nodes ``t`` and weights on ``[0, 1]`` of a fixed rule of ``n_points`` points
        (ignored by ``DPK``); ``EXACT`` has none (its nodes depend on the row)."""
        if self not in _FIXED_NODES:
            raise ValueError(f"{self.value!r} is not a fixed rule; it has no fixed nodes.")
        if self is not Quadrature.DPK and int(n_points) < 1:
            raise ValueError(f"n_points must be a positive integer, got {n_points!r}.")
        t, weights = _FIXED_NODES[self](int(n_points))
        return SharedNodes(t, weights)

    def rule(self, n_points):
        """The strategy object that integrates with this rule."""
        if self is Quadrature.EXACT:
            return KinkSplittingRule()
        return FixedRule(*self.fixed_nodes(n_points))


def _gauss(T):
    t, weights = gauss_legendre(T)
    return t.copy(), weights.copy()


_FIXED_NODES = {
    Quadrature.RIEMANN: lambda T: (np.arange(T) / T, np.full(T, 1.0 / T)),
    Quadrature.DPK: lambda T: (np.zeros(1), np.ones(1)),
    Quadrature.MIDPOINT: lambda T: ((np.arange(T) + 0.5) / T, np.full(T, 1.0 / T)),
    Quadrature.GAUSS: _gauss,
}
