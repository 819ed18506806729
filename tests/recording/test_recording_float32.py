"""Float32 runs: the kernel of the float64 replay of the recorded run.

Independent computations: the test's own step-by-step check of the linear form
(``test_recorder.replay``: autograd gradients of the recorded rows at the
replayed weights, a hand-kept buffer) applied to the replayed path; the float64
network evaluated at the replayed final weights by ``functional_call``; the
float32 module's own output; for float64 runs, the engine as it was built before
the replay existed.
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
from sklearn_pathkernel._training._replay import (
    ROUNDING_STEPS,
    replay_bound,
    replay_differences,
)

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
def test_float32_run_is_exact_for_its_float64_replay(name):
    recording, X = recorded(name, torch.float32)
    engine = recording._engine()
    path = engine.path
    assert path.weights.dtype == torch.float64 and recording.path_.weights.dtype == torch.float32
    # the replay starts at the recorded w_0 and follows the recorded run closely
    np.testing.assert_array_equal(path.weights[0].numpy(), recording.path_.weights[0].double())
    drift = (path.weights - recording.path_.weights.double()).abs().max()
    assert 0 < drift <= 1e-5
    # independently: every replayed move is the linear form of the float64 gradients
    replayed = SimpleNamespace(
        path_=path,
        module_=copy.deepcopy(recording.module_).double(),
        X_train_=recording.X_train_.double(),
        dtype=torch.float64,
    )
    worst, largest = replay(replayed)
    assert worst <= 1e-14 * max(largest, 1.0)

    queries = X[:6] + 0.05
    parts = recording.decompose(queries)
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    module64 = copy.deepcopy(recording.module_).double()
    with torch.no_grad():
        final = path.unflatten(path.weights[-1])
        output = functional_call(module64, final, (queries.double(),)).numpy()
        own = recording.module_(queries).double().numpy()
    np.testing.assert_array_equal(parts.output, output)  # the float64 replayed network
    assert np.abs(total - output).max() <= 1e-9
    assert parts.residual.max() <= 1e-9 and parts.quadrature_error.max() <= 1e-9
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
def test_honest_float32_runs_stay_within_the_bound(name):
    if name == "cnn-adamw":
        recording, _, X = cnn_adamw_run()
    else:
        recording, X = recorded("adamw" if name == "mlp-adamw" else "sgd-momentum-decay", F32)
    engine = recording._engine()  # (refused beyond the bound)
    bounds = replay_bound(recording.path_)
    differences = replay_differences(recording.path_, engine.path)
    assert max(differences[k] / bounds[k] for k in bounds) < 0.05  # a margin of 20
    parts = recording.decompose(X[:3])
    assert parts.residual.max() <= 1e-9 and 0 < parts.model_gap.max() <= 1e-5
    assert parts.model_difference == 0.0


def test_replay_beyond_the_bound_is_refused():
    """Steps that are not the optimiser's (here: recorded weights 1 % off from step 4
    on, what an unnoticed edit would leave) put the replay beyond the bound."""
    recording, _, X = cnn_adamw_run()
    recording.path_.weights[4:] *= 0.99
    recording.module_.load_state_dict(recording.final_state_dict())
    recording._live_module = None
    with pytest.raises(RecordingRefused, match=r"beyond the run's rounding bound"):
        recording.decompose(X[:2])


@pytest.mark.slow
def test_adam_relu_run_whose_replay_drifts_is_refused():
    """An honest float32 Adam run on a ReLU MLP (digits, 360 steps) whose float64
    replay drifts far from the float32 weights (rounding amplified by Adam's large
    preconditioners): refused, rather than a kernel of another network."""
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
    with pytest.raises(
        RecordingRefused, match="beyond the run's rounding bound .* train in float64"
    ):
        recording.decompose(X[:2])
