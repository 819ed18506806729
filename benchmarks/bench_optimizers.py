"""Cost of the exact decomposition for every solver, against plain SGD, in one run.

On the EPK paper's toy (3 classes, 100-d Gaussians, ReLU 100-64-3, M=300, 60
queries, full-batch steps), fit the same network with every solver and decompose
the queries. Plain SGD keeps every layer's factored rule; momentum, Nesterov, Adam
and AdamW accumulate materialised test features backward over the steps (see
``PathKernelEngine.decompose``). Prints, per solver, the decomposition's time (median
of ``--repeats`` calls), its ratio to plain SGD's, and the max error of ``bias +
sum(contributions) + decay`` against the network's own log-probabilities.

    python benchmarks/bench_optimizers.py [--steps 50] [--threads 2] [--repeats 3]
    python benchmarks/bench_optimizers.py --quick   # 10 steps, one thread, one call
"""

import argparse
import time

import numpy as np
import torch
from bench_quadrature import paper_toy  # the same toy, one definition

from sklearn_pathkernel import ExactPathKernelClassifier

SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate=0.05),
    "sgd + weight decay": dict(solver="sgd", learning_rate=0.05, weight_decay=1e-3),
    "momentum 0.9": dict(solver="sgd", learning_rate=0.01, momentum=0.9),
    "nesterov 0.9 + decay": dict(
        solver="sgd", learning_rate=0.01, momentum=0.9, nesterovs_momentum=True, weight_decay=1e-3
    ),
    "adam": dict(solver="adam", learning_rate=1e-3),
    "adam + weight decay": dict(solver="adam", learning_rate=1e-3, weight_decay=1e-3),
    "adamw": dict(solver="adamw", learning_rate=1e-3, weight_decay=1e-2),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 steps, 1 call")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(steps=10, threads=1, repeats=1)
        args = parser.parse_args()
    torch.set_num_threads(args.threads)
    X, y, queries = paper_toy()
    print(
        f"Paper toy: ReLU 100-64-3, M={X.shape[0]}, {queries.shape[0]} queries, "
        f"{args.steps} full-batch steps, {args.threads} threads, median of {args.repeats}"
    )
    print(f"{'solver':<22} {'fit':>7} {'decompose':>10} {'vs sgd':>7} {'max |error|':>12}")
    baseline = None
    for name, settings in SOLVERS.items():
        clf = ExactPathKernelClassifier(
            hidden_layer_sizes=(64,), max_iter=args.steps, random_state=0, **settings
        )
        start = time.perf_counter()
        clf.fit(X, y)
        fit_time = time.perf_counter() - start
        times = []
        for _ in range(args.repeats):
            clf.__dict__.pop("_kernel_cache", None)  # every call pays the whole cost
            start = time.perf_counter()
            parts = clf.decompose(queries)
            times.append(time.perf_counter() - start)
        elapsed = float(np.median(times))
        baseline = baseline or elapsed
        print(
            f"{name:<22} {fit_time:6.2f}s {elapsed:9.2f}s {elapsed / baseline:6.1f}x "
            f"{parts.residual.max():12.1e}"
        )


if __name__ == "__main__":
    main()
