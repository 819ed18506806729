"""The step log's Adam preconditioners: computed at the path's first read, not in
``finish``, and bitwise torch.optim.Adam's own :math:`P_s`."""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._path import Deferred


def _adam_run(dtype, n_steps=70):
    """A recorded AdamW loop (more steps than the host arrays' first capacity, 64),
    and, per step, torch's second moments and step counts (copied by a hook of the
    test's own, after the recorder's)."""
    torch.manual_seed(0)
    X = torch.randn(40, 5, dtype=dtype)
    y = torch.randint(0, 3, (40,))
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    recorder = TrainingRecorder(model, optimizer, X)
    seconds = []
    optimizer.register_step_post_hook(
        lambda opt, args, kwargs: seconds.append(
            [
                (float(opt.state[p]["step"]), opt.state[p]["exp_avg_sq"].clone())
                for p in model.parameters()
            ]
        )
    )
    for step in range(n_steps):
        rows = np.arange(10) + (step % 4) * 10
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    return recorder, seconds, optimizer


def _expected(seconds, optimizer):
    """P_s from torch's second moments, independently: Adam's step size over
    ``sqrt(v) / sqrt(1 - beta_2^t) + eps`` in the run's dtype (the order of
    ``_single_tensor_adam``), relative to the step size (one group: all ones)."""
    group = optimizer.param_groups[0]
    beta_2, eps = group["betas"][1], group["eps"]
    rows = []
    for per_step in seconds:
        parts = []
        for count, v in per_step:
            correction = (1 - beta_2**count) ** 0.5
            parts.append((1.0 / (v.sqrt() / correction + eps)).reshape(-1))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def test_adam_preconditioners_deferred_to_first_read_are_torchs():
    """finish() leaves Adam's P_s deferred; the first read computes them, bitwise
    equal to P_s from torch's own second moments, and later reads give the same
    tensor."""
    for dtype in (torch.float32, torch.float64):
        recorder, seconds, optimizer = _adam_run(dtype)
        recording = recorder.finish()
        update = recording.path_.update
        assert isinstance(update.__dict__["_preconditioners"], Deferred)
        first = update.preconditioners
        assert first is update.preconditioners  # (computed once)
        assert not isinstance(update.__dict__["_preconditioners"], Deferred)
        expected = _expected(seconds, optimizer)
        assert first.dtype == dtype and first.shape == expected.shape
        bits = torch.int32 if dtype == torch.float32 else torch.int64
        assert torch.equal(first.view(bits), expected.view(bits))


def test_path_read_mid_run_and_at_the_end_agree_bitwise():
    """A path taken in the middle of the run and read after later steps (its rows
    finished together with the later ones) holds the first steps' P_s of the final
    path, bitwise; early stopping (finish(at_step)) reads the truncated P_s."""
    recorder, seconds, optimizer = _adam_run(torch.float32)
    middle = recorder.path()  # after 70 steps, read after 3 more
    for step in range(3):
        rows = np.arange(10) + step * 10
        optimizer.zero_grad()
        out = recorder.module(recorder.X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, torch.zeros(10, dtype=torch.long)).backward()
        optimizer.step()
    final = recorder.path()
    assert final.n_steps == 73 and middle.n_steps == 70
    early = final.update.truncated(50).preconditioners
    assert middle.update.preconditioners.shape[0] == 70
    assert torch.equal(
        middle.update.preconditioners.view(torch.int32),
        final.update.preconditioners[:70].view(torch.int32),
    )
    assert torch.equal(early.view(torch.int32), final.update.preconditioners[:50].view(torch.int32))
    expected = _expected(seconds, optimizer)
    assert torch.equal(final.update.preconditioners.view(torch.int32), expected.view(torch.int32))
