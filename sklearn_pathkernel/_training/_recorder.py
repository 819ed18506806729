"""Recording a training run in the user's own PyTorch loop.

:class:`TrainingRecorder` attaches hooks to the user's module and ``torch.optim``
optimiser; the loop needs two added lines (the recorder, and the rows of each
batch)::

    recorder = TrainingRecorder(model, optimizer, X_train)
    for x, y, rows in loader:
        optimizer.zero_grad()
        out = model(x)
        recorder.rows(rows)  # the training rows of x
        loss_fn(out, y).backward()
        optimizer.step()
    recording = recorder.finish()

What each hook records (no extra forward or backward pass):

- a forward hook on the module: the batch's inputs (a reference, checked against
  the training rows as soon as they are named, by :meth:`PathRecorder.rows` or by
  this hook when the rows came first: before a reused input buffer is overwritten)
  and, through a pre-hook of the autograd node that made the output
  (``output.grad_fn.register_prehook``: a fifth of the cost of
  ``Tensor.register_hook``, at the same point of the pass; a tensor hook only for
  an output without a node), the output gradient ``e_{s,i} = -dL/dout_i`` exactly
  as the user's own loss and reduction produced it (class weights, mean or sum
  included; after the output's own tensor hooks, so the gradient that flows into
  the module);
- at the start and at the end of each backward pass through the output (that
  gradient hook, and a callback queued from it to the end of the pass:
  two calls per pass, whatever the number of parameters): which gradients the
  pass produced, so that a gradient changed afterwards (clipping,
  ``GradScaler.unscale_``, a manual edit) is refused, gradients reset without a
  step (a skipped step) drop the batches of that step, and several backward
  passes before one step (gradient accumulation) concatenate their rows and
  output gradients;
- step hooks on the optimiser: the hyperparameters it used (its
  ``param_groups``, read by :mod:`._optimizers`), the weights after the step and
  Adam's second moments (turned into its preconditioner :math:`P_s` when the
  recording's path is first read, not in the loop nor in ``finish``); watchers
  added by :meth:`PathRecorder.watch_steps` (the optimiser settings' log) are
  called from these two hooks rather than from hooks of their own;
- only on a module with dropout or BatchNorm layers: a forward pre-hook each,
  for the pass's masks and running statistics.

Per step the hooks do a fixed number of operations whatever the batch (a few per
parameter): a batch's inputs are compared with ``X[rows]`` by one numpy gather and
one ``memcmp``, the weights with the previous step's result by one concatenation
and one ``memcmp``, the optimiser's groups are read once, and Adam's state through
views kept while the optimiser holds the same tensors (with one group and one step
count, Adam's terms are computed once per step, not per parameter); the host copies
(and the weight check's concatenation) are one ``numpy.concatenate`` of kept numpy
views per row (``torch.cat`` where the tensors have no numpy view); the gradients'
fingerprints of the step are one list, compared with the step's in one comparison.
In the loop each such operation costs several times what it costs alone (numpy
reductions most: a batch's row range is checked with Python's ``min``/``max`` of a
list); the user guide's "Cost" gives the figures.

The network's output ``f`` is the module's own output (logits for a classifier):
the kernel decomposes it. Since ``G_s = sum_i J_i^T dL/dout_i`` by the chain rule,
this holds for any loss of the output; a loss that also depends on the weights
directly (a penalty) or on intermediate activations is caught by recomputing the
gradient from the recorded rows (``check="first"``: at the first step).
"""

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from .._path import BATCH_NORMS, MASKED_DROPOUT, flatten_parameters
from ._batchnorm import StatisticsWatch, refuse_unsupported
from ._dropout import MaskDraws
from ._module_checks import check_module
from ._module_copy import float64_tensor, module_copy
from ._optimizers import RecordingRefused, rule_for
from ._step_log import MicroBatch, StepLog, relative_difference, truncated_path
from ._structure_watch import STRUCTURE_CHANGES, StructureWatch
from ._weight_watch import (
    ConstantWatch,
    WeightWatch,
    host_numpy,
    largest_difference,
    matching_steps,
    same_bits,
)

CHECKS = ("first", "every", "none")
#: A forward pass's dropout masks and statistics without such layers (never written).
_NO_MASKS = {}
MISMATCH = ("refuse", "record")


