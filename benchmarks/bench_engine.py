"""Benchmark: the fast path-kernel engine against the brute-force reference.

Usage::

    python benchmarks/bench_engine.py            # full run
    python benchmarks/bench_engine.py --quick    # smaller sizes, a minute or two

The EPK paper's toy (3 classes, 100-d Gaussians with means (1,4,0,...),
(4,1,0,...), (5,5,0,...), sd 1; ReLU MLP 100-64-3 trained by full-batch gradient
descent, lr 0.05, 30 steps; M=300 training points, 60 queries). For each engine,
``PathKernelEngine`` (``quadrature="exact"``) and ``NaivePathKernelEngine``
(``"riemann"``, T=100, Algorithm 1), it times

    (a) the training Gram (M x M, both rows on the training copy),
    (b) the query x training Gram (60 x M),
    (c) the decomposition of the 60 queries,

and reports the ratio naive / fast, the max abs error of bias + sum of
contributions against the network's output, the largest difference between the
two engines' results, the peak memory and the kernel overhead factor (kernel
time / training time). Then a scale row: the training Gram of M=4000 points,
64 features, 10 classes, MLP 64-128-128-10, 50 full-batch steps.

Every measurement runs in its own subprocess (same data, same seeded training),
so that its peak resident memory is its own: peak RSS is sampled every 2 ms
during the first timed call, and "extra" is that peak minus the RSS just before
it. Each engine is warmed up on two rows, and training on a tiny fit, before
timing. The time is the median of up to ``--repeats`` calls (default 5), as
many as fit in ``--repeat-budget`` seconds (default 20; at least one): the same
rule for both engines, so that a short measurement is not one sample of the
machine's noise (a 0.3 s call varies by 30% from minute to minute on a shared
2-core machine) while a long one is not run five times.
The naive engine at scale needs hours (one step of the M=4000 Gram contracts
M x M x K*W = 4000 x 4000 x 261220 numbers), so it runs only on the first
``--naive-scale-steps`` steps there (default: 1 with ``--quick``, none
otherwise) and its all-steps time is extrapolated linearly (marked with *).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

TOY = {"n_train": 300, "n_queries": 60, "max_iter": 30}
TOY_QUICK = {"n_train": 120, "n_queries": 20, "max_iter": 10}
SCALE = {"n_train": 4000, "max_iter": 50}
SCALE_QUICK = {"n_train": 500, "max_iter": 10}
NAIVE_RULE = {"quadrature": "riemann", "n_points": 100}
TASKS = ("train_gram", "query_gram", "decompose")


# -- data and models ---------------------------------------------------------------------


def toy_data(n, seed):
    """The EPK paper's three 100-d Gaussians."""
    rng = np.random.default_rng(seed)
    means = np.zeros((3, 100))
    means[:, :2] = [[1, 4], [4, 1], [5, 5]]
    y = np.arange(n) % 3
    return means[y] + rng.standard_normal((n, 100)), y


def scale_data(n, seed):
    """10 Gaussian classes in 64 dimensions."""
    rng = np.random.default_rng(seed)
    means = 2.0 * rng.standard_normal((10, 64))
    y = np.arange(n) % 10
    return means[y] + rng.standard_normal((n, 64)), y


def fitted(problem, sizes):
    """The seeded classifier of a problem, its queries and its training time."""
    from sklearn_pathkernel import ExactPathKernelClassifier

    if problem == "toy":
        X, y = toy_data(sizes["n_train"] + sizes.get("n_queries", 0), seed=0)
        hidden, lr = (64,), 0.05
    else:
        X, y = scale_data(sizes["n_train"], seed=0)
        hidden, lr = (128, 128), 0.05
    X_train, y_train = X[: sizes["n_train"]], y[: sizes["n_train"]]
    queries = torch.tensor(X[sizes["n_train"] :], dtype=torch.float64)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=hidden, learning_rate=lr, max_iter=sizes["max_iter"], random_state=0
    )
    clf.set_params(max_iter=1).fit(X_train[:10], y_train[:10])  # warm-up: torch's first calls
    clf.set_params(max_iter=sizes["max_iter"])
    start = time.perf_counter()
    clf.fit(X_train, y_train)
    return clf, queries, time.perf_counter() - start


def truncated(path, n_steps):
    """The first ``n_steps`` steps of a path."""
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


