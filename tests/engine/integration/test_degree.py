"""The path degree analysis and the node counts it gives the exact rule.

The degrees are checked against what the architecture gives by hand (the number
of moving multiplications along the longest path), and independently against
the network itself: ``f`` evaluated along a step, on a piece with no kink, is
fitted exactly by a polynomial of the analysed degree and not of one less.
The reduced node counts are checked against today's 4 and 12 nodes per piece
on regressors: the same decomposition and Grams to rounding.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel._engine import _facade
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine.integration._degree import NodeCounts, PathDegree, path_degree
from sklearn_pathkernel._engine.integration._quadrature import TEST_TEST_NODES
from sklearn_pathkernel._nn._builders import make_distance_network
from sklearn_pathkernel._path import log_softmax
from sklearn_pathkernel._training import SolverSettings
from sklearn_pathkernel._training._loop import train_module
from sklearn_pathkernel._training._losses import SquaredError

DTYPE = torch.float64


def identity(out):
    return out


def mlp(*sizes, activation=nn.ReLU):
    torch.manual_seed(0)
    layers = []
    for width_in, width_out in zip(sizes[:-2], sizes[1:-1], strict=True):
        layers += [nn.Linear(width_in, width_out), activation()]
    return nn.Sequential(*layers, nn.Linear(sizes[-2], sizes[-1])).to(DTYPE)


class CNN(nn.Module):
    """conv, ReLU, 2x2 max-pool, linear, on 6x6 images: degree 2."""

    def __init__(self, n_outputs=2):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Linear(3 * 3 * 3, n_outputs)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv(x.view(-1, 1, 6, 6))), 2)
        return self.head(x.flatten(1))


class TwoConvCNN(nn.Module):
    """conv, ReLU, conv, ReLU, 2x2 max-pool, linear: degree 3."""

    def __init__(self, n_outputs=2):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3, padding=1)
        self.conv2 = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3 * 3 * 3, n_outputs)

    def forward(self, x):
        x = torch.relu(self.conv1(x.view(-1, 1, 6, 6)))
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class Squared(nn.Module):
    """A linear layer, its output times itself, a linear layer: degree 3."""

    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(5, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.first(x)
        return self.last(h * h)


class Scaled(nn.Module):
    """Divides by a function of a moving tensor: no polynomial."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 2)

    def forward(self, x):
        out = self.layer(x)
        return out / (1.0 + out.abs().sum(1, keepdim=True))


def names(module):
    return [name for name, _ in module.named_parameters()]


def degree(module, n_features=5, link=identity, path_names=None):
    module = module.to(DTYPE)
    example = torch.rand(2, n_features, dtype=DTYPE)
    return path_degree(module, names(module) if path_names is None else path_names, example, link)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_an_mlp_has_the_degree_of_its_number_of_linear_layers(depth):
    sizes = [5] + [6] * (depth - 1) + [2]
    assert degree(mlp(*sizes)) == PathDegree(depth)


@pytest.mark.parametrize(
    "activation", [nn.ReLU, nn.LeakyReLU, nn.Hardtanh, nn.ReLU6, nn.Identity, nn.Dropout]
)
def test_piecewise_linear_activations_keep_the_degree(activation):
    assert degree(mlp(5, 6, 6, 2, activation=activation).eval()).degree == 3


@pytest.mark.parametrize(("module", "expected"), [(CNN, 2), (TwoConvCNN, 3)])
def test_convolutional_networks(module, expected):
    assert degree(module(), n_features=36).degree == expected


@pytest.mark.parametrize("activation", [nn.Tanh, nn.GELU, nn.Sigmoid, nn.Softplus])
def test_smooth_activations_are_no_polynomial(activation):
    result = degree(mlp(5, 6, 2, activation=activation))
    assert result.degree is None
    assert "of a moving tensor" in result.reason


def test_the_classifiers_link_is_no_polynomial():
    result = degree(mlp(5, 6, 2), link=log_softmax)
    assert result == PathDegree(None, "log_softmax of a moving tensor")


def test_a_distance_network_is_no_polynomial():
    X = torch.rand(20, 5, dtype=DTYPE)
    network = make_distance_network(X, 3, (4,), "sqeuclidean", "kmeans++", "log1p", "linear")
    assert degree(network).degree is None


class Head(nn.Module):
    """``operation(first(x))`` into a linear layer: degree ``deg(operation) + 1``."""

    def __init__(self, operation):
        super().__init__()
        self.first, self.last, self.operation = nn.Linear(5, 4), nn.Linear(4, 2), operation

    def forward(self, x):
        return self.last(self.operation(self.first(x)))


