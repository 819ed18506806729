"""Whether the network the user holds is the recorded one.

The recorded path is the optimiser's: the weights after step ``s`` are its
result. Anything that moves the weights outside ``optimizer.step()`` (an edit
under ``no_grad`` or through ``.data``, an average written back, a
``load_state_dict``) makes the user's network another one than the kernel's. The
recorder compares, bitwise, the weights at every step with the weights the
previous step left (:class:`WeightWatch`), and at the end the trained
parameters with the recorded final weights and the constants (frozen
parameters, buffers) with their values when the recorder was created
(:class:`ConstantWatch`). A bitwise comparison has no tolerance to choose: the
optimiser's result is stored, not recomputed, so an honest run matches it
exactly, in float32 as in float64.
"""

import numpy as np
import torch

#: The integer dtype of each float dtype's width: a bitwise comparison.
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
#: Dtypes whose host tensors numpy can view (their bytes compared by memcmp).
_NUMPY = (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32)


def host_numpy(tensor):
    """A numpy view of a contiguous host tensor of a numpy dtype without autograd,
    else None."""
    if (
        tensor.is_cpu
        and tensor.dtype in _NUMPY
        and tensor.is_contiguous()
        and not tensor.requires_grad
    ):
        return tensor.numpy()
    return None


def host_bytes_equal(a, b):
    """Whether two contiguous host tensors of a numpy dtype hold the same bytes (a
    ``memcmp`` of copies: for a few thousand numbers, several times faster than
    ``torch.equal``); None when they are not such tensors."""
    if (
        a.dtype != b.dtype
        or a.dtype not in _NUMPY
        or not (a.is_cpu and b.is_cpu and a.is_contiguous() and b.is_contiguous())
    ):
        return None
    return a.detach().numpy().tobytes() == b.detach().numpy().tobytes()


