"""Exactness and cost of the test-copy quadrature, side by side.

On the EPK paper's toy (3 classes, 100-d Gaussians, ReLU 100-64-3, M=300,
lr 0.05, full-batch steps), decompose 60 queries with every scheme and print the
max error of ``bias + sum(contributions)`` against the network, the time, and,
for the exact scheme, the pieces, nodes and kink-search evaluations per step
and query.

    python benchmarks/bench_quadrature.py [--steps 50] [--threads 2]
    python benchmarks/bench_quadrature.py --quick   # 10 steps, one thread
"""

import argparse
import time

import numpy as np
import torch

from sklearn_pathkernel import ExactPathKernelClassifier
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._steps import PathSteps
from sklearn_pathkernel._engine.integration import _kinks, _switches
from sklearn_pathkernel._engine.integration._quadrature import KinkSplittingRule


def paper_toy(n_train=300, n_queries=60, seed=0):
    rng = np.random.RandomState(seed)
    means = np.zeros((3, 100))
    means[:, :2] = [[1, 4], [4, 1], [5, 5]]
    y = rng.randint(0, 3, n_train + n_queries)
    X = means[y] + rng.randn(n_train + n_queries, 100)
    return X[:n_train], y[:n_train], X[n_train:]


def count_exact_cost(engine, Q):
    """Per step and query: pieces, nodes and switch-state evaluations (rows of the
    kink search's forward passes); per step: those forward passes."""
    calls = {"rows": 0, "passes": 0}
    original = _switches.switch_state

    def counting(probe, start, direction, X, t, rows=None):
        calls["rows"] += X.shape[0] if rows is None else len(rows)
        calls["passes"] += 1
        return original(probe, start, direction, X, t, rows)

    _kinks.switch_state = counting
    steps, rule = PathSteps(engine.path, Q.device), KinkSplittingRule()
    try:
        nodes = 0
        for index in range(engine.path.n_steps):
            step = steps.step(index)
            nodes += rule.row_nodes(engine.probe, step, Q, engine.n_nodes).nodes.rows.size
    finally:
        _kinks.switch_state = original
    per = engine.path.n_steps * Q.shape[0]
    passes = calls["passes"] / engine.path.n_steps
    return nodes / engine.n_nodes / per, nodes / per, calls["rows"] / per, passes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 steps, 1 thread")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(steps=10, threads=1)
        args = parser.parse_args()
    torch.set_num_threads(args.threads)

    X, y, X_query = paper_toy()
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(64,), learning_rate=0.05, max_iter=args.steps, random_state=0
    ).fit(X, y)
    Q = torch.tensor(X_query)
    network = clf.predict_log_proba(X_query)
    print(f"paper toy: M=300, 60 queries, {args.steps} full-batch steps, {args.threads} threads")
    print(f"{'scheme':<22}{'max |error|':>14}{'certificate':>14}{'time (s)':>10}")
    schemes = [("dpk", 1), ("riemann", 10), ("riemann", 100), ("exact", None)]
    for quadrature, n_points in schemes:
        engine = PathKernelEngine(
            clf.module_,
            clf.path_,
            clf._fit_X,
            quadrature=quadrature,
            n_points=n_points or 100,
        )
        start = time.perf_counter()
        parts = engine.decompose(Q)
        elapsed = time.perf_counter() - start
        error = np.abs(parts.bias + parts.contributions.sum(1) - network).max()
        name = quadrature if n_points in (None, 1) else f"{quadrature} T={n_points}"
        print(f"{name:<22}{error:>14.2e}{parts.quadrature_error.max():>14.2e}{elapsed:>10.2f}")
    pieces, nodes, searches, passes = count_exact_cost(engine, Q)
    print(
        f"exact: {pieces:.3f} pieces, {nodes:.2f} gradient nodes and {searches:.2f} "
        f"kink-search evaluations per step and query, in {passes:.2f} batched forward "
        "passes per step"
    )


if __name__ == "__main__":
    main()
