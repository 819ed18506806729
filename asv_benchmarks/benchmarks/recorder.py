"""The cost of recording a user's own PyTorch loop with ``TrainingRecorder``.

An ordinary loop (float32, AdamW, a shuffled ``DataLoader`` of (x, y, rows)) on
scikit-learn's digits, with and without the recorder's two added lines.
``track_overhead_percent`` times the two loops in turns within one call (the median
of 5 turns each, the order alternating), so both see the same machine.
"""

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sklearn_pathkernel import TrainingRecorder

from .common import digits_images


def _network(name):
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(72, 10),
    )


class Loop:
    """MLP 64-64-10 and a CNN (conv 3x3, 8 channels, max-pool, linear head) on the
    8x8 digits (M=800), float32 AdamW, 3 epochs of a shuffled loader."""

    params = (["mlp", "cnn"], [64, 256])
    param_names = ["network", "batch_size"]
    timeout = 600

    def setup(self, network, batch_size):
        X, y, _, _ = digits_images(800, 0)
        self.X = torch.tensor(X, dtype=torch.float32)
        self.y = torch.tensor(y)
        self.network, self.batch_size = network, batch_size
        self._loop(record=False)  # (warm-up: the first pass through the loop's code)
        self._loop(record=True)

    def _loop(self, record):
        model = _network(self.network)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(
            TensorDataset(self.X, self.y, torch.arange(len(self.y))),
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
        )
        recorder = TrainingRecorder(model, optimizer, self.X) if record else None
        for _ in range(3):
            for x, target, rows in loader:
                optimizer.zero_grad()
                out = model(x)
                if record:
                    recorder.rows(rows)
                F.cross_entropy(out, target).backward()
                optimizer.step()
        return recorder.finish() if record else model

    def time_plain_loop(self, network, batch_size):
        self._loop(record=False)

    def time_recorded_loop(self, network, batch_size):
        self._loop(record=True)

    def peakmem_recorded_loop(self, network, batch_size):
        self._loop(record=True)

    def track_overhead_percent(self, network, batch_size):
        plain, recorded = [], []
        for turn in range(5):
            for record in (turn % 2 == 1, turn % 2 == 0):
                begin = time.perf_counter()
                self._loop(record=record)
                (recorded if record else plain).append(time.perf_counter() - begin)
        return 100.0 * (np.median(recorded) / np.median(plain) - 1.0)

    track_overhead_percent.unit = "percent"
