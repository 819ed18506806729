"""A catalogue of user modules: each one is either EXACT or REFUSED.

EXACT: after training, the decomposition adds up to the network's own
log-probabilities (``bias + contributions.sum(1) + decay == predict_log_proba``
to 1e-9), the certificate ``residual`` says so too, and the training Gram is a
symmetric positive semi-definite matrix.

REFUSED: ``fit`` raises a ``ValueError`` whose message names the cause. Nothing
in between: a module is never silently wrong.

One module is EXACT for the decomposition only: BatchNorm in training mode (its
rows coupled through the batch) decomposes exactly, and its Gram matrices are
refused by name (``test_batch_norm_in_training_mode``).
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import make_blobs
from sklearn.preprocessing import StandardScaler
from torch import nn

from sklearn_pathkernel import DistanceLayer, ExactPathKernelClassifier
from sklearn_pathkernel._engine.rules._generic import GenericRule
from sklearn_pathkernel._engine.rules._jacobian import JacobianRule

N_FEATURES, N_CLASSES = 6, 3
SUM_TOL = 1e-9
EIGEN_TOL = 1e-9


@pytest.fixture(scope="module")
def data():
    X, y = make_blobs(n_samples=40, n_features=N_FEATURES, centers=N_CLASSES, random_state=0)
    return StandardScaler().fit_transform(X), y


def seeded(build):
    """A module built with torch's generator seeded (the global state is kept)."""

    def make():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return build()

    return make


def mlp(hidden=8):
    return nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, N_CLASSES))


# -- EXACT -------------------------------------------------------------------------


def frozen_first_layer():
    module = mlp()
    module[0].requires_grad_(False)
    return module


def frozen_bias():
    module = mlp()
    module[2].bias.requires_grad_(False)
    return module


class SameLinearTwice(nn.Module):
    """One layer applied twice: its weights are used at two places of the network."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(N_FEATURES, N_FEATURES)
        self.head = nn.Linear(N_FEATURES, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.shared(h))
        return self.head(h)


class TiedDecoder(nn.Module):
    """``decoder.weight`` is ``encoder.weight`` (one parameter, two layers)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(N_FEATURES, 8)
        self.hidden = nn.Linear(8, N_FEATURES)
        self.decoder = nn.Linear(N_FEATURES, 8)
        self.decoder.weight = self.encoder.weight
        self.head = nn.Linear(8, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        h = torch.tanh(self.hidden(h))
        h = torch.tanh(self.decoder(h))
        return self.head(h)


class SelfAttention(nn.Module):
    """Each row is a sequence of 3 tokens of width 2, attending to each other."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(2, 1, batch_first=True)
        self.head = nn.Linear(N_FEATURES, N_CLASSES)

    def forward(self, x):
        tokens = x.reshape(x.shape[0], 3, 2)
        attended, _ = self.attention(tokens, tokens, tokens)
        return self.head(attended.reshape(x.shape[0], -1))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(N_FEATURES, 8)
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, N_CLASSES)

    def forward(self, x):
        h = self.first(x)
        h = h + self.inner(torch.tanh(h))
        return self.head(torch.tanh(h))


class WithBuffers(nn.Module):
    """Fixed input scaling held in buffers (state, not parameters)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, N_FEATURES))
        self.register_buffer("shift", torch.linspace(-0.2, 0.2, N_FEATURES))
        self.net = mlp()

    def forward(self, x):
        return self.net(x * self.scale + self.shift)


def normalised(norm):
    return nn.Sequential(nn.Linear(N_FEATURES, 8), norm, nn.Tanh(), nn.Linear(8, N_CLASSES))


def batch_norm_eval():
    module = normalised(nn.BatchNorm1d(8))
    with torch.no_grad():  # the running statistics of some earlier training
        module[1].running_mean.uniform_(-0.5, 0.5)
        module[1].running_var.uniform_(0.5, 2.0)
    return module.eval()


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, kernel_size=3)
        self.head = nn.Linear(4 * (N_FEATURES - 2), N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.conv(x.unsqueeze(1)))
        return self.head(h.flatten(1))


