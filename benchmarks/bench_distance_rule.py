"""Factored distance-layer rule vs the generic ``torch.func`` rule, on digits.

Fits one :class:`DistanceKernelClassifier` (StandardScaler-ed digits, full-batch
gradient descent) and times, with each rule, the training Gram
``clf.kernel_(X_train)`` and the exact decomposition ``clf.decompose(X_query)``:

- ``generic``: every distance layer by ``GenericRule`` (materialised per-example
  gradients; quadrature nodes evaluated one distinct ``t`` at a time), the
  behaviour before ``DistanceRule``;
- ``factored``: ``DistanceRule`` with per-row ``t`` (all nodes in one pass);
- ``factored, t grouped`` (optional): ``DistanceRule``'s factored inner products,
  nodes still evaluated one distinct ``t`` at a time (separates the two changes).

Prints times, ratios against ``generic`` and the largest differences of the
results (relative to the Gram's largest entry; absolute for the decomposition).

    python benchmarks/bench_distance_rule.py       # M=500, 64 memories, 30 steps, 2 queries
    python benchmarks/bench_distance_rule.py --variants factored "factored, t grouped" generic
    python benchmarks/bench_distance_rule.py --n-train 300 --n-query 10 --steps 10
    python benchmarks/bench_distance_rule.py --quick   # M=100, 16 memories, 5 steps, 1 query

The generic rule's decomposition takes most of the run (about 1.5 min per query
with the defaults on a 2-core CPU); ``--n-query`` scales it.

Set ``OMP_NUM_THREADS`` to pin the number of threads (torch's default: all cores).
"""

import argparse
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

from sklearn_pathkernel import DistanceKernelClassifier
from sklearn_pathkernel._engine.rules._registry import RULES
from sklearn_pathkernel._nn._distance import DistanceLayer

#: ``--quick``: a smoke run (options given explicitly still win).
QUICK = dict(n_train=100, n_query=1, memories=16, steps=5)


def fitted(args):
    X, y = load_digits(return_X_y=True)
    rng = np.random.RandomState(0)
    order = rng.permutation(len(X))
    train, query = order[: args.n_train], order[args.n_train : args.n_train + args.n_query]
    scaler = StandardScaler().fit(X[train])
    clf = DistanceKernelClassifier(
        hidden_layer_sizes=(args.memories,),
        kernel=args.kernel,
        max_iter=args.steps,
        random_state=0,
    )
    start = time.perf_counter()
    clf.fit(scaler.transform(X[train]), y[train])
    fit_time = time.perf_counter() - start
    clf.train_accuracy_ = clf.score(scaler.transform(X[train]), y[train])
    return clf, scaler.transform(X[train]), scaler.transform(X[query]), fit_time


def run(clf, X_train, X_query, variant):
    """Gram and decomposition with a fresh engine built under ``variant``."""
    original = RULES[DistanceLayer]
    if variant == "generic":
        del RULES[DistanceLayer]
    try:
        clf.__dict__.pop("_kernel_cache", None)  # a new engine: new rules
        engine = clf._engine()
        if variant == "factored, t grouped":
            engine.probe.per_row_t = False
        rules = sorted({type(rule).__name__ for rule in engine.probe.rules})
        start = time.perf_counter()
        gram = clf.kernel_(X_train)
        gram_time = time.perf_counter() - start
        start = time.perf_counter()
        parts = clf.decompose(X_query)
        decompose_time = time.perf_counter() - start
    finally:
        RULES[DistanceLayer] = original
        clf.__dict__.pop("_kernel_cache", None)
    identity = np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max()
    return {
        "rules": ", ".join(rules),
        "gram": gram,
        "parts": parts,
        "gram_time": gram_time,
        "decompose_time": decompose_time,
        "identity": identity,
        "residual": parts.residual.max(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-train", type=int, default=500)
    parser.add_argument("--n-query", type=int, default=2)
    parser.add_argument("--memories", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kernel", default="sqeuclidean")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["factored", "generic"],
        choices=["factored", "factored, t grouped", "generic"],
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: M=100, 5 steps")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    clf, X_train, X_query, fit_time = fitted(args)
    print(
        f"digits, StandardScaler: M={args.n_train} training points, {args.n_query} queries, "
        f"{X_train.shape[1]} features, 10 classes; DistanceKernelClassifier(kernel="
        f"{args.kernel!r}, hidden_layer_sizes=({args.memories},), max_iter={args.steps}); "
        f"fit {fit_time:.2f} s, train accuracy {clf.train_accuracy_:.2f}"
    )
    results = {}
    for variant in args.variants:
        results[variant] = result = run(clf, X_train, X_query, variant)
        print(
            f"{variant:>20s} [{result['rules']}]: Gram {result['gram_time']:8.2f} s, "
            f"decompose {result['decompose_time']:8.2f} s "
            f"(sum identity {result['identity']:.1e}, residual {result['residual']:.1e})",
            flush=True,
        )
    if "generic" in results:
        base = results["generic"]
        scale = np.abs(base["gram"]).max()
        for variant, result in results.items():
            if variant == "generic":
                continue
            gram_diff = np.abs(result["gram"] - base["gram"]).max() / scale
            parts_diff = np.abs(result["parts"].contributions - base["parts"].contributions).max()
            print(
                f"{variant:>20s} vs generic: Gram {base['gram_time'] / result['gram_time']:6.1f}x "
                f"faster, decompose {base['decompose_time'] / result['decompose_time']:6.1f}x "
                f"faster; max |Gram diff| / max |Gram| = {gram_diff:.1e}, "
                f"max |contribution diff| = {parts_diff:.1e}"
            )


if __name__ == "__main__":
    main()
