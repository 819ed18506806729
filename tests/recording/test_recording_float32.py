"""Float32 runs: the kernel of the recorded float32 weights themselves, each step
anchored at them, with its rounding as an explicit term.

Independent computations: the test's own step-by-step check of the linear form
(``_recorded_loops.replay``: autograd gradients of the recorded rows at the
recorded weights, a hand-kept buffer), which with the rounding moves taken off
must give the recorded moves; the float64 network evaluated at the recorded final
weights by ``functional_call``; the float32 module's own output; for float64 runs,
the engine as it was built before float32 runs were anchored.
"""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _recorded_loops import data, mlp, replay, run
from torch.func import functional_call

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._path import FunctionLink
from sklearn_pathkernel._recording._recording import output_function
from sklearn_pathkernel._training._optimizers import RecordingRefused
from sklearn_pathkernel._training._replay import ROUNDING_STEPS, replay_bound

F32 = torch.float32

OPTIMIZERS = {
    "sgd-momentum-decay": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.02),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.1),
}


def recorded(name, dtype):
    X, y = data(dtype=dtype)
    model = mlp(dtype)
    optimizer = OPTIMIZERS[name](model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.2 * s))
    return run(model, optimizer, X, y, scheduler=scheduler), X


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float32_run_is_exact_for_its_own_weights(name):
    recording, X = recorded(name, torch.float32)
    engine = recording._engine()
    path = engine.path
    assert path.weights.dtype == torch.float64 and recording.path_.weights.dtype == torch.float32
    # the recorded float32 weights themselves, not a replay that drifts from them
    np.testing.assert_array_equal(path.weights.numpy(), recording.path_.weights.double().numpy())
    rounding = path.rounding_moves
    assert rounding.shape == (path.n_steps, path.n_weights)
    assert 0 < rounding.abs().max() <= 1e-5
    # independently: every recorded move is the linear form of the float64 gradients at
    # the recorded weights plus the step's rounding move
    recomputed = SimpleNamespace(
        path_=path,
        module_=copy.deepcopy(recording.module_).double(),
        X_train_=recording.X_train_.double(),
        dtype=torch.float64,
    )
    worst, largest = replay(recomputed, rounding=rounding)
    assert worst <= 1e-14 * max(largest, 1.0)

    queries = X[:6] + 0.05
    parts = recording.decompose(queries)
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    module64 = copy.deepcopy(recording.module_).double()
    with torch.no_grad():
        final = recording.path_.unflatten(recording.path_.weights[-1].double())
        output = functional_call(module64, final, (queries.double(),)).numpy()
        own = recording.module_(queries).double().numpy()
    np.testing.assert_array_equal(parts.output, output)  # the float32 weights, in float64
    assert np.abs(total - output).max() <= 1e-12
    assert parts.residual.max() <= 1e-12 and parts.quadrature_error.max() <= 1e-12
    np.testing.assert_allclose(parts.model_gap, np.abs(own - output).max(axis=1), rtol=0, atol=0)
    assert 0 < parts.model_gap.max() <= 1e-5


def test_float64_run_is_unchanged():
    recording, X = recorded("adamw", torch.float64)
    engine = recording._engine()
    assert engine.path is recording.path_  # no replay: the recorded path itself
    # the engine as built before the float64 replay existed
    before = PathKernelEngine(
        copy.deepcopy(recording.module_).eval(),
        recording.path_,
        recording.X_train_,
        link=FunctionLink(output_function(recording.link)),
    )
    queries = X[:4] - 0.1
    parts, expected = recording.decompose(queries), before.decompose(queries)
    np.testing.assert_array_equal(parts.contributions, expected.contributions)
    np.testing.assert_array_equal(parts.bias, expected.bias)
    np.testing.assert_array_equal(parts.decay, expected.decay)
    with torch.no_grad():
        np.testing.assert_array_equal(parts.output, recording.module_(queries).numpy())
    assert parts.model_gap.max() == 0.0 and parts.residual.max() <= 1e-11


def test_replay_of_a_recording_on_disk_stays_on_disk():
    X, y = data(dtype=torch.float32)
    replays = []
    for storage in ["memory", "disk"]:
        model = mlp(torch.float32)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        recorder = TrainingRecorder(model, optimizer, X, max_steps=4, storage=storage)
        for start in range(0, 32, 8):
            rows = torch.arange(start, min(start + 8, X.shape[0]))
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            torch.nn.functional.cross_entropy(out, y[rows]).backward()
            optimizer.step()
        replays.append(recorder.finish()._engine().path)
    memory, disk = replays
    assert memory.storage == "memory" and disk.storage != "memory"
    assert disk.weights.dtype == torch.float64
    np.testing.assert_array_equal(disk.weights.numpy(), memory.weights.numpy())


