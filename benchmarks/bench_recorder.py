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
are printed next to this commit's.

Run: ``python benchmarks/bench_recorder.py [--repeats 5] [--epochs 5] [--base 119e29d]``.
"""

import argparse
import os
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


def loop(build, X, y, epochs, batch_size, record, recorder_class=TrainingRecorder):
    """One training run; returns (seconds, recording or None, seconds of creating
    the recorder and of finish)."""
    torch.manual_seed(0)
    model = build()
    generator = torch.Generator().manual_seed(1)
    loader = DataLoader(
        TensorDataset(X, y, torch.arange(len(y))),
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * len(loader))
    start = time.perf_counter()
    recorder = None
    if record:
        recorder = recorder_class(model, optimizer, X, max_steps=epochs * len(loader))
    fixed = time.perf_counter() - start
    for _ in range(epochs):
        for images, labels, rows in loader:
            optimizer.zero_grad()
            logits = model(images)
            if record:
                recorder.rows(rows)
            F.cross_entropy(logits, labels).backward()
            optimizer.step()
            schedule.step()
    before_finish = time.perf_counter()
    recording = recorder.finish() if record else None
    end = time.perf_counter()
    return end - start, recording, fixed + end - before_finish


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--base", default=None, help="an earlier commit to compare with")
    args = parser.parse_args()
    base = None if args.base is None else import_commit(args.base).TrainingRecorder
    torch.set_num_threads(1)
    digits = load_digits()
    X = torch.tensor(digits.data[:1200] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:1200])
    queries = torch.tensor(digits.data[1200:1205] / 16.0, dtype=torch.float32)
    print(
        f"digits: {len(y)} rows, batch {args.batch_size}, {args.epochs} epochs, AdamW + cosine, "
        f"float32, torch threads 1, {args.repeats} interleaved repeats (fastest)"
    )
    header = (
        f"{'network':<20}{'W':>8}{'steps':>7}{'plain s':>9}{'recorded s':>11}{'overhead':>9}"
        f"{'ms/step':>8}{'fixed s':>8}{'KiB/step':>10}{'ExPLAIND KiB/step':>18}"
        f"{'residual':>10}{'quadrature':>11}{'model_gap':>10}"
    )
    print(header)
    for name, build in networks().items():
        plain, recorded, fixed, recording, based = [], [], [], None, []
        for _ in range(args.repeats):
            plain.append(loop(build, X, y, args.epochs, args.batch_size, False)[0])
            seconds, recording, fixed_s = loop(build, X, y, args.epochs, args.batch_size, True)
            recorded.append(seconds)
            fixed.append(fixed_s)
            if base is not None:
                based.append(loop(build, X, y, args.epochs, args.batch_size, True, base)[0])
        # The fastest of the interleaved repeats: the least disturbed by other jobs.
        plain_s, recorded_s, fixed_s = min(plain), min(recorded), min(fixed)
        n_steps = recording.n_steps_
        n_weights = recording.path_.n_weights
        state_bytes = sum(t.nbytes for t in recording.module_.state_dict().values())
        # ExPLAIND: a deep copy of the state_dict and of the batch (inputs, labels) per step.
        explaind = state_bytes + args.batch_size * (X[0].nbytes + y[0].nbytes)
        parts = recording.decompose(queries)
        print(
            f"{name:<20}{n_weights:>8}{n_steps:>7}{plain_s:>9.3f}{recorded_s:>11.3f}"
            f"{recorded_s / plain_s - 1:>9.1%}"
            f"{1e3 * (recorded_s - fixed_s - plain_s) / n_steps:>8.2f}{fixed_s:>8.3f}"
            f"{recording.nbytes / n_steps / 1024:>10.1f}"
            f"{explaind / 1024:>18.1f}{parts.residual.max():>10.1e}"
            f"{parts.quadrature_error.max():>11.1e}{parts.model_gap.max():>10.1e}"
        )
        if based:
            print(f"{'  base ' + args.base:<35}{min(based):>11.3f}{min(based) / plain_s - 1:>9.1%}")


if __name__ == "__main__":
    main()
