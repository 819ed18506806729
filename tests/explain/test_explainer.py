"""The explanations as one object: ``Explainer`` built from a fitted model, its options
the same on every method, the path norms computed once, the attribution over time
streamed, and a new attribution as one class plus its registration.

Independent computations: ``decompose`` (the contributions the explanations rank and
sum), the training Gram's diagonal by ``gram`` (the path norms, against ``diag``).
"""

import numpy as np
import pytest

from sklearn_pathkernel import Explainer
from sklearn_pathkernel._explain._attributions import (
    ATTRIBUTIONS,
    Attribution,
    ScoreTile,
    register_attribution,
)


@pytest.fixture(scope="module")
def model(small_classifier):
    clf, X, y = small_classifier
    engine = clf._engine()
    norms = np.sqrt(np.diag(engine.gram(engine.X_train, a_train=True)))
    return clf, X, y, norms


def test_the_one_line_methods_are_the_explainers(model):
    clf, X, _, _ = model
    by_object = Explainer(clf, normalize=True, batch_size=3).explain(X[:5], k=4)
    by_method = clf.explain(X[:5], k=4, normalize=True, batch_size=3)
    np.testing.assert_array_equal(by_object.proponent_indices, by_method.proponent_indices)
    np.testing.assert_array_equal(by_object.opponent_values, by_method.opponent_values)


def test_normalize_is_the_same_option_on_every_method(model):
    clf, X, y, norms = model
    explainer = Explainer(clf, normalize=True, batch_size=2)
    contributions = clf.decompose(X[:4]).contributions
    expected = contributions / norms[None, :, None]
    np.testing.assert_allclose(explainer.influence_matrix(X[:4]), expected, rtol=1e-10)
    codes = np.searchsorted(clf.classes_, y)
    by_class = np.stack([expected[:, codes == c].sum(axis=1) for c in range(len(clf.classes_))], 1)
    np.testing.assert_allclose(explainer.class_contributions(X[:4]), by_class, rtol=1e-10)
    plain = clf.self_influence()
    normalized = explainer.self_influence()
    np.testing.assert_allclose(normalized.values, plain.values / norms[:, None], rtol=1e-10)
    np.testing.assert_allclose(normalized.scores, normalized.values[np.arange(len(y)), codes])
    over_time = explainer.explain_over_time(X[:3])
    np.testing.assert_allclose(over_time.values.sum(axis=1), expected[:3], rtol=1e-9, atol=1e-14)


def test_the_path_norms_are_computed_once(model, monkeypatch):
    clf, X, _, _ = model
    engine = clf._engine()
    calls = []
    diag = type(engine).diag
    monkeypatch.setattr(type(engine), "diag", lambda *a, **k: calls.append(1) or diag(*a, **k))
    from sklearn_pathkernel._explain import _scoring

    monkeypatch.setattr(_scoring, "_NORMS", type(_scoring._NORMS)())  # forget earlier runs
    explainer = Explainer(clf, normalize=True)
    explainer.explain(X[:2], k=2)
    explainer.influence_matrix(X[:2])
    clf.self_influence(normalize=True)
    assert len(calls) == 1


def test_the_attribution_over_time_streams_one_output_per_query(model, tmp_path):
    clf, X, _, _ = model
    columns = np.array([0, 2, 1, 0, 3])
    full = clf.explain_over_time(X[:5], period="step")
    picked = clf.explain_over_time(
        X[:5], period="step", columns=columns, batch_size=2, filename=tmp_path / "t.npy"
    )
    assert isinstance(picked.values, np.memmap) and picked.values.shape[-1] == 1
    expected = np.take_along_axis(full.values, columns[:, None, None, None], axis=3)
    np.testing.assert_allclose(picked.values, expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.load(tmp_path / "t.npy"), expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(picked.columns, columns)
    contributions = clf.decompose(X[:5]).contributions
    np.testing.assert_allclose(
        picked.values.sum(axis=1)[..., 0],
        np.take_along_axis(contributions, columns[:, None, None], axis=2)[..., 0],
        rtol=1e-9,
        atol=1e-14,
    )


def test_options_are_checked_once_and_named(model):
    clf, X, _, _ = model
    with pytest.raises(ValueError, match="method must be one of"):
        Explainer(clf, method="tracin")
    with pytest.raises(ValueError, match="normalize=True is for method='contributions'"):
        Explainer(clf, method="counterfactual", normalize=True)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        Explainer(clf, batch_size=0)
    with pytest.raises(ValueError, match="explain_over_time is for method='contributions'"):
        Explainer(clf, method="counterfactual").explain_over_time(X[:1])
    with pytest.raises(ValueError, match="columns must be 2 integer output indices"):
        clf.explain_over_time(X[:2], columns=[0])


# -- a new attribution is one class and its registration -------------------------------


class Doubled(Attribution):
    """A toy attribution: twice the contributions (a user's own, as the recipe says)."""

    decomposes = True

    def tile(self, context, queries):
        parts = context.engine.decompose(queries)
        return ScoreTile(2 * parts.contributions, parts.output, parts.bias, parts.decay)

    def self_influence(self, context, first_epoch, batch_size):
        raise NotImplementedError


@pytest.fixture
def doubled():
    saved = dict(ATTRIBUTIONS)
    yield register_attribution("doubled")(Doubled)  # the one registration
    ATTRIBUTIONS.clear()
    ATTRIBUTIONS.update(saved)


def test_a_new_attribution_reaches_every_explanation(model, doubled):
    clf, X, y, _ = model
    contributions = clf.decompose(X[:3]).contributions
    matrix = clf.influence_matrix(X[:3], method="doubled")
    np.testing.assert_allclose(matrix, 2 * contributions, rtol=1e-12)
    explanation = clf.explain(X[:3], k=2, method="doubled")
    assert explanation.method == "doubled"
    np.testing.assert_allclose(
        explanation.proponent_values, 2 * clf.explain(X[:3], k=2).proponent_values, rtol=1e-12
    )
    per_class = Explainer(clf, method=Doubled()).class_contributions(X[:3])
    np.testing.assert_allclose(per_class, 2 * clf.class_contributions(X[:3]), rtol=1e-12)
