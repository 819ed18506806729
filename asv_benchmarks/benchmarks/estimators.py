"""Fitting the estimators, and their accuracy beside scikit-learn's networks.

Digits (M=800 for fitting, the other 997 images scored), standardised; the
regressors on scikit-learn's diabetes data (first 300 rows fitted, the rest scored).
"""

import warnings

from sklearn.datasets import load_diabetes, load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.preprocessing import StandardScaler

from sklearn_pathkernel import (
    DistanceKernelClassifier,
    DistanceKernelRegressor,
    ExactPathKernelClassifier,
    ExactPathKernelRegressor,
)

# (scikit-learn's networks stop at max_iter, as ours do: the same budget of epochs)
warnings.filterwarnings("ignore", category=ConvergenceWarning)


def _classifiers():
    return {
        "ExactPathKernelClassifier": ExactPathKernelClassifier(
            hidden_layer_sizes=(64,), solver="adam", learning_rate=1e-3, max_iter=100,
            batch_size=100, random_state=0,
        ),
        "DistanceKernelClassifier": DistanceKernelClassifier(random_state=0),
        "MLPClassifier": MLPClassifier(
            hidden_layer_sizes=(64,), max_iter=100, batch_size=100, random_state=0
        ),
    }  # fmt: skip


def _regressors():
    return {
        "ExactPathKernelRegressor": ExactPathKernelRegressor(
            hidden_layer_sizes=(64,), solver="adam", learning_rate=1e-2, max_iter=100,
            batch_size=50, random_state=0,
        ),
        "DistanceKernelRegressor": DistanceKernelRegressor(random_state=0),
        "MLPRegressor": MLPRegressor(
            hidden_layer_sizes=(64,), learning_rate_init=1e-2, max_iter=100, batch_size=50,
            random_state=0,
        ),
    }  # fmt: skip


class _FitAndScore:
    """Fit time and held-out score (``score``: accuracy, or R^2) of each estimator
    of :meth:`estimators` on the rows of :meth:`data`."""

    param_names = ["estimator"]
    timeout = 600

    @staticmethod
    def data():
        """``X, y, X_test, y_test``."""
        raise NotImplementedError

    @staticmethod
    def estimators():
        raise NotImplementedError

    def setup(self, estimator):
        self.X, self.y, self.X_test, self.y_test = self.data()
        self.estimator = self.estimators()[estimator]

    def time_fit(self, estimator):
        self.estimator.fit(self.X, self.y)

    def track_score(self, estimator):
        return float(self.estimator.fit(self.X, self.y).score(self.X_test, self.y_test))

    track_score.unit = "accuracy or R^2"


def _digits():
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit(X[:800]).transform(X)
    return X[:800], y[:800], X[800:], y[800:]


def _diabetes():
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit(X[:300]).transform(X)
    y = (y - y[:300].mean()) / y[:300].std()
    return X[:300], y[:300], X[300:], y[300:]


class Classifiers(_FitAndScore):
    """Fit time and test accuracy on the digits, against ``MLPClassifier``."""

    params = list(_classifiers())
    data = staticmethod(_digits)
    estimators = staticmethod(_classifiers)


class Regressors(_FitAndScore):
    """Fit time and test R^2 on the diabetes data, against ``MLPRegressor``."""

    params = list(_regressors())
    data = staticmethod(_diabetes)
    estimators = staticmethod(_regressors)
