"""The cost of recording a user's own loop: time overhead and bytes per step.

The same loop (DataLoader, AdamW, cosine schedule, float32, digits) runs without
and with :class:`~sklearn_pathkernel.TrainingRecorder`, interleaved in one process
(the machine's load drifts), from the same initial weights and batch order; the
recorded run's time includes creating the recorder (its module checks) and
``finish``. Reported: the fastest of each over ``--repeats`` runs (the least
disturbed by other jobs), the overhead, the recorder's cost per step (without the
fixed cost of creating it and of ``finish``, given apart),
the bytes the recording holds per step, and what ExPLAIND would store per step
(computed, not measured: it deep-copies the full ``state_dict`` and the batch's
tensors at every step; ExPLAIND 0.1.0 needs Python >= 3.12 and could not be
installed here), and the decomposition's certificate on a few test images
(``residual``, against the float64 replay of the run, and ``model_gap``, the
float32 network's own output against it).

With ``--base COMMIT``, the recorder of an earlier commit (``git archive``, see
``_baseline.py``) runs in the same interleaved repeats, and its time and overhead
are printed next to this commit's. With ``--floor``, two more loops, interleaved
too, give the least a recorder costs: its hook points doing nothing
(:class:`NoOpHooks`), and doing only the copies of the weights and Adam's moments
into preallocated host rows (:class:`NoOpHooksAndCopies`). A third loop,
interleaved too, runs the recorder without its per-step weight check (the bitwise
comparison of the weights with the previous step's result): ``check share`` is
that check's part of the loop.

The overhead is given for the median of the repeats (and for the fastest); the
goal: at most 15 % at batch 64, 5 % at batch 256, float32, one thread.
With ``--clock cpu`` the loops are timed by the thread's CPU time
(``time.thread_time``) instead of the wall clock: on a loaded machine, the time
the process waits for a core is left out (cache disturbance by other jobs is not).

With ``--interleave step`` the runs take turns of ``--block`` steps instead (the
loop without a recorder, with this commit's, with ``--base``'s and the floors';
the order rotated at every turn), each step timed with its batch's loading: a
recorded step is measured within a few tens of milliseconds of a plain one, so a
machine that drifts between runs moves both alike, and within a turn a run's
steps follow its own (the caches as the loop alone leaves them, but for the
turn's first step, which the median leaves out). The overhead is then the median step's
(recorded against plain) plus the fixed costs (creating the recorder, ``finish``)
spread over the run's steps, and, beside it, the ratio of the totals (every
step's time, and the fixed costs, summed over the repeats), and first the median over
the turns of a turn's time against the plain run's in the same turn (plus the fixed
costs against the run's time): a turn's runs are timed within a fraction of a
second of each other, so this pairing is the least moved by a machine whose speed
drifts from second to second. ``--ablate`` adds the
recorder without its per-step weight check and without its per-step structure
check.

Run: ``python benchmarks/bench_recorder.py --repeats 15 --epochs 5 --batch-sizes 64 256
--networks "mlp 64-64-10" "cnn (example)"``; per step: ``python
benchmarks/bench_recorder.py --interleave step --repeats 9 --epochs 10 --batch-sizes 64
256 --networks "mlp 64-64-10" "cnn (example)" --floor --ablate --clock cpu``.
"""

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sklearn_pathkernel import TrainingRecorder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baseline import import_commit  # noqa: E402


def networks():
    return {
        "mlp 64-64-10": lambda: nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)),
        "mlp 64-256-256-10": lambda: nn.Sequential(
            nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10)
        ),
        "cnn (example)": lambda: nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(72, 10),
        ),
    }


