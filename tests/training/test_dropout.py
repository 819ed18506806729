"""Dropout trained exactly: the recorder draws and keeps each step's masks, the
training side of the kernel uses them, the query side is the eval-mode network.

Independent computations: the step's move recomputed by hand (a functional MLP
written out, ``W2 (tanh(W1 x + b1) * m / (1 - p)) + b2`` with the recorded masks,
plain autograd) must be the recorded move; the per-row contributions of plain
SGD recomputed from that functional form (the training side with the masks, the
query side's gradient integrated by 24-point Gauss-Legendre along each step of a
smooth tanh network); the decomposition's sum held against the module's own
eval-mode output.
"""

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jacrev

from sklearn_pathkernel import ExactPathKernelClassifier, TrainingRecorder
from sklearn_pathkernel._path import masks_applied
from sklearn_pathkernel._training import RecordingRefused

P = 0.3
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.2),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.02),
}


def data(n=30, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.3).long()
    return X.to(dtype), y


def mlp(dtype=torch.float64, seed=0, inplace=False):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Dropout(P, inplace=inplace), nn.Linear(6, 3)
    ).to(dtype)


def run(model, optimizer, X, y, *, epochs=3, batch_size=8, seed=1):
    """An ordinary loop with dropout in training mode, and the recorder's two lines."""
    recorder = TrainingRecorder(model, optimizer, X, y)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=generator)
        for start in range(0, X.shape[0], batch_size or X.shape[0]):
            rows = order[start : start + (batch_size or X.shape[0])]
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
    model.eval()
    return recorder.finish()


def identity_error(recording, queries):
    parts = recording.decompose(queries)
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    with torch.no_grad():
        own = recording.module_.eval()(queries.to(recording.path_.weights.dtype))
    return np.abs(total - own.double().numpy()).max(), parts


def functional_mlp(flat, x, mask):
    """The MLP written out: ``W2 (tanh(W1 x + b1) * m / (1 - p)) + b2`` (mask None:
    eval mode)."""
    W1, b1, W2, b2 = torch.split(flat, [24, 6, 18, 3])
    hidden = torch.tanh(x @ W1.reshape(6, 4).T + b1)
    if mask is not None:
        hidden = hidden * (mask.to(hidden.dtype) / (1 - P))
    return hidden @ W2.reshape(3, 6).T + b2


# -- a recorded loop --------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [8, None], ids=["mini-batch", "full-batch"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_recorded_loop_with_dropout_is_exact(name, batch_size):
    X, y = data()
    model = mlp()
    recording = run(model, OPTIMIZERS[name](model.parameters()), X, y, batch_size=batch_size)
    masks = recording.path_.dropout_masks
    assert masks is not None and len(masks) == recording.path_.n_steps
    assert masks[0]["2"].dtype == torch.bool and masks[0]["2"].shape == (batch_size or 30, 6)
    dropped = float(torch.cat([m["2"].reshape(-1) for m in masks]).logical_not().float().mean())
    assert 0.15 < dropped < 0.45  # the layer did drop units, about p of them
    error, parts = identity_error(recording, X[:6] + 0.05)
    assert error <= 1e-9 and parts.residual.max() <= 1e-9

    # Without the masks (every unit kept) the recorded moves are not the linear form
    # of the output gradients: refused at the first step, before any kernel.
    path = recording.path_
    kept = [{n: torch.ones_like(m) for n, m in step.items()} for step in path.dropout_masks]
    path.dropout_masks, saved = kept, path.dropout_masks
    try:
        unmasked = copy.deepcopy(recording)
        with pytest.raises(RecordingRefused, match="Step 0: the recorded move of"):
            identity_error(unmasked, X[:6] + 0.05)
    finally:
        path.dropout_masks = saved