@pytest.mark.parametrize(
    ("operation", "expected"),
    [
        (lambda h: h * h, 3),
        (lambda h: h**2, 3),
        (lambda h: h**3 + h, 4),
        (lambda h: h / 2.0 - h.abs(), 2),
        (lambda h: h / torch.full_like(h, 3.0), 2),
        (lambda h: torch.cat([h[:, :2], F.max_pool1d(h[:, None], 2).flatten(1)], 1), 2),
        (lambda h: h.sum(1, keepdim=True) @ torch.ones(1, 4, dtype=DTYPE), 2),
        (lambda h: torch.einsum("ij,ij->ij", h, h), 3),
        (lambda h: 1.0 / (1.0 + h), None),
        (lambda h: h**0.5, None),
        (lambda h: h.exp(), None),
        (lambda h: torch.where(h > 0, h, 0.0), None),
        (lambda h: h.max(1, keepdim=True).values.expand(-1, 4), None),
    ],
)
def test_operations_of_moving_tensors(operation, expected):
    assert degree(Head(operation)).degree == expected


def test_a_division_by_a_moving_tensor_is_no_polynomial():
    assert degree(Squared()).degree == 3
    assert degree(Scaled()).degree is None


def test_frozen_layers_are_constants():
    module = mlp(5, 6, 6, 2)
    assert degree(module, path_names=["4.weight", "4.bias"]).degree == 1
    assert degree(module, path_names=["2.weight", "4.weight"]).degree == 2
    assert degree(module, path_names=[]).degree == 0
    # a first layer's bias passes through fixed layers: degree 1, not 3
    assert degree(module, path_names=["0.bias"]).degree == 1
    assert degree(module, path_names=["0.bias", "4.weight"]).degree == 2
    assert degree(module, path_names=["4.bias"]).degree == 1


def test_the_analysis_leaves_the_module_as_it_was():
    module = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).to(DTYPE)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    example = torch.rand(4, 5, dtype=DTYPE)
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    result = path_degree(module, names(module), example, identity)
    assert result.degree is None  # batch norm in training mode: batch statistics
    assert torch.equal(torch.rand(1), expected)
    for key, value in module.state_dict().items():
        assert torch.equal(value, state[key])


@pytest.mark.parametrize("module", [mlp(5, 6, 2), mlp(5, 6, 6, 2), mlp(5, 4, 4, 4, 2), Squared()])
def test_the_degree_is_that_of_f_along_a_step(module):
    """Independent of the rules: ``f(w + t dw)`` along a whole step is a polynomial
    of exactly the analysed degree. Positive weights, inputs and direction keep
    every ReLU on (no kink), so the step is one smooth piece."""
    module = module.to(DTYPE)
    D = degree(module).degree
    x = torch.rand(3, 5, dtype=DTYPE)
    torch.manual_seed(1)
    params = {k: p.detach().abs() for k, p in module.named_parameters()}
    direction = {k: torch.rand_like(p) * p for k, p in params.items()}
    t = np.linspace(0.0, 1.0, 12)
    with torch.no_grad():
        values = np.stack(
            [
                torch.func.functional_call(
                    module, {k: p + s * direction[k] for k, p in params.items()}, (x,)
                ).numpy()
                for s in t
            ]
        ).reshape(len(t), -1)
    scale = np.abs(values).max()

    def misfit(deg):
        coeffs = np.polynomial.polynomial.polyfit(t, values, deg)
        return np.abs(np.polynomial.polynomial.polyval(t, coeffs).T - values).max() / scale

    assert misfit(D) < 1e-12
    assert misfit(D - 1) > 1e-8  # (rounding: 1e-15)


@pytest.mark.parametrize(
    ("degree", "n_nodes", "expected"),
    [
        (None, 4, (4, 12)),
        (0, 4, (1, 1)),
        (1, 4, (1, 1)),
        (2, 4, (1, 2)),
        (3, 4, (2, 3)),
        (4, 4, (2, 4)),
        (9, 4, (4, 9)),
        (20, 4, (4, 12)),
        (9, 2, (2, 6)),
    ],
)
def test_node_counts(degree, n_nodes, expected):
    counts = NodeCounts.of(degree, n_nodes, TEST_TEST_NODES)
    assert (counts.per_piece, counts.test_test) == expected
    assert counts.degree == degree


