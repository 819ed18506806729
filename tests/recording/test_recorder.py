"""The recorder in a user's own loop: the recorded linear form reproduces every
torch.optim step, and the decomposition is exact.

Independent computations: the weights are torch.optim's own (the run itself);
``replay`` rebuilds every step from the recorded linear form with autograd
gradients of the recorded rows and output gradients and a hand-kept buffer, and
must land on the recorded weights; the decomposition's sum is held against the
module's own float64 output; the estimator's own fit is matched by a hand loop.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _recorded_loops import data, mlp, replay, run
from torch import nn

from sklearn_pathkernel import ExactPathKernelRegressor, TrainingRecorder
from sklearn_pathkernel._path import log_softmax
from sklearn_pathkernel._training._optimizers import RecordingRefused

OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.2),
    "sgd-decay": lambda groups: torch.optim.SGD(groups, lr=0.2, weight_decay=0.05),
    "momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "nesterov-decay": lambda groups: torch.optim.SGD(
        groups, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.02
    ),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.02),
    "adam-decay": lambda groups: torch.optim.Adam(
        groups, lr=0.02, betas=(0.8, 0.99), weight_decay=0.05
    ),
    "adam-amsgrad-foreach": lambda groups: torch.optim.Adam(
        groups, lr=0.02, amsgrad=True, foreach=True
    ),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.02, weight_decay=0.1, eps=1e-6),
    "adamw-fused": lambda groups: torch.optim.AdamW(groups, lr=0.02, weight_decay=0.1, fused=True),
}


def groups_of(model, variant, name):
    """One group, or two groups with their own learning rates (and a frozen bias);
    AdamW's groups here share the product lr * weight_decay, so that its decoupled
    decay stays one number (groups that differ: test_parameter_groups.py)."""
    if variant == "plain":
        return model.parameters()
    model[2].bias.requires_grad_(False)
    first = {"params": model[0].parameters(), "lr": 0.3 if name.startswith("sgd") else 0.05}
    if name.startswith("adamw"):
        first["weight_decay"] = 0.04  # 0.05 * 0.04 == 0.02 * 0.1
    return [first, {"params": [model[2].weight]}]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("variant", ["plain", "groups-scheduler-frozen"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_identity(name, variant, dtype):
    X, y = data(dtype=dtype)
    model = mlp(dtype)
    optimizer = OPTIMIZERS[name](groups_of(model, variant, name))
    scheduler = None
    if variant != "plain":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.2 * s))
    recording = run(model, optimizer, X, y, scheduler=scheduler)
    assert recording.n_steps_ == 12
    worst, largest = replay(recording)
    parts = recording.decompose(X[:6])
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    assert np.abs(total - parts.output).max() == pytest.approx(parts.residual.max())
    assert parts.quadrature_error.max() <= 1e-9
    if dtype == torch.float64:
        assert worst <= 1e-14  # torch.optim's step, to the last bits
        assert parts.residual.max() <= 1e-11
        assert parts.model_gap.max() == 0.0
    else:
        # The float32 optimiser rounds its own updates: the linear form holds to
        # float32's rounding of each move; the kernel is the float64 replay's.
        assert worst <= 1e-4 * largest
        assert parts.residual.max() <= 1e-9
        assert 0 < parts.model_gap.max() <= 1e-5


def test_estimators_fit_is_a_recorded_loop():
    """The regressor's own fit and the same loop by hand, recorded: the same weights
    (<= 1e-14) and the same contributions (<= 1e-12)."""
    rng = np.random.RandomState(0)
    X = rng.randn(20, 3)
    y = np.c_[np.sin(X[:, 0]), X[:, 1] * X[:, 2]]
    est = ExactPathKernelRegressor(
        hidden_layer_sizes=(5,),
        solver="adam",
        learning_rate=0.02,
        max_iter=4,
        batch_size=7,
        random_state=0,
        weight_decay=0.01,
    ).fit(X, y)
    model = est.module_
    with torch.no_grad():  # back to w_0
        for name, value in est.path_.unflatten(est.path_.weights[0]).items():
            model.get_parameter(name).copy_(value)
    model.requires_grad_(True)
    X_t, y_t = torch.tensor(X), torch.tensor(y)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02, weight_decay=0.01)
    recorder = TrainingRecorder(model, optimizer, X_t)
    for rows in est.path_.batches:
        optimizer.zero_grad()
        out = model(X_t[rows])
        recorder.rows(rows)
        (0.5 * (out - y_t[rows]).square().mean(dim=1)).mean().backward()
        optimizer.step()
    recording = recorder.finish()
    assert (recording.path_.weights - est.path_.weights).abs().max() <= 1e-14
    mine, theirs = recording.decompose(X_t[:5]), est.decompose(X[:5])
    assert np.abs(mine.contributions - theirs.contributions).max() <= 1e-12
    assert np.abs(mine.decay - theirs.decay).max() <= 1e-12


def test_gradient_accumulation_skipped_steps_and_skipped_parameters():
    """Two backward passes per step, a step skipped (backward then zero_grad), a
    parameter without a gradient at some steps: exact."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    recorder = TrainingRecorder(model, optimizer, X, check="every")
    for step in range(6):
        optimizer.zero_grad()
        for half in (np.arange(0, 5), np.arange(5, 11)):
            rows = (half + 3 * step) % 30
            out = model(X[rows])
            recorder.rows(rows)
            (F.cross_entropy(out, y[rows], reduction="sum") / 11).backward()
        if step == 2:  # skipped: reset, next batch
            optimizer.zero_grad()
            out = model(X[:4])
            recorder.rows(np.arange(4))
            F.cross_entropy(out, y[:4]).backward()
        if step % 2:
            model[0].bias.grad = None  # torch.optim skips it
        optimizer.step()
    recording = recorder.finish()
    assert [len(b) for b in recording.path_.batches] == [11, 11, 4, 11, 11, 11]
    worst, _ = replay(recording)
    assert worst <= 1e-14
    parts = recording.decompose(X[:5])
    assert parts.residual.max() <= 1e-11


