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
