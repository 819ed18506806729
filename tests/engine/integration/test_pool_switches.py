"""Closed-form kinks of convolutional networks (ReLU and max-pool over a first
convolution, and one moving layer further down) against the regula-falsi search,
and the windows of a max-pool against torch's own indices."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._engine.integration import _kinks
from sklearn_pathkernel._engine.integration._kinks import row_kinks
from sklearn_pathkernel._engine.integration._pool_switches import pool_windows
from sklearn_pathkernel._path import WeightPath

DTYPE = torch.float64


class ConvPool(nn.Module):
    """conv 1->3 3x3, ReLU, 2x2 max-pool, linear (``pool_first``: pool, then ReLU)."""

    def __init__(self, pool_first=False):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.head = nn.Linear(3 * 3 * 3, 2)
        self.pool_first = pool_first

    def forward(self, x):
        x = self.conv(x.view(-1, 1, 8, 8))
        x = torch.relu(F.max_pool2d(x, 2)) if self.pool_first else F.max_pool2d(torch.relu(x), 2)
        return self.head(x.flatten(1))


class TwoConv(nn.Module):
    """conv 1->2 3x3 pad 1, ReLU, conv 2->3 3x3 pad 1, ReLU, 2x2 max-pool, linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3, padding=1)
        self.conv2 = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        x = torch.relu(self.conv1(x.view(-1, 1, 8, 8)))
        return self.head(F.max_pool2d(torch.relu(self.conv2(x)), 2).flatten(1))