@pytest.mark.parametrize("named_first", [False, True])
def test_gradient_accumulation_through_a_reused_input_buffer(named_first):
    """A loop that copies each micro-batch into one preallocated input tensor: each
    micro-batch's inputs are checked when both they and their rows are known,
    before the next one overwrites them; the run is recorded and exact (a
    buffer holding other rows is still refused at once)."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    recorder = TrainingRecorder(model, optimizer, X)
    buffer = torch.empty(5, X.shape[1], dtype=X.dtype)
    for step in range(4):
        optimizer.zero_grad()
        for half in range(2):
            rows = (np.arange(5) + 10 * step + 5 * half) % 30
            buffer.copy_(X[rows])
            if named_first:
                recorder.rows(rows)
            out = model(buffer)
            if not named_first:
                recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    recording = recorder.finish()
    assert [len(b) for b in recording.path_.batches] == [10] * 4
    worst, _ = replay(recording)
    assert worst <= 1e-14
    assert recording.decompose(X[:5]).residual.max() <= 1e-11
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    recorder = TrainingRecorder(model, optimizer, X)
    buffer.copy_(X[:5])
    out = model(buffer)
    with pytest.raises(RecordingRefused, match="Step 0: the batch's inputs are not"):
        recorder.rows(np.arange(5, 10))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_class_weights_and_squared_error(reduction):
    X, y = data()
    weights = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    for loss in (
        lambda out, t: F.cross_entropy(out, t, weight=weights, reduction=reduction),
        lambda out, t: F.mse_loss(out, F.one_hot(t, 3).double(), reduction=reduction),
    ):
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        recording = run(model, optimizer, X, y, epochs=2, loss=loss)
        assert recording.decompose(X[:4]).residual.max() <= 1e-11


def test_early_stopping_and_no_steps():
    X, y = data()
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    recorder = TrainingRecorder(model, optimizer, X)
    empty = recorder.finish()
    assert empty.n_steps_ == 0
    parts = empty.decompose(X[:3])
    assert np.abs(parts.contributions).max() == 0 and parts.residual.max() == 0


def test_gram_blocks_and_kernel():
    """The three Gram blocks and the scikit-learn kernel agree with each other."""
    from sklearn.svm import SVC

    X, y = data()
    model = mlp()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.2), X, y, epochs=1)
    train = recording.gram(X, a_train=True)
    cross = recording.gram(X[:4] + 0.1, X, b_train=True)
    test = recording.gram(X[:4] + 0.1)
    assert train.shape == (30, 30) and cross.shape == (4, 30) and test.shape == (4, 4)
    np.testing.assert_allclose(train, train.T, rtol=0, atol=1e-12)
    kernel = recording.kernel_
    np.testing.assert_allclose(kernel(X.numpy()), train, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kernel(X[:4].numpy() + 0.1, X.numpy()), cross, rtol=1e-12)
    svc = SVC(kernel="precomputed").fit(train, y.numpy())
    assert svc.predict(cross).shape == (4,)


def test_long_run_grows_its_arrays_and_reads_mid_run():
    """More steps than the host arrays' first capacity (64), the path read in the
    middle of the run: every step still replays torch.optim's to 1e-14."""
    X, y = data()
    model = mlp()
    groups = [{"params": model[0].parameters(), "lr": 0.01}, {"params": model[2].parameters()}]
    optimizer = torch.optim.Adam(groups, lr=0.02)
    recorder = TrainingRecorder(model, optimizer, X)
    middle = None
    for step in range(70):
        rows = np.arange(10) + (step % 3) * 10
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
        if step == 40:
            middle = recorder.path()
    recording = recorder.finish()
    assert recording.n_steps_ == 70 and middle.n_steps == 41
    torch.testing.assert_close(
        middle.update.preconditioners, recording.path_.update.preconditioners[:41], rtol=0, atol=0
    )
    worst, _ = replay(recording)
    assert worst <= 1e-14


