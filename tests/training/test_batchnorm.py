"""BatchNorm trained in training mode: per-row gradients through the batch statistics,
the running statistics' moves split over the rows, the eval-mode network explained.

Independent computations: an MLP with BatchNorm written out by hand (training mode:
the batch's biased variance; eval mode: the running statistics), the running
statistics replayed by torch's documented update (momentum, or the cumulative
average of ``momentum=None``, unbiased batch variance), each row's gradient by its
own backward pass through the whole batch, and the test side integrated by
24-point Gauss-Legendre along each step of the joint (weights, statistics) line
of a smooth tanh network; the decomposition's sum held against the module's own
eval-mode output.
"""

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _rounding import assert_equal_to_rounding
from torch import nn
from torch.func import jacrev

from sklearn_pathkernel import ExactPathKernelClassifier, ExactPathKernelRegressor, TrainingRecorder
from sklearn_pathkernel._training import RecordingRefused

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.2),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.02),
}
EPS = 1e-5


def data(n=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.3).long()
    return X, y


def mlp(momentum=0.1, seed=0, affine=True, bias=False):
    """Linear, BatchNorm, tanh, Linear; without the bias before BatchNorm (the usual
    practice: the batch mean removes it, its gradient is zero but for rounding)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6, bias=bias),
        nn.BatchNorm1d(6, momentum=momentum, affine=affine),
        nn.Tanh(),
        nn.Linear(6, 3),
    ).double()


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    ).double()


def run(model, optimizer, X, y, *, epochs=3, batch_size=8, seed=1):
    """An ordinary loop with BatchNorm in training mode, and the recorder's two lines."""
    recorder = TrainingRecorder(model, optimizer, X, y)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    n = X.shape[0]
    size = batch_size or n
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, size):
            rows = order[start : start + size]
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
    model.eval()
    return recorder.finish()


def identity_error(parts, model, queries):
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    with torch.no_grad():
        own = model.eval()(queries)
    return np.abs(total - own.numpy()).max()


# -- recorded loops -------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [8, None], ids=["mini-batch", "full-batch"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_recorded_loop_with_batchnorm_is_exact(name, batch_size):
    X, y = data()
    model = mlp()
    initial = model[1].running_mean.clone()
    recording = run(model, OPTIMIZERS[name](model.parameters()), X, y, batch_size=batch_size)
    stats = recording.path_.running_statistics
    assert stats is not None and stats.values.shape == (recording.path_.n_steps + 1, 12)
    assert not torch.equal(model[1].running_mean, initial)  # the statistics did move
    assert stats.move_error() < 1e-15
    queries = X[:6] + 0.05
    parts = recording.decompose(queries)
    assert identity_error(parts, model, queries) <= 1e-9
    assert parts.residual.max() <= 1e-9
    # the statistics' share is part of the contributions, and not a small one
    assert parts.statistics.shape == parts.contributions.shape
    assert np.abs(parts.statistics.sum(1)).max() > 1e-3


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.1),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.2, weight_decay=0.05),
        lambda m: torch.optim.SGD(
            [
                {"params": m[0].parameters(), "lr": 0.1, "weight_decay": 0.05},
                {"params": [*m[1].parameters(), *m[3].parameters()]},
            ],
            lr=0.2,
            momentum=0.5,
        ),
    ],
    ids=["adamw", "sgd-weight-decay", "parameter-groups"],
)
def test_weight_decay_is_zero_on_the_statistics(make):
    """Decoupled and coupled weight decay, per parameter group: the decay term covers
    the weights only (the running statistics are not decayed)."""
    X, y = data()
    model = mlp()
    recording = run(model, make(model), X, y)
    queries = X[:5] + 0.05
    parts = recording.decompose(queries)
    assert np.abs(parts.decay).max() > 1e-3
    assert identity_error(parts, model, queries) <= 1e-9


def test_batchnorm_cnn_recorded_loop_is_exact():
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(20, 1, 6, 6, generator=generator, dtype=torch.float64)
    y = (X.mean((1, 2, 3)) > 0).long() + (X[:, 0, 0, 0] > 0).long()
    model = cnn()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), X, y)
    queries = X[:4] * 0.9
    parts = recording.decompose(queries)
    assert identity_error(parts, model, queries) <= 1e-9
    assert parts.residual.max() <= 1e-9


def test_momentum_none_and_no_affine_are_exact():
    """Cumulative averages (``momentum=None``, weight ``1 / num_batches_tracked``) and
    a BatchNorm without its own weights."""
    X, y = data()
    model = mlp(momentum=None, affine=False)
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.2), X, y)
    queries = X[:5] - 0.1
    parts = recording.decompose(queries)
    assert identity_error(parts, model, queries) <= 1e-9


