"""Saving and loading a recording: a round trip in another process, and every
damaged or mismatched recording refused with its reason."""

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import Recording, TrainingRecorder
from sklearn_pathkernel._recording._io import ARRAYS, MANIFEST
from sklearn_pathkernel._training._optimizers import RecordingRefused

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].bias.requires_grad_(False)  # frozen: stored as the module's state
    return model


def data():
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(16, 4, generator=generator)
    return X, (X[:, 0] > 0).long()


@pytest.fixture
def recording():
    X, y = data()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    recorder = TrainingRecorder(model, optimizer, X, y)
    for step in range(5):
        rows = (np.arange(6) + 6 * step) % 16
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    return recorder.finish()


def test_round_trip_in_another_process(recording, tmp_path):
    recording.save(tmp_path)
    expected = recording.decompose(data()[0][:3])
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np, torch
        sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests", "recording")!r}]
        torch.set_num_threads(1)
        from test_recording_io import build, data
        from sklearn_pathkernel import Recording
        recording = Recording.load({str(tmp_path)!r}, build, data()[0])
        parts = recording.decompose(data()[0][:3])
        np.save({str(tmp_path / "out.npy")!r}, np.concatenate(
            [parts.contributions.ravel(), parts.decay.ravel(), parts.output.ravel()]))
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    loaded = np.load(tmp_path / "out.npy")
    mine = np.concatenate(
        [expected.contributions.ravel(), expected.decay.ravel(), expected.output.ravel()]
    )
    np.testing.assert_array_equal(loaded, mine)
    assert expected.residual.max() <= 1e-5  # float32 run (rounding of its updates)


def test_loaded_module_is_the_trained_one(recording, tmp_path):
    recording.save(tmp_path)
    fresh = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    loaded = Recording.load(tmp_path, fresh, data()[0])
    for (name, a), (_, b) in zip(
        recording.module_.state_dict().items(), fresh.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert loaded.path_.update.preconditioners.shape == (5, recording.path_.n_weights)


def test_truncated(recording, tmp_path):
    recording.save(tmp_path)
    name = tmp_path / ARRAYS
    content = name.read_bytes()
    name.write_bytes(content[: len(content) // 2])
    with pytest.raises(RecordingRefused, match="truncated or corrupted"):
        Recording.load(tmp_path, build, data()[0])


def test_corrupted(recording, tmp_path):
    recording.save(tmp_path)
    name = tmp_path / ARRAYS
    with zipfile.ZipFile(name) as archive:  # a byte of the weights' data
        offset = archive.getinfo("weights.npy").header_offset + 300
    content = bytearray(name.read_bytes())
    content[offset] ^= 0xFF
    name.write_bytes(bytes(content))
    with pytest.raises(RecordingRefused, match="corrupted"):
        Recording.load(tmp_path, build, data()[0])


def test_corrupted_values_with_a_valid_archive(recording, tmp_path):
    recording.save(tmp_path)
    with np.load(tmp_path / ARRAYS) as archive:
        arrays = dict(archive)
    arrays["weights"][1, 0] += 1.0
    np.savez(tmp_path / ARRAYS, **arrays)
    with pytest.raises(RecordingRefused, match="corrupted: 'weights' changed"):
        Recording.load(tmp_path, build, data()[0])


def test_other_module(recording, tmp_path):
    recording.save(tmp_path)
    other = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))
    with pytest.raises(RecordingRefused, match="The module does not match the recording"):
        Recording.load(tmp_path, other, data()[0])


def test_other_data(recording, tmp_path):
    recording.save(tmp_path)
    X = data()[0].clone()
    X[3, 1] += 1e-3
    with pytest.raises(RecordingRefused, match="training inputs do not match"):
        Recording.load(tmp_path, build, X)


def test_format_version_and_missing(recording, tmp_path):
    with pytest.raises(RecordingRefused, match="holds no recording"):
        Recording.load(tmp_path, build, data()[0])
    recording.save(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["format_version"] = 99
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RecordingRefused, match="format version 99; .* reads version 1"):
        Recording.load(tmp_path, build, data()[0])
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(RecordingRefused, match="manifest .* is corrupted"):
        Recording.load(tmp_path, build, data()[0])


def test_link_is_checked(recording, tmp_path):
    recording.save(tmp_path)
    with pytest.raises(RecordingRefused, match="was made with link None; got torch"):
        Recording.load(tmp_path, build, data()[0], link=torch.log_softmax)


def test_targets_and_epochs(recording, tmp_path):
    """Rows 0..15 in batches of 6 (wrapping): row 0 comes back at step 2, rows 12
    and 13 at step 4; the epochs start where a row is used again."""
    np.testing.assert_array_equal(recording.targets_, data()[1].numpy())
    np.testing.assert_array_equal(recording.epochs_, [0, 0, 1, 1, 2])
    recording.save(tmp_path)
    loaded = Recording.load(tmp_path, build, data()[0])
    np.testing.assert_array_equal(loaded.targets_, recording.targets_)


def test_counterfactual_after_loading(tmp_path):
    """The stated loss's name and the optimiser's settings (groups, per-step learning
    rates) come back: the same scores; a Loss instance is code, stated again."""
    from test_recording_counterfactual import tanh_mlp, user_loop

    from sklearn_pathkernel._training import CrossEntropy

    recording, X = user_loop("adamw-groups", epochs=1)
    before = recording.counterfactual(X[:2], output=1)
    recording.save(tmp_path)
    loaded = Recording.load(tmp_path, tanh_mlp, X)
    assert loaded.loss == "log_loss"
    assert loaded.optimizer_settings_.groups[0]["betas"] == (0.8, 0.95)
    after = loaded.counterfactual(X[:2], output=1)
    np.testing.assert_array_equal(after.scores, before.scores)
    recording.loss = CrossEntropy()
    recording.save(tmp_path / "instance")
    loaded = Recording.load(tmp_path / "instance", tanh_mlp, X)
    assert loaded.loss is None
    with pytest.raises(ValueError, match="does not know its loss: state it"):
        loaded.counterfactual(X[:1])
    loaded.loss = CrossEntropy()
    np.testing.assert_array_equal(loaded.counterfactual(X[:2], output=1).scores, before.scores)
    loaded.sample_weight = np.full(X.shape[0], 2.0)  # (uniform: the plain mean still)
    loaded.save(tmp_path / "weights")
    again = Recording.load(tmp_path / "weights", tanh_mlp, X)
    np.testing.assert_array_equal(again.sample_weight, np.full(X.shape[0], 2.0))
    again.loss = CrossEntropy()
    np.testing.assert_allclose(
        again.counterfactual(X[:2], output=1).scores, before.scores, rtol=1e-12, atol=1e-15
    )
