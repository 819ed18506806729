"""The :class:`~._context.ExplanationContext` of a fitted estimator."""

import numpy as np
import torch
from sklearn.base import clone
from sklearn.utils.validation import check_is_fitted, validate_data

from .._engine import TrainingRun, as_tensor
from .._explain import ExplanationContext
from .._path import with_running_statistics
from .._training import SolverSettings, float64_twin, retrain


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
        training_run=lambda: _training_run(estimator),
        refit=lambda sample_weight=None, loss_scale=1.0: _refit(
            estimator, targets, sample_weight, loss_scale
        ),
    )


def _sample_weight(estimator):
    """The fit's sample weights (ones for a model pickled before they were kept)."""
    weights = estimator.__dict__.get("_fit_sample_weight")
    return np.ones(estimator._fit_X.shape[0]) if weights is None else weights


def _training_run(estimator):
    """The fitted run as a ``TrainingRun``: what counterfactual attribution differentiates."""
    X = estimator._fit_X
    run64 = estimator._float64_run()  # (the float64 network and path the engine explains)
    return TrainingRun(
        module=run64.module,
        path=_differentiated_path(estimator),
        X=X,
        y=torch.as_tensor(estimator._fit_targets, device=X.device),
        loss=estimator._loss,
        sample_weight=torch.as_tensor(_sample_weight(estimator), dtype=X.dtype, device=X.device),
        update=SolverSettings.of(estimator).update_map(run64.path.learning_rates),
        training_dtype=estimator.path_.weights.dtype,
    )


def _differentiated_path(estimator):
    """The run counterfactual attribution differentiates: the fitted path of a
    float64 fit; of a float32 fit its float64 twin (the run trained again in float64
    by ``torch.optim`` from the recorded :math:`w_0`, with the recorded batches,
    masks and learning rates, checked to end within the float32 run's rounding of
    the recorded weights; built once per fit), as for a recording. Its retraining
    certificate then retrains the twin, whose finite differences are float64's, not
    float32 rounding divided by ``h``."""
    run64 = estimator._float64_run()
    if estimator.path_.weights.dtype == torch.float64:
        return run64.path
    cache = estimator.__dict__.get("_twin_cache")
    if cache is None:
        X = estimator._fit_X
        cache = estimator.__dict__["_twin_cache"] = float64_twin(
            run64.module,
            estimator.path_,
            run64.path,
            X,
            torch.as_tensor(estimator._fit_targets, device=X.device),
            estimator._loss,
            SolverSettings.of(estimator).schedule(run64.path.learning_rates),
            sample_weight=_sample_weight(estimator),
        )
    return cache


def _refit(estimator, targets, sample_weight, loss_scale):
    """The final coordinates (the flat weights, and BatchNorm's running statistics
    after them, as ``TrainingRun.weights``) and number of steps of the estimator
    refitted (same settings, seed and data) with ``sample_weight`` (None: the fit's)
    and every loss scaled by ``loss_scale`` (through the solver's parameters). A
    float32 fit's float64 twin is trained again instead (see
    :func:`_differentiated_path`)."""
    if sample_weight is None:
        sample_weight = _sample_weight(estimator)
    if estimator.path_.weights.dtype != torch.float64:  # the float64 twin, trained again
        run = _training_run(estimator)
        schedule = SolverSettings.of(estimator).schedule(run.path.learning_rates)
        final = retrain(
            run.module, run.path, run.X, run.y, run.loss, schedule,
            sample_weight=sample_weight, loss_scale=loss_scale,
        )  # fmt: skip
        return final, run.path.n_steps
    params = {}
    if loss_scale != 1.0:
        step = SolverSettings.of(estimator).update_map([])
        params = step.loss_scaling(loss_scale, estimator.get_params())
    X = estimator._fit_X.cpu().numpy()
    refitted = clone(estimator).set_params(**params).fit(X, targets, sample_weight=sample_weight)
    path = refitted._float64_run().path  # (a float32 refit's float64 replay)
    return with_running_statistics(path).weights[-1].clone(), path.n_steps
