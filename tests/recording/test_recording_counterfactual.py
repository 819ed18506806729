"""Counterfactual attribution of a user's own loop, its loss stated.

Independent computations: the estimators' own counterfactual scores of the same run
(same initial weights, batches and optimiser: the estimator's fit, matched by a hand
loop); central finite differences of the user's loop run again by hand with
``torch.optim`` and one row's loss weighted by ``1 +- h`` (the loop's own code, not the
package's retraining); the retraining certificate; the recorded output gradients of
loops whose loss is not the stated one.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _recorded_loops import run
from sklearn.datasets import make_blobs
from torch import nn

from sklearn_pathkernel import (
    ExactPathKernelClassifier,
    ExactPathKernelRegressor,
    RecordingRefused,
    TrainingRecorder,
)
from sklearn_pathkernel._path import log_softmax


def blobs(n=40):
    X, y = make_blobs(n, n_features=4, centers=3, random_state=0)
    return X / 4, y


def tanh_mlp(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def two_groups(model, first, rest):
    return [
        {"params": [model[0].weight], **first},
        {"params": [model[0].bias, model[2].weight, model[2].bias], **rest},
    ]


#: The user's optimisers: (optimiser of the model, scheduler of the optimiser or None).
LOOPS = {
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.2), None),
    "momentum-decay": (
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
        None,
    ),
    "nesterov-groups-step-lr": (
        lambda m: torch.optim.SGD(
            two_groups(m, {"lr": 0.05, "momentum": 0.5}, {"nesterov": True, "weight_decay": 0.02}),
            lr=0.1,
            momentum=0.9,
        ),
        lambda o: torch.optim.lr_scheduler.StepLR(o, 4, 0.5),
    ),
    "adam-lambda-lr": (
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.8, 0.95)),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + 0.1 * s)),
    ),
    "adamw-groups": (
        lambda m: torch.optim.AdamW(
            two_groups(m, {"lr": 0.02, "betas": (0.8, 0.95), "weight_decay": 0.1}, {"eps": 1e-6}),
            lr=0.01,
            weight_decay=0.05,
        ),
        None,
    ),
}


def user_loop(name, *, dtype=torch.float64, batch_size=10, epochs=3, weights=None, loss=None,
              y_recorded=None, stated="log_loss"):  # fmt: skip
    """The user's loop, recorded (``weights``: each row's loss weight, none when
    None; ``loss``: the loop's loss of (out, y), the mean cross-entropy by default).
    Returns the recording (None with ``weights``: then the final flat weights)."""
    recording, X, model = run_loop(
        name, tanh_mlp, dtype=dtype, batch_size=batch_size, epochs=epochs, weights=weights,
        loss=loss, y_recorded=y_recorded, stated=stated, record=weights is None,
    )  # fmt: skip
    return model if recording is None else (recording, X)


def run_loop(name, network, *, dtype=torch.float64, batch_size=10, epochs=3, weights=None,
             loss=None, y_recorded=None, stated="log_loss", record=True):  # fmt: skip
    """The loop of ``network(dtype)`` with optimiser ``LOOPS[name]``, recorded when
    ``record``; each row's loss weighted by ``weights`` when given. Returns the
    recording (or None), the inputs and the loop's own final model."""
    X, y = blobs()
    X, y = torch.tensor(X, dtype=dtype), torch.tensor(y)
    model = network(dtype)
    make_optimizer, make_scheduler = LOOPS[name]
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    recorder = None
    if record:
        recorded_y = y if y_recorded is None else y_recorded
        recorder = TrainingRecorder(model, optimizer, X, y=recorded_y, loss=stated)
    generator = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=generator)
        for start in range(0, X.shape[0], batch_size):
            rows = order[start : start + batch_size]
            optimizer.zero_grad()
            out = model(X[rows])
            if recorder is not None:
                recorder.rows(rows)
            if weights is not None:
                per_row = F.cross_entropy(out, y[rows], reduction="none")
                (per_row * weights[rows]).mean().backward()
            elif loss is not None:
                loss(out, y[rows]).backward()
            else:
                F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    return (None if recorder is None else recorder.finish()), X, model


