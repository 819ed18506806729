"""The float64 move check: what it adds to a recording's first query, and how much
room it leaves honest runs.

A float64 recording checks, before its first query, every step's move against its
recorded output gradients (one float64 forward and backward pass per step, once:
``_training/_replay.py::check_moves``); a step whose recomputed move lands further
than ``c u (max|w_{s+1}| + max|w_{s+1} - w_s|)`` from the recorded weights is
refused, with ``c = ROUNDING_STEPS = 1024``.

``--section cost``: the same loop (digits, MLP 64-64-10, AdamW, batches of 64,
float64, one thread) is recorded and decomposed with the check and with it
bypassed, alternately in one process; printed: the loop's time, the first
``decompose`` (which includes the check) and a second one.

``--section margin``: for honest float64 loops (an MLP 64-32-32-10, 300 steps of 32
rows) the smallest ``c`` that passes every step (by bisection): Adam with ReLU units
(some dead), a larger learning rate, gradient accumulation over two micro-batches,
AdamW with ``eps=1e-12`` (the preconditioner where it is largest), SGD with momentum
0.99 and Nesterov at a large learning rate.

Run: ``python benchmarks/bench_move_check.py --section cost --repeats 3`` and
``python benchmarks/bench_move_check.py --section margin``; ``--quick``: both sections
(or the one given) at small sizes: one repeat of 20 steps, margins of 60-step loops
by 12 bisections.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._recording._recording import output_function
from sklearn_pathkernel._training import _replay
from sklearn_pathkernel._training._optimizers import RecordingRefused

MARGIN_RUNS = {
    "Adam, ReLU": (lambda p: torch.optim.Adam(p, lr=1e-3), nn.ReLU, 1),
    "Adam, ReLU, lr 1e-2": (lambda p: torch.optim.Adam(p, lr=1e-2), nn.ReLU, 1),
    "Adam, ReLU, two micro-batches": (lambda p: torch.optim.Adam(p, lr=1e-3), nn.ReLU, 2),
    "AdamW, tanh, eps 1e-12": (lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-12), nn.Tanh, 1),
    "SGD momentum 0.99, two micro-batches": (
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.99),
        nn.ReLU,
        2,
    ),
    "SGD Nesterov, lr 0.5": (
        lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, nesterov=True),
        nn.ReLU,
        1,
    ),
}


def recording(model, optimizer, X, y, n_steps, batch_size, micro_batches=1):
    """A float64 loop of ``n_steps`` steps of ``micro_batches`` random batches each,
    recorded; returns the recording and the loop's seconds."""
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for _ in range(n_steps):
        optimizer.zero_grad()
        for _ in range(micro_batches):
            rows = rng.choice(len(y), batch_size, replace=False)
            out = model(X[rows])
            recorder.rows(rows)
            (F.cross_entropy(out, y[rows]) / micro_batches).backward()
        optimizer.step()
    return recorder.finish(), time.perf_counter() - start


def cost(X, y, repeats, n_steps):
    check = _replay.check_moves
    variants = {"with the check": check, "bypassed": lambda *args: None}
    for _ in range(repeats):
        for label, function in variants.items():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).double()
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
            run, loop_s = recording(model, optimizer, X, y, n_steps, 64)
            _replay.check_moves = function
            try:
                start = time.perf_counter()
                run.decompose(X[:5])
                first_s = time.perf_counter() - start
                start = time.perf_counter()
                run.decompose(X[5:10])
                second_s = time.perf_counter() - start
            finally:
                _replay.check_moves = check
            print(
                f"{label:<16}{run.n_steps_:>5} steps  loop {loop_s:.2f} s  first "
                f"decompose {first_s:.2f} s  second {second_s:.2f} s"
            )


def smallest_passing(run, iterations=30):
    """The smallest ``ROUNDING_STEPS`` the run's moves pass (bisection)."""
    low, high = 0.0, float(_replay.ROUNDING_STEPS)
    kept = _replay.ROUNDING_STEPS
    try:
        for _ in range(iterations):
            middle = (low + high) / 2
            _replay.ROUNDING_STEPS = middle
            try:
                _replay.check_moves(run.path_, run.module_, run.X_train_, output_function(run.link))
                high = middle
            except RecordingRefused:
                low = middle
    finally:
        _replay.ROUNDING_STEPS = kept
    return high


def margin(X, y, n_steps=300, iterations=30):
    for name, (optimizer, activation, micro_batches) in MARGIN_RUNS.items():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 32), activation(), nn.Linear(32, 32), activation(), nn.Linear(32, 10)
        ).double()
        run, _ = recording(model, optimizer(model.parameters()), X, y, n_steps, 32, micro_batches)
        smallest = smallest_passing(run, iterations)
        print(f"{name:<40} smallest c that passes: {smallest:.3g} (the check: 1024)")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--section", choices=("cost", "margin"), default=None,
                        help="default: cost (--quick: both)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=95, help="the cost section's steps")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(repeats=1, steps=20)
        args = parser.parse_args()
    sections = [args.section] if args.section else ["cost", "margin"] if args.quick else ["cost"]
    torch.set_num_threads(1)
    digits = load_digits()
    if "cost" in sections:
        cost(
            torch.tensor(digits.data[:1200] / 16.0),
            torch.tensor(digits.target[:1200]),
            args.repeats,
            args.steps,
        )
    if "margin" in sections:
        margin(
            torch.tensor(digits.data[:600] / 16.0),
            torch.tensor(digits.target[:600]),
            *((60, 12) if args.quick else ()),
        )


if __name__ == "__main__":
    main()
