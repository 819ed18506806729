"""Saving and loading a recording: a directory with a JSON manifest and an ``.npz``.

Layout of a recording directory (format version :data:`FORMAT_VERSION`)::

    manifest.json   format name and version, dtype, the parameters' names and
                    shapes, the linear form's constants, the module's and the
                    training data's fingerprints, the SHA-256 of every array, and
                    (for counterfactual attribution) the stated loss's name and
                    the optimiser's settings at every step
    arrays.npz      weights (S+1, W), preconditioners (S, W) if any, the steps'
                    rows and output gradients (concatenated, with offsets),
                    the per-step rates, the training targets if given, and the
                    module's other state (frozen parameters, buffers) under
                    ``state/<name>``

Why ``.npz``: numpy's own format, read without pickle (``allow_pickle=False``,
so loading runs no code), no new dependency; each member carries a zip CRC-32,
and the manifest a SHA-256 per array, so a truncated or corrupted file is
refused. Loading needs the module (its structure; a module or a factory that
builds one) and the training inputs: neither is stored (the module is code; the
inputs are the user's data, checked against their fingerprint).
"""

import hashlib
import json
import os
import zipfile

import numpy as np
import torch

from .._path import (
    RunningStatistics,
    UpdateRecord,
    WeightPath,
    from_plain,
    steps_to_plain,
    to_plain,
)
from .._training import OPTIMIZER_RULES, OptimizerSettings, RecordedRun, RecordingRefused

FORMAT = "sklearn_pathkernel.recording"
FORMAT_VERSION = 1
MANIFEST, ARRAYS = "manifest.json", "arrays.npz"
_RATES = ("gradient_rates", "direct_rates", "decoupled_decays")


def _digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _numpy(tensor):
    return tensor.detach().cpu().numpy()


def module_fingerprint(module):
    """Names, shapes and dtypes of every parameter and buffer, in order."""
    return [
        [name, list(t.shape), str(t.dtype)]
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]


def data_fingerprint(X):
    """Shape, dtype and SHA-256 of the training inputs."""
    array = _numpy(X)
    return {"shape": list(array.shape), "dtype": str(array.dtype), "sha256": _digest(array)}


def save_recording(recording, directory):
    """Write ``recording`` into ``directory`` (created if needed; existing files of a
    recording are replaced)."""
    os.makedirs(directory, exist_ok=True)
    path, update = recording.path_, recording.path_.update
    offsets = np.cumsum([0, *(len(b) for b in path.batches)])
    arrays = {
        "weights": _numpy(path.weights),
        "rows": np.concatenate(path.batches).astype(np.int64)
        if path.batches
        else np.zeros(0, np.int64),
        "row_offsets": offsets.astype(np.int64),
        "output_gradients": _numpy(torch.cat(path.output_gradients))
        if path.output_gradients
        else np.zeros((0, 0)),
        "learning_rates": np.asarray(path.learning_rates, dtype=float),
        **{name: steps_to_plain(getattr(update, name), len(path.param_names)) for name in _RATES},
    }
    if update.preconditioners is not None:
        arrays["preconditioners"] = _numpy(update.preconditioners)
    arrays.update(_mask_arrays(path))
    arrays.update(_statistics_arrays(path))
    if recording.targets_ is not None:
        arrays["targets"] = recording.targets_
    trained = set(path.param_names)
    for name, tensor in [*recording.module_.named_parameters(), *recording.module_.named_buffers()]:
        if name not in trained:
            arrays[f"state/{name}"] = _numpy(tensor)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": str(recording.dtype).removeprefix("torch."),
        "n_steps": path.n_steps,
        "n_weights": path.n_weights,
        "param_names": path.param_names,
        "param_shapes": [list(s) for s in path.param_shapes],
        "update": {
            # numbers, or one value per parameter (parameter groups)
            "buffer_decay": to_plain(update.buffer_decay),
            "gradient_scale": to_plain(update.gradient_scale),
            "coupled_decay": to_plain(update.coupled_decay),
        },
        "link": _link_name(recording.link),
        "module": module_fingerprint(recording.module_),
        "data": data_fingerprint(recording.X_train_),
        # (on_mismatch="record": how the user's module differed from the recorded one)
        "model_mismatch": recording.model_mismatch_,
        "model_difference": recording.model_difference_,
        # a registered loss's name (a Loss instance is code: state it again after loading)
        "loss": recording.loss if isinstance(recording.loss, str) else None,
        "sample_weight": None
        if recording.sample_weight is None
        else np.asarray(recording.sample_weight, dtype=float).tolist(),
        "optimizer": _settings_to_plain(recording.optimizer_settings_),
        "batch_norm": _statistics_manifest(path),
        "sha256": {name: _digest(a) for name, a in arrays.items()},
    }
    np.savez(os.path.join(directory, ARRAYS), **arrays)
    with open(os.path.join(directory, MANIFEST), "w") as handle:
        json.dump(manifest, handle, indent=1)


