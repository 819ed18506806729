"""Explanations leave the estimator as it was: picklable, nothing cached on it."""

import gc
import pickle
import weakref

import numpy as np
from explain_models import classifier

from sklearn_pathkernel._explain import _scoring


def test_pickle_after_explaining():
    clf, X, _ = classifier("sgd-mini", n=30)
    before = set(vars(clf))
    first = clf.explain(X[:2], k=3, normalize=True)
    assert set(vars(clf)) - before <= {"_kernel_cache"}
    again = pickle.loads(pickle.dumps(clf)).explain(X[:2], k=3, normalize=True)
    np.testing.assert_array_equal(again.proponent_indices, first.proponent_indices)
    np.testing.assert_allclose(again.proponent_values, first.proponent_values, rtol=1e-12)


def test_the_norms_go_with_their_engine():
    clf, X, _ = classifier("sgd-mini", n=30)
    clf.explain(X[:1], k=2, normalize=True)
    engine = weakref.ref(clf._engine())
    assert engine() in _scoring._NORMS
    held = len(_scoring._NORMS)
    clf.__dict__.pop("_kernel_cache")  # what set_params or a new fit does
    gc.collect()
    assert engine() is None
    assert len(_scoring._NORMS) == held - 1
