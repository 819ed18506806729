"""Convolutional distance network vs a CNN of equal parameter count vs MLPClassifier.

Data sets (no downloads):

- ``digits``: scikit-learn's bundled 8x8 digits.
- ``digits-shifted``: a variant derived from the same digits (NOT an independent
  data set: no second labelled image set ships with the installed packages), each
  8x8 digit placed at a random offset in a 10x10 canvas.

Protocol: per data set, ``N_SELECT`` = 300 images (stratified) are set aside.
The candidate architectures ``ARCHITECTURES`` (16 memories of 3x3 patches,
padding 1, a 2x2 or 3x3 pool over positions) come from an exploration on those
300 images only (5-fold cross-validation on them, ``doc/benchmarks_distance.rst``).
Here the 300 images choose, by 2-fold cross-validation on them, per data set
one architecture for both convolutional networks (the one with the largest sum
of the two networks' best selection scores) and each network's learning rate
from ``LEARNING_RATES``. The other 1497 images are scored by 5-fold
cross-validation (accuracy, the same folds for every model, one run).
MLPClassifier keeps scikit-learn's defaults. Inputs are scaled to [0, 1]
(pixel / 16).

Models:

- ``conv-distance``: ``DistanceKernelClassifier(image_shape, conv_layers,
  hidden_layer_sizes=())``: 16 memories of 3x3 patches (padding 1), the
  smallest distance of each p x p window of positions (min-pool), log1p, linear
  head.
- ``cnn``: the same shape: ``nn.Conv2d(1, 16, 3, padding=1)``, ReLU, p x p
  max-pool, linear head: the same parameter count (a convolution's weights and
  bias have the shape of the memories and the bias), trained by the same loop
  (``ExactPathKernelClassifier``, Adam, full batches).
- ``mlp``: ``MLPClassifier(random_state=0)`` (100 ReLU units, Adam).

Run: ``PYTHONPATH=. python benchmarks/bench_distance_images.py`` (single thread).
``--quick``: a smoke run of the protocol at a tiny size (``digits`` alone, 100
selection images, one architecture and learning rate, 20 epochs, 3-fold scores of 300
images): its accuracies mean nothing.
"""

import argparse
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import StratifiedKFold, cross_val_score, train_test_split
from sklearn.neural_network import MLPClassifier
from torch import nn

from sklearn_pathkernel import DistanceKernelClassifier, ExactPathKernelClassifier
from sklearn_pathkernel._estimators._networks import conv_specs

N_SELECT, MAX_ITER = 300, 300
#: Candidate ``conv_layers``: (n_memories, kernel_size, stride, padding, pool) per
#: layer; the CNN mirrors the one chosen.
ARCHITECTURES = (((16, 3, 1, 1, 2),), ((16, 3, 1, 1, 3),))
LEARNING_RATES = (0.01, 0.02, 0.05)
#: The protocol's sizes; ``--quick``'s (a smoke run).
FULL = dict(data_sets=("digits", "digits-shifted"), n_select=N_SELECT, max_iter=MAX_ITER,
            architectures=ARCHITECTURES, learning_rates=LEARNING_RATES, n_report=None,
            folds=5)  # fmt: skip
QUICK = dict(FULL, data_sets=("digits",), n_select=100, max_iter=20,
             architectures=ARCHITECTURES[:1], learning_rates=(0.02,), n_report=300,
             folds=3)  # fmt: skip


def digits_sets(seed=0):
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    rng = np.random.RandomState(seed)
    canvas = np.zeros((X.shape[0], 10, 10))
    offsets = rng.randint(0, 3, size=(X.shape[0], 2))
    for i, (r, c) in enumerate(offsets):
        canvas[i, r : r + 8, c : c + 8] = X[i].reshape(8, 8)
    return {"digits": (X, y, (8, 8)), "digits-shifted": (canvas.reshape(-1, 100), y, (10, 10))}


