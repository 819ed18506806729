"""The distance estimators on images: image_shape and conv_layers."""

import numpy as np
import pytest
from sklearn.datasets import load_digits

from sklearn_pathkernel import DistanceConv2d, DistanceKernelClassifier, DistanceKernelRegressor


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    X = X[:, :].reshape(-1, 8, 8)[:, 1:7, 1:7].reshape(-1, 36) / 16.0  # 6x6 crops
    return X[:40], y[:40] % 3


@pytest.mark.parametrize("solver, batch_size", [("sgd", None), ("adam", None), ("adam", 16)])
def test_classifier_sum_identity_through_decompose(digits, solver, batch_size):
    X, y = digits
    clf = DistanceKernelClassifier(
        image_shape=(6, 6),
        conv_layers=((3, 3, 1, 1),),
        hidden_layer_sizes=(),
        solver=solver,
        learning_rate=0.05,
        max_iter=3,
        batch_size=batch_size,
        random_state=0,
    ).fit(X, y)
    assert isinstance(clf.module_[1], DistanceConv2d)
    rules = [type(rule).__name__ for rule in clf._engine().probe.rules]
    assert rules == ["DistanceConv2dRule", "LinearRule"]
    parts = clf.decompose(X[:3])
    np.testing.assert_allclose(parts.output, clf.predict_log_proba(X[:3]), rtol=0, atol=1e-12)
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-9
    assert clf.kernel_(X[:3], X[:5]).shape == (3, 5)


def test_regressor_with_dense_layer_after_the_convolution(digits):
    X, y = digits
    reg = DistanceKernelRegressor(
        image_shape=(1, 6, 6),
        conv_layers=(2,),
        hidden_layer_sizes=(3,),
        max_iter=3,
        random_state=0,
    ).fit(X, y.astype(float))
    parts = reg.decompose(X[:2])
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-9
    np.testing.assert_allclose(parts.output.ravel(), reg.predict(X[:2]), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"image_shape": (5, 6)}, r"has 30 values per image but X has 36 features"),
        ({"image_shape": (6, 6), "conv_layers": ((2, 7),)}, "patch height 7 is larger"),
        ({"image_shape": (6, 6), "conv_layers": ((2, 3, 1, 1, 1, 1),)}, "Each entry of conv_layers"),
        ({"image_shape": (6, 6), "conv_layers": ((0, 3),)}, "must be positive"),
        ({"image_shape": (6, 0)}, "image_shape must be"),
    ],
)
def test_clear_errors(digits, params, match):
    X, y = digits
    with pytest.raises(ValueError, match=match):
        DistanceKernelClassifier(max_iter=1, **params).fit(X, y)
