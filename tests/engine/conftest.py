"""Shared builders, cases and independent references of the engine's tests.

The independent references: the network's own output (the sum identity), and a
brute-force EPK built from materialised per-example Jacobians (``torch.func``)
with high-order quadrature on smooth networks (:func:`brute_force`). The
builders reach the tests through the ``engine_cases`` fixture.
"""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap

from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._training._loop import train_module

DTYPE = torch.float64


def blobs(n, n_features, n_classes, seed):
    rng = np.random.RandomState(seed)
    centers = 2.0 * rng.randn(n_classes, n_features)
    y = rng.randint(0, n_classes, n)
    X = centers[y] + rng.randn(n, n_features)
    return torch.tensor(X), torch.tensor(y)


def mlp(sizes, activation=nn.ReLU, zero_head=False, seed=0):
    torch.manual_seed(seed)  # every test network starts from the same weights
    layers = []
    for width_in, width_out in zip(sizes[:-2], sizes[1:-1], strict=True):
        layers += [nn.Linear(width_in, width_out), activation()]
    head = nn.Linear(sizes[-2], sizes[-1])
    if zero_head:
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    return nn.Sequential(*layers, head).to(DTYPE)


class SmallCNN(nn.Module):
    """Conv -> ReLU -> max-pool -> linear, on 6x6 single-channel images."""

    def __init__(self, n_classes):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Linear(3 * 3 * 3, n_classes)

    def forward(self, x):
        x = x.view(-1, 1, 6, 6)
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.head(x.flatten(1))


class TwoConvCNN(nn.Module):
    """The 28x28 CNN's layers on 10x10 images (100 features): conv, ReLU, max-pool,
    conv, ReLU, max-pool, linear."""

    def __init__(self, n_classes=3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3)
        self.conv2 = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, n_classes)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x.view(-1, 1, 10, 10))), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def trained(module, n=40, n_features=5, n_classes=3, seed=0, steps=12, lr=0.5, **kwargs):
    torch.manual_seed(seed)
    module = module.to(DTYPE)
    X, y = blobs(n, n_features, n_classes, seed)
    result = train_module(
        module, X, y, learning_rate=lr, max_iter=steps, random_state=seed, **kwargs
    )
    return module, result.path, X, y


def engine_for(module, path, X, y, **kwargs):
    return PathKernelEngine(module, path, X, **kwargs)


def queries(n_features, n=7, seed=1):
    return torch.tensor(np.random.RandomState(seed).randn(n, n_features) * 1.5)


# -- brute force ------------------------------------------------------------------


def jacobians(module, path, flat, X):
    """Per-example Jacobians of log_softmax outputs, (n, K, W), by torch.func."""

    def f(w, x):
        return F.log_softmax(functional_call(module, path.unflatten(w), (x[None],)), 1)[0]

    return vmap(jacrev(f), in_dims=(None, 0))(flat, X)


def jacobians_along(module, path, start, direction, t, X):
    """Jacobians at every ``start + t_q direction`` at once: (T, n, K, W)."""
    weights = start[None] + torch.as_tensor(t, dtype=DTYPE)[:, None] * direction[None]

    def f(w, x):
        return F.log_softmax(functional_call(module, path.unflatten(w), (x[None],)), 1)[0]

    return vmap(vmap(jacrev(f), in_dims=(None, 0)), in_dims=(0, None))(weights, X)


