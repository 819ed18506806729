"""Benchmark: how the exact path kernel scales with M (training points), S (steps) and W (weights).

Usage::

    python benchmarks/bench_scale.py                 # M in {300, 1000, 4000}; long
    python benchmarks/bench_scale.py --quick         # one small configuration per table
    python benchmarks/bench_scale.py --out DIR       # where plots and results.json go
                                                     # (default benchmarks/results/)

Data: "digits-like" random 8x8 images, 10 classes (a smooth random template per
class plus pixel noise), 64 features, as float64. Architectures, all trained by
full-batch gradient descent for S steps:

    mlp-64        ReLU MLP 64-64-10
    mlp-128x128   ReLU MLP 64-128-128-10
    cnn           Conv(1->8, 3x3, pad 1) ReLU Conv(8->8, 3x3, stride 2) ReLU Linear(72->10)
    distance      DistanceKernelClassifier (only when it is importable)

For every configuration and phase, a fresh subprocess fits the network and runs
one phase, so that its peak memory (``ru_maxrss``) is its own:

    fit          training (records the path)
    train_gram   ``engine.gram(X, a_train=True)``, M x M
    query_gram   ``engine.gram(Q, X, b_train=True)``, n_queries x M
    decompose    ``engine.decompose(Q)``: contributions, bias, certificate

and reports wall time, peak RSS (``ru_maxrss``) and the phase's extra peak over
the fitted process (``ru_maxrss`` after minus before the phase; 0 when the phase
stays below the training peak). Exactness: the largest certificate (summed
per-step quadrature error) and ``max |bias + sum contributions - network|``.
"Overhead" is the phase's time over the training time.

The naive engine (``NaivePathKernelEngine``, the EPK paper's Algorithm 1 with
materialised Jacobians, Riemann T=100) runs where its Jacobians fit
(M*K*W*8 bytes <= --naive-max-bytes, default 1.5 GB) and only on the first
``--naive-steps`` steps (default 3); its time for all S steps is extrapolated
linearly (it is linear in S by construction) and "naive/fast" compares the two
per step.

Timings depend on the machine and its load: measure on an idle machine. torch
uses all its intra-op threads; the engine runs with ``n_jobs=None``.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("fit", "train_gram", "query_gram", "decompose")
KERNEL_PHASES = PHASES[1:]
NAIVE_RULE = {"quadrature": "riemann", "n_points": 100}
N_FEATURES, N_CLASSES = 64, 10

FULL = {
    "sizes": (300, 1000, 4000),
    "steps": 20,
    "queries": 100,
    "archs": ("mlp-64", "mlp-128x128", "cnn", "distance"),
    "steps_sweep": {"arch": "mlp-64", "M": 1000, "steps": (10, 20, 40)},
    "width_sweep": {"M": 1000, "widths": (32, 128, 512)},
}
QUICK = {
    "sizes": (100,),
    "steps": 5,
    "queries": 20,
    "archs": ("mlp-64",),
    "steps_sweep": {"arch": "cnn", "M": 100, "steps": (3,)},
    "width_sweep": {"M": 100, "widths": (16,)},
    "naive_steps": 1,
}


# -- data and models (run in the child) ---------------------------------------------------


def digits_like(n, seed=0):
    """n random 8x8 'images' of 10 classes: smooth class templates plus noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.standard_normal((N_CLASSES, 4, 4))
    templates = np.kron(coarse, np.ones((2, 2))).reshape(N_CLASSES, N_FEATURES)
    y = np.arange(n) % N_CLASSES
    X = templates[y] + 0.7 * rng.standard_normal((n, N_FEATURES))
    return X, y


