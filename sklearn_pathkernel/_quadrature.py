"""Quadrature along a training step for the test copy of input space.

The test-copy feature of step ``s`` is ``phi_s(x) = int_0^1 grad_w f(x; w_s(t)) dt``.
A rule is a flat list of *nodes*: (row, t, weight) triples, each row with its own
nodes. ``"exact"`` splits the step at each row's kinks and puts Gauss-Legendre
nodes on every smooth piece; ``"riemann"`` is the EPK paper's left Riemann sum;
``"dpk"`` the single left point of the Discrete Path Kernel.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ._kinks import SwitchState, locate_kinks, switch_state


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


@lru_cache
def gauss_legendre(n_nodes):
    """Gauss-Legendre nodes and weights on ``[0, 1]``."""
    nodes, weights = np.polynomial.legendre.leggauss(n_nodes)
    return 0.5 * (nodes + 1.0), 0.5 * weights


def piece_edges(breakpoints):
    """The pieces of ``[0, 1]`` split at ``breakpoints``: sorted unique edges."""
    return np.unique(np.concatenate([[0.0], np.asarray(breakpoints, float), [1.0]]))


def piecewise_gauss(breakpoints, n_nodes):
    """Gauss-Legendre nodes on each piece of ``[0, 1]`` split at ``breakpoints``."""
    edges = piece_edges(breakpoints)
    base_nodes, base_weights = gauss_legendre(n_nodes)
    widths = np.diff(edges)
    keep = widths > 0
    nodes = (edges[:-1, None] + widths[:, None] * base_nodes)[keep].ravel()
    weights = (widths[:, None] * base_weights)[keep].ravel()
    return nodes, weights


def fixed_rule(quadrature, n_points):
    """Nodes and weights of the non-adaptive rules on ``[0, 1]``."""
    if quadrature == "dpk":
        return np.zeros(1), np.ones(1)
    if quadrature == "riemann":
        return np.arange(n_points) / n_points, np.full(n_points, 1.0 / n_points)
    raise ValueError(f"Unknown quadrature {quadrature!r}.")


def same_nodes(rows, nodes, weights):
    """Every row of ``rows`` with the same nodes and weights."""
    rows = np.asarray(rows)
    return Nodes(
        np.repeat(rows, len(nodes)), np.tile(nodes, len(rows)), np.tile(weights, len(rows))
    )


def row_kinks(probe, start, direction, X, rows, grid=(0.0, 1.0), ends=None):
    """Kinks of each row in ``rows`` along ``w(t) = start + t * direction``.

    The pieces are first compared at the points of ``grid``; kinks are located
    between grid points whose pieces differ. A finer grid finds pairs of kinks
    that cancel between two coarse points. Grid points are returned as
    breakpoints too (harmless: a finer partition of a smooth piece).
    """
    rows = np.asarray(rows)
    X_rows = X[torch.as_tensor(rows, device=X.device)]
    kinks = [list(grid[1:-1]) for _ in rows]

    def evaluate(subset, t):
        return switch_state(probe, start, direction, X_rows[subset], t)

    states = [switch_state(probe, start, direction, X_rows, t) for t in grid]
    if ends is not None:  # the rows' (log_proba, scale) at both ends of the step
        ends.extend([states[0].outputs, states[-1].outputs])
    for left, right in zip(states[:-1], states[1:], strict=True):
        linear = _linear_switches(evaluate, left, right, kinks)

        def evaluate_rest(subset, t, linear=linear):
            return _without(evaluate(subset, t), [mask[subset] for mask in linear])

        found = locate_kinks(evaluate_rest, _without(left, linear), _without(right, linear))
        for row_kinks_, row_found in zip(kinks, found, strict=True):
            row_kinks_.extend(row_found)
    return [np.sort(np.asarray(k, dtype=float)) for k in kinks]


def _linear_switches(evaluate, left, right, kinks):
    """Roots of the switching values that are linear in ``t`` between two states.

    A first layer's pre-activations are linear in ``t`` along a step, so all of
    their kinks follow from the two end values at once (no search); they are
    added to ``kinks``. Returns, per switch tensor, the mask of those units, to be
    ignored by the search. Linearity is checked at the midpoint.
    """
    changed_rows = torch.nonzero(~left.same_piece(right)).squeeze(1)
    masks = [torch.zeros_like(z, dtype=torch.bool) for z in left.switches]
    if changed_rows.numel() == 0 or not masks:
        return masks
    lo, hi = left.t[changed_rows], right.t[changed_rows]
    middle = evaluate(changed_rows, 0.5 * (lo + hi))
    for mask, z_lo, z_hi, z_mid in zip(
        masks, left.switches, right.switches, middle.switches, strict=True
    ):
        z_lo, z_hi = z_lo[changed_rows], z_hi[changed_rows]
        scale = z_lo.abs() + z_hi.abs()
        linear = (z_mid - 0.5 * (z_lo + z_hi)).abs() <= 1e-12 * scale
        mask[changed_rows] = linear
        crossing = linear & ((z_lo > 0) != (z_hi > 0))
        if crossing.any():
            roots = lo[:, None] + (hi - lo)[:, None] * z_lo / (z_lo - z_hi)
            for position, root in zip(*torch.nonzero(crossing, as_tuple=True), strict=True):
                kinks[int(changed_rows[position])].append(float(roots[position, root]))
    return masks


def _without(state, masks):
    """The state with masked switching values replaced by a constant (never switching)."""
    return SwitchState(
        state.t,
        [torch.where(mask, 1.0, z) for z, mask in zip(state.switches, masks, strict=True)],
        state.pools,
    )


def exact_nodes(
    probe, start, direction, X, n_nodes, *, rows=None, grid=(0.0, 1.0), kinks=None, ends=None
):
    """Per-row nodes of the kink-splitting Gauss-Legendre rule.

    ``kinks`` (a list, optional) receives each row's breakpoints; ``ends`` (a list,
    optional) the rows' ``(log_proba, scale)`` at ``t = 0`` and ``t = 1``, recorded
    by the kink search's own forward passes.
    """
    rows = np.arange(X.shape[0]) if rows is None else np.asarray(rows)
    found = row_kinks(probe, start, direction, X, rows, tuple(grid), ends=ends)
    if kinks is not None:
        kinks.extend(found)
    parts = [
        same_nodes([row], *piecewise_gauss(k, n_nodes))
        for row, k in zip(rows, found, strict=True)
        if k.size
    ]
    smooth = [row for row, k in zip(rows, found, strict=True) if not k.size]
    if smooth:
        parts.append(same_nodes(smooth, *gauss_legendre(n_nodes)))
    return Nodes.cat(parts) if parts else Nodes(np.zeros(0, int), np.zeros(0), np.zeros(0))


def shared_exact_nodes(probe, start, direction, X, n_nodes):
    """One set of nodes valid for every row of ``X`` (the union of all kinks).

    Needed when two rows are integrated against each other at the same ``t``
    (the test x test kernel).
    """
    kinks = row_kinks(probe, start, direction, X, np.arange(X.shape[0]))
    return piecewise_gauss(np.concatenate(kinks) if kinks else np.array([]), n_nodes)
