"""The recorded weight path of a training run.

Everything the exact path kernel needs from training: the weights ``w_0 .. w_S``
as one contiguous array in the run's dtype (float64, or float32 for a float32 run),
for every step the batch it used and each batch point's output gradient
``e_{s,i} = -dL_s / df(x_i; w_s)``, and the optimiser's update in its linear form
(:class:`~._update_record.UpdateRecord`).
The gradient of step ``s``'s loss is

    G_s = - sum_{i in B_s} sum_k e_{s,i,k} grad_w f_k(x_i; w_s)

(see ``_losses``; for the mean cross-entropy of ``f = log_softmax(module(x))``,
``e_{s,i} = a_{s,i} onehot(y_i)`` with ``a_{s,i}`` the point's share of the batch's
sample weight). For plain gradient descent ``w_{s+1} - w_s = -lr_s G_s``.
"""

import ctypes
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ._memory import available_memory
from ._update_record import UpdateRecord

PATH_STORAGES = ("memory", "disk")

#: The weight files this process mapped (:func:`allocate_weights`): per mapping, a weak
#: reference to its numpy memmap and its address range. Pages are only ever released
#: inside these ranges (see :func:`release_pages`).
_MAPPINGS = {}
_MAPPINGS_LOCK = threading.Lock()
_MADV_DONTNEED = 4  # (Linux, macOS and the BSDs)


@dataclass
class WeightPath:
    """Weights along a training run and the data each step used.

    Attributes
    ----------
    weights : torch.Tensor of shape (n_steps + 1, n_weights)
        Flat weights ``w_0 .. w_S`` in the order of ``module.named_parameters()``.
        Row ``s`` is the state before step ``s``; the last row is the final model.
    batches : list of ndarray of int
        ``batches[s]`` holds the training indices of step ``s``. Full-batch steps
        share one array, so a full-batch path stores the indices once.
    output_gradients : list of torch.Tensor
        ``output_gradients[s][j]`` (K,) is ``e_{s,j} = -dL_s / df(x_j; w_s)`` of
        training point ``batches[s][j]``.
    learning_rates : ndarray of shape (n_steps,)
        The learning rate used at each step.
    update : UpdateRecord
        How the optimiser turned each step's gradient into the weight change.
    param_names, param_shapes : list
        How a flat weight vector splits into the module's parameters.
    dropout_masks : list of dict or None
        Per step, the masks its dropout layers drew in training mode: layer name
        to a boolean tensor (|B_s|, ...) of the batch's rows (see
        :func:`masks_applied`); None when the network has no dropout in training.
    running_statistics : RunningStatistics or None
        The running statistics of the BatchNorm layers trained in training mode,
        per step, with each batch row's share of their moves (see
        ``_batchnorm``); None without such layers.
    rounding_moves : torch.Tensor of shape (n_steps, n_weights) or None
        Per step, the part of the recorded move :math:`w_{s+1} - w_s` that the
        update's linear form of the step's gradients does not give:
        :math:`r_s = w_{s+1} - w_s - m_s`, with :math:`m_s` the move the linear form
        makes of the gradients recomputed in float64 at the recorded :math:`w_s`.
        A float32 run's rounding, kept so that the kernel of the recorded float32
        weights is exact (its term, ``<phi_s(x), r_s>``, joins the decay term; see
        ``_training._replay.anchored_in_float64``).
        None for a path whose moves are the linear form to float64 rounding.
    storage : str
        Where ``weights`` lives: ``"memory"``, or the directory of the
        memory-mapped file holding it (see :func:`allocate_weights`).

    Notes
    -----
    Pickling (and ``copy.deepcopy``) writes the weights themselves into the
    pickle, so a pickle never depends on a file; the copy holds its weights in
    memory (``storage == "memory"``).
    """

    weights: torch.Tensor
    batches: list = field(default_factory=list)
    output_gradients: list = field(default_factory=list)
    learning_rates: np.ndarray = None
    param_names: list = field(default_factory=list)
    param_shapes: list = field(default_factory=list)
    storage: str = "memory"
    update: UpdateRecord = None
    dropout_masks: list = None
    running_statistics: object = None
    rounding_moves: torch.Tensor = None

    def __getstate__(self):
        state = dict(self.__dict__)
        if state.get("storage", "memory") != "memory":
            # Self-contained pickle: the data, not the (possibly temporary) file.
            state["weights"] = state["weights"].clone()
            if state.get("rounding_moves") is not None:
                state["rounding_moves"] = state["rounding_moves"].clone()
            state["storage"] = "memory"
        return state

    def __setstate__(self, state):
        state.setdefault("storage", "memory")
        state.setdefault("dropout_masks", None)
        state.setdefault("running_statistics", None)
        state.setdefault("rounding_moves", None)
        self.__dict__.update(state)

    @property
    def n_steps(self):
        return self.weights.shape[0] - 1

    @property
    def n_weights(self):
        return self.weights.shape[1]

    @property
    def nbytes(self):
        """Bytes held by the path (weights, preconditioners, batches, output gradients)."""
        seen, total = set(), self.weights.element_size() * self.weights.nelement()
        preconditioners = None if self.update is None else self.update.preconditioners
        if preconditioners is not None:
            total += preconditioners.element_size() * preconditioners.nelement()
        if self.rounding_moves is not None:
            total += self.rounding_moves.element_size() * self.rounding_moves.nelement()
        for batch, coef in zip(self.batches, self.output_gradients, strict=False):
            if id(batch) not in seen:
                seen.add(id(batch))
                total += batch.nbytes
            total += coef.element_size() * coef.nelement()
        return total

    def masks(self, step):
        """Step ``step``'s dropout masks (layer name to (|B_s|, ...) booleans), or
        None without dropout."""
        return None if self.dropout_masks is None else self.dropout_masks[step]

    def unflatten(self, flat):
        """Split a flat weight vector into a ``{name: tensor}`` parameter dict (views)."""
        sizes = self.__dict__.get("_sizes")
        if sizes is None:  # called for every evaluation: computed once
            sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.param_shapes]
            self.__dict__["_sizes"] = sizes
        return {
            name: chunk.view(shape)
            for name, shape, chunk in zip(
                self.param_names, self.param_shapes, torch.split(flat, sizes), strict=True
            )
        }

    def astype(self, dtype):
        """A copy of the path with its floating tensors (weights, output gradients,
        preconditioners) rounded to ``dtype``: the engine computes in the path's
        dtype, so a float32 copy gives the float32 kernel of the same run."""
        update = self.update
        preconditioners = update.preconditioners
        stats = self.running_statistics
        return replace(
            self,
            running_statistics=None if stats is None else stats.astype(dtype),
            weights=self.weights.to(dtype),
            rounding_moves=None if self.rounding_moves is None else self.rounding_moves.to(dtype),
            output_gradients=[g.to(dtype) for g in self.output_gradients],
            update=replace(
                update,
                preconditioners=None if preconditioners is None else preconditioners.to(dtype),
            ),
        )

    def step_direction(self, step):
        """``w_{s+1} - w_s``, the straight line the weights follow in step ``s``."""
        return self.weights[step + 1] - self.weights[step]


