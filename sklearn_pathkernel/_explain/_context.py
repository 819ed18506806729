"""What an explanation needs of its host: the :class:`ExplanationContext` value object."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExplanationContext:
    """The fitted model an explanation reads, as its host hands it over.

    A host of :class:`~._mixin.ExplanationMixin` (an estimator, a recording of a
    user's training loop) returns one from ``_explanation_context()``.

    Attributes
    ----------
    engine : PathKernelEngine
        The exact path kernel engine of the recorded run.
    targets : ndarray of shape (M,) or (M, K)
        The training targets as the user gave them: labels for a classifier,
        values for a regressor (2-d, one column per output).
    classes : ndarray of shape (C,) or None
        The classes, in the order of the outputs; None for a regressor.
    output_names : tuple of str
        One name per output of the network (``f``'s columns).
    queries : callable
        ``queries(X)`` validates query rows and returns them as a tensor on the
        engine's device (a clear error for the wrong width).
    epochs : ndarray of shape (n_steps,)
        The epoch of every recorded step.
    training_run : callable or None
        ``training_run()`` returns the run as a
        :class:`~sklearn_pathkernel._engine._adjoint.TrainingRun` (loss, targets,
        sample weights, optimiser), what counterfactual attribution differentiates;
        None where the host does not know them.
    refit : callable or None
        ``refit(sample_weight=None, loss_scale=1.0)`` retrains from the same initial
        weights and batch order with other sample weights, or every loss scaled, and
        returns the final flat weights and the number of steps (the counterfactual
        certificate); None where the host cannot retrain.
    """

    engine: object
    targets: np.ndarray
    classes: np.ndarray | None
    output_names: tuple
    queries: Callable
    epochs: np.ndarray
    training_run: Callable | None = None
    refit: Callable | None = None

    @property
    def n_train(self):
        """M, the training points."""
        return self.engine.n_train

    @property
    def is_classifier(self):
        """Whether the outputs are classes."""
        return self.classes is not None

    def training_rows(self):
        """The training inputs as a host array (M, ...)."""
        return self.engine.X_train.cpu().numpy()

    def require_classes(self, what):
        """``classes``, or a clear error: a regressor has none."""
        if self.classes is None:
            raise ValueError(
                f"{what} needs classes, but this model is a regressor: its training "
                "targets are values, not classes."
            )
        return self.classes

    def label_codes(self):
        """Each training point's class as an output index (M,); classifiers only."""
        classes = self.require_classes("Class codes")
        return np.searchsorted(classes, self.targets)
