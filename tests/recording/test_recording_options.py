"""A Recording's options (quadrature, n_points, n_jobs, verbose): checked, and followed."""

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import TrainingRecorder


def _recording(dtype):
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(12, 4, generator=generator, dtype=dtype)
    y = torch.arange(12) % 3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    for step in range(6):
        rows = torch.arange(step % 2, 12, 2)
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    return recorder.finish(), X


def test_options_are_followed_by_the_next_computation():
    recording, X = _recording(torch.float64)
    queries = X[:3] + 0.1
    exact = recording.decompose(queries)
    assert exact.residual.max() < 1e-12
    recording.quadrature = "dpk"  # one node per step: a visible quadrature error
    dpk = recording.decompose(queries)
    assert dpk.residual.max() > 1e3 * exact.residual.max()
    recording.quadrature, recording.n_points = "riemann", 3
    three = recording.decompose(queries).residual.max()
    recording.n_points = 300
    assert recording.decompose(queries).residual.max() < three
    recording.quadrature, recording.n_jobs = "exact", 2
    parallel = recording.decompose(queries)
    np.testing.assert_allclose(parallel.contributions, exact.contributions, rtol=1e-12, atol=1e-15)
    assert recording._engine().n_jobs == 2
    recording.verbose = 1
    assert recording._engine().verbose == 1
    assert recording._engine().stepwise().verbose == 1


def test_float32_replay_is_kept_when_options_change():
    recording, X = _recording(torch.float32)
    before = recording.decompose(X[:2])
    replay = recording._float64_run()
    recording.n_jobs = 2
    after = recording.decompose(X[:2])
    assert recording._float64_run() is replay
    np.testing.assert_allclose(after.contributions, before.contributions, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("quadrature", "simpson", "'quadrature' parameter of Recording must be a str among"),
        ("n_points", 0, "'n_points' parameter of Recording must be an int in the range"),
        ("n_jobs", 1.5, "'n_jobs' parameter of Recording must be an instance of 'int'"),
        ("verbose", -1, "'verbose' parameter of Recording"),
    ],
)
def test_bad_options_are_named(name, value, message):
    recording, X = _recording(torch.float64)
    setattr(recording, name, value)
    with pytest.raises(ValueError, match=message):
        recording.decompose(X[:1])


def test_pickle_keeps_the_options():
    recording, X = _recording(torch.float64)
    recording.n_points, recording.verbose = 7, 0
    recording.decompose(X[:1])
    clone = pickle.loads(pickle.dumps(recording))
    assert clone._engine_cache is None and clone._replay_cache is None
    assert clone.n_points == 7
    np.testing.assert_array_equal(
        clone.decompose(X[:2]).contributions, recording.decompose(X[:2]).contributions
    )


def test_decompose_in_batches_of_rows():
    recording, X = _recording(torch.float64)
    whole = recording.decompose(X[:5] + 0.1)
    batched = recording.decompose(X[:5] + 0.1, batch_size=2)
    np.testing.assert_allclose(batched.contributions, whole.contributions, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(batched.output, whole.output)
    with pytest.raises(ValueError, match="batch_size == 0"):
        recording.decompose(X[:2], batch_size=0)
