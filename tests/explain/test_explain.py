"""explain(X, k): top-k equals a brute-force sort of decompose; shares, targets, frames."""

import matplotlib
import numpy as np
import pytest
from explain_models import digits

from sklearn_pathkernel import DistanceKernelClassifier
from sklearn_pathkernel._explain._topk import TopK

matplotlib.use("Agg")


def brute_force(values, k):
    """(n, M, K) -> indices and values of the k largest per (n, K), stable."""
    order = np.argsort(-np.moveaxis(values, 1, -1), axis=-1, kind="stable")[..., :k]
    return order, np.take_along_axis(np.moveaxis(values, 1, -1), order, -1)


@pytest.mark.parametrize("k", [1, 5, 60])
def test_top_k_equals_a_sort_of_decompose(small_classifier, k):
    clf, X, y = small_classifier
    queries = X[:7] + 0.01
    contributions = clf.decompose(queries).contributions
    result = clf.explain(queries, k=k)
    order, values = brute_force(contributions, k)
    np.testing.assert_array_equal(result.proponent_indices, order)
    np.testing.assert_array_equal(result.proponent_values, values)
    order, values = brute_force(-contributions, k)
    np.testing.assert_array_equal(result.opponent_indices, order)
    np.testing.assert_array_equal(result.opponent_values, -values)
    mass = np.abs(contributions).sum(axis=1)[..., None]
    np.testing.assert_allclose(result.proponent_shares, result.proponent_values / mass)
    np.testing.assert_array_equal(result.proponent_targets, y[result.proponent_indices])
    np.testing.assert_allclose(result.total, contributions.sum(axis=1))
    np.testing.assert_allclose(result.bias + result.total + result.decay, result.output, atol=1e-9)
    np.testing.assert_array_equal(result.predicted, np.argmax(clf.predict_log_proba(queries), 1))
    tiled = clf.explain(queries, k=k, batch_size=3)  # tiles of queries: the same, up to rounding
    np.testing.assert_array_equal(tiled.proponent_indices, result.proponent_indices)
    np.testing.assert_allclose(tiled.opponent_values, result.opponent_values, rtol=1e-13)


def test_ties_are_broken_by_the_smaller_index():
    values = np.array([[[1.0], [3.0], [3.0], [0.0], [3.0]]])
    top = TopK.of(values, 2)
    np.testing.assert_array_equal(top.indices[0, 0], [1, 2])


def test_normalised_ranks_by_the_path_norms(small_classifier):
    clf, X, _ = small_classifier
    queries = X[:4] + 0.02
    engine = clf._engine()
    # independent: the diagonal of the full training Gram (training copy, trace)
    gram = engine.gram(engine.X_train, a_train=True)
    norms = np.sqrt(np.diag(gram))
    expected = clf.decompose(queries).contributions / norms[None, :, None]
    result = clf.explain(queries, k=6, normalize=True)
    order, values = brute_force(expected, 6)
    np.testing.assert_array_equal(result.proponent_indices, order)
    np.testing.assert_allclose(result.proponent_values, values, rtol=1e-10)
    assert result.normalized


def test_every_estimator_explains():
    X, y = digits(40)
    clf = DistanceKernelClassifier(max_iter=2, random_state=0).fit(X, y)
    result = clf.explain(X[:2], k=3)
    order, _ = brute_force(clf.decompose(X[:2]).contributions, 3)
    np.testing.assert_array_equal(result.proponent_indices, order)


def test_regressor_explanation(small_regressor):
    reg, X = small_regressor
    result = reg.explain(X[:3], k=4)
    order, _ = brute_force(reg.decompose(X[:3]).contributions, 4)
    np.testing.assert_array_equal(result.proponent_indices, order)
    assert result.output_names == ("output 0", "output 1")
    frame = result.to_frame()
    assert len(frame) == 3 * 2 * 2 * 4


def test_to_frame_is_tidy(small_classifier):
    clf, X, y = small_classifier
    result = clf.explain(X[:2], k=3)
    frame = result.to_frame()
    assert list(frame.columns) == [
        "query", "output", "role", "rank", "train_index", "contribution", "share", "target",
    ]  # fmt: skip
    assert len(frame) == 2 * len(clf.classes_) * 2 * 3
    row = frame[(frame["query"] == 1) & (frame["output"] == "3") & (frame["role"] == "opponent")]
    np.testing.assert_array_equal(row.train_index, result.opponent_indices[1, 3])
    np.testing.assert_array_equal(row.target, y[result.opponent_indices[1, 3]])


def test_plots(small_classifier):
    clf, X, _ = small_classifier
    result = clf.explain(X[:2], k=3)
    ax = result.plot(1)
    assert len(ax.patches) == 6
    fig = result.plot(0, output=2, image_shape=(8, 8))
    assert len(fig.axes) == 2 * 4
    import matplotlib.pyplot as plt

    plt.close("all")
