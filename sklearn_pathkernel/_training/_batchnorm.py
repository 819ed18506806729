"""The running statistics of BatchNorm layers trained in training mode, recorded.

Each forward pass of a ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` layer in training
mode moves its running statistics by averaging in the batch's statistics. The
recorder keeps, per step, the statistics before the step's pass and each
batch row's share of their move (:func:`~.._path.row_shares`), and checks that
the statistics change only by the recorded passes: bitwise, the statistics a
step's pass starts from are those the previous recorded pass left, and the
final module's are the last pass's. The engine makes them coordinates of the
path (see ``_path/_batchnorm.py``).
"""

import contextlib

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .._path import (
    BATCH_NORMS,
    RunningStatistics,
    averaging_factor,
    load_statistics,
    row_shares,
    statistics_names,
)
from ._optimizers import RecordingRefused


def refuse_unsupported(name, layer, where="The module's", training=True):
    """Raise ``RecordingRefused`` for a BatchNorm layer the kernel cannot follow: one
    without running statistics, or (in training mode) of another type than
    BatchNorm1d/2d."""
    subject = f"{where} layer {name!r} ({type(layer).__name__})"
    if layer.running_mean is None or layer.running_var is None:
        raise RecordingRefused(
            f"{subject} has track_running_stats=False: it normalises by the batch's "
            "statistics in eval mode too, so the evaluated network's output on one row "
            "depends on the rows evaluated with it and no per-row kernel reproduces it. "
            "Build it with track_running_stats=True."
        )
    if training and type(layer) not in BATCH_NORMS:
        raise RecordingRefused(
            f"{subject} is a BatchNorm in training mode of a type whose running statistics "
            "the recorder does not follow (only nn.BatchNorm1d and nn.BatchNorm2d are "
            "supported in training mode). Put it in eval mode, or use one of those."
        )


#: A step's shares of a module without BatchNorm layers (never read: not trained).
_NO_SHARES = torch.zeros((0, 0), device="cpu")


