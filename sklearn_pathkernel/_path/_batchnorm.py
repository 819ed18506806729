"""BatchNorm trained in training mode: its running statistics as coordinates of the path.

In training mode ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` normalise each batch by
its own statistics, so row ``i``'s output depends on the whole batch; the
step's move is still a sum over rows, ``sum_{i in B_s} e_{s,i} . J_i``, with
``J_i`` the Jacobian of row ``i``'s output of the *batch* forward pass (taken
through the batch statistics). The network the kernel explains is the eval-mode
one, which normalises by the running statistics ``r = (mean, var)``. These move
by averaging, not by gradient: with momentum ``m`` (``1 / num_batches_tracked``
for ``momentum=None``), a batch of ``N`` rows with ``P`` positions each
(``n = N P`` values per channel, ``h_{ip}``) moves them by

    mean_{s+1} - mean_s = m (mu_B - mean_s)      = sum_i m sum_p (h_ip - mean_s) / n
    var_{s+1} - var_s   = m (s2_B - var_s)        = sum_i m [sum_p (h_ip - mu_B)^2 / (n - 1)
                                                              - var_s / N]

(``s2_B`` the unbiased batch variance, as torch keeps it): a sum over the rows.
The engine treats ``r`` as further coordinates of the weight path
(:func:`with_running_statistics`): along step ``s`` the pair ``(w, r)`` moves on
the line from ``(w_s, r_s)`` to ``(w_{s+1}, r_{s+1})``, the test copy integrates
the gradient with respect to both, and ``<phi_s^r, delta r_{s,i}>``, row ``i``'s
share of the statistics' move, is a term of its own added to row ``i``'s
contribution. The training gradients have no component along ``r`` (training
mode does not read it), so the update's linear form gets zero coefficients there.
"""

import types
from dataclasses import dataclass, replace

import torch
from torch import nn

from ._blockwise import Blockwise, block_values, per_step

#: The BatchNorm layers trained with batch statistics (exact types: a subclass may
#: override ``forward``).
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)

#: The running statistics of a BatchNorm layer that are coordinates of the path.
STATISTICS = ("running_mean", "running_var")


def batch_norm_layers(module):
    """``(name, layer)`` of the BatchNorm layers of ``module`` in training mode
    (any ``_BatchNorm`` subclass: the caller refuses the unsupported ones)."""
    return [
        (name, layer)
        for name, layer in module.named_modules()
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.training
    ]


def statistics_names(layer_name):
    """The path names of a layer's running statistics."""
    prefix = f"{layer_name}." if layer_name else ""
    return [f"{prefix}{name}" for name in STATISTICS]


def averaging_factor(layer):
    """The weight ``m`` of the batch statistics in the running averages of the pass
    that just ran (its ``num_batches_tracked`` already counted)."""
    if layer.momentum is None:
        return 1.0 / float(layer.num_batches_tracked)
    return float(layer.momentum)


def row_shares(inputs, mean, var, factor):
    """Each row's share of one pass's move of the running statistics.

    Parameters
    ----------
    inputs : torch.Tensor of shape (N, C) or (N, C, ...)
        The layer's input in the pass.
    mean, var : torch.Tensor of shape (C,)
        The running statistics before the pass.
    factor : float
        The averaging weight ``m`` (:func:`averaging_factor`).

    Returns
    -------
    torch.Tensor of shape (N, 2 C)
        Per row, its share of ``mean`` and of ``var``'s move (the module
        docstring's formulas); the rows' shares add up to the move.
    """
    h = inputs.detach()
    n_rows, n_channels = h.shape[:2]
    h = h.reshape(n_rows, n_channels, -1)
    n = n_rows * h.shape[2]
    if n < 2:
        raise ValueError("BatchNorm in training mode needs more than one value per channel.")
    batch_mean = h.mean(dim=(0, 2))
    mean_share = factor * (h - mean[None, :, None].to(h)).sum(2) / n
    squares = ((h - batch_mean[None, :, None]) ** 2).sum(2)
    var_share = factor * (squares / (n - 1) - var[None].to(h) / n_rows)
    return torch.cat([mean_share, var_share], dim=1)


