"""``ExplanationMixin``: the explanation API of every estimator (and recording).

The host implements ``_explanation_context()``, returning an
:class:`~._context.ExplanationContext`; everything else is here.
"""

from abc import abstractmethod

import numpy as np

from ._explanation import Explanation
from ._over_time import attribute_over_time
from ._scoring import class_totals, normaliser
from ._self_influence import self_influence
from ._streaming import StreamedTopK, influence_matrix, query_tiles
from ._topk import check_k


class ExplanationMixin:
    """Explanations of predictions by the training points that made them.

    Shaped after captum's ``TracInCP``: :meth:`explain` (top-k proponents and
    opponents), :meth:`self_influence` (mislabel detection), and what only an
    exact, every-step decomposition gives: :meth:`explain_over_time`.
    """

    @abstractmethod
    def _explanation_context(self):
        """The fitted model as an :class:`~._context.ExplanationContext`."""

    def explain(self, X, k=10, *, normalize=False, batch_size=64):
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
            Queries decomposed at a time: their contributions take ``8
            batch_size M K`` bytes. Inside a batch, the rows integrated at
            once follow the memory their quadrature nodes take (the engine's
            working budget, 1 GiB or a quarter of the available memory), so a
            large ``batch_size`` does not multiply that memory.

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
            queries=queries.cpu().numpy().reshape(queries.shape[0], -1),
            training_rows=context.training_rows().reshape(context.n_train, -1),
        )

    def self_influence(self, *, first_epoch=0):
        """Each training point's contribution to its own output, for mislabel
        and outlier detection.

        Parameters
        ----------
        first_epoch : int, default=0
            Keep only the terms of the gradients taken from this epoch on (the
            diagonal of :meth:`explain_over_time` summed over those epochs): late
            epochs weigh what the network still had to fit at the end.

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
        return self_influence(context, context.engine.stepwise(), first_epoch)

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
