"""The certificate covers the network the user holds: weights changed outside the
optimiser's steps are refused at the step where they change, at ``finish`` or
when a recording with the live module is queried; early stopping that restores
earlier weights gets the kernel of those weights (``finish(at_step=s)``).

Independent computations: the user's own module, converted to float64 and
evaluated by its own forward pass; ``torch.optim``'s own run.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._training._optimizers import RecordingRefused

DTYPES = [torch.float64, torch.float32]


def data(n=24, dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.3).long()
    return X.to(dtype), y


def mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def adam_run(dtype, n_steps=10, after_step=None, keep=None, **recorder_options):
    """Adam on a small MLP, ``n_steps`` full-batch steps; ``after_step(step, model)``
    runs after each step; ``keep`` (a step) returns a copy of the state_dict after
    that many steps."""
    X, y = data(dtype=dtype)
    model = mlp(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    recorder = TrainingRecorder(model, optimizer, X, y=y, **recorder_options)
    rows = np.arange(X.shape[0])
    kept = None
    for step in range(n_steps):
        if keep == step:
            kept = copy.deepcopy(model.state_dict())
        optimizer.zero_grad()
        out = model(X)
        recorder.rows(rows)
        F.cross_entropy(out, y).backward()
        optimizer.step()
        if after_step is not None:
            after_step(step, model)
    if keep == n_steps:
        kept = copy.deepcopy(model.state_dict())
    return model, recorder, X, kept


def own_float64_output(model, X):
    """The user's own module, in float64, on ``X``."""
    with torch.no_grad():
        return copy.deepcopy(model).double()(X.double()).numpy()


def assert_exact_for(recording, model, X):
    """The decomposition adds up, to 1e-9, to the user's own model in float64 (a
    float64 run), or to its float64 replay, within float32 rounding of the user's
    own float32 model (a float32 run)."""
    queries = X[:5] + 0.1
    parts = recording.decompose(queries)
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    own = own_float64_output(model, queries)
    assert parts.model_difference == 0.0
    if X.dtype == torch.float64:
        assert np.abs(total - own).max() <= 1e-9
    else:
        assert np.abs(total - parts.output).max() <= 1e-9
        assert np.abs(total - own).max() <= 1e-5
        assert parts.model_gap.max() <= 1e-5


# -- item 1: the state the user holds at finish ------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_dict_restored_before_finish_is_refused(dtype):
    model, recorder, X, kept = adam_run(dtype, keep=3)
    model.load_state_dict(kept)
    with pytest.raises(
        RecordingRefused, match=r"'0.weight' differs .* by up to .*finish\(at_step=3\)"
    ):
        recorder.finish()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("at_step", [0, 3, 10])
def test_early_stopping_at_a_step(dtype, at_step):
    """Restored best weights: the kernel of the network at that step, exact against
    the restored model itself."""
    model, recorder, X, kept = adam_run(dtype, keep=at_step)
    model.load_state_dict(kept)
    recording = recorder.finish(at_step=at_step)
    assert recording.n_steps_ == at_step
    assert_exact_for(recording, model, X)
    final = recording.final_state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(final[name], value)


def test_at_step_out_of_range_and_mismatched():
    model, recorder, X, _ = adam_run(torch.float64)
    with pytest.raises(ValueError, match=r"at_step must be an integer in \[0, 10\]; got 11"):
        recorder.finish(at_step=11)
    with pytest.raises(
        RecordingRefused, match="at step 4 .* equal the recorded weights at step 10"
    ):
        recorder.finish(at_step=4)  # the model holds the final weights, not step 4's


@pytest.mark.parametrize("dtype", DTYPES)
def test_edit_after_the_last_step_is_refused(dtype):
    model, recorder, X, _ = adam_run(dtype)
    with torch.no_grad():
        model[2].bias.add_(1e-3)
    with pytest.raises(RecordingRefused, match=r"'2.bias'.*differs.*by up to 0.001:"):
        recorder.finish()


@pytest.mark.parametrize("dtype", DTYPES)
def test_ema_written_back_is_refused(dtype):
    ema = {}

    def average(step, model):
        for name, p in model.named_parameters():
            ema[name] = p.detach().clone() if step == 0 else 0.9 * ema[name] + 0.1 * p.detach()

    model, recorder, X, _ = adam_run(dtype, after_step=average)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ema[name])
    with pytest.raises(RecordingRefused, match="differs from the recorded network"):
        recorder.finish()