@dataclass
class RunningStatistics:
    """The running statistics of a run's BatchNorm layers along its steps.

    Attributes
    ----------
    names : list of str
        Path names of the statistics (``"<layer>.running_mean"``,
        ``"<layer>.running_var"``, per layer).
    shapes : list of tuple
        Their shapes.
    values : torch.Tensor of shape (n_steps + 1, R)
        Flat statistics before each step; the last row is the final model's.
    shares : list of torch.Tensor
        Per step, (|B_s|, R): each batch row's share of the step's move
        ``values[s + 1] - values[s]`` (in the rows' order of ``batches[s]``).
    training_layers : list of str
        The BatchNorm layers that ran in training mode (the others in eval mode),
        the same at every step.
    factors : list of dict
        Per step, each training layer's averaging weight ``m`` (the momentum, or
        ``1 / num_batches_tracked`` for ``momentum=None``).
    """

    names: list
    shapes: list
    values: torch.Tensor
    shares: list
    training_layers: list
    factors: list

    @property
    def n_statistics(self):
        return self.values.shape[1]

    def truncated(self, n_steps):
        """The statistics of the first ``n_steps`` steps."""
        return replace(
            self,
            values=self.values[: n_steps + 1],
            shares=self.shares[:n_steps],
            factors=self.factors[:n_steps],
        )

    def astype(self, dtype):
        """The statistics rounded to ``dtype``."""
        return replace(
            self, values=self.values.to(dtype), shares=[s.to(dtype) for s in self.shares]
        )

    def move_error(self):
        """The largest ``|sum_i shares - (values[s+1] - values[s])|`` over the steps,
        relative to the statistics' size: how well the rows' shares add up to the
        recorded move (rounding only)."""
        worst = 0.0
        for step, shares in enumerate(self.shares):
            move = self.values[step + 1] - self.values[step]
            scale = float(self.values[step].abs().max()) + 1.0
            worst = max(worst, float((shares.sum(0) - move).abs().max()) / scale)
        return worst


def load_statistics(module, stats, step=-1):
    """Set ``module``'s running statistics to ``stats.values[step]`` (in place)."""
    buffers = dict(module.named_buffers())
    sizes = [int(torch.Size(shape).numel()) for shape in stats.shapes]
    with torch.no_grad():
        for name, value in zip(stats.names, torch.split(stats.values[step], sizes), strict=True):
            buffers[name].copy_(value.view_as(buffers[name]))


def with_running_statistics(path):
    """The path with its BatchNorm statistics as coordinates (see the module
    docstring): weights ``(w, r)``, the statistics' names and shapes after the
    parameters', the update's decays zero on them (and Adam's preconditioner).
    ``path`` without statistics is returned as it is."""
    stats = path.running_statistics
    if stats is None:
        return path
    numels = [int(torch.Size(shape).numel()) for shape in path.param_shapes]
    stat_numels = [int(torch.Size(shape).numel()) for shape in stats.shapes]
    update = path.update

    def zero_on_statistics(coefficient):
        if not coefficient:
            return coefficient
        values = [*block_values(coefficient, len(numels)), *([0.0] * len(stat_numels))]
        return Blockwise(values, [*numels, *stat_numels])

    preconditioners = update.preconditioners
    if preconditioners is not None:
        pad = preconditioners.new_zeros((preconditioners.shape[0], stats.n_statistics))
        preconditioners = torch.cat([preconditioners, pad], dim=1)
    update = replace(
        update,
        coupled_decay=zero_on_statistics(update.coupled_decay),
        decoupled_decays=per_step([zero_on_statistics(d) for d in update.decoupled_decays]),
        preconditioners=preconditioners,
        buffer_decay=_widened(update.buffer_decay, numels, stat_numels),
        gradient_scale=_widened(update.gradient_scale, numels, stat_numels),
        gradient_rates=_widened_steps(update.gradient_rates, numels, stat_numels),
        direct_rates=_widened_steps(update.direct_rates, numels, stat_numels),
    )
    augmented = replace(
        path,
        weights=torch.cat([path.weights, stats.values.to(path.weights)], dim=1),
        param_names=[*path.param_names, *stats.names],
        param_shapes=[*path.param_shapes, *stats.shapes],
        update=update,
        storage="memory",
    )
    augmented.__dict__.pop("_sizes", None)
    return augmented


def _widened(coefficient, numels, stat_numels):
    """A per-parameter coefficient given values on the statistics too (zero: the
    training gradients have no component there, so any value would do)."""
    if not isinstance(coefficient, Blockwise):
        return coefficient
    return Blockwise([*coefficient.values, *([0.0] * len(stat_numels))], [*numels, *stat_numels])


def _widened_steps(values, numels, stat_numels):
    if values.dtype != object:
        return values
    return per_step([_widened(v, numels, stat_numels) for v in values])


def eval_forward(layer, inputs):
    """``layer``'s eval-mode output written out, differentiable in its running
    statistics (``F.batch_norm`` is not): ``(x - mean) / sqrt(var + eps) *
    weight + bias``, channels on axis 1."""
    shape = (1, -1) + (1,) * (inputs.ndim - 2)
    out = (inputs - layer.running_mean.view(shape)) * torch.rsqrt(
        layer.running_var.view(shape) + layer.eps
    )
    if layer.affine:
        out = out * layer.weight.view(shape) + layer.bias.view(shape)
    return out


def differentiable_statistics(module):
    """Make ``module``'s BatchNorm1d/2d layers evaluate by :func:`eval_forward` (in
    place; for a private copy: the engine's probe differentiates the statistics)."""
    for _, layer in module.named_modules():
        if type(layer) in BATCH_NORMS and layer.running_mean is not None:
            layer.forward = types.MethodType(eval_forward, layer)


def statistics_factors(shares, n_weights):
    """The rows' shares ``(|B|, R)`` as flat vectors of the augmented path ``(|B|, 1,
    W + R)`` (zero on the weights)."""
    flat = shares.new_zeros((shares.shape[0], 1, n_weights + shares.shape[1]))
    flat[:, 0, n_weights:] = shares
    return flat
