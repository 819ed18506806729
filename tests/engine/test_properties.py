"""Property-based tests (hypothesis): the exact path kernel's identities hold on random
small networks, activations, batch sizes and data.

Each example fits a tiny network for a few steps, then checks
- the training Gram ``kernel_(X_train)`` is exactly symmetric and positive semi-definite,
- the test x test Gram ``kernel_(X_new)`` is symmetric PSD,
- the sum identity ``bias + contributions.sum(1) == predict_log_proba`` to 1e-9,
- the exactness certificate ``decompose(X).residual`` is below 1e-9.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sklearn_pathkernel import ExactPathKernelClassifier

TOL = 1e-9
PROPERTY_SETTINGS = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,  # the same examples on every run and machine
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def problems(draw):
    """A small architecture, training setup and data set."""
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.lists(st.integers(2, 8), min_size=depth, max_size=depth)))
    activation = draw(st.sampled_from(["relu", "tanh", "gelu", "softplus"]))
    n_classes = draw(st.integers(2, 4))
    n_samples = draw(st.integers(n_classes, 10))
    n_features = draw(st.integers(1, 4))
    batch_size = draw(st.one_of(st.none(), st.integers(1, 4)))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.RandomState(seed)
    X = scale * rng.randn(n_samples, n_features)
    if draw(st.booleans()) and n_samples > 2:
        X[-1] = X[0]  # a repeated training row
    y = np.r_[np.arange(n_classes), rng.randint(n_classes, size=n_samples - n_classes)]
    X_new = scale * rng.randn(3, n_features)
    params = dict(
        hidden_layer_sizes=widths,
        activation=activation,
        batch_size=batch_size,
        learning_rate=draw(st.sampled_from([0.05, 0.3, 1.0])),
        max_iter=draw(st.integers(1, 3)),
        random_state=seed,
    )
    return params, X, y, X_new


def assert_psd(K, what):
    eigenvalues = np.linalg.eigvalsh(K)
    scale = max(1.0, np.abs(eigenvalues).max())
    assert eigenvalues.min() >= -TOL * scale, f"{what}: eigenvalue {eigenvalues.min():.3e}"


@PROPERTY_SETTINGS
@given(problems())
def test_kernel_identities(problem):
    params, X, y, X_new = problem
    clf = ExactPathKernelClassifier(**params).fit(X, y)

    gram = clf.kernel_(X)
    assert gram.shape == (len(X), len(X))
    np.testing.assert_array_equal(gram, gram.T)
    assert_psd(gram, "training Gram")

    test_gram = clf.kernel_(X_new)
    np.testing.assert_allclose(test_gram, test_gram.T, rtol=0, atol=TOL * max(1, test_gram.max()))
    assert_psd(test_gram, "test x test Gram")

    for Q in (X_new, X):  # new points, and the training points on the test copy
        parts = clf.decompose(Q)
        total = parts.bias + parts.contributions.sum(axis=1)
        error = np.abs(total - clf.predict_log_proba(Q)).max()
        assert error < TOL, f"sum identity off by {error:.3e}"
        assert parts.residual.max() < TOL, f"certificate {parts.residual.max():.3e}"


@PROPERTY_SETTINGS
@given(problems())
def test_cross_gram_is_consistent(problem):
    """``kernel_(A, B)`` is the (A, B) block of ``kernel_(A + B)``, and diag is its diagonal."""
    params, X, y, X_new = problem
    params = dict(params, max_iter=1)
    clf = ExactPathKernelClassifier(**params).fit(X, y)
    both = np.vstack([X_new, X])
    full = clf.kernel_(both)
    cross = clf.kernel_(X_new, X)
    atol = 1e-12 * max(1.0, np.abs(full).max())
    np.testing.assert_allclose(cross, full[: len(X_new), len(X_new) :], rtol=1e-12, atol=atol)
    # diag integrates each row on its own pieces, the Gram on the union of the rows'
    # pieces: both are quadratures of the same integral, equal to ~1e-10 at worst.
    np.testing.assert_allclose(clf.kernel_.diag(both), np.diag(full), rtol=1e-9, atol=atol)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
