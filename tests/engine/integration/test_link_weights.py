"""The classifiers' exact route: Jacobian-weighted cotangents at the logits.

Checked against independent computations: the weights ``W_q`` against an
adaptive scalar integration (``scipy.integrate.quad_vec``) of ``J(z(t)) g(t)`` for
polynomials ``z`` and ``g``; the link's weighted Jacobians against autograd's
Jacobian of the link; the probe's per-node cotangents against per-example
Jacobians of the logits (``torch.func``, as the brute-force reference); and the
engine's decomposition and Grams against a fine quadrature (24 Gauss-Legendre
nodes per piece with the link's own cotangents, the scalar route) on MLP (SGD,
Adam, mini-batches), CNN and two-convolution CNN classifiers.
"""

import numpy as np
import pytest
import torch
from scipy.integrate import quad_vec
from test_degree import CNN, TwoConvCNN, _unknown_degree, mlp, trained
from torch import nn

from sklearn_pathkernel._engine import _facade
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._engine.integration._link_weights import (
    ORDERS,
    GaussWeights,
    JacobianWeights,
    gauss_on_unit,
    interpolation_points,
)
from sklearn_pathkernel._path import FunctionLink, IdentityLink, LogSoftmaxLink, log_softmax
from sklearn_pathkernel._training._loop import train_module
from sklearn_pathkernel._training._losses import CrossEntropy, SquaredError

DTYPE = torch.float64


def softmax_jacobian(z):
    p = np.exp(z - z.max())
    p /= p.sum()
    return np.eye(z.size) - np.outer(np.ones(z.size), p)


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_piece_weights_integrate_the_jacobian_times_any_gradient(degree, scale):
    """``sum_q W_q g(t_q) = int_a^b J(z(t)) g(t) dt`` for ``z`` of degree ``D``
    and every ``g`` of degree ``D - 1`` (``scale``: a softmax that saturates and
    switches inside the piece)."""
    rng = np.random.RandomState(degree)
    K, a, b = 4, 0.3, 0.7
    z_coeffs = scale * rng.randn(degree + 1, K)  # z(t) = sum_i c_i ((t - a) / (b - a))^i
    g_coeffs = rng.randn(max(1, degree), K, 3)

    def z(t):
        u = (t - a) / (b - a)
        return sum(c * u**i for i, c in enumerate(z_coeffs))

    def g(t):
        u = (t - a) / (b - a)
        return sum(c * u**i for i, c in enumerate(g_coeffs))

    expected, error = quad_vec(
        lambda t: softmax_jacobian(z(t)) @ g(t), a, b, epsabs=1e-15, epsrel=1e-14, limit=1000
    )
    assert error < 1e-12
    weighting = JacobianWeights(LogSoftmaxLink(), degree)
    points = a + (b - a) * interpolation_points(degree)
    logits = torch.tensor(np.stack([z(t) for t in points]))[None]
    W = weighting.piece_weights(logits, torch.tensor([b - a], dtype=DTYPE))[0].numpy()
    nodes = a + (b - a) * gauss_on_unit(weighting.nodes_per_piece)[0]
    ours = sum(W[q] @ g(t) for q, t in enumerate(nodes))
    assert np.abs(ours - expected).max() <= 1e-12 * np.abs(expected).max()


def test_a_sharp_transition_takes_higher_orders():
    """Two logits crossing with slope 300 in a piece of width 1: the first
    orders disagree, the weights come from higher ones (against the closed form)."""
    weighting = JacobianWeights(LogSoftmaxLink(), 1)
    points = interpolation_points(1)
    logits = torch.tensor([[[300.0 * (t - 0.45), 0.0] for t in points]], dtype=DTYPE)
    coarse, fine = weighting._integrals(logits, ORDERS[:2]).chunk(2, dim=1)
    assert (coarse - fine).abs().max() > 1e-6
    W = weighting.piece_weights(logits, torch.ones(1, dtype=DTYPE))[0, 0].numpy()
    # int_0^1 sigmoid(s (t - c)) dt = [log(1 + exp(s (t - c))) / s]_0^1, and J = I - 1 p^T
    s, c = 300.0, 0.45
    p0 = (np.logaddexp(0.0, s * (1 - c)) - np.logaddexp(0.0, -s * c)) / s
    expected = np.eye(2) - np.outer(np.ones(2), [p0, 1.0 - p0])
    assert np.abs(W - expected).max() <= 1e-13


@pytest.mark.parametrize("link", [LogSoftmaxLink(), IdentityLink()])
def test_weighted_jacobians_are_autograds(link):
    rng = np.random.RandomState(0)
    z = torch.tensor(3.0 * rng.randn(2, 5, 4))
    c = torch.tensor(rng.randn(3, 5))
    jacobians = torch.stack(
        [
            torch.stack([torch.func.jacrev(link)(z[p, m][None])[0, :, 0] for m in range(5)])
            for p in range(2)
        ]
    )  # (P, M, K, K)
    expected = torch.einsum("qm,pmkj->pqkj", c, jacobians)
    assert torch.allclose(link.weighted_jacobians(c, z), expected, rtol=0, atol=1e-14)


def test_a_callable_link_has_no_closed_form():
    link = FunctionLink(log_softmax)
    assert not link.closed_form
    with pytest.raises(NotImplementedError, match="closed-form Jacobian"):
        link.weighted_jacobians(torch.ones(1, 1), torch.ones(1, 1, 2))
    assert isinstance(CrossEntropy().output_link, LogSoftmaxLink)
    assert isinstance(SquaredError().output_link, IdentityLink)