@dataclass(frozen=True)
class RecordedRun:
    """What a finished recording holds (:meth:`PathRecorder.finish_run`, or a
    recording read from disk): the arguments of a ``Recording``.

    Attributes
    ----------
    module : torch.nn.Module
        A copy of the recorded network, at its final weights, in its training dtype.
    path : WeightPath
        The recorded path.
    X : torch.Tensor
        The training inputs the path's rows index.
    dtype : torch.dtype
        The dtype the network was trained in.
    link, targets, live_module, on_mismatch, mismatch, model_difference
        As ``Recording`` takes them.
    """

    module: nn.Module
    path: object
    X: torch.Tensor
    dtype: torch.dtype
    link: object = None
    targets: object = None
    live_module: nn.Module = None
    on_mismatch: str = "refuse"
    mismatch: str = None
    model_difference: float = 0.0

    def arguments(self):
        """The fields as keyword arguments (the tensors themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class PathRecorder:
    """Records the path of a training loop: the hooks, the per-step checks and the
    step log, for the estimators' loop and (as the public ``TrainingRecorder``,
    which adds ``finish``) for a user's own loop. See ``TrainingRecorder`` for the
    parameters.
    """

    def __init__(
        self,
        module,
        optimizer,
        X,
        y=None,
        *,
        check="first",
        max_steps=None,
        link=None,
        storage="memory",
        on_mismatch="refuse",
        generator=None,
    ):
        if check not in CHECKS:
            raise ValueError(f"check must be one of {CHECKS}, got {check!r}.")
        if on_mismatch not in MISMATCH:
            raise ValueError(f"on_mismatch must be one of {MISMATCH}, got {on_mismatch!r}.")
        self.on_mismatch = on_mismatch
        if not isinstance(X, torch.Tensor):
            raise TypeError(f"X must be a torch.Tensor of training inputs, got {type(X).__name__}.")
        self.module, self.optimizer, self.X, self.check = module, optimizer, X, check
        self._n_rows = X.shape[0]
        # (the training rows of a batch are gathered from this view, when X has one)
        self._X_numpy = host_numpy(X)
        self.y = None if y is None else np.asarray(torch.as_tensor(y).cpu().numpy())
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RecordingRefused("The module has no parameter that requires a gradient.")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._rule = rule_for(optimizer, self._params, self._names)
        _check_module(module, X)
        flat, _, self._shapes = flatten_parameters(module)
        self._dtype = flat.dtype
        self.link = link
        self._log = StepLog(
            self._params, [p.numel() for p in self._params], flat.dtype, max_steps, storage
        )
        self._layers = [
            (name, layer)
            for name, layer in module.named_modules()
            if isinstance(layer, _BatchNorm | _DropoutNd | nn.RReLU)
        ]
        self._open, self._done, self._rows = [], [], None
        # per parameter: the fingerprint of the gradient the step's backward passes
        # left (None where they left none)
        self._saved, self._stale, self._own_forward = [None] * len(self._params), False, False
        self._none = [None] * len(self._params)  # (no gradient produced: compared with)
        self._no_removal = [False] * len(self._params)
        self._dropout = MaskDraws(module, generator)
        self._stats = StatisticsWatch(module)
        # (read at every forward pass: kept rather than looked up)
        self._has_dropout = bool(self._dropout.layers)
        self._has_statistics = bool(self._stats.layers)
        # (the passes of dropout and BatchNorm layers are followed only where there
        # are such layers: a hook less per forward pass each)
        self._handles = [
            module.register_forward_pre_hook(watch.start_pass)
            for watch in (self._dropout, self._stats)
            if watch.layers
        ]
        self._handles += [
            module.register_forward_hook(self._on_forward),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        #: Objects whose ``before_step(optimizer, args, kwargs)`` and ``after_step``
        #: run at the end of the recorder's own step hooks (:meth:`watch_steps`).
        self._step_watchers = []
        self._in_backward, self._before, self._leftover = False, None, self._none
        self._last_rows = (None, None)  # (the last rows' copy, and what it was made from)
        self._structure = StructureWatch(module, optimizer)
        self._weights = WeightWatch(self._params)
        self._weights.after_step()
        # (the running statistics of BatchNorm layers move; the StatisticsWatch follows them)
        self._constants = ConstantWatch(module, {*self._names, *self._stats.buffer_names()})
        self._has_constants = self._constants.watched()
        self._finished = False

    def watch_steps(self, watcher):
        """Call ``watcher.before_step(optimizer, args, kwargs)`` and
        ``watcher.after_step(optimizer, args, kwargs)`` at the end of the recorder's
        own step hooks, as optimiser step hooks registered after the recorder's would
        be called (one Python call per step less for the optimiser's hooks each)."""
        self._step_watchers.append(watcher)

    # -- set-up checks ---------------------------------------------------------------

    # -- the user's calls ------------------------------------------------------------

    def rows(self, indices, output=None):
        """Name the training rows (of ``X``) of the batch the module was last called
        on, or, if called before the forward pass, of the next one.

        Parameters
        ----------
        indices : array-like or torch.Tensor of int, shape (batch_size,)
            Copied (``|B|`` integers), so that an index array changed in place
            later (a permutation shuffled every epoch) does not change the
            recorded rows; steps that name the same array share one copy
            (full-batch training stores its rows once).
        output : torch.Tensor or None, default=None
            ``link(module(x))`` of this batch, when the recorder has a ``link``:
            its gradient is recorded instead of the module output's.
        """
        if (
            type(indices) is torch.Tensor
            and indices is not self._last_rows[1]
            and indices.dtype is torch.int64
            and indices.ndim == 1
            and indices.is_cpu
            and not indices.requires_grad
            and 0 < indices.shape[0] <= _LIST_RANGE_ROWS
        ):
            # the usual case written out (a loader's host tensor of indices): one
            # numpy view, its copy, and the range by Python's min and max of a list
            rows = indices.numpy().copy()
            listed = rows.tolist()
            if min(listed) < 0 or max(listed) >= self._n_rows:
                raise IndexError(
                    f"Row indices must lie in [0, {self._n_rows}); got "
                    f"{min(listed)}..{max(listed)}."
                )
            self._last_rows = rows, indices
        else:
            rows = self._copied_rows(indices)
            if rows.size and not _in_range(rows, self._n_rows):
                raise IndexError(
                    f"Row indices must lie in [0, {self._n_rows}); got {rows.min()}..{rows.max()}."
                )
        if self._open and self._open[-1].rows is None:
            batch = self._open[-1]
            batch.rows = rows
            batch.match_inputs(self._log.n_steps, self.X, self._X_numpy)
            if output is not None:
                batch.take_from(output)
        elif output is not None:
            raise ValueError("rows(..., output=...) must follow the batch's forward pass.")
        else:
            self._rows = rows

    def _copied_rows(self, indices):
        """The indices as a new int64 array; the same object named again with the
        same values (full-batch training) shares the previous copy."""
        previous, source = self._last_rows
        if type(indices) is torch.Tensor and indices.is_cpu and not indices.requires_grad:
            values = indices.numpy()  # (the usual case: a loader's host tensor, one call)
        elif isinstance(indices, torch.Tensor):
            values = indices.detach().cpu().numpy()
        else:
            values = np.asarray(indices)
        if indices is source and np.array_equal(previous, values):
            return previous
        if values.dtype == np.int64 and values.ndim == 1:
            rows = values.copy()  # (the usual case: a numpy call less)
        else:
            rows = np.array(values, dtype=np.int64).reshape(-1)  # (a copy)
        self._last_rows = rows, indices
        return rows

    def finish_run(self, at_step=None):
        """Detach the hooks, check that the user's module is the recorded network
        after ``at_step`` steps (all when None), and return the :class:`RecordedRun`
        (see ``TrainingRecorder.finish``, its public face, for the parameter and the
        refusals)."""
        n_steps = self.n_steps
        if at_step is None:
            at_step = n_steps
        elif isinstance(at_step, bool) or not isinstance(at_step, int | np.integer):
            raise TypeError(f"at_step must be an integer or None; got {at_step!r}.")
        if not 0 <= at_step <= n_steps:
            raise ValueError(f"at_step must be an integer in [0, {n_steps}]; got {at_step}.")
        at_step = int(at_step)
        mismatch, difference = self._mismatch(at_step)
        if mismatch is not None and self.on_mismatch == "refuse":
            raise RecordingRefused(mismatch)
        self.close()
        path = self.path()
        if at_step < n_steps:
            path = truncated_path(path, at_step)
        # the recorded network (equal to the user's unless on_mismatch="record"): a
        # copy of the module whose trained parameters are the final weights
        final = dict(zip(self._names, _split(path.weights[-1], self._params), strict=True))

        def parameter(name, param):
            weights = final.get(name)
            if weights is None:  # (a constant: restored below)
                return param.detach().clone(memory_format=torch.preserve_format)
            return torch.empty_like(param).copy_(weights)

        module = module_copy(self.module, parameter)
        self._constants.restore(module)
        self._stats.restore(module, at_step)
        return RecordedRun(
            module,
            path,
            self.X,
            dtype=self._dtype,
            link=self.link,
            targets=self.y,
            live_module=self.module,
            on_mismatch=self.on_mismatch,
            mismatch=mismatch,
            model_difference=difference,
        )

    def _mismatch(self, at_step):
        """A message saying how the module differs from the network after ``at_step``
        recorded steps, and the largest difference (None and 0.0 when it does not)."""
        weights = self._log.weights()
        expected = weights[at_step]
        # the parameters the module holds now, by name (one replaced or removed after
        # the last step is not the object the recorder followed)
        present = dict(self.module.named_parameters())
        held = [present.get(name) for name in self._names]
        for name, param, own in zip(self._names, held, self._params, strict=True):
            if param is None or param.shape != own.shape or param.dtype != own.dtype:
                return (
                    f"The module has no parameter {name!r} of the recorded shape and dtype "
                    f"({tuple(own.shape)}, {own.dtype}) any more (removed or replaced after "
                    "the recorder was created): the kernel would not be the model's."
                ), float("inf")
        if all(param is own for param, own in zip(held, self._params, strict=True)):
            current = self._weights.flat()
        else:  # (a parameter replaced by another of its shape: compared by its values)
            current = torch.cat([p.detach().reshape(-1).to(expected) for p in held])
        if not same_bits(current, expected):
            names = dict(zip(self._names, held, strict=True))
            name, difference = largest_difference(
                names, dict(zip(self._names, _split(expected, self._params), strict=True))
            )
            steps = matching_steps(weights, current)
            hint = (
                f" They equal the recorded weights at step {steps[-1]} (after {steps[-1]} "
                f"optimiser steps): for early stopping that restored them, call "
                f"recorder.finish(at_step={steps[-1]})."
                if steps
                else " Changing the weights outside optimizer.step() (an average written "
                "back, an edit after the last step, restored weights) makes the model "
                "another network than the recorded one."
            )
            return (
                f"The module's parameter {name!r} differs from the recorded network at step "
                f"{at_step} (after {at_step} optimiser steps) by up to {difference:.4g}: the "
                f"kernel would not be the model's.{hint}"
            ), difference
        moved = self._stats.difference(at_step)
        if moved is not None:
            name, difference = moved
            return (
                f"The running statistics of the module's BatchNorm layer {name!r} differ "
                f"from the last recorded forward pass's (by up to {difference:.4g}): a "
                "forward pass in training mode after the last step moved them, so the "
                "kernel would not be the model's."
            ), difference
        changed = self._constants.difference(self.module)
        if changed is not None:
            name, difference = changed
            return (
                f"The module's constant {name!r} (a frozen parameter or buffer) changed since "
                f"the recorder was created (by up to {difference:.4g}): the recorded network "
                "holds it constant, so the kernel would not be the model's."
            ), difference
        return None, 0.0

    def close(self):
        """Detach the hooks (the recorded path stays readable with :meth:`path`)."""
        if not self._finished:
            for handle in self._handles:
                handle.remove()
            self._dropout.close()
            self._stats.close()
            self._structure.close()
            self._finished = True

    def path(self):
        """The :class:`~._path.WeightPath` recorded so far."""
        path = self._log.path(self._names, self._shapes, self._rule.recorded_form())
        path.running_statistics = self._stats.statistics(path.n_steps)
        return path

    @property
    def n_steps(self):
        """Steps recorded so far."""
        return self._log.n_steps

    # -- hooks -----------------------------------------------------------------------

    def _on_forward(self, module, args, output):
        if self._own_forward or not torch.is_grad_enabled():
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        # (is_cpu first: making the device object costs more than the check itself)
        if torch.is_autocast_enabled("cpu" if output.is_cpu else output.device.type):
            step = self.n_steps
            raise RecordingRefused(
                f"Step {step}: the module runs under autocast (mixed precision); the kernel "
                "evaluates the recorded weights in float64, not the reduced-precision forward."
            )
        for name, layer in self._layers:
            if (
                layer.training
                and not (isinstance(layer, _DropoutNd) and layer.p == 0)
                and type(layer) not in MASKED_DROPOUT
                and type(layer) not in BATCH_NORMS
            ):
                step = self.n_steps
                raise RecordingRefused(
                    f"Step {step}: layer {name!r} ({type(layer).__name__}) is in training mode "
                    "(batch statistics or randomness): one row's output is not a deterministic "
                    "function of that row. Put it in eval mode (module.eval()) for training "
                    "(nn.Dropout and nn.Dropout2d are recorded with their masks, nn.BatchNorm1d "
                    "and nn.BatchNorm2d with their batch statistics)."
                )
        self._in_backward = False  # (a pass that raised never reached its end)
        batch = MicroBatch(
            args[0],
            self._rows,
            [p._version for p in self._params],
            None,
            False,
            self._dropout.take() if self._has_dropout else _NO_MASKS,
            self._stats.take() if self._has_statistics else _NO_MASKS,
            self._backward_started,  # (not kept on self: a bound method there is a cycle)
        )
        if self._rows is not None:  # (named before the forward pass)
            batch.match_inputs(self._log.n_steps, self.X, self._X_numpy)
        self._rows = None
        self._open.append(batch)
        node = output.grad_fn
        if node is None:  # (a leaf: the module returned a tensor it did not compute)
            output.register_hook(batch.take_tensor_gradient)
        else:
            # a pre-hook of the output's node: the gradient as it enters the module,
            # at a fifth of Tensor.register_hook's cost
            batch.output_nr = output.output_nr
            node.register_prehook(batch.take_gradient)

    def _fingerprints(self):
        """Per parameter: what identifies its gradient now (None without one; see
        :func:`_fingerprint`, written out here for the usual case: every step)."""
        if self.check == "every":
            return [None if p.grad is None else _fingerprint("every", p.grad) for p in self._params]
        return [None if (g := p.grad) is None else (id(g), g._version) for p in self._params]

    def _backward_started(self):
        """The first gradient hook of a backward pass through the output, before any
        parameter's gradient of the pass is accumulated: notice gradients left over
        from the last step (not reset) and gradients reset without a step (the
        step's earlier passes are dropped), and queue :meth:`_backward_finished`
        to the end of the pass."""
        if self._in_backward:
            return
        self._in_backward = True
        if self.check == "every":
            before = self._fingerprints()
        else:  # (the usual case written out: a call less per backward pass)
            before = [None if (g := p.grad) is None else (id(g), g._version) for p in self._params]
        saved, leftover = self._saved, self._leftover
        if before != self._none or saved != self._none:
            # (else, the usual case: no gradient yet, none saved; nothing to notice)
            for index, now in enumerate(before):
                if saved[index] is not None:
                    if now != saved[index]:  # reset (zero_grad) without a step
                        self._done, self._saved = [], list(self._none)
                        break
                elif now is not None and now == leftover[index]:
                    self._stale = True  # a gradient left over from before the last step
        self._before = before
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self):
        """The end of a backward pass: the gradients it produced (those whose
        identity or version changed) are the step's, and its batches are done."""
        self._in_backward = False
        saved = self._saved
        if self.check == "every":
            after = self._fingerprints()
        else:  # (the usual case written out: a call less per backward pass)
            after = [None if (g := p.grad) is None else (id(g), g._version) for p in self._params]
        for index, (before, now) in enumerate(zip(self._before, after, strict=True)):
            if now is not None and now != before:
                saved[index] = now
        open_batches = self._open
        if len(open_batches) == 1 and open_batches[0].output_gradient is not None:
            self._done.append(open_batches[0])  # (the usual case, sooner)
            self._open = []
            return
        self._done.extend(b for b in open_batches if b.output_gradient is not None)
        self._open = [b for b in open_batches if b.output_gradient is None]

    def _before_step(self, optimizer, args, kwargs):
        step = self._log.n_steps
        if self.check == "every":
            now = self._fingerprints()
        else:  # (the usual case written out: a call less per step)
            now = [None if (g := p.grad) is None else (id(g), g._version) for p in self._params]
        active = [fingerprint is not None for fingerprint in now]
        if self._structure.changed(active):
            raise RecordingRefused(
                f"Step {step}: the module's trainable parameters or the optimiser's parameters "
                f"changed since the recorder was created ({STRUCTURE_CHANGES}); create a new "
                "recorder for a new set of parameters."
            )
        if self._stale or now != self._saved:  # (else, the usual case: nothing changed)
            self._check_gradients(step, active)
        batches = self._done
        if not batches:
            raise RecordingRefused(
                f"Step {step}: no backward pass through the module's output was recorded since "
                "the last step (gradients set by hand?)."
            )
        versions = [p._version for p in self._params]
        for batch in batches:
            batch.check(step, self.X, versions, self._X_numpy)
        if not self._weights.unchanged(self._log):
            self._refuse_changed_weights(step)
        if self._has_constants and self._constants.touched():
            changed = self._constants.difference(self.module)
            if changed is not None:
                name, difference = changed
                raise RecordingRefused(
                    f"Step {step}: the module's constant {name!r} (a frozen parameter or "
                    f"buffer) changed during the run (by up to {difference:.4g}; an edit "
                    "under no_grad, a custom running statistic): the recorded network "
                    "holds it constant."
                )
        # a parameter the backward pass reached whose gradient was removed by hand
        saved = self._saved
        removed = (
            self._no_removal
            if saved == now
            else [not on and saved[index] is not None for index, on in enumerate(active)]
        )
        self._rule.before_step(step, active, removed)
        if len(batches) == 1:  # the user's own index array, kept (shared between steps)
            rows, gradient = batches[0].rows, batches[0].output_gradient
        else:
            rows = np.concatenate([b.rows for b in batches])
            gradient = torch.cat([b.output_gradient for b in batches])
        masks = _step_masks(step, batches) if self._dropout.layers else None
        self._stats.record_step(step, batches)
        if self.check == "every" or (self.check == "first" and step == 0):
            self._verify(step, batches, active)
        self._pending = (rows, gradient, active, masks)
        for watcher in self._step_watchers:
            watcher.before_step(optimizer, args, kwargs)

    def _check_gradients(self, step, active):
        if self._stale:
            raise RecordingRefused(
                f"Step {step}: the gradients were not reset since the previous step "
                "(call optimizer.zero_grad() before each step's backward passes)."
            )
        for index, param in enumerate(self._params):
            if not active[index]:
                continue
            saved = self._saved[index]
            if saved is None and not bool(param.grad.any()):
                continue  # a zero gradient set by hand: a parameter the loss does not reach
            if saved != _fingerprint(self.check, param.grad):
                raise RecordingRefused(
                    f"Step {step}: the gradient of {self._names[index]!r} changed between the "
                    "backward pass and optimizer.step() (gradient clipping, an AMP "
                    "GradScaler's unscale_, or a manual edit); the step would not be the "
                    "recorded gradient's."
                )

    def _verify(self, step, batches, active):
        """The step's gradient recomputed from the recorded rows and output gradients."""
        params = [p for p, on in zip(self._params, active, strict=True) if on]
        self._own_forward = True
        try:
            with self._stats.paused():  # (a pass in training mode moves the statistics)
                total = _recomputed_gradient(
                    self.module, self.X, self.link, batches, params, self._dropout.replaying
                )
        finally:
            self._own_forward = False
        tolerance = 1e-9 if self._dtype == torch.float64 else 1e-4
        for name, param, recomputed in zip(
            [n for n, on in zip(self._names, active, strict=True) if on], params, total, strict=True
        ):
            difference = relative_difference(param.grad, recomputed)
            if difference > tolerance:
                raise RecordingRefused(
                    f"Step {step}: the gradient of {name!r} is not the backward pass of the "
                    "module's output on the recorded rows (relative difference "
                    f"{difference:.2e}): the loss depends on the weights or intermediate "
                    "values other than through the output (a penalty term, an auxiliary "
                    "loss), the gradients were scaled in place (an AMP GradScaler's "
                    "unscale_), or the rows passed to recorder.rows are not the batch's."
                )

    def _after_step(self, optimizer, args, kwargs):
        step = self._log.n_steps
        rows, gradient, active, masks = self._pending
        watch = self._weights
        weights = watch.flat_views()
        scales = self._rule.after_step(step, active)
        lr = scales.learning_rate
        if lr is None:  # (a rule that did not read it)
            lr = max([float(g["lr"]) for g in self._rule.groups()])
        self._log.append(
            weights, rows, gradient, scales, lr, masks, watch.on_host_views, watch.arrays
        )
        watch.after_step()
        self._leftover = self._saved
        self._open, self._done, self._saved, self._rows = [], [], list(self._none), None
        for watcher in self._step_watchers:
            watcher.after_step(optimizer, args, kwargs)

    def _refuse_changed_weights(self, step):
        """Step ``step``'s weights are not those step ``step - 1`` left: name the
        parameter, the size of the change and, if they are another recorded
        step's weights (restored), that step."""
        weights = self._log.weights()
        current = self._weights.flat()
        names = dict(zip(self._names, self._params, strict=True))
        name, difference = largest_difference(
            names, dict(zip(self._names, _split(weights[step], self._params), strict=True))
        )
        steps = matching_steps(weights[:step], current)
        restored = (
            f" They equal the recorded weights at step {steps[-1]} (restored): a run "
            "that goes back to earlier weights is two runs; record each with its own "
            "recorder, or stop there and call recorder.finish(at_step=...)."
            if steps
            else ""
        )
        when = (
            f"after step {step - 1}'s optimizer.step()"
            if step
            else "after the recorder was created"
        )
        raise RecordingRefused(
            f"Step {step}: the weights of {name!r} changed {when} and before this step "
            f"(by up to {difference:.4g}): an edit outside the optimiser (through .data, "
            "under no_grad, an average written back, load_state_dict) makes the path "
            f"another than the recorded one.{restored} Put weight changes in the "
            "optimiser (e.g. its weight_decay)."
        )