def assert_hand_differences(result, X, queries, rerun, h, output=1):
    """Row 3's and row 17's ``loss_weight_scores`` are the central differences of
    ``rerun(weights)`` (the loop run again by hand with the rows' loss weights; returns
    its final model) to 1e-6 of each query's largest score, and not vacuous."""
    for row in (3, 17):
        targets = []
        for sign in (1, -1):
            weights = torch.ones(X.shape[0], dtype=X.dtype)
            weights[row] += sign * h
            model = rerun(weights).eval()
            with torch.no_grad():
                targets.append(model(queries)[:, output].numpy())
        difference = (targets[0] - targets[1]) / (2 * h)
        scale = np.abs(result.loss_weight_scores).max(axis=1)
        assert (np.abs(result.loss_weight_scores[:, row] - difference) <= 1e-6 * scale).all()
        assert np.abs(difference).max() > 1e-4  # the row moves the queries (not vacuous)


def test_a_recording_without_a_stated_loss_says_so():
    recording, X = user_loop("sgd", stated=None)
    with pytest.raises(ValueError, match="does not know its loss: state it"):
        recording.counterfactual(X[:1])


@pytest.mark.parametrize("name", LOOPS)
def test_scores_are_finite_differences_of_the_loop_run_again_by_hand(name):
    """loss_weight_scores[:, i] is dT/d eps_i with row i's loss weighted by 1 + eps in
    every batch (the batch mean held): the user's loop run again with that weight,
    central differences, <= 1e-6 relative. Every optimiser with its exact adjoint."""
    recording, X = user_loop(name)
    queries = X[:2]
    result = recording.counterfactual(queries, output=1, hessian=True)
    assert result.replay_error < 1e-13
    assert_hand_differences(
        result, X, queries, lambda weights: user_loop(name, weights=weights), h=1e-5
    )


@pytest.mark.parametrize("name", ["momentum-decay", "adamw-groups"])
def test_retraining_certificate_replays_the_loop(name):
    """certify=k retrains the recorded run by torch.optim with rows' weights moved."""
    recording, X = user_loop(name)
    result = recording.counterfactual(X[:2], target="margin", certify=3, hessian=True)
    certificate = result.certificate
    assert certificate.rows.shape == (3,)
    assert certificate.error <= 1e-6
    np.testing.assert_allclose(
        certificate.finite_differences, result.scores[:, certificate.rows], rtol=1e-6, atol=1e-9
    )