class WithoutWeightCheck(TrainingRecorder):
    """The recorder without its per-step weight check (to measure that check)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._weights.unchanged = lambda log: True
        self._weights.after_step = lambda: None


class WithoutStructureCheck(TrainingRecorder):
    """The recorder without its per-step structure check (which parameters the module
    trains and the optimiser holds), to measure that check (``--ablate``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._structure.changed = lambda *args: False


class NoOpHooks:
    """The recorder's hook points doing nothing (``--floor``): the module's forward
    hook, which puts a tensor hook on the output, which queues a callback to the
    end of the backward pass, the optimiser's step pre- and post-hooks, and
    ``rows``. Its overhead is the least any recorder with these hook points costs."""

    def __init__(self, module, optimizer, X, max_steps=None):
        self.optimizer = optimizer
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._handles = [
            module.register_forward_hook(self._on_forward),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def rows(self, indices):
        self._rows = indices

    def _on_forward(self, module, args, output):
        output.register_hook(self._on_gradient)

    def _on_gradient(self, grad):
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self):
        pass

    def _before_step(self, optimizer, args, kwargs):
        pass

    def _after_step(self, optimizer, args, kwargs):
        pass

    def finish(self):
        for handle in self._handles:
            handle.remove()


class NoOpHooksAndCopies(NoOpHooks):
    """:class:`NoOpHooks` plus the copies no recorder can skip: per step, the weights
    and Adam's second moments each copied into a row of a host array allocated
    when it is created (``torch.cat`` of the parameters' flat views, as the
    recorder), and the output gradient negated (a new tensor)."""

    def __init__(self, module, optimizer, X, max_steps=None):
        super().__init__(module, optimizer, X, max_steps)
        width = sum(p.numel() for p in self.params)
        self._views = [p.detach().view(-1) for p in self.params]
        self._weights = torch.empty((max_steps + 1, width))
        self._moments = torch.empty((max_steps, width))
        torch.cat(self._views, out=self._weights[0])
        self._step = 0

    def _on_gradient(self, grad):
        self._gradient = grad.neg()
        super()._on_gradient(grad)

    def _after_step(self, optimizer, args, kwargs):
        state = optimizer.state
        self._step += 1
        torch.cat(self._views, out=self._weights[self._step])
        moments = [state[p]["exp_avg_sq"].view(-1) for p in self.params]
        torch.cat(moments, out=self._moments[self._step - 1])


#: The clock the loops are timed with (``--clock``).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def shuffled_loader(X, y, batch_size):
    """The loop's DataLoader: (inputs, labels, rows), shuffled by a seeded generator
    (every run sees the same batch order)."""
    return DataLoader(
        TensorDataset(X, y, torch.arange(len(y))),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )


def loop(build, X, y, epochs, batch_size, record, recorder_class=TrainingRecorder):
    """One training run; returns (seconds, recording or None, seconds of creating
    the recorder and of finish)."""
    torch.manual_seed(0)
    model = build()
    loader = shuffled_loader(X, y, batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * len(loader))
    start = clock()
    recorder = None
    if record:
        recorder = recorder_class(model, optimizer, X, max_steps=epochs * len(loader))
    fixed = clock() - start
    for _ in range(epochs):
        for images, labels, rows in loader:
            optimizer.zero_grad()
            logits = model(images)
            if record:
                recorder.rows(rows)
            F.cross_entropy(logits, labels).backward()
            optimizer.step()
            schedule.step()
    before_finish = clock()
    recording = recorder.finish() if record else None
    end = clock()
    return end - start, recording, fixed + end - before_finish


class SteppedRun:
    """One training run of :func:`loop`'s loop, advanced one step at a time
    (``--interleave step``): several runs take their steps in turn, so that each
    recorded step has a plain step beside it, measured within milliseconds of it."""

    def __init__(self, build, X, y, epochs, batch_size, recorder_class=None):
        torch.manual_seed(0)
        self.model = build()
        loader = shuffled_loader(X, y, batch_size)
        self.n_steps = epochs * len(loader)
        self.batches = itertools.chain.from_iterable(loader for _ in range(epochs))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01, weight_decay=1e-3)
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, self.n_steps)
        self.recorder_class, self.X = recorder_class, X
        self.recorder, self.recording = None, None
        self.times, self.fixed = [], 0.0

    def start(self):
        """Create the recorder (timed as the run's fixed cost)."""
        if self.recorder_class is not None:
            start = clock()
            self.recorder = self.recorder_class(
                self.model, self.optimizer, self.X, max_steps=self.n_steps
            )
            self.fixed += clock() - start

    def step(self):
        """One step of the loop, the batch's loading included (timed)."""
        start = clock()
        images, labels, rows = next(self.batches)
        self.optimizer.zero_grad()
        logits = self.model(images)
        if self.recorder is not None:
            self.recorder.rows(rows)
        F.cross_entropy(logits, labels).backward()
        self.optimizer.step()
        self.schedule.step()
        self.times.append(clock() - start)

    def finish(self):
        """``finish`` (timed as the run's fixed cost)."""
        if self.recorder is not None:
            start = clock()
            self.recording = self.recorder.finish()
            self.fixed += clock() - start


