"""Parameter groups with their own learning rate, momentum, Nesterov flag, betas and
weight decay (0 on the biases), with a per-group schedule and a frozen parameter.

Independent computations: the same loop run by torch.optim without the recorder
(the recorded weights are its weights); every step rebuilt from the recorded
per-parameter linear form with autograd gradients and a hand-kept buffer
(``replay``: it must land on torch's weights); the decomposition's sum against the
module's own output; and the brute-force reference (Algorithm 1's explicit double
sum over (step, earlier step) pairs with materialised Jacobians, each pair weighted
by its per-parameter mixing coefficient) on a tiny network, under the same
quadrature nodes.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _recorded_loops import data, mlp, replay
from _reference import NaivePathKernelEngine

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._path import Blockwise, FunctionLink
from sklearn_pathkernel._recording._recording import Recording, output_function


def three_groups(model, first, second, biases):
    """The first layer's weight, the last layer's weight, and the trained biases
    (each dict: that group's own settings)."""
    biases_params = [p for p in (model[0].bias, model[2].bias) if p.requires_grad]
    return [
        {"params": [model[0].weight], **first},
        {"params": [model[2].weight], **second},
        {"params": biases_params, **biases},
    ]


GROUPED = {
    "sgd-momentum-decay": lambda m: torch.optim.SGD(
        three_groups(
            m,
            {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.05},
            {"momentum": 0.5, "weight_decay": 0.01},
            {"lr": 0.05, "momentum": 0.0, "weight_decay": 0.0},
        ),
        lr=0.1,
    ),
    "sgd-nesterov-mixed": lambda m: torch.optim.SGD(
        three_groups(
            m,
            {"nesterov": True, "weight_decay": 0.02},
            {"momentum": 0.6},
            {"nesterov": True, "momentum": 0.9, "lr": 0.2},
        ),
        lr=0.1,
        momentum=0.8,
    ),
    "adam-decay-betas": lambda m: torch.optim.Adam(
        three_groups(
            m,
            {"betas": (0.8, 0.99), "weight_decay": 0.05},
            {"lr": 0.01, "weight_decay": 0.01},
            {"betas": (0.7, 0.9), "eps": 1e-6, "weight_decay": 0.0},
        ),
        lr=0.02,
    ),
    "adamw-decay-betas": lambda m: torch.optim.AdamW(
        three_groups(
            m,
            {"betas": (0.85, 0.99)},
            {"lr": 0.01, "weight_decay": 0.2},
            {"betas": (0.7, 0.9), "weight_decay": 0.0},
        ),
        lr=0.02,
        weight_decay=0.1,
    ),
    # The most common configuration: decay on the weights, none on the biases.
    "adamw-no-decay-on-biases": lambda m: torch.optim.AdamW(
        [
            {"params": [m[0].weight, m[2].weight]},
            {"params": [p for p in (m[0].bias, m[2].bias) if p.requires_grad], "weight_decay": 0},
        ],
        lr=0.02,
        weight_decay=0.1,
    ),
}


def per_group_schedule(optimizer):
    """LambdaLR with a schedule of its own per group."""
    lambdas = [lambda s: 1 / (1 + 0.2 * s), lambda s: 0.9**s, lambda s: 1.0 + 0.1 * (s % 2)]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas[: len(optimizer.param_groups)])


def loop(model, optimizer, X, y, scheduler=None, recorder=None, epochs=3, batch_size=8):
    """An ordinary loop (a short last batch); returns the trainable parameters'
    flat weights after every step."""
    generator = torch.Generator().manual_seed(1)
    trained = [p for p in model.parameters() if p.requires_grad]
    weights = [torch.cat([p.detach().reshape(-1) for p in trained])]
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=generator)
        for start in range(0, X.shape[0], batch_size):
            rows = order[start : start + batch_size]
            optimizer.zero_grad()
            out = model(X[rows])
            if recorder is not None:
                recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            weights.append(torch.cat([p.detach().reshape(-1) for p in trained]))
    return torch.stack(weights)


