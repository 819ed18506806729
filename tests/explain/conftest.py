"""Shared fixtures of the explanation tests: small fitted models on digits."""

import numpy as np
import pytest
from explain_models import SOLVERS, classifier, digits

from sklearn_pathkernel import ExactPathKernelRegressor


@pytest.fixture(scope="module", params=sorted(SOLVERS))
def fitted(request):
    """(classifier, X, y) per update rule."""
    return classifier(request.param)


@pytest.fixture(scope="module")
def small_classifier():
    return classifier("sgd-mini")


@pytest.fixture(scope="module")
def small_regressor():
    X, y = digits(50)
    reg = ExactPathKernelRegressor(
        hidden_layer_sizes=(6,), max_iter=3, learning_rate=0.05, batch_size=10, random_state=0
    ).fit(X, np.c_[y, y % 3].astype(float))
    return reg, X
