"""What the recorder cannot represent exactly is refused, naming the step and the cause."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._training._optimizers import RecordingRefused


def data(n=20):
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return X, (X[:, 0] > 0).long()


def mlp(*extra):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), *extra, nn.Tanh(), nn.Linear(6, 2)).double()


def steps(
    model,
    optimizer,
    recorder,
    X,
    y,
    n_steps=3,
    before_step=None,
    inputs=None,
    loss=None,
    before_forward=None,
):
    loss = loss or (lambda out, target: F.cross_entropy(out, target))
    for step in range(n_steps):
        rows = np.arange(5) + 5 * step
        if before_forward is not None:
            before_forward(step)
        optimizer.zero_grad()
        batch = X[rows] if inputs is None else inputs(X[rows])
        out = model(batch)
        recorder.rows(rows)
        loss(out, y[rows]).backward()
        if before_step is not None:
            before_step(step)
        optimizer.step()


def refused(match, model, optimizer, **kwargs):
    X, y = data()
    recorder = TrainingRecorder(model, optimizer, X)
    with pytest.raises(RecordingRefused, match=match):
        steps(model, optimizer, recorder, X, y, **kwargs)


def test_augmented_inputs():
    model = mlp()
    noise = torch.Generator().manual_seed(1)
    refused(
        "Step 0: the batch's inputs are not the training rows",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        inputs=lambda x: x + 0.01 * torch.randn(x.shape, generator=noise, dtype=x.dtype),
    )


def test_gradient_clipping():
    model = mlp()
    refused(
        "Step 0: the gradient of '0.weight' changed between the backward pass and",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        before_step=lambda step: nn.utils.clip_grad_norm_(model.parameters(), 1e-3),
    )


def test_manual_gradient_edit_at_a_later_step():
    model = mlp()
    refused(
        "Step 2: the gradient of '2.bias' changed",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        before_step=lambda step: model[2].bias.grad.mul_(2.0) if step == 2 else None,
    )


def test_amp_grad_scaler():
    """GradScaler scales the loss and unscales the gradients in place before the
    step (and skips steps with infinities): refused at the first step."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    out = model(X[:5])
    recorder.rows(np.arange(5))
    scaler.scale(F.cross_entropy(out, y[:5])).backward()
    with pytest.raises(RecordingRefused, match="Step 0: .*GradScaler"):
        scaler.step(optimizer)


