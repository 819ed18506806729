"""What the recorder keeps per batch and per step, and how it becomes a WeightPath.

A :class:`MicroBatch` is one training forward pass of the user's module: its
inputs (a reference), the training rows the user named, and the output gradient
its backward pass produced. A :class:`StepLog` holds, per optimiser step, the
weights after it, the rows and output gradients of its (possibly several)
micro-batches and its per-coordinate scale; :meth:`StepLog.path` turns them into
the :class:`~sklearn_pathkernel._path.WeightPath` and
:class:`~sklearn_pathkernel._path.UpdateRecord` the engine reads.
"""

from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from .._path import (
    Deferred,
    UpdateRecord,
    WeightPath,
    allocate_weights,
    per_step,
    release_pages,
    storage_directory,
)
from ._optimizers import RecordingRefused, adam_scale
from ._weight_watch import host_bytes_equal, host_numpy

#: The size of the blocks of rows that Adam's preconditioners are finished in.
CHUNK_BYTES = 1 << 20


def relative_difference(a, b):
    """``max |a - b| / max(max |b|, tiny)``."""
    scale = max(float(b.abs().max()), torch.finfo(b.dtype).tiny) if b.numel() else 1.0
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


@dataclass(slots=True)
class MicroBatch:
    """One training forward pass of the module.

    Attributes
    ----------
    inputs : torch.Tensor
        The batch the module was called on (a reference).
    rows : ndarray of int or None
        The training rows the user named (:meth:`TrainingRecorder.rows`).
    versions : list of int
        The parameters' version counters at the forward pass.
    output_gradient : torch.Tensor or None
        ``e = -dL/dout`` (n, K), set by the backward pass.
    """

    inputs: torch.Tensor
    rows: np.ndarray
    versions: list
    output_gradient: torch.Tensor = None
    explicit: bool = False
    masks: dict = None  # the dropout masks of the pass (layer name -> booleans)
    stats: dict = None  # what the pass did to BatchNorm running statistics (by layer)
    started: object = None  # called first by each gradient hook (the recorder's)
    output_nr: int = 0  # the output's position among its autograd node's outputs
    matched: bool = False  # the inputs were found to be X[rows] (match_inputs)

    def take_from(self, output):
        """Record the gradient of ``output`` (``link(module(x))``) instead of the
        module output's."""
        self.explicit = True
        output.register_hook(self.take_explicit)

    def take_gradient(self, grad_outputs):
        """Pre-hook of the autograd node that made the module's output (``output.grad_fn``;
        ``grad_outputs``: the gradients of that node's outputs, the module output's at
        :attr:`output_nr`): keep ``-dL/dout`` (several uses of the output arrive
        summed, as one gradient, and after the output's own tensor hooks: the gradient
        that flows into the module), unless :meth:`take_from` named another output.

        A node pre-hook costs a fifth of ``Tensor.register_hook`` (which is torch's own
        Python, about 8 us in the loop), and runs at the same point of the pass."""
        self.started()
        if not self.explicit:
            grad = grad_outputs[self.output_nr]
            if grad is not None:
                self._add(grad)

    def take_tensor_gradient(self, grad):
        """Tensor hook on the module's output, when it has no autograd node (a leaf):
        as :meth:`take_gradient`."""
        self.started()
        if not self.explicit:
            self._add(grad)

    def take_explicit(self, grad):
        """Tensor hook on the output named by :meth:`take_from`."""
        self.started()
        self._add(grad)

    def _add(self, grad):
        # (a new tensor: the negation allocates; detached only under create_graph)
        gradient = -grad.detach() if grad.requires_grad else grad.neg()
        if self.output_gradient is None:
            self.output_gradient = gradient
        else:  # a second backward through the same output (retain_graph)
            self.output_gradient = self.output_gradient + gradient

    def check(self, step, X, versions, X_numpy=None):
        """Refuse a batch that is not the named training rows at the step's weights
        (``X_numpy``: a numpy view of ``X``, when it has one, to gather from)."""
        if self.rows is None:
            raise RecordingRefused(
                f"Step {step}: a training batch has no rows; call recorder.rows(indices) "
                "for every forward pass of the module that is backpropagated."
            )
        if self.versions != versions:
            raise RecordingRefused(
                f"Step {step}: the weights changed between a batch's forward pass and "
                "optimizer.step() (an in-place edit of the parameters)."
            )
        if self.output_gradient.shape[0] != len(self.rows):
            raise RecordingRefused(
                f"Step {step}: recorder.rows named {len(self.rows)} rows for a batch of "
                f"{self.output_gradient.shape[0]}."
            )
        if not self.matched:
            self.match_inputs(step, X, X_numpy)

    def match_inputs(self, step, X, X_numpy=None):
        """Refuse the batch if its inputs are not ``X[rows]``. Run as soon as both are
        known (by ``recorder.rows`` after the forward pass, or by the forward hook
        when the rows were named first), while the inputs are those the forward
        pass read: an input buffer the loop reuses for its next micro-batch
        (gradient accumulation) is checked before it is overwritten. A batch
        whose size is not the rows' is left to :meth:`check`, at the step (its
        own message)."""
        inputs = self.inputs
        if inputs.ndim and inputs.shape[0] != len(self.rows):
            return
        if X_numpy is not None:
            # the usual case: a host batch of X's dtype, compared by its bytes with
            # the rows gathered by numpy (one gather, one memcmp)
            own = host_numpy(inputs)  # (None with autograd: the torch comparison below)
            if (
                own is not None
                and own.shape[1:] == X_numpy.shape[1:]
                and own.dtype == X_numpy.dtype
                and own.tobytes() == X_numpy.take(self.rows, axis=0).tobytes()
            ):
                self.matched = True
                return
        # (one gather and one comparison, in torch: no copy of the rows on the host)
        index = torch.from_numpy(self.rows)
        expected = X.index_select(0, index if X.is_cpu else index.to(X.device))
        if expected.dtype != inputs.dtype or expected.device != inputs.device:
            expected = expected.to(inputs)
        if inputs.shape != expected.shape or not (
            host_bytes_equal(inputs, expected) or torch.equal(inputs, expected)
        ):  # (the same bytes, the usual case, found sooner; else equal values)
            raise RecordingRefused(
                f"Step {step}: the batch's inputs are not the training rows X[rows] named "
                "by recorder.rows (random augmentation, a transform in the data loader, or "
                "wrong indices): the kernel would be of other data. Record the augmented "
                "inputs as training rows of their own."
            )
        self.matched = True


