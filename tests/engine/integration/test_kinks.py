"""Kinks of a one-hidden-layer ReLU network against their closed form.

Along ``w(t) = w_s + t (w_{s+1} - w_s)`` a hidden unit's pre-activation
``z(t) = (W + t dW) x + (b + t db)`` is linear in ``t``, so it changes sign at
``t* = -z(0) / (z(1) - z(0))``: the kinks of row ``x`` are the ``t*`` in (0, 1).
"""

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._engine.integration import _kinks
from sklearn_pathkernel._engine.integration._kinks import KinkSearch, row_kinks
from sklearn_pathkernel._path import WeightPath

DTYPE = torch.float64


def one_hidden_layer(seed=0, n_rows=9, width=12):
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2)).to(DTYPE)
    named = list(module.named_parameters())
    start = torch.cat([p.detach().reshape(-1) for _, p in named])
    direction = 0.8 * torch.randn_like(start)  # a long step: many units switch
    path = WeightPath(
        weights=torch.stack([start, start + direction]),
        param_names=[name for name, _ in named],
        param_shapes=[tuple(p.shape) for _, p in named],
    )
    X = torch.randn(n_rows, 3, dtype=DTYPE)
    return NetworkProbe(module, path, X[:1]), path, start, direction, X


def closed_form_kinks(path, start, direction, X):
    """Per row, the sorted ``t*`` in (0, 1) of the hidden units' pre-activations."""
    w0, w1 = path.unflatten(start), path.unflatten(start + direction)
    z0 = (X @ w0["0.weight"].T + w0["0.bias"]).numpy()
    z1 = (X @ w1["0.weight"].T + w1["0.bias"]).numpy()
    t = -z0 / (z1 - z0)
    return [np.sort(row[(row > 0) & (row < 1)]) for row in t]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kinks_of_a_relu_layer_are_its_closed_form_crossings(seed):
    probe, path, start, direction, X = one_hidden_layer(seed)
    search = row_kinks(probe, start, direction, X, np.arange(X.shape[0]))
    assert isinstance(search, KinkSearch)
    expected = closed_form_kinks(path, start, direction, X)
    assert sum(len(row) for row in expected) > X.shape[0]  # several kinks per row
    for found, row in zip(search.kinks, expected, strict=True):
        np.testing.assert_allclose(found, row, rtol=0, atol=1e-14)


def test_the_search_locates_the_same_kinks(monkeypatch):
    """With no switching value taken as a polynomial, regula falsi locates them."""
    probe, path, start, direction, X = one_hidden_layer(3)
    monkeypatch.setattr(_kinks, "POLYNOMIAL_RTOL", -1.0)
    search = row_kinks(probe, start, direction, X, np.arange(X.shape[0]))
    for found, row in zip(search.kinks, closed_form_kinks(path, start, direction, X), strict=True):
        np.testing.assert_allclose(found, row, rtol=0, atol=1e-12)


def test_the_search_returns_the_ends_of_the_step():
    probe, path, start, direction, X = one_hidden_layer(4)
    ends = row_kinks(probe, start, direction, X, np.arange(X.shape[0]), grid=(0.0, 0.5, 1.0)).ends
    for f, scale, weights in (
        (ends.f_start, ends.scale_start, start),
        (ends.f_end, ends.scale_end, start + direction),
    ):
        expected, expected_scale = probe.output_with_scale(weights, X)
        torch.testing.assert_close(f, expected, rtol=0, atol=1e-14)
        torch.testing.assert_close(scale, expected_scale, rtol=0, atol=1e-14)


class _TwoConvPool(nn.Module):
    """conv 1->3 3x3, ReLU, 2x2 max-pool, conv 3->4 3x3, ReLU, 2x2 max-pool, linear:
    the 28x28 benchmark CNN's shape on 10x10 images (three levels of kinks)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3)
        self.conv2 = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 1 * 1, 2)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x.view(-1, 1, 10, 10))), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def test_settled_layers_are_not_fitted_again_and_the_kinks_stay(monkeypatch):
    """``row_kinks``: switch tensors and pools solved on every piece of a level
    (``Settled``: the first convolution's ReLUs, linear along the step) are not
    fitted on the next levels' sub-pieces, and the kinks are those of a search
    that fits every tensor at every level."""
    torch.manual_seed(0)
    module = _TwoConvPool().to(DTYPE)
    named = list(module.named_parameters())
    start = torch.cat([p.detach().reshape(-1) for _, p in named])
    direction = 0.5 * torch.randn_like(start)
    path = WeightPath(
        weights=torch.stack([start, start + direction]),
        param_names=[name for name, _ in named],
        param_shapes=[tuple(p.shape) for _, p in named],
    )
    X = torch.rand(6, 100, dtype=DTYPE)
    probe = NetworkProbe(module, path, X[:1])
    levels = []
    of = _kinks.Settled.of.__func__

    def recorded(cls, solved):
        settled = of(cls, solved)
        levels.append(settled)
        return settled

    monkeypatch.setattr(_kinks.Settled, "of", classmethod(recorded))
    search = row_kinks(probe, start, direction, X, np.arange(X.shape[0]))
    assert len(levels) >= 2 and levels[0].switches[0]  # the first ReLUs, settled at once
    assert not all(levels[0].switches + levels[0].pools)  # a later level had work left
    monkeypatch.setattr(
        _kinks.Settled,
        "of",
        classmethod(
            lambda cls, solved: cls([False] * len(solved.switches), [False] * len(solved.pools))
        ),
    )
    every = row_kinks(probe, start, direction, X, np.arange(X.shape[0]))
    assert sum(row.size for row in search.kinks) > 3 * X.shape[0]
    for found, expected in zip(search.kinks, every.kinks, strict=True):
        np.testing.assert_allclose(found, expected, rtol=0, atol=_kinks.KINK_MERGE)
