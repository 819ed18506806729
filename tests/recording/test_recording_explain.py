"""The explanation API on a recording of a user's own loop.

Independent computations: the recording's own ``decompose`` (brute-force sorts
and diagonals of its contributions), and the recorded batches (epochs).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import TrainingRecorder


def brute_force(values, k):
    """(n, M, K) -> indices and values of the k largest per (n, K), stable."""
    order = np.argsort(-np.moveaxis(values, 1, -1), axis=-1, kind="stable")[..., :k]
    return order, np.take_along_axis(np.moveaxis(values, 1, -1), order, -1)


def record(optimizer_of, y_of, *, epochs=3, batch_size=8, n_outputs=3, loss=None):
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(24, 4, generator=generator, dtype=torch.float64)
    y = y_of(X)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, n_outputs)).double()
    optimizer = optimizer_of(model.parameters())
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    loss = loss or F.cross_entropy
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=generator)
        for start in range(0, X.shape[0], batch_size):
            rows = order[start : start + batch_size]
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            loss(out, y[rows]).backward()
            optimizer.step()
    return recorder.finish(), X, y


def labels(X):
    return (X[:, 0] > 0).long() + (X[:, 1] > 0.3).long()


@pytest.fixture(scope="module")
def classifier_recording():
    return record(lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.5), labels)


@pytest.mark.parametrize("k", [1, 5])
def test_explain_equals_a_sort_of_decompose(classifier_recording, k):
    recording, X, y = classifier_recording
    queries = X[:5] + 0.05
    contributions = recording.decompose(queries).contributions
    result = recording.explain(queries, k=k)
    order, values = brute_force(contributions, k)
    np.testing.assert_array_equal(result.proponent_indices, order)
    np.testing.assert_array_equal(result.proponent_values, values)
    order, values = brute_force(-contributions, k)
    np.testing.assert_array_equal(result.opponent_indices, order)
    np.testing.assert_array_equal(result.opponent_values, -values)
    np.testing.assert_array_equal(result.proponent_targets, y.numpy()[result.proponent_indices])
    assert result.output_names == ("0", "1", "2")
    output = recording.decompose(queries).output
    np.testing.assert_array_equal(result.predicted, np.argmax(output, axis=1))


def test_self_influence_is_the_diagonal_of_decompose(classifier_recording):
    recording, X, y = classifier_recording
    result = recording.self_influence()
    contributions = recording.decompose(X).contributions
    expected = contributions[np.arange(len(X)), np.arange(len(X))]
    scale = max(np.abs(expected).max(), 1.0)
    np.testing.assert_allclose(result.values, expected, rtol=0, atol=1e-10 * scale)
    # a classifier's score is the entry at the point's own label (output index)
    np.testing.assert_array_equal(result.scores, result.values[np.arange(len(y)), y.numpy()])


def test_self_influence_of_a_scalar_target(classifier_recording):
    """One output per row: the label column of the full diagonal, the margin's and
    (the recording stating no loss) a clear refusal of the loss."""
    recording, X, y = classifier_recording
    M = len(X)
    contributions = recording.decompose(X).contributions
    expected = contributions[np.arange(M), np.arange(M), y.numpy()]
    found = recording.self_influence(target="output")
    scale = max(np.abs(expected).max(), 1.0)
    assert found.values.shape == (M, 1)
    np.testing.assert_allclose(found.values[:, 0], expected, rtol=0, atol=1e-12 * scale)
    np.testing.assert_array_equal(found.scores, found.values[:, 0])
    margin = recording.decompose(X, target="margin", y=y.numpy()).contributions
    found = recording.self_influence(target="margin", first_epoch=0)
    np.testing.assert_allclose(
        found.values[:, 0], margin[np.arange(M), np.arange(M)], rtol=0, atol=1e-12 * scale
    )
    with pytest.raises(ValueError, match="target='loss' needs the training loss"):
        recording.self_influence(target="loss")


def test_over_time_class_contributions_and_influence_matrix(classifier_recording):
    recording, X, y = classifier_recording
    queries = X[:3] - 0.1
    contributions = recording.decompose(queries).contributions
    # a new epoch where a row is used again: 24 rows in batches of 8 -> 3 steps an epoch
    np.testing.assert_array_equal(recording.epochs_, np.repeat(np.arange(3), 3))
    over_time = recording.explain_over_time(queries)
    assert over_time.values.shape[1] == 3
    np.testing.assert_allclose(over_time.values.sum(axis=1), contributions, rtol=0, atol=1e-12)
    by_class = recording.class_contributions(queries)
    expected = np.stack([contributions[:, y.numpy() == c].sum(axis=1) for c in range(3)], 1)
    np.testing.assert_allclose(by_class, expected, rtol=0, atol=1e-12)
    matrix = recording.influence_matrix(queries)
    np.testing.assert_allclose(matrix, contributions, rtol=0, atol=1e-12)


def test_regression_recording_has_no_classes():
    def values(X):
        return torch.stack([X[:, 0] * X[:, 1], X[:, 2]], 1)

    recording, X, y = record(
        lambda p: torch.optim.Adam(p, lr=0.02), values, n_outputs=2, loss=F.mse_loss
    )
    result = recording.explain(X[:2], k=3)
    assert result.output_names == ("output 0", "output 1")
    np.testing.assert_array_equal(result.proponent_targets, y.numpy()[result.proponent_indices])
    influence = recording.self_influence()
    np.testing.assert_allclose(influence.scores, np.abs(influence.values).sum(axis=1))
    with pytest.raises(ValueError, match="needs classes, but this model is a regressor"):
        recording.class_contributions(X[:2])


def test_bad_queries_and_missing_targets(classifier_recording):
    recording, X, _ = classifier_recording
    wrong = r"X has rows of shape \(5,\) .* training rows have shape \(4,\)"
    with pytest.raises(ValueError, match=wrong):
        recording.explain(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"X has shape \(4,\), the shape of one training row"):
        recording.explain(X[0])
    recording.targets_, targets = None, recording.targets_
    try:
        with pytest.raises(ValueError, match="Explanations need the training targets.*y=y"):
            recording.self_influence()
    finally:
        recording.targets_ = targets


def test_decompose_of_a_target_is_the_column_and_adds_up(classifier_recording):
    recording, X, y = classifier_recording
    queries = X[:4] + 0.05
    full = recording.decompose(queries)
    columns = np.array([2, 0, 1, 1])
    found = recording.decompose(queries, target=columns)
    assert found.contributions.shape == (4, X.shape[0])
    np.testing.assert_allclose(
        found.contributions, full.contributions[np.arange(4), :, columns], rtol=0, atol=1e-12
    )
    margin = recording.decompose(queries, target="margin")
    assert margin.residual.max() <= 1e-9
    np.testing.assert_array_equal(margin.labels, full.output.argmax(1))
    with pytest.raises(ValueError, match="training loss"):
        recording.decompose(queries, target="loss", y=y[:4].numpy())
