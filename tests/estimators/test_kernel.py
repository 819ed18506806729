"""ExactPathKernel: shapes, the per-row copy rule, invariances, sharing and pickling."""

import copy
import pickle

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.datasets import make_blobs
from sklearn.gaussian_process.kernels import ConstantKernel

from sklearn_pathkernel import ExactPathKernel, ExactPathKernelClassifier


@pytest.fixture(scope="module")
def data():
    X, y = make_blobs(n_samples=30, n_features=4, centers=3, random_state=0)
    return X, y


@pytest.fixture(scope="module")
def clf(data):
    X, y = data
    return ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=10, random_state=0).fit(X, y)


@pytest.fixture(scope="module")
def queries(data):
    """Two training rows (3, 7) around one row off the training set."""
    X, _ = data
    return np.vstack([X[3], X[0] + 1e-3, X[7]])


def engine_gram(clf, A, B, a_train, b_train):
    engine = clf._engine()
    return engine.gram(torch.tensor(A), torch.tensor(B), a_train=a_train, b_train=b_train)


def test_kernel_is_a_sklearn_kernel_without_hyperparameters(clf):
    kernel = clf.kernel_
    assert isinstance(kernel, ExactPathKernel)
    assert kernel.theta.shape == (0,)
    assert kernel.n_dims == 0
    assert kernel.bounds.shape == (0,)
    assert kernel.requires_vector_input
    assert not kernel.is_stationary()
    assert set(kernel.get_params()) == {"engine", "output"}
    assert repr(kernel).startswith("ExactPathKernel(n_train=30, n_outputs=3, n_steps=10")


def test_shapes(clf, data, queries):
    X, _ = data
    kernel = clf.kernel_
    assert kernel(X).shape == (30, 30)
    assert kernel(queries, X).shape == (3, 30)
    assert kernel(X, queries).shape == (30, 3)
    assert kernel.diag(queries).shape == (3,)
    K, gradient = kernel(queries, eval_gradient=True)
    assert K.shape == (3, 3)
    assert gradient.shape == (3, 3, 0)
    with pytest.raises(ValueError, match="Y is None"):
        kernel(queries, X, eval_gradient=True)


def test_training_gram_is_symmetric_psd(clf, data):
    X, _ = data
    K = clf.kernel_(X)
    np.testing.assert_array_equal(K, K.T)
    eigenvalues = np.linalg.eigvalsh(K)
    assert eigenvalues.min() >= -1e-10 * eigenvalues.max()
    # Y equal to X takes the same (symmetric) computation.
    np.testing.assert_array_equal(clf.kernel_(X, X.copy()), K)


def test_mixed_copies_gram_is_psd(clf, data):
    # Training rows and test rows together are still a Gram matrix of features
    # (constant and integrated gradients in L2 over each step).
    X, _ = data
    A = np.vstack([X[:10], X[:10] + 0.3])
    K = clf.kernel_(A)
    eigenvalues = np.linalg.eigvalsh(K)
    assert eigenvalues.min() >= -1e-9 * eigenvalues.max()


def test_diag_matches_full_matrix(clf, data, queries):
    X, _ = data
    kernel = clf.kernel_
    A = np.vstack([queries, X[10:14] - 0.2])
    np.testing.assert_allclose(kernel.diag(A), np.diag(kernel(A)), rtol=1e-10)
    np.testing.assert_allclose(kernel.diag(X), np.diag(kernel(X)), rtol=1e-12)


def test_row_copy_rule(clf, data, queries):
    X, _ = data
    K_train = clf.kernel_(X)
    K = clf.kernel_(queries, X)
    # Training rows inside A: exactly their rows of the training Gram.
    np.testing.assert_allclose(K[0], K_train[3], rtol=1e-12)
    np.testing.assert_allclose(K[2], K_train[7], rtol=1e-12)
    # The perturbed row is on the test copy (integrated gradients), training rows on
    # the training copy: the engine with that explicit indicator gives the same matrix.
    expected = engine_gram(clf, queries, X, a_train=[True, False, True], b_train=True)
    np.testing.assert_allclose(K, expected, rtol=1e-12)
    # And the copy matters: the same training row on the test copy is another row.
    test_copy = engine_gram(clf, X[3:4], X, a_train=False, b_train=True)[0]
    assert not np.allclose(test_copy, K_train[3], rtol=1e-6)


def test_negative_zero_matches_a_training_row():
    X, y = make_blobs(n_samples=20, n_features=3, centers=2, random_state=1)
    X[:, 2] = 0.0
    clf = ExactPathKernelClassifier(hidden_layer_sizes=(4,), max_iter=3, random_state=0).fit(X, y)
    row = X[:1].copy()
    row[0, 2] = -0.0
    np.testing.assert_allclose(clf.kernel_(row, X)[0], clf.kernel_(X)[0], rtol=1e-12)


def test_per_row_invariance_to_order_and_subsets(clf, data, queries):
    X, _ = data
    kernel = clf.kernel_
    A = np.vstack([queries, X[20:23] + 0.5])
    K = kernel(A, X)
    order = np.array([4, 0, 5, 2, 1, 3])
    np.testing.assert_allclose(kernel(A[order], X), K[order], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kernel(A[:2], X), K[:2], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kernel(A, X[5:9]), K[:, 5:9], rtol=1e-12, atol=1e-12)
    K_AA = kernel(A)
    np.testing.assert_allclose(kernel(A[order]), K_AA[np.ix_(order, order)], rtol=1e-12)
    np.testing.assert_allclose(kernel(A[order], A), K_AA[order], rtol=1e-12)