def recorded_and_bare(name, frozen, scheduled, X, y, **kwargs):
    """The recording of the loop, and the weights of the same loop without recorder."""
    runs = []
    for record in (True, False):
        model = mlp(X.dtype)
        if frozen:
            model[0].bias.requires_grad_(False)
        optimizer = GROUPED[name](model)
        scheduler = per_group_schedule(optimizer) if scheduled else None
        recorder = TrainingRecorder(model, optimizer, X) if record else None
        runs.append(loop(model, optimizer, X, y, scheduler, recorder, **kwargs))
        if record:
            recording = recorder.finish()
    return recording, runs[1]


@pytest.mark.parametrize("variant", ["constant", "scheduler-frozen"])
@pytest.mark.parametrize("name", GROUPED)
def test_groups_identity(name, variant):
    X, y = data()
    recording, bare = recorded_and_bare(name, variant != "constant", variant != "constant", X, y)
    assert recording.n_steps_ == 12
    # The recorded weights are torch.optim's own run's.
    assert (recording.path_.weights - bare).abs().max() <= 1e-14
    # The per-parameter linear form reproduces torch.optim's every step.
    worst, largest = replay(recording)
    assert largest > 1e-3
    assert worst <= 1e-14
    parts = recording.decompose(X[:6])
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    with torch.no_grad():
        own = recording.module_(X[:6]).numpy()
    np.testing.assert_allclose(total, own, rtol=0, atol=1e-9)
    assert parts.residual.max() <= 1e-9
    # Weight decay that differs between the groups moves the output.
    assert np.abs(parts.decay).max() > 0


@pytest.mark.parametrize("name", GROUPED)
def test_groups_float32(name):
    """A float32 run: the recorded weights are torch.optim's; the kernel is the
    float64 replay's (with the same per-parameter coefficients), its sum exact, and
    the float32 model's own gap reported apart."""
    X, y = data(dtype=torch.float32)
    recording, bare = recorded_and_bare(name, True, True, X, y)
    assert torch.equal(recording.path_.weights, bare)
    worst, largest = replay(recording)
    assert worst <= 1e-4 * largest
    parts = recording.decompose(X[:6])
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    np.testing.assert_allclose(total, parts.output, rtol=0, atol=1e-9)
    assert parts.residual.max() <= 1e-9
    assert 0 < parts.model_gap.max() <= 1e-5


def test_groups_that_differ_are_per_parameter_coefficients():
    X, y = data()
    recording, _ = recorded_and_bare("sgd-nesterov-mixed", False, False, X, y, epochs=1)
    update, numels = recording.path_.update, [6 * 4, 6, 3 * 6, 3]
    # path order: 0.weight, 0.bias, 2.weight, 2.bias; groups: w0, w2, biases
    assert update.buffer_decay == Blockwise([0.8, 0.9, 0.6, 0.9], numels)
    assert update.coupled_decay == Blockwise([0.02, 0.0, 0.0, 0.0], numels)
    # alpha_s = mu (Nesterov) or 1, zeta_s = 1 (Nesterov) or 0, times the step's
    # rate (the largest learning rate, 0.2); each group's own rate relative to it
    # is its P_s
    rate = 0.2
    np.testing.assert_allclose(update.gradient_rates[0].values / rate, [0.8, 0.9, 1.0, 0.9])
    np.testing.assert_allclose(update.direct_rates[0].values / rate, [1.0, 1.0, 0.0, 1.0])
    P = update.preconditioners[0].numpy()
    np.testing.assert_array_equal(P, np.repeat([0.5, 1.0, 0.5, 1.0], numels))


def test_one_group_stays_numbers():
    X, y = data()
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    recorder = TrainingRecorder(model, optimizer, X)
    loop(model, optimizer, X, y, recorder=recorder, epochs=1)
    update = recorder.finish().path_.update
    for value in (update.buffer_decay, update.gradient_scale, update.coupled_decay):
        assert isinstance(value, float)
    for rates in (update.gradient_rates, update.direct_rates, update.decoupled_decays):
        assert rates.dtype == np.float64