# -- the independent reference ---------------------------------------------------------

SIZES = [24, 6, 6, 6, 18, 3]  # W1, b1, gamma, beta, W2, b2 (with the bias before BatchNorm)


def functional(flat, x, stats=None):
    """The MLP written out: training mode (batch statistics, biased variance) when
    ``stats`` is None, eval mode with the running statistics ``(mean, var)`` else."""
    W1, b1, gamma, beta, W2, b2 = torch.split(flat, SIZES)
    h = x @ W1.reshape(6, 4).T + b1
    if stats is None:
        mean, var = h.mean(0), h.var(0, unbiased=False)
    else:
        mean, var = stats
    z = torch.tanh((h - mean) / torch.sqrt(var + EPS) * gamma + beta)
    return z @ W2.reshape(3, 6).T + b2


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd", "momentum"])
def test_per_row_contributions_match_an_independent_reference(momentum):
    """SGD (and heavy-ball momentum): ``c_i(x) = sum_s [sum_{r <= s} lr mu^(s-r)
    <phi_s^w(x), g_{r,i}> + <phi_s^r(x), dr_{s,i}>]``, ``g_{r,i}`` row ``i``'s gradient
    at step ``r`` by its own backward pass through the batch, ``dr_{s,i}`` its share of
    the statistics' move by torch's update formula (not carried by momentum: the
    statistics move at their own step), ``phi_s`` the eval-mode Jacobian integrated
    along the joint line by Gauss-Legendre."""
    X, y = data()
    model, m = mlp(bias=True), 0.1
    lr = 0.2 if momentum == 0 else 0.05
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    recording = run(model, optimizer, X, y)
    path, stats = recording.path_, recording.path_.running_statistics
    queries = X[:4] - 0.1
    nodes, node_weights = np.polynomial.legendre.leggauss(24)
    nodes, node_weights = (nodes + 1) / 2, node_weights / 2
    reference = torch.zeros((4, X.shape[0], 3), dtype=torch.float64)
    mean, var = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    earlier = []  # (rows, per-row gradients) of the steps so far
    buffer = torch.zeros(63, dtype=torch.float64)
    for step in range(path.n_steps):
        w, rows = path.weights[step], torch.as_tensor(path.batches[step])
        batch = X[rows]
        # the running statistics by torch's documented update (unbiased batch variance)
        W1, b1 = torch.split(w, SIZES)[:2]
        h = batch @ W1.reshape(6, 4).T + b1
        new_mean = (1 - m) * mean + m * h.mean(0)
        new_var = (1 - m) * var + m * h.var(0, unbiased=True)
        recorded = stats.values[step + 1]
        assert torch.allclose(recorded, torch.cat([new_mean, new_var]), rtol=0, atol=1e-13)
        n = batch.shape[0]
        shares = torch.cat(
            [m * (h - mean) / n, m * ((h - h.mean(0)) ** 2 / (n - 1) - var / n)], dim=1
        )
        # each row's gradient through the batch: its own backward pass
        e = path.output_gradients[step]
        grads = []
        for i in range(n):
            flat = w.clone().requires_grad_(True)
            out = functional(flat, batch)[i]  # (the recording's f: the module's output)
            (g,) = torch.autograd.grad(out, flat, grad_outputs=e[i])
            grads.append(g)
        grads = torch.stack(grads)
        earlier.append((rows, grads))
        buffer = momentum * buffer + grads.sum(0)
        move = path.weights[step + 1] - w
        assert (move - lr * buffer).abs().max() <= 1e-14
        # the test side along the joint line
        r0 = torch.cat([mean, var])
        dr = recorded - r0
        phi_w, phi_r = 0, 0
        for t, nu in zip(nodes, node_weights, strict=True):
            joint = torch.cat([w + t * move, r0 + t * dr])

            def f(v):
                r = v[63:]
                return functional(v[:63], queries, (r[:6], r[6:]))

            jac = jacrev(f)(joint)  # (4, 3, 75)
            phi_w = phi_w + nu * jac[..., :63]
            phi_r = phi_r + nu * jac[..., 63:]
        for r, (r_rows, r_grads) in enumerate(earlier):
            scale = lr * momentum ** (step - r)
            reference.index_add_(1, r_rows, scale * torch.einsum("qkw,iw->qik", phi_w, r_grads))
        reference.index_add_(1, rows, torch.einsum("qkr,ir->qik", phi_r, shares))
        mean, var = new_mean, new_var
    parts = recording.decompose(queries)
    assert np.abs(parts.contributions - reference.numpy()).max() <= 1e-9