def test_the_recorded_masks_are_the_run_s():
    """Each step's move is ``lr sum_i J_i(w_s; m_{s,i})^T e_{s,i}`` with the recorded
    masks, the Jacobians of the functional MLP by plain autograd (SGD)."""
    X, y = data()
    model = mlp()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.2), X, y)
    path = recording.path_
    for step in range(path.n_steps):
        w = path.weights[step].clone().requires_grad_(True)
        rows = torch.as_tensor(path.batches[step])
        out = functional_mlp(w, X[rows], path.masks(step)["2"])
        (gradient,) = torch.autograd.grad(out, w, grad_outputs=-path.output_gradients[step])
        move = path.weights[step + 1] - path.weights[step]
        assert (move + 0.2 * gradient).abs().max() <= 1e-15


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd", "momentum"])
def test_per_row_contributions_match_an_independent_reference(momentum):
    """SGD (and heavy-ball momentum, ``b_s = mu b_{s-1} + G_s``) on a tanh network:
    row ``i``'s gradient of step ``r`` moves every later step ``s`` by ``lr mu^(s-r)``
    times it, so ``c_i(x) = sum_{r <= s} lr mu^(s-r) <phi_s(x), J_i(w_r; m_{r,i})^T
    e_{r,i}>``, ``phi_s`` the eval-mode Jacobian integrated by Gauss-Legendre."""
    X, y = data()
    model = mlp()
    lr = 0.2 if momentum == 0 else 0.05
    recording = run(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), X, y)
    path = recording.path_
    queries = X[:5] - 0.1
    nodes, weights = np.polynomial.legendre.leggauss(24)
    nodes, weights = (nodes + 1) / 2, weights / 2
    phis = []
    for step in range(path.n_steps):
        start, end = path.weights[step], path.weights[step + 1]
        phis.append(
            sum(
                nu * jacrev(lambda w: functional_mlp(w, queries, None))(start + t * (end - start))
                for t, nu in zip(nodes, weights, strict=True)
            )
        )  # (n, K, W)
    reference = np.zeros((queries.shape[0], X.shape[0], 3))
    for step in range(path.n_steps):
        start = path.weights[step]
        rows = torch.as_tensor(path.batches[step])
        masks = path.masks(step)["2"]
        for j, row in enumerate(rows.tolist()):
            x, mask = X[row : row + 1], masks[j : j + 1]
            J = jacrev(lambda w, x=x, mask=mask: functional_mlp(w, x, mask))(start)[0]  # (K, W)
            gradient = J.T @ path.output_gradients[step][j]
            for later in range(step, path.n_steps):
                rate = lr * momentum ** (later - step)
                reference[:, row] += rate * (phis[later] @ gradient).numpy()
    parts = recording.decompose(queries)
    assert np.abs(reference).max() > 0.05
    assert np.abs(parts.contributions - reference).max() <= 1e-9
    assert np.abs(parts.decay).max() == 0.0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float32_runs(name):
    """A float32 run is exact for its float64 replay, which uses the run's masks."""
    X, y = data(dtype=torch.float32)
    model = mlp(torch.float32)
    recording = run(model, OPTIMIZERS[name](model.parameters()), X, y)
    parts = recording.decompose(X[:4] + 0.05)
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    assert np.abs(total - parts.output).max() <= 1e-9 and parts.residual.max() <= 1e-9
    assert 0 < parts.model_gap.max() <= 1e-5


def test_in_place_dropout_and_float32():
    X, y = data(dtype=torch.float32)
    model = mlp(torch.float32, inplace=True)
    recording = run(model, torch.optim.Adam(model.parameters(), lr=0.02), X, y)
    parts = recording.decompose(X[:4])
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    # exact for the float64 replay of the run (with its masks), as any float32 run
    assert np.abs(total - parts.output).max() <= 1e-9 and parts.residual.max() <= 1e-9
    assert 0 < parts.model_gap.max() <= 1e-5


