"""Data attribution, side by side: the exact decomposition against dattri and captum.

On each task (see ``_attribution_tasks``: digits MLP with SGD and Adam, digits
CNN with SGD, breast-cancer MLP with SGD and Adam; M training and n test points) it fits
the model, builds the ground truth, runs every method (``_attribution_methods``)
in a forked process of its own (wall time and peak resident memory above the
fork), and prints one table per task, with dattri's metric functions:

- LDS: ``dattri.metric.lds`` over ``--subsets`` random halves (alpha = 0.5),
  retrained from fresh seeds, the target the test points' true-label margin;
- LDS same-seed: the same halves retrained from the full run's initial weights
  and batch order (removed points weighted 0);
- LOO: ``dattri.metric.loo_corr`` over ``--loo`` removed training points (same
  seed), the target the margin's drop;
- mislabel: 10 % of the labels flipped, ``dattri.metric.mislabel_detection_auc``
  of the self scores, and the share of flipped labels in the top 10 % / 20 %.

Optional dependencies: ``pip install -c constraints.txt dattri captum`` (the
``benchmarks`` extra). Writes ``--json`` with every number.

    python benchmarks/bench_attribution.py [--quick] [--tasks digits-mlp-sgd ...]
        [--train 500] [--test 100] [--subsets 50] [--loo 40] [--ensemble 3]
"""

import argparse
import json
import multiprocessing
import time
import traceback

import numpy as np
import torch
from _attribution_methods import (
    ENSEMBLE_METHODS,
    FIELD_METHODS,
    HORIZON_METHODS,
    LABELS,
    METHODS,
    Context,
    unsupported,
)
from _attribution_tasks import (
    FIELD_TASKS,
    TASKS,
    ground_truth,
    make_task,
)
from _extra import require


def _status(key):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _quiet_progress_bars():
    """dattri's progress bars off (they bind ``tqdm`` at import)."""
    from functools import partial

    import dattri.algorithm.base
    import dattri.algorithm.dvemb
    import dattri.algorithm.influence_function
    import dattri.algorithm.tracin
    import dattri.algorithm.trak
    from tqdm import tqdm

    for module in (dattri.algorithm.base, dattri.algorithm.dvemb,
                   dattri.algorithm.influence_function, dattri.algorithm.tracin,
                   dattri.algorithm.trak):  # fmt: skip
        module.tqdm = partial(tqdm, disable=True)


def _child(function, ctx, pipe):
    torch.set_num_threads(1)
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets the peak resident set size to the current one
        before = _status("VmRSS:")
        start = time.perf_counter()
        result = np.asarray(function(ctx), dtype=np.float64)
        seconds = time.perf_counter() - start
        pipe.send((result, seconds, (_status("VmHWM:") - before) / 2**20, None))
    except Exception:  # reported in the table, the run goes on
        pipe.send((None, None, None, traceback.format_exc(limit=3)))
    finally:
        pipe.close()


def measured(function, ctx, timeout):
    """``function(ctx)`` in a forked process: (result, seconds, peak MiB, error)."""
    parent, child = multiprocessing.get_context("fork").Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(
        target=_child, args=(function, ctx, child)
    )
    process.start()
    child.close()
    if parent.poll(timeout):
        answer = parent.recv()
    else:
        answer = (None, None, None, f"timed out after {timeout} s")
    process.join(5)
    if process.is_alive():
        process.kill()
    return answer


def lds_score(scores, truth, subsets):
    from dattri.metric import lds

    corr, _ = lds(torch.tensor(scores), (torch.tensor(truth), torch.tensor(subsets)))
    return float(np.nanmean(corr.numpy()))


def loo_score(scores, truth, removed):
    from dattri.metric import loo_corr

    corr, _ = loo_corr(torch.tensor(scores[removed]), (torch.tensor(truth), removed))
    return float(np.nanmean(corr.numpy()))


def mislabel_scores(self_scores, flipped):
    from dattri.metric import mislabel_detection_auc

    auc, _ = mislabel_detection_auc(torch.tensor(self_scores), torch.tensor(flipped))
    order = np.argsort(-self_scores, kind="stable")
    found = [
        flipped[order[: int(share * flipped.size)]].sum() / flipped.sum() for share in (0.1, 0.2)
    ]
    return float(auc), float(found[0]), float(found[1])