# -- the estimators ---------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [10, 40], ids=["mini-batch", "full-batch"])
@pytest.mark.parametrize(
    "solver",
    [{"solver": "sgd"}, {"solver": "sgd", "momentum": 0.9}, {"solver": "adam"}],
    ids=["sgd", "momentum", "adam"],
)
def test_estimator_trains_batchnorm_in_training_mode(solver, batch_size):
    X, y = data(40)
    X, y = X.numpy(), y.numpy()
    clf = ExactPathKernelClassifier(
        module=mlp(momentum=None), max_iter=3, batch_size=batch_size, random_state=0, **solver
    ).fit(X, y)
    assert not clf.module_.training
    assert clf.path_.running_statistics is not None
    parts = clf.decompose(X[:5])
    assert parts.residual.max() <= 1e-9
    with torch.no_grad():
        own = F.log_softmax(clf.module_(torch.as_tensor(X[:5])), dim=1).numpy()
    total = parts.bias + parts.contributions.sum(1) + parts.decay
    assert np.abs(total - own).max() <= 1e-9
    with pytest.raises(NotImplementedError, match="BatchNorm trained in training mode"):
        clf.kernel_(X[:2])


def test_regressor_trains_batchnorm_in_training_mode():
    rng = np.random.RandomState(0)
    X = rng.randn(40, 4)
    y = X[:, 0] - X[:, 1] ** 2
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)
    ).double()
    reg = ExactPathKernelRegressor(
        module=module, max_iter=5, batch_size=10, solver="adam", random_state=0
    ).fit(X, y)
    parts = reg.decompose(X[:5])
    total = (parts.bias + parts.contributions.sum(1) + parts.decay).ravel()
    assert np.abs(total - reg.predict(X[:5])).max() <= 1e-9
    assert parts.statistics.shape == parts.contributions.shape == (5, 40)
    assert np.abs(parts.statistics.sum(1)).max() > 1e-3


def test_estimator_with_a_batchnorm_cnn():
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(30, 36, generator=generator, dtype=torch.float64)
    y = (X.mean(1) > 0).long() + (X[:, 0] > 0).long()
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Unflatten(1, (1, 6, 6)),
        nn.Conv2d(1, 3, 3, bias=False),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 3),
    ).double()
    clf = ExactPathKernelClassifier(
        module=module, max_iter=3, batch_size=10, solver="adam", random_state=0
    ).fit(X.numpy(), y.numpy())
    parts = clf.decompose(X[:4].numpy())
    total = parts.bias + parts.contributions.sum(1) + parts.decay
    assert np.abs(total - clf.predict_log_proba(X[:4].numpy())).max() <= 1e-9
    assert parts.residual.max() <= 1e-9


def test_a_bias_before_batchnorm_under_adam_shows_in_the_residual():
    """The bias just before a BatchNorm has a zero gradient in training mode but for
    rounding, which Adam divides by a tiny second moment: the run moves it by about
    lr * 1e-9 per step, which the per-row gradients reproduce only to rounding. The
    residual shows it (honestly); without that bias it is at rounding level."""
    X, y = data(40)
    X, y = X.numpy(), y.numpy()
    residuals = {}
    for bias in (True, False):
        clf = ExactPathKernelClassifier(
            module=mlp(bias=bias), max_iter=3, batch_size=10, solver="adam", random_state=0
        ).fit(X, y)
        parts = clf.decompose(X[:5])
        with torch.no_grad():
            own = F.log_softmax(clf.module_(torch.as_tensor(X[:5])), dim=1).numpy()
        total = parts.bias + parts.contributions.sum(1) + parts.decay
        assert np.allclose(parts.residual, np.abs(total - own).max(1), rtol=0, atol=1e-15)
        residuals[bias] = parts.residual.max()
    assert residuals[False] <= 1e-10 < residuals[True] <= 1e-8


# -- refusals -------------------------------------------------------------------------


def test_track_running_stats_false_is_refused():
    X, y = data()
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6, track_running_stats=False), nn.Linear(6, 3)
    ).double()
    with pytest.raises(RecordingRefused, match="track_running_stats=False"):
        TrainingRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1), X, y)
    with pytest.raises(ValueError, match="track_running_stats=False"):
        ExactPathKernelClassifier(module=model, max_iter=1).fit(X.numpy(), y.numpy())


