"""The path-kernel regressors against scikit-learn's MLPRegressor, side by side.

Standard regression problems, each in a ``StandardScaler`` pipeline with a
standardised target (``TransformedTargetRegressor``), 5-fold CV with the same folds
for every model; prints the mean R^2 and fit time per model and data set, and the
mean and worst difference to ``MLPRegressor`` (its defaults, ``random_state=0``).

    OMP_NUM_THREADS=1 python benchmarks/bench_regressors.py            # defaults
    OMP_NUM_THREADS=1 python benchmarks/bench_regressors.py --sweep    # candidate settings
    OMP_NUM_THREADS=1 python benchmarks/bench_regressors.py --quick    # two data sets
"""

import argparse
import warnings

import numpy as np
from sklearn.compose import TransformedTargetRegressor
from sklearn.datasets import (
    load_diabetes,
    make_friedman1,
    make_friedman2,
    make_friedman3,
    make_regression,
    make_sparse_uncorrelated,
)
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import KFold, cross_validate
from sklearn.neural_network import MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from sklearn_pathkernel import DistanceKernelRegressor, ExactPathKernelRegressor


def sine(n=300, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-3, 3, (n, 2))
    return X, np.sin(X[:, 0]) * np.cos(X[:, 1]) + 0.1 * rng.randn(n)


DATASETS = {
    "diabetes": lambda: load_diabetes(return_X_y=True),
    "friedman1": lambda: make_friedman1(n_samples=400, noise=1.0, random_state=0),
    "friedman2": lambda: make_friedman2(n_samples=400, noise=10.0, random_state=0),
    "friedman3": lambda: make_friedman3(n_samples=400, noise=0.1, random_state=0),
    "linear": lambda: make_regression(n_samples=300, n_features=10, noise=10.0, random_state=0),
    "sparse": lambda: make_sparse_uncorrelated(n_samples=300, random_state=0),
    "sine": sine,
}

DEFAULTS = {
    "epk": lambda: ExactPathKernelRegressor(random_state=0),
    "distance": lambda: DistanceKernelRegressor(random_state=0),
}

CANDIDATES = {
    "epk sgd lr0.1 200": lambda: ExactPathKernelRegressor(
        solver="sgd", learning_rate=0.1, random_state=0
    ),
    "epk adam lr0.003 300": lambda: ExactPathKernelRegressor(
        solver="adam", learning_rate=0.003, max_iter=300, random_state=0
    ),
    "epk adam lr1e-3 b200": lambda: ExactPathKernelRegressor(
        solver="adam", learning_rate=1e-3, batch_size=200, random_state=0
    ),
    "dist adam lr0.01 300": lambda: DistanceKernelRegressor(
        solver="adam", learning_rate=0.01, max_iter=300, random_state=0
    ),
    "dist adam lr1e-3 b200": lambda: DistanceKernelRegressor(
        solver="adam", learning_rate=1e-3, batch_size=200, max_iter=200, random_state=0
    ),
}


def evaluate(estimator, X, y):
    """Mean 5-fold R^2 and fit time of ``StandardScaler -> estimator``, target scaled."""
    model = TransformedTargetRegressor(
        regressor=make_pipeline(StandardScaler(), estimator), transformer=StandardScaler()
    )
    folds = KFold(n_splits=5, shuffle=True, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", UserWarning)  # a diverging fit scores NaN
        scores = cross_validate(model, X, y, cv=folds, scoring="r2", error_score=np.nan)
    return scores["test_score"].mean(), scores["fit_time"].mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="evaluate candidate settings")
    parser.add_argument("--datasets", nargs="*", default=list(DATASETS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: two data sets")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(datasets=["linear", "sine"])
        args = parser.parse_args()
    models = CANDIDATES if args.sweep else DEFAULTS
    names = ["mlp", *models]
    results = {}
    print(f"{'data set':<12}" + "".join(f"{name:>22}" for name in names))
    for dataset in args.datasets:
        X, y = DATASETS[dataset]()
        row = {"mlp": evaluate(MLPRegressor(random_state=0), X, y)}
        for name, make in models.items():
            row[name] = evaluate(make(), X, y)
        results[dataset] = row
        print(
            f"{dataset:<12}" + "".join(f"{row[n][0]:>14.4f} ({row[n][1]:4.1f}s)" for n in names),
            flush=True,
        )
    print()
    for name in models:
        diffs = np.array([results[d][name][0] - results[d]["mlp"][0] for d in results])
        worst = list(results)[int(np.nanargmin(diffs))] if np.isfinite(diffs).any() else "-"
        print(
            f"{name:<24} mean R^2 difference {diffs.mean():+.4f}, "
            f"worst {diffs.min():+.4f} ({worst})"
        )


if __name__ == "__main__":
    main()
