"""What the float64 move check adds to a recording's first query.

A float64 recording checks, before its first query, every step's move against its
recorded output gradients (one float64 forward and backward pass per step, once:
``_training/_replay.py::check_moves``). The same loop (digits, MLP 64-64-10,
AdamW, batches of 64, float64, one thread) is recorded and decomposed with the
check and with it bypassed, alternately in one process; printed: the loop's time,
the first ``decompose`` (which includes the check) and a second one.

Run: ``python benchmarks/bench_move_check.py --repeats 3 --epochs 5``.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._training import _replay


def record(X, y, epochs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for first in range(0, len(y), 64):
            rows = order[first : first + 64]
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
    return recorder.finish(), time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    digits = load_digits()
    X = torch.tensor(digits.data[:1200] / 16.0)
    y = torch.tensor(digits.target[:1200])
    check = _replay.check_moves
    variants = {"with the check": check, "bypassed": lambda *args: None}
    for _ in range(args.repeats):
        for label, function in variants.items():
            _replay.check_moves = function
            try:
                recording, loop_s = record(X, y, args.epochs)
                start = time.perf_counter()
                recording.decompose(X[:5])
                first_s = time.perf_counter() - start
                start = time.perf_counter()
                recording.decompose(X[5:10])
                second_s = time.perf_counter() - start
            finally:
                _replay.check_moves = check
            print(
                f"{label:<16}{recording.n_steps_:>5} steps  loop {loop_s:.2f} s  first "
                f"decompose {first_s:.2f} s  second {second_s:.2f} s"
            )


if __name__ == "__main__":
    main()
