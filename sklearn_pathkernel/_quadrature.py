"""Quadrature along a training step for the test copy of input space.

The test-copy feature of step ``s`` is ``phi_s(x) = int_0^1 grad_w f(x; w_s(t)) dt``.
A rule is a list of *groups*: rows that share nodes ``t_q`` and weights ``nu_q``
on ``[0, 1]``. ``"exact"`` splits the step at each row's kinks and puts
Gauss-Legendre nodes on every smooth piece; ``"riemann"`` is the EPK paper's left
Riemann sum; ``"dpk"`` the single left point of the Discrete Path Kernel.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ._kinks import locate_kinks, switch_state


@dataclass
class NodeGroup:
    """Rows (indices into the batch) integrated with the same nodes and weights."""

    rows: np.ndarray
    nodes: np.ndarray
    weights: np.ndarray


@lru_cache
def gauss_legendre(n_nodes):
    """Gauss-Legendre nodes and weights on ``[0, 1]``."""
    nodes, weights = np.polynomial.legendre.leggauss(n_nodes)
    return 0.5 * (nodes + 1.0), 0.5 * weights


def piecewise_gauss(breakpoints, n_nodes):
    """Gauss-Legendre nodes on each piece of ``[0, 1]`` split at ``breakpoints``."""
    edges = np.unique(np.concatenate([[0.0], np.asarray(breakpoints, float), [1.0]]))
    base_nodes, base_weights = gauss_legendre(n_nodes)
    widths = np.diff(edges)
    keep = widths > 0
    nodes = (edges[:-1, None] + widths[:, None] * base_nodes)[keep].ravel()
    weights = (widths[:, None] * base_weights)[keep].ravel()
    return nodes, weights


def fixed_rule(quadrature, n_points):
    """Nodes and weights of the non-adaptive rules."""
    if quadrature == "dpk":
        return np.zeros(1), np.ones(1)
    if quadrature == "riemann":
        return np.arange(n_points) / n_points, np.full(n_points, 1.0 / n_points)
    raise ValueError(f"Unknown quadrature {quadrature!r}.")


def row_kinks(probe, start, direction, X, rows, grid):
    """Kinks of each row in ``rows`` along ``w(t) = start + t * direction``.

    ``grid`` (increasing, from 0 to 1) is where the pieces are first compared;
    kinks are then located between grid points whose pieces differ. A finer grid
    finds pairs of kinks that cancel between two coarse points.
    """
    if len(rows) == 0:
        return []
    states = [switch_state(probe, start + t * direction, X[rows], t) for t in grid]
    kinks = []
    for position, row in enumerate(rows):
        x = X[row : row + 1]

        def evaluate(t, x=x):
            return switch_state(probe, start + t * direction, x, t)

        found = list(grid[1:-1])
        for left, right in zip(states[:-1], states[1:], strict=True):
            found += locate_kinks(evaluate, left.row(position), right.row(position))
        kinks.append(np.array(sorted(found)))
    return kinks


def exact_groups(probe, start, direction, X, n_nodes, *, rows=None, grid=(0.0, 1.0), chunk=8):
    """Groups for the kink-splitting Gauss-Legendre rule.

    Rows that stay on one piece along the step share plain Gauss-Legendre nodes
    on ``[0, 1]``; the others are taken in chunks that share the union of their
    breakpoints (a finer partition of a smooth piece is still exact).
    """
    rows = np.arange(X.shape[0]) if rows is None else np.asarray(rows)
    grid = np.asarray(grid, dtype=float)
    first, last = (switch_state(probe, start + t * direction, X[rows], t) for t in grid[[0, -1]])
    if len(grid) == 2:
        smooth = first.same_piece(last).numpy()
    else:
        smooth = np.zeros(len(rows), dtype=bool)
    groups = []
    if smooth.any():
        groups.append(NodeGroup(rows[smooth], *gauss_legendre(n_nodes)))
    kinked = rows[~smooth]
    for begin in range(0, len(kinked), chunk):
        members = kinked[begin : begin + chunk]
        kinks = row_kinks(probe, start, direction, X, members, grid)
        groups.append(NodeGroup(members, *piecewise_gauss(np.concatenate(kinks), n_nodes)))
    return groups


def shared_exact_nodes(probe, start, direction, X, n_nodes):
    """One set of nodes valid for every row of ``X`` (the union of all kinks).

    Needed when two rows are integrated against each other at the same ``t``
    (the test x test kernel).
    """
    first = switch_state(probe, start, X, 0.0)
    last = switch_state(probe, start + direction, X, 1.0)
    kinked = np.flatnonzero(~first.same_piece(last).numpy())
    kinks = row_kinks(probe, start, direction, X, kinked, np.array([0.0, 1.0]))
    return piecewise_gauss(np.concatenate(kinks) if kinks else np.array([]), n_nodes)
