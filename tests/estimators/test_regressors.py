"""The regressors: exact kernel regressions for every solver, and their kernel in
scikit-learn's kernel machines.

Independent computations: autograd for the recorded output gradients, the
brute-force reference (materialised Jacobians, Gauss-Legendre along each step, the
explicit double sum over steps) for the contributions, and the network's own
prediction for the sum identity.
"""

import warnings

import numpy as np
import pytest
import torch
from _reference import NaivePathKernelEngine
from sklearn.datasets import make_friedman1
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, WhiteKernel
from sklearn.kernel_ridge import KernelRidge
from sklearn.pipeline import Pipeline
from sklearn.svm import SVR
from torch import nn
from torch.func import functional_call

from sklearn_pathkernel import (
    DistanceKernelRegressor,
    ExactPathKernelRegressor,
    PathKernelTransformer,
)
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._training import SolverSettings
from sklearn_pathkernel._training._loop import train_module
from sklearn_pathkernel._training._losses import SquaredError

DTYPE = torch.float64
SUM_TOL = 1e-9
SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate=0.2),
    "nesterov-decay": dict(
        solver="sgd", learning_rate=0.05, momentum=0.8, nesterovs_momentum=True, weight_decay=0.01
    ),
    "adam-decay": dict(solver="adam", learning_rate=0.01, weight_decay=0.01),
    "adamw": dict(solver="adamw", learning_rate=0.01, weight_decay=0.1),
}


@pytest.fixture(scope="module")
def data():
    X, y = make_friedman1(n_samples=40, n_features=5, noise=0.1, random_state=0)
    X = (X - X.mean(0)) / X.std(0)
    return X, (y - y.mean()) / y.std()


def identity_error(reg, X):
    parts = reg.decompose(X)
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    return np.abs(total - reg.predict(X)).max(), parts


@pytest.mark.parametrize("batch_size", [None, 8], ids=["full-batch", "mini-batch"])
@pytest.mark.parametrize("name", SOLVERS)
@pytest.mark.parametrize("make", [ExactPathKernelRegressor, DistanceKernelRegressor])
def test_sum_identity_for_every_solver(data, make, name, batch_size):
    X, y = data
    kwargs = dict(SOLVERS[name], max_iter=6, batch_size=batch_size, random_state=0)
    reg = make(hidden_layer_sizes=(10,), **kwargs).fit(X, y)
    error, parts = identity_error(reg, X[:5] + 0.1)
    assert error <= SUM_TOL
    assert parts.residual.max() <= SUM_TOL
    # The per-step certificate compares changes of f itself (no log-softmax): when it
    # did not, every step "failed" and was bisected to the cap (exact but ~40x slower).
    assert parts.quadrature_error.max() <= SUM_TOL
    assert parts.contributions.shape == (5, X.shape[0])  # 1-d y: no outputs axis
    assert np.abs(parts.contributions).sum(1).max() > 1e-3


def test_multi_output_shapes_and_identity(data):
    X, y = data
    Y = np.c_[y, np.sin(3 * X[:, 0]), -y]
    reg = ExactPathKernelRegressor(
        hidden_layer_sizes=(12,), max_iter=8, solver="adam", learning_rate=0.01, random_state=0
    ).fit(X, Y)
    assert reg.n_outputs_ == 3 and reg.predict(X).shape == (X.shape[0], 3)
    error, parts = identity_error(reg, X[:4])
    assert error <= SUM_TOL
    assert parts.contributions.shape == (4, X.shape[0], 3)
    assert parts.bias.shape == parts.decay.shape == (4, 3)


def test_output_gradients_are_the_scaled_residuals(data):
    # e_{s,i} = -dL_s/df(x_i) = a_{s,i} (y_i - f(x_i; w_s)) / K, checked by autograd
    # on the module at the recorded weights.
    X, y = data
    Y = torch.tensor(np.c_[y, -y])
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).to(DTYPE)
    weights = torch.rand(X.shape[0], dtype=DTYPE)
    path = train_module(
        module,
        torch.tensor(X),
        Y,
        loss=SquaredError(),
        sample_weight=weights,
        learning_rate=0.1,
        max_iter=2,
        batch_size=16,
        random_state=0,
    ).path
    for step, batch in enumerate(path.batches):
        index = torch.as_tensor(batch)
        f = functional_call(module, path.unflatten(path.weights[step]), (torch.tensor(X)[index],))
        f = f.detach().requires_grad_(True)
        share = weights[index] / weights[index].sum()
        loss = (share * 0.5 * (f - Y[index]).square().mean(1)).sum()
        (gradient,) = torch.autograd.grad(loss, f)
        torch.testing.assert_close(path.output_gradients[step], -gradient, rtol=0, atol=1e-15)
        expected = share[:, None] * (Y[index] - f.detach()) / 2
        torch.testing.assert_close(path.output_gradients[step], expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["sgd", "nesterov-decay", "adam-decay"])
