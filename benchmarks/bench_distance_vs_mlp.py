"""DistanceKernelClassifier vs scikit-learn's MLPClassifier, side by side.

Eleven data sets (four shipped with scikit-learn, seven generated with fixed
seeds), each in a ``StandardScaler`` pipeline, 5-fold stratified CV (the same
folds for every model). Prints mean accuracy and mean fit time per
model and data set, then ablations of the distance network (kernel, init,
skew transform, head), each changing one default at a time.

    python benchmarks/bench_distance_vs_mlp.py            # table + ablations
    python benchmarks/bench_distance_vs_mlp.py --no-ablations
    python benchmarks/bench_distance_vs_mlp.py --datasets moons xor-like ...
    python benchmarks/bench_distance_vs_mlp.py --quick   # 2 data sets, one short ablation

Set ``OMP_NUM_THREADS=1`` on a shared machine: both models then use one core.
"""

import argparse
import time
import warnings

import numpy as np
from sklearn.datasets import (
    load_breast_cancer,
    load_digits,
    load_iris,
    load_wine,
    make_blobs,
    make_circles,
    make_classification,
    make_gaussian_quantiles,
    make_hastie_10_2,
    make_moons,
)
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import StratifiedKFold, cross_validate
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from sklearn_pathkernel import DistanceKernelClassifier


def xor_like(n_samples=600, n_noise=2, random_state=0):
    """XOR of the signs of two Gaussian features, plus ``n_noise`` irrelevant features."""
    rng = np.random.RandomState(random_state)
    X = rng.randn(n_samples, 2 + n_noise)
    return X, ((X[:, 0] > 0) ^ (X[:, 1] > 0)).astype(int)


def hastie(n_samples=1000, random_state=0):
    """``make_hastie_10_2`` (10 Gaussian features, y = sum x_i^2 > 9.34), subsampled."""
    X, y = make_hastie_10_2(n_samples=n_samples, random_state=random_state)
    return X, (y > 0).astype(int)


DATASETS = {
    "moons": lambda: make_moons(n_samples=300, noise=0.2, random_state=0),
    "circles": lambda: make_circles(n_samples=300, noise=0.1, factor=0.5, random_state=0),
    "iris": lambda: load_iris(return_X_y=True),
    "wine": lambda: load_wine(return_X_y=True),
    "breast-cancer": lambda: load_breast_cancer(return_X_y=True),
    "digits": lambda: load_digits(return_X_y=True),
    "blobs": lambda: make_blobs(
        n_samples=600, centers=4, n_features=4, cluster_std=3.0, random_state=0
    ),
    "classification": lambda: make_classification(
        n_samples=800,
        n_features=20,
        n_informative=8,
        n_redundant=4,
        n_classes=4,
        n_clusters_per_class=2,
        flip_y=0.02,
        random_state=0,
    ),
    "quantiles": lambda: make_gaussian_quantiles(
        n_samples=600, n_features=3, n_classes=3, random_state=0
    ),
    "xor-like": xor_like,
    "hastie": hastie,
}

ABLATIONS = [
    ("kernel", ["sqeuclidean", "euclidean", "rbf", "laplacian", "cosine"]),
    ("init", ["uniform", "kmeans++", "samples"]),
    ("skew_transform", ["none", "sqrt", "log1p", "standardize"]),
    ("head", ["linear", "distance"]),
]


def evaluate(estimator, X, y):
    """Mean 5-fold accuracy and mean fit time of ``StandardScaler -> estimator``."""
    folds = StratifiedKFold(n_splits=5, shuffle=True, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        scores = cross_validate(make_pipeline(StandardScaler(), estimator), X, y, cv=folds)
    return scores["test_score"].mean(), scores["fit_time"].mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="*", default=list(DATASETS))
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: moons and iris, two kernels of the ablations",
    )
    args = parser.parse_args()
    ablations = ABLATIONS
    if args.quick:
        parser.set_defaults(datasets=["moons", "iris"])
        args = parser.parse_args()
        ablations = [(ABLATIONS[0][0], ABLATIONS[0][1][:2])]
    data = {name: DATASETS[name]() for name in args.datasets}

    print("Accuracy (mean of 5 folds) and fit time per fold, default settings")
    print(f"{'dataset':<14} {'distance':>9} {'mlp':>7} {'diff':>7} {'t_dist':>8} {'t_mlp':>8}")
    diffs = []
    for name, (X, y) in data.items():
        acc_d, time_d = evaluate(DistanceKernelClassifier(random_state=0), X, y)
        acc_m, time_m = evaluate(MLPClassifier(random_state=0), X, y)
        diffs.append(acc_d - acc_m)
        print(
            f"{name:<14} {acc_d:9.4f} {acc_m:7.4f} {100 * (acc_d - acc_m):+7.2f} "
            f"{time_d:7.2f}s {time_m:7.2f}s",
            flush=True,
        )
    print(
        f"mean difference {100 * np.mean(diffs):+.2f} points, "
        f"worst {100 * np.min(diffs):+.2f} points (distance - mlp)"
    )
    if args.no_ablations:
        return
    for parameter, values in ablations:
        print(f"\nAblation: {parameter} (accuracy; other parameters at their defaults)")
        print(f"{'value':<12} " + " ".join(f"{name[:9]:>9}" for name in data) + f" {'mean':>7}")
        for value in values:
            start = time.perf_counter()
            accs = [
                evaluate(DistanceKernelClassifier(random_state=0, **{parameter: value}), X, y)[0]
                for X, y in data.values()
            ]
            print(
                f"{value:<12} " + " ".join(f"{a:9.4f}" for a in accs) + f" {np.mean(accs):7.4f}"
                f"  ({time.perf_counter() - start:.0f}s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
