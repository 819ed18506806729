"""PathKernelTransformer: training Gram, transform against the training rows, meta-estimator."""

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.datasets import make_blobs
from sklearn.linear_model import LogisticRegression

from sklearn_pathkernel import (
    ExactPathKernel,
    ExactPathKernelClassifier,
    PathKernelTransformer,
)


@pytest.fixture(scope="module")
def data():
    X, y = make_blobs(n_samples=40, n_features=3, centers=3, random_state=0)
    return X[:30], y[:30], X[30:]


def small_net(**params):
    return ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=10, random_state=0, **params)


@pytest.fixture(scope="module")
def fitted(data):
    X, y, _ = data
    transformer = PathKernelTransformer(small_net())
    return transformer, transformer.fit_transform(X, y)


def test_fit_transform_is_the_training_gram(data, fitted):
    X, y, _ = data
    transformer, K = fitted
    assert K.shape == (30, 30)
    np.testing.assert_array_equal(K, K.T)
    assert np.linalg.eigvalsh(K).min() >= -1e-10 * np.abs(K).max()
    assert isinstance(transformer.kernel_, ExactPathKernel)
    np.testing.assert_array_equal(K, transformer.estimator_.kernel_(X))
    # The same network as fitting the classifier directly.
    direct = small_net().fit(X, y)
    np.testing.assert_array_equal(direct.kernel_(X), K)


def test_transform_of_the_training_rows_equals_fit_transform(data, fitted):
    X, _, _ = data
    transformer, K = fitted
    np.testing.assert_array_equal(transformer.transform(X), K)
    # Subsets and reorderings of the training rows keep their rows.
    order = np.arange(30)[::-3]
    np.testing.assert_allclose(transformer.transform(X[order]), K[order], rtol=1e-12)


def test_transform_new_rows(data, fitted):
    X, _, X_new = data
    transformer, K = fitted
    K_new = transformer.transform(X_new)
    assert K_new.shape == (10, 30)
    np.testing.assert_array_equal(K_new, transformer.estimator_.kernel_(X_new, X))
    # New rows are on the test copy, so they are not rows of the training Gram.
    assert not np.allclose(transformer.transform(X[:1] + 1e-3), K[:1], rtol=1e-6)


def test_fit_clones_the_estimator_and_keeps_a_copy_of_X(data):
    X, y, _ = data
    net = small_net()
    X_user = X.copy()
    transformer = PathKernelTransformer(net).fit(X_user, y)
    assert transformer.estimator_ is not net
    assert not hasattr(net, "module_")
    X_user[0, 0] = 100.0
    np.testing.assert_array_equal(transformer.X_fit_, X)
    assert transformer.n_features_in_ == 3


def test_default_estimator(data):
    X, y, _ = data
    transformer = PathKernelTransformer().fit(X[:12], y[:12])
    assert type(transformer.estimator_) is ExactPathKernelClassifier
    assert transformer.estimator is None


def test_random_state_seeds_the_default_estimator(data):
    X, y, _ = data
    first = PathKernelTransformer(random_state=0).fit_transform(X[:12], y[:12])
    second = PathKernelTransformer(random_state=0).fit_transform(X[:12], y[:12])
    np.testing.assert_array_equal(first, second)
    transformer = PathKernelTransformer(random_state=0).fit(X[:12], y[:12])
    assert transformer.estimator_.random_state == 0
    other = PathKernelTransformer(random_state=1).fit_transform(X[:12], y[:12])
    assert not np.array_equal(first, other)
    # A given estimator keeps its own random_state.
    net = ExactPathKernelClassifier(hidden_layer_sizes=(4,), max_iter=3, random_state=5)
    assert (
        PathKernelTransformer(net, random_state=0).fit(X[:12], y[:12]).estimator_.random_state == 5
    )


def test_feature_names_out_name_the_training_rows(fitted):
    transformer, _ = fitted
    names = transformer.get_feature_names_out()
    assert names.shape == (30,)
    assert names[0] == "pathkerneltransformer0"
    assert names[-1] == "pathkerneltransformer29"


