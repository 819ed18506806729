"""Self-influence: each training point's contribution to its own output.

``self_influence()[i, k] = c_i(x_i)_k``, the diagonal of
``decompose(X_train).contributions``, computed without the (M, M, K) array: see
``StepwiseDecomposition.self_influence`` (plain SGD: the steps whose batch holds
``i`` only, ``M`` times the epochs test copies; momentum and Adam: every step's
test copy of every row, ``M S``, and still no product with the other training
points), and the engine's ``self_influence`` for BatchNorm trained in training
mode (the diagonal of the training rows' decompositions). A training point the
network had to memorise (a flipped label, an outlier) pushes its own output far
more than the others: ranking by the score finds it.
"""

from dataclasses import dataclass

import numpy as np
from sklearn.metrics import roc_auc_score

from ._frames import pandas
from ._plotting import new_axes


@dataclass(frozen=True)
class SelfInfluence:
    """One score per training point, for mislabel and outlier detection.

    Attributes
    ----------
    values : ndarray of shape (M, K), or (M, 1) for a scalar target
        ``c_i(x_i)``: what training point ``i`` added to each output at itself
        (to its own target's value, with ``target=``).
    scores : ndarray of shape (M,)
        The ranking score: for a classifier the contribution to its own
        label's output (``values[i, label_i]``: how far it raised its own
        label's log-probability); for a regressor ``sum_k |values[i, k]|``.
        With a scalar target, ``values[:, 0]`` (``-values[:, 0]`` for the
        loss, which fitting lowers; ``|values[:, 0]|`` for a regressor's
        output).
    targets : ndarray of shape (M,) or (M, K)
        The training labels or values.
    output_names : tuple of str
    """

    values: np.ndarray
    scores: np.ndarray
    targets: np.ndarray
    output_names: tuple

    def ranking(self):
        """Training indices, highest score first (ties: smaller index first)."""
        return np.argsort(-self.scores, kind="stable")

    def _flagged(self, flagged):
        flagged = np.asarray(flagged)
        if flagged.dtype != bool or flagged.shape != self.scores.shape:
            raise ValueError(
                f"flagged must be a boolean mask of the {self.scores.shape[0]} training "
                f"points, got an array of dtype {flagged.dtype} and shape {flagged.shape}."
            )
        if not flagged.any():
            raise ValueError("flagged marks no training point.")
        return flagged

    def detection_curve(self, flagged):
        """Share of the ``flagged`` points found against the share inspected.

        Parameters
        ----------
        flagged : ndarray of bool, shape (M,)
            The points to find (e.g. the flipped labels).

        Returns
        -------
        inspected, found : ndarray of shape (M + 1,)
            After inspecting the top ``j`` points by score, ``j / M`` and the
            share of the flagged points among them (starting at 0, 0).
        """
        flagged = self._flagged(flagged)
        hits = np.r_[0, np.cumsum(flagged[self.ranking()])]
        return np.arange(hits.size) / self.scores.size, hits / flagged.sum()

    def found_at(self, flagged, fraction):
        """Share of the flagged points among the top ``fraction`` of the ranking."""
        inspected, found = self.detection_curve(flagged)
        return float(found[int(np.floor(fraction * self.scores.size + 1e-9))])

    def auc(self, flagged):
        """ROC AUC of the scores for telling the flagged points apart."""
        return float(roc_auc_score(self._flagged(flagged), self.scores))

    def to_frame(self):
        """A ``pandas.DataFrame``, one row per training point, highest score first:
        ``train_index``, ``score``, ``target`` and one column per output."""
        pd = pandas()
        order = self.ranking()
        frame = pd.DataFrame({"train_index": order, "score": self.scores[order]})
        targets = self.targets[order]
        frame["target"] = list(targets) if targets.ndim > 1 else targets
        for column, name in enumerate(self.output_names):
            frame[f"self_{name}"] = self.values[order, column]
        return frame

    def plot(self, flagged=None, *, ax=None):
        """The detection curve when ``flagged`` is given (with the random
        baseline), else the scores in ranking order."""
        ax = new_axes(ax, (4.5, 4))
        if flagged is None:
            ax.plot(np.arange(self.scores.size), self.scores[self.ranking()])
            ax.set_xlabel("training points, by rank")
            ax.set_ylabel("self-influence")
            return ax
        inspected, found = self.detection_curve(flagged)
        ax.plot(inspected, found, label=f"self-influence (AUC {self.auc(flagged):.3f})")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="random")
        ax.set_xlabel("share of the training set inspected")
        ax.set_ylabel("share of the flagged points found")
        ax.legend(loc="lower right")
        return ax


def self_influence(context, first_epoch=0, targets=None):
    """The :class:`SelfInfluence` of a context's training points, from its engine's
    ``self_influence()``, the gradients of epochs ``first_epoch`` on; with ``targets`` (a
    ``QueryTargets`` of the training rows), of each row's own scalar target at
    the cost of one output (:func:`scalar_self_influence`)."""
    epochs = np.asarray(context.epochs)
    if isinstance(first_epoch, bool) or not isinstance(first_epoch, int | np.integer):
        raise TypeError(f"first_epoch must be an int, got {type(first_epoch).__name__}.")
    n_epochs = int(epochs.max()) + 1 if epochs.size else 0
    if not 0 <= first_epoch < max(n_epochs, 1):
        raise ValueError(
            f"first_epoch={first_epoch} is out of range: the run has {n_epochs} epochs."
        )
    first_step = int(np.searchsorted(epochs, first_epoch))
    values = context.engine.self_influence(first_step, targets=targets)
    if targets is not None:
        return scalar_self_influence(context, values[:, 0], targets)
    if context.is_classifier:
        scores = values[np.arange(values.shape[0]), context.label_codes()]
    else:
        scores = np.abs(values).sum(axis=1)
    return SelfInfluence(values, scores, context.targets, context.output_names)


def scalar_self_influence(context, own, targets):
    """The :class:`SelfInfluence` of one scalar target per training row.

    Parameters
    ----------
    context : ExplanationContext
    own : ndarray of shape (M,)
        Row ``i``'s score for its own target :math:`T_i`.
    targets : QueryTargets
        The targets (``targets.target`` names the one output).

    Returns
    -------
    SelfInfluence
        ``values`` (M, 1), ``own``; ``scores`` oriented so that a point the
        network had to fit scores high: ``-own`` for a target fitting lowers (a
        loss), ``own`` for a classifier's output or margin, ``|own|`` for a
        regressor's output (fitting moves it either way).
    """
    if targets.target.lowered_by_fitting:
        scores = -own
    elif context.is_classifier:
        scores = own.copy()
    else:
        scores = np.abs(own)
    return SelfInfluence(own[:, None], scores, context.targets, (targets.target.name,))