class Conv2dNet(nn.Module):
    """groups=1, zero padding: the factored Conv2d rule."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=2, padding=1)
        self.head = nn.Linear(4 * 3 * 4, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.conv(x.reshape(x.shape[0], 1, 2, 3)))
        return self.head(h.flatten(1))


def distance_net(kernel):
    return nn.Sequential(DistanceLayer(N_FEATURES, 8, kernel=kernel), nn.Linear(8, N_CLASSES))


class DirectParameters(nn.Module):
    """Parameters of the module itself, used in its own forward."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, N_FEATURES) / N_FEATURES**0.5)
        self.bias = nn.Parameter(torch.zeros(8))
        self.head = nn.Linear(8, N_CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.weight.T + self.bias))


class WeightUsedOutsideItsLayer(nn.Module):
    """``first.weight`` also used by the parent's forward, outside ``first``."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(N_FEATURES, 8)
        self.head = nn.Linear(8, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        back = F.linear(h, self.first.weight.T)  # (n, N_FEATURES)
        return self.head(h + 0.1 * torch.tanh(F.linear(back, self.first.weight)))


# How the engine computes the gradients' inner products (see the user guide, "Which
# modules"): "factored" (Linear / Conv2d / distance rules only), "per-layer" (some
# layer by its own torch.func rule), "whole-network" (the torch.func fallback).
FACTORED, PER_LAYER, WHOLE_NETWORK = "factored", "per-layer", "whole-network"

# name -> (module factory, route, expected warning or None)
EXACT = {
    "mlp": (mlp, FACTORED, None),
    "frozen-first-layer": (frozen_first_layer, FACTORED, None),
    "frozen-bias": (frozen_bias, FACTORED, None),
    "same-linear-twice": (SameLinearTwice, WHOLE_NETWORK, None),
    "tied-decoder-weight": (TiedDecoder, WHOLE_NETWORK, None),
    "self-attention": (SelfAttention, WHOLE_NETWORK, None),
    "residual": (Residual, FACTORED, None),
    "buffers": (WithBuffers, FACTORED, None),
    "layer-norm": (lambda: normalised(nn.LayerNorm(8)), PER_LAYER, None),
    "group-norm": (lambda: normalised(nn.GroupNorm(2, 8)), PER_LAYER, None),
    "batch-norm-eval": (batch_norm_eval, PER_LAYER, None),
    # trained with dropout, its masks recorded (the training side), the query side in eval
    "dropout": (lambda: normalised(nn.Dropout(0.3)), FACTORED, None),
    "alpha-dropout": (lambda: normalised(nn.AlphaDropout(0.3)), FACTORED, "Dropout is disabled"),
    "conv1d": (Conv1dNet, PER_LAYER, None),
    "conv2d": (Conv2dNet, FACTORED, None),
    "distance-rbf": (lambda: distance_net("rbf"), FACTORED, None),
    "distance-cosine": (lambda: distance_net("cosine"), FACTORED, None),
    "distance-laplacian": (lambda: distance_net("laplacian"), PER_LAYER, None),
    "direct-parameters": (DirectParameters, WHOLE_NETWORK, None),
    "weight-used-outside-its-layer": (WeightUsedOutsideItsLayer, WHOLE_NETWORK, None),
}


# -- REFUSED -----------------------------------------------------------------------


class Transformed(nn.Module):
    def __init__(self, transform):
        super().__init__()
        self.net = mlp()
        self.transform = transform

    def forward(self, x):
        return self.transform(self.net(x))


class CenterBatch(nn.Module):
    """Subtracts the batch mean: each row's output depends on the other rows."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


class Noise(nn.Module):
    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


class SubclassedBatchNorm(nn.BatchNorm1d):
    """A subclass may override forward: not followed in training mode."""