def _split(flat, params):
    """A flat weight vector as one view per parameter."""
    parts = torch.split(flat, [p.numel() for p in params])
    return [part.view(p.shape) for part, p in zip(parts, params, strict=True)]


def _check_module(module, X):
    """The estimators' module checks on a float64 eval copy of ``module`` (batch
    coupling, randomness, output shape and finiteness), on the first rows of ``X``."""
    for name, layer in module.named_modules():
        if isinstance(layer, _BatchNorm):
            refuse_unsupported(name, layer, training=False)
    copy64 = module_copy(module, float64_tensor, float64_tensor).eval()
    rows = X[: min(64, X.shape[0])].to(torch.float64)
    # (the output's width is the module's own: its first row's, in check_module)
    check_module(copy64, rows, None, classifier=True)


#: Up to this many rows, their range is checked by Python's min and max of a list
#: (a numpy reduction costs more per call inside the training loop: see the user
#: guide's "Cost").
_LIST_RANGE_ROWS = 1024


def _in_range(rows, n_rows):
    """Whether every index of ``rows`` (int64, not empty) lies in ``[0, n_rows)``."""
    if rows.size <= _LIST_RANGE_ROWS:
        values = rows.tolist()
        return min(values) >= 0 and max(values) < n_rows
    # (one reduction: a negative index read as unsigned is at least 2**63)
    return bool(rows.view(np.uint64).max() < n_rows)


