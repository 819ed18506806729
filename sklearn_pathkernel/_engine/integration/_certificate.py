"""The certificate of a step's quadrature, and the refinement of the rows that fail it.

By the chain rule, ``<phi_s(x), w_{s+1} - w_s> = f(x; w_{s+1}) - f(x; w_s)``
exactly; a quadrature's features miss it by their integration error. Per row,
:meth:`Certificate.check` measures ``max_k |f(w_{s+1}) - f(w_s) - <phi_s,
w_{s+1} - w_s>|`` (for a scalar target per row, ``T(f)`` in place of ``f``)
and holds it to the engine's ``certificate_tolerance``, or to the rounding
floor of the logits where that is larger (and, in float32, at least the
rounding of ``f`` itself: :func:`least_tolerance`). An adaptive rule
(:class:`._quadrature.KinkSplittingRule`) then integrates the failing rows again
(:meth:`Certificate.refine`): on finer kink grids (``REFINEMENT_GRIDS``), then
by bisecting their pieces until each piece passes its own certificate.

Cost: two forward passes of the rows per step (none when the kink search
computed both ends), one directional derivative of the features; for each
failing row, the kink search and nodes of each finer grid, then two forward
passes and the nodes of every piece per bisection level.
"""

import copy
from typing import NamedTuple

import numpy as np
import torch

from ._kinks import StepEnds
from ._quadrature import Nodes, gauss_on_pieces, pieces

#: ... unless rounding alone explains the miss: f(w_{s+1}) - f(w_s) is known only
#: to about eps * |logits|, so with large logits (a saturated softmax on unscaled
#: inputs: |logits| ~ 1e3) no quadrature can get below this many eps times the
#: largest logit.
ROUNDING_ULPS = 64
#: The kink grids a failing row is searched on again, coarse to fine.
REFINEMENT_GRIDS = tuple(np.linspace(0.0, 1.0, n) for n in (9, 65))
#: Last resort for rows whose certificate still fails (two kinks closer than the
#: grid, e.g. a squared distance plus bias touching zero, or a sharp but smooth
#: transition of a nearly saturated softmax): bisect their pieces until each
#: piece's own certificate passes, at most this deep and into at most this many
#: pieces per row (a row past the cap keeps its pieces; its certificate reports
#: the error).
MAX_BISECTIONS = 48
MAX_PIECES_PER_ROW = 512
#: A bisected piece passes at the tolerance over this (its row has many pieces).
PIECE_TOLERANCE_DIVISOR = 64


def rounding_floor(*scales):
    """Per row, the error that rounding alone can cause in ``f(b) - f(a)``.

    ``scales`` are the rows' largest absolute logits at the points compared.
    """
    return ROUNDING_ULPS * torch.finfo(scales[0].dtype).eps * sum(scales)


def least_tolerance(dtype, tolerance):
    """``tolerance``, or ``ROUNDING_ULPS`` eps of ``dtype`` where that is larger.

    In float32, rounding alone misses by about 1e-7 even where every logit is
    near zero (``f``, the log-probabilities, is not), so a float32 path is held
    to about 8e-6; float64 keeps ``tolerance`` (1e-11 and 1e-11 / 64 are above
    its 1.4e-14).
    """
    return max(tolerance, ROUNDING_ULPS * torch.finfo(dtype).eps)


class StepCheck(NamedTuple):
    """Per row, the certificate's error (ndarray) and the tolerance it is held to."""

    errors: np.ndarray
    tolerance: np.ndarray

    def failed(self):
        """Positions of the rows above their tolerance."""
        return np.flatnonzero(self.errors > self.tolerance)


class StepIntegral(NamedTuple):
    """A step's test copy for some rows: its node chunks, the features they make
    (:class:`~sklearn_pathkernel._engine._features.StepFeatures`) and their
    certificate."""

    chunks: list
    features: object
    check: StepCheck