def test_other_batchnorm_types_in_training_mode_are_refused():
    class MyNorm(nn.BatchNorm1d):
        pass

    X, y = data()
    model = nn.Sequential(nn.Linear(4, 6), MyNorm(6), nn.Linear(6, 3)).double()
    with pytest.raises(ValueError, match="only nn.BatchNorm1d and nn.BatchNorm2d"):
        ExactPathKernelClassifier(module=model, max_iter=1).fit(X.numpy(), y.numpy())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RecordingRefused, match="MyNorm"):
        run(model, optimizer, X, y, epochs=1)


def test_micro_batches_and_untracked_passes_are_refused():
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X, y)
    model.train()
    optimizer.zero_grad()
    for rows in (torch.arange(0, 6), torch.arange(6, 12)):
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
    with pytest.raises(RecordingRefused, match="micro-batches"):
        optimizer.step()

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X, y)
    model.train()
    with torch.no_grad():
        model(X[:8])  # moves the running statistics, unrecorded
    optimizer.zero_grad()
    out = model(X[8:16])
    recorder.rows(torch.arange(8, 16))
    F.cross_entropy(out, y[8:16]).backward()
    with pytest.raises(RecordingRefused, match="changed outside the step's recorded"):
        optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float32_run_is_exact_for_its_replay(name):
    """A float32 run: exact for its float64 replay (the running statistics replayed
    with the weights), the float32 model within ``model_gap`` of it."""
    X, y = data()
    model = mlp().float()
    recording = run(model, OPTIMIZERS[name](model.parameters()), X.float(), y)
    parts = recording.decompose(X[:6] + 0.05)
    assert parts.residual.max() <= 1e-9
    assert 0 < parts.model_gap.max() <= 1e-5
    replayed = recording._float64_run().path.running_statistics
    recorded = recording.path_.running_statistics.values[-1].double()
    assert 0 < (replayed.values[-1] - recorded).abs().max() <= 1e-5


def test_saved_and_loaded_recording_keeps_the_statistics(tmp_path):
    X, y = data()
    model = mlp()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), X, y)
    queries = X[:4] + 0.1
    before = recording.decompose(queries)
    recording.save(tmp_path / "run")
    loaded = type(recording).load(tmp_path / "run", mlp(), X)
    stats, read = recording.path_.running_statistics, loaded.path_.running_statistics
    assert torch.equal(read.values, stats.values) and read.factors == stats.factors
    after = loaded.decompose(queries)
    np.testing.assert_array_equal(after.contributions, before.contributions)
    np.testing.assert_array_equal(after.statistics, before.statistics)


def test_dropout_and_batchnorm_together_are_exact():
    """The step's dropout masks and its batch statistics in one training pass."""
    X, y = data()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6, bias=False), nn.BatchNorm1d(6), nn.Tanh(), nn.Dropout(0.3), nn.Linear(6, 3)
    ).double()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), X, y)
    assert recording.path_.dropout_masks is not None
    queries = X[:5] + 0.05
    parts = recording.decompose(queries)
    assert identity_error(parts, model, queries) <= 1e-9


def test_early_stopping_restores_weights_and_statistics():
    """finish(at_step=k) after restoring a checkpoint of step k (weights and running
    statistics): the recording is the run's first k steps."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    recorder = TrainingRecorder(model, optimizer, X, y)
    model.train()
    checkpoint = None
    for step in range(5):
        if step == 3:
            checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
        rows = torch.arange(8) + 8 * (step % 3)
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    model.load_state_dict(checkpoint)
    model.eval()
    recording = recorder.finish(at_step=3)
    assert recording.path_.n_steps == 3
    assert recording.path_.running_statistics.values.shape[0] == 4
    queries = X[:4]
    parts = recording.decompose(queries)
    assert identity_error(parts, model, queries) <= 1e-9


def test_what_needs_a_training_copy_is_refused_by_name():
    """Gram matrices, attribution over time and self-influence from a later epoch
    need a row's gradient outside the batch it was trained in: refused, naming the
    reason; the explanations by contributions work (and self-influence, below, and
    counterfactual attribution, tests/engine/test_adjoint.py)."""
    X, y = data()
    model = mlp()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.2), X, y)
    for call in (
        lambda: recording.gram(X[:3]),
        lambda: recording.self_influence(first_epoch=1),
        lambda: recording.explain_over_time(X[:2]),
    ):
        with pytest.raises(NotImplementedError, match="BatchNorm trained in training mode"):
            call()
    explanation = recording.explain(X[:2], k=3)
    parts = recording.decompose(X[:2])
    strongest = -np.sort(-parts.contributions, axis=1)[:, :3].transpose(0, 2, 1)  # (n, K, 3)
    np.testing.assert_allclose(explanation.proponent_values, strongest, rtol=0, atol=1e-12)
    np.testing.assert_allclose(explanation.output, parts.output, rtol=0, atol=1e-12)


def test_a_module_left_in_training_mode_is_evaluated_in_eval_mode():
    """The network explained is the eval-mode one: a live module left in training mode
    after the loop is compared in eval mode, its running statistics untouched."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    recorder = TrainingRecorder(model, optimizer, X, y)
    model.train()
    for step in range(3):
        rows = torch.arange(8) + 8 * step
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    recording = recorder.finish()  # (no model.eval())
    statistics = model[1].running_mean.clone()
    for _ in range(2):  # the second query would see moved statistics
        parts = recording.decompose(X[:4])
        assert parts.residual.max() <= 1e-9 and parts.model_gap.max() == 0
    assert model.training and torch.equal(model[1].running_mean, statistics)


