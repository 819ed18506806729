"""Progress moves step by step, within a single block, for every long computation."""

import pytest
import torch

from sklearn_pathkernel._engine import _progress
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._progress import NO_PROGRESS, StepProgress


class Bar:
    """A stand-in for tqdm that records what it was shown."""

    made = []

    def __init__(self, total, desc, unit):
        self.total, self.desc, self.n, self.closed = total, desc, 0, False
        Bar.made.append(self)

    def update(self, n):
        self.n += n

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    import tqdm.auto

    Bar.made = []
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    return Bar.made


@pytest.fixture(scope="module")
def fitted():
    from sklearn.datasets import make_blobs

    from sklearn_pathkernel import ExactPathKernelClassifier

    X, y = make_blobs(n_samples=20, centers=3, n_features=4, random_state=0)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(5,), max_iter=3, batch_size=10, random_state=0
    ).fit(X, y)
    return clf, torch.tensor(X)


@pytest.mark.parametrize("n_jobs", [None, 2])
def test_every_long_computation_moves_over_steps(fitted, bars, n_jobs):
    clf, X = fitted
    engine = PathKernelEngine(clf.module_, clf.path_, clf._fit_X, n_jobs=n_jobs, verbose=1)
    n_steps = clf.path_.n_steps
    assert n_steps == 6
    calls = {
        "training Gram": lambda: engine.gram(X, a_train=True),
        "mixed Gram": lambda: engine.gram(X[:3] + 0.1, X, b_train=True),
        "test Gram": lambda: engine.gram(X[:3] + 0.1),
        "diagonal": lambda: engine.diag(X[:3] + 0.1),
        "decompose": lambda: engine.decompose(X[:3] + 0.1),
        "self-influence": lambda: engine.stepwise().self_influence(),
        "terms": lambda: list(engine.stepwise().terms(X[:3] + 0.1)),
    }
    for name, call in calls.items():
        bars.clear()
        call()
        assert len(bars) == 1, name
        bar = bars[0]
        # One tile of rows: the bar counts the steps of the single block.
        assert bar.total == n_steps, name
        assert bar.n == n_steps, name
        assert bar.closed, name


def test_quiet_by_default_and_not_pickled(fitted, bars):
    import pickle

    clf, X = fitted
    PathKernelEngine(clf.module_, clf.path_, clf._fit_X).decompose(X[:2])
    assert bars == []
    bar = StepProgress(3, "x")
    assert isinstance(pickle.loads(pickle.dumps(bar)), _progress.NoProgress)
    assert list(NO_PROGRESS.over(range(3))) == [0, 1, 2]


def test_the_estimators_verbose_reaches_the_bars(fitted, bars):
    clf, X = fitted
    clf.set_params(verbose=1)
    try:
        clf.decompose(X[:2].numpy())
    finally:
        clf.set_params(verbose=0)
    assert [bar.n for bar in bars if bar.desc.startswith("decompose")] == [6]
