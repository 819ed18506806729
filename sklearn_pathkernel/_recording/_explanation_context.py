"""The :class:`~._context.ExplanationContext` of a recorded training run.

A :class:`~sklearn_pathkernel.Recording` knows its training targets only if the
recorder was given them (``TrainingRecorder(..., y=...)``), and its loss only if the
user states it (``loss=``: then counterfactual attribution and its retraining
certificate follow, :mod:`._counterfactual`; a regression loss makes a regressor).
It is a classifier when those targets are integer labels of a network with ``K >= 2`` outputs, each
label an output index in ``[0, K)`` (the convention of ``torch.nn.CrossEntropyLoss``:
output ``k`` is class ``k``); otherwise (real-valued or 2-d targets) a regressor.
"""

import numpy as np

from .._explain import ExplanationContext
from .._training import resolve_loss
from ._counterfactual import stated_run


def recording_context(recording):
    """The context of a :class:`~sklearn_pathkernel.Recording`: its float64 engine,
    its recorded targets, its classes (output indices) and its epochs (a new epoch
    where a training row is used again, :attr:`Recording.epochs_`)."""
    targets = recording.targets_
    if targets is None:
        raise ValueError(
            "Explanations need the training targets, which this recording does not hold: "
            "pass them to the recorder, TrainingRecorder(module, optimizer, X, y=y)."
        )
    engine = recording._engine()
    n_outputs = engine.n_outputs
    if targets.shape[0] != engine.n_train:
        raise ValueError(
            f"The recording holds {targets.shape[0]} targets for {engine.n_train} training rows."
        )
    classes = class_indices(targets, n_outputs)
    stated = recording.loss is not None
    if stated and not resolve_loss(recording.loss).classifies:
        classes = None  # (a regression loss stated: the targets are values)
    if classes is not None:
        names = tuple(str(c) for c in classes)
    else:
        names = tuple(f"output {k}" for k in range(n_outputs))
    return ExplanationContext(
        engine=engine,
        targets=targets,
        classes=classes,
        output_names=names,
        queries=recording._rows,
        epochs=recording.epochs_,
        training_run=(lambda: stated_run(recording).run) if stated else None,
        refit=(
            lambda sample_weight=None, loss_scale=1.0: stated_run(recording).refit(
                sample_weight, loss_scale
            )
        )
        if stated
        else None,
    )


def class_indices(targets, n_outputs):
    """``arange(K)`` when ``targets`` are integer labels in ``[0, K)`` of a network with
    ``K >= 2`` outputs (a classifier whose output ``k`` is class ``k``), else None."""
    if targets.ndim != 1 or n_outputs < 2 or targets.dtype.kind not in "iu":
        return None
    if targets.size and (targets.min() < 0 or targets.max() >= n_outputs):
        return None
    return np.arange(n_outputs)
