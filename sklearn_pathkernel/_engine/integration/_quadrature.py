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

# Points of the kink search evaluated in one forward pass (for all rows): the
# default grid's ends and the two points at a third and two thirds of the step;
# finer grids take several passes, which bounds a pass's memory to that of four
# evaluations of the rows.
POINTS_PER_PASS = 4
# Switching values sampled at u = 0, 1/3, 2/3, 1 of an interval are taken as
# polynomials in u (linear or quadratic) when the differences that vanish for
# such polynomials vanish to this fraction of the values' magnitude. Values are
# computed to a few eps (2.2e-16) of the terms they are summed from, so a true
# polynomial passes with a ~1000-fold margin wherever the values are at least
# ~1e-3 of those terms (others are searched instead: slower, equally exact); a
# function that passes deviates from its fitted polynomial by at most about this
# fraction of its values on the interval, so a root moves by about that much
# over the slope, which the certificate would see above ~1e-11.
POLYNOMIAL_RTOL = 1e-12


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


def piecewise_gauss(breakpoints, n_nodes):
    """Gauss-Legendre nodes on each piece of ``[0, 1]`` split at ``breakpoints``."""
    nodes = piecewise_nodes(np.zeros(1, int), [np.asarray(breakpoints, float)], n_nodes)
    return nodes.t, nodes.weights


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

    Each interval of ``grid`` is evaluated at its ends and thirds, in the same
    passes: switching values linear or quadratic in ``t`` there (a first layer's
    pre-activations, a first distance layer's outputs) have their kinks solved in
    closed form (:func:`_polynomial_switches`); the others are compared at the grid
    points, and located between grid points whose pieces differ. A finer grid finds pairs of kinks
    that cancel between two coarse points. Grid points are returned as
    breakpoints too (harmless: a finer partition of a smooth piece).
    Returns one sorted array of kinks per row.
    """
    rows = np.asarray(rows)
    n = rows.size
    X_rows = X[torch.as_tensor(rows, device=X.device)]

    def evaluate(subset, t):
        return switch_state(probe, start, direction, X_rows[subset], t)

    # The grid points and the thirds between them (which tell which switching values
    # are linear or quadratic in t), all rows at up to POINTS_PER_PASS points per pass.
    grid = np.asarray(grid, dtype=float)
    points = np.empty(3 * grid.size - 2)
    points[0::3] = grid
    points[1::3], points[2::3] = (2 * grid[:-1] + grid[1:]) / 3, (grid[:-1] + 2 * grid[1:]) / 3
    states = []
    for begin in range(0, points.size, POINTS_PER_PASS):
        part = points[begin : begin + POINTS_PER_PASS]
        t = torch.as_tensor(np.repeat(part, n), dtype=torch.float64, device=X.device)
        repeated = X_rows.repeat(part.size, *([1] * (X_rows.ndim - 1)))
        evaluated = switch_state(probe, start, direction, repeated, t)
        states += [evaluated.take(slice(j * n, (j + 1) * n)) for j in range(part.size)]
    if ends is not None:  # the rows' (log_proba, scale) at both ends of the step
        ends.extend([states[0].outputs, states[-1].outputs])

    # Kinks as flat (row position, t) pairs, the inner grid points first.
    kink_rows = [np.repeat(np.arange(n), grid.size - 2)]
    kink_t = [np.tile(grid[1:-1], n)]
    for begin in range(0, len(states) - 1, 3):
        left, right = states[begin], states[begin + 3]
        solved = _polynomial_switches(states[begin : begin + 4], kink_rows, kink_t)
        left, right = _without(left, solved), _without(right, solved)
        if left.same_piece(right).all():  # every kink was solved: nothing to search
            continue

        def evaluate_rest(subset, t, solved=solved):
            return _without(evaluate(subset, t), [mask[subset] for mask in solved])

        found = locate_kinks(evaluate_rest, left, right)
        kink_rows.append(np.repeat(np.arange(n), [len(row) for row in found]))
        kink_t.append(np.fromiter((t for row in found for t in row), float))
    if n == 0:
        return []
    kink_rows, kink_t = np.concatenate(kink_rows), np.concatenate(kink_t)
    order = np.lexsort((kink_t, kink_rows))
    bounds = np.searchsorted(kink_rows[order], np.arange(n + 1)).tolist()
    kink_t = kink_t[order]
    return [kink_t[begin:end] for begin, end in zip(bounds[:-1], bounds[1:], strict=True)]


def _polynomial_switches(states, kink_rows, kink_t):
    """Roots of the switching values that are linear or quadratic in ``t`` on an interval.

    ``states`` are the rows' states at ``u = 0, 1/3, 2/3, 1`` of their interval
    ``[lo, hi]`` (``t = lo + u (hi - lo)``), with values ``z_0 .. z_3`` per entry.
    A first layer's pre-activations are linear in ``t`` along a step, a first
    distance layer's outputs (a squared distance to memories that move linearly,
    plus a bias) quadratic, so their kinks follow from these four values at once
    (no search); they are appended to ``kink_rows`` (row positions) and ``kink_t``.

    An entry is linear when both interior values lie on the chord,
    ``|z_1 - (2 z_0 + z_3) / 3|`` and ``|z_2 - (z_0 + 2 z_3) / 3|`` at most
    ``POLYNOMIAL_RTOL (|z_0| + |z_3|)``; its root is ``u = z_0 / (z_0 - z_3)``.
    It is quadratic when the third difference, zero for every quadratic,
    vanishes: ``|z_3 - 3 z_2 + 3 z_1 - z_0| <= POLYNOMIAL_RTOL (|z_0| + 3 |z_1| +
    3 |z_2| + |z_3|)``. Then ``z(u) = a + b u + c u^2`` with the curvature from
    the mean of the two second differences (each ``2 c / 9``),
    ``c = 9 (z_3 - z_2 - z_1 + z_0) / 4``, and ``a = z_0``, ``b = z_3 - z_0 - c``
    through the ends (so that a sign change between the ends always has a root);
    its roots ``(-b -+ sqrt(b^2 - 4 a c)) / (2 c)`` are taken in the cancellation-free
    form ``q / c`` and ``a / q``, ``q = -(b + sign(b) sqrt(b^2 - 4 a c)) / 2``,
    and kept in ``(0, 1)``. Both crossings of a value that leaves its piece and
    comes back within the interval are found, which the end signs cannot show.

    Returns, per switch tensor, the mask of the solved entries (to be ignored by
    the search).
    """
    lo, hi = states[0].t, states[-1].t
    masks = []
    for z0, z1, z2, z3 in zip(*(state.switches for state in states), strict=True):
        ends = z0.abs() + z3.abs()
        linear = ((z1 - (2 * z0 + z3) / 3).abs() <= POLYNOMIAL_RTOL * ends) & (
            (z2 - (z0 + 2 * z3) / 3).abs() <= POLYNOMIAL_RTOL * ends
        )
        scale = ends + 3 * (z1.abs() + z2.abs())
        quadratic = ~linear & ((z3 - 3 * z2 + 3 * z1 - z0).abs() <= POLYNOMIAL_RTOL * scale)
        masks.append(linear | quadratic)
        row, unit = torch.nonzero(linear & ((z0 > 0) != (z3 > 0)), as_tuple=True)
        a, d = z0[row, unit], z3[row, unit]
        roots = [(row, a / (a - d))]
        row, unit = torch.nonzero(quadratic, as_tuple=True)
        a, c = z0[row, unit], 2.25 * (z3 - z2 - z1 + z0)[row, unit]
        roots += [(row, u) for u in _quadratic_roots(a, z3[row, unit] - a - c, c)]
        for row, u in roots:
            inside = (u > 0) & (u < 1)  # (nan and +-inf fail both tests)
            row, u = row[inside], u[inside]
            kink_rows.append(row.cpu().numpy())
            kink_t.append((lo[row] + (hi[row] - lo[row]) * u).cpu().numpy())
    return masks


def _quadratic_roots(a, b, c):
    """Both real roots of ``a + b u + c u^2`` per entry, cancellation-free.

    ``q = -(b + sign(b) sqrt(b^2 - 4 a c)) / 2`` and the roots ``q / c``, ``a / q``;
    nan where the roots are complex, inf for a missing root (``c = 0``).
    """
    discriminant = b * b - 4 * a * c
    root = torch.sqrt(discriminant)  # nan below 0: no real root
    q = -0.5 * (b + torch.where(b >= 0, root, -root))
    return q / c, a / q


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
    return piecewise_nodes(rows, found, n_nodes)


def shared_exact_nodes(probe, start, direction, X, n_nodes):
    """One set of nodes valid for every row of ``X`` (the union of all kinks).

    Needed when two rows are integrated against each other at the same ``t``
    (the test x test kernel).
    """
    kinks = row_kinks(probe, start, direction, X, np.arange(X.shape[0]))
    return piecewise_gauss(np.concatenate(kinks) if kinks else np.array([]), n_nodes)
