"""Where the computations run: the ``device`` parameter of the estimators.

Everything is float64, so the supported device types are ``"cpu"`` and
``"cuda"`` (also ROCm builds, which PyTorch calls ``"cuda"``); Apple's ``"mps"``
has no float64. Where the data live:

- the module, the training data and every tensor the engine creates: on the device;
- the recorded weight path (``path_storage``: RAM or a memory-mapped file) and its
  per-step coefficients: on the host, copied from the device after each step and
  moved to the device, one step at a time, when the engine evaluates them;
- the engine's work: each block (a tile of query rows times a chunk of steps) is
  accumulated in float64 on the device and handed back as a numpy array (a large
  one from a GPU through pinned buffers, :mod:`._transfer`); blocks are summed
  and assembled into the Gram or decomposition on the host;
- everything handed back to the user: numpy arrays on the host.

Initial weights are drawn on the CPU (its generator, the training data on the
host) and then moved, so ``w_0`` does not depend on the device.

Pickles always hold host (CPU) tensors, so they load on machines without the
device; :func:`loadable_device` moves them back when the device exists.
"""

import copy
import warnings

import numpy as np
import torch

SUPPORTED = ("cpu", "cuda")
CPU = torch.device("cpu")


def available_devices():
    """The devices this machine can run on, e.g. ``['cpu', 'cuda:0']``."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices


def resolve_device(device):
    """The ``torch.device`` of a ``device`` setting, or a ``ValueError`` naming it.

    Parameters
    ----------
    device : str or torch.device
        ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 1)``...
        A bare ``"cuda"`` resolves to the current CUDA device.

    Returns
    -------
    torch.device
    """
    available = available_devices()
    if isinstance(device, torch.device):
        resolved = device
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(
                f"Unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:<index>' "
                f"(available on this machine: {available})."
            ) from None
    if resolved.type not in SUPPORTED:
        raise ValueError(
            f"device={device!r} is not supported: the estimators compute in float64 "
            f"on 'cpu' or 'cuda' devices (available on this machine: {available})."
        )
    if resolved.type == "cpu":
        return CPU
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} was requested, but CUDA is not available on this "
            f"machine (torch.cuda.is_available() is False); available devices: {available}."
        )
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device={device!r} was requested, but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s); available devices: {available}."
        )
    return torch.device("cuda", index)


def on_host(module):
    """A CPU copy of ``module`` (the module itself when it is already on the CPU)."""
    if all(t.device.type == "cpu" for t in _parameters_and_buffers(module)):
        return module
    return copy.deepcopy(module).cpu()


def _parameters_and_buffers(module):
    yield from module.parameters()
    yield from module.buffers()


def loadable_device(device, what):
    """``device`` when this machine has it, else the CPU with a warning (for unpickling)."""
    if device is None or device.type == "cpu":
        return CPU
    try:
        return resolve_device(device)
    except ValueError:
        warnings.warn(
            f"{what} was pickled on device {str(device)!r}, which this machine does not "
            f"have (available: {available_devices()}); it is loaded on the CPU instead.",
            UserWarning,
            stacklevel=3,
        )
        return CPU


def as_tensor(X, device):
    """A float64 torch copy of a validated array on ``device`` (never a view of user memory)."""
    return torch.tensor(np.asarray(X, dtype=np.float64), dtype=torch.float64, device=device)