def cnn_adamw_run(n_steps=24):
    """A float32 CNN (frozen stem, two parameter groups) trained with AdamW and a
    warm-up plus cosine schedule on shuffled batches."""
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(40, 1, 6, 6, generator=generator)
    y = (X[:, 0, :3].mean((1, 2)) > 0).long() + (X[:, 0, 3:].mean((1, 2)) > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3),
        torch.nn.Tanh(),
        torch.nn.Conv2d(4, 6, 3),
        torch.nn.Tanh(),
        torch.nn.AvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(6, 3),
    )
    model[0].requires_grad_(False)  # a frozen stem
    optimizer = torch.optim.AdamW(
        [{"params": model[2].parameters(), "lr": 0.01}, {"params": model[6].parameters()}],
        lr=0.02,
        weight_decay=0.01,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + np.cos(np.pi * s / n_steps))
    )
    recorder = TrainingRecorder(model, optimizer, X)
    order = torch.randperm(40, generator=generator)
    for step in range(n_steps):
        if step % 4 == 0:
            order = torch.randperm(40, generator=generator)
        rows = order[10 * (step % 4) : 10 * (step % 4) + 10]
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        torch.nn.functional.cross_entropy(out, y[rows]).backward()
        optimizer.step()
        schedule.step()
    return recorder.finish(), model, X


def test_replay_bound_is_the_formula():
    recording, _ = recorded("adamw", torch.float32)
    path = recording.path_
    u = 2.0**-24
    bounds = replay_bound(path)
    offset = int(np.prod(path.param_shapes[0]))
    w = path.weights.double()[:, offset : offset + int(np.prod(path.param_shapes[1]))]
    expected = (
        ROUNDING_STEPS
        * u
        * sum(
            float(w[s + 1].abs().max() + (w[s + 1] - w[s]).abs().max()) for s in range(path.n_steps)
        )
    )
    assert bounds[path.param_names[1]] == pytest.approx(expected, rel=1e-12)
    assert all(value == 0.0 for value in replay_bound(path.astype(torch.float64)).values())


@pytest.mark.parametrize("name", ["cnn-adamw", "mlp-adamw", "mlp-sgd"])
def test_honest_float32_runs_are_exact(name):
    if name == "cnn-adamw":
        recording, _, X = cnn_adamw_run()
    else:
        recording, X = recorded("adamw" if name == "mlp-adamw" else "sgd-momentum-decay", F32)
    engine = recording._engine()  # (refused at a step beyond its rounding)
    assert torch.equal(engine.path.weights, recording.path_.weights.double())
    parts = recording.decompose(X[:3])
    assert parts.residual.max() <= 1e-12 and 0 < parts.model_gap.max() <= 1e-5
    assert parts.model_difference == 0.0


def test_weights_off_the_run_are_refused_at_their_step():
    """Steps that are not the optimiser's (here: recorded weights 1 % off from step 4
    on, what an unnoticed edit would leave): the move of step 3 is refused."""
    recording, _, X = cnn_adamw_run()
    recording.path_.weights[4:] *= 0.99
    recording.module_.load_state_dict(recording.final_state_dict())
    recording._live_module = None
    with pytest.raises(RecordingRefused, match=r"Step 3: .* beyond the step's rounding"):
        recording.decompose(X[:2])


def test_a_weight_that_is_not_a_number_is_refused_at_its_step():
    """A recorded weight that is NaN (a comparison with it is never true) is outside
    every bound: refused at the step that moved to it, not carried as rounding."""
    recording, _, X = cnn_adamw_run()
    recording.path_.weights[3, 0] = float("nan")
    recording._live_module = None
    with pytest.raises(RecordingRefused, match=r"Step 2: .* beyond the step's rounding"):
        recording.decompose(X[:2])


def test_a_penalty_in_a_float32_loop_is_refused_at_its_first_step():
    """A loss with a penalty on the weights (not a function of the module's output):
    its moves are not the recorded output gradients' update, refused at step 2 where
    the penalty starts, in a float32 loop too."""
    X, y = data(dtype=F32)
    model = mlp(F32)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    recorder = TrainingRecorder(model, optimizer, X, check="none")
    for step in range(5):
        rows = torch.arange(10 * (step % 3), 10 * (step % 3) + 10)
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        loss = torch.nn.functional.cross_entropy(out, y[rows])
        if step >= 2:
            loss = loss + 1e-2 * sum((p**2).sum() for p in model.parameters())
        loss.backward()
        optimizer.step()
    recording = recorder.finish()
    with pytest.raises(RecordingRefused, match=r"Step 2: .* beyond the step's rounding"):
        recording.decompose(X[:2])


@pytest.mark.slow
def test_adam_relu_run_whose_replay_would_drift_is_exact():
    """An honest float32 Adam run on a ReLU MLP (digits, 360 steps) whose float64
    replay from w_0 drifts far from the float32 weights (rounding amplified by Adam's
    large preconditioners, 0.37 apart): anchored at the recorded weights, its kernel
    is exact for them."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    X = torch.tensor(digits.data[:600] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:600])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    recorder = TrainingRecorder(model, optimizer, X)
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        order = torch.randperm(600, generator=generator)
        for start in range(0, 600, 50):
            rows = order[start : start + 50]
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            torch.nn.functional.cross_entropy(out, y[rows]).backward()
            optimizer.step()
    recording = recorder.finish()
    parts = recording.decompose(X[:2])
    assert parts.residual.max() <= 1e-11 and parts.model_gap.max() <= 1e-4