SOLVERS = {
    "sgd": (dict(solver="sgd", learning_rate=0.2), lambda p: torch.optim.SGD(p, lr=0.2)),
    "momentum": (
        dict(solver="sgd", learning_rate=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    "adam": (
        dict(solver="adam", learning_rate=0.01),
        lambda p: torch.optim.Adam(p, lr=0.01),
    ),
    "adamw": (
        dict(solver="adamw", learning_rate=0.01, weight_decay=0.05),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05),
    ),
}


def _estimator_as_a_loop(est, make_optimizer, X, y, loss, link=None, stated="log_loss"):
    """The estimator's run by hand: its initial weights, batches and optimiser."""
    model = est.module_
    with torch.no_grad():
        for name, value in est.path_.unflatten(est.path_.weights[0]).items():
            model.get_parameter(name).copy_(value)
    model.requires_grad_(True)
    optimizer = make_optimizer(model.parameters())
    recorder = TrainingRecorder(model, optimizer, X, y=y, loss=stated, link=link)
    for rows in est.path_.batches:
        optimizer.zero_grad()
        out = model(X[rows])
        if link is not None:
            out = link(out)
        recorder.rows(rows, output=out if link is not None else None)
        loss(out, y[rows]).backward()
        optimizer.step()
    recording = recorder.finish()
    assert (recording.path_.weights - est.path_.weights).abs().max() <= 1e-14
    return recording


@pytest.mark.parametrize("batch_size", [None, 10])
@pytest.mark.parametrize("solver", SOLVERS)
def test_classifier_scores_are_the_estimators(solver, batch_size):
    """The same run as an estimator's fit and as a user's loop: the same scores
    (<= 1e-10 relative), for the output (the loop's link is the estimator's
    log_softmax), the margin and the loss, with and without the Hessian term."""
    settings, make_optimizer = SOLVERS[solver]
    X, y = blobs()
    est = ExactPathKernelClassifier(
        hidden_layer_sizes=(6,), activation="tanh", max_iter=3, random_state=0,
        batch_size=batch_size, **settings,
    ).fit(X, y)  # fmt: skip
    Xt, yt = torch.tensor(X), torch.tensor(y)
    recording = _estimator_as_a_loop(est, make_optimizer, Xt, yt, F.nll_loss, link=log_softmax)
    for hessian in (True, False):
        for target, kwargs in [("output", dict(output=2)), ("margin", {}), ("loss", {})]:
            theirs = est.counterfactual(X[:3], y[:3], target=target, hessian=hessian, **kwargs)
            mine = recording.counterfactual(
                Xt[:3], y[:3], target=target, hessian=hessian, **kwargs
            )
            scale = np.abs(theirs.scores).max()
            assert np.abs(mine.scores - theirs.scores).max() <= 1e-10 * scale
            np.testing.assert_allclose(mine.values, theirs.values, rtol=1e-12)
            assert mine.hessian == theirs.hessian == hessian


def test_regressor_scores_are_the_estimators():
    """squared_error is half the mean squared error: ``0.5 * F.mse_loss`` in the loop."""
    rng = np.random.RandomState(0)
    X = rng.randn(20, 3)
    y = np.c_[np.sin(X[:, 0]), X[:, 1] * X[:, 2]]
    est = ExactPathKernelRegressor(
        hidden_layer_sizes=(5,), activation="tanh", solver="adam", learning_rate=0.02,
        max_iter=4, batch_size=7, random_state=0, weight_decay=0.01,
    ).fit(X, y)  # fmt: skip
    Xt, yt = torch.tensor(X), torch.tensor(y)
    recording = _estimator_as_a_loop(
        est,
        lambda p: torch.optim.Adam(p, lr=0.02, weight_decay=0.01),
        Xt,
        yt,
        lambda out, target: 0.5 * F.mse_loss(out, target),
        stated="squared_error",
    )
    for output in (0, 1):
        theirs = est.counterfactual(X[:3], output=output, hessian=True)
        mine = recording.counterfactual(Xt[:3], output=output, hessian=True)
        assert np.abs(mine.scores - theirs.scores).max() <= 1e-10 * np.abs(theirs.scores).max()


def test_explanations_take_the_counterfactual_scores():
    """The explanation API ranks a recording's counterfactual scores, and its
    counterfactual self-influence is each row's score for its own label."""
    recording, X = user_loop("sgd", epochs=2)
    explanation = recording.explain(X[:2], k=3, method="counterfactual")
    assert explanation.method == "counterfactual"
    for column in range(3):
        scores = recording.counterfactual(X[:2], output=column).scores
        np.testing.assert_array_equal(
            explanation.proponent_indices[:, column], np.argsort(-scores, 1, kind="stable")[:, :3]
        )
    own = recording.self_influence(method="counterfactual")
    _, y = blobs()
    scores = recording.counterfactual(X[:5], y[:5]).scores
    np.testing.assert_allclose(own.scores[:5], np.diagonal(scores[:, :5]), rtol=1e-10)


@pytest.mark.parametrize(
    "loss, match",
    [
        (lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1), "Step 0: the recorded"),
        (lambda out, y: F.cross_entropy(out, y, reduction="sum"), r"10 times the stated"),
        (
            lambda out, y: F.cross_entropy(out, y, weight=torch.tensor([1.0, 2.0, 1.0]).double()),
            "Step 0: the recorded output gradients are not those of the stated loss",
        ),
        (lambda out, y: 0.5 * F.mse_loss(out, F.one_hot(y, 3).double()), "Step 0"),
    ],
    ids=["label-smoothing", "sum", "class-weights", "another-loss"],
)
def test_a_loss_that_is_not_the_loops_is_refused(loss, match):
    recording, X = user_loop("momentum-decay", loss=loss, epochs=1)
    with pytest.raises(RecordingRefused, match=match):
        recording.counterfactual(X[:1])


def test_other_targets_are_refused():
    _, y = blobs()
    wrong = torch.tensor((y + 1) % 3)
    recording, X = user_loop("sgd", y_recorded=wrong, epochs=1)
    with pytest.raises(RecordingRefused, match="differ by .* relative to the step's scale"):
        recording.counterfactual(X[:1])


def test_a_regression_loss_needs_values():
    recording, X = user_loop("sgd", stated="squared_error", epochs=1)
    with pytest.raises(ValueError, match=r"target values of shape \(M, 3\)"):
        recording.counterfactual(X[:1])


def test_an_unknown_loss_is_refused_at_once():
    X, y = blobs()
    model = tanh_mlp()
    with pytest.raises(ValueError, match="registered loss name"):
        TrainingRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         torch.tensor(X), y=y, loss="cross_entropy")  # fmt: skip


def test_the_loss_may_be_stated_after_the_run():
    recording, X = user_loop("sgd", stated=None, epochs=1)
    recording.loss = "log_loss"
    assert recording.counterfactual(X[:1], output=0).scores.shape == (1, X.shape[0])


