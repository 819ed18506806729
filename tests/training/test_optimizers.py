"""Every solver: training is torch.optim's, the recorded linear form reproduces each
step, and the decomposition and Grams are exact.

Independent computations: torch.optim run by hand on a copy of the initial module
(training), autograd gradients with a hand-kept momentum buffer (the record), the
brute-force reference's explicit double sum over (step, earlier step) pairs with
materialised Jacobians (contributions, decay, Grams), and the network's own output
(the sum identity).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _reference import NaivePathKernelEngine
from sklearn.datasets import make_blobs
from torch import nn
from torch.func import functional_call

from sklearn_pathkernel import DistanceKernelClassifier, ExactPathKernelClassifier
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._path import UpdateRecord
from sklearn_pathkernel._training import SolverSettings
from sklearn_pathkernel._training._loop import train_module

DTYPE = torch.float64
SUM_TOL = 1e-9

SOLVERS = {
    "sgd": dict(solver="sgd"),
    "sgd-decay": dict(solver="sgd", weight_decay=0.05),
    "momentum": dict(solver="sgd", momentum=0.9),
    "nesterov-decay": dict(solver="sgd", momentum=0.8, nesterovs_momentum=True, weight_decay=0.02),
    "adam": dict(solver="adam"),
    "adam-decay": dict(solver="adam", weight_decay=0.05, beta_1=0.8, beta_2=0.99),
    "adamw": dict(solver="adamw", weight_decay=0.1, epsilon=1e-6),
}
LEARNING_RATES = {"sgd": 0.3, "adam": 0.02, "adamw": 0.02}


def learning_rate(settings):
    return LEARNING_RATES[settings["solver"]]


def schedule(settings):
    base = learning_rate(settings)
    return lambda step: base / (1 + 0.1 * step)


def data(n=24, n_features=4, n_classes=3, seed=0):
    X, y = make_blobs(n, n_features=n_features, centers=n_classes, random_state=seed)
    return torch.tensor(X), torch.tensor(y)


def tanh_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)


def by_hand_optimizer(settings, params, lr):
    """The torch.optim optimiser of ``settings``, built here (not by the package)."""
    solver = settings["solver"]
    decay = settings.get("weight_decay", 0.0)
    if solver == "sgd":
        momentum = settings.get("momentum", 0.0)
        nesterov = settings.get("nesterovs_momentum", False)
        return torch.optim.SGD(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=decay
        )
    kind = torch.optim.Adam if solver == "adam" else torch.optim.AdamW
    return kind(
        params,
        lr=lr,
        betas=(settings.get("beta_1", 0.9), settings.get("beta_2", 0.999)),
        eps=settings.get("epsilon", 1e-8),
        weight_decay=decay,
    )


def train(settings, module, X, y, **kwargs):
    return train_module(
        module,
        X,
        y,
        solver=SolverSettings(**settings),
        learning_rate=kwargs.pop("learning_rate", schedule(settings)),
        random_state=0,
        **kwargs,
    ).path


@pytest.mark.parametrize("name", SOLVERS)
def test_training_is_torch_optim_run_by_hand(name):
    settings = SOLVERS[name]
    X, y = data()
    module = tanh_mlp()
    initial = [p.detach().clone() for p in module.parameters()]
    rate = schedule(settings)
    path = train(settings, module, X, y, max_iter=3, batch_size=10)

    by_hand = tanh_mlp()
    with torch.no_grad():
        for param, value in zip(by_hand.parameters(), initial, strict=True):
            param.copy_(value)
    optimizer = by_hand_optimizer(settings, by_hand.parameters(), rate(0))
    for step, batch in enumerate(path.batches):
        for group in optimizer.param_groups:
            group["lr"] = rate(step)
        optimizer.zero_grad()
        index = torch.as_tensor(batch)
        F.cross_entropy(by_hand(X[index]), y[index]).backward()
        optimizer.step()
    for mine, theirs in zip(module.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-14)
    flat = torch.cat([p.detach().reshape(-1) for p in by_hand.parameters()])
    torch.testing.assert_close(path.weights[-1], flat, rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", SOLVERS)
def test_recorded_update_reproduces_every_step(name):
    # w_{s+1} - w_s = -P_s (alpha_s b_s + zeta_s g_s) + d_s w_s with the buffer kept
    # here from autograd gradients of each batch loss at the recorded w_s.
    settings = SOLVERS[name]
    X, y = data()
    module = tanh_mlp()
    path = train(settings, module, X, y, max_iter=3, batch_size=10)
    update = path.update
    buffer = torch.zeros(path.n_weights, dtype=DTYPE)
    for step, batch in enumerate(path.batches):
        w = path.weights[step].clone().requires_grad_(True)
        index = torch.as_tensor(batch)
        logits = functional_call(module, path.unflatten(w), (X[index],))
        f = F.log_softmax(logits, dim=1)
        loss = F.nll_loss(f, y[index])  # the mean cross-entropy over the batch
        (gradient, output_gradient) = torch.autograd.grad(loss, (w, f))
        torch.testing.assert_close(
            path.output_gradients[step], -output_gradient, rtol=0, atol=1e-15
        )
        gradient = gradient + update.coupled_decay * path.weights[step]
        buffer = update.buffer_decay * buffer + update.gradient_scale * gradient
        P = 1.0 if update.preconditioners is None else update.preconditioners[step]
        moved = (
            -P * (update.gradient_rates[step] * buffer + update.direct_rates[step] * gradient)
            + update.decoupled_decays[step] * path.weights[step]
        )
        torch.testing.assert_close(moved, path.step_direction(step), rtol=1e-10, atol=1e-15)


@pytest.fixture(scope="module", params=["momentum", "nesterov-decay", "adam-decay", "adamw"])
def smooth_engines(request):
    """Fast and reference engines of a smooth (tanh) network, mini-batch run."""
    settings = SOLVERS[request.param]
    X, y = data()
    module = tanh_mlp()
    path = train(settings, module, X, y, max_iter=2, batch_size=8)
    fast = PathKernelEngine(module, path, X)
    reference = NaivePathKernelEngine(module, path, X, quadrature="gauss", n_points=24)
    queries = torch.tensor(np.random.RandomState(1).randn(5, 4) * 2.0)
    return fast, reference, module, queries, X


def test_decomposition_matches_the_brute_force_double_sum(smooth_engines):
    fast, reference, module, queries, _ = smooth_engines
    mine, theirs = fast.decompose(queries), reference.decompose(queries)
    scale = np.abs(theirs.contributions).max()
    np.testing.assert_allclose(mine.contributions, theirs.contributions, rtol=0, atol=1e-9 * scale)
    np.testing.assert_allclose(mine.decay, theirs.decay, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mine.bias, theirs.bias, rtol=0, atol=1e-14)
    # ... and both add up to the trained network's own output.
    with torch.no_grad():
        own = F.log_softmax(module(queries), dim=1).numpy()
    for parts in (mine, theirs):
        total = parts.bias + parts.contributions.sum(1) + parts.decay
        np.testing.assert_allclose(total, own, rtol=0, atol=SUM_TOL)


def test_grams_match_the_reference(smooth_engines):
    fast, reference, _, queries, X = smooth_engines
    A = torch.cat([queries[:3], X[:4]])
    mask = np.r_[np.zeros(3, bool), np.ones(4, bool)]
    for output in ("trace", "full"):
        mine = fast.gram(A, a_train=mask, output=output)
        theirs = reference.gram(A, a_train=mask, output=output)
        np.testing.assert_allclose(mine, theirs, rtol=1e-9, atol=1e-12 * np.abs(theirs).max())
    np.testing.assert_allclose(
        fast.diag(A, a_train=mask), reference.diag(A, a_train=mask), rtol=1e-9
    )


def cnn(n_features, n_classes):
    return nn.Sequential(
        nn.Unflatten(1, (1, 4, 4)),
        nn.Conv2d(1, 2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8, n_classes),
    )


ARCHITECTURES = {
    "relu-mlp": lambda **kw: ExactPathKernelClassifier(hidden_layer_sizes=(12, 8), **kw),
    "tanh-mlp": lambda **kw: ExactPathKernelClassifier(
        hidden_layer_sizes=(10,), activation="tanh", **kw
    ),
    "cnn": lambda **kw: ExactPathKernelClassifier(module=cnn, **kw),
    "distance": lambda **kw: DistanceKernelClassifier(hidden_layer_sizes=(6,), **kw),
}


@pytest.mark.parametrize("batch_size", [None, 7], ids=["full-batch", "mini-batch"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("name", ["momentum", "nesterov-decay", "adam-decay", "adamw"])
def test_sum_identity_for_every_solver(name, architecture, batch_size):
    settings = SOLVERS[name]
    X, y = make_blobs(30, n_features=16, centers=3, random_state=0)
    X = X / np.abs(X).max()
    lr = learning_rate(settings) * (3 if architecture == "distance" else 1)
    clf = ARCHITECTURES[architecture](
        max_iter=4, batch_size=batch_size, learning_rate=lr, random_state=0, **settings
    ).fit(X, y)
    parts = clf.decompose(X[:4] + 0.05)
    total = parts.bias + parts.contributions.sum(1) + parts.decay
    np.testing.assert_allclose(total, clf.predict_log_proba(X[:4] + 0.05), rtol=0, atol=SUM_TOL)
    assert parts.residual.max() <= SUM_TOL
    # The network moved, so the identity is not trivially 0 = 0.
    assert np.abs(parts.contributions).sum(1).max() > 1e-3


@pytest.mark.parametrize("name", SOLVERS)
def test_decay_is_zero_exactly_without_weight_decay(name):
    X, y = make_blobs(20, n_features=3, centers=2, random_state=0)
    settings = SOLVERS[name]
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(5,),
        max_iter=3,
        learning_rate=learning_rate(settings),
        random_state=0,
        **settings,
    ).fit(X, y)
    decay = clf.decompose(X[:3]).decay
    assert decay.shape == (3, 2)
    if settings.get("weight_decay", 0.0) == 0:
        assert np.all(decay == 0.0)
    else:
        assert np.abs(decay).max() > 1e-6


@pytest.mark.parametrize("name", ["momentum", "adam", "adamw"])
def test_training_gram_is_symmetric_psd_and_consistent_with_queries(name):
    settings = SOLVERS[name]
    X, y = make_blobs(25, n_features=4, centers=3, random_state=2)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(8,),
        max_iter=5,
        learning_rate=learning_rate(settings),
        random_state=0,
        **settings,
    ).fit(X, y)
    gram = clf.kernel_(X)
    np.testing.assert_array_equal(gram, gram.T)
    eigenvalues = np.linalg.eigvalsh(gram)
    assert eigenvalues.min() >= -1e-9 * eigenvalues.max()
    # Query rows (test copy) against the training rows: the same kernel whether
    # asked alone or as a block of one joint request.
    queries = X[:3] + 0.01
    cross = clf.kernel_(queries, X)
    joint = clf.kernel_(np.vstack([queries, X]))
    np.testing.assert_allclose(cross, joint[:3, 3:], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(clf.kernel_.diag(queries), np.diag(joint)[:3], rtol=1e-10)


@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov-decay", "adam", "adamw"])
def test_backward_accumulation_matches_the_closed_form_mixing(name):
    # psi_r = sum_{s >= r} c_{s,r} u_s: the recursion against the closed form, on the
    # linear form of a recorded run with a decaying learning rate, and random u.
    n_steps = 6
    X, y = data()
    settings = SOLVERS[name]
    record = train_module(
        tanh_mlp(),
        X,
        y,
        solver=SolverSettings(**settings),
        learning_rate=schedule(settings),
        max_iter=n_steps,
    ).path.update
    assert len(set(record.gradient_rates)) == n_steps  # the schedule reached the form
    u = torch.randn(n_steps, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    accumulation = record.backward()
    for step in reversed(range(n_steps)):
        (psi,) = accumulation.psi(step, [u[step]])
        expected = sum(record.mixing(s, step) * u[s] for s in range(step, n_steps))
        torch.testing.assert_close(psi, expected, rtol=1e-14, atol=1e-15)


def test_backward_accumulation_refuses_steps_out_of_order():
    record = UpdateRecord(0.9, 1.0, 0.0, np.ones(3), np.zeros(3), np.zeros(3))
    accumulation = record.backward()
    accumulation.psi(2, [torch.ones(1)])
    with pytest.raises(ValueError, match="last to first"):
        accumulation.psi(2, [torch.ones(1)])