# name -> (module factory, the cause the message must name)
REFUSED = {
    "batch-norm-subclass-train": (
        lambda: normalised(SubclassedBatchNorm(8)),
        r"layer '1' \(SubclassedBatchNorm\) is in training mode: only nn.BatchNorm1d",
    ),
    "wrong-shape": (
        lambda: nn.Linear(N_FEATURES, 2),
        r"outputs of shape \(1, 2\) for one sample, but the target has 3 classes",
    ),
    "float32-output": (
        lambda: Transformed(lambda out: out.float()),
        r"computed in float64.*the module's output is float32",
    ),
    "nan-output": (
        lambda: Transformed(lambda out: out * torch.nan),
        r"output at its initial weights contains NaN",
    ),
    "tuple-output": (lambda: Transformed(lambda out: (out, out)), r"it returned a tuple"),
    "couples-rows": (
        lambda: normalised(CenterBatch()),
        r"couples the rows of a batch.*first at layer '1' \(CenterBatch\)",
    ),
    "random": (
        lambda: normalised(Noise()),
        r"output is random.*first at layer '1' \(Noise\)",
    ),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_exact(data, name):
    X, y = data
    build, route, warning = EXACT[name]
    module = seeded(build)()
    clf = ExactPathKernelClassifier(module=module, max_iter=15, learning_rate=0.1, random_state=0)
    if warning is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            clf.fit(X, y)
    else:
        with pytest.warns(UserWarning, match=warning):
            clf.fit(X, y)

    parts = clf.decompose(X[:5])
    total = parts.bias + parts.contributions.sum(axis=1) + parts.get("decay", 0.0)
    log_proba = clf.predict_log_proba(X[:5])
    assert np.abs(total - log_proba).max() <= SUM_TOL
    assert parts.residual.max() <= SUM_TOL
    # Training moved the network: the identity is not the trivial bias == output.
    assert np.abs(parts.contributions.sum(axis=1)).max() > 1e-3

    gram = clf.kernel_(X)
    assert gram.shape == (X.shape[0], X.shape[0])
    assert np.array_equal(gram, gram.T)
    eigenvalues = np.linalg.eigvalsh(gram)
    assert eigenvalues.min() >= -EIGEN_TOL * np.abs(eigenvalues).max()
    assert route_of(clf) == route


def test_batch_norm_in_training_mode(data):
    """Trained with batch statistics: the decomposition is exact against the eval-mode
    network (running statistics); the Gram matrices are refused by name."""
    X, y = data
    module = seeded(lambda: normalised(nn.BatchNorm1d(8)))()
    clf = ExactPathKernelClassifier(
        module=module, max_iter=15, learning_rate=0.1, batch_size=10, random_state=0
    ).fit(X, y)
    parts = clf.decompose(X[:5])
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    assert np.abs(total - clf.predict_log_proba(X[:5])).max() <= SUM_TOL
    assert parts.residual.max() <= SUM_TOL
    assert np.abs(parts.statistics.sum(axis=1)).max() > 1e-3
    with pytest.raises(NotImplementedError, match="BatchNorm trained in training mode"):
        clf.kernel_(X)
    assert route_of(clf) == WHOLE_NETWORK


def route_of(clf):
    probe = clf._engine().probe
    if probe.fallback_reason is not None:
        assert [type(rule) for rule in probe.rules] == [JacobianRule]
        return WHOLE_NETWORK
    if any(isinstance(rule, GenericRule) for rule in probe.rules):
        return PER_LAYER
    return FACTORED


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused(data, name):
    X, y = data
    build, cause = REFUSED[name]
    clf = ExactPathKernelClassifier(
        module=seeded(build)(), max_iter=15, learning_rate=0.1, random_state=0
    )
    with pytest.raises(ValueError, match=cause):
        clf.fit(X, y)
    assert not hasattr(clf, "module_")
