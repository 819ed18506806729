"""Kinks: where each row's gradient jumps along a step.

Along ``w(t) = w_s + t (w_{s+1} - w_s)`` the gradient of a piecewise-linear
network is smooth between the points where a switching value (see
:mod:`._switches`) changes sign. Any quadrature across such a jump converges only
as O(1/T); splitting the step at the kinks and integrating each smooth piece with
Gauss-Legendre (:mod:`._quadrature`) is exact to machine precision with a
handful of nodes.

:func:`row_kinks` evaluates every row at the ends and thirds of each interval of a
grid: switching values and max-pool windows linear or quadratic in ``t`` there (a
first layer's pre-activations, a first distance layer's outputs, a max-pool over
a first convolution) have their kinks solved in closed form, and between those
kinks the next layer's values are sampled again; what is left is located by
:func:`locate_kinks`, regula falsi on the first switching value to change sign,
for all rows and intervals at once.

Cost: one forward pass (no backward pass) of every row at the ends and thirds of
its pieces per level (one level for a network whose switching values are all
polynomials of degree <= 2 in ``t``, one more per layer whose values become so
between the kinks of the layers before it), plus, per kink left to the search, a
few passes of the intervals that have one, all intervals in the same passes
(regula falsi converges in a handful of iterations, bisection takes over where it
does not).
"""

from typing import NamedTuple

import numpy as np
import torch

from ._polynomials import fit_samples, quadratic_roots
from ._pool_switches import polynomial_pools
from ._switches import SwitchState, switch_state

