"""The losses: link, per-sample value and output gradient against independent
formulas and autograd; a new loss is one class, and the kernel's identity holds for it.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import make_blobs, make_regression
from sklearn.utils._param_validation import InvalidParameterError

from sklearn_pathkernel import ExactPathKernelClassifier, ExactPathKernelRegressor
from sklearn_pathkernel._training import (
    CLASSIFICATION_LOSSES,
    REGRESSION_LOSSES,
    CrossEntropy,
    SquaredError,
    register_loss,
)
from sklearn_pathkernel._training._losses import ClassificationLoss, RegressionLoss

DTYPE = torch.float64
N, K = 7, 3


def batch(seed=0):
    """Module outputs, class codes, target values and shares of one batch."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(N, K, generator=gen, dtype=DTYPE)
    codes = torch.randint(0, K, (N,), generator=gen)
    values = torch.randn(N, K, generator=gen, dtype=DTYPE)
    weights = torch.rand(N, generator=gen, dtype=DTYPE)
    return out, codes, values, weights / weights.sum()


class LogCosh(RegressionLoss):
    """A toy regression loss: ``mean_k log cosh(f_k - y_k)``, ``f = out``."""

    def link(self, out):
        return out

    def per_sample(self, f, targets):
        return torch.log(torch.cosh(f - targets)).mean(dim=1)


class LogitCrossEntropy(ClassificationLoss):
    """A toy classification loss whose output is the logits themselves: the
    kernel then decomposes the logits, and ``log_proba`` is their log-softmax."""

    def link(self, out):
        return out

    def per_sample(self, f, targets):
        return F.cross_entropy(f, targets, reduction="none")

    def log_proba(self, f):
        return F.log_softmax(f, dim=1)


LOSSES = {
    "cross-entropy": (CrossEntropy(), "codes"),
    "squared-error": (SquaredError(), "values"),
    "log-cosh": (LogCosh(), "values"),
    "logit-cross-entropy": (LogitCrossEntropy(), "codes"),
}


def targets_of(kind, codes, values):
    return codes if kind == "codes" else values


def test_links():
    out = batch()[0]
    torch.testing.assert_close(CrossEntropy().link(out), out - out.logsumexp(1, keepdim=True))
    assert SquaredError().link(out) is out


def test_per_sample_values_follow_the_formulas():
    out, codes, values, _ = batch()
    f = CrossEntropy().link(out)
    expected = torch.stack(
        [-torch.log(out[i].exp()[codes[i]] / out[i].exp().sum()) for i in range(N)]
    )
    torch.testing.assert_close(CrossEntropy().per_sample(f, codes), expected)
    expected = torch.stack([((out[i] - values[i]) ** 2).sum() / (2 * K) for i in range(N)])
    torch.testing.assert_close(SquaredError().per_sample(out, values), expected)


def test_output_gradients_follow_the_closed_forms():
    out, codes, values, shares = batch()
    f = CrossEntropy().link(out)
    expected = shares[:, None] * F.one_hot(codes, K).to(DTYPE)
    torch.testing.assert_close(CrossEntropy().output_gradient(f, codes, shares), expected)
    expected = shares[:, None] * (values - out) / K
    torch.testing.assert_close(SquaredError().output_gradient(out, values, shares), expected)


@pytest.mark.parametrize("name", LOSSES)
def test_output_gradient_is_minus_the_gradient_of_each_rows_loss(name):
    # Row by row, by torch.func: e_i = -a_i dl(f_i, y_i)/df_i (independent of batch_loss).
    loss, kind = LOSSES[name]
    out, codes, values, shares = batch(1)
    targets = targets_of(kind, codes, values)
    f = loss.link(out)
    expected = torch.stack(
        [
            -shares[i]
            * torch.func.grad(lambda row, i=i: loss.per_sample(row[None], targets[i : i + 1])[0])(
                f[i]
            )
            for i in range(N)
        ]
    )
    torch.testing.assert_close(
        loss.output_gradient(f, targets, shares), expected, rtol=0, atol=1e-15
    )


@pytest.mark.parametrize("name", LOSSES)
def test_output_gradient_is_the_cotangent_backward_sends_into_the_module(name):
    # Bitwise what batch_loss(...).backward() would put in f.grad, and the module's
    # gradient from f.backward(-e) is the loss's gradient.
    loss, kind = LOSSES[name]
    out, codes, values, shares = batch(2)
    targets = targets_of(kind, codes, values)
    torch.manual_seed(0)
    module = torch.nn.Linear(K, K).to(DTYPE)
    f = loss.link(module(out))
    f.retain_grad()
    loss.batch_loss(f, targets, shares).backward()
    reference = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    f2 = loss.link(module(out))
    e = loss.output_gradient(f2, targets, shares)
    assert torch.equal(e, -f.grad)
    f2.backward(-e)
    for param, expected in zip(module.parameters(), reference, strict=True):
        assert torch.equal(param.grad, expected)


