"""The exactness certificate is honest: ``decompose(X).residual`` compares the
decomposition with the network's own output, so an error in the engine or in the
recorded path cannot hide behind it.

The quadrature's own check (``quadrature_error``) integrates along whatever path was
recorded and telescopes: it passes on a corrupted path. These tests corrupt the path
on purpose and require the residual to catch it.
"""

import numpy as np
import pytest
import torch
from sklearn.datasets import make_blobs
from torch import nn

from sklearn_pathkernel import ExactPathKernelClassifier
from sklearn_pathkernel._training._loop import train_module

SUM_TOL = 1e-9


@pytest.fixture
def fitted():
    X, y = make_blobs(30, n_features=4, centers=3, random_state=0)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(8,), max_iter=6, learning_rate=0.2, random_state=0
    ).fit(X, y)
    return clf, X


def corrupt_middle_weights(path):
    path.weights[3] += 1e-3 * torch.randn(path.n_weights, dtype=path.weights.dtype)


def corrupt_output_gradients(path):
    path.output_gradients[2] = path.output_gradients[2] * 1.01


def corrupt_final_weights(path):
    path.weights[-1] += 1e-3


def corrupt_update_rates(path):
    path.update.gradient_rates = path.update.gradient_rates * 1.01


@pytest.mark.parametrize(
    "corrupt",
    [corrupt_middle_weights, corrupt_output_gradients, corrupt_final_weights, corrupt_update_rates],
)
def test_a_corrupted_path_is_caught(fitted, corrupt):
    clf, X = fitted
    assert clf.decompose(X[:4]).residual.max() <= SUM_TOL  # honest and exact before
    corrupt(clf.path_)
    clf.__dict__.pop("_kernel_cache", None)  # a fresh engine on the corrupted path
    parts = clf.decompose(X[:4])
    assert parts.residual.max() > 1e-5
    total = parts.bias + parts.contributions.sum(1) + parts.decay
    np.testing.assert_allclose(
        parts.residual, np.abs(total - clf.predict_log_proba(X[:4])).max(1), rtol=1e-12
    )


def test_the_quadrature_check_alone_misses_a_corrupted_step(fitted):
    # Why the residual must not be the per-step quadrature check: along a corrupted
    # path each step is still integrated exactly.
    clf, X = fitted
    corrupt_middle_weights(clf.path_)
    clf.__dict__.pop("_kernel_cache", None)
    parts = clf.decompose(X[:4])
    assert parts.quadrature_error.max() <= SUM_TOL
    assert parts.residual.max() > 1e-5


class PartlyFrozen(nn.Module):
    def __init__(self, n_features, n_classes, freeze):
        super().__init__()
        self.hidden = nn.Linear(n_features, 8)
        self.head = nn.Linear(8, n_classes)
        for name in freeze:
            getattr(self, name.split(".")[0]).get_parameter(name.split(".")[1]).requires_grad_(
                False
            )

    def forward(self, x):
        return self.head(torch.relu(self.hidden(x)))


@pytest.mark.parametrize("solver", ["sgd", "adam"])
@pytest.mark.parametrize("freeze", [("hidden.weight", "hidden.bias"), ("head.bias",)])
def test_frozen_parameters_are_constants_of_the_path(freeze, solver):
    X, y = make_blobs(30, n_features=4, centers=3, random_state=0)
    module = PartlyFrozen(4, 3, freeze).double()
    frozen = {name: p.detach().clone() for name, p in module.named_parameters() if name in freeze}
    clf = ExactPathKernelClassifier(
        module=module, max_iter=8, learning_rate=0.2 if solver == "sgd" else 0.02, solver=solver
    ).fit(X, y)
    assert not set(freeze) & set(clf.path_.param_names)
    for name, value in frozen.items():  # never moved
        torch.testing.assert_close(clf.module_.get_parameter(name), value, rtol=0, atol=0)
    parts = clf.decompose(X[:5])
    np.testing.assert_allclose(
        parts.bias + parts.contributions.sum(1) + parts.decay,
        clf.predict_log_proba(X[:5]),
        rtol=0,
        atol=SUM_TOL,
    )
    assert parts.residual.max() <= SUM_TOL
    assert np.abs(parts.contributions).max() > 1e-4
    gram = clf.kernel_(X)
    assert np.linalg.eigvalsh(gram).min() >= -1e-9 * np.abs(gram).max()


def test_certificate_measures_quadrature_error(relu_case, engine_cases):
    module, path, X, y, A = relu_case
    assert engine_cases.engine_for(module, path, X, y).certificate(A).max() < 1e-10
    riemann = engine_cases.engine_for(module, path, X, y, quadrature="riemann", n_points=5)
    parts = riemann.decompose(A)
    sum_error = np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max(1)
    assert parts.quadrature_error.max() > 1e-6
    # the certificate bounds the error of the sum identity (up to rounding)
    assert (sum_error <= parts.quadrature_error + 1e-12).all()


def test_bisection_certifies_a_double_crossing_the_grids_miss(engine_cases):
    """A squared distance plus bias touching zero twice within ~1e-8 of ``t``.

    Kink detection compares pieces at grid points and misses both crossings; the
    certificate catches the error and bisection fixes it.
    """
    from sklearn_pathkernel import DistanceKernelClassifier

    X, y = engine_cases.blobs(60, 4, 3, 0)
    clf = DistanceKernelClassifier(
        hidden_layer_sizes=(8,), max_iter=5, learning_rate=0.5, random_state=0
    ).fit(X.numpy(), y.numpy())
    parts = clf.decompose(X[:10].numpy() + 0.3)
    assert parts.residual.max() < 1e-9
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-9


def test_saturated_softmax_on_unscaled_inputs_is_certified_without_blowup(engine_cases):
    """Features near 100 (scikit-learn's idempotence check): the first steps swing the
    softmax between saturated states. Each step's change is then known only to about
    eps * |logits| (~1e-13), and its integrand has sharp smooth transitions between
    the kinks. Bisection starts from the kink partition, resolves the transitions and
    accepts the rounding floor, instead of halving pieces without end."""
    rng = np.random.RandomState(0)
    X = torch.tensor(rng.normal(loc=100, size=(60, 2)))
    y = torch.tensor((X[:, 0] > 100).numpy().astype(np.int64))
    torch.manual_seed(0)
    module = engine_cases.mlp([2, 100, 2], zero_head=True)
    path = train_module(module, X, y, learning_rate=0.1, max_iter=3).path
    engine = engine_cases.engine_for(module, path, X, y)
    A = torch.tensor(rng.normal(loc=100, size=(4, 2)))
    _, scale = engine.probe.output_with_scale(path.weights[1], A)
    assert scale.min() > 100  # saturated after one step: the case this test is about
    parts = engine.decompose(A)
    assert parts.quadrature_error.max() < 1e-10
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-10


def test_the_least_tolerance_follows_the_dtype_s_rounding():
    """float64 keeps the loss's tolerance (and its bisection's 64th); float32 is
    held to ``ROUNDING_ULPS`` of its own eps, which rounding alone can reach."""
    from sklearn_pathkernel._engine.integration._certificate import (
        ROUNDING_ULPS,
        least_tolerance,
    )

    assert least_tolerance(torch.float64, 1e-11) == 1e-11
    assert least_tolerance(torch.float64, 1e-11 / 64) == 1e-11 / 64
    single = ROUNDING_ULPS * torch.finfo(torch.float32).eps
    assert least_tolerance(torch.float32, 1e-11) == single
    assert 1e-6 < single < 1e-5
