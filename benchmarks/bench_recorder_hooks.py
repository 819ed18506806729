"""Where the recorder's time goes in a step: the median time of each of its hooks.

The loop of ``bench_recorder.py`` (digits-sized random inputs, AdamW, float32, one
thread, batches of 64, 150 steps per run) runs with the recorder of this tree and
of the commits given, interleaved in one process; every call of the recorder's
hooks (and of the main parts inside them) is timed, and the median per call is
printed, per commit. Medians of many calls are robust to the moments a loaded
machine takes the core away, which sums of wall-clock times are not; they still
include what other jobs do to the caches. A hook's time is what it costs inside
the loop, which is several times what the same call costs repeated alone (the
loop's forward, backward and optimiser step evict what the hook touches).

Top-level hooks (their sum is the recorder's per-step time in Python, without
creating the recorder and ``finish``): ``rows`` (the user's call),
``_on_forward`` (module forward hook), ``take_gradient`` (the output's gradient
hook, with the start of the backward pass), ``_backward_finished`` (end of the
backward pass), ``_before_step`` and ``_after_step`` (the optimiser's step
hooks). Inside them: ``check`` (a batch's inputs against ``X[rows]``),
``unchanged`` (the bitwise weight check), ``before_step``/``after_step`` (the
optimiser rule reading ``param_groups`` and state), ``append`` (the step log's
host copies).

Also printed, per run (median, milliseconds of the thread's CPU time): creating
the recorder (``__init__``, with the module checks on a float64 copy,
``_check_module``), ``finish``, and Adam's :math:`P_s` of all steps
(``_finish_adam``: ``AdamFinisher.finish`` at the path's first read, which each run
does after ``finish``; inside ``finish`` in earlier commits that have no
``AdamFinisher``). With
``--prefault`` the step log's host arrays are written once when they are
allocated (their pages faulted in then), so that ``append`` shows the copies
without the first writes into fresh memory.

Run: ``python benchmarks/bench_recorder_hooks.py --network mlp --commits REV``
(``--batch-size 256``: batches of 256 rows instead of 64; ``--quick``: 2 runs of this
tree alone).
"""

import argparse
import importlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import sklearn_pathkernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baseline import import_commit  # noqa: E402

TOP = ("rows", "_on_forward", "take_gradient", "_backward_finished", "_before_step", "_after_step")
INNER = ("check", "unchanged", "before_step", "after_step", "append")


def build(network):
    if network == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(72, 10),
    )


def instrument(package, calls):
    """Time the hooks of ``package``'s recorder into ``calls`` (name -> list of ns);
    returns its ``TrainingRecorder``."""

    def module(name):
        return importlib.import_module(f"{package.__name__}._training.{name}")

    recorder, step_log = module("_recorder"), module("_step_log")
    optimizers, weight_watch = module("_optimizers"), module("_weight_watch")

    def wrap(owner, name):
        function = getattr(owner, name)
        times = calls.setdefault(name, [])

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                times.append(time.perf_counter_ns() - start)

        setattr(owner, name, timed)

    for name in ("rows", "_on_forward", "_backward_finished", "_before_step", "_after_step"):
        wrap(recorder.PathRecorder, name)
    wrap(step_log.MicroBatch, "take_gradient")
    wrap(step_log.MicroBatch, "check")
    wrap(weight_watch.WeightWatch, "unchanged")
    wrap(optimizers.AdamRule, "before_step")
    wrap(optimizers.AdamRule, "after_step")
    wrap(step_log.StepLog, "append")
    for owner, name in (
        (recorder.PathRecorder, "__init__"),
        (package.TrainingRecorder, "finish"),
        (recorder, "_check_module"),
    ):
        wrap_cpu(owner, name, calls)
    if hasattr(step_log, "AdamFinisher"):  # (P_s at the path's first read, after finish)
        wrap_cpu(step_log.AdamFinisher, "finish", calls, "_finish_adam")
    else:  # (P_s in finish)
        wrap_cpu(step_log.StepLog, "_finish_adam", calls)
    return package.TrainingRecorder


def wrap_cpu(owner, name, calls, key=None):
    """Time ``owner.name`` by the thread's CPU time, summed per run (the list of
    ``key``, by default ``name``, gets one entry per run, see :func:`run`)."""
    function = getattr(owner, name)
    totals = calls.setdefault(key or name, [0])

    def timed(*args, **kwargs):
        start = time.thread_time_ns()
        try:
            return function(*args, **kwargs)
        finally:
            totals[-1] += time.thread_time_ns() - start

    setattr(owner, name, timed)


def prefault(package):
    """Make the step log's host arrays write every row once when allocated."""
    step_log = importlib.import_module(f"{package.__name__}._training._step_log")
    allocate = step_log.allocate_weights

    def allocate_and_touch(*args, **kwargs):
        weights, storage = allocate(*args, **kwargs)
        weights.fill_(0)
        return weights, storage

    step_log.allocate_weights = allocate_and_touch


FIXED = ("__init__", "_check_module", "finish", "_finish_adam")


def run(recorder_class, network, X, y, calls, n_steps=150, batch_size=64):
    for name in FIXED:
        calls[name].append(0)  # (this run's total)
    torch.manual_seed(0)
    model = build(network)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=1e-3)
    recorder = recorder_class(model, optimizer, X, max_steps=n_steps)
    order = torch.randperm(X.shape[0])
    span = X.shape[0] - X.shape[0] % batch_size
    for step in range(n_steps):
        start = (batch_size * step) % span
        rows = order[start : start + batch_size].clone()
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    recording = recorder.finish()
    recording.path_.update.preconditioners  # noqa: B018 (read: P_s computed, if deferred)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--network", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--commits", nargs="*", default=[], help="earlier commits to compare")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--prefault", action="store_true")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 runs")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(repeats=2)
        args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    X = torch.rand(1200, 64, generator=generator)
    y = torch.randint(0, 10, (1200,), generator=generator)
    versions = ["this", *args.commits]
    calls = {version: {} for version in versions}
    packages = {
        version: sklearn_pathkernel if version == "this" else import_commit(version)
        for version in versions
    }
    classes = {version: instrument(packages[version], calls[version]) for version in versions}
    if args.prefault:
        for package in packages.values():
            prefault(package)
    for _ in range(args.repeats):
        for version in versions:
            run(classes[version], args.network, X, y, calls[version], batch_size=args.batch_size)
    print(
        f"{args.network}, batch {args.batch_size}, AdamW, float32: median us per call, "
        f"{args.repeats} runs"
    )
    print(f"{'':<20}" + "".join(f"{version[:10]:>11}" for version in versions))
    for name in TOP + INNER:
        indent = "" if name in TOP else "  "
        medians = [statistics.median(calls[v][name]) / 1e3 for v in versions]
        print(f"{indent + name:<20}" + "".join(f"{m:11.1f}" for m in medians))
    sums = [sum(statistics.median(calls[v][n]) for n in TOP) / 1e3 for v in versions]
    print(f"{'hooks per step':<20}" + "".join(f"{s:11.1f}" for s in sums))
    print("per run, ms of CPU (150 steps):")
    for name in FIXED:
        indent = "  " if name in ("_check_module", "_finish_adam") else ""
        medians = [statistics.median(calls[v][name][1:]) / 1e6 for v in versions]
        print(f"{indent + name:<20}" + "".join(f"{m:11.2f}" for m in medians))


if __name__ == "__main__":
    main()