class StatisticsWatch:
    """Follows the running statistics of a module's BatchNorm layers.

    Parameters
    ----------
    module : torch.nn.Module
        The recorded module; its BatchNorm1d/2d layers get a forward pre-hook and a
        forward hook (removed by :meth:`close`).
    """

    def __init__(self, module):
        self.layers = [
            (name, layer) for name, layer in module.named_modules() if isinstance(layer, _BatchNorm)
        ]
        self.tracked = [
            (name, layer)
            for name, layer in self.layers
            if type(layer) in BATCH_NORMS and layer.running_mean is not None
        ]
        self.names, self.shapes = [], []
        for name, layer in self.tracked:
            self.names.extend(statistics_names(name))
            self.shapes.extend([tuple(layer.running_mean.shape)] * 2)
        self._values = [self.current()]  # flat statistics before each step, and after
        self._shares = []
        self._factors = []
        self._pass = {}  # layer name -> (before, after, shares, factor) of the pass
        self._inputs = {}
        self._paused = False
        self.trained = False  # whether a recorded pass ran a layer in training mode
        self._training_layers = None  # the layers in training mode at every step
        self._handles = []
        for name, layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._before(name)))
            self._handles.append(layer.register_forward_hook(self._after(name)))

    def buffer_names(self):
        """The names of the followed buffers (running statistics and batch counters),
        which the recorder does not hold constant."""
        names = list(self.names)
        for name, _ in self.tracked:
            names.append(f"{name}.num_batches_tracked" if name else "num_batches_tracked")
        return names

    def current(self):
        """The followed statistics now, flat (on the host)."""
        parts = []
        for _, layer in self.tracked:
            parts += [
                layer.running_mean.detach().reshape(-1),
                layer.running_var.detach().reshape(-1),
            ]
        if not parts:
            return torch.zeros(0, dtype=torch.float64, device="cpu")
        return torch.cat(parts).cpu().clone()

    def start_pass(self, *_):
        """A forward pass of the whole module begins (a root pre-hook)."""
        self._pass, self._inputs = {}, {}

    def take(self):
        """What the last forward pass did to the statistics (layer name to
        ``(before, after, shares, factor)``)."""
        taken, self._pass = self._pass, {}
        return taken

    @contextlib.contextmanager
    def paused(self):
        """The recorder's own forward passes: not followed, and the statistics they
        move are put back."""
        saved = [
            (buffer, buffer.detach().clone())
            for _, layer in self.layers
            for buffer in layer.buffers(recurse=False)
        ]
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)

    def close(self):
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, name):
        def hook(layer, args):
            if self._paused or not layer.training:
                return
            refuse_unsupported(name, layer)
            self._inputs[name] = (
                args[0].detach(),
                layer.running_mean.detach().clone(),
                layer.running_var.detach().clone(),
            )

        return hook

    def _after(self, name):
        def hook(layer, args, output):
            if self._paused or not layer.training:
                return
            if name in self._pass:
                raise RecordingRefused(
                    f"BatchNorm layer {name!r} is called twice in one forward pass; the "
                    "recorder follows one update of its running statistics per pass."
                )
            inputs, mean, var = self._inputs.pop(name)
            factor = averaging_factor(layer)
            shares = row_shares(inputs, mean, var, factor)
            after = torch.cat([layer.running_mean.detach(), layer.running_var.detach()])
            self._pass[name] = (
                torch.cat([mean, var]).cpu(),
                after.cpu().clone(),
                shares.cpu(),
                factor,
            )

        return hook

    def record_step(self, step, batches):
        """Check and keep step ``step``'s move of the statistics (its micro-batches'
        passes, each with ``stats`` from :meth:`take`)."""
        if not self.layers:  # (no BatchNorm: nothing moves, nothing is recorded)
            self._values.append(self._values[-1])
            self._factors.append({})
            self._shares.append(_NO_SHARES)
            return
        passes = [batch for batch in batches if batch.stats]
        if passes and len(batches) > 1:
            raise RecordingRefused(
                f"Step {step}: the step has {len(batches)} forward passes (micro-batches) "
                "with BatchNorm in training mode: each pass normalises by its own batch "
                "and updates the running statistics, and the recorder supports one such "
                "pass per step. Use one forward pass per step."
            )
        training = sorted(passes[0].stats) if passes else []
        if self._training_layers is None:
            self._training_layers = training
        elif training != self._training_layers:
            raise RecordingRefused(
                f"Step {step}: the BatchNorm layers in training mode changed (from "
                f"{self._training_layers} to {training}); the recorder needs each layer's "
                "mode fixed for the run."
            )
        previous = self._values[-1]
        shares, factors = [], {}
        n_rows = len(batches[0].rows) if batches else 0
        offset = 0
        expected = previous.clone()
        for name, layer in self.tracked:
            size = 2 * layer.running_mean.numel()
            recorded = passes[0].stats.get(name) if passes else None
            if recorded is None:
                shares.append(torch.zeros((n_rows, size), dtype=previous.dtype))
            else:
                before, after, layer_shares, factors[name] = recorded
                if not torch.equal(before.to(previous.dtype), previous[offset : offset + size]):
                    self._refuse_outside(step, name)
                shares.append(layer_shares.to(previous.dtype))
                expected[offset : offset + size] = after.to(previous.dtype)
                self.trained = True
            offset += size
        if not torch.equal(self.current().to(expected.dtype), expected):
            self._refuse_outside(step, self._changed_layer(expected))
        self._values.append(expected)
        self._factors.append(factors)
        self._shares.append(torch.cat(shares, dim=1) if shares else torch.zeros((n_rows, 0)))

    def _changed_layer(self, expected):
        now, offset = self.current().to(expected.dtype), 0
        for name, layer in self.tracked:
            size = 2 * layer.running_mean.numel()
            if not torch.equal(now[offset : offset + size], expected[offset : offset + size]):
                return name
            offset += size
        return "?"

    def _refuse_outside(self, step, name):
        raise RecordingRefused(
            f"Step {step}: the running statistics of BatchNorm layer {name!r} changed "
            "outside the step's recorded forward pass (a forward pass in training mode "
            "without gradients or whose gradients were dropped, a pass of another step, "
            "or an edit): the recorded network would not be the model."
        )

    def restore(self, module, at_step):
        """Put the statistics after ``at_step`` recorded steps into ``module`` (a copy
        of the recorded module)."""
        stats = RunningStatistics(self.names, self.shapes, torch.stack(self._values), [], [], [])
        load_statistics(module, stats, at_step)

    def difference(self, at_step=None):
        """The followed layer whose statistics differ from those after ``at_step``
        recorded steps (the last when None): ``(name, max |difference|)``, or None."""
        last = self._values[-1 if at_step is None else at_step]
        now, offset = self.current(), 0
        for name, layer in self.tracked:
            size = 2 * layer.running_mean.numel()
            gap = now[offset : offset + size].double() - last[offset : offset + size].double()
            if gap.numel() and float(gap.abs().max()) > 0:
                return name, float(gap.abs().max())
            offset += size
        return None

    def statistics(self, n_steps):
        """The :class:`RunningStatistics` of the first ``n_steps`` steps, or None
        when no recorded pass ran a BatchNorm layer in training mode."""
        if not self.trained:
            return None
        return RunningStatistics(
            list(self.names),
            list(self.shapes),
            torch.stack(self._values[: n_steps + 1]),
            list(self._shares[:n_steps]),
            list(self._training_layers),
            list(self._factors[:n_steps]),
        )
