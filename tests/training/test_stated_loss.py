"""A user's loop with its loss stated: the check of the recorded output gradients,
and the run trained again by torch.optim.

Independent computations: the user's loop itself (its weights, and the same loop run
by hand with rows' weights moved and each batch's weighted mean); the recorded output
gradients of loops whose loss differs from the stated one only slightly.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import RecordingRefused, TrainingRecorder
from sklearn_pathkernel._training import (
    CrossEntropy,
    StatedLoss,
    check_output_gradients,
    loss_targets,
    resolve_loss,
    retrain,
)


def loop(weights=None, loss=None, accumulate=False, n_steps=6):
    """Adam over mini-batches of 4 (two micro-batches of 2 with ``accumulate``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X = torch.randn(12, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.01)
    recorder = TrainingRecorder(model, optimizer, X, y=y, loss="log_loss")
    for step in range(n_steps):
        rows = torch.arange(step % 3 * 4, step % 3 * 4 + 4)
        optimizer.zero_grad()
        parts = (rows[:2], rows[2:]) if accumulate else (rows,)
        for part in parts:
            out = model(X[part])
            recorder.rows(part)
            if weights is not None:
                w = weights[part]
                (F.cross_entropy(out, y[part], reduction="none") * w).sum().div(
                    weights[rows].sum()
                ).backward()
            elif loss is not None:
                loss(out, y[part]).backward()
            else:
                (F.cross_entropy(out, y[part]) / len(parts)).backward()
        optimizer.step()
    return recorder.finish(), model, X, y


def stated(recording):
    loss = StatedLoss(CrossEntropy(), lambda out: out)
    module = recording._float64_run().module
    y = loss_targets(recording.targets_, loss, 3, recording.X_train_.device)
    return loss, module, y


def test_retraining_is_the_loop():
    """Unchanged weights: the recorded run (<= 1e-13); moved: the loop run by hand
    with each batch's weighted mean (<= 1e-13)."""
    recording, _, X, _ = loop()
    loss, module, y = stated(recording)
    settings, path = recording.optimizer_settings_, recording.path_
    every = retrain(module, path, X, y, loss, settings, every_step=True)
    assert every.shape == path.weights.shape
    assert (every - path.weights).abs().max() <= 1e-13
    weights = np.ones(12)
    weights[[1, 5, 6]] = [0.0, 2.0, 0.7]
    final = retrain(module, path, X, y, loss, settings, sample_weight=weights)
    _, model, _, _ = loop(weights=torch.tensor(weights))
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert (final - mine).abs().max() <= 1e-13


def test_the_stated_loss_is_checked_to_rounding():
    recording, _, X, _ = loop(accumulate=True)  # micro-batch means, halved: the step's mean
    loss, module, y = stated(recording)
    difference = check_output_gradients(recording.path_, module, X, y, loss, torch.float64)
    assert difference <= 1e-14


@pytest.mark.parametrize("smoothing", [1e-3, 1e-6])
def test_a_slightly_different_loss_is_caught(smoothing):
    recording, _, X, _ = loop(
        loss=lambda out, y: F.cross_entropy(out, y, label_smoothing=smoothing)
    )
    loss, module, y = stated(recording)
    with pytest.raises(RecordingRefused, match="Step 0: the recorded output gradients"):
        check_output_gradients(recording.path_, module, X, y, loss, torch.float64)


def test_gradient_accumulation_without_averaging_is_refused():
    recording, _, X, _ = loop(loss=lambda out, y: F.cross_entropy(out, y), accumulate=True)
    with pytest.raises(RecordingRefused, match="2 times the stated ones"):
        recording.counterfactual(X[:1])


def test_loss_names_and_instances():
    assert isinstance(resolve_loss("log_loss"), CrossEntropy)
    own = CrossEntropy()
    assert resolve_loss(own) is own
    with pytest.raises(ValueError, match="must be a registered loss name"):
        resolve_loss("mse")
