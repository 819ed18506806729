"""Kinks: where each row's gradient jumps along a step.

Along ``w(t) = w_s + t (w_{s+1} - w_s)`` the gradient of a piecewise-linear
network is smooth between the points where a switching value (see
:mod:`._switches`) changes sign. Any quadrature across such a jump converges only
as O(1/T); splitting the step at the kinks and integrating each smooth piece with
Gauss-Legendre (:mod:`._quadrature`) is exact to machine precision with a
handful of nodes.

:func:`row_kinks` evaluates every row at the ends and thirds of each interval of a
grid: switching values linear or quadratic in ``t`` there (a first layer's
pre-activations, a first distance layer's outputs) have their kinks solved in
closed form; the others are located by :func:`locate_kinks`, regula falsi on the
first switching value to change sign, for all rows at once.

Cost: one forward pass (no backward pass) of the rows per ``POINTS_PER_PASS``
points of the grid, plus, per kink left to the search, a few passes of the rows
that have one (regula falsi converges in a handful of iterations, bisection takes
over where it does not).
"""

from typing import NamedTuple

import numpy as np
import torch

from ._switches import SwitchState, switch_state

#: Points of the kink search evaluated in one forward pass (for all rows): the
#: default grid's ends and its two thirds; finer grids take several passes, so a
#: pass holds at most four evaluations of the rows.
POINTS_PER_PASS = 4
#: Switching values sampled at u = 0, 1/3, 2/3, 1 of an interval are taken as
#: polynomials in u (linear or quadratic) when the differences that vanish for
#: such polynomials vanish to this fraction of the values' magnitude. Values are
#: computed to a few eps (2.2e-16) of the terms they are summed from, so a true
#: polynomial passes with a ~1000-fold margin wherever the values are at least
#: ~1e-3 of those terms (others are searched instead: slower, equally exact); a
#: function that passes deviates from its fitted polynomial by at most about this
#: fraction of its values on the interval, so a root moves by about that much
#: over the slope, which the certificate would see above ~1e-11.
POLYNOMIAL_RTOL = 1e-12


class StepEnds(NamedTuple):
    """``f`` and the largest absolute logit of each row at both ends of a step."""

    f_start: torch.Tensor
    scale_start: torch.Tensor
    f_end: torch.Tensor
    scale_end: torch.Tensor


class KinkSearch(NamedTuple):
    """What :func:`row_kinks` finds.

    Attributes
    ----------
    kinks : list of ndarray
        Per row, its sorted breakpoints in ``(0, 1)``.
    ends : StepEnds
        The rows' ``f`` and scale at ``t = 0`` and ``t = 1``, from the search's
        own forward passes (the certificate reuses them).
    """

    kinks: list
    ends: StepEnds


class PolynomialSwitches(NamedTuple):
    """Kinks solved in closed form (:func:`polynomial_switches`).

    Attributes
    ----------
    solved : list of torch.Tensor
        Per switch tensor, the mask of its entries solved (ignored by the search).
    rows : ndarray
        Row position of every kink found.
    t : ndarray
        Its point along the step.
    """

    solved: list
    rows: np.ndarray
    t: np.ndarray


