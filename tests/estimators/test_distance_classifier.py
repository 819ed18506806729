"""DistanceKernelClassifier: acceptance on AND/XOR, network shape, determinism, errors,
exactness and documentation of the defaults."""

import ast
import inspect
import re

import numpy as np
import pytest
import torch
from sklearn.datasets import load_iris, make_moons
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from sklearn_pathkernel import DistanceKernelClassifier

X_BOOL = np.array([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
LOGIC = {"and": np.array([0, 0, 0, 1]), "xor": np.array([0, 1, 1, 0])}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["and", "xor"])
def test_default_settings_learn_and_xor_for_every_seed(name):
    y = LOGIC[name]
    failures = [
        seed
        for seed in range(20)
        if not np.array_equal(
            DistanceKernelClassifier(random_state=seed).fit(X_BOOL, y).predict(X_BOOL), y
        )
    ]
    assert failures == [], f"{name} not learned for random_state in {failures}"


@pytest.mark.slow
def test_xor_needs_the_nonlinear_transform():
    # Squared distances share one |x|^2 term, and on {0,1}^2 |x|^2 = x1 + x2: a
    # linear head on raw squared distances is a linear classifier, so XOR fails.
    y = LOGIC["xor"]
    scores = [
        DistanceKernelClassifier(skew_transform="none", random_state=seed)
        .fit(X_BOOL, y)
        .score(X_BOOL, y)
        for seed in range(5)
    ]
    assert max(scores) < 1.0


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"kernel": "euclidean", "head": "distance"},
        {"kernel": "rbf", "init": "samples", "skew_transform": "standardize"},
        {"kernel": "laplacian", "hidden_layer_sizes": (5, 4), "init": "uniform"},
        {"kernel": "cosine", "skew_transform": "none", "head": "distance"},
        {"hidden_layer_sizes": 3, "skew_transform": "sqrt"},
    ],
)
@pytest.mark.parametrize("n_classes", [2, 3])
def test_module_output_shape(params, n_classes):
    rng = np.random.RandomState(0)
    X, y = rng.randn(12, 4), np.arange(12) % n_classes
    clf = DistanceKernelClassifier(max_iter=3, random_state=0, **params).fit(X, y)
    with torch.no_grad():
        out = clf.module_(torch.as_tensor(X))
    assert out.shape == (12, n_classes) and out.dtype == torch.float64
    assert clf.predict_proba(X).shape == (12, n_classes)
    np.testing.assert_allclose(clf.predict_proba(X).sum(1), 1.0)


def test_hidden_layers_have_the_requested_memories():
    X, y = np.random.RandomState(0).randn(10, 3), np.arange(10) % 2
    clf = DistanceKernelClassifier(hidden_layer_sizes=(6, 4), max_iter=1, random_state=0).fit(X, y)
    widths = [m.memories.shape for m in clf.module_ if hasattr(m, "memories")]
    assert widths == [(6, 3), (4, 6)]


def test_same_random_state_gives_bitwise_identical_path():
    X, y = np.random.RandomState(0).randn(20, 3), np.arange(20) % 3
    fits = [
        DistanceKernelClassifier(hidden_layer_sizes=(5,), max_iter=10, random_state=7).fit(X, y)
        for _ in range(2)
    ]
    assert torch.equal(fits[0].path_.weights, fits[1].path_.weights)
    other = DistanceKernelClassifier(hidden_layer_sizes=(5,), max_iter=10, random_state=8).fit(X, y)
    assert not torch.equal(fits[0].path_.weights, other.path_.weights)


def test_kmeans_init_puts_memories_on_training_points():
    X, y = np.random.RandomState(0).randn(20, 3), np.arange(20) % 2
    clf = DistanceKernelClassifier(hidden_layer_sizes=(5,), max_iter=1, random_state=0).fit(X, y)
    w0 = clf.path_.unflatten(clf.path_.weights[0])["0.memories"].numpy()
    assert all(np.isclose(X, m).all(1).any() for m in w0)


def test_user_data_not_mutated():
    X, y = np.random.RandomState(0).randn(10, 3), np.arange(10) % 2
    X_copy, y_copy = X.copy(), y.copy()
    DistanceKernelClassifier(max_iter=2, random_state=0).fit(X, y).predict(X)
    assert np.array_equal(X, X_copy) and np.array_equal(y, y_copy)


def test_errors_for_bad_input():
    X, y = np.random.RandomState(0).randn(10, 3), np.arange(10) % 2
    clf = DistanceKernelClassifier(max_iter=2, random_state=0)
    X_nan = X.copy()
    X_nan[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        clf.fit(X_nan, y)
    with pytest.raises(ValueError, match="only one class"):
        clf.fit(X, np.zeros(10))
    with pytest.raises(ValueError, match="could not convert|numeric|dtype"):
        clf.fit(np.array([["a", "b", "c"]] * 10), y)
    clf.fit(X, y)
    with pytest.raises(ValueError, match="3 features"):
        clf.predict(X[:, :2])
    with pytest.raises(ValueError, match="cosine"):
        DistanceKernelClassifier(kernel="cosine", skew_transform="log1p").fit(X, y)
    with pytest.raises(ValueError, match="kernel"):
        DistanceKernelClassifier(kernel="manhattan").fit(X, y)


# With skew_transform="none" the integrand is polynomial along each step; "log1p"
# (the default) is exact too, to rounding.
@pytest.mark.parametrize("transform", ["none", "log1p"])
def test_decomposition_reproduces_the_network(transform):
    # The engine differentiates through the distance layers (generic rule).
    y = LOGIC["xor"]
    clf = DistanceKernelClassifier(
        hidden_layer_sizes=(4,), skew_transform=transform, max_iter=5, random_state=0
    ).fit(X_BOOL, y)
    parts = clf.decompose(X_BOOL)
    np.testing.assert_allclose(
        np.asarray(parts.bias) + np.asarray(parts.contributions).sum(1),
        clf.predict_log_proba(X_BOOL),
        rtol=0,
        atol=1e-10,
    )
    assert np.max(parts.residual) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("data", ["iris", "moons"])
def test_default_settings_give_an_exact_kernel(data):
    # The defaults (full-batch Adam, log1p distances, 100 memories, 500 steps) on
    # real data: the certificate against the network's own output is at rounding
    # level, and the decomposition adds up to the log-probabilities.
    X, y = load_iris(return_X_y=True) if data == "iris" else make_moons(150, noise=0.2)
    X = StandardScaler().fit_transform(X)
    X_train, X_test, y_train, _ = train_test_split(
        X, y, train_size=60, test_size=5, stratify=y, random_state=0
    )
    clf = DistanceKernelClassifier(random_state=0).fit(X_train, y_train)
    parts = clf.decompose(X_test)
    assert parts.residual.max() <= 1e-9
    np.testing.assert_allclose(
        parts.bias + parts.contributions.sum(1) + parts.decay,
        clf.predict_log_proba(X_test),
        rtol=0,
        atol=1e-9,
    )


def test_docstring_states_the_defaults():
    # Every parameter's "default=" in the docstring is the signature's default
    # (the solver text is generated from the update rules, with this estimator's notes).
    doc = DistanceKernelClassifier.__doc__
    for name, parameter in inspect.signature(DistanceKernelClassifier).parameters.items():
        match = re.search(rf"^    {name} : .*default=(.+)$", doc, flags=re.MULTILINE)
        assert match, f"{name} is not documented"
        assert ast.literal_eval(match.group(1).strip()) == parameter.default, name
