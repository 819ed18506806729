"""The learned kernel inside scikit-learn, on the EPK paper's 3-class toy problem.

Three 100-d Gaussians with unit variance and means (1, 4, 0, ...), (4, 1, 0, ...)
and (5, 5, 0, ...), smaller than in the paper for speed.
"""

import numpy as np
import pytest
from sklearn.gaussian_process import GaussianProcessClassifier, GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, WhiteKernel
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import Pipeline
from sklearn.svm import SVC

from sklearn_pathkernel import ExactPathKernelClassifier, PathKernelTransformer

# Chance is 1/3; the network itself reaches about 0.83 with these settings.
MIN_ACCURACY = 0.75


def paper_toy(n_per_class, rng):
    means = np.zeros((3, 100))
    means[:, :2] = [(1, 4), (4, 1), (5, 5)]
    X = np.vstack([mean + rng.standard_normal((n_per_class, 100)) for mean in means])
    return X, np.repeat(np.arange(3), n_per_class)


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(0)
    X, y = paper_toy(20, rng)
    X_test, y_test = paper_toy(20, rng)
    return X, y, X_test, y_test


def small_net(**params):
    settings = dict(hidden_layer_sizes=(16,), learning_rate=0.2, max_iter=30, random_state=0)
    return ExactPathKernelClassifier(**{**settings, **params})


@pytest.fixture(scope="module")
def clf(toy):
    X, y, _, _ = toy
    return small_net().fit(X, y)


def test_svc_on_precomputed_kernel(toy, clf):
    X, y, X_test, y_test = toy
    K, K_test = clf.kernel_(X), clf.kernel_(X_test, X)
    svc = SVC(kernel="precomputed").fit(K, y)
    assert svc.score(K_test, y_test) >= MIN_ACCURACY
    # The callable kernel gives the same machine.
    svc_callable = SVC(kernel=clf.kernel_).fit(X, y)
    np.testing.assert_array_equal(svc_callable.predict(X_test), svc.predict(K_test))
    np.testing.assert_allclose(
        svc_callable.decision_function(X_test), svc.decision_function(K_test), rtol=1e-10
    )


def test_gaussian_process_classifier(toy, clf):
    X, y, X_test, y_test = toy
    gpc = GaussianProcessClassifier(kernel=clf.kernel_).fit(X, y)
    assert gpc.score(X_test, y_test) >= MIN_ACCURACY
    proba = gpc.predict_proba(X_test)
    assert np.all(np.isfinite(proba))
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    # One-vs-rest clones the kernel per class: all clones share the engine.
    engines = {id(estimator.kernel_.engine) for estimator in gpc.base_estimator_.estimators_}
    assert engines == {id(clf.kernel_.engine)}


def test_gaussian_process_regressor_on_one_hot_targets(toy, clf):
    X, y, X_test, y_test = toy
    kernel = ConstantKernel() * clf.kernel_ + WhiteKernel(noise_level_bounds=(1e-10, 10.0))
    gpr = GaussianProcessRegressor(kernel=kernel, random_state=0).fit(X, np.eye(3)[y])
    mean, std = gpr.predict(X_test, return_std=True)
    assert mean.shape == (60, 3)
    assert np.mean(mean.argmax(axis=1) == y_test) >= MIN_ACCURACY
    assert std.shape in {(60,), (60, 3)}
    assert np.all(np.isfinite(std)) and np.all(std >= 0)
    # The fitted hyperparameters moved: the optimiser saw the (empty) EPK gradient.
    assert gpr.kernel_.k2.noise_level != 1.0


def test_grid_search_over_the_pipeline(toy):
    X, y, X_test, y_test = toy
    pipeline = Pipeline(
        [("epk", PathKernelTransformer(small_net())), ("svc", SVC(kernel="precomputed"))]
    )
    search = GridSearchCV(
        pipeline, {"epk__estimator__max_iter": [3, 30], "svc__C": [0.1, 10.0]}, cv=2
    ).fit(X, y)
    assert search.cv_results_["mean_test_score"].shape == (4,)
    assert set(search.best_params_) == {"epk__estimator__max_iter", "svc__C"}
    assert search.score(X_test, y_test) >= MIN_ACCURACY


def test_sum_identity_through_the_public_api(toy, clf):
    X, _, X_test, _ = toy
    for points in (X_test, X[:10]):
        parts = clf.decompose(points)
        assert parts.contributions.shape == (points.shape[0], 60, 3)
        reconstructed = parts.bias + parts.contributions.sum(axis=1)
        np.testing.assert_allclose(reconstructed, clf.predict_log_proba(points), rtol=0, atol=1e-9)
        assert np.all(parts.residual <= 1e-9)