def test_batch_loss_is_the_share_weighted_sum():
    out, codes, _, shares = batch(3)
    f = CrossEntropy().link(out)
    expected = (shares * F.cross_entropy(out, codes, reduction="none")).sum()
    torch.testing.assert_close(CrossEntropy().batch_loss(f, codes, shares), expected)


def test_the_loss_says_what_its_targets_are():
    assert CrossEntropy.classifies and LogitCrossEntropy.classifies
    assert not SquaredError.classifies and not LogCosh.classifies
    assert CrossEntropy.certificate_tolerance == 1e-11


# -- a new loss is one class and one registration ------------------------------------


@pytest.fixture
def toy_losses():
    """Registers the toy losses as the recipe says, and takes them back after."""
    saved = dict(CLASSIFICATION_LOSSES), dict(REGRESSION_LOSSES)
    register_loss("log_cosh")(LogCosh)  # the one registration of each
    register_loss("logit_log_loss")(LogitCrossEntropy)
    yield
    for registry, before in zip((CLASSIFICATION_LOSSES, REGRESSION_LOSSES), saved, strict=True):
        registry.clear()
        registry.update(before)


def test_the_loss_parameter_names_the_registered_losses():
    assert ExactPathKernelClassifier().loss == "log_loss"
    assert ExactPathKernelRegressor().loss == "squared_error"
    X, y = make_blobs(n_samples=12, n_features=2, centers=2, random_state=0)
    with pytest.raises(InvalidParameterError, match=r"'loss' parameter.*\{'log_loss'\}"):
        ExactPathKernelClassifier(loss="squared_error", max_iter=1).fit(X, y)
    with pytest.raises(ValueError, match="'log_loss' is registered already"):
        register_loss("log_loss")(LogitCrossEntropy)
    doc = " ".join(ExactPathKernelRegressor.__doc__.split())
    assert 'loss : {"squared_error"}, default="squared_error"' in doc


def test_the_kernel_describes_the_fitted_loss_until_the_next_fit(toy_losses):
    X, y = make_regression(n_samples=20, n_features=3, random_state=0)
    reg = ExactPathKernelRegressor(hidden_layer_sizes=(4,), max_iter=2, random_state=0).fit(X, y)
    reg.set_params(loss="log_cosh")
    assert isinstance(reg._loss, SquaredError)  # what the path was trained with
    assert isinstance(reg.fit(X, y)._loss, LogCosh)


def test_a_new_regression_loss_trains_and_decomposes_exactly(toy_losses):
    X, y = make_regression(n_samples=30, n_features=3, noise=0.1, random_state=0)
    y = y / y.std()
    params = dict(hidden_layer_sizes=(8,), max_iter=6, batch_size=10, random_state=0)
    reg = ExactPathKernelRegressor(loss="log_cosh", activation="tanh", **params).fit(X, y)
    squared = ExactPathKernelRegressor(activation="tanh", **params).fit(X, y)
    assert not torch.equal(reg.path_.weights, squared.path_.weights)  # another loss
    # The recorded output gradients are the toy loss's, e = a tanh(y - f) (K = 1);
    # at w_0 the default MLP's output layer is zero, so f = 0 and e = tanh(y) / 10.
    first = reg.path_.batches[0]
    expected = np.tanh(y[first])[:, None] / len(first)
    np.testing.assert_allclose(reg.path_.output_gradients[0].numpy(), expected, rtol=1e-15)
    queries = X[:5] + 0.1
    parts = reg.decompose(queries)
    np.testing.assert_allclose(
        parts.bias + parts.contributions.sum(1) + parts.decay,
        reg.predict(queries),
        rtol=0,
        atol=1e-9,
    )
    assert parts.residual.max() < 1e-9


def test_a_new_classification_loss_owns_the_prediction_transform(toy_losses):
    X, y = make_blobs(n_samples=24, n_features=3, centers=3, random_state=0)
    clf = ExactPathKernelClassifier(
        loss="logit_log_loss", hidden_layer_sizes=(6,), max_iter=5, random_state=0
    ).fit(X, y)
    queries = X[:4] + 0.1
    parts = clf.decompose(queries)
    with torch.no_grad():
        logits = clf.module_(torch.tensor(queries)).numpy()
    # The kernel decomposes the loss's output (here the logits), not log-probabilities.
    np.testing.assert_allclose(parts.output, logits, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        parts.bias + parts.contributions.sum(1) + parts.decay, logits, rtol=0, atol=1e-9
    )
    assert parts.residual.max() < 1e-9
    log_proba = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(clf.predict_log_proba(queries), log_proba, rtol=0, atol=1e-12)
    np.testing.assert_allclose(clf.predict_proba(queries).sum(1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(clf.predict(queries), clf.classes_[logits.argmax(1)])