@pytest.mark.parametrize("dtype", DTYPES)
def test_frozen_constant_changed_is_refused(dtype):
    X, y = data(dtype=dtype)
    model = mlp(dtype)
    model[0].bias.requires_grad_(False)
    model.register_buffer("scale", torch.ones((), dtype=dtype))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X)
    optimizer.zero_grad()
    out = model(X)
    recorder.rows(np.arange(len(X)))
    F.cross_entropy(out, y).backward()
    optimizer.step()
    model[0].bias.data.mul_(0.5)  # (.data: no version counter moves)
    with pytest.raises(RecordingRefused, match=r"constant '0.bias'.*changed"):
        recorder.finish()


@pytest.mark.parametrize("dtype", DTYPES)
def test_on_mismatch_record_flags_every_result(dtype):
    model, recorder, X, kept = adam_run(dtype, keep=3, on_mismatch="record")
    model.load_state_dict(kept)
    recording = recorder.finish()
    assert recording.model_difference_ > 0.1
    assert "'0.weight'" in recording.model_mismatch_
    with pytest.warns(UserWarning, match="not the recorded network"):
        parts = recording.decompose(X[:3])
    assert parts.model_difference == recording.model_difference_
    # model_gap compares the user's own model with the kernel's network
    assert parts.model_gap.max() > 1e-2
    with pytest.warns(UserWarning, match="not the recorded network"):
        recording.gram(X[:3])
    with pytest.warns(UserWarning, match="not the recorded network"):
        recording.explain(X[:2], k=2)


def test_on_mismatch_value_checked():
    X, _ = data()
    model = mlp(torch.float64)
    with pytest.raises(ValueError, match="on_mismatch must be one of"):
        TrainingRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1), X, on_mismatch="x")


@pytest.mark.parametrize("dtype", DTYPES)
def test_recording_refuses_when_the_live_model_changes_later(dtype):
    model, recorder, X, kept = adam_run(dtype, keep=3)
    recording = recorder.finish()
    assert_exact_for(recording, model, X)  # unchanged: exact against the user's model
    recording.gram(X[:3])
    model.load_state_dict(kept)  # restored after finish
    for query in (
        lambda: recording.decompose(X[:3]),
        lambda: recording.gram(X[:3]),
        lambda: recording.kernel_,
        lambda: recording.explain(X[:2], k=2),
    ):
        with pytest.raises(RecordingRefused, match="'0.weight'.*differs"):
            query()


def test_honest_run_is_exact_against_the_users_model():
    for dtype in DTYPES:
        model, recorder, X, _ = adam_run(dtype)
        recording = recorder.finish()
        assert recording.model_difference_ == 0.0 and recording.model_mismatch_ is None
        if dtype == torch.float64:
            assert_exact_for(recording, model, X)
        else:  # the float32 model's own output is its rounding away
            parts = recording.decompose(X[:4])
            assert 0 < parts.model_gap.max() <= 1e-5 and parts.residual.max() <= 1e-9


# -- item 2: changes between steps, at the step ------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_data_edit_after_a_step_is_refused_at_the_next_step(dtype):
    def shrink(step, model):
        if step == 4:
            for p in model.parameters():
                p.data.mul_(0.99)  # (.data: no version counter moves)

    with pytest.raises(
        RecordingRefused, match=r"Step 5: the weights of '0.weight' changed after step 4's"
    ):
        adam_run(dtype, after_step=shrink)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_grad_edit_after_a_step_is_refused_at_the_next_step(dtype):
    def edit(step, model):
        if step == 2:
            with torch.no_grad():
                model[2].weight[0, 0] += 1e-6

    with pytest.raises(
        RecordingRefused, match=r"Step 3: the weights of '2.weight' changed after step 2's"
    ):
        adam_run(dtype, after_step=edit)


def test_state_dict_restored_mid_run_is_refused_at_the_step():
    kept = {}

    def restore(step, model):
        if step == 1:
            kept.update(copy.deepcopy(model.state_dict()))
        if step == 5:
            model.load_state_dict(kept)

    with pytest.raises(
        RecordingRefused, match=r"Step 6: .*equal the recorded weights at step 2 \(restored\)"
    ):
        adam_run(torch.float64, after_step=restore)


