"""Small fitted models on digits for the explanation tests."""

import numpy as np
from sklearn.datasets import load_digits

from sklearn_pathkernel import ExactPathKernelClassifier

#: The update rules the explanations must handle, as estimator settings.
SOLVERS = {
    "sgd-full": dict(solver="sgd"),
    "sgd-mini": dict(solver="sgd", batch_size=16),
    "momentum": dict(solver="sgd", momentum=0.9, batch_size=20),
    "nesterov-decay": dict(solver="sgd", momentum=0.8, nesterovs_momentum=True,
                           weight_decay=0.01, batch_size=25),
    "adam": dict(solver="adam", learning_rate=0.01, batch_size=20),
    "adamw": dict(solver="adamw", learning_rate=0.01, weight_decay=0.05, batch_size=30),
}  # fmt: skip


def digits(n=60, seed=0):
    X, y = load_digits(return_X_y=True)
    rows = np.random.RandomState(seed).permutation(len(y))[:n]
    return X[rows] / 16.0, y[rows]


def classifier(solver="sgd-mini", n=60, **params):
    X, y = digits(n)
    settings = dict(hidden_layer_sizes=(8,), max_iter=3, learning_rate=0.2, random_state=0)
    settings.update(SOLVERS[solver])
    settings.update(params)
    return ExactPathKernelClassifier(**settings).fit(X, y), X, y
