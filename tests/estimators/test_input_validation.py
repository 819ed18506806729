"""Bad input gets a clear error naming the problem: data, targets, modules, learning
rates, sample weights, and calls before fit."""

import numpy as np
import pytest
import torch
from scipy import sparse
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.utils._param_validation import InvalidParameterError

SUM_TOL = 1e-9


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_X_at_fit(data, bad, make_clf):
    X, y = data
    X = X.copy()
    X[3, 1] = bad
    with pytest.raises(ValueError, match="NaN|infinity"):
        make_clf().fit(X, y)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("method", ["predict", "predict_proba", "decompose", "kernel"])
def test_non_finite_X_after_fit(fitted, data, bad, method):
    X = data[0][:3].copy()
    X[1, 0] = bad
    call = (lambda A: fitted.kernel_(A)) if method == "kernel" else getattr(fitted, method)
    with pytest.raises(ValueError, match="NaN|infinity"):
        call(X)


@pytest.mark.parametrize(
    "call",
    [
        lambda clf, X: clf.predict(X),
        lambda clf, X: clf.predict_proba(X),
        lambda clf, X: clf.decision_function(X),
        lambda clf, X: clf.decompose(X),
        lambda clf, X: clf.kernel_(X),
        lambda clf, X: clf.kernel_(X[:, :3], X),
        lambda clf, X: clf.kernel_.diag(X),
    ],
    ids=["predict", "proba", "decision", "decompose", "kernel", "kernel_Y", "diag"],
)
@pytest.mark.parametrize("n_features", [2, 4])
def test_wrong_n_features_after_fit(fitted, call, n_features):
    X = np.random.RandomState(1).randn(3, n_features)
    with pytest.raises(ValueError, match=rf"{n_features} features.*3 features"):
        call(fitted, X)


@pytest.mark.parametrize(
    "call",
    [
        lambda clf, X, y: clone(clf).fit(X, y),  # a fresh tiny classifier
        lambda clf, X, y: clf.predict(X),
        lambda clf, X, y: clf.decompose(X),
        lambda clf, X, y: clf.kernel_(X),
    ],
    ids=["fit", "predict", "decompose", "kernel"],
)
def test_sparse_input_is_a_clear_error(fitted, data, call):
    # Sparse input is not supported (the network takes dense tensors): say so and how to fix.
    X, y = data
    with pytest.raises(TypeError, match="Sparse data.*dense data is required.*toarray"):
        call(fitted, sparse.csr_matrix(X), y)


def test_one_class(data, make_clf):
    X, _ = data
    with pytest.raises(ValueError, match="at least 2 classes.*only one class: 'a'"):
        make_clf().fit(X, np.full(X.shape[0], "a"))


def test_continuous_y(data, make_clf):
    X, _ = data
    with pytest.raises(ValueError, match="Unknown label type: continuous"):
        make_clf().fit(X, np.linspace(0.0, 1.0, X.shape[0]))


@pytest.mark.parametrize("width", [1, 2, 5])
def test_module_output_width_names_both(data, width, make_clf):
    X, y = data  # 3 classes
    with pytest.raises(ValueError, match=rf"shape \(1, {width}\).*3 classes"):
        make_clf(module=torch.nn.Linear(3, width)).fit(X, y)


def test_module_output_of_wrong_rank(data, make_clf):
    X, y = data
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Flatten(0))
    with pytest.raises(ValueError, match=r"shape \(3,\).*3 classes"):
        make_clf(module=module).fit(X, y)


class NoParameters(torch.nn.Module):
    def forward(self, x):
        return torch.zeros(x.shape[0], 3, dtype=x.dtype)


@pytest.mark.parametrize("module", [NoParameters(), lambda n_features, n_classes: NoParameters()])
def test_module_without_parameters(data, module, make_clf):
    X, y = data
    with pytest.raises(ValueError, match="no parameters"):
        make_clf(module=module).fit(X, y)


@pytest.mark.parametrize("module", ["mlp", 3, np.zeros(3)])
def test_module_not_a_module(data, module, make_clf):
    X, y = data
    with pytest.raises(InvalidParameterError, match="'module' parameter.*torch.nn"):
        make_clf(module=module).fit(X, y)


def test_module_callable_returning_non_module(data, make_clf):
    X, y = data
    with pytest.raises(TypeError, match="must return a torch.nn.Module, got ndarray"):
        make_clf(module=lambda n_features, n_classes: np.zeros(3)).fit(X, y)


@pytest.mark.parametrize("lr", [0.0, -1.0, np.nan, np.inf])
def test_bad_learning_rate_from_schedule(data, lr, make_clf):
    X, y = data
    with pytest.raises(ValueError, match=r"positive finite.*at step 0"):
        make_clf(learning_rate=lambda step: lr).fit(X, y)


def test_bad_sample_weights(data, make_clf):
    X, y = data
    with pytest.raises(ValueError, match="Negative values.*sample_weight"):
        make_clf().fit(X, y, sample_weight=np.r_[-0.5, np.ones(X.shape[0] - 1)])
    with pytest.raises(ValueError, match="non-zero|not all be zero"):
        make_clf().fit(X, y, sample_weight=np.zeros(X.shape[0]))
    with pytest.raises(ValueError, match="NaN"):
        make_clf().fit(X, y, sample_weight=np.r_[np.nan, np.ones(X.shape[0] - 1)])


def test_unfitted_kernel_and_decompose(data, make_clf):
    with pytest.raises(NotFittedError):
        _ = make_clf().kernel_
    with pytest.raises(NotFittedError):
        make_clf().decompose(data[0])
