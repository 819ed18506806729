"""Counterfactual attribution on the attribution benchmark's tasks: the adjoint's
growth along the run, and the cost against ``decompose`` and the fit.

For each task of ``_attribution_tasks`` it fits the model (seed 0), runs
``counterfactual(X_test, y_test, target="margin")`` and ``decompose(X_test)`` on the
same test points side by side in one process, and prints the growth of the pulled-back
target gradient, ``max_s ||lambda_s|| / ||lambda_S||`` (median and largest over the test
points), where along the run it peaks, and the seconds of each computation with their
ratios. ``--certify r`` also checks ``r`` rows by finite differences of real retraining.

    python benchmarks/bench_counterfactual.py [--tasks ...] [--train 500] [--test 20]
"""

import argparse
import time

import numpy as np
import torch
from _attribution_tasks import TASKS, make_task


def timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def run_task(name, args):
    task = make_task(name, args.train, args.test)
    clf, fit_seconds = timed(lambda: task.fit(seed=0))
    X, y = task.X_test, task.y_test
    result, seconds = timed(
        lambda: clf.counterfactual(X, y, target="margin", certify=args.certify, batch_size=64)
    )
    _, decompose_seconds = timed(lambda: clf.decompose(X))
    growth = result.growth
    norms = result.adjoint_norms / result.adjoint_norms[-1]
    peak_step = int(np.median(np.argmax(norms, axis=0)))
    certificate = result.certificate
    check = (
        "—"
        if certificate is None
        else f"{certificate.row_error:.1e} / {certificate.total_error:.1e}"
    )
    print(
        f"| {name} | {clf.n_steps_} | {np.median(growth):.3g} | {growth.max():.3g} | "
        f"{peak_step} | {seconds:.1f} | {decompose_seconds:.1f} | {fit_seconds:.1f} | "
        f"{seconds / decompose_seconds:.2f} | {seconds / len(y) / fit_seconds:.3f} | "
        f"{result.replay_error:.1e} | {check} |",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--train", type=int, default=500)
    parser.add_argument("--test", type=int, default=20)
    parser.add_argument("--certify", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| task | steps | growth (median) | growth (max) | peak at step | counterfactual (s) "
        "| decompose (s) | fit (s) | counterfactual / decompose | per query / fit "
        "| replay error | certificate (rows / sum) |"
    )
    print("|" + "---|" * 12)
    for name in args.tasks:
        run_task(name, args)


if __name__ == "__main__":
    main()
