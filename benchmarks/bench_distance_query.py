"""Query side of a distance network: ``decompose`` and the cross Gram, against a base commit.

Fits ``DistanceKernelClassifier(random_state=0)`` on the first ``--n-train``
rows of ``scale_data`` (10 Gaussian classes in 64 dimensions, from
``bench_engine.py``), then times ``clf.decompose(Q)`` and
``clf.kernel_(Q, X_train)`` for the next ``--n-queries`` rows ``Q``, with the
public API only. Each measurement runs in a fresh subprocess importing either
this working tree or the base commit's tree (``PYTHONPATH``; the child prints
the ``sklearn_pathkernel`` it imported; ``--head`` names another tree than this
one, e.g. a copy that stays fixed while this one is edited), A and B interleaved and repeated, with
one thread (``OMP_NUM_THREADS=1``). Prints per setting the best time of each
tree, the ratios, the exactness of both (largest summed certificate
``residual`` and largest miss of ``bias + sum(contributions) + decay = output``)
and how far the two trees' results differ (largest difference relative to the
largest value).

Settings: ``defaults`` (each tree's own class defaults: the base commit may
have other defaults, e.g. full-batch SGD instead of Adam, so its results are
not compared), ``sgd`` (``solver="sgd", learning_rate=1.5``: the same network
in both trees, results compared).

    python benchmarks/bench_distance_query.py                        # base: /tmp/base68
    python benchmarks/bench_distance_query.py --base /path/to/checkout --repeats 3
    python benchmarks/bench_distance_query.py --settings sgd --n-train 300

Without ``--base`` the base is ``/tmp/base68`` when it exists, else a
``git worktree`` of commit 68eeedd created under the system's temporary
directory (removed afterwards).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BASE_COMMIT = "68eeedd"
DEFAULT_BASE = Path(tempfile.gettempdir()) / "base68"
ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"defaults": {}, "sgd": {"solver": "sgd", "learning_rate": 1.5}}


def child(args):
    """Fit, time the two queries, save the results, print one JSON line."""
    import torch

    torch.set_num_threads(1)
    import sklearn_pathkernel
    from sklearn_pathkernel import DistanceKernelClassifier

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine import scale_data

    X, y = scale_data(args.n_train + args.n_queries, 0)
    X_train, y_train, Q = X[: args.n_train], y[: args.n_train], X[args.n_train :]
    start = time.perf_counter()
    clf = DistanceKernelClassifier(random_state=0, **SETTINGS[args.setting]).fit(X_train, y_train)
    fit = time.perf_counter() - start
    start = time.perf_counter()
    parts = clf.decompose(Q)
    decompose = time.perf_counter() - start
    start = time.perf_counter()
    gram = np.asarray(clf.kernel_(Q, X_train))
    cross = time.perf_counter() - start
    decay = parts.get("decay", 0.0)  # (the base commit has no decay term)
    identity = parts.bias + parts.contributions.sum(1) + decay - parts.output
    np.savez(
        args.save,
        contributions=parts.contributions,
        output=parts.output,
        gram=gram,
    )
    print(
        json.dumps(
            {
                "module": sklearn_pathkernel.__file__,
                "fit": fit,
                "decompose": decompose,
                "cross": cross,
                "residual": float(parts.residual.max()),
                "identity": float(np.abs(identity).max()),
            }
        )
    )


def run_child(tree, setting, args, save):
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--setting",
        setting,
        "--n-train",
        str(args.n_train),
        "--n-queries",
        str(args.n_queries),
        "--save",
        str(save),
    ]
    # cwd outside both trees: only PYTHONPATH decides which package is imported
    done = subprocess.run(
        command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise RuntimeError(f"child failed on {tree}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = Path(tree).resolve() / "sklearn_pathkernel"
    if Path(result["module"]).resolve().parent != expected:
        raise RuntimeError(f"child imported {result['module']}, not the package of {tree}")
    return result


def relative_difference(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), np.finfo(float).tiny))


def compare(args, base):
    trees = {"base": base, "head": args.head}
    with tempfile.TemporaryDirectory() as scratch:
        for setting in args.settings:
            runs = {name: [] for name in trees}
            for repeat in range(args.repeats):
                order = list(trees) if repeat % 2 == 0 else list(trees)[::-1]
                for name in order:
                    save = Path(scratch) / f"{setting}-{name}.npz"
                    runs[name].append(run_child(trees[name], setting, args, save))
            saved = {name: np.load(Path(scratch) / f"{setting}-{name}.npz") for name in trees}
            report(setting, runs, saved)


def report(setting, runs, saved):
    print(f"\n== {setting} ({SETTINGS[setting] or 'class defaults'})")
    for name, results in runs.items():
        print(f"  {name}: {results[0]['module']}")
    best = {name: {} for name in runs}
    for key in ("fit", "decompose", "cross"):
        for name, results in runs.items():
            best[name][key] = min(r[key] for r in results)
        every = {
            name: ", ".join(f"{r[key]:.1f}" for r in results) for name, results in runs.items()
        }
        print(
            f"  {key:9s} base {best['base'][key]:7.1f} s   head {best['head'][key]:7.1f} s   "
            f"ratio {best['base'][key] / best['head'][key]:5.2f}x   "
            f"(runs: base {every['base']}; head {every['head']})"
        )
    for name, results in runs.items():
        print(
            f"  exactness {name}: residual <= {max(r['residual'] for r in results):.1e}, "
            f"sum identity <= {max(r['identity'] for r in results):.1e}"
        )
    if setting != "defaults":
        for key in ("contributions", "output", "gram"):
            difference = relative_difference(saved["head"][key], saved["base"][key])
            print(f"  head vs base, {key}: max relative difference {difference:.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="checkout of the base commit")
    parser.add_argument(
        "--head", type=Path, default=ROOT, help="tree compared with it (default: this one)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--n-queries", type=int, default=20)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=list(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.base is not None:
        compare(args, args.base)
        return
    if DEFAULT_BASE.exists():
        compare(args, DEFAULT_BASE)
        return
    worktree = Path(tempfile.mkdtemp()) / "base"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), BASE_COMMIT],
        check=True,
    )
    try:
        compare(args, worktree)
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=True
        )


if __name__ == "__main__":
    main()
