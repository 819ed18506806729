"""Self-influence: the diagonal of the training rows' decomposition, linear in M."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score


def diagonal(clf, X):
    contributions = clf.decompose(X).contributions
    return contributions[np.arange(len(X)), np.arange(len(X))]


def test_equals_the_diagonal_of_decompose(fitted):
    clf, X, y = fitted
    result = clf.self_influence()
    expected = diagonal(clf, X)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(result.values, expected, rtol=0, atol=1e-10 * max(scale, 1.0))
    # the classifier's score is the entry at its own label
    codes = np.searchsorted(clf.classes_, y)
    np.testing.assert_array_equal(result.scores, result.values[np.arange(len(y)), codes])


def test_regressor_scores_sum_absolute_outputs(small_regressor):
    reg, X = small_regressor
    result = reg.self_influence()
    expected = diagonal(reg, X)
    np.testing.assert_allclose(result.values, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(result.scores, np.abs(expected).sum(axis=1))


def test_plain_sgd_integrates_only_the_batch_steps(small_classifier, monkeypatch):
    """Linear in M: each point's test copy is taken only at the steps that held it."""
    clf, X, _ = small_classifier
    stepwise = clf._engine().stepwise()
    rows = []
    original = stepwise._scaled_features

    def counting(index, Xs, with_rows=None, targets=None):
        rows.append(Xs.shape[0])
        return original(index, Xs, with_rows, targets)

    monkeypatch.setattr(stepwise, "_scaled_features", counting)
    stepwise.self_influence()
    assert sum(rows) == sum(len(b) for b in clf.path_.batches) == len(X) * clf.n_iter_


def test_detection_metrics_against_brute_force(small_classifier):
    clf, X, _ = small_classifier
    result = clf.self_influence()
    flagged = np.zeros(len(X), dtype=bool)
    flagged[[1, 5, 7, 30]] = True
    assert result.auc(flagged) == pytest.approx(roc_auc_score(flagged, result.scores))
    order = np.argsort(-result.scores)
    top = order[: int(0.2 * len(X))]
    assert result.found_at(flagged, 0.2) == pytest.approx(flagged[top].sum() / flagged.sum())
    inspected, found = result.detection_curve(flagged)
    assert inspected[0] == found[0] == 0 and found[-1] == 1.0 and inspected[-1] == 1.0
    frame = result.to_frame()
    np.testing.assert_array_equal(frame["train_index"], result.ranking())
    assert list(frame.columns[:3]) == ["train_index", "score", "target"]


def test_flagged_must_be_a_mask(small_classifier):
    clf, X, _ = small_classifier
    result = clf.self_influence()
    with pytest.raises(ValueError, match="boolean mask of the 60"):
        result.auc(np.arange(len(X)))
    with pytest.raises(ValueError, match="marks no training point"):
        result.auc(np.zeros(len(X), dtype=bool))


def test_late_epochs_are_the_diagonal_of_the_attribution_over_time(fitted):
    clf, X, _ = fitted
    over_time = clf.explain_over_time(X, period="epoch").values  # (M, E, M, K)
    for first in range(clf.n_iter_):
        late = over_time[:, first:].sum(axis=1)
        expected = late[np.arange(len(X)), np.arange(len(X))]
        result = clf.self_influence(first_epoch=first).values
        scale = max(np.abs(expected).max(), 1.0)
        np.testing.assert_allclose(result, expected, rtol=0, atol=1e-10 * scale)


def test_first_epoch_out_of_range(small_classifier):
    clf, _, _ = small_classifier
    with pytest.raises(ValueError, match="first_epoch=3 is out of range: the run has 3 epochs"):
        clf.self_influence(first_epoch=3)
    with pytest.raises(TypeError, match="first_epoch must be an int"):
        clf.self_influence(first_epoch=1.0)