def run_task(engine, task, X_train, queries):
    if task == "train_gram":
        return engine.gram(X_train, a_train=True)
    if task == "query_gram":
        return engine.gram(queries, X_train, a_train=False, b_train=True)
    return engine.decompose(queries)


# -- one measurement (child process) -------------------------------------------------------


def current_rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples the resident set size in a thread while the block runs."""

    def __enter__(self):
        self.before = self.peak = current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, current_rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


def measure(spec):
    """Fit, warm up, then time one (engine, task) and record its peak memory."""
    sizes = spec["sizes"]
    clf, queries, fit_time = fitted(spec["problem"], sizes)
    engine = make_engine(spec["engine"], clf, spec.get("n_steps"))
    X_train = clf._fit_X
    run_task(engine, spec["task"], X_train[:2], queries[:2])  # warm-up (torch.func, caches)

    with PeakRSS() as memory:
        start = time.perf_counter()
        result = run_task(engine, spec["task"], X_train, queries)
        times = [time.perf_counter() - start]
    while len(times) < spec.get("repeats", 1) and sum(times) < spec.get("budget", 0.0):
        start = time.perf_counter()
        run_task(engine, spec["task"], X_train, queries)
        times.append(time.perf_counter() - start)

    report = {
        "time": float(np.median(times)),
        "times": times,
        "fit_time": fit_time,
        "n_steps": engine.path.n_steps,
        "n_weights": engine.path.n_weights,
        "peak_rss_mb": memory.peak / 2**20,
        "extra_mb": (memory.peak - memory.before) / 2**20,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "load": os.getloadavg()[0],
    }
    if spec["task"] == "decompose":
        total = result.bias + result.contributions.sum(1)
        report["sum_error"] = float(np.abs(total - result.output).max())
        report["max_residual"] = float(result.quadrature_error.max())
        result = result.contributions
    if spec.get("save"):
        np.save(spec["save"], result)
    return report


def run_child(spec, timeout):
    """Run :func:`measure` in a fresh interpreter; None when it fails or times out."""
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  ! {spec['engine']} {spec['task']}: timed out after {timeout:.0f} s")
        return None
    if done.returncode != 0:
        print(f"  ! {spec['engine']} {spec['task']} failed:\n{done.stderr[-2000:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def fast_engine_available():
    try:
        import sklearn_pathkernel._engine._facade  # noqa: F401
    except ImportError as error:
        print(f"PathKernelEngine not importable ({error}); timing the naive engine only.\n")
        return False
    return True


# -- the tables ---------------------------------------------------------------------------


def fmt_time(seconds):
    return "-" if seconds is None else f"{seconds:8.3f} s"


def toy_table(sizes, engines, timeout, workdir, repeats, budget):
    print(
        f"Paper toy: M={sizes['n_train']}, {sizes['n_queries']} queries, ReLU 100-64-3, "
        f"{sizes['max_iter']} full-batch steps, lr 0.05; naive = Algorithm 1, Riemann "
        f"T={NAIVE_RULE['n_points']}; fast = PathKernelEngine('exact')."
    )
    results = {}
    for task in TASKS:
        for name in engines:
            save = os.path.join(workdir, f"{name}_{task}.npy")
            spec = {
                "problem": "toy",
                "sizes": sizes,
                "engine": name,
                "task": task,
                "save": save,
                "repeats": repeats,
                "budget": budget,
            }
            results[name, task] = run_child(spec, timeout)

    header = (
        f"{'task':<12}{'engine':<7}{'time':>11}{'runs':>5}{'spread':>8}{'naive/fast':>11}"
        f"{'overhead':>10}"
        f"{'peak RSS':>11}{'extra':>10}{'load':>6}{'sum error':>11}{'rel. fast-naive':>17}"
    )
    print(header)
    print("-" * len(header))
    for task in TASKS:
        fast, naive = results.get(("fast", task)), results.get(("naive", task))
        difference = None
        if fast and naive:
            fast_values = np.load(os.path.join(workdir, f"fast_{task}.npy"))
            naive_values = np.load(os.path.join(workdir, f"naive_{task}.npy"))
            difference = np.abs(fast_values - naive_values).max() / np.abs(naive_values).max()
        for name in engines:
            row = results.get((name, task))
            if row is None:
                print(f"{task:<12}{name:<7}{'failed':>11}")
                continue
            ratio = f"{naive['time'] / fast['time']:10.1f}x" if fast and naive else "-".rjust(11)
            error = f"{row['sum_error']:11.1e}" if "sum_error" in row else "".rjust(11)
            diff = f"{difference:17.1e}" if difference is not None and name == "fast" else ""
            spread = max(row["times"]) / min(row["times"])
            print(
                f"{task:<12}{name:<7}{fmt_time(row['time']):>11}{len(row['times']):>5}"
                f"{spread:>7.2f}x{ratio if name == 'fast' else '':>11}"
                f"{row['time'] / row['fit_time']:9.0f}x"
                f"{row['peak_rss_mb']:8.0f} MB{row['extra_mb']:7.0f} MB"
                f"{row['load']:6.1f}{error}{diff}"
            )
    any_row = next((r for r in results.values() if r), None)
    if any_row:
        print(
            f"training (fit) time: {any_row['fit_time']:.3f} s ({any_row['n_steps']} steps, "
            f"W={any_row['n_weights']}); overhead = kernel time / training time; load = "
            "1-min load average at the end (other jobs share the cores); time = median of "
            "'runs' calls, spread = slowest / fastest of them; rel. fast-naive = "
            "max |fast - naive| / max |naive| (Gram or contributions)."
        )
    print()
    return results


def scale_table(sizes, engines, naive_steps, timeout):
    print(
        f"Scale: training Gram, M={sizes['n_train']}, 64 features, 10 classes, MLP "
        f"64-128-128-10, {sizes['max_iter']} full-batch steps."
    )
    header = (
        f"{'engine':<7}{'steps run':>10}{'time':>11}{'time, all steps':>18}{'overhead':>10}"
        f"{'peak RSS':>11}{'extra':>10}{'load':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = {}
    for name in engines:
        spec = {"problem": "scale", "sizes": sizes, "engine": name, "task": "train_gram"}
        if name == "naive":
            if naive_steps <= 0:
                continue
            spec["n_steps"] = naive_steps
        row = rows[name] = run_child(spec, timeout)
        if row is None:
            print(f"{name:<7}{'failed':>10}")
            continue
        total = row["time"] * sizes["max_iter"] / row["n_steps"]
        note = "" if row["n_steps"] == sizes["max_iter"] else " (extrapolated)"
        print(
            f"{name:<7}{row['n_steps']:>10}{fmt_time(row['time']):>11}{fmt_time(total):>12}"
            f"{'*' if note else ' ':<6}{total / row['fit_time']:9.0f}x"
            f"{row['peak_rss_mb']:8.0f} MB{row['extra_mb']:7.0f} MB{row['load']:6.1f}"
        )
    if rows.get("fast") and rows.get("naive"):
        fast, naive = rows["fast"], rows["naive"]
        per_step = (naive["time"] / naive["n_steps"]) / (fast["time"] / fast["n_steps"])
        print(f"naive / fast per step: {per_step:.0f}x")
    first = next((r for r in rows.values() if r), None)
    if first:
        print(
            f"training (fit) time: {first['fit_time']:.3f} s (W={first['n_weights']}); "
            "* = naive time for all steps extrapolated linearly from the steps run."
        )
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a minute or two)")
    parser.add_argument("--skip-scale", action="store_true", help="only the paper's toy")
    parser.add_argument(
        "--naive-scale-steps",
        type=int,
        default=None,
        help="steps of the scale path given to the naive engine (0 skips it; default 1 with "
        "--quick, else 0: at M=4000 one naive step takes over ten minutes)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed calls per toy measurement (median)"
    )
    parser.add_argument(
        "--repeat-budget",
        type=float,
        default=20.0,
        help="seconds after which a toy measurement stops repeating",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return

    engines = ["fast", "naive"] if fast_engine_available() else ["naive"]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n"
    )
    with tempfile.TemporaryDirectory() as workdir:
        toy_table(
            TOY_QUICK if args.quick else TOY,
            engines,
            args.timeout,
            workdir,
            args.repeats,
            args.repeat_budget,
        )
    if not args.skip_scale:
        sizes = SCALE_QUICK if args.quick else SCALE
        naive_steps = args.naive_scale_steps
        if naive_steps is None:
            naive_steps = 1 if args.quick else 0
        scale_table(sizes, engines, naive_steps, args.timeout)


if __name__ == "__main__":
    main()