def test_contributions_match_the_brute_force_reference(data, name):
    X, y = data
    settings = dict(SOLVERS[name])
    lr = settings.pop("learning_rate")
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).to(DTYPE)
    X_t, Y = torch.tensor(X), torch.tensor(np.c_[y, np.cos(X[:, 1])])
    path = train_module(
        module,
        X_t,
        Y,
        loss=SquaredError(),
        solver=SolverSettings(**settings),
        learning_rate=lr,
        max_iter=2,
        batch_size=16,
        random_state=0,
    ).path
    link = SquaredError().link
    queries = X_t[:4] + 0.3
    mine = PathKernelEngine(module, path, X_t, link=SquaredError().output_link).decompose(queries)
    theirs = NaivePathKernelEngine(
        module, path, X_t, link=link, quadrature="gauss", n_points=24
    ).decompose(queries)
    scale = np.abs(theirs.contributions).max()
    np.testing.assert_allclose(mine.contributions, theirs.contributions, rtol=0, atol=1e-9 * scale)
    np.testing.assert_allclose(mine.decay, theirs.decay, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        own = module(queries).numpy()
    np.testing.assert_allclose(
        mine.bias + mine.contributions.sum(1) + mine.decay, own, rtol=0, atol=SUM_TOL
    )


@pytest.fixture(scope="module")
def fitted(data):
    X, y = data
    reg = ExactPathKernelRegressor(hidden_layer_sizes=(16,), max_iter=40, random_state=0)
    return reg.fit(X, y), X, y


def test_training_gram_is_symmetric_psd(fitted):
    reg, X, _ = fitted
    gram = reg.kernel_(X)
    np.testing.assert_array_equal(gram, gram.T)
    eigenvalues = np.linalg.eigvalsh(gram)
    assert eigenvalues.min() >= -1e-9 * eigenvalues.max()


def test_gaussian_process_regression_on_the_learned_kernel(fitted):
    reg, X, y = fitted
    kernel = ConstantKernel(1.0) * reg.kernel_ + WhiteKernel(1e-2)
    gpr = GaussianProcessRegressor(kernel=kernel, normalize_y=True, random_state=0).fit(X, y)
    assert np.isfinite(gpr.log_marginal_likelihood_value_)
    mean, std = gpr.predict(X[:5] + 0.05, return_std=True)
    assert np.all(std > 0) and np.all(np.isfinite(mean))
    assert gpr.score(X, y) > 0.8
    # The optimiser moved the constant and noise levels (the EPK itself has none).
    assert gpr.kernel_.k1.k1.constant_value != 1.0


def test_kernel_ridge_precomputed_equals_the_callable_kernel(fitted):
    reg, X, y = fitted
    queries = X[:6] + 0.1
    precomputed = KernelRidge(alpha=1e-2, kernel="precomputed").fit(reg.kernel_(X), y)
    callable_kernel = KernelRidge(alpha=1e-2, kernel=reg.kernel_).fit(X, y)
    np.testing.assert_allclose(
        precomputed.predict(reg.kernel_(queries, X)),
        callable_kernel.predict(queries),
        rtol=1e-10,
        atol=1e-12,
    )
    assert precomputed.score(reg.kernel_(X), y) > 0.9


def test_svr_and_transformer_pipeline(fitted, data):
    reg, X, y = fitted
    svr = SVR(kernel=reg.kernel_, C=10.0).fit(X, y)
    assert svr.score(X, y) > 0.8
    pipeline = Pipeline(
        [
            ("epk", PathKernelTransformer(ExactPathKernelRegressor(max_iter=20, random_state=0))),
            ("ridge", KernelRidge(kernel="precomputed", alpha=1e-2)),
        ]
    ).fit(X, y)
    assert pipeline.predict(X[:3]).shape == (3,)
    assert pipeline.score(X, y) > 0.5


def test_zero_weight_points_contribute_nothing(data):
    X, y = data
    weights = np.r_[np.zeros(5), np.ones(X.shape[0] - 5)]
    reg = ExactPathKernelRegressor(hidden_layer_sizes=(8,), max_iter=5, random_state=0)
    reg.fit(X, y, sample_weight=weights)
    parts = reg.decompose(X[:3])
    assert np.all(parts.contributions[:, :5] == 0.0)
    assert parts.residual.max() <= SUM_TOL


def test_bad_targets_are_refused(data):
    X, y = data
    with pytest.raises(ValueError, match="NaN|infinity"):
        ExactPathKernelRegressor(max_iter=2).fit(X, np.r_[np.nan, y[1:]])


def test_read_only_targets_are_copied_without_warning():
    """Read-only targets (a memmap): no "non-writable array" warning from torch,
    and the fit equals one on a writable copy."""
    X, y = make_friedman1(n_samples=40, n_features=5, random_state=0)
    y_read_only = y.copy()
    y_read_only.flags.writeable = False
    make = dict(hidden_layer_sizes=(8,), max_iter=5, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        reg = ExactPathKernelRegressor(**make).fit(X, y_read_only)
    ref = ExactPathKernelRegressor(**make).fit(X, y)
    assert torch.equal(reg.path_.weights, ref.path_.weights)