def run_task(name, args):
    start = time.perf_counter()
    task = make_task(name, args.train, args.test)
    clf = task.fit(seed=0)
    accuracy = float((clf.predict(task.X_test) == task.y_test).mean())
    # (the noisy model has the clean one's settings: what one supports, so does the other)
    reasons = {m: unsupported(m, Context(task, clf, clf, task.y_train, 1)) for m in args.methods}
    if all(reasons.values()):  # nothing to score: no ground truth
        print(f"\n## {name}: every method left out")
        for method in args.methods:
            print(f"| {LABELS.get(method, method)} | not supported ({reasons[method]}) |")
        return {"accuracy": accuracy, "steps": clf.n_steps_,
                "methods": {m: {"not_supported": reasons[m]} for m in args.methods}}  # fmt: skip
    truths = ground_truth(task, clf, args.subsets, args.loo)
    subsets, truth, truth_same = truths.subsets, truths.lds, truths.lds_same_seed
    removed, truth_loo = truths.removed, truths.loo
    noisy, noisy_y, flipped = truths.noisy, truths.noisy_y, truths.flipped
    ground_truth_seconds = time.perf_counter() - start
    ctx = Context(task, clf, noisy, noisy_y, args.ensemble)
    print(
        f"\n## {name}: M={task.n_train}, {task.X_test.shape[0]} test points, "
        f"{clf.n_steps_} steps, test accuracy {accuracy:.3f}; ground truth "
        f"({2 * args.subsets + args.loo + 1} retrainings) {ground_truth_seconds:.0f} s",
        flush=True,
    )
    header = (
        "| method | LDS | LDS same-seed | LOO | mislabel AUC | found@10% | found@20% "
        "| time attr. (s) | time self (s) | peak MiB |"
    )
    print(header)
    print("|" + "---|" * 10)
    rows = {}
    for method in args.methods:
        attribute, self_scores = METHODS[method]
        if reasons[method]:
            rows[method] = {"not_supported": reasons[method]}
            print(f"| {LABELS.get(method, method)} | not supported ({reasons[method]}) |")
            continue
        row = {}
        scores, row["time_attr"], memory_attr, error = measured(attribute, ctx, args.timeout)
        if error:
            row["error_attr"] = error.strip().splitlines()[-1]
        else:
            row["lds"] = lds_score(scores, truth, subsets)
            row["lds_same_seed"] = lds_score(scores, truth_same, subsets)
            row["loo"] = loo_score(scores, truth_loo, removed)
        memory_self = None
        if self_scores is not None:
            values, row["time_self"], memory_self, error = measured(self_scores, ctx, args.timeout)
            if error:
                row["error_self"] = error.strip().splitlines()[-1]
            else:
                row["auc"], row["found10"], row["found20"] = mislabel_scores(values, flipped)
        memories = [m for m in (memory_attr, memory_self) if m is not None]
        row["peak_mib"] = max(memories) if memories else None
        rows[method] = row
        print(_line(method, row), flush=True)
        for key in ("error_attr", "error_self"):
            if key in row:
                print(f"|   ({key}: {row[key][:150]}) |")
    return {"accuracy": accuracy, "steps": clf.n_steps_, "methods": rows}


def _line(method, row):
    def f(key, fmt="{:.3f}"):
        value = row.get(key)
        return "—" if value is None else fmt.format(value)

    cells = [f("lds"), f("lds_same_seed"), f("loo"), f("auc"), f("found10", "{:.2f}"),
             f("found20", "{:.2f}"), f("time_attr", "{:.1f}"), f("time_self", "{:.1f}"),
             f("peak_mib", "{:.0f}")]  # fmt: skip
    return f"| {LABELS.get(method, method)} | " + " | ".join(cells) + " |"


COLUMNS = (
    ("LDS", "lds", "{:.3f}"),
    ("LDS same-seed", "lds_same_seed", "{:.3f}"),
    ("LOO", "loo", "{:.3f}"),
    ("mislabel AUC", "auc", "{:.3f}"),
    ("found@10%", "found10", "{:.2f}"),
    ("found@20%", "found20", "{:.2f}"),
    ("time attr. (s)", "time_attr", "{:.1f}"),
    ("time self (s)", "time_self", "{:.1f}"),
    ("peak MiB", "peak_mib", "{:.0f}"),
)


def rst_tables(saved):
    """The saved results as reStructuredText list-tables, one per task."""
    lines = []
    for name, result in saved["results"].items():
        lines += [
            f".. list-table:: {name}: {result['steps']} steps, test accuracy "
            f"{result['accuracy']:.3f}",
            "   :header-rows: 1",
            "",
            "   * - method",
        ]
        lines += [f"     - {title}" for title, _, _ in COLUMNS]
        for method, row in result["methods"].items():
            lines.append(f"   * - {LABELS.get(method, method)}")
            if "not_supported" in row:
                lines.append(f"     - not supported ({row['not_supported']})")
                lines += ["     - —"] * (len(COLUMNS) - 1)
                continue
            for _, key, fmt in COLUMNS:
                value = row.get(key)
                lines.append("     - " + ("—" if value is None else fmt.format(value)))
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=[name for name in TASKS if name not in FIELD_TASKS],
        choices=list(TASKS),
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[
            name
            for name in METHODS
            if name not in FIELD_METHODS + ENSEMBLE_METHODS + HORIZON_METHODS
        ],
        choices=list(METHODS),
    )
    parser.add_argument("--train", type=int, default=500)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--subsets", type=int, default=50)
    parser.add_argument("--loo", type=int, default=40)
    parser.add_argument("--ensemble", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--rst", nargs=2, metavar=("JSON", "OUT"), help="write a saved run as rst tables, only"
    )
    args = parser.parse_args()
    if args.rst:
        with open(args.rst[0]) as saved, open(args.rst[1], "w") as out:
            out.write(rst_tables(json.load(saved)))
        return
    require(["dattri"], args.quick, "bench_attribution.py (dattri's attributors and metrics)")
    if args.quick:
        args.train, args.test, args.subsets, args.loo, args.ensemble = 100, 10, 6, 4, 2
    torch.set_num_threads(1)
    _quiet_progress_bars()
    start = time.perf_counter()
    results = {name: run_task(name, args) for name in args.tasks}
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
