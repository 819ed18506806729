"""``Explainer``: the explanations of a fitted model, as one object.

Built from a fitted estimator or a ``Recording`` (captum and dattri users build
an attributor from a model; scikit-learn users keep the one-line methods of
:class:`~._mixin.ExplanationMixin`, which build one), with its options once:
the attribution (``method``), normalisation, the query tile size. Every
explanation is a method here, written against the
:class:`~._attributions.Attribution` protocol and the host's
:class:`~._context.ExplanationContext`, so a new explanation lands here and a
new attribution in ``_attributions``, never in a host class.
"""

from dataclasses import replace

import numpy as np

from ._attributions import attribution_of
from ._counterfactual import counterfactual_attribution
from ._explanation import Explanation
from ._over_time import attribute_over_time
from ._scoring import class_totals, path_norms
from ._streaming import StreamedTopK, influence_matrix, query_tiles
from ._targets import decomposition_targets, training_targets
from ._topk import check_k


class Explainer:
    """Explanations of a fitted model's predictions by its training points.

    Parameters
    ----------
    model : fitted estimator or Recording
        Any host of the explanation API (it supplies its own context).
    method : {"contributions", "counterfactual"} or Attribution, \
            default="contributions"
        What training points are ranked by. ``"contributions"``: the exact terms
        of ``decompose`` (what each point added in this run; they sum to the
        output). ``"counterfactual"``: the scores of ``counterfactual`` with the
        ``"output"`` target of every output (what retraining with each point
        weighted more would change); then ``bias`` and ``decay`` are NaN.
    normalize : bool, default=False
        Rank by ``s_i(x) / n_i``, each score over training point ``i``'s path
        norm (``sqrt`` of the path kernel's training-copy diagonal, linear in
        ``M``, computed once per engine and kept with it), as TracIn's cosine variant:
        points with large gradients no longer top every list.
        ``method="contributions"`` only.
    batch_size : int, default=64
        Queries scored at a time: ``8 batch_size M K`` bytes of scores. Inside a
        tile, the rows the engine integrates at once follow the memory their
        quadrature nodes take.
    hessian : bool or None, default=None
        For the counterfactual scores (``method="counterfactual"`` and
        :meth:`counterfactual`), as ``counterfactual``'s; the contributions do not
        use it.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_pathkernel import ExactPathKernelClassifier, Explainer
    >>> X, y = make_blobs(n_samples=40, centers=2, random_state=0)
    >>> clf = ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=5,
    ...                                 random_state=0).fit(X, y)
    >>> explainer = Explainer(clf, normalize=True)
    >>> explainer.explain(X[:2], k=3).proponent_indices.shape
    (2, 2, 3)
    """

    def __init__(
        self, model, *, method="contributions", normalize=False, batch_size=64, hessian=None
    ):
        self.model = model
        self.attribution = attribution_of(method, hessian)
        self.attribution.check_options(normalize=normalize)
        query_tiles(0, batch_size)  # a clear error for a bad batch_size, now
        self.method = self.attribution.name
        self.normalize = bool(normalize)
        self.batch_size = batch_size
        self.hessian = hessian

    # -- shared pieces ----------------------------------------------------------

    def _context(self):
        return self.model._explanation_context()

    def _transform(self, context):
        if not self.normalize:
            return None
        norms = path_norms(context.engine)
        return lambda scores: scores / norms[None, :, None]

    def _tiles(self, context, queries, targets=None):
        """``(slice, ScoreTile)`` of consecutive tiles of ``batch_size`` queries
        (of their ``targets``, a ``QueryTargets``, when given)."""
        for tile in query_tiles(queries.shape[0], self.batch_size):
            if targets is None:  # (attributions written before targets take two arguments)
                yield tile, self.attribution.tile(context, queries[tile])
            else:
                yield tile, self.attribution.tile(context, queries[tile], targets.take(tile))

    # -- explanations -----------------------------------------------------------

    def explain(self, X, k=10, *, target=None, y=None):
        """Top-``k`` proponents and opponents of every query, per output (or of one
        scalar target per query).

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        k : int, default=10
            Training points per query, output and side; at most ``M``.
        target : {"predicted", "output", "margin", "loss"}, array-like of int \
                of shape (n_queries,) or None, default=None
            Rank the training points for one scalar per query instead of every
            output, at the cost of one output (see ``decompose``'s ``target``):
            ``"predicted"``, the log-probability of the predicted class;
            ``"output"``, ``"margin"``, of the class ``y``; ``"loss"``, the loss at
            ``(x, y)``; an int array, that output per query. The result then has
            one output, named after the target. None (the default): every output,
            the explanation of each ``f_k``.
        y : array-like of shape (n_queries,) or (n_queries, n_outputs), default=None
            The queries' labels or values, for ``target``.

        Returns
        -------
        Explanation
            With ``to_frame()`` and ``plot()``. For the contributions it equals a
            stable sort of ``decompose(X, target=target, y=y).contributions``
            along the training axis.

        Notes
        -----
        Cost: that of the attribution on ``X`` (``decompose(X)`` for the
        contributions, of one output with a target; plus the path norms once,
        with ``normalize``), and ``O(n M K)`` for the selection.
        """
        context = self._context()
        k = check_k(k, context.n_train)
        queries = context.queries(X)
        targets = decomposition_targets(context, queries, target, y)
        n = queries.shape[0]
        K = context.engine.n_outputs if targets is None else 1
        tiles = self._tiles(context, queries, targets)
        top = StreamedTopK(k, self._transform(context)).run(tiles, n, K)
        mass = np.where(top.mass > 0, top.mass, 1.0)[..., None]
        predicted = (
            np.argmax(top.output, axis=1)
            if context.is_classifier and targets is None
            else np.zeros(n, dtype=int)
        )
        output_names = context.output_names if targets is None else (_target_name(target),)
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
            output_names=output_names,
            normalized=self.normalize,
            method=self.method,
            queries=queries.cpu().numpy().reshape(n, -1),
            training_rows=context.training_rows().reshape(context.n_train, -1),
        )

    def influence_matrix(self, X, *, columns=None, target=None, y=None, filename=None):
        """The scores of every training point for every query, streamed.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        columns : array-like of int, shape (n_queries,), or None
            One output per query (e.g. the predicted class's index): the result
            is (n_queries, M), computed as that output's scalar target (the work
            of one output, not ``K``); None keeps every output, (n_queries, M, K).
        target : {"predicted", "output", "margin", "loss"} or None, default=None
            One scalar per query instead (see :meth:`explain`): (n_queries, M),
            at the cost of one output. Not with ``columns``.
        y : array-like, default=None
            The queries' labels or values, for ``target``.
        filename : path-like or None
            Stream into a ``.npy`` file there (a ``numpy.memmap``, readable with
            ``np.load(filename, mmap_mode="r")``) instead of memory.

        Returns
        -------
        ndarray or numpy.memmap
        """
        if columns is not None and target is not None:
            raise ValueError("Give columns or target, not both.")
        context = self._context()
        queries = context.queries(X)
        n = queries.shape[0]
        targets = decomposition_targets(context, queries, target if columns is None else columns, y)
        if targets is None:
            return influence_matrix(
                self._tiles(context, queries),
                n,
                context.n_train,
                context.engine.n_outputs,
                columns=None,
                filename=filename,
                transform=self._transform(context),
            )
        return influence_matrix(
            self._tiles(context, queries, targets),
            n,
            context.n_train,
            1,
            columns=np.zeros(n, dtype=int),  # the target's one output
            filename=filename,
            transform=self._transform(context),
        )

    def class_contributions(self, X):
        """The scores summed over the training points of each class.

        Returns
        -------
        ndarray of shape (n_queries, n_classes, n_outputs)
            Entry ``[q, c, k]``: what the training points labelled ``classes_[c]``
            added to output ``k`` at query ``q``.
        """
        context = self._context()
        classes = context.require_classes("class_contributions")
        queries = context.queries(X)
        codes = context.label_codes()
        transform = self._transform(context)
        out = np.zeros((queries.shape[0], classes.size, context.engine.n_outputs))
        for tile, found in self._tiles(context, queries):
            scores = found.scores if transform is None else transform(found.scores)
            out[tile] = class_totals(scores, codes, classes.size)
        return out

    def self_influence(self, *, first_epoch=0, target=None):
        """Each training point's score for its own output, for mislabel and outlier
        detection.

        Parameters
        ----------
        first_epoch : int, default=0
            Keep only the terms of the gradients taken from this epoch on (the
            diagonal of :meth:`explain_over_time` summed over those epochs): late
            epochs weigh what the network still had to fit at the end.
            ``method="contributions"`` only.
        target : {"output", "margin", "loss", "predicted"}, array-like of int \
                of shape (M,) or None, default=None
            Score each training point for one scalar of its own instead of every
            output, at the cost of one output per point (see ``decompose``'s
            ``target``, with the point's own training label as ``y``):
            ``"output"``, a classifier's log-probability of the point's own label
            (what ``scores`` reads, without the other ``K - 1`` outputs' work; a
            regressor's output 0); ``"margin"``, its own label's margin;
            ``"loss"``, the training loss at ``(x_i, y_i)``; ``"predicted"``, the
            log-probability of its predicted class; an int array, that output per
            point. None (the default): every output.

        Returns
        -------
        SelfInfluence
            ``values`` (M, K): for the contributions, the diagonal of
            ``decompose(X_train).contributions`` (over the path norms with
            ``normalize``); for the counterfactual scores, each point's score for
            its own label (a classifier; the other columns NaN) or every output.
            With ``target``, ``values`` has shape (M, 1), one output named after
            the target, as ``explain(X, target=...)``'s: the diagonal of
            ``decompose(X_train, target=target, y=y_train).contributions`` (for
            ``"output"``, of a classifier, ``decompose(X_train).contributions[i, i,
            label_i]``), or the counterfactual scores of that target. (M, 1)
            rather than (M, K) with NaN in the other columns: a margin or a loss
            is no column of the outputs, and NaN columns would be read as
            measured. ``scores`` (M,) to rank by (with a target, the value,
            negated for the loss, which fitting lowers); ``detection_curve``,
            ``auc``, ``found_at``, ``to_frame`` and ``plot``.

        Notes
        -----
        Cost linear in ``M``, like a Gram diagonal: plain SGD integrates each
        point at the steps whose batch held it; momentum and Adam need
        ``psi_s(x_i)`` over every later step (``M S`` test copies, each of ``K``
        outputs, or of one with a target: a classifier's scores need only their
        label's, ``target="output"``, ``K`` times less work), the points'
        momentum buffers held in blocks of 1 GiB (a pass over the steps each);
        the counterfactual scores sweep ``M`` (a regressor without a target: ``M
        K``) adjoint vectors, ``batch_size`` at a time. Never the ``(M, M, K)``
        decomposition.
        """
        self.attribution.check_options(first_epoch=first_epoch)
        context = self._context()
        targets = training_targets(context, target)
        found = self.attribution.self_influence(context, first_epoch, self.batch_size, targets)
        if targets is not None:
            found = replace(found, output_names=(_target_name(target),))
        if not self.normalize:
            return found
        norms = path_norms(context.engine)
        # (every score is linear in its row's values, and the norms are positive)
        return replace(found, values=found.values / norms[:, None], scores=found.scores / norms)

    def explain_over_time(self, X, *, period="epoch", by_class=False, columns=None,
                          filename=None):  # fmt: skip
        """What each training point (or class) moved during each step or epoch.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        period : {"epoch", "step"}, default="epoch"
        by_class : bool, default=False
            Sum the training points of each class (classifiers only).
        columns : array-like of int, shape (n_queries,), or None
            One output per query (e.g. the predicted class's index): ``values``
            then has one output, that one, computed as a scalar target (one
            output's work per step, not ``K``); None keeps every output.
        filename : path-like or None
            Stream ``values`` into a ``.npy`` file there (a ``numpy.memmap``)
            instead of memory: ``batch_size`` queries are resolved at a time.

        Returns
        -------
        TimeAttribution
            ``values`` (n, P, G, K), or (n, P, G, 1) with ``columns``, summing over
            periods to ``decompose(X).contributions`` (or its per-class sums; over
            the path norms with ``normalize``). ``method="contributions"`` only:
            the other attributions do not split over the steps.
        """
        if not self.attribution.decomposes:
            raise ValueError(
                f"explain_over_time is for method='contributions' only, not {self.method!r}."
            )
        context = self._context()
        queries = context.queries(X)
        groups, names = None, None
        if by_class:
            names = context.require_classes("by_class=True")
            groups = context.label_codes()
        return attribute_over_time(
            context,
            context.engine.stepwise(),
            queries,
            period,
            groups,
            names,
            columns=columns,
            filename=filename,
            batch_size=self.batch_size,
            norms=path_norms(context.engine) if self.normalize else None,
        )

    def counterfactual(self, X, y=None, *, target="output", output=None, certify=0, h=1e-4,
                       random_state=0):  # fmt: skip
        r"""How each training point's weight moves each query's target, through
        the whole recorded run: the prediction with other data, to first order.

        With :math:`\omega_i` point ``i``'s sample weight and :math:`T(x)` the
        query's scalar target at the trained weights,
        ``scores[q, i]`` :math:`= \partial T(x_q) / \partial \log \omega_i`,
        exactly (an adjoint sweep backward over the recorded steps, through the
        optimiser's exact update: momentum's buffer and Adam's moments included).
        ``T - scores[q, i]`` estimates the target refitted without point ``i``
        (:meth:`CounterfactualAttribution.loo_predictions`). The explainer's
        ``hessian`` applies; its ``method`` and ``normalize`` do not.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        y : array-like of shape (n_queries,) or (n_queries, n_outputs), default=None
            The queries' labels or values: a classifier's ``"output"`` and
            ``"margin"`` targets are its class (default: the predicted class);
            ``target="loss"`` needs them.
        target : {"output", "predicted", "margin", "loss"}, default="output"
            ``"output"``: :math:`f_c(x)`, a classifier's log-probability of class
            ``c``, a regressor's output ``c``; ``"predicted"``: that of the
            predicted class, whatever ``y`` says; ``"margin"``: :math:`\log p_c -
            \log(1 - p_c)` (classifiers); ``"loss"``: the training loss at
            ``(x, y)``.
        output : int or None, default=None
            The output ``c`` of every query (instead of ``y`` or the prediction).
        certify : int, default=0
            Training rows to check by real retraining (central differences of
            their sample weight, ``h``), and the sum of the scores by retraining
            with every loss scaled: ``2 certify + 3`` fits. Needs an int
            ``random_state`` and ``tol=None`` at fit (an estimator); a recording
            retrains its recorded run with a fresh ``torch.optim`` optimiser.
        h : float, default=1e-4
            Relative step of the finite differences.
        random_state : int, default=0
            Draws the rows checked.

        Returns
        -------
        CounterfactualAttribution
            ``scores`` (n, M), ``loss_weight_scores``, ``values`` (n,), the adjoint's
            growth along the run, ``replay_error`` and ``certificate``.

        Notes
        -----
        One adjoint vector per query: a scalar target costs one output, never
        ``K`` (the ``method="counterfactual"`` explanations without a target sweep
        ``K`` per query). Cost: a replay of the run (one gradient per step, keeping the optimiser's
        state: ``8 S n_state W`` bytes) and, per tile of ``batch_size`` queries,
        ``S`` steps of one forward pass of the batch and one backward and
        double-backward pass batched over the queries (memory about ``8
        batch_size (1 + n_state) W`` bytes): a few times ``decompose`` and the fit
        per query tile.
        """
        context = self._context()
        return counterfactual_attribution(
            context,
            context.queries(X),
            y=y,
            target=target,
            output=output,
            batch_size=self.batch_size,
            certify=certify,
            h=h,
            random_state=random_state,
            hessian=self.hessian,
        )


def _target_name(target):
    """The name of a target's one output in an explanation."""
    return target if isinstance(target, str) else "output"
