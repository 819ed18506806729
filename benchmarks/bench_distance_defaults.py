"""Sweep of DistanceKernelClassifier settings against MLPClassifier's defaults.

Evaluates candidate settings of ``DistanceKernelClassifier`` (each given as
changes to the class defaults) on the data sets of ``bench_distance_vs_mlp.py``:
``StandardScaler`` pipeline, 5-fold stratified CV, the same folds for both
models, ``random_state=0``. Prints, per candidate, the accuracy per data set,
the mean difference to ``MLPClassifier`` (its defaults) and the worst data set,
in points, and the mean fit time per fold.

    python benchmarks/bench_distance_defaults.py                   # every candidate
    python benchmarks/bench_distance_defaults.py --screen          # on SCREEN only
    python benchmarks/bench_distance_defaults.py --configs sgd-1.5-500 adam-0.02-500-eps1e-4
    python benchmarks/bench_distance_defaults.py --datasets digits wine \\
        --config "solver='adam', learning_rate=0.01, max_iter=300"
    python benchmarks/bench_distance_defaults.py --list
    python benchmarks/bench_distance_defaults.py --quick   # the present defaults, 2 data sets

``--config`` takes keyword arguments as Python literals (repeatable). MLP scores
are cached in ``--mlp-cache`` (JSON) so that screening runs do not refit it;
``--log`` appends one JSON line per candidate and data set. Set
``OMP_NUM_THREADS=1`` on a shared machine.
"""

import argparse
import ast
import json
import os
import time
import warnings

import numpy as np
from bench_distance_vs_mlp import DATASETS
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import StratifiedKFold, cross_validate
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from sklearn_pathkernel import DistanceKernelClassifier

# The sweep of doc/benchmarks_distance.rst, every swept setting explicit (so that
# the names keep their meaning when the class defaults change); the other
# parameters at the class defaults. "sgd-1.5-500" is the former default,
# "adam-0.02-500-eps1e-4" the present one.
ADAM = dict(solver="adam", epsilon=1e-8)  # torch's epsilon, as swept before epsilon
CANDIDATES = {
    "sgd-1.5-500": dict(solver="sgd", learning_rate=1.5, max_iter=500),
    "momentum-0.9-0.15-500": dict(solver="sgd", momentum=0.9, learning_rate=0.15, max_iter=500),
    "adam-0.01-200": dict(ADAM, learning_rate=0.01, max_iter=200),
    "adam-0.02-200": dict(ADAM, learning_rate=0.02, max_iter=200),
    "adam-0.1-300": dict(ADAM, learning_rate=0.1, max_iter=300),
    "adam-0.02-300": dict(ADAM, learning_rate=0.02, max_iter=300),
    "adam-0.01-500": dict(ADAM, learning_rate=0.01, max_iter=500),
    "adam-0.02-500": dict(ADAM, learning_rate=0.02, max_iter=500),
    "adam-0.03-500": dict(ADAM, learning_rate=0.03, max_iter=500),
    "adam-0.05-500": dict(ADAM, learning_rate=0.05, max_iter=500),
    "adam-0.05-500-rbf": dict(ADAM, learning_rate=0.05, max_iter=500, kernel="rbf"),
    "adamw-0.05-500-wd0.01": dict(
        ADAM, solver="adamw", learning_rate=0.05, max_iter=500, weight_decay=0.01
    ),
    "adam-0.01-100-batch200": dict(ADAM, learning_rate=0.01, max_iter=100, batch_size=200),
    "adam-0.02-500-distance-head": dict(ADAM, learning_rate=0.02, max_iter=500, head="distance"),
    "adam-0.02-500-eps1e-4": dict(ADAM, learning_rate=0.02, max_iter=500, epsilon=1e-4),
    "adam-0.02-500-eps1e-3": dict(ADAM, learning_rate=0.02, max_iter=500, epsilon=1e-3),
}
# Screening subset: the data sets where the former default trailed MLPClassifier.
SCREEN = ["classification", "xor-like", "blobs", "digits", "wine", "breast-cancer"]
#: ``--quick``: a smoke run (options given explicitly still win).
QUICK = dict(datasets=["moons", "iris"], configs=["adam-0.02-500-eps1e-4"])


