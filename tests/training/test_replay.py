"""The float64 replay's helpers: the rounding bound read in blocks of rows, and the
float64 run of a float64 path (the path itself).

Independent computation: the bound's formula written out over the whole path at once.
"""

import numpy as np
import pytest
import torch
from sklearn.datasets import make_blobs

from sklearn_pathkernel import ExactPathKernelClassifier
from sklearn_pathkernel._training import _replay
from sklearn_pathkernel._training._replay import ROUNDING_STEPS, float64_run, replay_bound


@pytest.fixture(scope="module")
def fitted():
    X, y = make_blobs(n_samples=40, centers=3, n_features=4, random_state=0)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(6,), max_iter=5, batch_size=10, random_state=0, dtype="float32"
    )
    return clf.fit(X, y)


def whole_path_bound(path):
    """The formula of :func:`replay_bound` with every step converted at once."""
    u, bounds, offset = 2.0**-24, {}, 0
    for name, shape in zip(path.param_names, path.param_shapes, strict=True):
        numel = int(np.prod(shape))
        w = path.weights.double()[:, offset : offset + numel]
        sizes = w[1:].abs().amax(dim=1) + w.diff(dim=0).abs().amax(dim=1)
        bounds[name] = ROUNDING_STEPS * u * float(sizes.sum())
        offset += numel
    return bounds


@pytest.mark.parametrize("block", [1, 3, 64])
def test_replay_bound_read_in_blocks_of_rows(fitted, monkeypatch, block):
    """The bound is read ``ROW_BLOCK`` steps at a time (the float32 path is never
    converted whole) and is the formula's, whatever the block."""
    monkeypatch.setattr(_replay, "ROW_BLOCK", block)
    path = fitted.path_
    assert path.n_steps == 20 and path.weights.dtype == torch.float32
    expected = whole_path_bound(path)
    for name, bound in replay_bound(path).items():
        assert bound == pytest.approx(expected[name], rel=1e-12)


def test_float64_run_of_a_float64_path_is_the_path(fitted):
    path64 = fitted.path_.astype(torch.float64)
    run = float64_run(fitted.module_, path64, fitted._fit_X, fitted._loss.link)
    assert run.path is path64
    assert all(p.dtype == torch.float64 for p in run.module.parameters())
    assert run.module.training is False
    flat = torch.cat([p.reshape(-1) for p in run.module.parameters()])
    assert torch.equal(flat, path64.weights[-1])  # (the float32 final weights, widened)
