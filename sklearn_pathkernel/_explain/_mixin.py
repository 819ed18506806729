"""``ExplanationMixin``: the one-line explanation methods of every estimator (and
recording), each building an :class:`~._explainer.Explainer` of the host.

The host implements ``_explanation_context()``, returning an
:class:`~._context.ExplanationContext`; the explanations themselves live in the
explainer (a new one lands there, not here).
"""

from abc import abstractmethod

from ._explainer import Explainer


class ExplanationMixin:
    """Explanations of predictions by the training points that made them.

    Shaped after captum's ``TracInCP``: :meth:`explain` (top-k proponents and
    opponents), :meth:`self_influence` (mislabel detection), and what only an
    exact, every-step decomposition gives: :meth:`explain_over_time`; and what
    only the recorded path gives: :meth:`counterfactual`. Each is
    ``Explainer(self, ...)``'s method of the same name (see
    :class:`~sklearn_pathkernel.Explainer` for the options, the same on every
    method).
    """

    @abstractmethod
    def _explanation_context(self):
        """The fitted model as an :class:`~._context.ExplanationContext`."""

    def explain(
        self, X, k=10, *, target=None, y=None, normalize=False, batch_size=64,
        method="contributions",
    ):  # fmt: skip
        """Top-``k`` proponents and opponents of every query, per output (or of one
        scalar ``target`` per query, at the cost of one output):
        ``Explainer(self, method=method, normalize=normalize,
        batch_size=batch_size).explain(X, k, target=target, y=y)`` (see
        :meth:`Explainer.explain`).

        Returns
        -------
        Explanation
        """
        explainer = Explainer(self, method=method, normalize=normalize, batch_size=batch_size)
        return explainer.explain(X, k, target=target, y=y)

    def self_influence(
        self, *, first_epoch=0, target=None, normalize=False, method="contributions",
        batch_size=64, hessian=None,
    ):  # fmt: skip
        """Each training point's score for its own output (or, with ``target``, for
        one scalar of its own at the cost of one output, e.g. ``target="output"``:
        a classifier's own label's log-probability, all that ``scores`` reads),
        for mislabel and outlier detection: ``Explainer(self,
        ...).self_influence(first_epoch=first_epoch, target=target)`` (see
        :meth:`Explainer.self_influence`).

        Returns
        -------
        SelfInfluence
        """
        explainer = Explainer(
            self, method=method, normalize=normalize, batch_size=batch_size, hessian=hessian
        )
        return explainer.self_influence(first_epoch=first_epoch, target=target)

    def counterfactual(
        self, X, y=None, *, target="output", output=None, batch_size=64, certify=0, h=1e-4,
        random_state=0, hessian=None,
    ):  # fmt: skip
        """How each training point's weight moves each query's target, through the
        whole recorded run: ``Explainer(self, batch_size=batch_size,
        hessian=hessian).counterfactual(X, y, ...)`` (see
        :meth:`Explainer.counterfactual`).

        Returns
        -------
        CounterfactualAttribution
        """
        explainer = Explainer(self, batch_size=batch_size, hessian=hessian)
        return explainer.counterfactual(
            X, y, target=target, output=output, certify=certify, h=h, random_state=random_state
        )

    def explain_over_time(
        self, X, *, period="epoch", by_class=False, columns=None, filename=None,
        normalize=False, batch_size=64,
    ):  # fmt: skip
        """What each training point (or class) moved during each step or epoch:
        ``Explainer(self, normalize=normalize,
        batch_size=batch_size).explain_over_time(X, ...)`` (see
        :meth:`Explainer.explain_over_time`).

        Returns
        -------
        TimeAttribution
        """
        explainer = Explainer(self, normalize=normalize, batch_size=batch_size)
        return explainer.explain_over_time(
            X, period=period, by_class=by_class, columns=columns, filename=filename
        )

    def class_contributions(self, X, *, normalize=False, batch_size=64, method="contributions"):
        """The scores summed over the training points of each class:
        ``Explainer(self, ...).class_contributions(X)`` (see
        :meth:`Explainer.class_contributions`).

        Returns
        -------
        ndarray of shape (n_queries, n_classes, n_outputs)
        """
        explainer = Explainer(self, method=method, normalize=normalize, batch_size=batch_size)
        return explainer.class_contributions(X)

    def influence_matrix(
        self, X, *, columns=None, target=None, y=None, filename=None, normalize=False,
        batch_size=64, method="contributions",
    ):  # fmt: skip
        """The scores of every training point for every query, streamed:
        ``Explainer(self, ...).influence_matrix(X, columns=columns, target=target,
        y=y, filename=filename)`` (see :meth:`Explainer.influence_matrix`); with
        ``columns`` or ``target``, one output's work per query, not ``K``.

        Returns
        -------
        ndarray or numpy.memmap
        """
        explainer = Explainer(self, method=method, normalize=normalize, batch_size=batch_size)
        return explainer.influence_matrix(X, columns=columns, target=target, y=y, filename=filename)
