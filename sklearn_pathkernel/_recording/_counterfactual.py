"""Counterfactual attribution of a recording: the run it differentiates and retrains.

A recording of a user's loop does not know its loss; stated by the user
(``TrainingRecorder(..., y=y, loss=...)``, or ``recording.loss`` later; with
``sample_weight=`` for a loop whose batch loss is the sample-weighted mean
:math:`\\sum_{i \\in B_s} \\omega_i l_i / \\sum_{j \\in B_s} \\omega_j`), it is
checked against the recorded output gradients (every step, to the run's rounding:
:func:`~sklearn_pathkernel._training.check_output_gradients`) and, with the
optimiser's settings the recorder kept, makes the
:class:`~sklearn_pathkernel._engine.TrainingRun` that counterfactual attribution
differentiates and the retraining that certifies it (:class:`StatedRun`).

Which run: a float64 recording's own recorded weights. A float32 recording's scores
are those of its float64 twin, the run trained again in float64 by ``torch.optim``
from the recorded :math:`w_0` with the recorded batches and settings and the stated
loss (checked to end within the float32 run's rounding bound of its final weights:
the sweep differentiates a run that reproduces itself step after step, which the
kernel's path, anchored at the float32 weights, does not need to be); its
``values`` are that run's targets.
"""

from dataclasses import dataclass

import torch

from .._engine import TrainingRun
from .._training import (
    RecordingRefused,
    StatedLoss,
    check_output_gradients,
    check_sample_weight,
    float64_twin,
    loss_targets,
    resolve_loss,
    retrain,
)

DTYPE = torch.float64


@dataclass(frozen=True)
class StatedRun:
    """A recording with its loss stated: what counterfactual attribution needs.

    Attributes
    ----------
    loss_spec : str or Loss
        The recording's ``loss`` as stated (with ``weights_spec``, the cache's key).
    weights_spec : array-like or None
        The recording's ``sample_weight`` as stated.
    run : TrainingRun
        The run the adjoint sweep differentiates.
    settings : OptimizerSettings
        The optimiser's settings at every step.
    gradient_difference : float
        The largest difference between the recorded output gradients and the stated
        loss's, relative to each step's scale (rounding).
    """

    loss_spec: object
    weights_spec: object
    run: TrainingRun
    settings: object
    gradient_difference: float

    def refit(self, sample_weight=None, loss_scale=1.0):
        """The run trained again by ``torch.optim`` with the rows' ``sample_weight``
        (None: the run's) and every loss scaled by ``loss_scale``: the final
        coordinates (the flat weights, and BatchNorm's running statistics after them)
        and the number of steps (the ``refit`` of the explanation context)."""
        run = self.run
        if sample_weight is None:
            sample_weight = run.sample_weight.cpu().numpy()
        final = retrain(
            run.module, run.path, run.X, run.y, run.loss, self.settings,
            sample_weight=sample_weight, loss_scale=loss_scale,
        )  # fmt: skip
        return final, run.path.n_steps


def _identity(out):
    return out


def stated_run(recording):
    """The :class:`StatedRun` of ``recording`` (built and checked once per stated loss)."""
    cached = recording._stated_cache
    if (
        cached is not None
        and cached.loss_spec is recording.loss
        and cached.weights_spec is recording.sample_weight
    ):
        return cached
    if recording.loss is None:
        raise ValueError(
            "Counterfactual attribution of a recording needs the loss its loop minimised: "
            "TrainingRecorder(module, optimizer, X, y=y, loss='log_loss') or "
            "recording.loss = ..."
        )
    settings = recording.optimizer_settings_
    if settings is None:
        raise RecordingRefused(
            "This recording does not hold its optimiser's settings (learning rates, betas, "
            "eps per parameter group), which counterfactual attribution needs: record the "
            "run again with this version's TrainingRecorder."
        )
    path = recording.path_
    run64 = recording._float64_run()
    module, replayed = run64.module, run64.path
    X = recording.X_train_.to(DTYPE)
    link = _identity if recording.link is None else recording.link
    loss = StatedLoss(resolve_loss(recording.loss), link)
    n_outputs = recording._engine().n_outputs
    y = loss_targets(recording.targets_, loss, n_outputs, X.device)
    sample_weight = check_sample_weight(recording.sample_weight, X.shape[0])
    difference = check_output_gradients(
        path, module, X, y, loss, recording.dtype, sample_weight=sample_weight
    )
    update = settings.update_map(DTYPE, X.device)
    if path.weights.dtype != DTYPE:
        replayed = float64_twin(
            module, path, replayed, X, y, loss, settings, sample_weight=sample_weight
        )
    run = TrainingRun(
        module=module,
        path=replayed,
        X=X,
        y=y,
        loss=loss,
        sample_weight=(
            torch.ones(X.shape[0], dtype=DTYPE, device=X.device)
            if sample_weight is None
            else torch.as_tensor(sample_weight, device=X.device)
        ),
        update=update,
        training_dtype=path.weights.dtype,
    )
    stated = StatedRun(recording.loss, recording.sample_weight, run, settings, difference)
    recording._stated_cache = stated
    return stated
