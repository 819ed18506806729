"""How much room the float64 move check leaves honest runs.

``_training/_replay.py::check_moves`` refuses a step whose recomputed move lands
further than ``c u (max|w_{s+1}| + max|w_{s+1} - w_s|)`` from the recorded weights,
with ``c = ROUNDING_STEPS = 1024``. For honest float64 loops (digits, an MLP
64-32-32-10, 300 steps of 32 rows, one thread) this prints the smallest ``c`` that
passes every step (by bisection): Adam with ReLU units (some dead), a larger
learning rate, gradient accumulation over two micro-batches, AdamW with
``eps=1e-12`` (the preconditioner where it is largest), SGD with momentum 0.99 and
Nesterov at a large learning rate.

Run: ``python benchmarks/move_check_margin.py``.
"""

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._recording._recording import output_function
from sklearn_pathkernel._training import _replay
from sklearn_pathkernel._training._optimizers import RecordingRefused

RUNS = {
    "Adam, ReLU": (lambda p: torch.optim.Adam(p, lr=1e-3), nn.ReLU, 1),
    "Adam, ReLU, lr 1e-2": (lambda p: torch.optim.Adam(p, lr=1e-2), nn.ReLU, 1),
    "Adam, ReLU, two micro-batches": (lambda p: torch.optim.Adam(p, lr=1e-3), nn.ReLU, 2),
    "AdamW, tanh, eps 1e-12": (
        lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-12),
        nn.Tanh,
        1,
    ),
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


def recording(X, y, optimizer, activation, micro_batches, n_steps=300, batch_size=32):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 32), activation(), nn.Linear(32, 32), activation(), nn.Linear(32, 10)
    ).double()
    optimizer = optimizer(model.parameters())
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    rng = np.random.default_rng(0)
    for _ in range(n_steps):
        optimizer.zero_grad()
        for _ in range(micro_batches):
            rows = rng.choice(len(y), batch_size, replace=False)
            out = model(X[rows])
            recorder.rows(rows)
            (F.cross_entropy(out, y[rows]) / micro_batches).backward()
        optimizer.step()
    return recorder.finish()


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


def main():
    torch.set_num_threads(1)
    digits = load_digits()
    X = torch.tensor(digits.data[:600] / 16.0)
    y = torch.tensor(digits.target[:600])
    for name, (optimizer, activation, micro_batches) in RUNS.items():
        run = recording(X, y, optimizer, activation, micro_batches)
        print(f"{name:<40} smallest c that passes: {smallest_passing(run):.3g} (the check: 1024)")


if __name__ == "__main__":
    main()