@pytest.mark.parametrize("name", ["momentum-decay", "adam-lambda-lr"])
def test_float32_loop(name):
    """A float32 loop: its loss checked to float32 rounding, the scores those of its
    float64 twin (the run trained again in float64), whose finite differences
    (certify) confirm them, and which ends within the run's rounding of the float32
    network."""
    recording, X = user_loop(name, dtype=torch.float32, epochs=2)
    result = recording.counterfactual(X[:2], output=0, certify=2, hessian=True)
    assert result.replay_error < 1e-13
    assert result.certificate.error <= 1e-6
    with torch.no_grad():
        own = recording.module_(X[:2])[:, 0].double().numpy()
    np.testing.assert_allclose(result.values, own, atol=1e-4)


def test_float32_loop_with_another_loss_is_refused():
    recording, X = user_loop(
        "momentum-decay", dtype=torch.float32, epochs=1,
        loss=lambda out, y: F.cross_entropy(out, y, label_smoothing=0.05),
    )  # fmt: skip
    with pytest.raises(RecordingRefused, match="rounding allows 6.1"):
        recording.counterfactual(X[:1])


def weighted_loop(weights, stated_weights, make_optimizer, est):
    """The estimator's run by hand with its sample weights: each batch's weighted mean."""
    X, y = blobs()
    Xt, yt = torch.tensor(X), torch.tensor(y)
    model = est.module_
    with torch.no_grad():
        for name, value in est.path_.unflatten(est.path_.weights[0]).items():
            model.get_parameter(name).copy_(value)
    model.requires_grad_(True)
    optimizer = make_optimizer(model.parameters())
    recorder = TrainingRecorder(
        model, optimizer, Xt, y=yt, loss="log_loss", link=log_softmax, sample_weight=stated_weights
    )
    w = torch.tensor(weights)
    for rows in est.path_.batches:
        optimizer.zero_grad()
        out = log_softmax(model(Xt[rows]))
        recorder.rows(rows, output=out)
        per_row = F.nll_loss(out, yt[rows], reduction="none")
        ((w[rows] * per_row).sum() / w[rows].sum()).backward()
        optimizer.step()
    return recorder.finish(), Xt


def test_sample_weighted_loop_is_the_estimators_weighted_fit():
    """A loop whose batch loss is the sample-weighted mean, its weights stated: the
    scores (d T / d log w_i) of the estimator fitted with those sample weights
    (<= 1e-10), certified by retraining; unstated, the loop is refused."""
    X, y = blobs()
    weights = np.random.RandomState(3).uniform(0.2, 2.0, len(y))
    settings, make_optimizer = SOLVERS["momentum"]
    est = ExactPathKernelClassifier(
        hidden_layer_sizes=(6,), activation="tanh", max_iter=3, random_state=0,
        batch_size=10, **settings,
    ).fit(X, y, sample_weight=weights)  # fmt: skip
    recording, Xt = weighted_loop(weights, weights, make_optimizer, est)
    assert (recording.path_.weights - est.path_.weights).abs().max() <= 1e-14
    theirs = est.counterfactual(X[:2], target="margin")
    mine = recording.counterfactual(Xt[:2], target="margin", certify=2)
    assert np.abs(mine.scores - theirs.scores).max() <= 1e-10 * np.abs(theirs.scores).max()
    assert mine.certificate.error <= 1e-6
    unstated, _ = weighted_loop(weights, None, make_optimizer, clone_fit(est, X, y, weights))
    with pytest.raises(RecordingRefused, match="Step 0: the recorded output gradients"):
        unstated.counterfactual(Xt[:1])
    with pytest.raises(ValueError, match=r"one weight per training row, shape \(40,\)"):
        TrainingRecorder(est.module_, torch.optim.SGD(est.module_.parameters(), lr=0.1), Xt,
                         y=torch.tensor(y), loss="log_loss", sample_weight=weights[:3])  # fmt: skip


def clone_fit(est, X, y, weights):
    from sklearn.base import clone

    return clone(est).fit(X, y, sample_weight=weights)


def with_dropout(dtype):
    torch.manual_seed(0)
    hidden = nn.Sequential(nn.Tanh(), nn.Dropout(0.3))
    return nn.Sequential(nn.Linear(4, 8), hidden, nn.Linear(8, 3)).to(dtype)


