"""Gram matrices and diagonals: against the brute-force kernel, and the kernel's
properties (symmetric, positive semi-definite, independent of tiles and jobs)."""

import numpy as np
import torch


def test_grams_match_brute_force(smooth_case, engine_cases):
    module, path, X, y, A, (_, gram_train, gram_test_train, gram_test) = smooth_case
    engine = engine_cases.engine_for(module, path, X, y)
    np.testing.assert_allclose(engine.gram(X, a_train=True), gram_train.numpy(), rtol=1e-10)
    full = engine.gram(A, X, a_train=False, b_train=True, output="full")
    expected = gram_test_train.numpy()
    np.testing.assert_allclose(full, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())
    trace = engine.gram(A, X, a_train=False, b_train=True)
    np.testing.assert_allclose(trace, np.einsum("nmkk->nm", full), rtol=1e-12)
    np.testing.assert_allclose(engine.gram(A), gram_test.numpy(), rtol=1e-9)
    # the transposed block is the transpose
    np.testing.assert_allclose(engine.gram(X, A, a_train=True, b_train=False), trace.T, rtol=1e-12)


def test_relu_grams_match_fine_brute_force(engine_cases):
    """On a ReLU net the brute force needs many nodes (O(1/T) across kinks)."""
    module, path, X, y = engine_cases.trained(
        engine_cases.mlp([3, 5, 2]), n=10, n_features=3, n_classes=2, steps=3, lr=1.0
    )
    A = engine_cases.queries(3, n=4)
    _, _, gram_test_train, gram_test = engine_cases.brute_force(
        module, path, X, y, A, ("midpoint", 20000)
    )
    engine = engine_cases.engine_for(module, path, X, y)
    full = engine.gram(A, X, b_train=True, output="full")
    scale = np.abs(full).max()
    assert np.abs(full - gram_test_train.numpy()).max() < 1e-4 * scale
    assert np.abs(engine.gram(A) - gram_test.numpy()).max() < 1e-4 * np.abs(engine.gram(A)).max()


def test_training_gram_symmetric_psd(relu_case, engine_cases):
    module, path, X, y, _ = relu_case
    gram = engine_cases.engine_for(module, path, X, y).gram(X, a_train=True)
    np.testing.assert_array_equal(gram, gram.T)
    assert np.linalg.eigvalsh(gram).min() > -1e-10 * np.abs(gram).max()


def test_test_gram_symmetric_psd_and_diag(relu_case, engine_cases):
    module, path, X, y, A = relu_case
    engine = engine_cases.engine_for(module, path, X, y)
    gram = engine.gram(A)
    np.testing.assert_allclose(gram, gram.T, rtol=1e-13)
    assert np.linalg.eigvalsh(gram).min() > -1e-10 * np.abs(gram).max()
    np.testing.assert_allclose(engine.diag(A), np.diag(gram), rtol=1e-10)
    np.testing.assert_allclose(engine.diag(X, a_train=True), np.diag(engine.gram(X, a_train=True)))


def test_mixed_copies_gram_is_psd(relu_case, engine_cases):
    """Training-copy and test-copy rows together: inner products in one space."""
    module, path, X, y, A = relu_case
    rows = torch.cat([X[:8], A])
    on_train = np.r_[np.ones(8, bool), np.zeros(len(A), bool)]
    gram = engine_cases.engine_for(module, path, X, y).gram(rows, a_train=on_train)
    np.testing.assert_allclose(gram, gram.T, rtol=1e-12)
    assert np.linalg.eigvalsh(gram).min() > -1e-10 * np.abs(gram).max()


def test_invariance_to_tiles_and_jobs(relu_case, engine_cases):
    module, path, X, y, A = relu_case
    reference = engine_cases.engine_for(module, path, X, y)
    for kwargs in ({"tile_size": 7}, {"tile_size": 11, "n_jobs": 2}):
        other = engine_cases.engine_for(module, path, X, y, **kwargs)
        np.testing.assert_allclose(
            other.gram(X, a_train=True), reference.gram(X, a_train=True), rtol=1e-12
        )
        np.testing.assert_allclose(
            other.gram(A, X, b_train=True), reference.gram(A, X, b_train=True), rtol=1e-12
        )
        np.testing.assert_allclose(
            other.decompose(A).contributions,
            reference.decompose(A).contributions,
            rtol=1e-12,
            atol=1e-16,
        )
