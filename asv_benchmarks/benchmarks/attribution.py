"""Attribution quality, tracked: the linear datamodeling score (LDS) of the exact
decomposition and of the counterfactual on a small task.

Digits (M=300 rows in [0, 1], 50 test points), MLP 64-32-10, trained by full-batch
gradient descent (lr 0.5, 30 steps) or by Adam in batches of 50 (lr 1e-2, 5 epochs:
30 steps; the adaptive optimisers are the attributions' hard case). The ground
truth is same-seed retraining on 20 random halves of the training rows (each row's
sample weight 1 or 0: the same initial weights and steps, other data); the LDS is,
per test point, the Spearman
correlation over the halves between the summed scores of the kept rows and the
retrained model's margin ``log p_y - log(1 - p_y)``, averaged over test points.
The field-scale comparison against TRAK, TracIn and influence functions is
``python benchmarks/run.py attribution`` and ``python benchmarks/run.py field``.
"""

import numpy as np
from scipy.stats import spearmanr
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from sklearn_pathkernel import ExactPathKernelClassifier

SETTINGS = {
    "gd": {"hidden_layer_sizes": (32,), "learning_rate": 0.5, "max_iter": 30},
    "adam": {
        "hidden_layer_sizes": (32,),
        "solver": "adam",
        "learning_rate": 1e-2,
        "batch_size": 50,
        "max_iter": 5,
    },
}
N_SUBSETS = 20


def _margins(clf, X, y):
    log_proba = clf.predict_log_proba(X)
    logp = log_proba[np.arange(len(y)), np.searchsorted(clf.classes_, y)]
    return logp - np.log(-np.expm1(np.minimum(logp, -1e-16)))


class DigitsLDS:
    """Same-seed LDS over 20 retrained halves (see the module's docstring)."""

    params = (list(SETTINGS), ["decomposition", "counterfactual"])
    param_names = ["training", "method"]
    timeout = 900

    def setup_cache(self):
        return {training: self._task(settings) for training, settings in SETTINGS.items()}

    @staticmethod
    def _task(settings):
        X, y = load_digits(return_X_y=True)
        X_train, X_test, y_train, y_test = train_test_split(
            X / 16.0, y, train_size=300, test_size=50, stratify=y, random_state=0
        )
        clf = ExactPathKernelClassifier(random_state=0, **settings).fit(X_train, y_train)
        rng = np.random.RandomState(0)
        subsets = [
            np.sort(rng.choice(len(y_train), len(y_train) // 2, replace=False))
            for _ in range(N_SUBSETS)
        ]
        truth = []
        for rows in subsets:
            weight = np.zeros(len(y_train))
            weight[rows] = 1.0
            retrained = ExactPathKernelClassifier(random_state=0, **settings).fit(
                X_train, y_train, sample_weight=weight
            )
            truth.append(_margins(retrained, X_test, y_test))
        return clf, X_test, y_test, subsets, np.stack(truth)

    def track_lds(self, cache, training, method):
        clf, X_test, y_test, subsets, truth = cache[training]
        if method == "decomposition":
            parts = clf.decompose(X_test, target="margin", y=y_test)
            scores = parts.contributions.reshape(len(y_test), -1)
        else:
            scores = clf.counterfactual(X_test, y_test, target="margin").scores
        predicted = np.stack([scores[:, rows].sum(axis=1) for rows in subsets])
        correlations = [
            spearmanr(predicted[:, j], truth[:, j]).statistic for j in range(len(y_test))
        ]
        return float(np.nanmean(correlations))

    track_lds.unit = "Spearman correlation"

    def time_scores(self, cache, training, method):
        clf, X_test, y_test, _, _ = cache[training]
        if method == "decomposition":
            clf.decompose(X_test, target="margin", y=y_test)
        else:
            clf.counterfactual(X_test, y_test, target="margin")