def small_cnn(n_features, n_classes):
    from torch import nn

    side = int(round(n_features**0.5))
    return nn.Sequential(
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * ((side - 3) // 2 + 1) ** 2, n_classes),
    )


def distance_available():
    try:
        from sklearn_pathkernel._estimators._distance_classifier import DistanceKernelClassifier  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means "not available yet"
        return False
    return True


def make_classifier(arch, steps):
    common = {"max_iter": steps, "random_state": 0, "learning_rate": 0.05}
    if arch == "distance":
        from sklearn_pathkernel._estimators._distance_classifier import DistanceKernelClassifier

        return DistanceKernelClassifier(hidden_layer_sizes=(32,), **common)
    from sklearn_pathkernel import ExactPathKernelClassifier

    if arch == "cnn":
        return ExactPathKernelClassifier(module=small_cnn, **common)
    if arch.startswith("mlp-"):
        hidden = tuple(int(width) for width in arch[4:].split("x"))
        return ExactPathKernelClassifier(hidden_layer_sizes=hidden, **common)
    raise ValueError(f"unknown architecture {arch!r}")


def truncated(path, n_steps):
    """The first ``n_steps`` steps of a path (the naive engine's share)."""
    from sklearn_pathkernel._path import WeightPath

    return WeightPath(
        path.weights[: n_steps + 1],
        path.batches[:n_steps],
        path.output_gradients[:n_steps],
        path.learning_rates[:n_steps],
        path.param_names,
        path.param_shapes,
        update=path.update.truncated(n_steps),
    )


def make_engine(name, clf, n_steps=None):
    path = clf.path_ if n_steps is None else truncated(clf.path_, n_steps)
    args = (clf.module_, path, clf._fit_X)
    if name == "fast":
        from sklearn_pathkernel._engine._facade import PathKernelEngine

        return PathKernelEngine(*args)
    # Algorithm 1 lives with the tests (it is not part of the installed package).
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from _reference import NaivePathKernelEngine

    return NaivePathKernelEngine(*args, **NAIVE_RULE)


def maxrss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(spec):
    """One (configuration, engine, phase) in this fresh process."""
    X, y = digits_like(spec["M"] + spec["queries"], seed=0)
    X_train, y_train = X[: spec["M"]], y[: spec["M"]]
    queries = torch.tensor(X[spec["M"] :], dtype=torch.float64)
    clf = make_classifier(spec["arch"], spec["steps"])
    before = maxrss_bytes()
    start = time.perf_counter()
    clf.fit(X_train, y_train)
    fit_time = time.perf_counter() - start
    report = {
        "fit_time": fit_time,
        "n_steps": clf.path_.n_steps,
        "n_weights": clf.path_.n_weights,
        "n_outputs": N_CLASSES,
    }
    if spec["phase"] == "fit":
        report.update(time=fit_time, maxrss=maxrss_bytes(), extra=maxrss_bytes() - before)
        return report

    engine = make_engine(spec["engine"], clf, spec.get("n_steps"))
    X_t, phase = clf._fit_X, spec["phase"]
    engine.gram(X_t[:2], a_train=True)  # warm-up (torch.func, lazy imports)
    before = maxrss_bytes()
    start = time.perf_counter()
    if phase == "train_gram":
        engine.gram(X_t, a_train=True)
    elif phase == "query_gram":
        engine.gram(queries, X_t, b_train=True)
    else:
        parts = engine.decompose(queries)
        total = parts.bias + parts.contributions.sum(1)
        report["sum_error"] = float(np.abs(total - parts.output).max())
        report["max_certificate"] = float(parts.quadrature_error.max())
    report.update(
        time=time.perf_counter() - start,
        maxrss=maxrss_bytes(),
        extra=max(0, maxrss_bytes() - before),
        steps_run=engine.path.n_steps,
    )
    return report


# -- the parent ---------------------------------------------------------------------------


def run_child(spec, timeout):
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    label = f"{spec['arch']} M={spec['M']} S={spec['steps']} {spec['engine']} {spec['phase']}"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  ! {label}: timed out after {timeout:.0f} s", flush=True)
        return None
    if done.returncode != 0:
        print(f"  ! {label} failed:\n{done.stderr[-1500:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def n_weights_of(arch):
    """W of an architecture, from a throw-away model (cheap, in the parent)."""
    clf = make_classifier(arch, 1)
    X, y = digits_like(N_CLASSES * 2)
    return clf.fit(X, y).path_.n_weights


def measure_config(arch, M, steps, args, settings):
    """All phases of one configuration: {(engine, phase): report}."""
    base = {"arch": arch, "M": M, "steps": steps, "queries": settings["queries"]}
    results = {}
    for phase in PHASES:
        results["fast", phase] = run_child({**base, "engine": "fast", "phase": phase}, args.timeout)
    W = n_weights_of(arch)
    naive_bytes = M * N_CLASSES * W * 8
    if args.naive_steps > 0 and naive_bytes <= args.naive_max_bytes:
        for phase in KERNEL_PHASES:
            spec = {**base, "engine": "naive", "phase": phase, "n_steps": args.naive_steps}
            results["naive", phase] = run_child(spec, args.timeout)
    return {
        "arch": arch,
        "M": M,
        "steps": steps,
        "W": W,
        "naive_bytes": naive_bytes,
        "runs": {f"{e}/{p}": r for (e, p), r in results.items()},
    }


def fmt(value, spec, unit=""):
    """``value`` formatted by ``spec`` then ``unit``; a right-aligned "-" when missing."""
    width = int(spec.split(".")[0] or 0) + len(unit)
    return "-".rjust(width) if value is None else format(value, spec) + unit


def print_config(config):
    runs = config["runs"]
    fit = runs.get("fast/fit")
    fit_time = fit["time"] if fit else None
    print(
        f"\n{config['arch']}  M={config['M']}  S={config['steps']}  W={config['W']}  "
        f"(naive Jacobians M*K*W*8 = {config['naive_bytes'] / 2**30:.2f} GiB)"
    )
    header = (
        f"  {'phase':<11}{'time':>10}{'overhead':>10}{'maxrss':>10}{'extra':>10}"
        f"{'naive (all S)':>15}{'naive/fast':>11}{'naive maxrss':>13}"
        f"{'max cert':>10}{'max |sum-net|':>14}"
    )
    print(header)
    for phase in PHASES:
        fast, naive = runs.get(f"fast/{phase}"), runs.get(f"naive/{phase}")
        if fast is None:
            print(f"  {phase:<11}{'failed':>10}")
            continue
        overhead = fast["time"] / fit_time if fit_time and phase != "fit" else None
        naive_total = ratio = None
        if naive:
            per_step = naive["time"] / naive["steps_run"]
            naive_total = per_step * config["steps"]
            ratio = per_step / (fast["time"] / fast["steps_run"])
        print(
            f"  {phase:<11}{fmt(fast['time'], '9.3f', 's')}{fmt(overhead, '9.1f', 'x')}"
            f"{fast['maxrss'] / 2**20:7.0f} MB{fast['extra'] / 2**20:7.0f} MB"
            f"{fmt(naive_total, '13.2f', 's')}{'*' if naive else ' '}"
            f"{fmt(ratio, '10.1f', 'x')}"
            f"{fmt(naive['maxrss'] / 2**20 if naive else None, '10.0f', ' MB')}"
            f"{fmt(fast.get('max_certificate'), '10.1e')}{fmt(fast.get('sum_error'), '14.1e')}"
        )
    kernel = [runs.get(f"fast/{phase}") for phase in KERNEL_PHASES]
    if fit_time and all(kernel):
        total = sum(run["time"] for run in kernel)
        print(f"  kernel overhead factor (three kernel phases / training): {total / fit_time:.1f}x")


def plot(configs, settings, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no plots.")
        return []

    sweeps = {
        "M": ("training points M", lambda c: c["M"]),
        "S": ("steps S", lambda c: c["steps"]),
        "W": ("weights W", lambda c: c["W"]),
    }
    saved = []
    for name, (xlabel, select) in sweeps.items():
        chosen = [c for c in configs if c["sweep"] == name]
        if not chosen:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))

        # One colour per architecture, one line style per phase; the W sweep's
        # networks (mlp-32, mlp-128, ...) are one family.
        def family(c, name=name):
            return "one-hidden-layer MLP" if name == "W" else c["arch"]

        for index, arch in enumerate(sorted({family(c) for c in chosen})):
            subset = [c for c in chosen if family(c) == arch]
            color = f"C{index}"
            for phase, style in zip(PHASES, ("-", "--", "-.", ":"), strict=True):
                for key, ax in (("time", axes[0]), ("memory", axes[1])):
                    points = sorted((select(c), v) for c, v in _values(subset, phase, key, "fast"))
                    if points:
                        xs, ys = zip(*points, strict=True)
                        ax.plot(xs, ys, style, marker="o", color=color, label=f"{arch} {phase}")
                    naive = sorted((select(c), v) for c, v in _values(subset, phase, key, "naive"))
                    if naive:
                        xs, ys = zip(*naive, strict=True)
                        ax.plot(
                            xs, ys, style, marker="x", color="grey", label=f"{arch} {phase} (naive)"
                        )
        ticks = sorted({select(c) for c in chosen})
        for ax, ylabel in zip(axes, ("wall time (s)", "peak RSS (MiB)"), strict=True):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(ticks, [str(tick) for tick in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=6, ncol=2)
        fig.suptitle(f"Exact path kernel: time and memory versus {xlabel}")
        fig.tight_layout()
        filename = os.path.join(out, f"scale_vs_{name}.png")
        fig.savefig(filename, dpi=120)
        plt.close(fig)
        saved.append(filename)
    return saved


def _values(configs, phase, key, engine):
    for config in configs:
        run = config["runs"].get(f"{engine}/{phase}")
        if run is None:
            continue
        if key == "time":
            value = run["time"]
            if engine == "naive":
                value = value / run["steps_run"] * config["steps"]
        else:
            value = run["maxrss"] / 2**20
        yield config, value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about two minutes)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="plots and json")
    parser.add_argument("--archs", nargs="*", help="subset of architectures")
    parser.add_argument("--sizes", nargs="*", type=int, help="values of M (overrides the preset)")
    parser.add_argument("--steps", type=int, help="S of the M table (overrides the preset)")
    parser.add_argument(
        "--naive-steps",
        type=int,
        default=None,
        help="steps given to the naive engine (its time is extrapolated to all S); 0 skips "
        "it (default 3; --quick: 1)",
    )
    parser.add_argument(
        "--naive-max-bytes",
        type=float,
        default=1.5e9,
        help="skip the naive engine when M*K*W*8 exceeds this",
    )
    parser.add_argument("--no-sweeps", action="store_true", help="only the M table")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per child")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return

    settings = dict(QUICK if args.quick else FULL)
    if args.naive_steps is None:
        args.naive_steps = settings.get("naive_steps", 3)
    if args.sizes:
        settings["sizes"] = tuple(args.sizes)
    if args.steps:
        settings["steps"] = args.steps
    archs = [
        a for a in (args.archs or settings["archs"]) if a != "distance" or distance_available()
    ]
    if "distance" in (args.archs or settings["archs"]) and "distance" not in archs:
        print("DistanceKernelClassifier is not importable: skipping the distance network.")
    os.makedirs(args.out, exist_ok=True)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
        f"{os.cpu_count()} CPUs, float64; naive = Algorithm 1, Riemann T=100, first "
        f"{args.naive_steps} steps, extrapolated (*)."
    )
    configs = []

    def add(config, sweep):
        config["sweep"] = sweep
        configs.append(config)
        print_config(config)
        with open(os.path.join(args.out, "results.json"), "w") as handle:
            json.dump(configs, handle, indent=1)

    print("\n== versus M (training points) ==")
    for arch in archs:
        for M in settings["sizes"]:
            add(measure_config(arch, M, settings["steps"], args, settings), "M")
    if not args.no_sweeps:
        sweep = settings["steps_sweep"]
        print(f"\n== versus S (steps), {sweep['arch']}, M={sweep['M']} ==")
        for steps in sweep["steps"]:
            add(measure_config(sweep["arch"], sweep["M"], steps, args, settings), "S")
        sweep = settings["width_sweep"]
        print(f"\n== versus W (weights), one-hidden-layer MLP, M={sweep['M']} ==")
        for width in sweep["widths"]:
            add(measure_config(f"mlp-{width}", sweep["M"], settings["steps"], args, settings), "W")
    for filename in plot(configs, settings, args.out):
        print(f"saved {filename}")
    print(f"saved {os.path.join(args.out, 'results.json')}")


if __name__ == "__main__":
    main()
