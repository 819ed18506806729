"""The :class:`~._context.ExplanationContext` of a fitted estimator."""

import numpy as np
from sklearn.utils.validation import check_is_fitted, validate_data

from .._engine import as_tensor
from ._context import ExplanationContext


def estimator_context(estimator):
    """The context of a fitted ``BasePathEstimator``: its engine, its training
    targets (labels or values), its classes and its outputs' names."""
    check_is_fitted(estimator)
    engine = estimator._engine()
    codes = estimator._fit_targets
    if estimator._loss.classifies:
        classes = estimator.classes_
        targets, names = classes[codes], tuple(str(c) for c in classes)
    else:
        classes = None
        targets = codes[:, 0] if codes.shape[1] == 1 else codes
        names = tuple(f"output {k}" for k in range(codes.shape[1]))

    def queries(X):
        X = validate_data(estimator, X, dtype=np.float64, reset=False)
        return as_tensor(X, estimator.device_)

    n_steps = engine.path.n_steps
    per_epoch = max(1, -(-n_steps // max(1, estimator.n_iter_)))
    return ExplanationContext(
        engine=engine,
        targets=targets,
        classes=classes,
        output_names=names,
        queries=queries,
        epochs=np.arange(n_steps) // per_epoch,
    )
