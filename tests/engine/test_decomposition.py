"""Decomposition: the sum identity on many networks and paths, and the
contributions against the brute-force kernel (``conftest.brute_force``)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel._training._loop import train_module

DTYPE = torch.float64


ARCHITECTURES = {
    "relu-1": lambda mlp: mlp([5, 16, 3], zero_head=True),
    "relu-2": lambda mlp: mlp([5, 12, 10, 3]),
    "relu-3": lambda mlp: mlp([5, 10, 8, 8, 3]),
    "tanh": lambda mlp: mlp([5, 12, 3], nn.Tanh),
    "gelu": lambda mlp: mlp([5, 12, 10, 3], nn.GELU),
    "softplus": lambda mlp: mlp([5, 12, 3], nn.Softplus),
    "leaky-relu": lambda mlp: mlp([5, 12, 10, 3], nn.LeakyReLU),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_sum_identity_mlps(name, engine_cases):
    module, path, X, y = engine_cases.trained(ARCHITECTURES[name](engine_cases.mlp))
    A = torch.cat([engine_cases.queries(5), X[:3]])  # training points too, on the test copy
    parts = engine_cases.engine_for(module, path, X, y).decompose(A)
    reconstructed = parts.bias + parts.contributions.sum(axis=1)
    with torch.no_grad():
        network = F.log_softmax(module(A), 1).numpy()
    np.testing.assert_allclose(parts.output, network, rtol=0, atol=1e-12)
    assert np.abs(reconstructed - network).max() < 1e-9
    assert parts.quadrature_error.max() < 1e-9


def test_sum_identity_cnn_with_max_pool(engine_cases):
    module, path, X, y = engine_cases.trained(
        engine_cases.SmallCNN(3), n_features=36, n=30, steps=10, lr=0.3
    )
    A = engine_cases.queries(36, n=5)
    parts = engine_cases.engine_for(module, path, X, y).decompose(A)
    with torch.no_grad():
        network = F.log_softmax(module(A), 1).numpy()
    assert np.abs(parts.bias + parts.contributions.sum(1) - network).max() < 1e-9


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 7},  # mini-batches, shuffled
        {"learning_rate": lambda step: 0.6 / (1 + 0.2 * step)},  # a schedule
        {"sample_weight": torch.linspace(0.2, 2.0, 40, dtype=DTYPE)},
    ],
    ids=["mini-batch", "schedule", "sample-weight"],
)
def test_sum_identity_other_paths(kwargs, engine_cases):
    torch.manual_seed(0)
    module = engine_cases.mlp([5, 12, 3])
    X, y = engine_cases.blobs(40, 5, 3, 0)
    lr = kwargs.pop("learning_rate", 0.5)
    path = train_module(module, X, y, learning_rate=lr, max_iter=4, random_state=0, **kwargs).path
    A = engine_cases.queries(5)
    parts = engine_cases.engine_for(module, path, X, y).decompose(A)
    with torch.no_grad():
        network = F.log_softmax(module(A), 1).numpy()
    assert np.abs(parts.bias + parts.contributions.sum(1) - network).max() < 1e-9


def test_training_points_outside_a_batch_contribute_nothing_in_that_step(engine_cases):
    torch.manual_seed(0)
    module = engine_cases.mlp([5, 8, 3])
    X, y = engine_cases.blobs(20, 5, 3, 0)
    path = train_module(module, X, y, learning_rate=0.5, max_iter=1, batch_size=5).path
    engine = engine_cases.engine_for(module, path, X, y)
    total = engine.decompose(engine_cases.queries(5)).contributions
    used = np.zeros(20, dtype=bool)
    for batch in path.batches:
        used[batch] = True
    assert used.all()  # one epoch: every point in exactly one batch, each contributes
    assert (np.abs(total).sum(axis=(0, 2)) > 0).all()


def test_decomposition_matches_brute_force(smooth_case, engine_cases):
    module, path, X, y, A, (contributions, *_) = smooth_case
    parts = engine_cases.engine_for(module, path, X, y).decompose(A)
    # Exact to the quadrature's certificate (1e-11 absolute per step): compared
    # relative to the largest contribution, not entry by entry.
    expected = contributions.numpy()
    np.testing.assert_allclose(
        parts.contributions, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max()
    )


def test_sum_identity_distance_network(engine_cases):
    from sklearn_pathkernel import DistanceKernelClassifier

    X, y = engine_cases.blobs(30, 3, 3, 0)
    clf = DistanceKernelClassifier(hidden_layer_sizes=(4,), max_iter=5, random_state=0)
    clf.fit(X.numpy(), y.numpy())
    A = engine_cases.queries(3, n=4)
    parts = clf.decompose(A.numpy())
    assert (
        np.abs(parts.bias + parts.contributions.sum(1) - clf.predict_log_proba(A.numpy())).max()
        < 1e-9
    )
