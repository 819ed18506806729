"""Shared fixtures of the estimator tests: tiny classifiers on tiny data (every test is
about behaviour, not accuracy)."""

import numpy as np
import pytest

from sklearn_pathkernel import ExactPathKernelClassifier


def _make_clf(**params):
    defaults = dict(hidden_layer_sizes=(4,), max_iter=3, learning_rate=0.5, random_state=0)
    defaults.update(params)
    return ExactPathKernelClassifier(**defaults)


def _make_data(n_samples=12, n_features=3, n_classes=3, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.randn(n_samples, n_features)
    y = np.arange(n_samples) % n_classes
    return X, y


def _fitted_attributes(est):
    return sorted(k for k in vars(est) if k.endswith("_") and not k.startswith("__"))


@pytest.fixture
def make_clf():
    """``make_clf(**params)``: a tiny :class:`ExactPathKernelClassifier` (4 hidden
    units, 3 epochs, ``learning_rate=0.5``, seeded), ``params`` overriding."""
    return _make_clf


@pytest.fixture
def make_data():
    """``make_data(n_samples=12, n_features=3, n_classes=3, seed=0) -> (X, y)``:
    Gaussian rows, classes in turn."""
    return _make_data


@pytest.fixture
def fitted_attributes():
    """``fitted_attributes(est)``: the sorted names of an estimator's fitted attributes."""
    return _fitted_attributes


@pytest.fixture(scope="module")
def data():
    """12 rows, 3 features, 3 classes."""
    return _make_data()


@pytest.fixture(scope="module")
def fitted(data):
    """The tiny classifier fitted on :func:`data`."""
    X, y = data
    return _make_clf().fit(X, y)