def same_bits(a, b):
    """Whether ``a`` and ``b`` (same dtype and shape) hold the same bits (NaN included;
    ``-0.0`` differs from ``0.0``)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    fast = host_bytes_equal(a, b)
    if fast is not None:
        return fast
    if a.is_floating_point():
        bits = _BITS[a.element_size()]
        return torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))
    return torch.equal(a, b)


def largest_difference(named, reference):
    """``(name, max |a - b|)`` of the first tensor in ``named`` (name -> tensor) whose
    values differ from ``reference[name]``, or None when all agree bitwise."""
    for name, value in named.items():
        expected = reference[name].detach()
        value = value.detach()
        expected = expected.to(device=value.device, dtype=value.dtype)
        if not same_bits(value, expected.reshape(value.shape)):
            diff = (value.double() - expected.double().reshape(value.shape)).abs()
            return name, float(diff.nan_to_num(nan=float("inf")).max())
    return None


class WeightWatch:
    """The trained parameters, checked at every step against the weights the previous
    step left.

    Parameters
    ----------
    params : list of torch.nn.Parameter
        The trained parameters, in the path's order.

    Notes
    -----
    Cost per step: one concatenation of the ``W`` weights into a scratch buffer and
    one bitwise comparison with the recorded row (``3 W`` numbers read, no
    allocation). On an accelerator the reference is a copy on the device (one
    more copy per step), so that no weights cross to the host for the check.
    """

    def __init__(self, params):
        self.params = params
        first = params[0]
        numel = sum(p.numel() for p in params)
        self._scratch = torch.empty(numel, dtype=first.dtype, device=first.device)
        self._on_host = first.device.type == "cpu"
        self._reference = None if self._on_host else torch.empty_like(self._scratch)
        self._views, self._pointers = None, None
        #: Whether the views are 1-d host tensors (of the parameters' memory).
        self.on_host_views = False
        # (on the host, the scratch's bytes are compared with the row's by memcmp)
        self._bytes = self._scratch.numpy() if self._on_host and first.dtype in _NUMPY else None
        #: Numpy views of the flat views, when every parameter is a contiguous host
        #: tensor of the scratch's (numpy) dtype; else None.
        self.arrays = None

    def flat_views(self):
        """One flat view per parameter, without autograd (kept between steps while
        the parameters keep their memory: ``p.data = t`` gives new views)."""
        pointers = [p.data_ptr() for p in self.params]
        if pointers != self._pointers:
            self.on_host_views = all(p.is_cpu for p in self.params)
            self.arrays = None
            if not all(p.is_contiguous() for p in self.params):  # (copies: not kept)
                self._pointers = None
                return [p.detach().reshape(-1) for p in self.params]
            self._views = [p.detach().view(-1) for p in self.params]
            self._pointers = pointers
            dtype = self._scratch.dtype
            if self._bytes is not None and all(v.is_cpu and v.dtype == dtype for v in self._views):
                self.arrays = [v.numpy() for v in self._views]
        return self._views

    def _flat(self):
        views = self.flat_views()
        arrays = self.arrays
        if arrays is not None:
            # (numpy's concatenation: the same bytes as torch.cat, at half its cost)
            np.concatenate(arrays, out=self._bytes, casting="no")
        else:
            torch.cat(views, out=self._scratch)
        return self._scratch

    def after_step(self):
        """Keep the weights the step left (a device copy; on the host the recorded
        row itself is the reference)."""
        if not self._on_host:
            self._reference.copy_(self._flat())

    def unchanged(self, log):
        """Whether the weights now are bitwise the reference: the last recorded weights
        of ``log`` (a :class:`~._step_log.StepLog`, on the host) or the device copy."""
        flat = self._flat()
        scratch = self._bytes
        if scratch is not None:
            recorded = log.last_weight_bytes()  # (None unless a host array of a numpy dtype)
            if recorded is not None and log.dtype == self._scratch.dtype:
                return scratch.tobytes() == recorded
        reference = log.last_weights() if self._on_host else self._reference
        return same_bits(flat, reference)

    def flat(self):
        """The current weights, flat, on the host (for the messages)."""
        return self._flat().cpu()


class ConstantWatch:
    """The constants of the network (frozen parameters and buffers), as they were when
    the recorder was created.

    Parameters
    ----------
    module : torch.nn.Module
    trained : set of str
        The names of the trained parameters (not constants).
    """

    def __init__(self, module, trained):
        current = constants(module, trained)
        self._initial = {name: value.detach().clone() for name, value in current.items()}
        self._trained = trained
        self._tensors = list(current.values())
        self._versions = [t._version for t in self._tensors]

    def watched(self):
        """Whether there is any constant to watch (else :meth:`touched` is always False)."""
        return bool(self._tensors)

    def touched(self):
        """Whether a constant was changed in place since the last call (its version
        counter moved: a running statistic updated, an edit under ``no_grad``);
        cheap, for every step. Edits through ``.data`` are seen by
        :meth:`difference` only."""
        versions = [t._version for t in self._tensors]
        if versions == self._versions:
            return False
        self._versions = versions
        return True

    def restore(self, module):
        """Put the constants' values of the recorder's creation into ``module`` (a copy
        of the user's module: the recorded network)."""
        current = constants(module, self._trained)
        with torch.no_grad():
            for name, value in self._initial.items():
                if name in current:
                    current[name].copy_(value)

    def difference(self, module):
        """``(name, max |difference|)`` of the first constant that changed, or None."""
        current = constants(module, self._trained)
        missing = set(self._initial) ^ set(current)
        if missing:
            return sorted(missing)[0], float("inf")
        return largest_difference(current, self._initial)


def constants(module, trained):
    """The module's frozen parameters and buffers, by name (those in ``trained``,
    trained parameters and followed running statistics, left out)."""
    values = {n: p for n, p in module.named_parameters() if n not in trained}
    values.update({n: b for n, b in module.named_buffers() if n not in trained})
    return values


def matching_steps(weights, flat):
    """The recorded steps whose weights (rows of ``weights``) equal ``flat`` bitwise."""
    return [s for s in range(weights.shape[0]) if same_bits(weights[s], flat)]