def test_dropout2d_cnn():
    torch.manual_seed(0)
    X = torch.randn(16, 2, 5, 5, dtype=torch.float64)
    y = torch.arange(16) % 3
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Dropout2d(0.4), nn.Flatten(), nn.Linear(36, 3)
    ).double()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), X, y)
    assert recording.path_.masks(0)["2"].shape == (8, 4, 1, 1)
    error, parts = identity_error(recording, X[:4] + 0.1)
    assert error <= 1e-9 and parts.residual.max() <= 1e-9


def test_the_training_forward_is_the_masked_eval_network():
    """The recorder's own masks reproduce the training pass bitwise."""
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    recorder = TrainingRecorder(model, optimizer, X)
    rows = torch.arange(10)
    out = model.train()(X[rows])
    recorder.rows(rows)
    F.cross_entropy(out, y[rows]).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    recording = recorder.finish()
    evaluated = copy.deepcopy(model).eval()
    with torch.no_grad():
        for param, value in zip(evaluated.parameters(), weights, strict=True):
            param.copy_(value)
        with masks_applied(evaluated, recording.path_.masks(0)):
            again = evaluated(X[rows])
    assert torch.equal(again, out.detach())


def test_eval_mode_passes_draw_no_masks():
    X, y = data()
    model = mlp()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.2), X, y, epochs=1)
    model.eval()
    # a model trained in eval mode records no masks (dropout is the identity)
    model2 = mlp()
    optimizer = torch.optim.SGD(model2.parameters(), lr=0.2)
    recorder = TrainingRecorder(model2.eval(), optimizer, X)
    optimizer.zero_grad()
    out = model2(X)
    recorder.rows(np.arange(30))
    F.cross_entropy(out, y).backward()
    optimizer.step()
    assert recorder.finish().path_.dropout_masks is None
    assert recording.path_.dropout_masks is not None


# -- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer", [nn.AlphaDropout(0.2), nn.FeatureAlphaDropout(0.2), nn.Dropout1d(0.2)]
)
def test_other_dropout_layers_stay_refused(layer):
    X, y = data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), layer, nn.Linear(6, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    TrainingRecorder(model, optimizer, X)
    with pytest.raises(RecordingRefused, match=rf"'1' \({type(layer).__name__}\) is in training"):
        model.train()(X[:8])


class TwiceDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout = nn.Linear(4, 4), nn.Dropout(0.5)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.dropout(self.dropout(self.linear(x))))


def test_a_dropout_layer_called_twice_is_refused():
    X, _ = data()
    model = TwiceDropout().double()
    TrainingRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1), X)
    with pytest.raises(RuntimeError, match="'dropout' is called twice in one forward pass"):
        model.train()(X[:8])


# -- the estimators ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "solver, batch_size",
    [("sgd", None), ("sgd", 8), ("momentum", 8), ("adam", 8), ("adam", None)],
)
def test_estimator_trains_with_dropout_exactly(solver, batch_size):
    X, y = data()
    extra = {"momentum": 0.9, "solver": "sgd"} if solver == "momentum" else {"solver": solver}
    est = ExactPathKernelClassifier(
        module=mlp(),
        max_iter=4,
        batch_size=batch_size,
        learning_rate=0.02 if solver == "adam" else 0.1,
        random_state=0,
        **extra,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "dropout is disabled" warning any more
        est.fit(X.numpy(), y.numpy())
    assert est.path_.dropout_masks is not None
    assert not any(layer.training for layer in est.module_.modules())
    parts = est.decompose(X[:5].numpy() + 0.05)
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    np.testing.assert_allclose(parts.output, est.predict_log_proba(X[:5].numpy() + 0.05))
    assert np.abs(total - parts.output).max() <= 1e-9 and parts.residual.max() <= 1e-9


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_self_influence_and_attribution_over_time(name):
    """The per-step routes (self-influence, attribution over time) use the masks too:
    the diagonal of ``decompose(X_train)`` and the sum over periods and groups."""
    X, y = data()
    model = mlp()
    recording = run(model, OPTIMIZERS[name](model.parameters()), X, y)
    parts = recording.decompose(X)
    diagonal = parts.contributions[np.arange(30), np.arange(30)]
    assert np.abs(recording.self_influence().values - diagonal).max() <= 1e-12
    over_time = recording.explain_over_time(X[:4])
    summed = over_time.values.sum(axis=(1, 2))
    assert np.abs(summed - parts.contributions[:4].sum(axis=1)).max() <= 1e-12


def test_saved_and_loaded_with_its_masks(tmp_path):
    X, y = data()
    model = mlp()
    recording = run(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5), X, y)
    recording.save(tmp_path / "run")
    loaded = type(recording).load(tmp_path / "run", mlp(), X)
    for saved, read in zip(recording.path_.dropout_masks, loaded.path_.dropout_masks, strict=True):
        assert saved.keys() == read.keys()
        assert all(torch.equal(saved[name], read[name]) for name in saved)
    mine, theirs = recording.decompose(X[:4]), loaded.decompose(X[:4])
    np.testing.assert_array_equal(mine.contributions, theirs.contributions)