def brute_force(module, path, X_train, y_train, A, rule=("gauss", 24)):
    """Decomposition and Grams from materialised Jacobians.

    ``rule`` is ("gauss", n) Gauss-Legendre nodes (fast convergence on smooth
    networks) or ("midpoint", T) (O(1/T) across kinks, for ReLU networks).
    """
    kind, n_points = rule
    if kind == "gauss":
        nodes, weights = np.polynomial.legendre.leggauss(n_points)
        nodes, weights = 0.5 * (nodes + 1), 0.5 * weights
    else:
        nodes, weights = (np.arange(n_points) + 0.5) / n_points, np.full(n_points, 1 / n_points)
    nu = torch.as_tensor(weights, dtype=DTYPE)
    M, n = X_train.shape[0], A.shape[0]
    K = jacobians(module, path, path.weights[0], A[:1]).shape[1]
    contributions = torch.zeros(n, M, K, dtype=DTYPE)
    gram_train = torch.zeros(M, M, dtype=DTYPE)
    gram_test_train = torch.zeros(n, M, K, K, dtype=DTYPE)
    gram_test = torch.zeros(n, n, dtype=DTYPE)
    for s in range(path.n_steps):
        start, direction = path.weights[s], path.step_direction(s)
        J_train = jacobians(module, path, start, X_train)
        J_test = jacobians_along(module, path, start, direction, nodes, A)  # (T, n, K, W)
        phi = torch.einsum("q,qnkw->nkw", nu, J_test)
        gram_test += torch.einsum("q,qnkw,qmkw->nm", nu, J_test, J_test)
        gram_train += torch.einsum("nkw,mkw->nm", J_train, J_train)
        gram_test_train += torch.einsum("nkw,mjw->nmkj", phi, J_train)
        batch = torch.as_tensor(path.batches[s])
        g_y = J_train[batch, y_train[batch]]  # (|B|, W)
        coefficient = path.learning_rates[s] / batch.numel()  # the mean over the batch
        contributions[:, batch] += torch.einsum("nkw,bw->nbk", phi, g_y) * coefficient
    return contributions, gram_train, gram_test_train, gram_test


def image_distance_classifier(n_rows, n_queries, **params):
    """A small fitted ``DistanceKernelClassifier(image_shape=(6, 6))`` with one
    convolutional distance layer (its outputs wide next to its factors), its
    ``n_rows`` training images and ``n_queries`` query images; ``params`` set the
    estimator's other parameters."""
    from sklearn_pathkernel import DistanceKernelClassifier

    rng = np.random.RandomState(0)
    y = rng.randint(0, 3, n_rows)
    X = np.clip(rng.rand(3, 36)[y] + 0.3 * rng.rand(n_rows, 36), 0, 1)
    params = {"max_iter": 3, **params}
    clf = DistanceKernelClassifier(
        image_shape=(6, 6), conv_layers=((3, 3, 1, 1, 2),), hidden_layer_sizes=(7,),
        random_state=0, **params,
    )  # fmt: skip
    return clf.fit(X, y), X, rng.rand(n_queries, 36)


def factor_tensors(factor):
    """A factor object's tensors by name (dataclasses with slots, or plain objects)."""
    if dataclasses.is_dataclass(factor):
        items = {field.name: getattr(factor, field.name) for field in dataclasses.fields(factor)}
    else:
        items = vars(factor)
    return {name: value for name, value in items.items() if torch.is_tensor(value)}


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def engine_cases():
    """The builders above: ``blobs``, ``mlp``, ``SmallCNN``, ``TwoConvCNN``, ``trained``,
    ``engine_for``, ``queries``, the ``brute_force`` reference, ``factor_tensors`` and
    ``image_distance_classifier``."""
    return SimpleNamespace(
        DTYPE=DTYPE,
        blobs=blobs,
        mlp=mlp,
        SmallCNN=SmallCNN,
        TwoConvCNN=TwoConvCNN,
        trained=trained,
        engine_for=engine_for,
        queries=queries,
        brute_force=brute_force,
        factor_tensors=factor_tensors,
        image_distance_classifier=image_distance_classifier,
    )


@pytest.fixture(scope="session")
def smooth_case():
    """A tanh MLP 4-6-3, five steps, six queries, and its brute-force kernel."""
    module, path, X, y = trained(mlp([4, 6, 3], nn.Tanh), n=15, n_features=4, steps=5)
    A = queries(4, n=6)
    return module, path, X, y, A, brute_force(module, path, X, y, A)


@pytest.fixture(scope="session")
def relu_case():
    """A ReLU MLP 5-16-12-3 trained eight steps on 30 points, and nine queries."""
    module, path, X, y = trained(mlp([5, 16, 12, 3]), n=30, steps=8)
    return module, path, X, y, queries(5, n=9)


@pytest.fixture(scope="module")
def dask_client():
    """A client of a dask cluster of two worker processes, one thread each (per
    test module: starting one takes seconds)."""
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            worker_dashboard_address=None,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client