def test_a_pickled_estimator_keeps_its_statistics():
    X, y = data(40)
    X, y = X.numpy(), y.numpy()
    clf = ExactPathKernelClassifier(module=mlp(), max_iter=2, batch_size=10, random_state=0)
    clf.fit(X, y)
    before = clf.decompose(X[:3])
    loaded = pickle.loads(pickle.dumps(clf))
    after = loaded.decompose(X[:3])
    np.testing.assert_array_equal(after.contributions, before.contributions)
    np.testing.assert_array_equal(after.statistics, before.statistics)


@pytest.mark.parametrize("target", ["predicted", "margin"])
def test_scalar_targets_take_the_statistics_shares(target):
    """A scalar target per query: its contributions (the statistics' shares
    included) add up to T's move, and the output column equals the full
    decomposition's column with its statistics part."""
    X, y = data()
    model = mlp()
    recording = run(model, OPTIMIZERS["momentum"](model.parameters()), X, y)
    queries = X[:5] + 0.05
    full = recording.decompose(queries)
    parts = recording.decompose(queries, target=target)
    assert parts.contributions.shape == parts.statistics.shape == (5, X.shape[0])
    moved = parts.output - parts.bias - parts.decay
    np.testing.assert_allclose(parts.contributions.sum(axis=1), moved, atol=1e-9)
    assert parts.residual.max() <= 1e-9
    if target == "predicted":
        column = parts.labels
        rows = np.arange(5)
        np.testing.assert_allclose(
            parts.contributions, full.contributions[rows, :, column], atol=1e-12
        )
        np.testing.assert_allclose(parts.statistics, full.statistics[rows, :, column], atol=1e-12)


@pytest.mark.parametrize("edit", ["in place", "stray training pass"])
def test_statistics_changed_after_finish_are_refused(edit):
    """The model the user holds is checked with its running statistics: a moved
    statistic after ``finish`` (an edit, or a forward pass in training mode) is
    refused by name, not decomposed as if it were the recorded network."""
    X, y = data()
    model = mlp()
    recording = run(model, OPTIMIZERS["momentum"](model.parameters()), X, y)
    assert recording.decompose(X[:3]).residual.max() <= 1e-9
    if edit == "in place":
        with torch.no_grad():
            model[1].running_mean.add_(0.5)
    else:
        model.train()
        model(X[:8])
    with pytest.raises(RecordingRefused, match="1.running_mean"):
        recording.decompose(X[:3])


@pytest.mark.parametrize("tile_rows", [None, 7])
def test_self_influence_is_the_diagonal_of_the_training_rows_decomposition(
    tile_rows, monkeypatch
):
    """Without a training copy, self-influence is the diagonal of the decomposition
    of the training rows, tile by tile, for every output and for a scalar target: to
    a few units in the last place of the largest value (bitwise where the BLAS adds a
    row's products in the same order whatever the tile's number of rows; MKL on an
    AVX2 processor does not)."""
    X, y = data(40)
    X, y = X.numpy(), y.numpy()
    clf = ExactPathKernelClassifier(
        module=mlp(), max_iter=2, batch_size=10, random_state=0, solver="sgd", momentum=0.9
    ).fit(X, y)
    if tile_rows is not None:  # (several tiles, the last one short)
        monkeypatch.setattr(
            "sklearn_pathkernel._engine._facade.SELF_TILE_BYTES", 8 * 40 * 3 * tile_rows
        )
    own = np.arange(len(X))
    found = clf.self_influence()
    expected = clf.decompose(X).contributions[own, own]
    assert_equal_to_rounding(found.values, expected)
    margin = clf.self_influence(target="margin")
    expected = clf.decompose(X, y=y, target="margin").contributions[own, own]
    assert_equal_to_rounding(margin.values[:, 0], expected)
    assert np.abs(found.values).max() > 1e-3
