"""A fitted estimator or a recording frees its recorded path with its last reference.

The path is the largest thing a fit holds (``8 (S + 1) W`` bytes: gigabytes at the
field's size, a memory-mapped file with ``path_storage="disk"``). If anything the fit
leaves behind sits in a reference cycle with it (a recorder holding a bound method of
itself, a rule and its helper pointing at each other), the path outlives the
estimator until Python's cycle collector runs, which large tensors do not trigger: a
loop of retrainings (a grid search, a table of retrained subsets) then holds many
paths at once. Each case below runs with the cycle collector off and checks that
deleting the last reference frees the path at once and leaves nothing for the
collector.
"""

import gc
import weakref

import numpy as np
import pytest
import torch

from sklearn_pathkernel import (
    DistanceKernelClassifier,
    ExactPathKernelClassifier,
    ExactPathKernelRegressor,
    TrainingRecorder,
)

rng = np.random.RandomState(0)
X = rng.randn(40, 16)
y = (X[:, 0] > 0).astype(int)
SMALL = dict(max_iter=3, batch_size=20, random_state=0)


def _cnn():
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 4, 4)),
        torch.nn.Conv2d(1, 3, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(12, 2),
    )


ESTIMATORS = {
    "mlp-sgd": lambda: ExactPathKernelClassifier(hidden_layer_sizes=(8,), **SMALL),
    "mlp-momentum-disk": lambda: ExactPathKernelClassifier(
        hidden_layer_sizes=(8,), solver="sgd", momentum=0.9, path_storage="disk", **SMALL
    ),
    "mlp-adam-float32": lambda: ExactPathKernelClassifier(
        hidden_layer_sizes=(8,), solver="adam", epsilon=1e-4, dtype="float32", **SMALL
    ),
    "cnn-dropout": lambda: ExactPathKernelClassifier(module=_cnn(), **SMALL),
    "regressor": lambda: ExactPathKernelRegressor(hidden_layer_sizes=(8,), **SMALL),
    "distance": lambda: DistanceKernelClassifier(max_iter=3, random_state=0),
    "image-distance": lambda: DistanceKernelClassifier(
        image_shape=(4, 4), max_iter=2, random_state=0
    ),
}


@pytest.fixture(scope="module")
def warmed_up():
    """One fit and decomposition first: the first use of some of torch's modules
    imports them, and the import's frames (which reference the caller's) wait for
    the cycle collector once."""
    ESTIMATORS["mlp-sgd"]().fit(X, y).decompose(X[:2])


@pytest.fixture
def no_cycle_collector(warmed_up):
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_an_estimators_path_is_freed_with_it(name, no_cycle_collector):
    target = X[:, 0] if name == "regressor" else y
    estimator = ESTIMATORS[name]().fit(X, target)
    estimator.predict(X[:3])
    estimator.decompose(X[:2])  # (builds the kernel's caches too)
    path, fitted = weakref.ref(estimator.path_), weakref.ref(estimator)
    del estimator
    assert fitted() is None, "the estimator is in a reference cycle"
    assert path() is None, "the recorded path outlives the estimator"
    _assert_no_garbage()


def test_a_recordings_path_is_freed_with_it(no_cycle_collector):
    X_t = torch.tensor(X)
    y_t = torch.tensor(y)
    torch.manual_seed(0)
    model = _cnn().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    recorder = TrainingRecorder(model, optimizer, X_t, y_t, loss="log_loss")
    model.train()
    for start in (0, 20, 0):
        rows = torch.arange(start, start + 20)
        optimizer.zero_grad()
        out = model(X_t[rows])
        recorder.rows(rows)
        torch.nn.functional.cross_entropy(out, y_t[rows]).backward()
        optimizer.step()
    del out  # (the last step's graph holds the recorder's gradient hook, and so the record)
    model.eval()
    recording = recorder.finish()
    recording.decompose(X_t[:2])
    path, held = weakref.ref(recording.path_), weakref.ref(recorder)
    del recording, recorder
    assert held() is None, "the recorder is in a reference cycle"
    assert path() is None, "the recorded path outlives the recording"
    _assert_no_garbage()


def _assert_no_garbage():
    """Nothing the fit made waits for the cycle collector (the recorder's log holds
    the path's storage: a cycle through it would keep the storage, not the path)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = gc.collect()
        kinds = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert found == 0, f"{found} objects in reference cycles: {kinds}"