def test_the_probe_back_propagates_cotangents_at_the_logits():
    """Row ``i``'s ``k``-th gradient is ``sum_j C[i, k, j] grad z_j``: against
    per-example Jacobians of the logits (``torch.func``), at per-row ``t``."""
    module = mlp(5, 6, 3).to(DTYPE)
    rng = np.random.RandomState(0)
    X = torch.tensor(rng.rand(4, 5))
    y = torch.tensor(rng.randint(0, 3, 4))
    path = train_module(module, X, y, learning_rate=0.3, max_iter=2, random_state=0).path
    start, end = path.weights[0], path.weights[1]
    t = torch.tensor([0.1, 0.5, 0.5, 0.9], dtype=DTYPE)
    C = torch.tensor(rng.randn(4, 3, 3))
    probe = NetworkProbe(module, path, X[:1])
    factors = probe.factors(start, X, direction=end - start, t=t, cotangents=C)
    got = torch.cat([rule.materialise(f) for rule, f in zip(probe.rules, factors, strict=True)], 2)

    def logits(weights, x):
        return torch.func.functional_call(module, path.unflatten(weights), (x[None],))[0]

    weights = start + t[:, None] * (end - start)
    J = torch.func.vmap(torch.func.jacrev(logits))(weights, X)  # (n, K, W)
    expected = torch.einsum("nkj,njw->nkw", C, J)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=0, atol=1e-13 * expected.abs().max())


def trained_classifier(module, n_features, solver, batch_size=None, n_classes=3):
    rng = np.random.RandomState(0)
    X = torch.tensor(rng.rand(24, n_features))
    y = torch.tensor(rng.randint(0, n_classes, 24))
    return trained(module, X, y, solver, batch_size, learning_rate=0.5)


CASES = {
    "mlp/sgd": (lambda: mlp(5, 8, 3), 5, "sgd", None, 2),
    "mlp/adam": (lambda: mlp(5, 8, 3), 5, "adam", None, 2),
    "mlp3/sgd/mini": (lambda: mlp(5, 8, 6, 3), 5, "sgd", 8, 3),
    "cnn/sgd": (lambda: CNN(3), 36, "sgd", None, 2),
    "cnn2/sgd/mini": (lambda: TwoConvCNN(3), 36, "sgd", 8, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_jacobian_route_is_exact(case, monkeypatch):
    """Against a fine quadrature: 24 nodes per piece, scalar Gauss weights."""
    make, n_features, solver, batch_size, per_piece = CASES[case]
    module, path, X = trained_classifier(make(), n_features, solver, batch_size)
    Q = torch.tensor(np.random.RandomState(1).rand(5, n_features) * 1.5)
    ours = PathKernelEngine(module, path, X)
    assert isinstance(ours._weighting, JacobianWeights)
    assert (ours.nodes.per_piece, ours.nodes.test_test) == (per_piece, 12)
    monkeypatch.setattr(_facade, "path_degree", _unknown_degree)
    fine = PathKernelEngine(module, path, X, n_nodes=24)
    assert isinstance(fine._weighting, GaussWeights)
    mine, theirs = ours.decompose(Q), fine.decompose(Q)
    scale = np.abs(theirs.contributions).max()
    assert np.abs(mine.contributions - theirs.contributions).max() <= 1e-12 * scale
    total = mine.bias + mine.contributions.sum(1) + mine.decay
    assert np.abs(total - mine.output).max() <= 1e-9
    # the certificate, computed as before from the network's own change
    certificate = ours.certificate(Q)
    assert np.abs(certificate - mine.quadrature_error).max() <= 1e-14
    assert certificate.max() <= 1e-12
    for our_gram, their_gram in [
        (ours.gram(Q, X, b_train=True), fine.gram(Q, X, b_train=True)),
        (ours.diag(Q), fine.diag(Q)),
    ]:
        assert np.abs(our_gram - their_gram).max() <= 1e-12 * np.abs(their_gram).max()


def test_todays_nodes_where_the_logits_are_no_polynomial(monkeypatch):
    """tanh, the whole-network Jacobian rule, a fixed rule and a degree above
    ``n_nodes`` keep the Gauss weights and ``n_nodes`` nodes."""
    module, path, X = trained_classifier(mlp(5, 8, 3, activation=nn.Tanh), 5, "sgd")
    engine = PathKernelEngine(module, path, X)
    assert isinstance(engine._weighting, GaussWeights)
    assert (engine.nodes.per_piece, engine.nodes.test_test) == (4, 12)
    module, path, X = trained_classifier(mlp(5, 8, 3), 5, "sgd")
    assert isinstance(PathKernelEngine(module, path, X, n_nodes=1)._weighting, GaussWeights)
    riemann = PathKernelEngine(module, path, X, quadrature="riemann", n_points=5)
    assert isinstance(riemann._weighting, GaussWeights)
    monkeypatch.setattr(NetworkProbe, "__init__", _forced_jacobian(NetworkProbe.__init__))
    engine = PathKernelEngine(module, path, X)
    assert engine.probe.jacobian is not None
    assert isinstance(engine._weighting, GaussWeights)
    assert engine.nodes.per_piece == 4


def _forced_jacobian(init):
    def forced(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "force_jacobian": True})

    return forced


def test_pieces_split_across_passes(monkeypatch):
    """Passes of a few rows each (whole pieces per pass): the same features."""
    module, path, X = trained_classifier(CNN(3), 36, "sgd")
    Q = torch.tensor(np.random.RandomState(1).rand(4, 36) * 1.5)
    engine = PathKernelEngine(module, path, X)
    expected = engine.decompose(Q).contributions
    monkeypatch.setattr(engine._planner, "pass_rows", lambda one_output=False: 3)
    got = engine.decompose(Q).contributions
    assert np.abs(got - expected).max() <= 1e-13 * np.abs(expected).max()
