"""The brute-force reference engine checked against closed forms and identities.

The reference is what the fast engine is tested against, so it must stand on
its own: closed-form Jacobians of a linear softmax model, the fundamental
theorem of calculus along every step (bias + contributions == output), the
convergence order of the Riemann rule, and the algebra of the Gram matrices.
"""

import numpy as np
import pytest
import torch
from _reference import NaivePathKernelEngine, jacobian, quadrature_rule
from torch import nn

from sklearn_pathkernel._training._loop import train_module

DTYPE = torch.float64
N_TRAIN, N_FEATURES, N_CLASSES = 24, 4, 3


def make_data(seed=0, n=N_TRAIN):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, N_FEATURES, dtype=DTYPE, generator=gen)
    y = torch.arange(n) % N_CLASSES
    return X, y


def queries(n=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, N_FEATURES, dtype=DTYPE, generator=gen)


def trained(module, X, y, **params):
    """Train ``module`` in place and return it with its recorded path."""
    params = {"learning_rate": 0.5, "max_iter": 6, **params}
    result = train_module(module, X, y, random_state=0, **params)
    return module, result.path


def mlp(activation, width=8, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(N_FEATURES, width), activation(), nn.Linear(width, N_CLASSES)
    ).to(DTYPE)


def engine(module, path, X, y, **params):
    return NaivePathKernelEngine(module, path, X, **params)


def sum_identity_error(result):
    return np.abs(result.bias + result.contributions.sum(1) - result.output).max()


@pytest.fixture(scope="module")
def tanh_engine():
    X, y = make_data()
    module, path = trained(mlp(nn.Tanh), X, y)
    return engine(module, path, X, y, quadrature="gauss", n_points=12), X, y


# -- quadrature rules -----------------------------------------------------------------


@pytest.mark.parametrize("quadrature", ["riemann", "midpoint", "gauss", "dpk"])
def test_rules_integrate_polynomials(quadrature):
    t, nu = quadrature_rule(quadrature, 5)
    assert np.isclose(nu.sum(), 1.0)
    assert np.all((t >= 0) & (t < 1))
    if quadrature == "gauss":  # exact up to degree 2T - 1
        assert np.isclose((nu * t**9).sum(), 1 / 10)
    if quadrature == "riemann":
        np.testing.assert_allclose(t, [0, 0.2, 0.4, 0.6, 0.8])


def test_unknown_rule_is_rejected():
    with pytest.raises(ValueError, match="'gauss'"):
        quadrature_rule("exact", 4)


# -- Jacobians ---------------------------------------------------------------------------


def test_jacobian_of_linear_softmax_matches_closed_form():
    X, y = make_data()
    module, path = trained(nn.Linear(N_FEATURES, N_CLASSES).to(DTYPE), X, y)
    weights = path.weights[3]
    jac = jacobian(module, path, weights, X)

    params = path.unflatten(weights)
    proba = torch.softmax(X @ params["weight"].T + params["bias"], dim=1)
    eye = torch.eye(N_CLASSES, dtype=DTYPE)
    # d f_k / d z = e_k - softmax(z); d z_j / d W_j = x, d z_j / d b_j = 1.
    dz = eye[None] - proba[:, None, :]  # (n, k, j)
    d_weight = dz[..., None] * X[:, None, None, :]  # (n, k, j, d)
    expected = torch.cat([d_weight.flatten(2), dz], dim=2)
    assert jac.shape == (N_TRAIN, N_CLASSES, path.n_weights)
    torch.testing.assert_close(jac, expected, rtol=0, atol=1e-13)


def test_jacobian_of_no_rows_is_empty():
    X, y = make_data()
    module, path = trained(mlp(nn.Tanh), X, y, max_iter=1)
    assert jacobian(module, path, path.weights[0], X[:0]).shape == (0, N_CLASSES, path.n_weights)


# -- decomposition -------------------------------------------------------------------


def test_sum_identity_gauss_on_smooth_network():
    X, y = make_data()
    module, path = trained(mlp(nn.Tanh), X, y)
    result = engine(module, path, X, y, quadrature="gauss", n_points=20).decompose(queries())
    assert result.contributions.shape == (6, N_TRAIN, N_CLASSES)
    assert sum_identity_error(result) < 1e-10
    assert result.quadrature_error.max() < 1e-10
    with torch.no_grad():
        expected = torch.log_softmax(module(queries()), dim=1).numpy()
    np.testing.assert_allclose(result.output, expected, atol=1e-14)


