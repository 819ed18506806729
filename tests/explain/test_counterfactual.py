"""Counterfactual attribution through the explanation API: the same tables and
selections as the exact contributions, from the adjoint sweep's scores."""

import numpy as np
import pytest
import torch

from sklearn_pathkernel._engine._adjoint import AdjointSweep
from sklearn_pathkernel._engine._targets import MarginTarget
from sklearn_pathkernel._estimators._explanation_context import estimator_context
from sklearn_pathkernel._explain._counterfactual import (
    CounterfactualAttribution,
    counterfactual_attribution,
)


def test_counterfactual_result(small_classifier):
    clf, X, y = small_classifier
    result = clf.counterfactual(X[:3], y[:3], target="margin")
    assert isinstance(result, CounterfactualAttribution)
    M = X.shape[0]
    assert result.scores.shape == result.loss_weight_scores.shape == (3, M)
    assert result.adjoint_norms.shape == (clf.n_steps_ + 1, 3)
    assert result.growth.shape == (3,) and (result.growth >= 1).all()
    assert result.replay_error < 1e-13 and result.certificate is None
    log_proba = clf.predict_log_proba(X[:3])
    p = np.exp(log_proba[np.arange(3), np.searchsorted(clf.classes_, y[:3])])
    np.testing.assert_allclose(result.values, np.log(p) - np.log1p(-p), rtol=1e-10)
    np.testing.assert_allclose(result.loo_predictions(), result.values[:, None] - result.scores)
    proponents, opponents = result.top(4)
    np.testing.assert_array_equal(proponents, np.argsort(-result.scores, 1, kind="stable")[:, :4])
    assert (result.scores[0, opponents[0]] <= result.scores[0, proponents[0, -1]]).all()


def test_default_column_is_the_prediction(small_classifier):
    clf, X, _ = small_classifier
    result = clf.counterfactual(X[:4])
    predicted = np.searchsorted(clf.classes_, clf.predict(X[:4]))
    np.testing.assert_array_equal(result.columns, predicted)
    np.testing.assert_allclose(
        result.values, clf.predict_log_proba(X[:4])[np.arange(4), predicted], rtol=1e-12
    )
    same = clf.counterfactual(X[:4], output=int(predicted[0]))
    np.testing.assert_allclose(same.scores[0], result.scores[0], rtol=1e-12, atol=1e-16)


def test_explain_ranks_the_counterfactual_scores(small_classifier):
    clf, X, _ = small_classifier
    explanation = clf.explain(X[:2], k=3, method="counterfactual", batch_size=7)
    assert explanation.method == "counterfactual"
    for column in range(len(clf.classes_)):
        scores = clf.counterfactual(X[:2], output=column).scores
        np.testing.assert_array_equal(
            explanation.proponent_indices[:, column],
            np.argsort(-scores, 1, kind="stable")[:, :3],
        )
        np.testing.assert_allclose(
            explanation.opponent_values[:, column], np.sort(scores, 1)[:, :3], rtol=1e-10
        )
    assert np.isnan(explanation.bias).all()
    np.testing.assert_allclose(explanation.output, clf.predict_log_proba(X[:2]), rtol=1e-12)
    assert set(explanation.to_frame().columns) >= {"train_index", "contribution"}


def test_self_influence_is_each_rows_own_score(small_classifier):
    clf, X, y = small_classifier
    found = clf.self_influence(method="counterfactual", batch_size=25)
    codes = np.searchsorted(clf.classes_, y)
    rows = [0, 7, 31]
    for i in rows:
        own = clf.counterfactual(X[i : i + 1], output=int(codes[i])).scores[0, i]
        assert found.scores[i] == pytest.approx(own, rel=1e-10)
        assert found.values[i, codes[i]] == found.scores[i]
    assert np.isnan(found.values[0, (codes[0] + 1) % 10])


def test_regressor_self_influence(small_regressor):
    reg, X = small_regressor
    found = reg.self_influence(method="counterfactual")
    assert found.values.shape == (X.shape[0], 2)
    score = reg.counterfactual(X[3:4], output=1).scores[0, 3]
    assert found.values[3, 1] == pytest.approx(score, rel=1e-10)


def test_leave_one_out_is_first_order(small_classifier):
    """The estimate T - score_i of the target refitted without row i: its error is
    second order, small against the score itself on this small run."""
    from sklearn.base import clone

    clf, X, y = small_classifier
    result = clf.counterfactual(X[:2], output=0)
    for i in (3, 20):
        weights = np.ones(len(y))
        weights[i] = 0
        refit = clone(clf).fit(X, y, sample_weight=weights)
        actual = refit.predict_log_proba(X[:2])[:, 0]
        error = np.abs(result.loo_predictions()[:, i] - actual)
        assert (error < 0.1 * np.abs(result.scores[:, i]) + 1e-6).all()


def test_a_recording_says_what_it_lacks():
    """A recording of a user's own loop does not know its loss, sample weights or
    optimiser's update map: a clear error, not a wrong answer."""
    import torch
    from torch import nn

    from sklearn_pathkernel import TrainingRecorder

    X = torch.randn(12, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = (X[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    for _ in range(2):
        optimizer.zero_grad()
        out = model(X)
        recorder.rows(torch.arange(12))
        torch.nn.functional.cross_entropy(out, y).backward()
        optimizer.step()
    recording = recorder.finish()
    with pytest.raises(ValueError, match="Counterfactual attribution needs the training loss"):
        recording.counterfactual(X[:1])
    with pytest.raises(ValueError, match="Counterfactual attribution needs the training loss"):
        recording.explain(X[:1], k=2, method="counterfactual")


def test_a_network_without_second_derivatives_is_refused():
    """torch has no second derivative of cdist (the distance layers): a clear error."""
    from explain_models import digits

    from sklearn_pathkernel import DistanceKernelClassifier

    X, y = digits(30)
    model = DistanceKernelClassifier(max_iter=1, random_state=0).fit(X, y)
    with pytest.raises(NotImplementedError, match="second derivative of the network.*cdist"):
        model.counterfactual(X[:1])


def test_the_private_horizon_passes_through_and_is_not_certified(small_classifier):
    """``counterfactual_attribution(horizon=...)`` (issue 34's experiment) is the
    sweep's horizon; a horizon's scores are not the run's derivative, so no
    retraining certificate is offered for them."""
    clf, X, y = small_classifier
    context = estimator_context(clf)
    codes = np.searchsorted(clf.classes_, y[:2])
    found = counterfactual_attribution(
        context, context.queries(X[:2]), target="margin", columns=codes, horizon=3
    )
    sweep = AdjointSweep(context.training_run())
    direct = sweep.run_queries(
        context.queries(X[:2]), MarginTarget(), torch.as_tensor(codes), horizon=3
    )
    np.testing.assert_array_equal(found.scores, direct.weight_scores)
    with pytest.raises(ValueError, match="certify"):
        counterfactual_attribution(context, context.queries(X[:1]), horizon=3, certify=1)