@pytest.mark.parametrize("name", ["momentum-decay", "adamw-groups"])
def test_a_loop_with_dropout_is_differentiated_with_its_masks(name):
    """The scores of a loop with dropout are the finite differences of the loop run
    again by hand with the same masks (<= 1e-6: the recorder draws them from torch's
    generator, seeded with the model, so every run recorded has the same masks),
    certified by retraining; the masks are really drawn (some units dropped)."""
    recording, X, _ = run_loop(name, with_dropout)
    masks = recording.path_.dropout_masks
    assert 0 < sum(float((~m).float().mean()) for step in masks for m in step.values())
    queries = X[:2]
    result = recording.counterfactual(queries, output=1, hessian=True, certify=2)
    assert result.replay_error < 1e-13
    assert result.certificate.error <= 1e-6

    def rerun(weights):
        again, _, model = run_loop(name, with_dropout, weights=weights)
        for step, step_masks in enumerate(again.path_.dropout_masks):
            for layer, mask in step_masks.items():
                assert torch.equal(mask, masks[step][layer])
        return model

    assert_hand_differences(result, X, queries, rerun, h=1e-5)


def test_a_float32_loop_with_dropout_is_its_float64_twin_with_the_masks():
    """A float32 loop with dropout: the float64 twin is trained with the recorded
    masks (else it would not end within the run's rounding and be refused)."""
    recording, X, _ = run_loop("momentum-decay", with_dropout, dtype=torch.float32)
    result = recording.counterfactual(X[:2], output=0, certify=2, hessian=True)
    assert result.certificate.error <= 1e-6


def with_batchnorm(dtype):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)
    ).to(dtype)


@pytest.mark.parametrize("name, h", [("momentum-decay", 1e-5), ("adam-lambda-lr", 3e-6)])
def test_a_loop_with_batchnorm_is_differentiated_through_its_running_statistics(name, h):
    """BatchNorm in training mode: the scores are the finite differences of the loop
    run again by hand (no recorder; the eval-mode model's output), <= 1e-6, and the
    retraining certificate agrees (Adam's differences are curved: a smaller h)."""
    recording, X, _ = run_loop(name, with_batchnorm)
    assert recording.path_.running_statistics is not None
    queries = X[:2]
    result = recording.counterfactual(queries, output=1, hessian=True, certify=2, h=h)
    assert result.replay_error < 1e-13
    assert result.certificate.error <= 1e-6
    assert_hand_differences(
        result, X, queries,
        lambda weights: run_loop(name, with_batchnorm, weights=weights, record=False)[2], h=h,
    )  # fmt: skip


def cumulative_batchnorm(dtype):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8, momentum=None), nn.Tanh(),
        nn.Linear(8, 3),
    ).to(dtype)  # fmt: skip


def one_batchnorm_frozen(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8, bias=False),
        nn.BatchNorm1d(8, affine=False), nn.Tanh(), nn.Linear(8, 3),
    ).to(dtype)  # fmt: skip
    with torch.no_grad():
        model[1].running_mean.add_(0.3)
    model[1].eval()  # (normalises by its running statistics, which stay)
    return model


@pytest.mark.parametrize("network", [cumulative_batchnorm, one_batchnorm_frozen])
def test_batchnorm_variants_are_certified_by_retraining(network):
    """``momentum=None`` (the cumulative average: retraining starts from the recorded
    count of batches) and a BatchNorm kept in eval mode beside one in training mode
    (without affine parameters)."""
    recording, X, _ = run_loop("adam-lambda-lr", network)
    result = recording.counterfactual(X[:2], output=1, hessian=True, certify=3, h=3e-6)
    assert result.replay_error < 1e-13
    assert result.certificate.error <= 1e-6


def test_a_float32_loop_with_batchnorm_is_its_float64_twin():
    """The float32 loop's twin is retrained with BatchNorm in training mode, its
    running statistics checked against the recorded ones like its weights."""
    recording, X, _ = run_loop("momentum-decay", with_batchnorm, dtype=torch.float32)
    result = recording.counterfactual(X[:2], output=0, certify=2, hessian=True, h=1e-5)
    assert result.certificate.error <= 1e-6


def test_a_convolutional_loop_with_batchnorm2d():
    """BatchNorm2d's statistics over rows and positions: certified by retraining."""
    rng = np.random.RandomState(0)
    X, y = torch.tensor(rng.randn(24, 1, 6, 6)), torch.tensor(rng.randint(0, 3, 24))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(),
        nn.Linear(64, 3),
    ).double()  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    recording = run(model, optimizer, X, y, stated="log_loss")
    result = recording.counterfactual(X[:2], output=1, certify=3, h=1e-5)
    assert result.replay_error < 1e-13
    assert result.certificate.error <= 1e-6
    assert np.abs(result.certificate.finite_differences).max() > 1e-4
