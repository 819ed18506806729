"""Edge sizes and input types: two samples, one feature, many classes, string labels,
float32, read-only memmaps and pandas frames keep the kernel exact."""

import warnings

import numpy as np
import pytest
import torch

SUM_TOL = 1e-9


def check_exact(clf, X_train, X_new):
    """The sum identity, certificate and Gram symmetry on a fitted estimator."""
    parts = clf.decompose(X_new)
    total = parts.bias + parts.contributions.sum(axis=1)
    assert np.abs(total - clf.predict_log_proba(X_new)).max() < SUM_TOL
    assert parts.residual.max() < SUM_TOL
    assert parts.contributions.shape == (len(X_new), len(X_train), len(clf.classes_))
    gram = clf.kernel_(X_train)
    assert gram.shape == (len(X_train), len(X_train))
    np.testing.assert_array_equal(gram, gram.T)
    assert np.all(np.isfinite(gram))


def test_two_samples_one_per_class(make_clf):
    X, y = np.array([[0.0, 1.0], [1.0, -1.0]]), np.array([3, 7])
    clf = make_clf().fit(X, y)
    np.testing.assert_array_equal(clf.classes_, [3, 7])
    assert clf.decision_function(X).shape == (2,)
    check_exact(clf, X, X + 0.1)


def test_one_feature(make_clf, make_data):
    X, y = make_data(n_samples=8, n_features=1, n_classes=2)
    clf = make_clf().fit(X, y)
    assert clf.n_features_in_ == 1
    check_exact(clf, X, np.array([[0.3], [-2.0]]))


def test_many_classes(make_clf, make_data):
    X, y = make_data(n_samples=24, n_features=2, n_classes=12)
    clf = make_clf(max_iter=2).fit(X, y)
    assert clf.predict_proba(X[:2]).shape == (2, 12)
    check_exact(clf, X, X[:2] + 0.1)


def test_string_labels(make_clf, make_data):
    X, y = make_data(n_samples=9)
    labels = np.array(["setosa", "versicolor", "virginica"], dtype=object)[y]
    clf = make_clf().fit(X, labels)
    np.testing.assert_array_equal(clf.classes_, ["setosa", "versicolor", "virginica"])
    assert set(clf.predict(X)) <= set(labels)
    # Same network as integer labels in the same order.
    ints = make_clf().fit(X, y)
    assert torch.equal(clf.path_.weights, ints.path_.weights)
    check_exact(clf, X, X[:2] + 0.1)


def test_float32_input(data, make_clf):
    X, y = data
    X32 = X.astype(np.float32)
    clf = make_clf().fit(X32, y)
    ref = make_clf().fit(X32.astype(np.float64), y)
    assert torch.equal(clf.path_.weights, ref.path_.weights)
    assert clf.predict_proba(X32).dtype == np.float64
    # float32 training rows are on the training copy (exact after conversion to float64).
    np.testing.assert_array_equal(clf.kernel_(X32), ref.kernel_(X32.astype(np.float64)))
    check_exact(clf, X32, X32[:2] + np.float32(0.1))


def test_read_only_memmap_input(data, tmp_path, make_clf):
    X, y = data
    filename = tmp_path / "X.dat"
    writable = np.memmap(filename, dtype=np.float64, mode="w+", shape=X.shape)
    writable[:] = X
    writable.flush()
    del writable
    X_map = np.memmap(filename, dtype=np.float64, mode="r", shape=X.shape)
    assert not X_map.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. torch's "non-writable array"
        clf = make_clf().fit(X_map, y)
        check_exact(clf, X_map, X_map[:2])
        np.testing.assert_array_equal(clf.kernel_(X_map), clf.kernel_(X))
    np.testing.assert_array_equal(X_map, X)
    ref = make_clf().fit(X, y)
    assert torch.equal(clf.path_.weights, ref.path_.weights)


def test_pandas_dataframe_input(data, make_clf):
    pd = pytest.importorskip("pandas")
    X, y = data
    frame = pd.DataFrame(X, columns=["a", "b", "c"])
    clf = make_clf().fit(frame, pd.Series(y))
    np.testing.assert_array_equal(clf.feature_names_in_, ["a", "b", "c"])
    ref = make_clf().fit(X, y)
    np.testing.assert_array_equal(clf.predict_proba(frame), ref.predict_proba(X))
    np.testing.assert_array_equal(clf.kernel_(frame), ref.kernel_(X))
    check_exact(clf, frame, frame[:2] + 0.1)
    with pytest.raises(ValueError, match="feature names"):
        clf.predict(frame[["c", "b", "a"]])
