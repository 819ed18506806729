"""BatchNorm's running statistics as part of the step that counterfactual attribution
differentiates.

A BatchNorm layer trained in training mode normalises each batch by the batch's own
statistics and moves its running statistics :math:`r = (\\text{mean}, \\text{var})` by
averaging,

.. math::

    r_{s+1} = r_s + m_s \\big(b_s(w_s) - r_s\\big), \\qquad
    b_s(w) = \\big(\\mu_B(w), \\tfrac{n}{n - 1} \\sigma^2_B(w)\\big),

with :math:`\\mu_B, \\sigma^2_B` the batch's mean and (biased) variance of the layer's
input over its ``n`` values per channel, and :math:`m_s` the layer's momentum (or
``1 / num_batches_tracked`` for ``momentum=None``, as recorded). The trained network
the queries see is the eval-mode one, which normalises by :math:`r_S`. So the run's
state is :math:`(w, r)`: the step's loss gradient depends on :math:`w` alone (through
the batch statistics, which couple the batch's rows), the running statistics on
:math:`w_s` through :math:`b_s`, and the target on both.
:class:`RunningStatisticsStep` evaluates the two passes a step needs on a private
copy of the network: the training pass (batch statistics, the running ones neither
read nor written, the batch's :math:`b_s` returned) and the query pass, differentiable
in the running statistics. A row's weight in the loss does not enter :math:`b_s`
(BatchNorm does not see the loss), as in real retraining with ``sample_weight``.

Cost: the batch statistics are reductions of activations the training pass computes
anyway; the query pass writes the eval-mode normalisation out (a few elementwise
operations per BatchNorm layer).
"""

import contextlib
import copy
import types

import torch
import torch.nn.functional as F

from .._path import BATCH_NORMS, eval_forward


class RunningStatisticsStep:
    """The training and query passes of a network with BatchNorm trained in training
    mode, and the running statistics' move.

    Parameters
    ----------
    module : torch.nn.Module
        The float64 network in eval mode (copied; not changed).
    stats : RunningStatistics
        The path's running statistics (names, shapes, training layers, averaging
        weights per step).

    Attributes
    ----------
    module : torch.nn.Module
        The private copy, each BatchNorm layer's forward replaced (see the module
        docstring).
    """

    def __init__(self, module, stats):
        self.module = copy.deepcopy(module)
        self.stats = stats
        self.sizes = [int(torch.Size(shape).numel()) for shape in stats.shapes]
        self._training = set(stats.training_layers)
        self._batch = None  # layer name -> (mean, unbiased var) during a training pass
        for name, layer in self.module.named_modules():
            if type(layer) in BATCH_NORMS and layer.running_mean is not None:
                layer.forward = types.MethodType(self._forward(name), layer)

    def _forward(self, name):
        def forward(layer, inputs):
            if self._batch is None or name not in self._training:
                return eval_forward(layer, inputs)
            dims = [0, *range(2, inputs.ndim)]
            n = inputs.numel() // inputs.shape[1]
            if n < 2:
                raise ValueError(
                    "BatchNorm in training mode needs more than one value per channel."
                )
            mean = inputs.mean(dims)
            variance = inputs.var(dims, correction=1)
            self._batch[name] = (mean, variance)
            return F.batch_norm(
                inputs, None, None, layer.weight, layer.bias, True, 0.0, layer.eps
            )

        return forward

    @contextlib.contextmanager
    def training_pass(self):
        """Within: the training layers normalise by the batch's statistics; yields
        the dict they write their :math:`b_s` into (layer name to (mean, var))."""
        self._batch = {}
        try:
            yield self._batch
        finally:
            self._batch = None

    def moved(self, step, statistics, batch):
        """:math:`r_{s+1} = r_s + m_s (b_s - r_s)` for the training layers (the others
        keep theirs): ``statistics`` the flat :math:`r_s` (R,), ``batch`` what the
        step's training pass wrote."""
        parts = list(torch.split(statistics, self.sizes))
        factors = self.stats.factors[step]
        for index, name in enumerate(self.stats.names):
            layer, _, which = name.rpartition(".")
            factor = factors.get(layer)
            if factor is None:  # (an eval-mode layer, or no pass at this step)
                continue
            value = batch[layer][0 if which == "running_mean" else 1]
            parts[index] = parts[index] + factor * (value - parts[index])
        return torch.cat(parts)