def flatten_parameters(module):
    """Flat copy of a module's trainable parameters, with their names and shapes.

    Frozen parameters (``requires_grad=False``) are not part of the path: they
    are constants, the module's own values.
    """
    names, shapes, tensors = [], [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        names.append(name)
        shapes.append(tuple(param.shape))
        tensors.append(param.detach().reshape(-1))
    return torch.cat(tensors), names, shapes


def _gib(nbytes):
    return f"{nbytes / 2**30:.2f} GiB"


def storage_directory(path_storage):
    """The directory of a ``path_storage`` setting, or None for ``"memory"``."""
    if isinstance(path_storage, str) and path_storage == "memory":
        return None
    if isinstance(path_storage, str) and path_storage == "disk":
        return tempfile.gettempdir()
    if isinstance(path_storage, str | os.PathLike):
        directory = os.fspath(path_storage)
        if not os.path.isdir(directory):
            raise ValueError(
                f"path_storage must be 'memory', 'disk' or an existing directory; "
                f"{directory!r} is not a directory."
            )
        return directory
    raise TypeError(
        "path_storage must be 'memory', 'disk' or a directory path, got "
        f"{type(path_storage).__name__}."
    )


def allocate_weights(n_rows, n_weights, path_storage="memory", dtype=torch.float64):
    """An uninitialised ``(n_rows, n_weights)`` weight array, in RAM or on disk.

    Parameters
    ----------
    n_rows : int
        ``S + 1``: the number of steps plus one (an upper bound when training
        may stop early).
    n_weights : int
        ``W``, the number of trainable weights.
    path_storage : "memory", "disk" or path-like
        ``"memory"``: a torch tensor in RAM. ``"disk"``: a numpy memmap in a new
        file of the system's temporary directory; a directory: a new file there.
        The file is deleted as soon as it is mapped (POSIX), so it never
        outlives the process; the operating system pages it in and out.
    dtype : torch.dtype, default=torch.float64
        The numbers' dtype: the run's (a float32 run's path takes 4 bytes a number).

    Returns
    -------
    weights : torch.Tensor
    storage : str
        ``"memory"`` or the directory of the file.

    Raises
    ------
    MemoryError
        When the array would not fit in the available memory (``"memory"``) or
        in the free disk space (otherwise); the message names S, W, the bytes
        and the ways out.
    """
    itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
    nbytes = int(n_rows) * int(n_weights) * itemsize
    sizes = (
        f"The weight path of {n_rows - 1} steps x {n_weights} weights "
        f"({n_rows} x {n_weights} x {itemsize} bytes = {_gib(nbytes)})"
    )
    directory = storage_directory(path_storage)
    if directory is None:
        available = available_memory()
        if nbytes > available:
            raise MemoryError(
                f"{sizes} does not fit in the {_gib(available)} of available memory. "
                "Store it on disk with path_storage='disk' (or a directory with "
                "enough free space), or lower max_iter (steps = max_iter x batches "
                "per epoch), use larger batches or a smaller network."
            )
        # On the host whatever the training device (or torch's default device).
        return torch.empty((n_rows, n_weights), dtype=dtype, device="cpu"), "memory"

    free = shutil.disk_usage(directory).free
    if nbytes > free:
        raise MemoryError(
            f"{sizes} does not fit in the {_gib(free)} free on the disk of "
            f"{directory!r}. Give path_storage a directory on a larger disk, or "
            "lower max_iter (steps = max_iter x batches per epoch), use larger "
            "batches or a smaller network."
        )
    suffix = f".f{8 * itemsize}"  # .f64, .f32: the numbers' width
    handle, filename = tempfile.mkstemp(prefix="pathkernel-weights-", suffix=suffix, dir=directory)
    os.close(handle)
    try:
        array = np.memmap(
            filename,
            dtype=torch.empty((), dtype=dtype, device="cpu").numpy().dtype,
            mode="w+",
            shape=(n_rows, n_weights),
        )
    except BaseException:
        os.remove(filename)
        raise
    try:
        os.remove(filename)  # POSIX: the mapping keeps the data until it is released
    except OSError:  # pragma: no cover - Windows cannot remove a mapped file
        weakref.finalize(array, _remove_quietly, filename)
    _register_mapping(array)
    return torch.from_numpy(array), directory


def _register_mapping(array):
    start = array.ctypes.data
    key = (start, id(array))
    with _MAPPINGS_LOCK:
        _MAPPINGS[key] = (weakref.ref(array), start, start + array.nbytes)
    weakref.finalize(array, _unregister_mapping, key)


def _unregister_mapping(key):
    with _MAPPINGS_LOCK:
        _MAPPINGS.pop(key, None)


def _madvise():
    """libc's ``madvise``, or None where it cannot be called."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):  # pragma: no cover - Windows
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def _mapped_pages(tensor):
    """The page-aligned address range around ``tensor``'s data when that data lies in
    a live weight file mapped by :func:`allocate_weights`, else None."""
    if _MADVISE is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _MAPPINGS_LOCK:
        for reference, low, high in _MAPPINGS.values():
            if low <= start and end <= high and reference() is not None:
                first = start - start % mmap.PAGESIZE  # (low is page-aligned)
                return first, min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, high)
    return None


def release_pages(tensor):
    """Give the resident pages of ``tensor`` back, if it lies in a weight file mapped
    by :func:`allocate_weights`; return whether it did.

    The mapping is shared and file-backed: ``madvise(MADV_DONTNEED)`` unmaps the pages
    from this process (its resident memory falls) and the next read of them pages
    the same numbers back in from the file (or the page cache). Memory that is not
    such a mapping is never touched (there, ``MADV_DONTNEED`` would zero it): the
    tensor's whole range must lie in a registered, live mapping.

    Parameters
    ----------
    tensor : torch.Tensor
        A contiguous host tensor, e.g. a row of a path's weights.

    Returns
    -------
    bool
        False for a tensor in ordinary memory, or where ``madvise`` is unavailable.
    """
    pages = _mapped_pages(tensor)
    if pages is None:
        return False
    first, last = pages
    return _MADVISE(first, last - first, _MADV_DONTNEED) == 0


def read_row(rows, index, device):
    """Row ``index`` of ``rows`` (a path's weights or preconditioners) on ``device``.

    A row of a path stored on disk is copied and then its pages released
    (:func:`release_pages`), so that reading the path step by step keeps only the
    rows in use resident, whatever the number of steps (cost: one copy of the row);
    a row in memory is ``rows[index].to(device)`` (no copy on the host).
    """
    row = rows[index]
    if _mapped_pages(row) is None:
        return row.to(device)
    copy = row.to(device, copy=True)
    release_pages(row)
    return copy


def _remove_quietly(filename):  # pragma: no cover - Windows only
    try:
        os.remove(filename)
    except OSError:
        pass