def test_amp_grad_scaler_after_the_checked_step():
    """Not only at the first step (which is also verified by recomputation): with
    check="every" the gradients' fingerprint includes their L1 norm."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X, check="every")
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for step in range(2):
        optimizer.zero_grad()
        out = model(X[:5])
        recorder.rows(np.arange(5))
        if step == 0:
            F.cross_entropy(out, y[:5]).backward()
            optimizer.step()
            continue
        scaler.scale(F.cross_entropy(out, y[:5])).backward()
        with pytest.raises(RecordingRefused, match="Step 1: .*GradScaler"):
            scaler.step(optimizer)


def test_autocast():
    X, y = data()
    model = mlp().float()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    TrainingRecorder(model, optimizer, X.float())
    with pytest.raises(RecordingRefused, match="Step 0: the module runs under autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(X[:5].float())


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: torch.optim.RMSprop(p, lr=0.1), "RMSprop cannot be recorded exactly"),
        (lambda p: torch.optim.LBFGS(p), "LBFGS cannot be recorded exactly"),
        (lambda p: torch.optim.Adagrad(p), "Adagrad cannot be recorded exactly"),
    ],
)
def test_unsupported_optimizers(make, match):
    X, _ = data()
    model = mlp()
    with pytest.raises(RecordingRefused, match=match):
        TrainingRecorder(model, make(model.parameters()), X)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), "SGD with maximize=True"),
        (lambda p: torch.optim.Adam(p, lr=0.1, maximize=True), "Adam with maximize=True"),
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
            "SGD with dampening=0.1",
        ),
    ],
)
def test_unsupported_options(make, match):
    model = mlp()
    refused(f"Step 0: {match}", model, make(model.parameters()))


def test_groups_with_different_momentum_or_decay_are_recorded():
    """Formerly refused: groups that differ in momentum, or in AdamW's decoupled
    decay lr * weight_decay, are now per-parameter coefficients; the identity holds
    (tests/training/test_parameter_groups.py checks them against torch.optim and
    the brute-force reference)."""
    X, y = data()
    for make in (
        lambda m: torch.optim.SGD(
            [{"params": m[0].parameters(), "momentum": 0.5}, {"params": m[2].parameters()}],
            lr=0.1,
            momentum=0.9,
        ),
        lambda m: torch.optim.AdamW(
            [{"params": m[0].parameters(), "lr": 0.01}, {"params": m[2].parameters()}],
            lr=0.1,
            weight_decay=0.1,
        ),
    ):
        model = mlp()
        optimizer = make(model)
        recorder = TrainingRecorder(model, optimizer, X)
        steps(model, optimizer, recorder, X, y)
        recording = recorder.finish()
        parts = recording.decompose(X[:4])
        with torch.no_grad():
            own = model(X[:4]).numpy()
        total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
        np.testing.assert_allclose(total, own, rtol=0, atol=1e-9)


def test_group_momentum_changed_during_the_run():
    model = mlp()
    groups = [{"params": model[0].parameters(), "momentum": 0.5}, {"params": model[2].parameters()}]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    def change(step):
        if step == 2:
            optimizer.param_groups[1]["momentum"] = 0.8

    refused(
        "Step 2: the optimiser's momentum, betas, Nesterov flag",
        model,
        optimizer,
        before_step=change,
    )


def test_momentum_changed_during_the_run():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def change(step):
        if step == 1:
            optimizer.param_groups[0]["momentum"] = 0.5

    refused(
        "Step 1: the optimiser's momentum, betas, Nesterov flag",
        model,
        optimizer,
        before_step=change,
    )


def test_penalty_in_the_loss():
    """A loss that depends on the weights other than through the output."""
    model = mlp()
    refused(
        "Step 0: the gradient of '0.weight' is not the backward pass of the module's output",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss=lambda out, t: F.cross_entropy(out, t) + 0.1 * model[0].weight.square().sum(),
    )


@pytest.mark.parametrize(
    "layer, match",
    [
        (nn.AlphaDropout(0.5), "'1' \\(AlphaDropout\\) is in training mode"),
    ],
)
def test_training_mode_layers(layer, match):
    model = mlp(layer).train()
    refused(f"Step 0: layer {match}", model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_batch_norm_of_another_type_in_training_mode():
    """BatchNorm1d/2d are followed in training mode (tests/training/test_batchnorm.py);
    other BatchNorm types are refused by name."""
    model = mlp(nn.SyncBatchNorm(6)).train()
    X, y = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    TrainingRecorder(model, optimizer, X)
    with pytest.raises(RecordingRefused, match=r"layer '1' \(SyncBatchNorm\) is a BatchNorm in"):
        model(X[:4])


def test_batch_coupling_module_refused_at_creation():
    class BatchMean(nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)

    X, _ = data()
    model = mlp(BatchMean())
    with pytest.raises(ValueError, match="depends on the other rows"):
        TrainingRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1), X)


class _Tuple(nn.Module):
    def forward(self, x):
        return x, x


@pytest.mark.parametrize(
    ("last", "match"),
    [(nn.Flatten(0), r"got a tensor of shape \(2,\)"), (_Tuple(), "got tuple")],
)
def test_output_not_one_two_dimensional_tensor_refused_at_creation(last, match):
    X, _ = data()
    model = nn.Sequential(mlp(), last)
    with pytest.raises(RecordingRefused, match="must be one tensor of shape .* " + match):
        TrainingRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1), X)


def test_parameters_changed_between_steps():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))

    def add(step):
        if step == 1:
            optimizer.add_param_group({"params": [extra]})

    refused(
        "Step 1: the module's trainable parameters or the optimiser's parameters changed",
        model,
        optimizer,
        before_step=add,
    )
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def freeze(step):
        if step == 2:
            model[0].weight.requires_grad_(False)

    refused("Step 2: the module's trainable parameters", model, optimizer, before_step=freeze)


def test_parameter_not_in_the_optimizer():
    X, _ = data()
    model = mlp()
    with pytest.raises(
        RecordingRefused,
        match=r"\['2.weight', '2.bias'\] require a gradient but are not in the optimiser",
    ):
        TrainingRecorder(model, torch.optim.SGD(model[0].parameters(), lr=0.1), X)


def test_missing_rows():
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    TrainingRecorder(model, optimizer, X)
    F.cross_entropy(model(X[:5]), y[:5]).backward()
    with pytest.raises(RecordingRefused, match="Step 0: a training batch has no rows"):
        optimizer.step()


def test_gradients_not_reset_between_steps():
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X)
    for step in range(2):
        out = model(X[:5])
        recorder.rows(np.arange(5))
        F.cross_entropy(out, y[:5]).backward()
        if step == 0:
            optimizer.step()
    with pytest.raises(RecordingRefused, match="Step 1: the gradients were not reset"):
        optimizer.step()


def test_weights_edited_between_forward_and_step():
    model = mlp()

    def edit(step):
        with torch.no_grad():
            model[2].bias.add_(1.0)

    refused(
        "Step 0: the weights changed between a batch's forward pass",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        before_step=edit,
    )


def test_skipped_parameter_with_a_momentum_buffer():
    model = mlp()

    def skip(step):
        if step == 1:
            model[2].bias.grad = None

    refused(
        "Step 1: parameter '2.bias' has no gradient but has a momentum buffer",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        before_step=skip,
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    ],
)
def test_gradient_removed_by_hand_under_momentum(make):
    """The backward pass reached the parameter but its gradient was set to None:
    torch.optim skips it, the momentum buffer of the linear form would not."""
    model = mlp()

    def remove(step):
        model[2].bias.grad = None

    refused(
        "Step 0: the gradient of parameter '2.bias' was removed after the backward pass",
        model,
        make(model.parameters()),
        before_step=remove,
    )


def test_wrong_rows():
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X)
    model(X[:5])
    with pytest.raises(
        RecordingRefused, match="Step 0: the batch's inputs are not the training rows"
    ):
        recorder.rows(np.arange(1, 6))  # (checked when named: the forward pass's inputs)
    with pytest.raises(IndexError, match="must lie in"):
        recorder.rows([100])


SCHEDULERS = {
    "one-cycle-adam": (
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda o, cycle: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.05, total_steps=6, cycle_momentum=cycle
        ),
    ),
    "cyclic-sgd": (
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
        lambda o, cycle: torch.optim.lr_scheduler.CyclicLR(
            o, base_lr=0.01, max_lr=0.1, step_size_up=2, cycle_momentum=cycle
        ),
    ),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_scheduler_cycling_the_momentum(name):
    """OneCycleLR and CyclicLR cycle beta_1 / momentum by default: refused, naming
    them and the setting; with cycle_momentum=False the run is exact."""
    make_optimizer, make_scheduler = SCHEDULERS[name]
    X, y = data()
    for cycle in (True, False):
        model = mlp()
        optimizer = make_optimizer(model.parameters())
        scheduler = make_scheduler(optimizer, cycle)
        recorder = TrainingRecorder(model, optimizer, X)

        def schedule(step, scheduler=scheduler):
            if step:
                scheduler.step()

        if cycle:
            with pytest.raises(
                RecordingRefused, match=r"Step 1: .*OneCycleLR or CyclicLR .*cycle_momentum=False"
            ):
                steps(model, optimizer, recorder, X, y, n_steps=3, before_step=schedule)
            continue
        steps(model, optimizer, recorder, X, y, n_steps=3, before_step=schedule)
        recording = recorder.finish()
        parts = recording.decompose(X[:3])
        total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
        with torch.no_grad():
            own = model(X[:3]).numpy()
        assert np.abs(total - own).max() <= 1e-9
        assert len(set(recording.path_.learning_rates)) == 3  # the rate did change


def test_parameter_removed_between_steps_is_refused_at_the_step():
    """``del`` registers nothing: the removed parameter's missing gradient sends the
    structure check to walk the module."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def remove(step):
        if step == 1:
            bias = model[2].bias.detach().clone()
            del model[2].bias
            model[2].bias = bias  # (a plain tensor: a constant the optimiser never moves)

    refused(
        "Step 1: the module's trainable parameters",
        model,
        optimizer,
        n_steps=4,
        before_forward=remove,
    )


def test_modules_made_elsewhere_during_the_run_are_no_change():
    """A layer built outside the model mid-run (a registration the global hooks see)
    makes the structure check walk once; the run is recorded."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = data()
    recorder = TrainingRecorder(model, optimizer, X)
    steps(model, optimizer, recorder, X, y, before_forward=lambda step: nn.Linear(2, 2))
    assert recorder.finish().n_steps_ == 3


def test_global_registration_hooks_removed_at_finish_and_when_collected():
    import gc

    from torch.nn.modules import module as torch_module

    hooks = torch_module._global_parameter_registration_hooks
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = data()
    before = set(hooks)
    recorder = TrainingRecorder(model, optimizer, X)
    ours = set(hooks) - before
    assert len(ours) == 1
    recorder.finish()
    assert not ours & set(hooks)
    before = set(hooks)
    TrainingRecorder(model, optimizer, X)  # never finished: its hooks keep it alive
    ours = set(hooks) - before
    assert len(ours) == 1
    del model, optimizer, recorder  # (the module holds the hooks; the first recorder it)
    gc.collect()
    assert not ours & set(hooks)
