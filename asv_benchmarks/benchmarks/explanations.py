"""Explanations of a fitted classifier: top-k tables, self-influence, scalar targets.

Digits (M=400, standardised), MLP 64-64-10, Adam in batches of 100, 20 steps.
"""

from sklearn_pathkernel import ExactPathKernelClassifier

from .common import ColdCalls, digits, fresh

TARGETS = [None, "predicted", "margin"]


class Explain(ColdCalls):
    """``explain(k=10)`` of 50 queries; ``self_influence(target="output")`` of the
    400 rows (each row's own class: one output's work). Every timed call starts
    cold (:class:`ColdCalls`)."""

    timeout = 600

    def setup_cache(self):
        X, y, Q, yq = digits(400, 50)
        clf = ExactPathKernelClassifier(
            hidden_layer_sizes=(64,),
            solver="adam",
            learning_rate=1e-3,
            max_iter=20,
            batch_size=100,
            random_state=0,
        ).fit(X, y)
        return clf, Q, yq

    def setup(self, cache):
        clf, self.Q, self.yq = cache
        self.clf = fresh(clf)

    def time_explain(self, cache):
        self.clf.explain(self.Q, k=10)

    def time_self_influence(self, cache):
        self.clf.self_influence(target="output")

    def peakmem_explain(self, cache):
        self.clf.explain(self.Q, k=10)


class ScalarTargets(ColdCalls):
    """``decompose`` of 20 queries, every output against one scalar target each."""

    params = [["all outputs", "predicted", "margin"]]
    param_names = ["target"]
    timeout = 600

    def setup_cache(self):
        return Explain.setup_cache(self)

    def setup(self, cache, target):
        clf, Q, yq = cache
        self.clf, self.Q, self.yq = fresh(clf), Q[:20], yq[:20]
        self.target = None if target == "all outputs" else target

    def time_decompose(self, cache, target):
        if self.target is None:
            self.clf.decompose(self.Q)
        else:
            self.clf.decompose(self.Q, target=self.target, y=self.yq)
