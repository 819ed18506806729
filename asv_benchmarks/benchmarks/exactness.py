"""Exactness of the decomposition: quadrature schemes and optimisers.

``track_max_error`` is the largest ``|bias + sum(contributions) + decay - f(x)|``
over the queries and outputs, ``f`` evaluated by the network itself.
"""

from sklearn_pathkernel import ExactPathKernelClassifier

from .common import digits, fresh, max_identity_error, paper_toy

SCHEMES = {
    "dpk": {"quadrature": "dpk"},
    "riemann-10": {"quadrature": "riemann", "n_points": 10},
    "riemann-100": {"quadrature": "riemann", "n_points": 100},
    "exact": {"quadrature": "exact"},
}


class Quadrature:
    """The paper's toy (M=300, ReLU 100-64-3, lr 0.05, 50 full-batch steps): 60
    queries decomposed with the paper's left Riemann sums, DPK and the exact
    scheme (Gauss-Legendre nodes between the ReLU kinks)."""

    params = list(SCHEMES)
    param_names = ["scheme"]
    timeout = 600

    def setup_cache(self):
        X, y, X_query = paper_toy()
        clf = ExactPathKernelClassifier(
            hidden_layer_sizes=(64,), learning_rate=0.05, max_iter=50, random_state=0
        ).fit(X, y)
        return clf, X_query

    def setup(self, cache, scheme):
        clf, self.X_query = cache
        self.clf = fresh(clf).set_params(**SCHEMES[scheme])

    def time_decompose(self, cache, scheme):
        self.clf.decompose(self.X_query)

    def track_max_error(self, cache, scheme):
        return max_identity_error(self.clf, self.clf.decompose(self.X_query), self.X_query)

    track_max_error.unit = "log-probability"


SOLVERS = {
    "sgd": {"solver": "sgd", "learning_rate": 0.1},
    "momentum": {"solver": "sgd", "learning_rate": 0.05, "momentum": 0.9},
    "nesterov": {
        "solver": "sgd",
        "learning_rate": 0.05,
        "momentum": 0.9,
        "nesterovs_momentum": True,
    },
    "adam": {"solver": "adam", "learning_rate": 1e-3},
    "adamw": {"solver": "adamw", "learning_rate": 1e-3, "weight_decay": 1e-2},
}


class Optimisers:
    """Digits (M=800, standardised), MLP 64-64-10, 20 steps in batches of 100 with
    each optimiser; 20 queries decomposed (every output)."""

    params = list(SOLVERS)
    param_names = ["solver"]
    timeout = 600

    def setup_cache(self):
        X, y, X_query, _ = digits(800, 20)
        fitted = {
            name: ExactPathKernelClassifier(
                hidden_layer_sizes=(64,),
                max_iter=20,
                batch_size=100,
                random_state=0,
                **settings,
            ).fit(X, y)
            for name, settings in SOLVERS.items()
        }
        return fitted, X, y, X_query

    def setup(self, cache, solver):
        fitted, self.X, self.y, self.X_query = cache
        self.clf = fresh(fitted[solver])

    def time_fit(self, cache, solver):
        ExactPathKernelClassifier(
            hidden_layer_sizes=(64,), max_iter=20, batch_size=100, random_state=0, **SOLVERS[solver]
        ).fit(self.X, self.y)

    def time_decompose(self, cache, solver):
        self.clf.decompose(self.X_query)

    def track_max_error(self, cache, solver):
        return max_identity_error(self.clf, self.clf.decompose(self.X_query), self.X_query)

    track_max_error.unit = "log-probability"
