"""The learned kernel: Gram matrices by network, and the engine against the paper's
Algorithm 1 (materialised per-example Jacobians, left Riemann sum with T=100)."""

import os
import sys
import time

import numpy as np
import torch

from sklearn_pathkernel import DistanceKernelClassifier, ExactPathKernelClassifier

from .common import ColdCalls, DigitsCNN, Smooth, digits, digits_images, fresh, paper_toy


def _networks():
    """The fitted estimators of :class:`Gram`, with their training and query rows."""
    X, y, Q, _ = digits(400, 50)
    Xi, yi, Qi, _ = digits_images(400, 50)
    return {
        "mlp-sgd": (
            ExactPathKernelClassifier(hidden_layer_sizes=(64,), max_iter=20, random_state=0),
            X,
            y,
            Q,
        ),
        "mlp-adam": (
            ExactPathKernelClassifier(
                hidden_layer_sizes=(64,),
                solver="adam",
                learning_rate=1e-3,
                max_iter=10,
                batch_size=100,
                random_state=0,
            ),
            X,
            y,
            Q,
        ),
        "cnn-sgd": (
            ExactPathKernelClassifier(
                module=DigitsCNN(), learning_rate=0.1, max_iter=20, random_state=0
            ),
            Xi,
            yi,
            Qi,
        ),
        "distance": (DistanceKernelClassifier(max_iter=20, random_state=0), X, y, Q),
        "fallback": (
            ExactPathKernelClassifier(module=Smooth(64, 10), max_iter=20, random_state=0),
            X,
            y,
            Q,
        ),
    }


class Gram(ColdCalls):
    """Training Gram (M x M, both sides on the training copy) and cross Gram
    (queries x M, the queries on the test copy) of ``kernel_``, and ``decompose``
    of 10 queries, M=400 digits and 50 queries: MLP 64-64-10 with 20 full-batch SGD
    steps and with 10 Adam steps in batches of 100; a CNN on the 8x8 images; the
    distance network; an MLP with a SiLU gate (the generic torch.func fallback);
    20 full-batch steps each. Every timed call starts cold (:class:`ColdCalls`)."""

    params = ["mlp-sgd", "mlp-adam", "cnn-sgd", "distance", "fallback"]
    param_names = ["network"]
    timeout = 900

    def setup_cache(self):
        return {
            name: (estimator.fit(X, y), X, Q) for name, (estimator, X, y, Q) in _networks().items()
        }

    def setup(self, cache, network):
        clf, self.X, self.Q = cache[network]
        self.clf = fresh(clf)  # (its own kernel cache, empty)

    def time_training_gram(self, cache, network):
        self.clf.kernel_(self.X)

    def peakmem_training_gram(self, cache, network):
        self.clf.kernel_(self.X)

    def time_cross_gram(self, cache, network):
        self.clf.kernel_(self.Q, self.X)

    def peakmem_cross_gram(self, cache, network):
        self.clf.kernel_(self.Q, self.X)

    def time_decompose(self, cache, network):
        self.clf.decompose(self.Q[:10])


def _algorithm1(clf, X):
    """The paper's Algorithm 1 on a fitted estimator: the brute-force reference
    the package's tests check the engine against (``tests/_reference.py``)."""
    tests = os.path.join(os.path.dirname(__file__), "..", "..", "tests")
    if tests not in sys.path:
        sys.path.insert(0, os.path.abspath(tests))
    from _reference import NaivePathKernelEngine

    module = clf.module_.to(torch.float64)
    return NaivePathKernelEngine(
        module, clf.path_, torch.as_tensor(X), quadrature="riemann", n_points=100
    )


class VsAlgorithm1:
    """The engine against Algorithm 1 on the paper's toy at a small size (M=120, 20
    queries, 10 full-batch steps): each ``track_speedup_*`` times both in one call
    (the median of 3) and returns Algorithm 1's time over the engine's;
    ``track_max_difference`` is the largest difference between the two training
    Grams (the training copy needs no quadrature, so they must agree to rounding)."""

    timeout = 900

    def setup_cache(self):
        X, y, Q = paper_toy(n_train=120, n_queries=20)
        clf = ExactPathKernelClassifier(
            hidden_layer_sizes=(64,), learning_rate=0.05, max_iter=10, random_state=0
        ).fit(X, y)
        return clf, X, Q

    def setup(self, cache):
        clf, self.X, self.Q = cache
        self.clf = clf
        self.reference = _algorithm1(clf, self.X)
        self.X_t, self.Q_t = torch.as_tensor(self.X), torch.as_tensor(self.Q)

    @staticmethod
    def _median_time(fn, repeats=3):
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        return float(np.median(times))

    def track_speedup_training_gram(self, cache):
        fast = self._median_time(lambda: fresh(self.clf).kernel_(self.X))
        naive = self._median_time(lambda: self.reference.gram(self.X_t, a_train=True))
        return naive / fast

    def track_speedup_cross_gram(self, cache):
        fast = self._median_time(lambda: fresh(self.clf).kernel_(self.Q, self.X))
        naive = self._median_time(
            lambda: self.reference.gram(self.Q_t, self.X_t, a_train=False, b_train=True)
        )
        return naive / fast

    def track_speedup_decompose(self, cache):
        fast = self._median_time(lambda: self.clf.decompose(self.Q))
        naive = self._median_time(lambda: self.reference.decompose(self.Q_t))
        return naive / fast

    def track_max_difference(self, cache):
        ours = fresh(self.clf).kernel_(self.X)
        reference = self.reference.gram(self.X_t, a_train=True)
        reference = reference.detach().cpu().numpy() if torch.is_tensor(reference) else reference
        return float(np.abs(ours - np.asarray(reference)).max() / np.abs(ours).max())

    track_speedup_training_gram.unit = "ratio"
    track_speedup_cross_gram.unit = "ratio"
    track_speedup_decompose.unit = "ratio"
    track_max_difference.unit = "relative"