def stepped(build, X, y, epochs, batch_size, recorder_classes, block):
    """Runs of the loop without a recorder and with each of ``recorder_classes``,
    taking ``block`` steps each in turn (the order rotated at every turn); returns
    the runs."""
    runs = [SteppedRun(build, X, y, epochs, batch_size, None)] + [
        SteppedRun(build, X, y, epochs, batch_size, cls) for cls in recorder_classes
    ]
    for run in runs:
        run.start()
    n_steps = runs[0].n_steps
    for turn, start in enumerate(range(0, n_steps, block)):
        shift = turn % len(runs)
        for run in runs[shift:] + runs[:shift]:
            for _ in range(min(block, n_steps - start)):
                run.step()
    for run in runs:
        run.finish()
    return runs


def report_stepped(name, build, X, y, batch_size, args, base):
    """``--interleave step``: per step, the loop with each recorder against the loop
    without, their steps taken in turn."""
    classes = [TrainingRecorder] + ([] if base is None else [base])
    labels = ["this commit"] + ([] if base is None else [f"base {args.base}"])
    if args.ablate:
        classes += [WithoutWeightCheck, WithoutStructureCheck]
        labels += ["without weight check", "without structure check"]
    if args.floor:
        classes += [NoOpHooks, NoOpHooksAndCopies]
        labels += ["no-op hooks", "no-op hooks + copies"]
    steps = [[] for _ in range(len(classes) + 1)]
    fixed = [[] for _ in classes]
    paired = [[] for _ in classes]  # per turn: the run's time over the plain run's
    for _ in range(args.repeats):
        runs = stepped(build, X, y, args.epochs, batch_size, classes, args.block)
        for times, run in zip(steps, runs, strict=True):
            times.extend(run.times)
        for seconds, run in zip(fixed, runs[1:], strict=True):
            seconds.append(run.fixed)
        turns = range(0, runs[0].n_steps, args.block)
        for ratios, run in zip(paired, runs[1:], strict=True):
            ratios.extend(
                sum(run.times[k : k + args.block]) / sum(runs[0].times[k : k + args.block])
                for k in turns
            )
    n_steps = runs[0].n_steps
    plain = statistics.median(steps[0])
    total = sum(steps[0])
    print(
        f"{name:<20}{batch_size:>6}{n_steps:>6}  plain step {1e3 * plain:.3f} ms (median of "
        f"{len(steps[0])}), mean {1e3 * total / len(steps[0]):.3f} ms"
    )
    mean_step = total / len(steps[0])
    for label, times, seconds, ratios in zip(labels, steps[1:], fixed, paired, strict=True):
        fixed_s = statistics.median(seconds)
        per_step = statistics.median(times) - plain
        median = (per_step * n_steps + fixed_s) / (plain * n_steps)
        mean = (sum(times) + sum(seconds)) / total - 1
        turns = statistics.median(ratios) - 1 + fixed_s / (n_steps * mean_step)
        print(
            f"  {label:<24}overhead {turns:>7.1%} (paired turns), {median:>7.1%} (medians), "
            f"{mean:>7.1%} (totals); {1e3 * per_step:.3f} ms/step, fixed "
            f"{1e3 * fixed_s:.2f} ms per run"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--networks", nargs="+", default=list(networks()))
    parser.add_argument("--base", default=None, help="an earlier commit to compare with")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="with --interleave step: the steps each run takes in its turn (1: runs "
        "alternate at every step, each step then follows another run's and finds the "
        "caches as that one left them)",
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="with --interleave step: also the recorder without its per-step weight "
        "check, and without its per-step structure check",
    )
    parser.add_argument(
        "--interleave",
        choices=("run", "step"),
        default="run",
        help="run: whole runs in turn, the median run (the default); step: the runs' "
        "steps in turn, the median step (robust to a drifting machine), plus the fixed "
        "costs",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time the recorder's hook points doing nothing, and with the "
        "copies of the weights and Adam's moments only (the least a recorder costs)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 2 repeats of 1 epoch, the MLP"
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.epochs, args.networks = 2, 1, list(networks())[:1]
    global clock
    clock = CLOCKS[args.clock]
    base = None if args.base is None else import_commit(args.base).TrainingRecorder
    torch.set_num_threads(1)
    digits = load_digits()
    X = torch.tensor(digits.data[:1200] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:1200])
    queries = torch.tensor(digits.data[1200:1205] / 16.0, dtype=torch.float32)
    print(
        f"digits: {len(y)} rows, {args.epochs} epochs, AdamW + cosine, float32, torch threads "
        f"1, {args.repeats} interleaved repeats, {args.clock} clock; overhead of the median (of "
        "the fastest)"
    )
    header = (
        f"{'network':<20}{'batch':>6}{'W':>7}{'steps':>6}{'plain s':>9}{'recorded s':>11}"
        f"{'overhead':>17}{'check share':>12}{'ms/step':>8}{'fixed s':>8}{'KiB/step':>9}"
        f"{'ExPLAIND':>9}{'residual':>9}{'quadr.':>9}{'gap':>9}"
    )
    if args.interleave == "step":
        for batch_size in args.batch_sizes:
            for name in args.networks:
                report_stepped(name, networks()[name], X, y, batch_size, args, base)
        return
    print(header)
    for batch_size in args.batch_sizes:
        for name in args.networks:
            report(name, networks()[name], X, y, queries, batch_size, args, base)


