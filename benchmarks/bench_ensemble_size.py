"""Fresh-seed LDS against the number of averaged runs: the counterfactual and TracIn.

For one task of ``bench_attribution.py`` (same data, network, subsets and seeds, so the
figures are those of its ``counterfactual-ens`` and ``tracin-ens`` rows at E = 5) it
trains ``--runs`` models from seeds 0, 1, ..., scores the test points with each run's
``counterfactual(..., target="margin")`` (the optimiser family's rule) and dattri's
TracIn over 10 checkpoints, and prints the LDS (fresh seeds, and same seed) of the
mean of the first E runs' scores, raw and with each run standardised per test point,
and each run's scale (the raw mean weighs the runs by it).

    python benchmarks/bench_ensemble_size.py --task digits-mlp-sgd [--runs 10]
        [--train 500] [--test 100] [--subsets 50]
    python benchmarks/bench_ensemble_size.py --quick   # 3 runs, 100 rows, 6 subsets

TracIn and the metrics are dattri's (the ``benchmarks`` extra).
"""

import argparse
import time

import numpy as np
import torch
from _attribution_methods import Context, _standardised, tracin
from _attribution_tasks import TASKS, lds_ground_truth, lds_subsets, make_task
from _extra import require
from bench_attribution import _quiet_progress_bars, lds_score

#: ``--quick``: a smoke run (options given explicitly still win).
QUICK = dict(runs=3, train=100, test=10, subsets=6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="digits-mlp-sgd", choices=list(TASKS))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--train", type=int, default=500)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--subsets", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 runs, 100 rows")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    require(["dattri"], args.quick, "bench_ensemble_size.py (dattri's TracIn and LDS)")
    torch.set_num_threads(1)
    _quiet_progress_bars()
    task = make_task(args.task, args.train, args.test)
    subsets = lds_subsets(task.n_train, args.subsets)
    truth = lds_ground_truth(task, subsets, same_seed=False)
    truth_same = lds_ground_truth(task, subsets, same_seed=True)
    scores = {"counterfactual": [], "tracin-10": []}
    seconds = {name: 0.0 for name in scores}
    for seed in range(args.runs):
        clf = task.fit(seed=seed)
        start = time.perf_counter()
        scores["counterfactual"].append(
            clf.counterfactual(task.X_test, task.y_test, target="margin").scores.T
        )
        seconds["counterfactual"] += time.perf_counter() - start
        start = time.perf_counter()
        scores["tracin-10"].append(tracin(Context(task, clf, clf, task.y_train, 1)))
        seconds["tracin-10"] += time.perf_counter() - start
    print(f"## {args.task}: M={task.n_train}, {args.test} test points, {args.subsets} subsets")
    print("| method | E | LDS | LDS same-seed | LDS (std.) | LDS same-seed (std.) |")
    print("|---|---|---|---|---|---|")
    sizes = sorted({1, 2, 3, 5, 10, 20, args.runs} & set(range(1, args.runs + 1)))
    for name, runs in scores.items():
        for size in sizes:
            raw = np.mean(runs[:size], axis=0)
            std = np.mean([_standardised(s) for s in runs[:size]], axis=0)
            cells = [lds_score(s, t, subsets) for s in (raw, std) for t in (truth, truth_same)]
            print(f"| {name} | {size} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
        print(f"|   ({name}: {seconds[name] / args.runs:.1f} s per run) |")
        scales = [np.median(run.std(axis=0)) for run in runs]
        print(f"|   ({name}: each run's scale, the median over test points of the scores' "
              f"deviation over rows: {', '.join(f'{s:.2g}' for s in scales)}) |")  # fmt: skip


if __name__ == "__main__":
    main()
