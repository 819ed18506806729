"""The kink search with and without the switch states shared between steps.

Usage::

    python benchmarks/bench_kink_reuse.py --cells cnn/sgd/mini cnn2/sgd/mini cnn/momentum/mini

Per cell of ``bench_matrix.py`` (digits, M=1000, 100 steps), the time spent in
``row_kinks`` during ``decompose`` of ``--queries`` rows and the rows the switch
recorder evaluated, with the states at a step's ends reused by the next step
(this commit) and without (``BoundaryCache.known`` answering None: each step
searched from scratch, its levels still sharing the first level's ends), timed
alternately in one process, the fastest of ``--repeats``; and the two
decompositions' largest relative difference.
"""

import argparse
import functools
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_matrix import FULL, digits, fresh, make_estimator  # noqa: E402

import sklearn_pathkernel  # noqa: E402
from sklearn_pathkernel._engine.integration import _kinks, _quadrature  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001


class KinkTimer:
    """Seconds in ``row_kinks`` and rows given to ``switch_state``, while installed."""

    def __init__(self):
        self.seconds, self.rows = 0.0, 0

    def install(self):
        row_kinks, switch_state = _kinks.row_kinks, _kinks.switch_state

        def timed_row_kinks(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return row_kinks(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - begin

        def counted(probe, start, direction, X, t):
            self.rows += X.shape[0]
            return switch_state(probe, start, direction, X, t)

        _quadrature.row_kinks, _kinks.switch_state = timed_row_kinks, counted
        return lambda: (
            setattr(_quadrature, "row_kinks", row_kinks),
            setattr(_kinks, "switch_state", switch_state),
        )


def measure(clf, queries, reuse):
    known = _quadrature.BoundaryCache.known
    if not reuse:
        _quadrature.BoundaryCache.known = lambda self, X, index: None
    timer = KinkTimer()
    restore = timer.install()
    try:
        fresh(clf)
        parts = clf.decompose(queries)
    finally:
        restore()
        _quadrature.BoundaryCache.known = known
    return timer, parts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="*", default=["cnn/sgd/mini", "cnn2/sgd/mini"])
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"digits, M=1000, {args.queries} queries, best of {args.repeats}")
    print(f"{'cell':<22}{'reuse s':>9}{'fresh s':>9}{'ratio':>7}{'rows':>9}{'rows':>9}  diff")
    for name in args.cells:
        cell = tuple(name.split("/"))
        cell = cell if len(cell) == 4 else (*cell, "clf")
        X, y, Q = digits(1000, args.queries)
        if cell[3] == "reg":
            y = np.eye(10)[y]
        clf = make_estimator(sklearn_pathkernel, cell, FULL["steps"], FULL["batch_size"], 1000)
        clf.fit(X, y)
        best, results = {True: np.inf, False: np.inf}, {}
        for repeat in range(args.repeats):
            for reuse in (True, False) if repeat % 2 == 0 else (False, True):
                timer, parts = measure(clf, Q, reuse)
                best[reuse] = min(best[reuse], timer.seconds)
                results[reuse] = (timer.rows, parts.contributions)
        a, b = results[True][1], results[False][1]
        diff = np.abs(a - b).max() / np.abs(b).max()
        print(
            f"{name:<22}{best[True]:>9.2f}{best[False]:>9.2f}{best[False] / best[True]:>6.2f}x"
            f"{results[True][0]:>9}{results[False][0]:>9}  {diff:.1e}"
        )


if __name__ == "__main__":
    main()
