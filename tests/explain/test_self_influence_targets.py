"""Self-influence of a scalar target per training row: one output's work.

Independent computations: ``decompose(X_train)`` (every output, then its label
column), ``decompose(X_train, target=..., y=y_train)`` and ``counterfactual``
(their diagonals), the default self-influence's scores, and the engine's calls
counted on the test copy.
"""

import numpy as np
import pytest

from sklearn_pathkernel import Explainer
from sklearn_pathkernel._engine._test_copy import TestCopy


def diagonal(contributions):
    rows = np.arange(contributions.shape[0])
    return contributions[rows, rows]


def assert_exact(found, expected, tol=1e-12):
    scale = max(np.abs(expected).max(), 1.0)
    np.testing.assert_allclose(found, expected, rtol=0, atol=tol * scale)


def test_output_target_is_the_label_column_of_decompose(fitted):
    """Every update rule (plain SGD full batch and mini-batches, momentum, Nesterov
    with weight decay, Adam, AdamW): the label column of the full diagonal."""
    clf, X, y = fitted
    codes = np.searchsorted(clf.classes_, y)
    expected = diagonal(clf.decompose(X).contributions)[np.arange(len(y)), codes]
    found = clf.self_influence(target="output")
    assert found.values.shape == (len(y), 1) and found.output_names == ("output",)
    assert_exact(found.values[:, 0], expected)
    # the scores a classifier ranks by are the same as the default's (which read
    # this column of K computed outputs)
    np.testing.assert_array_equal(found.scores, found.values[:, 0])
    assert_exact(found.scores, clf.self_influence().scores)


@pytest.mark.parametrize("target", ["margin", "loss"])
def test_margin_and_loss_are_the_diagonal_of_their_decomposition(fitted, target):
    clf, X, y = fitted
    expected = diagonal(clf.decompose(X, target=target, y=y).contributions)
    found = clf.self_influence(target=target)
    assert found.output_names == (target,)
    assert_exact(found.values[:, 0], expected)
    # the loss falls as a point is fitted: its score is the loss's fall
    sign = -1.0 if target == "loss" else 1.0
    np.testing.assert_array_equal(found.scores, sign * found.values[:, 0])


def test_predicted_and_output_indices(small_classifier):
    clf, X, y = small_classifier
    full = diagonal(clf.decompose(X).contributions)
    predicted = np.argmax(clf.decompose(X).output, axis=1)
    found = clf.self_influence(target="predicted")
    assert found.output_names == ("predicted",)
    assert_exact(found.values[:, 0], full[np.arange(len(y)), predicted])
    columns = (np.arange(len(y)) * 7) % len(clf.classes_)
    found = clf.self_influence(target=columns)
    assert_exact(found.values[:, 0], full[np.arange(len(y)), columns])


@pytest.mark.parametrize("solver", ["sgd-mini", "momentum", "adam"])
def test_first_epoch_on_both_routes(solver):
    from explain_models import classifier

    clf, X, y = classifier(solver)
    codes = np.searchsorted(clf.classes_, y)
    for first in range(clf.n_iter_):
        every = clf.self_influence(first_epoch=first).values[np.arange(len(y)), codes]
        found = clf.self_influence(first_epoch=first, target="output").values[:, 0]
        assert_exact(found, every)


@pytest.mark.parametrize("solver", ["sgd-mini", "momentum"])
def test_the_engine_is_asked_for_one_output_per_row(solver, monkeypatch):
    """Every test copy the self-influence integrates holds one output (the target's
    cotangent), on the per-step and the accumulated route alike; without a target
    it holds the K outputs."""
    from explain_models import classifier

    clf, _, _ = classifier(solver)
    asked = []
    integrate = TestCopy.integrate

    def counted(test_copy, index, X, **options):
        asked.append((test_copy.n_outputs, options.get("outputs_per_pair", 1), X.shape[0]))
        return integrate(test_copy, index, X, **options)

    monkeypatch.setattr(TestCopy, "integrate", counted)
    clf.self_influence(target="output")
    assert asked and {(n, per_pair) for n, per_pair, _ in asked} == {(1, 1)}
    rows = sum(n_rows for _, _, n_rows in asked)
    asked.clear()
    clf.self_influence()
    K = len(clf.classes_)
    assert {(n, per_pair) for n, per_pair, _ in asked} == {(K, K)}
    assert sum(n_rows for _, _, n_rows in asked) == rows  # the same rows and steps


def test_normalized_scalar_target(small_classifier):
    clf, X, y = small_classifier
    plain = clf.self_influence(target="output")
    normalized = Explainer(clf, normalize=True).self_influence(target="output")
    norms = np.sqrt(np.clip(clf._engine().diag(clf._engine().X_train, a_train=True), 0, None))
    np.testing.assert_allclose(normalized.values[:, 0], plain.values[:, 0] / norms, rtol=1e-10)
    np.testing.assert_allclose(normalized.scores, normalized.values[:, 0], rtol=1e-12)


def test_counterfactual_scalar_target(small_classifier):
    """The counterfactual's own-label scores (the default already sweeps one adjoint
    vector per row) and the margin's, against ``counterfactual`` of the rows."""
    clf, X, y = small_classifier
    default = clf.self_influence(method="counterfactual")
    found = clf.self_influence(method="counterfactual", target="output")
    assert found.values.shape == (len(y), 1)
    assert_exact(found.scores, default.scores)
    margin = clf.self_influence(method="counterfactual", target="margin")
    expected = np.diagonal(clf.counterfactual(X, y, target="margin").scores)
    assert_exact(margin.values[:, 0], expected)


def test_regressor_targets(small_regressor):
    reg, X = small_regressor
    expected = diagonal(reg.decompose(X, target="output").contributions)
    found = reg.self_influence(target="output")
    assert_exact(found.values[:, 0], expected)
    assert_exact(found.values[:, 0], reg.self_influence().values[:, 0])
    np.testing.assert_array_equal(found.scores, np.abs(found.values[:, 0]))
    with pytest.raises(ValueError, match="target='margin' needs classes"):
        reg.self_influence(target="margin")


def test_bad_targets(small_classifier):
    clf, X, _ = small_classifier
    with pytest.raises(ValueError, match="target must be one of"):
        clf.self_influence(target="largest")
    with pytest.raises(ValueError, match=str(len(X))):
        clf.self_influence(target=np.zeros(3, dtype=int))