class Certificate:
    """Checks a step's features against the network's own change, and refines.

    Parameters
    ----------
    probes : ThreadProbes
    steps : PathSteps
    tolerance : float
        The engine's ``certificate_tolerance``, in units of ``f``.
    """

    def __init__(self, probes, steps, tolerance):
        self.probes, self.steps, self.tolerance = probes, steps, tolerance
        self.targets = None

    def for_targets(self, targets):
        """This certificate for a scalar target per row of the ``X`` it will be
        given (a ``QueryTargets``): it compares ``T(f(w_{s+1})) - T(f(w_s))`` with
        the features' one output."""
        other = copy.copy(self)
        other.targets = targets
        return other

    def _values(self, f, rows=None):
        """``f`` (n, K), or its target values (n, 1) for the rows ``rows`` of ``X``."""
        if self.targets is None:
            return f
        return self.targets.values(f) if rows is None else self.targets.take(rows).values(f)

    def ends(self, step, X):
        """``f`` and the largest logit of each row of ``X`` at both ends of ``step``."""
        probe = self.probes.current()
        f_start, scale_start = probe.output_with_scale(step.start, X)
        f_end, scale_end = probe.output_with_scale(self.steps.weights(step.index + 1), X)
        return StepEnds(f_start, scale_start, f_end, scale_end)

    def check(self, step, X, features, ends=None):
        """Per row, ``max_k |f(w_{s+1}) - f(w_s) - <phi_s, w_{s+1} - w_s>|``.

        ``ends`` (from the kink search's passes at ``t = 0`` and ``t = 1``)
        saves two forward passes.
        """
        ends = self.ends(step, X) if ends is None else ends
        direction = self.probes.current().params(step.direction)
        change = self._values(ends.f_end) - self._values(ends.f_start)
        error = change - features.directional(direction)
        floor = rounding_floor(ends.scale_start, ends.scale_end)
        tolerance = torch.clamp(floor, min=least_tolerance(floor.dtype, self.tolerance))
        return StepCheck(error.abs().amax(1).cpu().numpy(), tolerance.cpu().numpy())

    def refine(self, step, X, rule, row_nodes, integral, n_nodes, outputs_per_pair, evaluator):
        """``integral`` (a :class:`StepIntegral`) again for the rows that fail its check.

        The failing rows are searched for kinks on each of ``REFINEMENT_GRIDS``
        in turn, then bisected (:meth:`bisected_nodes`); only they are evaluated
        again. ``row_nodes`` is the rule's first answer (its kinks and ends);
        ``evaluator`` evaluates nodes and makes features (the engine's test copy,
        or its ``GroupedNodes``: ``evaluate(step, X, nodes)``, ``features(chunks,
        n_rows, outputs_per_pair)``, ``without_rows(chunks, rows)``, and
        ``nodes_evaluator``, the test copy, whose node chunks bisection sums per
        piece).
        """
        chunks, features, check = integral
        kinks = list(row_nodes.kinks)
        for grid in (*REFINEMENT_GRIDS, None):  # None: bisection, the last resort
            failed = check.failed()
            if failed.size == 0:
                break
            if grid is None:
                failed_kinks = [kinks[r] for r in failed]
                nodes = self.bisected_nodes(
                    step, X, failed, failed_kinks, n_nodes, evaluator.nodes_evaluator
                )
            else:
                refined = rule.refined_nodes(self.probes.current(), step, X, failed, grid, n_nodes)
                nodes = refined.nodes
                for row, row_kinks in zip(failed, refined.kinks, strict=True):
                    kinks[row] = row_kinks
            kept = evaluator.without_rows(chunks, self.steps.on_device(failed))
            chunks = kept + evaluator.evaluate(step, X, nodes)
            features = evaluator.features(chunks, X.shape[0], outputs_per_pair)
            check = self.check(step, X, features, row_nodes.ends)
        return StepIntegral(chunks, features, check)

    def bisected_nodes(self, step, X, rows, kinks, n_nodes, evaluator):
        """Adaptive nodes: halve every piece whose own certificate fails.

        The pieces start as each row's kink partition (``kinks``, per row). The
        exact change of ``f`` over any piece ``[a, b]`` is known (two forward
        passes), so each piece is certified on its own; a piece holding an
        undetected kink, or a transition too sharp for its nodes, shrinks
        geometrically until its error is negligible. A piece passes below the
        tolerance over ``PIECE_TOLERANCE_DIVISOR`` or the rounding floor of its
        ends, whichever is larger; a row stops splitting at ``MAX_PIECES_PER_ROW``
        (so a row that rounding keeps from passing cannot split without end).
        """
        probe = self.probes.current()
        step_params = probe.params(step.direction)
        tolerance = least_tolerance(step.start.dtype, self.tolerance / PIECE_TOLERANCE_DIVISOR)
        on_device = self.steps.on_device
        pending = pieces(rows, kinks)
        done = []
        for depth in range(MAX_BISECTIONS + 1):
            piece_rows, a, b = pending
            if piece_rows.size == 0:
                break
            nodes = gauss_on_pieces(piece_rows, a, b, n_nodes)
            if depth == MAX_BISECTIONS:
                done.append(nodes)
                break
            # <integral over each piece, w_{s+1} - w_s>: the nodes' factors, summed per piece
            piece_of_node = on_device(np.repeat(np.arange(piece_rows.size), n_nodes))
            by_piece, offset = [], 0
            for chunk in evaluator.evaluate(step, X, nodes):
                size = chunk.weights.numel()
                by_piece.append(chunk._replace(rows=piece_of_node[offset : offset + size]))
                offset += size
            estimate = evaluator.features(by_piece, piece_rows.size).directional(step_params)
            # f at both ends of every piece, in one pass
            f_ab, scale_ab = probe.output_with_scale(
                step.start,
                X,
                step.direction,
                on_device(np.concatenate([a, b])),
                rows=on_device(np.concatenate([piece_rows, piece_rows])),
            )
            f_ab = self._values(f_ab, on_device(np.concatenate([piece_rows, piece_rows])))
            (f_a, f_b), (scale_a, scale_b) = f_ab.chunk(2), scale_ab.chunk(2)
            floor = torch.clamp(rounding_floor(scale_a, scale_b), min=tolerance)
            ok = ((f_b - f_a - estimate).abs().amax(1) <= floor).cpu().numpy()
            # Rows that would split into more pieces than the cap keep the ones they have.
            n_failing = np.bincount(piece_rows[~ok], minlength=X.shape[0])[piece_rows]
            ok |= 2 * n_failing > MAX_PIECES_PER_ROW
            done.append(nodes.take(np.repeat(ok, n_nodes)))
            bad_rows, bad_a, bad_b = piece_rows[~ok], a[~ok], b[~ok]
            middle = 0.5 * (bad_a + bad_b)
            pending = (
                np.concatenate([bad_rows, bad_rows]),
                np.concatenate([bad_a, middle]),
                np.concatenate([middle, bad_b]),
            )
        return Nodes.cat(done)


def without_rows(chunks, rows):
    """The evaluated node chunks without the nodes of ``rows``."""
    kept = []
    for chunk in chunks:
        keep = ~torch.isin(chunk.rows, rows)
        if keep.all():
            kept.append(chunk)
        elif keep.any():
            kept.append(
                type(chunk)(
                    chunk.rows[keep], chunk.weights[keep], [f.take(keep) for f in chunk.factors]
                )
            )
    return kept
