"""Explanations of one scalar target per query (``target=``), at one output's cost.

Each against the decomposition of the same target (``decompose(X, target=...)``,
checked in ``tests/engine/test_targets_decompose.py``), the full influence matrix's
columns, or the counterfactual scores of the same target.
"""

import numpy as np
import pytest
from explain_models import classifier

from sklearn_pathkernel import Explainer


def _top(values, k):
    """(n, M) -> the k largest per row, stable: indices and values."""
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(values, order, axis=1)


@pytest.mark.parametrize("solver", ["sgd-mini", "momentum", "adam"])
@pytest.mark.parametrize("target", ["predicted", "margin", "loss"])
def test_explain_of_a_target_sorts_its_decomposition(solver, target):
    clf, X, y = classifier(solver)
    found = clf.explain(X[:4], k=5, target=target, y=y[:4])
    parts = clf.decompose(X[:4], target=target, y=y[:4])
    assert found.proponent_indices.shape == (4, 1, 5)
    assert found.output_names == (target,)
    indices, values = _top(parts.contributions, 5)
    np.testing.assert_array_equal(found.proponent_indices[:, 0], indices)
    np.testing.assert_allclose(found.proponent_values[:, 0], values, rtol=0, atol=1e-15)
    # (the explanation's output is the engine's; decompose's the module's own forward)
    np.testing.assert_allclose(found.output[:, 0], parts.output, rtol=0, atol=1e-11)
    # (Adam's contributions here reach |c| ~ 1e5 and cancel: rounding ~1e-16 of their
    # sum; the full K-output decomposition of these rows misses by up to 2e-11)
    np.testing.assert_allclose(found.bias[:, 0] + found.total[:, 0] + found.decay[:, 0],
                               found.output[:, 0], rtol=0, atol=1e-11)  # fmt: skip


@pytest.mark.parametrize("solver", ["sgd-mini", "momentum"])
def test_explain_of_a_target_asks_one_output_per_query(solver, monkeypatch):
    """The test copy ``explain(X, target="predicted")`` integrates holds one output
    (the target's cotangent) for every query row and step, against ``K`` without a
    target, the same rows and steps."""
    from sklearn_pathkernel._engine._test_copy import TestCopy

    clf, X, _ = classifier(solver)
    asked = []
    integrate = TestCopy.integrate

    def counted(test_copy, index, rows, **options):
        asked.append((test_copy.n_outputs, options.get("outputs_per_pair", 1), rows.shape[0]))
        return integrate(test_copy, index, rows, **options)

    monkeypatch.setattr(TestCopy, "integrate", counted)
    clf.explain(X[:5], k=3, target="predicted")
    assert asked and {(n, per_pair) for n, per_pair, _ in asked} == {(1, 1)}
    rows = sum(n_rows for _, _, n_rows in asked)
    assert rows == 5 * clf.n_steps_
    asked.clear()
    clf.explain(X[:5], k=3)
    K = len(clf.classes_)
    assert {(n, per_pair) for n, per_pair, _ in asked} == {(K, K)}
    assert sum(n_rows for _, _, n_rows in asked) == rows


def test_influence_matrix_columns_are_the_full_matrix_columns():
    clf, X, y = classifier("momentum")
    columns = np.array([3, 0, 7, 1, 9])
    picked = clf.influence_matrix(X[:5], columns=columns)
    full = clf.influence_matrix(X[:5])
    assert picked.shape == (5, X.shape[0])
    np.testing.assert_allclose(picked, full[np.arange(5), :, columns], rtol=0, atol=1e-12)
    normalized = clf.influence_matrix(X[:5], columns=columns, normalize=True)
    full_normalized = clf.influence_matrix(X[:5], normalize=True)
    np.testing.assert_allclose(
        normalized, full_normalized[np.arange(5), :, columns], rtol=0, atol=1e-12
    )
    margin = clf.influence_matrix(X[:5], target="margin", y=y[:5])
    np.testing.assert_allclose(
        margin, clf.decompose(X[:5], target="margin", y=y[:5]).contributions, atol=1e-15
    )
    with pytest.raises(ValueError, match="columns or target"):
        clf.influence_matrix(X[:5], columns=columns, target="margin", y=y[:5])


def test_counterfactual_scores_of_a_target_are_its_counterfactual():
    clf, X, y = classifier("sgd-mini")
    explainer = Explainer(clf, method="counterfactual")
    scores = explainer.influence_matrix(X[:3], target="margin", y=y[:3])
    expected = explainer.counterfactual(X[:3], y[:3], target="margin").scores
    np.testing.assert_allclose(scores, expected, rtol=1e-12, atol=1e-15)
    explained = explainer.explain(X[:3], k=4, target="margin", y=y[:3])
    np.testing.assert_array_equal(explained.proponent_indices[:, 0], _top(expected, 4)[0])


def test_counterfactual_predicted_target_is_the_output_of_the_prediction():
    clf, X, y = classifier("sgd-mini")
    predicted = clf.counterfactual(X[:3], y[:3], target="predicted")
    expected = clf.counterfactual(X[:3], target="output")  # (without y: the prediction)
    np.testing.assert_array_equal(predicted.scores, expected.scores)
    np.testing.assert_array_equal(
        predicted.columns, np.searchsorted(clf.classes_, clf.predict(X[:3]))
    )