def _read_manifest(directory):
    name = os.path.join(directory, MANIFEST)
    if not os.path.isfile(name):
        raise RecordingRefused(f"{directory!r} holds no recording ({MANIFEST} is missing).")
    try:
        with open(name) as handle:
            manifest = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RecordingRefused(f"The manifest of {directory!r} is corrupted: {error}.") from None
    if manifest.get("format") != FORMAT:
        raise RecordingRefused(
            f"{directory!r} is not a recording (format {manifest.get('format')!r})."
        )
    if manifest.get("format_version") != FORMAT_VERSION:
        raise RecordingRefused(
            f"The recording in {directory!r} has format version "
            f"{manifest.get('format_version')}; this version of sklearn_pathkernel reads "
            f"version {FORMAT_VERSION}."
        )
    return manifest


def _read_arrays(directory, manifest):
    name = os.path.join(directory, ARRAYS)
    try:
        with np.load(name, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except FileNotFoundError:
        raise RecordingRefused(f"The recording in {directory!r} has no {ARRAYS}.") from None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as error:
        raise RecordingRefused(
            f"{ARRAYS} of {directory!r} is truncated or corrupted ({error})."
        ) from None
    expected = manifest["sha256"]
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise RecordingRefused(f"{ARRAYS} of {directory!r} is truncated: {missing} missing.")
    for key, digest in expected.items():
        if _digest(arrays[key]) != digest:
            raise RecordingRefused(f"{ARRAYS} of {directory!r} is corrupted: {key!r} changed.")
    return arrays


def _link_name(link):
    """A link's qualified name (None for the identity): code is not stored, so a
    loaded recording must be given the same link again."""
    if link is None:
        return None
    return f"{getattr(link, '__module__', '?')}.{getattr(link, '__qualname__', repr(link))}"


def read_recording(directory, module, X, link=None):
    """Read the recording in ``directory``.

    Parameters
    ----------
    directory : path-like
    module : torch.nn.Module or callable
        A module of the recorded structure, or a factory returning one; its
        weights and buffers are set from the recording (final weights).
    X : torch.Tensor
        The training inputs of the recorded run (checked by fingerprint).
    link : callable or None, default=None
        The recorder's ``link``, if it had one (checked by its qualified name).

    Returns
    -------
    RecordedRun
        What ``Recording`` is made of.

    Raises
    ------
    RecordingRefused
        A missing, truncated or corrupted recording, another format version,
        another module (parameter names, shapes or dtypes) or other data.
    """
    directory = os.fspath(directory)
    manifest = _read_manifest(directory)
    arrays = _read_arrays(directory, manifest)
    if not isinstance(module, torch.nn.Module):
        module = module()
    if module_fingerprint(module) != manifest["module"]:
        raise RecordingRefused(
            f"The module does not match the recording in {directory!r}: its parameters and "
            f"buffers are {module_fingerprint(module)}, the recording's {manifest['module']}."
        )
    if data_fingerprint(X) != manifest["data"]:
        raise RecordingRefused(
            f"The training inputs do not match the recording in {directory!r} (shape, dtype "
            f"or values differ: {data_fingerprint(X)} against {manifest['data']})."
        )
    if _link_name(link) != manifest.get("link"):
        raise RecordingRefused(
            f"The recording in {directory!r} was made with link {manifest.get('link')}; "
            f"got {_link_name(link)}."
        )
    weights = torch.from_numpy(arrays["weights"])
    offsets = arrays["row_offsets"]
    rows = arrays["rows"]
    gradients = torch.from_numpy(arrays["output_gradients"])
    batches = [rows[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    preconditioners = arrays.get("preconditioners")
    u = manifest["update"]
    numels = [int(np.prod(s, dtype=np.int64)) for s in manifest["param_shapes"]]
    update = UpdateRecord(
        buffer_decay=from_plain(u["buffer_decay"], numels),
        gradient_scale=from_plain(u["gradient_scale"], numels),
        coupled_decay=from_plain(u["coupled_decay"], numels),
        **{name: from_plain(arrays[name], numels) for name in _RATES},
        preconditioners=None if preconditioners is None else torch.from_numpy(preconditioners),
    )
    path = WeightPath(
        weights,
        batches,
        [gradients[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)],
        arrays["learning_rates"],
        list(manifest["param_names"]),
        [tuple(s) for s in manifest["param_shapes"]],
        "memory",
        update,
        _read_masks(arrays, offsets),
        _read_statistics(arrays, offsets, manifest.get("batch_norm")),
    )
    _set_final_state(module, path, arrays)
    dtype = getattr(torch, manifest["dtype"])
    return RecordedRun(
        module,
        path,
        X,
        dtype=dtype,
        link=link,
        targets=arrays.get("targets"),
        mismatch=manifest.get("model_mismatch"),
        model_difference=manifest.get("model_difference", 0.0),
    )


def _plain_value(value):
    """A setting as JSON: numbers, flags, None, strings, and lists of them (a
    one-number tensor as its number); else a ``TypeError``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, list | tuple):
        return [_plain_value(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(type(value).__name__)


def _settings_to_plain(settings):
    """:class:`OptimizerSettings` as JSON, or None (none kept, or a setting JSON
    cannot hold: a loaded recording then refuses counterfactual attribution)."""
    if settings is None:
        return None
    try:
        groups = [{key: _plain_value(v) for key, v in group.items()} for group in settings.groups]
    except TypeError:
        return None
    return {
        "class": settings.optimizer_class.__name__,
        "groups": groups,
        "learning_rates": settings.learning_rates.tolist(),
        "group_of": list(settings.group_of),
        "numels": list(settings.numels),
        "refusal": settings.refusal,
    }


def _settings_from_plain(plain):
    """The :class:`OptimizerSettings` of :func:`_settings_to_plain` (None stays None)."""
    if plain is None:
        return None
    classes = {cls.__name__: cls for cls in OPTIMIZER_RULES}
    if plain["class"] not in classes:
        return None
    groups = tuple(
        {key: tuple(v) if isinstance(v, list) else v for key, v in group.items()}
        for group in plain["groups"]
    )
    rates = np.asarray(plain["learning_rates"], dtype=float).reshape(-1, max(1, len(groups)))
    return OptimizerSettings(
        optimizer_class=classes[plain["class"]],
        groups=groups,
        learning_rates=rates,
        group_of=tuple(plain["group_of"]),
        numels=tuple(plain["numels"]),
        refusal=plain["refusal"],
    )


def read_stated(directory):
    """The stated loss (a name or None), sample weights (an array or None) and the
    :class:`OptimizerSettings` (or None) saved with the recording in ``directory``."""
    manifest = _read_manifest(os.fspath(directory))
    weights = manifest.get("sample_weight")
    return (
        manifest.get("loss"),
        None if weights is None else np.asarray(weights, dtype=float),
        _settings_from_plain(manifest.get("optimizer")),
    )


def _mask_arrays(path):
    """The dropout masks as arrays: per layer, the masked steps' rows one after the
    other (``dropout/<layer>``), and which steps have masks (``dropout_steps``)."""
    if path.dropout_masks is None:
        return {}
    masked = [masks is not None for masks in path.dropout_masks]
    names = next(masks for masks in path.dropout_masks if masks is not None)
    arrays = {"dropout_steps": np.asarray(masked)}
    for name in names:
        parts = [masks[name] for masks in path.dropout_masks if masks is not None]
        arrays[f"dropout/{name}"] = torch.cat(parts).numpy()
    return arrays


def _read_masks(arrays, offsets):
    """The dropout masks saved by :func:`_mask_arrays`, or None."""
    masked = arrays.get("dropout_steps")
    if masked is None:
        return None
    prefix = "dropout/"
    layers = {
        key.removeprefix(prefix): torch.from_numpy(value)
        for key, value in arrays.items()
        if key.startswith(prefix)
    }
    masks, start = [], 0
    for step, on in enumerate(masked):
        if not on:
            masks.append(None)
            continue
        size = int(offsets[step + 1] - offsets[step])
        masks.append({name: mask[start : start + size] for name, mask in layers.items()})
        start += size
    return masks


def _statistics_manifest(path):
    """BatchNorm's running statistics: names, shapes and training layers (or None)."""
    stats = path.running_statistics
    if stats is None:
        return None
    return {
        "names": stats.names,
        "shapes": [list(s) for s in stats.shapes],
        "training_layers": stats.training_layers,
    }


def _statistics_arrays(path):
    """BatchNorm's running statistics per step (``batch_norm/values``), the rows'
    shares one step after the other (``batch_norm/shares``) and the averaging
    weights (``batch_norm/factors``, a column per training layer)."""
    stats = path.running_statistics
    if stats is None:
        return {}
    n_rows = sum(len(batch) for batch in path.batches)
    shares = torch.cat(stats.shares) if stats.shares else torch.zeros((n_rows, 0))
    factors = [[step[name] for name in stats.training_layers] for step in stats.factors]
    return {
        "batch_norm/values": _numpy(stats.values),
        "batch_norm/shares": _numpy(shares),
        "batch_norm/factors": np.asarray(factors, dtype=float).reshape(
            len(stats.factors), len(stats.training_layers)
        ),
    }


def _read_statistics(arrays, offsets, manifest):
    """The running statistics saved by :func:`_statistics_arrays`, or None."""
    if manifest is None:
        return None
    shares = torch.from_numpy(arrays["batch_norm/shares"])
    layers = list(manifest["training_layers"])
    return RunningStatistics(
        list(manifest["names"]),
        [tuple(s) for s in manifest["shapes"]],
        torch.from_numpy(arrays["batch_norm/values"]),
        [shares[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)],
        layers,
        [dict(zip(layers, row.tolist(), strict=True)) for row in arrays["batch_norm/factors"]],
    )


def _set_final_state(module, path, arrays):
    """The module's weights from the path's last row, its other state from the file."""
    final = path.unflatten(path.weights[-1])
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            value = final[name] if name in final else torch.from_numpy(arrays[f"state/{name}"])
            tensor.copy_(value)