def test_classifier_fit_is_a_recorded_loop_with_a_link():
    """The classifier decomposes f = log_softmax(module(x)): a hand loop recorded with
    that link (and output=f) gives its weights (<= 1e-14) and contributions (<= 1e-12)."""
    from sklearn_pathkernel import ExactPathKernelClassifier

    X, y = data()
    est = ExactPathKernelClassifier(
        hidden_layer_sizes=(5,),
        solver="sgd",
        momentum=0.9,
        nesterovs_momentum=True,
        learning_rate=0.1,
        max_iter=3,
        batch_size=8,
        random_state=0,
    ).fit(X.numpy(), y.numpy())
    model = est.module_
    with torch.no_grad():
        for name, value in est.path_.unflatten(est.path_.weights[0]).items():
            model.get_parameter(name).copy_(value)
    model.requires_grad_(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    recorder = TrainingRecorder(model, optimizer, X, link=log_softmax)
    for rows in est.path_.batches:
        optimizer.zero_grad()
        f = log_softmax(model(X[rows]))
        recorder.rows(rows, output=f)
        F.nll_loss(f, y[rows]).backward()
        optimizer.step()
    recording = recorder.finish()
    assert (recording.path_.weights - est.path_.weights).abs().max() <= 1e-14
    mine, theirs = recording.decompose(X[:5]), est.decompose(X[:5].numpy())
    assert np.abs(mine.contributions - theirs.contributions).max() <= 1e-12
    assert np.abs(mine.output - theirs.output).max() <= 1e-14


def test_adam_parameters_at_different_step_counts():
    """Adam without a first moment (beta_1 = 0, so a parameter may be skipped): a
    bias skipped at every other step lags in its own step count, and its P_s
    follows its own count (the per-count terms are not shared across counts):
    the replay lands on the recorded weights."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02, betas=(0.0, 0.99))
    recorder = TrainingRecorder(model, optimizer, X)
    for step in range(6):
        rows = np.arange(8) + 3 * step
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        if step % 2:
            model[0].bias.grad = None  # torch.optim skips it: its step count lags
        optimizer.step()
    counts = {float(optimizer.state[p]["step"]) for p in model.parameters()}
    assert counts == {3.0, 6.0}
    worst, largest = replay(recorder.finish())
    assert largest > 1e-3 and worst <= 1e-14


def test_preconditioners_finished_in_blocks_are_those_of_one_pass(monkeypatch):
    """Adam's P_s is finished at the path's first read in blocks of rows
    (cache-sized): the same numbers, bitwise, as in one pass over all rows."""
    from sklearn_pathkernel._training import _step_log

    X, y = data()
    recordings, finished = [], []
    for chunk_bytes in (1, 1 << 30):  # one row per block; every row in one block
        monkeypatch.setattr(_step_log, "CHUNK_BYTES", chunk_bytes)
        model = mlp(torch.float32)
        recordings.append(run(model, OPTIMIZERS["adamw"](model.parameters()), X.float(), y))
        finished.append(recordings[-1].path_.update.preconditioners)  # (read: finished now)
    one_row, one_pass = finished
    assert one_row.shape[0] == recordings[0].n_steps_ > 1
    assert torch.equal(one_row, one_pass)


def test_pass_hooks_only_for_modules_with_dropout_or_batchnorm():
    """The per-pass hooks of dropout masks and BatchNorm statistics are registered on
    the module only when it has such layers (a Python call less per forward pass
    each); the optimiser carries the recorder's two step hooks only (the settings'
    log is called from them), and finish removes every hook."""
    X, _ = data()
    plain = mlp()
    with_layers = nn.Sequential(plain[0], nn.BatchNorm1d(plain[0].out_features), nn.Dropout(0.1),
                                *plain[1:])  # fmt: skip
    for model, pre_hooks in ((plain, 0), (with_layers, 2)):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        recorder = TrainingRecorder(model, optimizer, X)
        assert len(model._forward_pre_hooks) == pre_hooks
        assert len(optimizer._optimizer_step_pre_hooks) == 1
        assert len(optimizer._optimizer_step_post_hooks) == 1
        recorder.finish()
        assert not model._forward_pre_hooks and not model._forward_hooks
        assert not optimizer._optimizer_step_pre_hooks
        assert not optimizer._optimizer_step_post_hooks


def test_structure_watch_accepts_a_new_layer_without_parameters():
    """The per-step structure check reads a signature first: a layer without
    parameters added mid-run changes the signature but not the trained
    parameters (recorded, exact); a parameter replaced in a layer is refused at
    its step."""
    from sklearn_pathkernel._training._optimizers import RecordingRefused

    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    recorder = TrainingRecorder(model, optimizer, X)
    for step in range(4):
        if step == 1:
            model.append(nn.Identity())
        if step == 3:
            model[2].bias = nn.Parameter(model[2].bias.detach().clone())
        rows = np.arange(6) + 4 * step
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        if step < 3:
            optimizer.step()
    with pytest.raises(RecordingRefused, match="Step 3: the module's trainable parameters"):
        optimizer.step()
    worst, largest = replay(recorder.finish())
    assert largest > 1e-3 and worst <= 1e-14


def test_hand_loop_reproduces_the_estimators_batch_order():
    """The estimators' mini-batch order as the user guide states it: a
    ``np.random.RandomState(random_state)`` draws the initial weights' seed
    (``randint(2**31 - 1)``), then each epoch ``permutation(n)`` cut into slices of
    ``batch_size`` (the last one short). A hand loop that follows it, from the
    estimator's initial weights, lands on the estimator's weights."""
    rng = np.random.RandomState(0)
    X = rng.randn(23, 3)
    y = np.c_[np.sin(X[:, 0]), X[:, 1] * X[:, 2]]
    est = ExactPathKernelRegressor(
        hidden_layer_sizes=(5,),
        solver="sgd",
        momentum=0.9,
        learning_rate=0.05,
        max_iter=3,
        batch_size=8,
        random_state=7,
    ).fit(X, y)
    order = np.random.RandomState(7)
    order.randint(np.iinfo(np.int32).max)  # the initial weights' seed
    batches = [
        perm[start : start + 8]
        for perm in (order.permutation(23) for _ in range(3))
        for start in range(0, 23, 8)
    ]
    assert len(batches) == est.path_.n_steps
    for mine, theirs in zip(batches, est.path_.batches, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    model = est.module_
    with torch.no_grad():  # back to w_0
        for name, value in est.path_.unflatten(est.path_.weights[0]).items():
            model.get_parameter(name).copy_(value)
    model.requires_grad_(True)
    X_t, y_t = torch.tensor(X), torch.tensor(y)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    recorder = TrainingRecorder(model, optimizer, X_t)
    for rows in batches:
        optimizer.zero_grad()
        out = model(X_t[rows])
        recorder.rows(rows)
        (0.5 * (out - y_t[rows]).square().mean(dim=1)).mean().backward()
        optimizer.step()
    recording = recorder.finish()
    assert (recording.path_.weights - est.path_.weights).abs().max() <= 1e-14


def test_adam_state_replaced_mid_run_is_read_anew():
    """Adam's state is read through views kept while the optimiser holds the same
    tensors: an optimiser whose state is loaded again mid-run (new tensors, the
    same values) is read from its new tensors, and the replay of every step lands
    on the recorded weights."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    recorder = TrainingRecorder(model, optimizer, X)
    for step in range(6):
        if step == 3:
            before = optimizer.state[model[0].weight]["exp_avg_sq"]
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            assert optimizer.state[model[0].weight]["exp_avg_sq"] is not before
        rows = np.arange(8) + 3 * step
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    worst, largest = replay(recorder.finish())
    assert largest > 1e-3 and worst <= 1e-14


