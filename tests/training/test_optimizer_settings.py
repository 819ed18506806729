"""The optimiser's settings kept per step of a user's loop, and what they make: the
step as a differentiable map (per-weight values where parameter groups differ) and a
fresh torch.optim optimiser.

Independent computations: torch.optim's own steps (the user's optimiser, with its
groups and scheduler) against the map run over the recorded gradients; the refusals
name what the map cannot be.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import RecordingRefused, TrainingRecorder


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(12, 3, dtype=torch.float64)
    y = (X[:, 0] > 0).long()
    return model, X, y


def groups(model, first, rest):
    return [
        {"params": [model[0].weight], **first},
        {"params": [model[0].bias, *model[2].parameters()], **rest},
    ]


OPTIMIZERS = {
    "sgd-groups": lambda m: torch.optim.SGD(
        groups(m, {"lr": 0.05, "momentum": 0.0}, {"nesterov": True, "weight_decay": 0.1}),
        lr=0.2, momentum=0.7,
    ),
    "adam-groups": lambda m: torch.optim.Adam(
        groups(m, {"betas": (0.5, 0.9), "weight_decay": 0.1}, {"eps": 1e-5}), lr=0.03
    ),
    "adam-decoupled": lambda m: torch.optim.Adam(
        m.parameters(), lr=0.03, weight_decay=0.2, decoupled_weight_decay=True
    ),
    "adamw-groups": lambda m: torch.optim.AdamW(
        groups(m, {"lr": 0.01, "weight_decay": 0.3}, {}), lr=0.03
    ),
}  # fmt: skip


def recorded_loop(make_optimizer, steps=6, edit=None):
    """A mini-batch loop with a cyclic scheduler; ``edit(optimizer, step)`` before
    a step. Returns the recording and each step's parameter gradients (flat)."""
    model, X, y = model_and_data()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 + 0.5 * (s % 2))
    recorder = TrainingRecorder(model, optimizer, X, y=y, loss="log_loss")
    gradients = []
    for step in range(steps):
        rows = torch.arange(step % 3 * 4, step % 3 * 4 + 4)
        if edit is not None:
            edit(optimizer, step)
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        gradients.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        optimizer.step()
        scheduler.step()
    return recorder.finish(), gradients


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_map_takes_the_loops_steps(name):
    """The map over the recorded gradients lands on every recorded weight (rounding)."""
    recording, gradients = recorded_loop(OPTIMIZERS[name])
    settings = recording.optimizer_settings_
    assert settings.refusal is None and settings.learning_rates.shape == (6, 1 + ("groups" in name))
    step_map = settings.update_map()
    weights = recording.path_.weights
    state = step_map.initial_state(weights[0])
    moved = weights[0]
    for step, gradient in enumerate(gradients):
        moved, state = step_map(step, moved, state, gradient)
        torch.testing.assert_close(moved, weights[step + 1], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_fresh_optimizer_takes_the_same_steps(name):
    recording, gradients = recorded_loop(OPTIMIZERS[name])
    """Bitwise: the same class, groups and learning rates on the same gradients."""
    settings = recording.optimizer_settings_
    model, _, _ = model_and_data()
    with torch.no_grad():
        for name_, value in recording.path_.unflatten(recording.path_.weights[0]).items():
            model.get_parameter(name_).copy_(value)
    params = [model.get_parameter(n) for n in recording.path_.param_names]
    optimizer = settings.optimizer(params)
    for step, gradient in enumerate(gradients):
        settings.set_step(optimizer, step)
        for p, g in zip(params, torch.split(gradient, [p.numel() for p in params]), strict=True):
            p.grad = g.reshape(p.shape).clone()
        optimizer.step()
    final = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(final, recording.path_.weights[-1])


def _set(key, value, at):
    def edit(optimizer, step):
        if step == at:
            optimizer.param_groups[0][key] = value

    return edit


@pytest.mark.parametrize(
    "make_optimizer, edit, match",
    [
        (
            lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
            _set("eps", 1e-3, 3),
            r"Step 3: the optimiser's epsilon of parameter group 0 \(1e-08 -> 0.001\) changed",
        ),
        (
            lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True),
            None,
            "Adam with amsgrad=True",
        ),
        (
            lambda m: torch.optim.Adam(
                [{"params": [m[0].weight], "decoupled_weight_decay": True},
                 {"params": [m[0].bias, *m[2].parameters()]}], lr=0.01,
            ),
            None,
            r"one kind of step for every parameter group.*AdamMap.*AdamWMap",
        ),
    ],
    ids=["eps-changed", "amsgrad", "mixed-decoupling"],
)  # fmt: skip
def test_what_the_map_cannot_be_is_refused_by_name(make_optimizer, edit, match):
    recording, _ = recorded_loop(make_optimizer, edit=edit)
    with pytest.raises(RecordingRefused, match=match):
        recording.optimizer_settings_.update_map()
    with pytest.raises(RecordingRefused, match=match):
        recording.counterfactual(recording.X_train_[:1])


def test_state_from_before_the_recorder_is_refused():
    model, X, y = model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(X), y).backward()
    optimizer.step()  # a step before the recorder: a momentum buffer
    recorder = TrainingRecorder(model, optimizer, X, y=y, loss="log_loss")
    optimizer.zero_grad()
    out = model(X)
    recorder.rows(torch.arange(12))
    F.cross_entropy(out, y).backward()
    optimizer.step()
    recording = recorder.finish()
    with pytest.raises(RecordingRefused, match=r"held state .* from before the recorder"):
        recording.counterfactual(X[:1])


def test_a_skipped_parameter_is_refused():
    model, X, y = model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X, y=y, loss="log_loss")
    for step in range(2):
        optimizer.zero_grad()
        out = model(X)
        recorder.rows(torch.arange(12))
        F.cross_entropy(out, y).backward()
        if step == 1:
            model[0].bias.grad = None  # torch.optim skips it
        optimizer.step()
    recording = recorder.finish()
    with pytest.raises(RecordingRefused, match=r"\['0.bias'\] had no gradient at some step"):
        recording.counterfactual(X[:1])


def test_early_stopping_keeps_the_first_steps_settings():
    recording_all, _ = recorded_loop(OPTIMIZERS["sgd-groups"])
    model, X, y = model_and_data()
    optimizer = OPTIMIZERS["sgd-groups"](model)
    recorder = TrainingRecorder(model, optimizer, X, y=y, loss="log_loss")
    for step in range(4):
        rows = torch.arange(step % 3 * 4, step % 3 * 4 + 4)
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
        if step == 1:
            saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, value in zip(model.parameters(), saved, strict=True):
            p.copy_(value)
    recording = recorder.finish(at_step=2)
    assert recording.optimizer_settings_.n_steps == 2
    result = recording.counterfactual(X[:1], output=0)
    assert result.adjoint_norms.shape == (3, 1)
    assert recording_all.optimizer_settings_.n_steps == 6


@pytest.mark.parametrize(
    "edit, match",
    [
        (_set("betas", (0.9, 0.99), 4), r"Step 4: the optimiser's beta_2 of parameter group 0"),
        (_set("weight_decay", 0.5, 5), r"Step 5: the optimiser's weight_decay of parameter"),
    ],
    ids=["beta_2", "weight_decay-last-step"],
)
def test_a_setting_changed_after_equal_steps_is_refused(edit, match):
    """Steps whose settings equal the last step's are not read again (the rule's
    settings key): a change at a later step, or at the last one, is still seen."""
    recording, _ = recorded_loop(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), edit=edit)
    with pytest.raises(RecordingRefused, match=match):
        recording.optimizer_settings_.update_map()
