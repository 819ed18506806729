"""Data sets, networks and fitted estimators shared by the benchmarks.

Every benchmark runs on one torch thread (a 2-core machine's second core is left to
the rest of the system, and one thread is what makes a run repeatable), on data
generated from fixed seeds or shipped with scikit-learn. The benchmarks use the
package's public API only, so that ``asv continuous`` can compare any two commits.
"""

import pickle

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler
from torch import nn

torch.set_num_threads(1)


def paper_toy(n_train=300, n_queries=60, seed=0):
    """The EPK paper's toy: 3 classes, 100-d Gaussians with means (1,4,0,...),
    (4,1,0,...), (5,5,0,...) and unit variance. Returns ``X, y, X_query``."""
    rng = np.random.RandomState(seed)
    means = np.zeros((3, 100))
    means[:, :2] = [[1, 4], [4, 1], [5, 5]]
    y = rng.randint(0, 3, n_train + n_queries)
    X = means[y] + rng.randn(n_train + n_queries, 100)
    return X[:n_train], y[:n_train], X[n_train:]


def digits(n_train=800, n_queries=100):
    """scikit-learn's 8x8 digits, standardised. Returns ``X, y, X_query, y_query``."""
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    return (
        X[:n_train],
        y[:n_train],
        X[n_train : n_train + n_queries],
        y[n_train : n_train + n_queries],
    )


def digits_images(n_train=400, n_queries=40):
    """The digits as images in [0, 1] for a CNN (flat rows of 64 pixels)."""
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    return (
        X[:n_train],
        y[:n_train],
        X[n_train : n_train + n_queries],
        y[n_train : n_train + n_queries],
    )


class DigitsCNN(nn.Module):
    """A small CNN on 8x8 digit images given as flat rows: conv 3x3 (8 channels),
    ReLU, max-pool 2, linear head."""

    def __init__(self, n_classes=10):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(8 * 4 * 4, n_classes)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        return self.head(self.pool(torch.relu(self.conv(x))).flatten(1))


class Smooth(nn.Module):
    """An MLP with a layer no per-layer rule follows (a smooth gate the engine
    differentiates with torch.func): the generic fallback's workload."""

    def __init__(self, n_features, n_classes, width=32):
        super().__init__()
        self.inner = nn.Linear(n_features, width)
        self.outer = nn.Linear(width, n_classes)

    def forward(self, x):
        z = self.inner(x)
        return self.outer(z * torch.sigmoid(z))


class ColdCalls:
    """Timing of benchmarks whose every timed call must start cold: one call per
    sample and no warm-up, each sample after its own ``setup`` (which makes a
    :func:`fresh` estimator), so that no call reads what an earlier one left in the
    kernel's cache."""

    number = 1
    repeat = (1, 5, 30.0)
    warmup_time = 0.0


def fresh(estimator):
    """An independent copy of a fitted estimator (a pickle round trip): no result
    computed on the original (the kernel's cache) is shared with it."""
    return pickle.loads(pickle.dumps(estimator))


def max_identity_error(clf, parts, X):
    """The largest ``|bias + sum(contributions) + decay - network output|`` of a
    decomposition, against the network's own output (computed by the network, not
    by the decomposition)."""
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    return float(np.abs(total - clf.predict_log_proba(X)).max())