def test_training_points_add_up_to_the_weight_change():
    # Contributions of training rows on the training copy are the step itself:
    # lr_s sum_i sum_k e_{s,i,k} g_k(x_i; w_s) == w_{s+1} - w_s for every step, and the
    # recorded output gradients of the mean cross-entropy are 1/|B| at the label.
    X, y = make_data()
    module, path = trained(mlp(nn.Tanh), X, y, max_iter=2)
    ref = engine(module, path, X, y, quadrature="dpk")
    for step in range(path.n_steps):
        batch = torch.as_tensor(path.batches[step])
        expected = torch.zeros(batch.numel(), 3, dtype=torch.float64)
        expected[torch.arange(batch.numel()), y[batch]] = 1.0 / batch.numel()
        torch.testing.assert_close(path.output_gradients[step], expected, rtol=0, atol=1e-15)
        moved = path.learning_rates[step] * ref._training_gradients(step).sum(0)
        torch.testing.assert_close(moved, path.step_direction(step), rtol=0, atol=1e-14)


def test_riemann_error_decreases_like_one_over_t_on_relu():
    X, y = make_data()
    module, path = trained(mlp(nn.ReLU, width=16), X, y)
    errors = [
        sum_identity_error(
            engine(module, path, X, y, quadrature="riemann", n_points=T).decompose(queries())
        )
        for T in (4, 16, 64)
    ]
    ratios = np.array(errors[:-1]) / np.array(errors[1:])
    assert errors[-1] > 1e-8  # not exact: the integrand jumps at the kinks
    np.testing.assert_allclose(ratios, 4.0, rtol=0.35)


def test_quadrature_error_is_the_per_step_error_and_bounds_the_sum_identity():
    X, y = make_data()
    module, path = trained(mlp(nn.ReLU, width=16), X, y)
    ref = engine(module, path, X, y, quadrature="riemann", n_points=5)
    result = ref.decompose(queries())
    gaps = np.abs(result.bias + result.contributions.sum(1) - result.output).max(1)
    assert np.all(gaps <= result.quadrature_error + 1e-14)
    np.testing.assert_allclose(
        ref.certificate(queries()), result.quadrature_error, rtol=0, atol=1e-15
    )


@pytest.mark.parametrize(
    "params",
    [
        {"batch_size": 7, "max_iter": 3},
        {"learning_rate": lambda step: 0.6 / (1 + step)},
        {"batch_size": 10, "learning_rate": lambda step: 0.3 + 0.1 * (step % 2), "max_iter": 3},
    ],
    ids=["mini-batch", "schedule", "both"],
)
def test_sum_identity_with_minibatches_and_schedules(params):
    X, y = make_data()
    sample_weight = torch.linspace(0.5, 2.0, N_TRAIN, dtype=DTYPE)
    module, path = trained(mlp(nn.Tanh), X, y, sample_weight=sample_weight, **params)
    if "batch_size" in params:
        assert len(path.batches[0]) < N_TRAIN
    result = engine(module, path, X, y, quadrature="gauss", n_points=12).decompose(queries())
    assert sum_identity_error(result) < 1e-10


def test_query_tiles_do_not_change_the_result():
    X, y = make_data()
    module, path = trained(mlp(nn.Tanh), X, y, batch_size=10, max_iter=2)
    whole = engine(module, path, X, y, quadrature="gauss", n_points=3)
    tiled = engine(module, path, X, y, quadrature="gauss", n_points=3, tile_size=6)
    a, b = whole.decompose(queries(9)), tiled.decompose(queries(9))
    np.testing.assert_allclose(a.contributions, b.contributions, rtol=0, atol=1e-15)
    A = torch.cat([queries(5), X[:6]])
    mask = np.arange(11) >= 5
    np.testing.assert_allclose(
        whole.gram(A, a_train=mask), tiled.gram(A, a_train=mask), rtol=1e-13, atol=1e-13
    )


# -- Gram matrices ---------------------------------------------------------------------


def assert_symmetric_psd(gram):
    np.testing.assert_allclose(gram, gram.T, rtol=1e-12, atol=1e-12)
    eigenvalues = np.linalg.eigvalsh(gram)
    assert eigenvalues.min() > -1e-10 * eigenvalues.max()


def test_training_gram_is_symmetric_psd(tanh_engine):
    ref, X, _ = tanh_engine
    assert_symmetric_psd(ref.gram(X[:12], a_train=True))


def test_test_gram_is_symmetric_psd(tanh_engine):
    ref, _, _ = tanh_engine
    assert_symmetric_psd(ref.gram(queries(10), a_train=False))