def test_row_range_of_a_large_batch():
    """Batches of more than 1024 rows are range-checked by one numpy reduction (a
    negative index read as unsigned is out of range); smaller ones by Python's
    min and max: both refuse a negative index and one past the end."""
    X = torch.zeros(3000, 4, dtype=torch.float64)
    model = mlp()
    recorder = TrainingRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1), X)
    for size in (8, 1100):
        for bad in (-1, 3000):
            rows = np.arange(size)
            rows[size // 2] = bad
            with pytest.raises(IndexError, match="must lie in"):
                recorder.rows(rows)
        recorder.rows(np.arange(size) + 3000 - size)  # the last rows: accepted


def test_batch_equal_in_value_but_not_in_bytes_is_accepted():
    """A batch's inputs are compared with X[rows] by their bytes first, then by
    value: a batch holding -0.0 where X holds 0.0 is the same data (accepted, as
    the exact kernel sees no difference), the recorded run is exact."""
    X, y = data()
    X[:, 2] = 0.0
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X)
    for step in range(3):
        rows = np.arange(8) + 4 * step
        batch = X[rows].clone()
        batch[:, 2] = -0.0
        assert batch.numpy().tobytes() != X[rows].numpy().tobytes()
        optimizer.zero_grad()
        out = model(batch)
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    worst, largest = replay(recorder.finish())
    assert largest > 1e-3 and worst <= 1e-14


