"""The distance estimators on images: image_shape and conv_layers."""

import numpy as np
import pytest
import torch
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
        ({"image_shape": (6, 6), "conv_layers": ((2, 3, 1, 1, 1, 1),)}, "Each entry of conv"),
        ({"image_shape": (6, 6), "conv_layers": ((0, 3),)}, "must be positive"),
        ({"image_shape": (6, 6), "conv_layers": ((2, 3, 1, 0, 0),)}, "pool must be positive"),
        ({"image_shape": (6, 6), "conv_layers": ((2, 3, 1, 0, 5),)}, "pool 5 is larger than"),
        ({"image_shape": (6, 6), "conv_layers": ({"n_memories": 2, "pol": 2},)}, "unknown keys"),
        ({"image_shape": (6, 6), "conv_layers": ({"pool": 2},)}, "a dict needs 'n_memories'"),
        ({"image_shape": (6, 6), "conv_layers": ((2, 3.0),)}, "must be ints"),
        ({"image_shape": (6, 0)}, "image_shape must be"),
    ],
)
def test_clear_errors(digits, params, match):
    X, y = digits
    with pytest.raises(ValueError, match=match):
        DistanceKernelClassifier(max_iter=1, **params).fit(X, y)


@pytest.mark.parametrize("solver, batch_size", [("sgd", None), ("adam", None), ("adam", 16)])
def test_pooled_network_sum_identity_and_closed_form_kinks(digits, solver, batch_size, monkeypatch):
    """A min-pool over positions after the first distance layer: the identity
    through decompose, and every kink of the path in closed form (the pooled
    squared distances are quadratic along a step: nothing is left to the search)."""
    from sklearn_pathkernel._engine.integration import _kinks
    from sklearn_pathkernel._nn._distance_conv import MinPool2d

    calls = []
    original = _kinks.locate_kinks
    monkeypatch.setattr(
        _kinks, "locate_kinks", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    X, y = digits
    clf = DistanceKernelClassifier(
        image_shape=(6, 6),
        conv_layers=({"n_memories": 3, "kernel_size": 3, "padding": 1, "pool": 2},),
        hidden_layer_sizes=(),
        solver=solver,
        learning_rate=0.05,
        max_iter=3,
        batch_size=batch_size,
        random_state=0,
    ).fit(X, y)
    assert isinstance(clf.module_[2], MinPool2d)
    assert clf.module_[-1].in_features == 3 * 3 * 3
    parts = clf.decompose(X[:3])
    assert parts.contributions.shape == (3, X.shape[0], 3)
    assert parts.residual.max() < 1e-9
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-9
    assert calls == []


def test_tuple_and_dict_entries_build_the_same_network(digits):
    X, y = digits
    nets = [
        DistanceKernelClassifier(
            image_shape=(6, 6),
            conv_layers=(layer,),
            hidden_layer_sizes=(),
            max_iter=1,
            random_state=0,
        )
        .fit(X, y)
        .module_
        for layer in ((2, 3, 1, 1, 2), {"n_memories": 2, "padding": 1, "pool": 2})
    ]
    assert str(nets[0]) == str(nets[1])
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_default_image_network_pools_over_positions(digits):
    """The default conv_layers: 16 memories of 3x3 patches, padding 1, a 2x2 min-pool."""
    from sklearn_pathkernel._nn._distance_conv import MinPool2d

    X, y = digits
    clf = DistanceKernelClassifier(image_shape=(6, 6), hidden_layer_sizes=(), max_iter=2)
    module = clf.fit(X, y).module_
    conv, pool = module[1], module[2]
    assert (conv.n_memories, conv.kernel_size, conv.padding) == (16, (3, 3), (1, 1))
    assert isinstance(pool, MinPool2d) and pool.pool_size == 2
    assert module[-1].in_features == 16 * 3 * 3
    assert clf.predict(X[:4]).shape == (4,)