def truncated_path(path, n_steps):
    """The :class:`~._path.WeightPath` of the first ``n_steps`` steps of ``path`` (early
    stopping: the later steps do not move ``w_0 .. w_{n_steps}``)."""
    return replace(
        path,
        weights=path.weights[: n_steps + 1],
        batches=path.batches[:n_steps],
        output_gradients=path.output_gradients[:n_steps],
        learning_rates=path.learning_rates[:n_steps],
        update=path.update.truncated(n_steps),
        dropout_masks=None if path.dropout_masks is None else path.dropout_masks[:n_steps],
        running_statistics=None
        if path.running_statistics is None
        else path.running_statistics.truncated(n_steps),
        rounding_moves=None if path.rounding_moves is None else path.rounding_moves[:n_steps],
    )


def _write_parts(row, parts, numels):
    """Write ``parts`` (numbers, or tensors on any device and dtype) into ``row``."""
    offset = 0
    for part, numel in zip(parts, numels, strict=True):
        chunk = row[offset : offset + numel]
        if isinstance(part, float):
            chunk.fill_(part)
        else:
            chunk.copy_(part.detach().reshape(-1))
        offset += numel


class GrowingRows:
    """A host array of rows that grows by doubling: each step writes its row in
    place (one copy), and :meth:`view` is the rows written, without a final copy.

    Parameters
    ----------
    width : int
    dtype : torch.dtype
    capacity : int, default=64
    """

    def __init__(self, width, dtype, capacity=64, storage="memory"):
        self._data, self.storage = allocate_weights(capacity, width, storage, dtype)
        self._numpy = host_numpy(self._data)  # (a numpy view, to compare rows by memcmp)
        self.n_rows = 0

    def _next_row(self):
        """The row to write next (a view), the array grown first when full."""
        if self.n_rows == len(self._data):
            if self.storage != "memory":
                raise RecordingRefused(
                    f"More steps than max_steps ({self._data.shape[0]} rows) on disk storage."
                )
            grown = torch.empty((2 * self.n_rows, self._data.shape[1]), dtype=self._data.dtype)
            grown[: self.n_rows] = self._data
            self._data, self._numpy = grown, host_numpy(grown)
        return self._data.select(0, self.n_rows)

    def write_flat(self, flat):
        """Append a row made of ``flat``: 1-d host tensors of the rows' dtype, without
        autograd, whose sizes add up to the width (one ``torch.cat`` into the row)."""
        torch.cat(flat, out=self._next_row())
        self.n_rows += 1

    def write_arrays(self, arrays):
        """Append a row made of ``arrays``: 1-d numpy arrays (views of host tensors) of
        the rows' dtype, whose sizes add up to the width (one ``numpy.concatenate``
        into the row: the same bytes as ``torch.cat``, at half its cost for a few
        thousand numbers). Returns False, writing nothing, when the rows have no
        numpy view (the caller then writes the tensors)."""
        if self._numpy is None:
            return False
        if self.n_rows == len(self._numpy):
            self._next_row()  # (grown: a new numpy view)
        np.concatenate(arrays, out=self._numpy[self.n_rows], casting="no")
        self.n_rows += 1
        return True

    def write(self, parts, numels):
        """Append a row made of ``parts`` (numbers or tensors, of ``numels`` each)."""
        row = self._next_row()
        flat = [
            part if part.ndim == 1 and not part.requires_grad else part.detach().reshape(-1)
            for part in parts
            if isinstance(part, torch.Tensor)
        ]
        dtype = row.dtype  # (the rows are on the host)
        if len(flat) == len(parts) and all(f.is_cpu and f.dtype == dtype for f in flat):
            torch.cat(flat, out=row)  # one operation for the whole row
        else:
            _write_parts(row, parts, numels)
        self.n_rows += 1
        if self.storage != "memory":  # written to the file: its pages leave this process
            release_pages(row)

    def rows(self):
        """The rows written, as a view (to write into)."""
        return self._data[: self.n_rows]

    def last(self):
        """The last row written (a view)."""
        return self._data[self.n_rows - 1]

    def last_bytes(self):
        """The last row written, as bytes (None without a numpy view of the rows)."""
        return None if self._numpy is None else self._numpy[self.n_rows - 1].tobytes()

    def view(self):
        """The rows written: a view on disk, a copy in memory when rows are unused
        (early stopping), so that the unused capacity is released."""
        if self.storage == "memory" and self.n_rows < self._data.shape[0]:
            return self._data[: self.n_rows].clone()
        return self._data[: self.n_rows]