def test_output_gradient_after_the_outputs_own_hooks():
    """The output gradient is taken where it enters the module (a pre-hook of the
    output's autograd node), after the output's own tensor hooks: a hook that scales
    the gradient is recorded as the gradient the parameters received, and the
    recomputed gradient of every step agrees (check="every")."""
    X, y = data()
    model = mlp()
    initial = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    recorder = TrainingRecorder(model, optimizer, X, check="every")
    first = None
    for start in range(0, 24, 8):
        rows = torch.arange(start, start + 8)
        first = rows if first is None else first
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        out.register_hook(lambda grad: 2.0 * grad)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    recording = recorder.finish()
    out = initial(X[first])
    (expected,) = torch.autograd.grad(F.cross_entropy(out, y[first]), out)
    assert torch.equal(recording.path_.output_gradients[0], -2.0 * expected)
    assert recording.decompose(X[:4]).residual.max() <= 1e-11


class _SecondHalf(nn.Module):
    """A module whose output is the second output of its last autograd node."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 6)

    def forward(self, x):
        return torch.tanh(self.body(x)).split(3, dim=1)[1]


def test_output_of_a_node_with_several_outputs():
    """The module's output is one of several outputs of its autograd node (a split):
    its own gradient is recorded (the node's gradient at the output's position),
    and the recorded loop is exact."""
    X, y = data()
    torch.manual_seed(0)
    model = _SecondHalf().double()
    initial = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    recording = run(model, optimizer, X, y, epochs=2)
    assert model(X[:2]).output_nr == 1
    parts = recording.decompose(X[:5])
    assert parts.residual.max() <= 1e-11
    assert parts.model_gap.max() == 0.0
    # the first step's recorded gradient is -dL/dout of its batch at w_0
    first = torch.as_tensor(recording.path_.batches[0])
    out = initial(X[first])
    (expected,) = torch.autograd.grad(F.cross_entropy(out, y[first]), out)
    assert torch.equal(recording.path_.output_gradients[0], -expected)
