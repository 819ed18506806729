"""The streamed influence matrix and the per-class sums."""

import numpy as np

from sklearn_pathkernel._explain._scoring import class_totals


def test_influence_matrix_equals_decompose(small_classifier, tmp_path):
    clf, X, _ = small_classifier
    queries = X[:5] + 0.03
    contributions = clf.decompose(queries).contributions
    np.testing.assert_array_equal(clf.influence_matrix(queries), contributions)
    np.testing.assert_allclose(
        clf.influence_matrix(queries, batch_size=2), contributions, rtol=0, atol=1e-15
    )
    columns = np.array([0, 3, 9, 2, 2])
    filename = tmp_path / "influence.npy"
    out = clf.influence_matrix(queries, columns=columns, filename=filename, batch_size=2)
    assert isinstance(out, np.memmap)
    np.testing.assert_allclose(
        np.load(filename, mmap_mode="r"), contributions[np.arange(5), :, columns], atol=1e-15
    )


def test_class_contributions_by_hand(small_classifier):
    clf, X, y = small_classifier
    contributions = clf.decompose(X[:3]).contributions
    result = clf.class_contributions(X[:3], batch_size=2)
    for c, label in enumerate(clf.classes_):
        np.testing.assert_allclose(result[:, c], contributions[:, y == label].sum(axis=1))
    np.testing.assert_allclose(result.sum(axis=1), contributions.sum(axis=1))
    assert class_totals(contributions, np.searchsorted(clf.classes_, y), 10).shape == (3, 10, 10)
