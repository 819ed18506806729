"""``ExplanationMixin``: the explanation API of every estimator (and recording).

The host implements ``_explanation_context()``, returning an
:class:`~._context.ExplanationContext`; everything else is here.
"""

from abc import abstractmethod

import numpy as np

from ._counterfactual import counterfactual_attribution, counterfactual_outputs
from ._explanation import Explanation
from ._over_time import attribute_over_time
from ._scoring import class_totals, normaliser
from ._self_influence import self_influence
from ._streaming import StreamedTopK, influence_matrix, query_tiles
from ._topk import TopK, check_k

#: The attributions the explanation entry points take (``method=``).
METHODS = ("contributions", "counterfactual")


def _check_method(method):
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}.")
    return method


class ExplanationMixin:
    """Explanations of predictions by the training points that made them.

    Shaped after captum's ``TracInCP``: :meth:`explain` (top-k proponents and
    opponents), :meth:`self_influence` (mislabel detection), and what only an
    exact, every-step decomposition gives: :meth:`explain_over_time`.
    """

    @abstractmethod
    def _explanation_context(self):
        """The fitted model as an :class:`~._context.ExplanationContext`."""

    def explain(self, X, k=10, *, normalize=False, batch_size=64, method="contributions"):
        """Top-``k`` proponents and opponents of every query, per output.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        k : int, default=10
            Training points per query, output and side; at most ``M``.
        normalize : bool, default=False
            Rank by ``c_i(x) / n_i``, each contribution over training point
            ``i``'s path norm (``sqrt`` of the path kernel's training-copy
            diagonal, linear in ``M``), as TracIn's cosine variant: points with
            large gradients no longer top every list.
        batch_size : int, default=64
            Queries decomposed at a time: memory ``8 batch_size M K`` bytes.
        method : {"contributions", "counterfactual"}, default="contributions"
            ``"contributions"``: the exact terms of ``decompose`` (what each
            point added in this run). ``"counterfactual"``: the scores of
            :meth:`counterfactual` with the ``"output"`` target of every output
            (what retraining with each point weighted more would change; the
            top proponents are the points whose removal would lower the output
            most). Then ``bias`` and ``decay`` are NaN, and ``total`` is the
            scores' sum (0 up to rounding: scaling every sample weight alike
            changes nothing); ``normalize`` is not available.

        Returns
        -------
        Explanation
            With ``to_frame()`` and ``plot()``. Equals a stable sort of
            ``decompose(X).contributions`` along the training axis.

        Notes
        -----
        Cost: that of ``decompose(X)`` (plus the path norms once, with
        ``normalize``), and ``O(n M K)`` for the selection.
        """
        context = self._explanation_context()
        k = check_k(k, context.n_train)
        queries = context.queries(X)
        if _check_method(method) == "counterfactual":
            if normalize:
                raise ValueError("normalize=True is for method='contributions' only.")
            top = _CounterfactualTopK(context, k, batch_size).run(queries)
        else:
            transform = normaliser(context.engine) if normalize else None
            top = StreamedTopK(context.engine, k, batch_size, transform).run(queries)
        mass = np.where(top.mass > 0, top.mass, 1.0)[..., None]
        predicted = (
            np.argmax(top.output, axis=1)
            if context.is_classifier
            else np.zeros(queries.shape[0], dtype=int)
        )
        return Explanation(
            proponent_indices=top.proponents.indices,
            proponent_values=top.proponents.values,
            proponent_shares=top.proponents.values / mass,
            proponent_targets=context.targets[top.proponents.indices],
            opponent_indices=top.opponents.indices,
            opponent_values=top.opponents.values,
            opponent_shares=top.opponents.values / mass,
            opponent_targets=context.targets[top.opponents.indices],
            total=top.total,
            bias=top.bias,
            decay=top.decay,
            output=top.output,
            predicted=predicted,
            output_names=context.output_names,
            normalized=bool(normalize),
            method=method,
            queries=queries.cpu().numpy().reshape(queries.shape[0], -1),
            training_rows=context.training_rows().reshape(context.n_train, -1),
        )

    def self_influence(self, *, first_epoch=0, method="contributions", batch_size=64, hessian=None):
        """Each training point's contribution to its own output, for mislabel
        and outlier detection.

        Parameters
        ----------
        first_epoch : int, default=0
            Keep only the terms of the gradients taken from this epoch on (the
            diagonal of :meth:`explain_over_time` summed over those epochs): late
            epochs weigh what the network still had to fit at the end.
            ``method="contributions"`` only.
        method : {"contributions", "counterfactual"}, default="contributions"
            ``"counterfactual"``: each point's :meth:`counterfactual` score for its
            own output (a classifier: its own label's log-probability, the other
            columns of ``values`` NaN; a regressor: every output), each training
            row its own query: ``M`` (regressor: ``M K``) adjoint vectors swept
            over the run, ``batch_size`` at a time.
        batch_size : int, default=64
            Training rows per adjoint sweep (``method="counterfactual"``).
        hessian : bool or None, default=None
            As in :meth:`counterfactual` (``method="counterfactual"``).

        Returns
        -------
        SelfInfluence
            ``values`` (M, K), the diagonal of ``decompose(X_train).contributions``;
            ``scores`` (M,) to rank by; ``detection_curve``, ``auc``,
            ``found_at``, ``to_frame`` and ``plot``.

        Notes
        -----
        Cost linear in ``M``, like a Gram diagonal: plain SGD integrates each
        point at the steps whose batch held it (``M`` times the epochs test
        copies); momentum and Adam need ``psi_s(x_i)`` over every later step (``M
        S`` test copies). Never the ``(M, M, K)`` decomposition of the training rows.
        """
        context = self._explanation_context()
        if _check_method(method) == "counterfactual":
            if first_epoch != 0:
                raise ValueError("first_epoch is for method='contributions' only.")
            return counterfactual_self_influence(context, batch_size, hessian)
        return self_influence(context, context.engine.stepwise(), first_epoch)

    def counterfactual(
        self, X, y=None, *, target="output", output=None, batch_size=64, certify=0, h=1e-4,
        random_state=0, hessian=None,
    ):  # fmt: skip
        r"""How each training point's weight moves each query's target, through
        the whole recorded run: the prediction with other data, to first order.

        With :math:`\omega_i` point ``i``'s sample weight and :math:`T(x)` the
        query's scalar target at the trained weights,
        ``scores[q, i]`` :math:`= \partial T(x_q) / \partial \log \omega_i`,
        exactly (an adjoint sweep backward over the recorded steps, through
        the optimiser's exact update: momentum's buffer and Adam's moments
        included). ``T - scores[q, i]`` estimates the target refitted without
        point ``i`` (:meth:`CounterfactualAttribution.loo_predictions`).

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        y : array-like of shape (n_queries,) or (n_queries, n_outputs), default=None
            The queries' labels or values: a classifier's ``"output"`` and
            ``"margin"`` targets are its class (default: the predicted class);
            ``target="loss"`` needs them.
        target : {"output", "margin", "loss"}, default="output"
            ``"output"``: :math:`f_c(x)`, a classifier's log-probability of class
            ``c``, a regressor's output ``c``; ``"margin"``: :math:`\log p_c -
            \log(1 - p_c)` (classifiers); ``"loss"``: the training loss at
            ``(x, y)``.
        output : int or None, default=None
            The output ``c`` of every query (instead of ``y`` or the prediction).
        batch_size : int, default=64
            Queries per sweep: memory about ``8 batch_size (1 + n_state) W`` bytes
            plus ``batch_size |B|`` rows of activations per step (``n_state``: 0 for
            SGD, 1 with momentum, 2 for Adam).
        certify : int, default=0
            Training rows to check by real retraining (central differences of
            their sample weight, ``h``), and the sum of the scores by retraining
            with every loss scaled: ``2 certify + 3`` fits. Needs an int
            ``random_state`` and ``tol=None`` at fit.
        h : float, default=1e-4
            Relative step of the finite differences.
        random_state : int, default=0
            Draws the rows checked.
        hessian : bool or None, default=None
            ``True``: the exact derivative (every later step's gradient reacts to
            the earlier moves, a Hessian-vector product per step). ``False``: every
            step's gradient held at its recorded weights (the final target gradient
            carried back through the optimiser's exact update: no Hessian term).
            None: the optimiser family's rule, exact for SGD (with momentum,
            Nesterov, weight decay), without the Hessian for Adam and AdamW, whose
            exact adjoint grows by 1e4 to 1e6 along a run (see the user guide). The
            certificate checks the exact derivative: with ``hessian=False`` its error
            is how far the scores are from it.

        Returns
        -------
        CounterfactualAttribution
            ``scores`` (n, M), ``loss_weight_scores``, ``values`` (n,), the adjoint's
            growth along the run, ``replay_error`` and ``certificate``.

        Notes
        -----
        Cost: a replay of the run (one gradient per step, keeping the optimiser's
        state: ``8 S n_state W`` bytes) and, per tile of queries, ``S`` steps of one
        forward pass of the batch and one backward and double-backward pass batched
        over the queries: a few times ``decompose`` and the fit per query tile.
        """
        context = self._explanation_context()
        return counterfactual_attribution(
            context,
            context.queries(X),
            y=y,
            target=target,
            output=output,
            batch_size=batch_size,
            certify=certify,
            h=h,
            random_state=random_state,
            hessian=hessian,
        )

    def explain_over_time(self, X, *, period="epoch", by_class=False):
        """What each training point (or class) moved during each step or epoch.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        period : {"epoch", "step"}, default="epoch"
        by_class : bool, default=False
            Sum the training points of each class (classifiers only).

        Returns
        -------
        TimeAttribution
            ``values`` (n, P, G, K), summing over periods to
            ``decompose(X).contributions`` (or its per-class sums).
        """
        context = self._explanation_context()
        queries = context.queries(X)
        groups, names = None, None
        if by_class:
            names = context.require_classes("by_class=True")
            groups = context.label_codes()
        stepwise = context.engine.stepwise()
        return attribute_over_time(context, stepwise, queries, period, groups, names)

    def class_contributions(self, X, *, batch_size=64):
        """The contributions summed over the training points of each class.

        Returns
        -------
        ndarray of shape (n_queries, n_classes, n_outputs)
            Entry ``[q, c, k]``: what the training points labelled ``classes_[c]``
            added to output ``k`` at query ``q``.
        """
        context = self._explanation_context()
        classes = context.require_classes("class_contributions")
        queries = context.queries(X)
        codes = context.label_codes()
        out = np.zeros((queries.shape[0], classes.size, context.engine.n_outputs))
        for tile in query_tiles(queries.shape[0], batch_size):
            parts = context.engine.decompose(queries[tile])
            out[tile] = class_totals(parts.contributions, codes, classes.size)
        return out

    def influence_matrix(self, X, *, columns=None, filename=None, normalize=False, batch_size=64):
        """The contributions of every training point to every query, streamed.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        columns : array-like of int, shape (n_queries,), or None
            One output per query (e.g. the predicted class's index): the result
            is (n_queries, M); None keeps every output, (n_queries, M, K).
        filename : path-like or None
            Stream into a ``.npy`` file there (a ``numpy.memmap``, readable with
            ``np.load(filename, mmap_mode="r")``) instead of memory.
        normalize : bool, default=False
            As in :meth:`explain`.
        batch_size : int, default=64
            Queries decomposed at a time (the memory held besides the result).

        Returns
        -------
        ndarray or numpy.memmap
        """
        context = self._explanation_context()
        queries = context.queries(X)
        transform = normaliser(context.engine) if normalize else None
        return influence_matrix(
            context.engine,
            queries,
            columns=columns,
            filename=filename,
            batch_size=batch_size,
            transform=transform,
        )