class MirrorCNN(nn.Module):
    """The conv distance network's shape with ``nn.Conv2d`` + ReLU (+ ``nn.MaxPool2d``)
    in place of each distance layer (+ its min-pool): the same parameter count."""

    def __init__(self, image_shape, n_outputs, conv_layers):
        super().__init__()
        self.image_shape = image_shape
        layers, channels, (height, width) = [], 1, image_shape
        for spec in conv_specs(conv_layers):
            layers += [
                nn.Conv2d(
                    channels,
                    spec.n_memories,
                    spec.kernel_size,
                    spec.stride,
                    spec.padding,
                    dtype=torch.float64,
                ),
                nn.ReLU(),
            ]
            height, width = (
                (size + 2 * spec.padding - spec.kernel_size) // spec.stride + 1
                for size in (height, width)
            )
            if spec.pool > 1:
                layers.append(nn.MaxPool2d(spec.pool))
                height, width = height // spec.pool, width // spec.pool
            channels = spec.n_memories
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(channels * height * width, n_outputs, dtype=torch.float64)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.body(x.view(-1, 1, *self.image_shape)).flatten(1))


def conv_distance(image_shape, conv_layers, learning_rate, max_iter=MAX_ITER):
    return DistanceKernelClassifier(
        image_shape=image_shape,
        conv_layers=conv_layers,
        hidden_layer_sizes=(),
        learning_rate=learning_rate,
        max_iter=max_iter,
        random_state=0,
    )


def cnn(image_shape, conv_layers, learning_rate, max_iter=MAX_ITER):
    return ExactPathKernelClassifier(
        module=lambda n_features, n_outputs: MirrorCNN(image_shape, n_outputs, conv_layers),
        solver="adam",
        learning_rate=learning_rate,
        max_iter=max_iter,
        random_state=0,
    )


def n_parameters(estimator, X, y):
    module = estimator.fit(X[:50], y[:50]).module_
    return sum(p.numel() for p in module.parameters())


def select(name, shape, X_select, y_select, settings=FULL):
    """The two convolutional networks chosen on the selection images (2-fold CV):
    one architecture for both, each network's learning rate."""
    makers = {"conv-distance": conv_distance, "cnn": cnn}
    architectures, max_iter = settings["architectures"], settings["max_iter"]
    best = {}
    for layers in architectures:
        for label, make in makers.items():
            scores = {
                lr: cross_val_score(
                    make(shape, layers, lr, max_iter), X_select, y_select, cv=2
                ).mean()
                for lr in settings["learning_rates"]
            }
            lr = max(scores, key=scores.get)
            best[layers, label] = (scores[lr], lr)
            print(f"{name} {label} {layers}: selection {scores}", flush=True)
    layers = max(architectures, key=lambda a: sum(best[a, label][0] for label in makers))
    print(f"{name}: conv_layers={layers}", flush=True)
    return {
        label: make(shape, layers, best[layers, label][1], max_iter)
        for label, make in makers.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run at a tiny size")
    settings = QUICK if parser.parse_args().quick else FULL
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Stochastic Optimizer")  # MLP's max_iter
    start = time.perf_counter()
    rows = []
    for name, (X, y, shape) in digits_sets().items():
        if name not in settings["data_sets"]:
            continue
        X_select, X_report, y_select, y_report = train_test_split(
            X, y, train_size=settings["n_select"], stratify=y, random_state=0
        )
        X_report, y_report = X_report[: settings["n_report"]], y_report[: settings["n_report"]]
        folds = StratifiedKFold(settings["folds"], shuffle=True, random_state=0)
        models = select(name, shape, X_select, y_select, settings)
        models["mlp"] = MLPClassifier(random_state=0)
        counts = {label: n_parameters(est, X, y) for label, est in models.items() if label != "mlp"}
        counts["mlp"] = X.shape[1] * 100 + 100 + 100 * 10 + 10
        for label, model in models.items():
            tic = time.perf_counter()
            scores = cross_val_score(model, X_report, y_report, cv=folds)
            lr = "(defaults)" if label == "mlp" else model.learning_rate
            rows.append(
                (
                    name,
                    label,
                    counts[label],
                    scores.mean(),
                    scores.std(),
                    lr,
                    time.perf_counter() - tic,
                )
            )
            print(
                f"{name:15s} {label:14s} params={counts[label]:6d} "
                f"acc={scores.mean():.4f} +- {scores.std():.4f} ({rows[-1][-1]:.0f} s)",
                flush=True,
            )
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    print(f"\n| data set | model | parameters | {settings['folds']}-fold accuracy | lr |")
    print("|---|---|---|---|---|")
    for name, label, count, mean, std, lr, _ in rows:
        print(f"| {name} | {label} | {count} | {mean:.4f} ± {std:.4f} | {lr} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