class Pool1d(nn.Module):
    """Linear 6->12, ReLU, max_pool1d (3, stride 2, padding 1), linear."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 12)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        x = torch.relu(self.first(x))[:, None]
        return self.head(F.max_pool1d(x, 3, stride=2, padding=1)[:, 0])


def _step(module, n_rows, n_features, seed, length):
    torch.manual_seed(seed)
    module = module.to(DTYPE)
    named = list(module.named_parameters())
    start = torch.cat([p.detach().reshape(-1) for _, p in named])
    direction = length * torch.randn_like(start)
    path = WeightPath(
        weights=torch.stack([start, start + direction]),
        param_names=[name for name, _ in named],
        param_shapes=[tuple(p.shape) for _, p in named],
    )
    X = torch.randn(n_rows, n_features, dtype=DTYPE)
    return NetworkProbe(module, path, X[:1]), start, direction, X


CASES = {
    "relu-then-pool": (lambda: ConvPool(), 64, 0.3),
    "pool-then-relu": (lambda: ConvPool(pool_first=True), 64, 0.3),
    "two-convolutions": (TwoConv, 64, 0.1),
    "pool1d-padded": (Pool1d, 6, 0.5),
}


def _searched(monkeypatch, probe, start, direction, X):
    """The kinks with no closed form: regula falsi on every switching value."""
    with monkeypatch.context() as patch:
        patch.setattr(_kinks, "POLYNOMIAL_RTOL", -1.0)
        return row_kinks(probe, start, direction, X, np.arange(X.shape[0])).kinks


def _no_search(monkeypatch, probe, start, direction, X):
    """The kinks of ``row_kinks``, checking that it left none to the search."""
    calls = []
    original = _kinks.locate_kinks

    def counted(*args, **kwargs):
        calls.append(args[1].t.shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(_kinks, "locate_kinks", counted)
    kinks = row_kinks(probe, start, direction, X, np.arange(X.shape[0])).kinks
    assert calls == []  # every kink in closed form: nothing left to the search
    return kinks


def _lines(probe, start, direction, x):
    """The convolution's outputs ``alpha + t beta`` (36 positions, 3 channels) in
    extended precision, from the weights, by im2col: independent of the engine."""
    image = x.view(8, 8).numpy().astype(np.longdouble)
    patches = np.stack([image[i : i + 3, j : j + 3].ravel() for i in range(6) for j in range(6)])
    coefficients = []
    for weights in (probe.path.unflatten(start), probe.path.unflatten(direction)):
        kernel = weights["conv.weight"].numpy().reshape(3, 9).astype(np.longdouble)
        coefficients.append(patches @ kernel.T + weights["conv.bias"].numpy())
    return coefficients


def _reference_kinks(probe, start, direction, x, pool_first):
    """Every switch of ``ConvPool`` along the step, by enumeration: the ReLUs' zeros,
    and the crossings of two entries of a 2x2 window at which they are its largest
    (and, ReLU first, positive: below zero every entry is 0 and nothing switches)."""
    alpha, beta = _lines(probe, start, direction, x)
    found = []
    with np.errstate(divide="ignore", invalid="ignore"):
        for c in range(3):
            for wi in range(3):
                for wj in range(3):
                    members = [(2 * wi + di) * 6 + 2 * wj + dj for di in (0, 1) for dj in (0, 1)]
                    a, b = alpha[members, c], beta[members, c]
                    if not pool_first:
                        found += [t for t in -a / b if 0 < t < 1]
                    for i in range(4):
                        for j in range(i + 1, 4):
                            t = (a[j] - a[i]) / (b[i] - b[j])
                            value = a[i] + t * b[i]
                            top = (a + t * b).max()
                            if 0 < t < 1 and value >= top - 1e-15 and (pool_first or value > 0):
                                found.append(t)
                    if pool_first:  # the ReLU of the window's winner
                        for t in -a / b:
                            if 0 < t < 1 and (a + t * b).max() <= 1e-15:
                                found.append(t)
    return np.sort(np.array(found, dtype=float))


@pytest.mark.parametrize("pool_first", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_pool_kinks_of_a_first_convolution_are_its_closed_form(monkeypatch, pool_first, seed):
    probe, start, direction, X = _step(ConvPool(pool_first), 5, 64, seed, 0.3)
    kinks = _no_search(monkeypatch, probe, start, direction, X)
    for found, x in zip(kinks, X, strict=True):
        expected = _reference_kinks(probe, start, direction, x, pool_first)
        assert expected.size > 3  # several kinks per row, pool crossings among them
        np.testing.assert_allclose(found, expected, rtol=0, atol=1e-12)


#: Regula falsi brackets a kink to 4e-13 in t, but the crossing of two nearly
#: parallel entries is only known to rounding over their slopes' difference: the
#: search (which compares the rounded winners) lands up to ~3e-11 from the
#: extended-precision crossing that the closed form matches to ~2e-15 (above).
SEARCH_ATOL = 1e-10


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_closed_forms_find_the_kinks_the_search_finds(monkeypatch, case, seed):
    make, n_features, length = CASES[case]
    probe, start, direction, X = _step(make(), 3, n_features, seed, length)
    closed = _no_search(monkeypatch, probe, start, direction, X)
    searched = _searched(monkeypatch, probe, start, direction, X)
    assert sum(k.size for k in searched) > X.shape[0]  # several kinks per row
    for found, expected in zip(closed, searched, strict=True):
        np.testing.assert_allclose(found, expected, rtol=0, atol=SEARCH_ATOL)


def test_the_pool_kinks_are_where_the_winner_changes():
    """A pool directly over a first convolution: every kink the closed form finds
    that is no ReLU kink changes the winner of some window there."""
    probe, start, direction, X = _step(ConvPool(pool_first=True), 4, 64, 3, 0.4)
    kinks = row_kinks(probe, start, direction, X, np.arange(X.shape[0])).kinks
    assert sum(k.size for k in kinks) > 0
    module = probe.module
    for row, row_kinks_ in zip(X, kinks, strict=True):
        for t in row_kinks_:
            winners = []
            for side in (t - 1e-9, t + 1e-9):
                params = probe.path.unflatten(start + side * direction)
                z = F.conv2d(row.view(1, 1, 8, 8), params["conv.weight"], params["conv.bias"])
                winners.append(F.max_pool2d_with_indices(z, 2)[1])
                pre = F.max_pool2d(z, 2)
            changed = (winners[0] != winners[1]).any()
            near_zero = (pre.abs() < 1e-6).any()  # a ReLU kink there instead
            assert changed or near_zero
    assert module is probe.module


@pytest.mark.parametrize(
    "shape, kernel, stride, padding, dilation",
    [
        ((6, 6), 2, None, 0, 1),
        ((7, 5), 3, 2, 1, 1),
        ((8, 8), (2, 3), (1, 2), (1, 0), (2, 1)),
    ],
)
def test_windows_hold_torchs_winners(shape, kernel, stride, padding, dilation):
    torch.manual_seed(0)
    x = torch.randn(2, 3, *shape, dtype=DTYPE)
    args = (x, kernel, stride, padding, dilation)
    windows = pool_windows(args, {}, 2)
    out, indices = F.max_pool2d_with_indices(*args)
    values = x.flatten(2)
    assert windows.shape[0] == out[0, 0].numel()
    gathered = values[:, :, windows.clamp(min=0)].masked_fill(windows < 0, -torch.inf)
    best = gathered.argmax(-1)
    torch.testing.assert_close(windows[torch.arange(windows.shape[0]), best], indices.flatten(2))
    torch.testing.assert_close(gathered.amax(-1), out.flatten(2))


def test_windows_of_unsupported_pools_are_unknown():
    x = torch.randn(1, 1, 4, 4, 4)
    assert pool_windows((x, 2), {}, 3) is None
    assert pool_windows((x[:, :, 0], 3), {"ceil_mode": True, "stride": 2}, 2) is None


@pytest.mark.slow  # the search alone takes over a second
def test_decomposition_of_a_cnn_is_that_of_the_search(monkeypatch, engine_cases):
    """A trained CNN's decomposition, kinks in closed form or searched: the same
    contributions, and the sum identity holds on images with flat (tied) regions."""
    cases = engine_cases
    module, path, X, y = cases.trained(cases.SmallCNN(3), n=20, n_features=36, steps=3, lr=0.5)
    A = cases.queries(36, n=3)
    A[:, :12] = 0.0  # the top two rows of every image blank: tied pool windows
    decompositions = []
    for rtol in (_kinks.POLYNOMIAL_RTOL, -1.0):
        with monkeypatch.context() as patch:
            patch.setattr(_kinks, "POLYNOMIAL_RTOL", rtol)
            engine = cases.engine_for(module, path, X, y)
            decompositions.append(engine.decompose(A))
    closed, searched = decompositions
    scale = np.abs(searched.contributions).max()
    np.testing.assert_allclose(closed.contributions, searched.contributions, atol=1e-9 * scale)
    identity = closed.bias + closed.contributions.sum(1) + closed.decay - closed.output
    assert np.abs(identity).max() <= 1e-9
    assert closed.quadrature_error.max() <= 1e-10