class _CounterfactualTopK:
    """The fields of :class:`StreamedTopK` from counterfactual scores of every output."""

    def __init__(self, context, k, batch_size):
        self.context, self.k, self.batch_size = context, k, batch_size

    def run(self, queries):
        scores, self.output = counterfactual_outputs(self.context, queries, self.batch_size)
        self.mass = np.abs(scores).sum(axis=1)
        self.total = scores.sum(axis=1)
        self.bias = np.full_like(self.total, np.nan)
        self.decay = np.full_like(self.total, np.nan)
        self.proponents = TopK.of(scores, self.k)
        opponents = TopK.of(-scores, self.k)
        self.opponents = TopK(opponents.indices, -opponents.values)
        return self


def counterfactual_self_influence(context, batch_size, hessian=None):
    """The counterfactual :class:`SelfInfluence`: each training row's score for its
    own output (a classifier's own label; every output of a regressor)."""
    from ._self_influence import SelfInfluence

    rows = context.engine.X_train
    M, K = context.n_train, context.engine.n_outputs
    if context.is_classifier:
        codes = context.label_codes()
        found = counterfactual_attribution(
            context, rows, columns=codes, batch_size=batch_size, hessian=hessian
        )
        own = np.diagonal(found.scores).copy()
        values = np.full((M, K), np.nan)
        values[np.arange(M), codes] = own
        scores = own
    else:
        values, _ = counterfactual_outputs(context, rows, batch_size, True, hessian)
        scores = np.abs(values).sum(axis=1)
    return SelfInfluence(values, scores, context.targets, context.output_names)