class SharedLinear(nn.Module):
    """One linear layer applied twice, with dropout between: the engine's
    whole-network Jacobian route."""

    def __init__(self):
        super().__init__()
        self.inner, self.dropout, self.head = nn.Linear(4, 4), nn.Dropout(0.3), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(self.dropout(torch.tanh(self.inner(x))))))


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_whole_network_jacobian_route(name):
    X, y = data()
    torch.manual_seed(0)
    model = SharedLinear().double()
    recording = run(model, OPTIMIZERS[name](model.parameters()), X, y)
    assert recording._engine().probe.jacobian is not None
    error, parts = identity_error(recording, X[:4] - 0.2)
    assert error <= 1e-9 and parts.residual.max() <= 1e-9


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(F.dropout(torch.tanh(self.first(x)), 0.5, training=self.training))


def test_functional_dropout_is_caught_at_the_first_step():
    """``F.dropout`` is not a module the recorder sees: the first step's gradient,
    recomputed from the recorded rows, differs from the run's."""
    X, y = data()
    torch.manual_seed(0)
    model = FunctionalDropout().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X)
    optimizer.zero_grad()
    out = model.train()(X[:10])
    recorder.rows(np.arange(10))
    F.cross_entropy(out, y[:10]).backward()
    with pytest.raises(RecordingRefused, match="Step 0: the gradient of .* is not the backward"):
        optimizer.step()


def test_early_stopping_keeps_the_first_steps_masks():
    X, y = data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    recorder = TrainingRecorder(model, optimizer, X, y)
    model.train()
    saved = None
    for step in range(6):
        rows = torch.arange(step % 3 * 10, step % 3 * 10 + 10)
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
        if step == 3:
            saved = copy.deepcopy(model.state_dict())
    model.load_state_dict(saved)
    recording = recorder.finish(at_step=4)
    assert len(recording.path_.dropout_masks) == 4
    error, parts = identity_error(recording, X[:4])
    assert error <= 1e-9 and parts.residual.max() <= 1e-9


def test_a_pickled_estimator_keeps_its_masks():
    X, y = data()
    est = ExactPathKernelClassifier(module=mlp(), max_iter=3, batch_size=10, random_state=0)
    est.fit(X.numpy(), y.numpy())
    again = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(
        again.decompose(X[:3].numpy()).contributions, est.decompose(X[:3].numpy()).contributions
    )


def test_an_estimator_fit_is_reproducible():
    """The masks are drawn from a generator seeded by ``random_state``."""
    X, y = data()
    fits = [
        ExactPathKernelClassifier(module=mlp(), max_iter=3, batch_size=10, random_state=3).fit(
            X.numpy(), y.numpy()
        )
        for _ in range(2)
    ]
    torch.manual_seed(123)  # (the global generator is not the masks')
    third = ExactPathKernelClassifier(module=mlp(), max_iter=3, batch_size=10, random_state=3)
    third.fit(X.numpy(), y.numpy())
    for est in fits[1:] + [third]:
        assert torch.equal(est.path_.weights, fits[0].path_.weights)