class AdamFinisher:
    """Turns the rows of a :class:`GrowingRows` that hold Adam's second moments into
    :math:`P_s`, in place, once per row: when a path's preconditioners are first
    read (``StepLog.path`` gives them deferred), not in the training loop.

    Parameters
    ----------
    rows : GrowingRows
        The per-coordinate scales (second moments, or ready scales for steps
        without ``adam_terms``, which come first).
    terms : list
        Per Adam step (the step log's list, appended to as steps are recorded):
        ``(step_size, correction, eps)`` per parameter.
    numels : list of int
    """

    def __init__(self, rows, terms, numels):
        self.rows, self.terms, self.numels = rows, terms, numels
        self.finished = 0  # rows already turned into P_s

    def preconditioners(self, n_steps):
        """:math:`P_s` of the first ``n_steps`` steps (the rows written up to now
        finished first)."""
        self.finish()
        view = self.rows.view()
        return view if view.shape[0] == n_steps else view[:n_steps]

    def finish(self):
        """Turn the rows not finished yet into :math:`P_s`, all steps at once per
        parameter."""
        preconditioners = self.rows.rows()
        rows = slice(self.finished, len(self.terms))
        if rows.start == rows.stop:
            return
        terms = torch.tensor(
            self.terms[rows], dtype=torch.float64, device="cpu"
        )  # (steps, params, 3)
        offset = 0
        for index, numel in enumerate(self.numels):
            columns = slice(offset, offset + numel)
            step_size, correction, eps = (
                terms[:, index, k, None].to(preconditioners.dtype) for k in range(3)
            )
            # in blocks of rows of about 1 MiB, each finished while in the cache (the
            # same elementwise operations: the same numbers as in one pass)
            chunk = max(1, CHUNK_BYTES // (numel * preconditioners.element_size()))
            for start in range(0, rows.stop - rows.start, chunk):
                part = slice(start, min(start + chunk, rows.stop - rows.start))
                block = preconditioners[rows.start + part.start : rows.start + part.stop, columns]
                adam_scale(block, step_size[part], correction[part], eps[part])
                if not block.is_contiguous():  # (columns of a disk path: its rows' pages)
                    block = preconditioners[rows.start + part.start : rows.start + part.stop]
                release_pages(block)
            offset += numel
        self.finished = rows.stop


class StepLog:
    """The recorded steps, on the host.

    Parameters
    ----------
    initial : list of torch.Tensor
        The parameters at ``w_0``.
    numels : list of int
        The sizes of the parameters, in the path's order.
    dtype : torch.dtype
        The path's dtype (the parameters').
    max_steps : int or None
        The steps expected (the arrays' first capacity), if known.
    """

    def __init__(self, initial, numels, dtype, max_steps=None, storage="memory"):
        self._numels = list(numels)
        if max_steps is None and storage_directory(storage) is not None:
            raise ValueError("Recording on disk needs max_steps (the arrays' size).")
        capacity = 64 if max_steps is None else max(1, int(max_steps))
        self._weights = GrowingRows(sum(self._numels), dtype, capacity + 1, storage)
        self._weights.write(initial, self._numels)
        self._storage = storage
        self._scales = None  # allocated at the first step that needs per-coordinate scales
        self._capacity, self._dtype = capacity, dtype
        # (every parameter in the path's dtype: flat parts need no conversion)
        self._uniform_dtype = all(p.dtype == dtype for p in initial)
        self._uniform = []  # per step: its one scale, or None when written in _scales
        self._rates = []  # per step: the rate folded into alpha_s and zeta_s
        self._adam_terms = []  # per step: Adam's (step_size, correction, eps) per parameter
        self._adam = None  # the AdamFinisher of _scales (made with it)
        self._batches, self._gradients = [], []
        self._masks = []  # per step: its dropout masks, or None
        self._decays, self._learning_rates = [], []

    @property
    def n_steps(self):
        return len(self._batches)

    @property
    def dtype(self):
        """The dtype of the recorded weights."""
        return self._dtype

    def weights(self):
        """The weights recorded so far, ``w_0 .. w_s`` (a view)."""
        return self._weights.rows()

    def last_weights(self):
        """The last recorded weights (a view of their row)."""
        return self._weights.last()

    def last_weight_bytes(self):
        """The last recorded weights as bytes (None when they are not a host array of a
        numpy dtype)."""
        return self._weights.last_bytes()

    def append(
        self,
        weights,
        rows,
        output_gradient,
        step_scales,
        learning_rate,
        masks=None,
        flat=False,
        arrays=None,
    ):
        """Record one step: the parameters after it, its rows and output gradients, its
        :class:`~._optimizers.StepScales` and a learning rate (the largest of the
        groups, for display); ``flat``: the weights are 1-d host tensors in the
        parameters' dtypes (:meth:`WeightWatch.flat_views`); ``arrays``: numpy views
        of them, when they have such views (:meth:`WeightWatch.flat_arrays`). Cost:
        one copy of the weights (and of a per-coordinate scale) into the host
        arrays, one ``numpy.concatenate`` each when they are flat host arrays of the
        path's dtype (``torch.cat`` of flat host tensors otherwise)."""
        uniform_dtype = self._uniform_dtype
        if not (uniform_dtype and arrays is not None and self._weights.write_arrays(arrays)):
            if flat and uniform_dtype or self._host_parts(weights):
                self._weights.write_flat(weights)
            else:
                self._weights.write(weights, self._numels)
        self._batches.append(rows)
        self._masks.append(masks)
        # (the recorder's own tensor, from the backward hook: no copy on the host)
        self._gradients.append(output_gradient if output_gradient.is_cpu else output_gradient.cpu())
        scales = step_scales.scales
        terms = step_scales.adam_terms
        self._rates.append(step_scales.rate)
        if terms is not None:
            self._adam_terms.append(terms)
        if terms is None and all(isinstance(s, float) for s in scales) and len(set(scales)) == 1:
            self._uniform.append(scales[0])
        else:
            rows_written = self._scales
            if rows_written is None:
                rows_written = self._scale_rows()
            if rows_written.n_rows < len(self._uniform):
                self._fill_uniform(len(self._uniform))  # earlier uniform steps
            scale_arrays = step_scales.arrays
            if not (
                uniform_dtype
                and scale_arrays is not None
                and rows_written.write_arrays(scale_arrays)
            ):
                if step_scales.flat and uniform_dtype or self._host_parts(scales):
                    rows_written.write_flat(scales)
                else:
                    rows_written.write(scales, self._numels)
            self._uniform.append(None)
        self._decays.append(step_scales.decoupled_decay)
        self._learning_rates.append(learning_rate)

    def _host_parts(self, parts):
        """Whether ``parts`` are 1-d host tensors of the path's dtype without autograd,
        one per parameter (a row is then one ``torch.cat`` of them)."""
        dtype = self._dtype
        return len(parts) == len(self._numels) and all(
            type(part) is torch.Tensor
            and part.ndim == 1
            and part.is_cpu
            and part.dtype == dtype
            and not part.requires_grad
            for part in parts
        )

    def _scale_rows(self):
        """The per-coordinate scales' rows (allocated at first use)."""
        if self._scales is None:
            self._scales = GrowingRows(
                sum(self._numels), self._dtype, self._capacity, self._storage
            )
            self._adam = AdamFinisher(self._scales, self._adam_terms, self._numels)
        return self._scales

    def _fill_uniform(self, n_steps):
        """Write the uniform scales of the steps before ``n_steps`` not written yet."""
        rows = self._scale_rows()
        while rows.n_rows < n_steps:
            rows.write([self._uniform[rows.n_rows]], [sum(self._numels)])

    def path(self, names, shapes, form):
        """The :class:`~._path.WeightPath` of the steps so far, in the linear form ``form``."""
        weights = self._weights.view()
        storage = self._weights.storage
        n_steps = len(self._uniform)
        if not form.preconditioned and None not in self._uniform:
            scales = np.asarray(self._rates, dtype=float) * np.asarray(self._uniform, dtype=float)
            preconditioners = None
        else:
            scales = np.asarray(self._rates, dtype=float)
            self._fill_uniform(n_steps)
            # Adam's P_s from its second moments at the first read of the path's
            # preconditioners, not here (finish() of a user's loop)
            preconditioners = Deferred(partial(self._adam.preconditioners, n_steps))
        update = UpdateRecord(
            buffer_decay=form.buffer_decay,
            gradient_scale=form.gradient_scale,
            coupled_decay=form.coupled_decay,
            gradient_rates=per_step([form.gradient_rate * scale for scale in scales]),
            direct_rates=per_step([form.direct_rate * scale for scale in scales]),
            decoupled_decays=per_step(self._decays),
            preconditioners=preconditioners,
        )
        return WeightPath(
            weights,
            list(self._batches),
            list(self._gradients),
            np.asarray(self._learning_rates, dtype=float),
            list(names),
            list(shapes),
            storage,
            update,
            None if all(m is None for m in self._masks) else list(self._masks),
        )