def parse_config(text):
    """``"a=1, b='x'"`` -> ``{"a": 1, "b": "x"}`` (values are Python literals)."""
    call = ast.parse(f"f({text})", mode="eval").body
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def config_name(params):
    return ",".join(f"{key}={value!r}" for key, value in params.items()) or "defaults"


def cross_val(estimator, X, y):
    """Per-fold accuracies and mean fit time of ``StandardScaler -> estimator``."""
    folds = StratifiedKFold(n_splits=5, shuffle=True, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        scores = cross_validate(make_pipeline(StandardScaler(), estimator), X, y, cv=folds)
    return scores["test_score"].tolist(), float(scores["fit_time"].mean())


def mlp_scores(names, data, cache_file):
    cache = {}
    if cache_file and os.path.exists(cache_file):
        with open(cache_file) as f:
            cache = json.load(f)
    for name in names:
        if name not in cache:
            folds, fit_time = cross_val(MLPClassifier(random_state=0), *data[name])
            cache[name] = {"folds": folds, "fit_time": fit_time}
            if cache_file:
                with open(cache_file, "w") as f:
                    json.dump(cache, f, indent=1)
    return cache


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="*", default=None, help="default: all")
    parser.add_argument("--screen", action="store_true", help="the SCREEN data sets")
    parser.add_argument("--configs", nargs="*", default=None, help="names from CANDIDATES")
    parser.add_argument("--config", action="append", default=[], help="keyword arguments")
    parser.add_argument("--mlp-cache", default=None, help="JSON file caching MLP scores")
    parser.add_argument("--log", default=None, help="append JSON lines here")
    parser.add_argument("--list", action="store_true", help="print the candidates and exit")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: the present defaults on two small data sets",
    )
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    if args.list:
        for name, params in CANDIDATES.items():
            print(f"{name:<28} {config_name(params)}")
        return

    configs = {name: CANDIDATES[name] for name in (args.configs or [])}
    configs.update({config_name(p): p for p in map(parse_config, args.config)})
    if not configs:
        configs = dict(CANDIDATES)
    if args.datasets is None:
        args.datasets = SCREEN if args.screen else list(DATASETS)
    data = {name: DATASETS[name]() for name in args.datasets}
    mlp = mlp_scores(args.datasets, data, args.mlp_cache)

    print(
        "MLPClassifier (defaults): "
        + ", ".join(f"{name} {np.mean(mlp[name]['folds']):.4f}" for name in args.datasets)
    )
    for label, params in configs.items():
        print(f"\n{label}: {config_name(params)}")
        print(
            f"  {'dataset':<15} {'distance':>8} {'mlp':>7} {'diff':>7} {'t_dist':>7} {'t_mlp':>6}"
        )
        diffs, start = {}, time.perf_counter()
        for name, (X, y) in data.items():
            folds, fit_time = cross_val(DistanceKernelClassifier(random_state=0, **params), X, y)
            acc, acc_mlp = np.mean(folds), np.mean(mlp[name]["folds"])
            diffs[name] = 100 * (acc - acc_mlp)
            print(
                f"  {name:<15} {acc:8.4f} {acc_mlp:7.4f} {diffs[name]:+7.2f} "
                f"{fit_time:6.2f}s {mlp[name]['fit_time']:5.2f}s",
                flush=True,
            )
            if args.log:
                with open(args.log, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "label": label,
                                "params": params,
                                "dataset": name,
                                "folds": folds,
                                "fit_time": fit_time,
                                "mlp_folds": mlp[name]["folds"],
                                "mlp_fit_time": mlp[name]["fit_time"],
                            }
                        )
                        + "\n"
                    )
        worst = min(diffs, key=diffs.get)
        print(
            f"  => mean diff {np.mean(list(diffs.values())):+.2f} points, worst "
            f"{diffs[worst]:+.2f} ({worst}), {len(diffs)} data sets, "
            f"{time.perf_counter() - start:.0f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