def test_gram_blocks_agree_with_the_copies(tanh_engine):
    ref, X, _ = tanh_engine
    Q = queries(4)
    A = torch.cat([Q, X[:5]])
    mask = np.arange(9) >= 4
    mixed = ref.gram(A, a_train=mask)
    np.testing.assert_allclose(mixed, mixed.T, rtol=1e-12, atol=1e-12)
    cross = ref.gram(Q, X[:5], a_train=False, b_train=True)
    np.testing.assert_allclose(mixed[:4, 4:], cross, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(mixed[4:, 4:], ref.gram(X[:5], a_train=True), rtol=1e-13)
    np.testing.assert_allclose(mixed[:4, :4], ref.gram(Q), rtol=1e-13)
    # The same point on the two copies is not the same feature.
    assert not np.allclose(ref.gram(X[:3], a_train=True), ref.gram(X[:3], a_train=False))


def test_diag_matches_gram(tanh_engine):
    ref, X, _ = tanh_engine
    A = torch.cat([queries(3), X[:4]])
    mask = np.arange(7) >= 3
    np.testing.assert_allclose(ref.diag(A, a_train=mask), np.diag(ref.gram(A, a_train=mask)))


def test_full_gram_trace_is_the_scalar_gram(tanh_engine):
    ref, X, _ = tanh_engine
    A = torch.cat([queries(3), X[:3]])
    mask = np.arange(6) >= 3
    full = ref.gram(A, X[5:9], a_train=mask, b_train=True, output="full")
    assert full.shape == (6, 4, N_CLASSES, N_CLASSES)
    scalar = ref.gram(A, X[5:9], a_train=mask, b_train=True)
    np.testing.assert_allclose(np.einsum("abkk->ab", full), scalar, rtol=1e-13)
    symmetric = ref.gram(A, a_train=mask, output="full")
    np.testing.assert_allclose(symmetric, symmetric.transpose(1, 0, 3, 2), rtol=1e-12, atol=1e-13)


def test_query_by_training_gram_reproduces_the_decomposition(tanh_engine):
    # With full-batch equal coefficients per step the decomposition is the full
    # kernel weighted by a_{s,i}; for one step the trace picks output y_i.
    ref, X, y = tanh_engine
    Q = queries(3)
    full = ref.gram(Q, X, a_train=False, b_train=True, output="full")
    contributions = ref.decompose(Q).contributions
    assert all(np.array_equal(b, np.arange(N_TRAIN)) for b in ref.path.batches)  # full batch
    assert np.all(ref.path.learning_rates == ref.path.learning_rates[0])
    coefficient = ref.path.learning_rates[0] / N_TRAIN
    expected = coefficient * full[:, np.arange(N_TRAIN), :, y.numpy()]
    np.testing.assert_allclose(contributions, expected.transpose(1, 0, 2), rtol=1e-12, atol=1e-14)


def test_bad_output_is_rejected(tanh_engine):
    ref, X, _ = tanh_engine
    with pytest.raises(ValueError, match="trace"):
        ref.gram(X[:2], output="diag")


# -- the fast engine against the reference -------------------------------------------


@pytest.mark.parametrize(
    "activation, fast_rule, reference_rule, atol",
    [
        # "exact" on a smooth network is 4 Gauss nodes per step (no kinks to split
        # at): about 1e-11 off the converged reference, within its certificate.
        (nn.Tanh, {"quadrature": "exact"}, {"quadrature": "gauss", "n_points": 16}, 5e-11),
        (
            nn.ReLU,
            {"quadrature": "riemann", "n_points": 7},
            {"quadrature": "riemann", "n_points": 7},
            1e-12,
        ),
        (nn.ReLU, {"quadrature": "dpk"}, {"quadrature": "dpk"}, 1e-12),
    ],
    ids=["tanh-exact-vs-gauss", "relu-riemann", "relu-dpk"],
)
def test_fast_engine_agrees_with_the_reference(activation, fast_rule, reference_rule, atol):
    engine_module = pytest.importorskip("sklearn_pathkernel._engine._facade")
    X, y = make_data()
    module, path = trained(mlp(activation), X, y, batch_size=12, max_iter=1)
    fast = engine_module.PathKernelEngine(module, path, X, **fast_rule)
    ref = engine(module, path, X, y, **reference_rule)
    Q = queries(4)
    A, mask = torch.cat([Q, X[:5]]), np.arange(9) >= 4
    fast_parts, ref_parts = fast.decompose(Q), ref.decompose(Q)
    np.testing.assert_allclose(fast_parts.contributions, ref_parts.contributions, rtol=0, atol=atol)
    if fast_rule == reference_rule:  # same nodes: same quadrature error
        np.testing.assert_allclose(
            fast_parts.quadrature_error, ref_parts.quadrature_error, rtol=1e-9, atol=1e-14
        )
    for output in ("trace", "full"):
        expected = ref.gram(A, a_train=mask, output=output)
        np.testing.assert_allclose(
            fast.gram(A, a_train=mask, output=output), expected, rtol=1e-11, atol=atol
        )
    np.testing.assert_allclose(
        fast.diag(A, a_train=mask), ref.diag(A, a_train=mask), rtol=1e-11, atol=atol
    )