def test_full_output_traces_to_the_scalar_kernel(clf, data, queries):
    X, _ = data
    full = ExactPathKernel(clf._engine(), output="full")
    K_full = full(queries, X[:5])
    assert K_full.shape == (3, 5, 3, 3)
    np.testing.assert_allclose(
        np.einsum("abkk->ab", K_full), clf.kernel_(queries, X[:5]), rtol=1e-12
    )
    diag_full = full.diag(queries)
    assert diag_full.shape == (3, 3, 3)
    np.testing.assert_allclose(np.einsum("akk->a", diag_full), clf.kernel_.diag(queries))


def test_results_are_fresh_copies(clf, data):
    X, _ = data
    kernel = clf.kernel_
    K = kernel(X)
    K[np.diag_indices_from(K)] += 1.0  # as GaussianProcessRegressor does with alpha
    assert not np.array_equal(kernel(X), K)
    np.testing.assert_array_equal(kernel(X), clf.kernel_(X))


def test_kernel_algebra(clf, data):
    X, _ = data
    scaled = ConstantKernel(2.0, constant_value_bounds="fixed") * clf.kernel_
    np.testing.assert_allclose(scaled(X[:6]), 2.0 * clf.kernel_(X[:6]), rtol=1e-12)


def test_clone_and_deepcopy_share_the_engine(clf):
    kernel = clf.kernel_
    engine = kernel.engine
    for copied in (
        clone(kernel),
        copy.deepcopy(kernel),
        kernel.clone_with_theta(kernel.theta),
        clone(ConstantKernel() * kernel).k2,
    ):
        assert type(copied) is ExactPathKernel
        assert copied is not kernel
        assert copied.engine is engine
        assert copied == kernel
    assert ExactPathKernel(engine, output="full") != kernel
    assert clf.kernel_ == kernel  # every access wraps the one cached engine


def test_pickle_round_trip_keeps_values_bitwise(clf, data, queries):
    X, _ = data
    kernel = clf.kernel_
    restored = pickle.loads(pickle.dumps(kernel))
    assert restored.engine is not kernel.engine  # really recomputed below
    np.testing.assert_array_equal(restored(queries, X), kernel(queries, X))
    np.testing.assert_array_equal(restored(X), kernel(X))
    np.testing.assert_array_equal(restored.diag(queries), kernel.diag(queries))
    clf_restored = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(clf_restored.kernel_(queries, X), kernel(queries, X))


def test_kernel_calls_mutate_neither_estimator_nor_inputs(data, queries):
    X, y = data
    clf = ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=5, random_state=1).fit(X, y)
    state = {name: value.clone() for name, value in clf.module_.state_dict().items()}
    weights = clf.path_.weights.clone()
    coefficients = [c.clone() for c in clf.path_.output_gradients]
    fit_X = clf._fit_X.clone()
    X_before, queries_before = X.copy(), queries.copy()

    kernel = clf.kernel_
    kernel(X)
    kernel(queries, X)
    kernel.diag(queries)
    clf.decompose(queries)

    for name, value in clf.module_.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert torch.equal(clf.path_.weights, weights)
    pairs = zip(clf.path_.output_gradients, coefficients, strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert torch.equal(clf._fit_X, fit_X)
    np.testing.assert_array_equal(X, X_before)
    np.testing.assert_array_equal(queries, queries_before)


def test_input_validation(clf, data):
    X, _ = data
    kernel = clf.kernel_
    with pytest.raises(ValueError, match="3 features.*learned on data with 4 features"):
        kernel(X[:, :3])
    with pytest.raises(ValueError, match="Y has 5 features"):
        kernel(X, np.hstack([X, X[:, :1]]))
    bad = X[:3].copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        kernel(bad)
    with pytest.raises(ValueError, match="NaN"):
        kernel.diag(bad)
    with pytest.raises(ValueError, match="output must be one of"):
        ExactPathKernel(clf._engine(), output="mean")(X[:2])


def test_gaussian_process_optimiser_computes_the_training_gram_once(data, monkeypatch):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import WhiteKernel

    X, y = data
    clf = ExactPathKernelClassifier(hidden_layer_sizes=(4,), max_iter=3, random_state=2).fit(X, y)
    engine = clf._engine()
    calls = []
    gram = engine.gram

    def counting_gram(*args, **kwargs):
        calls.append(args[0].shape[0])
        return gram(*args, **kwargs)

    monkeypatch.setattr(engine, "gram", counting_gram)
    kernel = ConstantKernel() * clf.kernel_ + WhiteKernel()
    gpr = GaussianProcessRegressor(kernel=kernel, n_restarts_optimizer=1, random_state=0)
    gpr.fit(X, np.eye(3)[y])
    assert calls == [30]  # every optimiser step and restart reused the memoised Gram
    gpr.predict(X[:5] + 0.1)
    assert calls == [30, 5]