def row_kinks(probe, start, direction, X, rows, grid=(0.0, 1.0)):
    """Kinks of each row in ``rows`` along ``w(t) = start + t * direction``.

    Each interval of ``grid`` is evaluated at its ends and thirds, in the same
    passes: switching values linear or quadratic in ``t`` there have their kinks
    solved in closed form (:func:`polynomial_switches`); the others are compared
    at the grid points, and located between grid points whose pieces differ. A
    finer grid finds pairs of kinks that cancel between two coarse points. Grid
    points are returned as breakpoints too (harmless: a finer partition of a
    smooth piece).

    Returns
    -------
    KinkSearch
        One sorted array of kinks per row, and the rows' ends of the step.
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
    ends = StepEnds(*states[0].outputs, *states[-1].outputs)

    # Kinks as flat (row position, t) pairs, the inner grid points first.
    kink_rows = [np.repeat(np.arange(n), grid.size - 2)]
    kink_t = [np.tile(grid[1:-1], n)]
    for begin in range(0, len(states) - 1, 3):
        left, right = states[begin], states[begin + 3]
        polynomial = polynomial_switches(states[begin : begin + 4])
        kink_rows.append(polynomial.rows)
        kink_t.append(polynomial.t)
        solved = polynomial.solved
        left, right = _without(left, solved), _without(right, solved)
        if left.same_piece(right).all():  # every kink was solved: nothing to search
            continue

        def evaluate_rest(subset, t, solved=solved):
            return _without(evaluate(subset, t), [mask[subset] for mask in solved])

        found = locate_kinks(evaluate_rest, left, right)
        kink_rows.append(np.repeat(np.arange(n), [len(row) for row in found]))
        kink_t.append(np.fromiter((t for row in found for t in row), float))
    if n == 0:
        return KinkSearch([], ends)
    kink_rows, kink_t = np.concatenate(kink_rows), np.concatenate(kink_t)
    order = np.lexsort((kink_t, kink_rows))
    bounds = np.searchsorted(kink_rows[order], np.arange(n + 1)).tolist()
    kink_t = kink_t[order]
    kinks = [kink_t[begin:end] for begin, end in zip(bounds[:-1], bounds[1:], strict=True)]
    return KinkSearch(kinks, ends)


def polynomial_switches(states):
    """Roots of the switching values that are linear or quadratic in ``t`` on an interval.

    ``states`` are the rows' states at ``u = 0, 1/3, 2/3, 1`` of their interval
    ``[lo, hi]`` (``t = lo + u (hi - lo)``), with values ``z_0 .. z_3`` per entry.
    A first layer's pre-activations are linear in ``t`` along a step, a first
    distance layer's outputs (a squared distance to memories that move linearly,
    plus a bias) quadratic, so their kinks follow from these four values at once
    (no search).

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

    Returns
    -------
    PolynomialSwitches
        The masks of the solved entries and the kinks found.
    """
    lo, hi = states[0].t, states[-1].t
    masks, kink_rows, kink_t = [], [], []
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
    return PolynomialSwitches(
        masks,
        np.concatenate(kink_rows) if kink_rows else np.zeros(0, int),
        np.concatenate(kink_t) if kink_t else np.zeros(0),
    )


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


def _first_crossing(left, right):
    """Per row, the regula-falsi estimate of the first sign change in (left.t, right.t)."""
    lo, hi = left.t, right.t
    width = (hi - lo)[:, None]
    best = torch.full_like(lo, torch.inf)
    for a, b in zip(left.switches, right.switches, strict=True):
        changed = (a > 0) != (b > 0)
        if changed.any():
            estimate = torch.where(changed, lo[:, None] + width * a / (a - b), torch.inf)
            best = torch.minimum(best, estimate.amin(1))
    for (va, ia), (vb, ib) in zip(left.pools, right.pools, strict=True):
        changed = ia != ib
        if changed.any():
            # left winner minus right winner: >= 0 at lo, <= 0 at hi
            da = (va.gather(2, ia) - va.gather(2, ib)).flatten(1)
            db = (vb.gather(2, ia) - vb.gather(2, ib)).flatten(1)
            ok = changed.flatten(1) & (da - db > 0)
            estimate = torch.where(ok, lo[:, None] + width * da / (da - db), torch.inf)
            best = torch.minimum(best, estimate.amin(1))
    # No sign change seen (only a pool winner without a usable bracket): bisect.
    return torch.where(torch.isfinite(best), best.clamp(lo, hi), 0.5 * (lo + hi))


def locate_kinks(evaluate, left, right, *, tol=1e-13, max_iter=60, max_kinks=100_000):
    """Breakpoints of every row where it changes piece between ``left`` and ``right``.

    Parameters
    ----------
    evaluate : callable
        ``evaluate(rows, t) -> SwitchState`` of the given rows at per-row ``t``.
    left, right : SwitchState
        All rows' states at the ends of their intervals.
    tol : float
        Each breakpoint is bracketed to within ``4 * tol``.

    Returns
    -------
    list of list of float
        Increasing breakpoints per row; between consecutive ones the row stays on
        one linear piece (up to double crossings between ``left`` and ``right``,
        which the certificate reveals).
    """
    kinks = [[] for _ in range(left.t.shape[0])]
    current = left
    for _ in range(max_kinks):
        rows = torch.nonzero(~current.same_piece(right)).squeeze(1)
        if rows.numel() == 0:
            break
        a, b = current.take(rows), right.take(rows)
        for iteration in range(max_iter):
            width = b.t - a.t
            if not (width > 4 * tol).any():
                break
            t = _first_crossing(a, b)
            # Nudge estimates off the bracket's ends so that it closes from both
            # sides; a closed bracket just re-evaluates its right end.
            t = torch.minimum(torch.maximum(t, a.t + tol), b.t - tol)
            t = torch.where(width > 4 * tol, t, b.t)
            a, b = _split(evaluate, rows, a, b, t)
            if iteration >= 2:  # slow regula falsi somewhere: bisect those rows
                # (below ~1e3 tol the estimates are rounding noise: no point in bisecting)
                slow = (b.t - a.t > 0.5 * width) & (width > 1e3 * tol)
                if slow.any():
                    t = torch.where(slow, 0.5 * (a.t + b.t), b.t)
                    a, b = _split(evaluate, rows, a, b, t)
        for row, t in zip(rows.tolist(), b.t.tolist(), strict=True):
            kinks[row].append(t)
        current = current.put(rows, b)  # the states just past these kinks
    return kinks


def _split(evaluate, rows, a, b, t):
    middle = evaluate(rows, t)
    before = a.same_piece(middle)
    return a.where(before, middle), b.where(~before, middle)