# -- the reduced nodes against today's -------------------------------------------------


def _unknown_degree(*args):
    return PathDegree(None, "forced by the test")


def trained(module, X, targets, solver, batch_size=None, loss=None, learning_rate=0.2):
    """``module`` trained 4 steps on ``(X, targets)`` (Adam: learning rate 0.05)."""
    module = module.to(DTYPE)
    path = train_module(
        module,
        X,
        targets,
        loss=loss,
        solver=SolverSettings(solver),
        learning_rate=0.05 if solver == "adam" else learning_rate,
        max_iter=4,
        batch_size=batch_size,
        random_state=0,
    ).path
    return module, path, X


def trained_regressor(module, n_features, solver, batch_size=None):
    rng = np.random.RandomState(0)
    X = torch.tensor(rng.rand(24, n_features))
    return trained(module, X, torch.tensor(rng.randn(24, 2)), solver, batch_size, SquaredError())


CASES = {
    "mlp/sgd": (lambda: mlp(5, 8, 2), 5, "sgd", None, 1),
    "mlp3/sgd/mini": (lambda: mlp(5, 8, 6, 2), 5, "sgd", 8, 2),
    "mlp/adam": (lambda: mlp(5, 8, 2), 5, "adam", None, 1),
    "cnn/sgd": (CNN, 36, "sgd", None, 1),
    "cnn2/sgd": (TwoConvCNN, 36, "sgd", None, 2),
    "cnn2/adam": (TwoConvCNN, 36, "adam", None, 2),
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c == "cnn2/adam" else c for c in CASES],
)
def test_reduced_nodes_give_the_same_kernel(case, monkeypatch):
    make, n_features, solver, batch_size, per_piece = CASES[case]
    module, path, X = trained_regressor(make(), n_features, solver, batch_size)
    Q = torch.tensor(np.random.RandomState(1).rand(5, n_features) * 1.5)
    loss = SquaredError()
    reduced = PathKernelEngine(module, path, X, link=loss.output_link)
    assert reduced.nodes.per_piece == per_piece
    assert reduced.nodes.test_test == reduced.nodes.degree < TEST_TEST_NODES * 4
    monkeypatch.setattr(_facade, "path_degree", _unknown_degree)
    full = PathKernelEngine(module, path, X, link=loss.output_link)
    assert (full.nodes.per_piece, full.nodes.test_test) == (4, 12)

    ours, theirs = reduced.decompose(Q), full.decompose(Q)
    scale = np.abs(theirs.contributions).max()
    assert np.abs(ours.contributions - theirs.contributions).max() <= 1e-12 * scale
    total = ours.bias + ours.contributions.sum(1) + ours.decay
    assert np.abs(total - ours.output).max() <= 1e-9
    assert ours.quadrature_error.max() <= 1e-10

    for ours_gram, their_gram in [
        (reduced.gram(Q), full.gram(Q)),  # test x test: D nodes against 12
        (reduced.gram(Q, X, b_train=True), full.gram(Q, X, b_train=True)),
        (reduced.diag(Q), full.diag(Q)),
    ]:
        assert np.abs(ours_gram - their_gram).max() <= 1e-12 * np.abs(their_gram).max()


def test_fixed_rules_keep_their_nodes():
    module, path, X = trained_regressor(mlp(5, 8, 2), 5, "sgd")
    for quadrature in ("riemann", "dpk", "midpoint", "gauss"):
        engine = PathKernelEngine(
            module, path, X, link=SquaredError().output_link, quadrature=quadrature
        )
        assert (engine.nodes.per_piece, engine.nodes.test_test) == (4, 12)
    exact = PathKernelEngine(module, path, X, link=SquaredError().output_link)
    assert (exact.nodes.per_piece, exact.nodes.test_test, exact.nodes.degree) == (1, 2, 2)


def test_a_classifier_gets_the_logits_degree_in_nodes():
    """``f`` (log-softmax) is no polynomial, its logits are: ``D`` nodes with
    Jacobian weights (``test_link_weights.py``), 12 for the test x test Gram."""
    module = mlp(5, 8, 3)
    rng = np.random.RandomState(0)
    X, y = torch.tensor(rng.rand(20, 5)), torch.tensor(rng.randint(0, 3, 20))
    path = train_module(module, X, y, learning_rate=0.2, max_iter=2, random_state=0).path
    engine = PathKernelEngine(module, path, X)
    assert engine.nodes == NodeCounts(2, 12, None)