def test_errors(data):
    X, y, _ = data
    with pytest.raises(TypeError, match="kernel_ attribute.*LogisticRegression"):
        PathKernelTransformer(LogisticRegression()).fit(X, y)
    with pytest.raises(ValueError, match="requires y"):
        PathKernelTransformer(small_net()).fit(X, None)
    # fit parameters reach the classifier
    with pytest.raises(ValueError, match="non-zero"):
        PathKernelTransformer(small_net()).fit(X, y, sample_weight=np.zeros(30))
    transformer = PathKernelTransformer(small_net()).fit(X, y)
    with pytest.raises(ValueError, match="features"):
        transformer.transform(X[:, :2])


def test_nested_parameters_for_grid_search():
    transformer = PathKernelTransformer(small_net())
    assert transformer.get_params()["estimator__max_iter"] == 10
    transformer.set_params(estimator__max_iter=3)
    assert clone(transformer).estimator.max_iter == 3


def test_distance_classifier_as_estimator(data):
    module = pytest.importorskip("sklearn_pathkernel._estimators._distance_classifier")
    X, y, X_new = data
    # A fixed rule keeps this fast: "exact" on distance layers took 100 s here (being fixed).
    net = module.DistanceKernelClassifier(
        hidden_layer_sizes=(4,), max_iter=5, quadrature="riemann", n_points=4, random_state=0
    )
    transformer = PathKernelTransformer(net)
    K = transformer.fit_transform(X, y)
    assert K.shape == (30, 30)
    np.testing.assert_array_equal(transformer.transform(X), K)
    assert transformer.transform(X_new).shape == (10, 30)


def test_nested_parameters_of_the_default_estimator(data):
    # The README's pipeline: PathKernelTransformer() with no estimator, tuned through it.
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import Pipeline
    from sklearn.svm import SVC

    X, y, _ = data
    transformer = PathKernelTransformer(random_state=3)
    params = transformer.get_params()
    assert params["estimator"] is None
    assert params["estimator__max_iter"] == ExactPathKernelClassifier().max_iter
    assert params["estimator__random_state"] == 3
    transformer.set_params(estimator__max_iter=4, estimator__hidden_layer_sizes=(5,))
    assert type(transformer.estimator) is ExactPathKernelClassifier
    assert transformer.estimator.max_iter == 4
    assert transformer.estimator.random_state == 3
    assert clone(transformer).estimator.get_params() == transformer.estimator.get_params()
    # The same training as the equivalent explicit estimator.
    explicit = ExactPathKernelClassifier(max_iter=4, hidden_layer_sizes=(5,), random_state=3)
    np.testing.assert_array_equal(
        transformer.fit_transform(X, y), PathKernelTransformer(explicit).fit_transform(X, y)
    )
    # estimator=None given in the same call as a nested parameter still builds the default.
    assert (
        PathKernelTransformer().set_params(estimator=None, estimator__max_iter=2).estimator.max_iter
        == 2
    )
    # (seeded: the score of an unseeded 3-step fit depends on the tests run before)
    pipe = Pipeline(
        [("epk", PathKernelTransformer(random_state=0)), ("svc", SVC(kernel="precomputed"))]
    )
    pipe.set_params(epk__estimator__max_iter=3, epk__estimator__hidden_layer_sizes=(4,))
    assert pipe.fit(X, y).score(X, y) > 0.5
    grid = GridSearchCV(
        Pipeline(
            [("epk", PathKernelTransformer(random_state=0)), ("svc", SVC(kernel="precomputed"))]
        ),
        {"epk__estimator__max_iter": [2, 4], "svc__C": [1.0]},
        cv=2,
    ).fit(X, y)
    assert grid.best_params_["epk__estimator__max_iter"] in (2, 4)
    assert grid.best_estimator_.named_steps["epk"].estimator_.random_state == 0