#: Rows (pieces times sample points) of the kink search evaluated in one forward
#: pass: all rows and pieces of a step in one pass, unless a refinement grid makes
#: many (the switching values of a pass are held in memory at once).
ROWS_PER_PASS = 8192
#: Pieces split at their closed-form kinks and sampled again, at most this many
#: times in a row: a level per layer whose values are polynomials between the
#: kinks of the layers before it (degree <= 2: one moving layer below them).
MAX_LEVELS = 3
#: The switch states that the pieces of one group hold at once (their four samples,
#: as evaluated and as taken per sample). A level's pieces are searched in groups
#: of this size: a row with hundreds of kinks in a step (a convolutional network
#: with max-pooling: every ReLU and pooling window of every position switches) held
#: every piece's states at once, about 1 GB for one MNIST row of a 12.8k-weight CNN.
GROUP_STATE_BYTES = 64 * 2**20
#: A closed-form kink splits its piece only this fraction of the piece's width
#: inside it (at its ends it is the kink the piece was split at, found again).
SPLIT_MARGIN = 1e-9
#: Kinks of a row closer than this are one (the search brackets to 4e-13): a
#: piece narrower than it would add nothing to the integral.
KINK_MERGE = 1e-13
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

    Each interval of ``grid`` is a *piece*, evaluated at its ends and thirds, all
    rows and pieces in the same passes (:func:`sampled_pieces`): switching values
    and max-pool windows polynomial in ``t`` there (degree <= 2) have their kinks
    solved in closed form (:func:`polynomial_switches`,
    :func:`._pool_switches.polynomial_pools`). A piece where some other value
    changes, or is no polynomial, is split at its closed-form kinks and its
    sub-pieces evaluated again, up to ``MAX_LEVELS`` times: between a first
    layer's kinks the next layer's values are polynomials too (a convolution's
    max-pool over its ReLUs, a second layer's pre-activations). What is left
    changes sign between samples of a piece with no closed-form kink to split it
    at: :func:`locate_kinks` searches those intervals, all in the same passes. A
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
    X_rows = QueryRows(X, torch.as_tensor(rows, device=X.device))
    grid = np.asarray(grid, dtype=float)
    n_pieces = grid.size - 1
    piece_row = np.repeat(np.arange(n), n_pieces)
    lo, hi = np.tile(grid[:-1], n), np.tile(grid[1:], n)
    kink_rows, kink_t = [np.repeat(np.arange(n), grid.size - 2)], [np.tile(grid[1:-1], n)]
    searches, ends, piece_bytes = [], None, None
    settled = None  # per switch tensor and pool, whether solved on every piece so far
    for level in range(MAX_LEVELS + 1):
        if piece_row.size == 0:
            break
        # Level 0 (a piece per row and grid interval) at once: its states give the
        # bytes of a piece's samples, and the later levels' groups from them.
        size = piece_row.size if piece_bytes is None else GROUP_STATE_BYTES // piece_bytes
        pieces, level_settled = [], None
        for group in _groups(piece_row.size, max(1, size)):
            rows_g, lo_g, hi_g = piece_row[group], lo[group], hi[group]
            states = sampled_pieces(probe, start, direction, X_rows, rows_g, lo_g, hi_g)
            if level == 0:
                first = torch.arange(n, device=X.device) * n_pieces
                last = first + n_pieces - 1
                ends = StepEnds(*states[0].take(first).outputs, *states[-1].take(last).outputs)
                # (as evaluated and as taken per sample: twice the samples' states)
                piece_bytes = max(1, 2 * sum(_nbytes(state) for state in states) // rows_g.size)
            solved = closed_form_kinks(states, settled)
            level_settled = Settled.of(solved).both(level_settled)
            kink_rows.append(rows_g[solved.rows])
            kink_t.append(solved.t)
            if not solved.unsolved.any():  # every value in closed form: done
                continue
            # (solved values never change once masked)
            rest = [_without(state, solved.switches, solved.pools) for state in states]
            changes = np.stack(  # between consecutive samples
                [
                    (~left.same_piece(right)).cpu().numpy()
                    for left, right in zip(rest[:-1], rest[1:], strict=True)
                ]
            )
            inside = _inner_kinks(solved, lo_g, hi_g)
            split = (changes.any(0) | solved.unsolved) & (inside.counts > 0)
            if level == MAX_LEVELS:
                split[:] = False
            search = changes & ~split
            if search.any():
                searches.append(_SearchIntervals.of(rest, search, rows_g, solved))
            pieces.append(inside.pieces(split, rows_g, lo_g, hi_g))
        settled = level_settled
        piece_row, lo, hi = (
            (np.concatenate(part) for part in zip(*pieces, strict=True))
            if pieces
            else (piece_row[:0], lo[:0], hi[:0])
        )
    if n == 0:
        return KinkSearch([], ends)
    if searches:
        intervals = _SearchIntervals.cat(searches)

        def evaluate_rest(subset, t):
            state = X_rows.switch_state(probe, start, direction, intervals.rows[subset], t)
            return _without(
                state,
                [mask[subset] for mask in intervals.switches],
                [mask[subset] for mask in intervals.pools],
            )

        found = locate_kinks(evaluate_rest, intervals.left, intervals.right)
        kink_rows.append(np.repeat(intervals.rows.cpu().numpy(), [len(row) for row in found]))
        kink_t.append(np.fromiter((t for row in found for t in row), float))
    return KinkSearch(_by_row(n, np.concatenate(kink_rows), np.concatenate(kink_t)), ends)


def _groups(n_pieces, size):
    """Consecutive slices of ``size`` pieces (sorted by row, then ``lo``)."""
    return [slice(begin, min(begin + size, n_pieces)) for begin in range(0, n_pieces, size)]


def _nbytes(state):
    """Memory held by a :class:`SwitchState`'s tensors."""
    tensors = [state.t, *state.switches, *(part for pool in state.pools for part in pool)]
    return sum(tensor.nbytes for tensor in [*tensors, *(state.outputs or ())])


class QueryRows(NamedTuple):
    """Rows ``X[rows]`` of a step's queries ``X``: evaluated as such, their first
    layer comes from the step's products (``NetworkProbe.per_row``)."""

    X: torch.Tensor
    rows: torch.Tensor

    @property
    def device(self):
        return self.X.device

    def switch_state(self, probe, start, direction, subset, t):
        """:func:`switch_state` of the rows ``subset`` of these rows."""
        return switch_state(probe, start, direction, self.X, t, self.rows[subset])


def sampled_pieces(probe, start, direction, X_rows, piece_row, lo, hi):
    """Switch states of every piece ``[lo, hi]`` of row ``piece_row`` at ``u = 0,
    1/3, 2/3, 1``: four lists of states, one entry per piece.

    Points shared by pieces (a piece's end, the next one's start) are evaluated
    once; all of them in passes of at most ``ROWS_PER_PASS`` rows.
    """
    # Pieces come sorted by row, then lo: a piece starting where the one before
    # it (same row) ends shares that point. Each piece adds its thirds and end,
    # and its start unless shared: positions of its four samples in the points.
    shared = np.zeros(piece_row.size, dtype=bool)
    shared[1:] = (piece_row[1:] == piece_row[:-1]) & (lo[1:] == hi[:-1])
    count = 4 - shared
    offset = np.cumsum(count) - count
    own = offset + 1 - shared  # the first of the piece's own points after its start
    index = np.stack([np.where(shared, offset - 1, offset), own, own + 1, own + 2])
    total = int(count.sum())
    point_row, point_t = np.empty(total, dtype=np.int64), np.empty(total)
    for j, u in enumerate((0.0, 1 / 3, 2 / 3, 1.0)):
        point_row[index[j]] = piece_row
        point_t[index[j]] = lo if j == 0 else (hi if j == 3 else lo + (hi - lo) * u)
    inverse = torch.as_tensor(index.ravel(), device=X_rows.device)
    unique_rows = torch.as_tensor(point_row, device=X_rows.device)
    unique_t = torch.as_tensor(point_t, dtype=torch.float64, device=X_rows.device)
    parts = [
        X_rows.switch_state(probe, start, direction, unique_rows[part], unique_t[part])
        for part in (
            slice(begin, begin + ROWS_PER_PASS) for begin in range(0, total, ROWS_PER_PASS)
        )
    ]
    evaluated = parts[0] if len(parts) == 1 else SwitchState.cat(parts)
    size = piece_row.size
    return [evaluated.take(inverse[j * size : (j + 1) * size]) for j in range(4)]


class ClosedFormKinks(NamedTuple):
    """Kinks solved in closed form on pieces (:func:`closed_form_kinks`).

    Attributes
    ----------
    switches, pools : list of torch.Tensor
        Per switch tensor and max-pool, the mask of its entries (windows) solved.
    unsolved : ndarray of bool
        Per piece, whether some entry is not solved.
    rows, t : ndarray
        Piece position and point along the step of every kink found.
    """

    switches: list
    pools: list
    unsolved: np.ndarray
    rows: np.ndarray
    t: np.ndarray


class Settled(NamedTuple):
    """Per switch tensor and per max-pool, whether every entry was solved in closed
    form on every piece of a level of :func:`row_kinks`: the next level's pieces
    lie inside those, where the same polynomials have no kinks but the ones found
    already, so they are not fitted again (a first layer's pre-activations are
    linear along the whole step)."""

    switches: list
    pools: list

    @classmethod
    def of(cls, solved):
        """From a level's :class:`ClosedFormKinks`."""
        return cls(
            [bool(mask.all()) for mask in solved.switches],
            [bool(mask.all()) for mask in solved.pools],
        )

    def both(self, other):
        """Settled here and in ``other`` (the pieces of two groups of a level; None:
        no other group)."""
        if other is None:
            return self
        return Settled(
            [a and b for a, b in zip(self.switches, other.switches, strict=True)],
            [a and b for a, b in zip(self.pools, other.pools, strict=True)],
        )


def closed_form_kinks(states, settled=None):
    """The kinks of the switching values and max-pool windows polynomial on their
    pieces, from the states at ``u = 0, 1/3, 2/3, 1`` (see :func:`polynomial_switches`
    and :func:`._pool_switches.polynomial_pools`); those ``settled`` (a
    :class:`Settled` of the pieces these lie in, or None) are solved without a fit
    and have no kinks inside the pieces."""
    switches = polynomial_switches(states, None if settled is None else settled.switches)
    pools = polynomial_pools(states, POLYNOMIAL_RTOL, None if settled is None else settled.pools)
    unsolved = torch.zeros(states[0].t.shape[0], dtype=torch.bool, device=states[0].t.device)
    for mask in (*switches.solved, *pools.solved):
        unsolved |= ~mask.flatten(1).all(1)
    return ClosedFormKinks(
        switches.solved,
        pools.solved,
        unsolved.cpu().numpy(),
        np.concatenate([switches.rows, pools.rows]),
        np.concatenate([switches.t, pools.t]),
    )


class _InnerKinks(NamedTuple):
    """The closed-form kinks strictly inside their pieces, and how many per piece."""

    rows: np.ndarray
    t: np.ndarray
    counts: np.ndarray

    def pieces(self, split, piece_row, lo, hi):
        """The sub-pieces ``(row, lo, hi)`` of the pieces ``split``, split at their kinks."""
        chosen = split[self.rows]
        parents = np.flatnonzero(split)
        edge_piece = np.concatenate([parents, self.rows[chosen], parents])
        edge_t = np.concatenate([lo[parents], self.t[chosen], hi[parents]])
        order = np.lexsort((edge_t, edge_piece))
        edge_piece, edge_t = edge_piece[order], edge_t[order]
        keep = (edge_piece[1:] == edge_piece[:-1]) & (edge_t[1:] - edge_t[:-1] > KINK_MERGE)
        return piece_row[edge_piece[:-1][keep]], edge_t[:-1][keep], edge_t[1:][keep]


def _inner_kinks(solved, lo, hi):
    """The kinks of ``solved`` at least ``SPLIT_MARGIN`` of their piece's width
    inside it (kinks at a piece's ends are those it was split at)."""
    rows, t = solved.rows, solved.t
    margin = SPLIT_MARGIN * (hi - lo)[rows]
    inside = (t > lo[rows] + margin) & (t < hi[rows] - margin)
    rows, t = rows[inside], t[inside]
    return _InnerKinks(rows, t, np.bincount(rows, minlength=lo.size))


class _SearchIntervals(NamedTuple):
    """Intervals left to :func:`locate_kinks`: their row (position in the search's
    rows), their masked states at both ends, and the solved masks of their piece."""

    rows: torch.Tensor
    left: SwitchState
    right: SwitchState
    switches: list
    pools: list

    @classmethod
    def of(cls, rest, search, piece_row, solved):
        sample, piece = np.nonzero(search)  # between samples ``sample`` and ``sample + 1``
        device = rest[0].t.device
        order = torch.as_tensor(sample * piece_row.size + piece, device=device)
        take = torch.as_tensor(piece, device=device)
        return cls(
            torch.as_tensor(piece_row[piece], device=device),
            SwitchState.cat(rest[:-1]).take(order),
            SwitchState.cat(rest[1:]).take(order),
            [mask[take] for mask in solved.switches],
            [mask[take] for mask in solved.pools],
        )

    @classmethod
    def cat(cls, parts):
        if len(parts) == 1:
            return parts[0]
        return cls(
            torch.cat([p.rows for p in parts]),
            SwitchState.cat([p.left for p in parts]),
            SwitchState.cat([p.right for p in parts]),
            [torch.cat(masks) for masks in zip(*(p.switches for p in parts), strict=True)],
            [torch.cat(masks) for masks in zip(*(p.pools for p in parts), strict=True)],
        )


def _by_row(n, rows, t):
    """Per row of ``n``, its sorted kinks ``t``, those within ``KINK_MERGE`` of the
    one before dropped (the same kink found twice: at a piece's ends and inside
    its parent)."""
    order = np.lexsort((t, rows))
    rows, t = rows[order], t[order]
    keep = np.ones(t.size, dtype=bool)
    keep[1:] = (rows[1:] != rows[:-1]) | (t[1:] - t[:-1] > KINK_MERGE)
    rows, t = rows[keep], t[keep]
    bounds = np.searchsorted(rows, np.arange(n + 1)).tolist()
    return [t[begin:end] for begin, end in zip(bounds[:-1], bounds[1:], strict=True)]


def polynomial_switches(states, settled=None):
    """Roots of the switching values that are linear or quadratic in ``t`` on an interval.

    ``states`` are the rows' states at ``u = 0, 1/3, 2/3, 1`` of their interval
    ``[lo, hi]`` (``t = lo + u (hi - lo)``), with values ``z_0 .. z_3`` per entry.
    A first layer's pre-activations are linear in ``t`` along a step, a first
    distance layer's outputs (a squared distance to memories that move linearly,
    plus a bias) quadratic, so their kinks follow from these four values at once
    (no search).

    Which entries are linear or quadratic, and their coefficients ``z(u) = a + b u
    + c u^2``, come from :func:`._polynomials.fit_samples` (at
    ``POLYNOMIAL_RTOL``); the roots (:func:`._polynomials.quadratic_roots`, in a
    cancellation-free form) are kept in ``(0, 1)``. Both crossings of a value
    that leaves its piece and comes back within the interval are found, which
    the end signs cannot show.

    ``settled`` (one bool per switch tensor, or None): tensors solved on the
    pieces these intervals lie in, taken as solved without kinks inside them.

    Returns
    -------
    PolynomialSwitches
        The masks of the solved entries and the kinks found.
    """
    lo, hi = states[0].t, states[-1].t
    masks, kink_rows, kink_t = [], [], []
    for index, samples in enumerate(zip(*(state.switches for state in states), strict=True)):
        if settled is not None and settled[index]:
            masks.append(torch.ones(samples[0].shape, dtype=torch.bool, device=lo.device))
            continue
        # values are computed to a few eps of the row's largest one (at best;
        # the largest at the ends stands for it)
        floor = torch.maximum(samples[0].abs().amax(1), samples[-1].abs().amax(1))
        fit = fit_samples(*samples, POLYNOMIAL_RTOL, floor[:, None])
        masks.append(fit.solved)
        # (a line has a root inside only if its ends' signs differ)
        crossing = fit.quadratic | (fit.linear & ((samples[0] > 0) != (samples[-1] > 0)))
        row, unit = torch.nonzero(crossing, as_tuple=True)
        for u in quadratic_roots(fit.a[row, unit], fit.b[row, unit], fit.c[row, unit]):
            inside = (u > 0) & (u < 1)  # (nan and +-inf fail both tests)
            row_in, u = row[inside], u[inside]
            kink_rows.append(row_in.cpu().numpy())
            kink_t.append((lo[row_in] + (hi[row_in] - lo[row_in]) * u).cpu().numpy())
    return PolynomialSwitches(
        masks,
        np.concatenate(kink_rows) if kink_rows else np.zeros(0, int),
        np.concatenate(kink_t) if kink_t else np.zeros(0),
    )


def _without(state, switch_masks, pool_masks=None):
    """The state with masked switching values replaced by a constant (never
    switching) and masked max-pool windows by a constant winner."""
    pools = state.pools
    if pool_masks is not None:
        pools = [
            (values, torch.where(mask, 0, indices))
            for (values, indices), mask in zip(state.pools, pool_masks, strict=True)
        ]
    return SwitchState(
        state.t,
        [torch.where(mask, 1.0, z) for z, mask in zip(state.switches, switch_masks, strict=True)],
        pools,
        windows=state.windows,
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