# -- item 3: row indices are copied ------------------------------------------------


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_in_place_shuffle_of_the_row_indices(kind):
    X, y = data()
    model = mlp(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    recorder = TrainingRecorder(model, optimizer, X)
    rng = np.random.default_rng(0)
    perm = np.arange(X.shape[0])
    if kind == "torch":
        perm = torch.from_numpy(perm)
    seen = []
    for _ in range(3):
        rng.shuffle(perm.numpy() if kind == "torch" else perm)  # in place, every epoch
        for start in range(0, X.shape[0], 8):
            rows = perm[start : start + 8]
            seen.append(torch.as_tensor(rows).numpy().copy())
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
    recording = recorder.finish()
    for recorded, used in zip(recording.path_.batches, seen, strict=True):
        np.testing.assert_array_equal(recorded, used)
    assert_exact_for(recording, model, X)


@pytest.mark.parametrize("dtype", DTYPES)
def test_running_statistics_updated_during_the_run_are_refused_at_the_step(dtype):
    """A BatchNorm (eval mode while training) whose running statistics a forward
    pass in training mode updates, under no_grad (an evaluation in the wrong mode)."""
    X, y = data(dtype=dtype)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    model = model.to(dtype).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X)
    rows = np.arange(len(X))
    with pytest.raises(
        RecordingRefused,
        match=r"Step 2: the running statistics of BatchNorm layer '1' changed outside",
    ):
        for step in range(4):
            if step == 2:
                model.train()
                with torch.no_grad():
                    model(X)
                model.eval()
            optimizer.zero_grad()
            out = model(X)
            recorder.rows(rows)
            F.cross_entropy(out, y).backward()
            optimizer.step()


def with_buffer(dtype):
    model = mlp(dtype)
    model.register_buffer("unused", torch.zeros(2, dtype=dtype))
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_on_mismatch_record_keeps_the_recorded_constants_and_survives_saving(dtype, tmp_path):
    """A buffer changed after training, recorded: the recording's network keeps the
    buffer of the run; a saved and loaded recording still says it."""
    X, y = data(dtype=dtype)
    model = with_buffer(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X, on_mismatch="record")
    for _ in range(2):
        optimizer.zero_grad()
        out = model(X)
        recorder.rows(np.arange(len(X)))
        F.cross_entropy(out, y).backward()
        optimizer.step()
    model.unused.data.fill_(3.0)
    recording = recorder.finish()
    assert "constant 'unused'" in recording.model_mismatch_
    assert recording.model_difference_ == 3.0
    assert torch.equal(recording.module_.unused, torch.zeros(2, dtype=dtype))
    assert torch.equal(recording.final_state_dict()["unused"], torch.zeros(2, dtype=dtype))
    recording.save(tmp_path)
    loaded = type(recording).load(tmp_path, lambda: with_buffer(dtype), X)
    assert loaded.model_mismatch_ == recording.model_mismatch_
    assert loaded.model_difference_ == 3.0
    with pytest.warns(UserWarning, match="not the recorded network"):
        loaded.decompose(X[:2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_parameter_replaced_after_the_last_step_is_refused(dtype):
    """A trained parameter replaced by another object after the last step (the old
    one, which the recorder followed, unchanged): its values are compared by name,
    so other values are refused and the same values are the recorded network."""

    def replace(values):
        def after_step(step, model):
            if step == 4:
                model[2].bias = nn.Parameter(values(model[2].bias.detach()))

        return after_step

    model, recorder, X, _ = adam_run(dtype, n_steps=5, after_step=replace(torch.zeros_like))
    with pytest.raises(RecordingRefused, match="parameter '2.bias' differs from the recorded"):
        recorder.finish()
    model, recorder, X, _ = adam_run(
        dtype, n_steps=5, after_step=replace(torch.zeros_like), on_mismatch="record"
    )
    recording = recorder.finish()
    assert "'2.bias'" in recording.model_mismatch_ and recording.model_difference_ > 0
    model, recorder, X, _ = adam_run(dtype, n_steps=5, after_step=replace(torch.clone))
    assert_exact_for(recorder.finish(), model, X)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parameter_removed_after_the_last_step_is_refused(dtype):
    model, recorder, X, _ = adam_run(dtype, n_steps=3)
    del model[2].bias
    with pytest.raises(RecordingRefused, match="no parameter '2.bias' of the recorded shape"):
        recorder.finish()
    model, recorder, X, _ = adam_run(dtype, n_steps=3)
    model[2].bias = nn.Parameter(model[2].bias.detach().half())  # (another dtype)
    with pytest.raises(RecordingRefused, match="no parameter '2.bias' of the recorded shape"):
        recorder.finish()