def _fingerprint(check, grad):
    """What identifies a gradient as the one a backward pass left: the tensor and
    its version counter and, with ``check="every"``, its L1 norm (the AMP
    scaler's in-place unscale does not bump the version counter; at the first
    step the recomputation catches it)."""
    if check == "every":
        return id(grad), grad._version, float(torch.linalg.vector_norm(grad, 1))
    return id(grad), grad._version


def _step_masks(step, batches):
    """The step's dropout masks in the order of its rows (its micro-batches'
    masks joined), or None without dropout in training mode."""
    names = {name for batch in batches for name in batch.masks}
    if not names:
        return None
    for batch in batches:
        if set(batch.masks) != names:
            raise RecordingRefused(
                f"Step {step}: the step's forward passes used different dropout layers in "
                "training mode; keep each layer's mode fixed within a step."
            )
    if len(batches) == 1:
        return batches[0].masks
    return {name: torch.cat([batch.masks[name] for batch in batches]) for name in names}


def _recomputed_gradient(module, X, link, batches, params, replaying):
    """A step's gradient with respect to ``params``, recomputed from its micro-batches'
    recorded rows and output gradients: :math:`\\sum_b J_b^T (-e_b)` (one forward and
    one backward pass per micro-batch)."""
    total = [torch.zeros_like(p) for p in params]
    with torch.enable_grad():
        for batch in batches:
            with replaying(batch.masks):
                out = module(X[torch.as_tensor(batch.rows, device=X.device)])
            if link is not None:
                out = link(out)
            grads = torch.autograd.grad(
                out, params, grad_outputs=-batch.output_gradient, allow_unused=True
            )
            for t, g in zip(total, grads, strict=True):
                if g is not None:
                    t += g
    return total