def report(name, build, X, y, queries, batch_size, args, base):
    """One network at one batch size: the interleaved repeats and their figures."""
    plain, recorded, unchecked, fixed, based = [], [], [], [], []
    floors = {NoOpHooks: [], NoOpHooksAndCopies: []} if args.floor else {}
    for _ in range(args.repeats):
        plain.append(loop(build, X, y, args.epochs, batch_size, False)[0])
        seconds, recording, fixed_s = loop(build, X, y, args.epochs, batch_size, True)
        recorded.append(seconds)
        fixed.append(fixed_s)
        unchecked.append(loop(build, X, y, args.epochs, batch_size, True, WithoutWeightCheck)[0])
        if base is not None:
            based.append(loop(build, X, y, args.epochs, batch_size, True, base)[0])
        for floor, times in floors.items():
            times.append(loop(build, X, y, args.epochs, batch_size, True, floor)[0])
    plain_s, recorded_s = statistics.median(plain), statistics.median(recorded)
    unchecked_s, fixed_s = statistics.median(unchecked), statistics.median(fixed)
    n_steps = recording.n_steps_
    n_weights = recording.path_.n_weights
    state_bytes = sum(t.nbytes for t in recording.module_.state_dict().values())
    # ExPLAIND: a deep copy of the state_dict and of the batch (inputs, labels) per step.
    explaind = state_bytes + batch_size * (X[0].nbytes + y[0].nbytes)
    parts = recording.decompose(queries)
    overhead = f"{recorded_s / plain_s - 1:.1%} ({min(recorded) / min(plain) - 1:.1%})"
    print(
        f"{name:<20}{batch_size:>6}{n_weights:>7}{n_steps:>6}{plain_s:>9.3f}{recorded_s:>11.3f}"
        f"{overhead:>17}{(recorded_s - unchecked_s) / plain_s:>12.1%}"
        f"{1e3 * (recorded_s - fixed_s - plain_s) / n_steps:>8.2f}{fixed_s:>8.3f}"
        f"{recording.nbytes / n_steps / 1024:>9.1f}"
        f"{explaind / 1024:>9.1f}{parts.residual.max():>9.1e}"
        f"{parts.quadrature_error.max():>9.1e}{parts.model_gap.max():>9.1e}"
    )
    if based:
        base_s = statistics.median(based)
        print(f"{'  base ' + args.base:<39}{base_s:>11.3f}{base_s / plain_s - 1:>17.1%}")
    for floor, times in floors.items():
        floor_s = statistics.median(times)
        label = "  no-op hooks" if floor is NoOpHooks else "  no-op hooks + copies"
        print(
            f"{label:<39}{floor_s:>11.3f}{floor_s / plain_s - 1:>17.1%}{'':>12}"
            f"{1e3 * (floor_s - plain_s) / n_steps:>8.2f}"
        )


if __name__ == "__main__":
    main()