def tiny_recording(name):
    """A 4-3-2 tanh network, 3 steps of 4 rows, with the scheduler and a frozen bias."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)
    ).double()
    model[0].bias.requires_grad_(False)
    X, y = data(n=8)
    y = y.clamp(max=1)
    optimizer = GROUPED[name](model)
    scheduler = per_group_schedule(optimizer)
    recorder = TrainingRecorder(model, optimizer, X)
    loop(model, optimizer, X, y, scheduler, recorder, epochs=1, batch_size=3)
    return recorder.finish(), X


@pytest.mark.parametrize("name", GROUPED)
def test_contributions_match_the_brute_force_reference(name):
    recording, X = tiny_recording(name)
    module = copy.deepcopy(recording.module_).eval()
    path = recording.path_
    fast = PathKernelEngine(
        module, path, X, link=FunctionLink(output_function(None)), quadrature="gauss", n_points=24
    )
    reference = NaivePathKernelEngine(
        module, path, X, link=lambda out: out, quadrature="gauss", n_points=24
    )
    queries = torch.tensor(np.random.RandomState(1).randn(4, 4))
    mine, theirs = fast.decompose(queries), reference.decompose(queries)
    scale = max(1.0, np.abs(theirs.contributions).max())
    np.testing.assert_allclose(mine.contributions, theirs.contributions, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(mine.decay, theirs.decay, rtol=0, atol=1e-12)
    assert np.abs(theirs.decay).max() > 1e-6
    # ... both add up to the module's own output, and the stepwise terms and the
    # self-influence (the engine's other two uses of the coefficients) agree.
    with torch.no_grad():
        own = module(queries).numpy()
    total = mine.bias + mine.contributions.sum(1) + mine.decay
    np.testing.assert_allclose(total, own, rtol=0, atol=1e-9)
    stepwise = fast.stepwise()
    summed = np.zeros_like(mine.contributions)
    for term in stepwise.terms(queries):
        np.add.at(summed, (slice(None), term.batch), term.values)
    np.testing.assert_allclose(summed, mine.contributions, rtol=0, atol=1e-12 * scale)
    diagonal = fast.decompose(X).contributions[np.arange(len(X)), np.arange(len(X))]
    np.testing.assert_allclose(stepwise.self_influence(), diagonal, rtol=0, atol=1e-12 * scale)


def test_unreached_parameter_gets_no_decoupled_decay():
    """A parameter the loss never reaches has no gradient: torch.optim neither moves
    nor decays it (AdamW's decay is per group and skips it); recorded as d_s = 0
    there (formerly refused)."""
    X, y = data()
    model = mlp()
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(5, dtype=torch.float64)))
    optimizer = torch.optim.AdamW(
        [{"params": [*model[0].parameters(), model.unused]}, {"params": model[2].parameters()}],
        lr=0.02,
        weight_decay=0.1,
    )
    recorder = TrainingRecorder(model, optimizer, X)
    loop(model, optimizer, X, y, recorder=recorder, epochs=1)
    recording = recorder.finish()
    assert torch.equal(model.unused.detach(), torch.ones(5, dtype=torch.float64))
    decays = recording.path_.update.decoupled_decays[0]
    unused = recording.path_.param_names.index("unused")
    assert isinstance(decays, Blockwise) and decays.values[unused] == 0.0
    assert (decays.values < 0).sum() == len(decays.values) - 1
    worst, _ = replay(recording)
    assert worst <= 1e-14
    parts = recording.decompose(X[:4])
    with torch.no_grad():
        own = model(X[:4]).numpy()
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    np.testing.assert_allclose(total, own, rtol=0, atol=1e-9)


def test_save_and_load_keep_the_per_parameter_coefficients(tmp_path):
    X, y = data()
    recording, _ = recorded_and_bare("sgd-momentum-decay", True, True, X, y, epochs=1)
    recording.save(tmp_path)
    fresh = mlp()
    fresh[0].bias.requires_grad_(False)
    loaded = Recording.load(tmp_path, fresh, X)
    saved, read = recording.path_.update, loaded.path_.update
    for name in ("buffer_decay", "gradient_scale", "coupled_decay"):
        assert getattr(read, name) == getattr(saved, name)
    for name in ("gradient_rates", "direct_rates", "decoupled_decays"):
        assert list(getattr(read, name)) == list(getattr(saved, name))
    assert isinstance(read.buffer_decay, Blockwise)
    expected, parts = recording.decompose(X[:3]), loaded.decompose(X[:3])
    np.testing.assert_array_equal(parts.contributions, expected.contributions)
    np.testing.assert_array_equal(parts.decay, expected.decay)
