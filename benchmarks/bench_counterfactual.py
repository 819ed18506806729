"""Counterfactual attribution on the attribution benchmark's tasks: the adjoint's
growth along the run, the cost against ``decompose`` and the fit, and the error of the
leave-one-out estimate against real retraining.

For each task of ``_attribution_tasks`` (and the same networks trained with momentum,
Nesterov and AdamW) it fits the model (seed 0), runs ``counterfactual(X_test, y_test,
target="margin")`` with the exact adjoint (``hessian=True``) and with the optimiser
family's rule, and ``decompose(X_test)``, side by side in one process, and prints:

- the growth of the exact adjoint, ``max_s ||lambda_s|| / ||lambda_S||`` (median and
  largest over the test points) and the step where it peaks (median);
- the seconds of the rule's counterfactual, of ``decompose`` and of the fit, and their
  ratios;
- with ``--loo r``: ``r`` training rows refitted with sample weight 0 (same seed and
  batch order): the error of ``loo_predictions()`` against the refitted margins,
  relative to the true change (mean over rows and test points of ``|estimate -
  actual|`` over the mean ``|actual - T|``), and the same for the exact adjoint;
- with ``--certify r``: the retraining certificate of the exact scores (rows / sum).

    python benchmarks/bench_counterfactual.py [--tasks ...] [--train 500] [--test 20]
        [--loo 10] [--certify 2]
    python benchmarks/bench_counterfactual.py --quick   # three small tasks, 100 rows
"""

import argparse
import time

import numpy as np
import torch
from _attribution_tasks import TASKS, make_task

#: The benchmark's networks with the other optimisers: (task, extra settings).
VARIANTS = {
    "cancer-mlp-momentum": ("cancer-mlp-sgd", dict(momentum=0.9)),
    "digits-mlp-nesterov": ("digits-mlp-sgd", dict(momentum=0.9, nesterovs_momentum=True,
                                                   learning_rate=0.05, weight_decay=1e-3)),
    "digits-mlp-adamw": ("digits-mlp-adam", dict(solver="adamw", weight_decay=0.01)),
}  # fmt: skip

#: ``--quick``: a smoke run (options given explicitly still win).
QUICK = dict(tasks=["digits-mlp-sgd", "cancer-mlp-adam", "digits-mlp-adamw"], train=100,
             test=10, loo=2, certify=1)  # fmt: skip


def timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def loo_errors(task, clf, results, rows):
    """Mean |estimate - actual| / mean |actual - T| of each result's loo_predictions."""
    codes = np.searchsorted(clf.classes_, task.y_test)
    actual = []
    for row in rows:
        weights = np.ones(task.n_train)
        weights[row] = 0.0
        refit = task.fit(seed=0, sample_weight=weights)
        log_proba = refit.predict_log_proba(task.X_test)
        logp = log_proba[np.arange(len(codes)), codes]
        actual.append(logp - np.log(-np.expm1(np.minimum(logp, -1e-16))))
    actual = np.array(actual).T  # (n, rows)
    change = np.abs(actual - results[0].values[:, None]).mean()
    return [np.abs(r.loo_predictions()[:, rows] - actual).mean() / change for r in results]


def run_task(name, args):
    base, extra = VARIANTS.get(name, (name, {}))
    task = make_task(base, args.train, args.test)
    task.settings.update(extra)
    clf, fit_seconds = timed(lambda: task.fit(seed=0))
    X, y = task.X_test, task.y_test
    exact = clf.counterfactual(
        X, y, target="margin", hessian=True, certify=args.certify, batch_size=64
    )
    rule, seconds = timed(lambda: clf.counterfactual(X, y, target="margin", batch_size=64))
    _, decompose_seconds = timed(lambda: clf.decompose(X))
    growth = exact.growth
    norms = exact.adjoint_norms / exact.adjoint_norms[-1]
    peak_step = int(np.median(np.argmax(norms, axis=0)))
    certificate = exact.certificate
    check = "—" if certificate is None else (
        f"{certificate.row_error:.1e} / {certificate.total_error:.1e}"
    )  # fmt: skip
    loo = "—"
    if args.loo:
        rows = np.random.RandomState(1).choice(task.n_train, args.loo, replace=False)
        errors = loo_errors(task, clf, [rule, exact], rows)
        loo = f"{errors[0]:.3f} / {errors[1]:.3f}"
    print(
        f"| {name} | {clf.n_steps_} | {np.median(growth):.3g} | {growth.max():.3g} | "
        f"{peak_step} | {'exact' if rule.hessian else 'no Hessian'} | {seconds:.1f} | "
        f"{decompose_seconds:.1f} | {fit_seconds:.1f} | {seconds / decompose_seconds:.2f} | "
        f"{seconds / len(y) / fit_seconds:.3f} | {exact.replay_error:.1e} | {check} | {loo} |",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = list(TASKS) + list(VARIANTS)
    parser.add_argument("--tasks", nargs="+", default=names, choices=names)
    parser.add_argument("--train", type=int, default=500)
    parser.add_argument("--test", type=int, default=20)
    parser.add_argument("--certify", type=int, default=0)
    parser.add_argument("--loo", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 small tasks")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| task | steps | exact growth (median) | exact growth (max) | peak at step | rule "
        "| counterfactual (s) | decompose (s) | fit (s) | counterfactual / decompose "
        "| per query / fit | replay error | certificate (rows / sum) "
        "| LOO error (rule / exact) |"
    )
    print("|" + "---|" * 14)
    for name in args.tasks:
        run_task(name, args)


if __name__ == "__main__":
    main()
