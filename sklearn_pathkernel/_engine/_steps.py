"""The path's steps on the device, and the network probe of each thread.

A :class:`Step` is ``w_s`` and ``w_{s+1} - w_s`` of one step, moved from the
recorded path (host memory or disk) to the device. :class:`PathSteps` hands them
out and remembers, per thread, the last step asked: a step is evaluated many
times in a row (kinks, nodes, certificate), and the same tensors let the probe
reuse their unflattened parameters. :class:`ThreadProbes` gives every worker
thread its own probe (probes register forward hooks on their module while they
evaluate it, and refuse a second thread meanwhile): every evaluation in a task
goes through ``current()``, never through another thread's probe.

Cost: one host-to-device copy of two weight vectors (``2 W`` numbers) per step
and thread; one copy of the module per worker thread.
"""

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .._path import read_row
from ._probe import NetworkProbe


@dataclass(frozen=True)
class Step:
    """Step ``index`` of the path: it moves along ``w(t) = start + t direction``.

    Attributes
    ----------
    index : int
    start : torch.Tensor of shape (W,)
        ``w_s``, on the device.
    direction : torch.Tensor of shape (W,)
        ``w_{s+1} - w_s``, on the device.
    """

    index: int
    start: torch.Tensor
    direction: torch.Tensor


class PathSteps:
    """The weights and steps of ``path`` on ``device``.

    Parameters
    ----------
    path : WeightPath
    device : torch.device
    """

    def __init__(self, path, device):
        self.path = path
        self.device = device
        self._last = {}  # thread ident -> the last Step that thread asked for

    def __getstate__(self):
        return {"path": self.path, "device": self.device, "_last": {}}

    def weights(self, index):
        """Row ``index`` of the weight path, on the device (a copy, its pages released,
        for a path stored on disk: :func:`~sklearn_pathkernel._path.read_row`)."""
        return read_row(self.path.weights, index, self.device)

    def step(self, index):
        """Step ``index`` as a :class:`Step` (the calling thread's last one when it
        asks for the same step again)."""
        ident = threading.get_ident()
        last = self._last.get(ident)
        if last is None or last.index != index:
            start = self.weights(index)
            last = Step(index, start, self.weights(index + 1) - start)
            self._last[ident] = last
        return last

    def metric(self, index, rules):
        """The weight-space metric of step ``index``'s kernel, per rule: Adam's
        preconditioner ``P_s`` in the rule's layout, or None (the identity)."""
        preconditioners = self.path.update.preconditioners
        if preconditioners is None:
            return None
        scales = self.path.unflatten(read_row(preconditioners, index, self.device))
        return [rule.flatten(scales) for rule in rules]

    def on_device(self, array):
        """A numpy array (row indices, nodes, weights) as a tensor on the device;
        floating values in the path's dtype (float64 nodes of a float32 path
        would otherwise promote its products to float64)."""
        floating = np.asarray(array).dtype.kind == "f"
        dtype = self.path.weights.dtype if floating else None
        return torch.as_tensor(array, dtype=dtype, device=self.device)


class ThreadProbes:
    """The network probe of each thread: the main thread's, and one per worker
    thread on its own copy of the module.

    Parameters
    ----------
    module : torch.nn.Module
    path : WeightPath
    example : torch.Tensor
        Input rows for the probe's dry run.
    link : callable
        ``f`` from the module's output.
    """

    def __init__(self, module, path, example, link):
        self.module, self.path, self.example, self.link = module, path, example, link
        self.main = NetworkProbe(module, path, example, link=link)
        # Thread ident -> NetworkProbe. An ident is reused only after its thread has
        # ended: a later thread (of a later joblib call) takes over the probe of one
        # that is gone, never that of a thread still running.
        self._workers = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_workers"] = {}
        return state

    def current(self):
        """The probe of the calling thread.

        A worker's probe evaluates a copy of ``module`` of its own (the probe
        copies it), which no probe hooks: the main thread's probe has its own
        copy too, so a worker's copy made while another thread evaluates carries
        none of its hooks.
        """
        if threading.current_thread() is threading.main_thread():
            return self.main
        ident = threading.get_ident()
        if ident not in self._workers:
            self._workers[ident] = NetworkProbe(
                self.module, self.path, self.example, link=self.link
            )
        return self._workers[ident]
