"""A user's loop with its loss stated: the loss on the recorded output, its check
against the recorded output gradients, and the run trained again by ``torch.optim``.

A recording of a user's loop holds each step's output gradients
:math:`e_{s,i} = -\\partial L_s / \\partial f(x_i; w_s)` exactly as the user's loss
produced them, but not the loss itself. Stated by the user (a registered loss, see
:mod:`._losses`, applied to the recording's output ``f``: the module's output, or the
recorder's link of it), with the training targets, it is checked, not trusted:
:func:`check_output_gradients` recomputes every step's

.. math::

    \\hat e_{s,i} = -a_{s,i} \\frac{\\partial l(f(x_i; w_s), y_i)}{\\partial f},
    \\qquad a_{s,i} = 1 / |B_s|

(the mean over the step's rows) at the recorded weights and refuses the statement
where it differs from the recorded :math:`e_{s,i}` beyond rounding: a wrong loss or
wrong targets, label smoothing, class weights, a sum reduction or unaveraged
gradient accumulation. :func:`retrain` then trains the run again, with a fresh
optimiser of the recorded settings (:mod:`._optimizer_settings`), the recorded
batches and learning rates, and any rows' weights moved: real retraining, the
independent check of counterfactual scores. Both evaluate each step as it was
trained: with the dropout masks its rows drew in the recorded run (the masks are part
of the run: a row's weight moves its loss, not the randomness), and with the BatchNorm
layers that trained in training mode in training mode (batch statistics; the
retraining's own running statistics, from the recorded initial ones, are its
result's).
"""

import copy
from dataclasses import replace

import numpy as np
import torch
from torch.func import functional_call

from .._path import load_statistics, masks_applied
from ._losses import CLASSIFICATION_LOSSES, REGRESSION_LOSSES, Loss
from ._optimizers import RecordingRefused
from ._replay import ROUNDING_STEPS, check_replay

DTYPE = torch.float64


class StatedLoss(Loss):
    """A loss applied to a recording's output ``f``: ``l(loss.link(f), y)``.

    Parameters
    ----------
    loss : Loss
        The stated loss (``log_loss``: the cross-entropy of ``log_softmax(f)``,
        ``torch.nn.functional.cross_entropy`` on ``f``; ``squared_error``:
        ``|f - y|^2 / (2K)``, half of ``torch.nn.functional.mse_loss``).
    link : callable
        The recording's ``f`` of the module's output (the identity, or the
        recorder's ``link``).
    """

    def __init__(self, loss, link):
        self.loss, self._link = loss, link
        self.classifies = loss.classifies
        self.summary = loss.summary

    def link(self, out):
        return self._link(out)

    def per_sample(self, f, targets):
        return self.loss.per_sample(self.loss.link(f), targets)


def resolve_loss(loss):
    """The :class:`Loss` of a recording's ``loss``: a registered name (the
    estimators' ``loss`` values) or a ``Loss`` instance; else a clear error."""
    if isinstance(loss, Loss):
        return loss
    names = {**CLASSIFICATION_LOSSES, **REGRESSION_LOSSES}
    if isinstance(loss, str) and loss in names:
        if loss in CLASSIFICATION_LOSSES and loss in REGRESSION_LOSSES:
            raise ValueError(f"The loss name {loss!r} is registered twice; pass a Loss instance.")
        return names[loss]()
    raise ValueError(
        f"loss must be a registered loss name {sorted(names)} or a Loss instance, got {loss!r}."
    )


def loss_targets(targets, loss, n_outputs, device):
    """The training targets as ``loss`` takes them: class codes (M,) int64 in
    ``[0, K)``, or values (M, K) float64; else a clear error."""
    if targets is None:
        raise ValueError(
            "Counterfactual attribution of a recording needs its training targets: "
            "TrainingRecorder(module, optimizer, X, y=y, loss=...)."
        )
    targets = np.asarray(targets)
    if loss.classifies:
        if targets.ndim != 1 or targets.dtype.kind not in "iu":
            raise ValueError(
                f"A classification loss needs integer class labels (M,); the recording's "
                f"targets have shape {targets.shape} and dtype {targets.dtype}."
            )
        if targets.size and (targets.min() < 0 or targets.max() >= n_outputs):
            raise ValueError(
                f"A classification loss needs labels in [0, {n_outputs}) (output k is class "
                f"k); the recording's are in [{targets.min()}, {targets.max()}]."
            )
        return torch.as_tensor(targets, dtype=torch.int64, device=device)
    values = targets.astype(np.float64)
    values = values.reshape(-1, 1) if values.ndim == 1 else values
    if values.ndim != 2 or values.shape[1] != n_outputs:
        raise ValueError(
            f"A regression loss needs target values of shape (M, {n_outputs}) (or (M,) for "
            f"one output); the recording's have shape {targets.shape}."
        )
    return torch.as_tensor(values, dtype=DTYPE, device=device)


def batch_shares(weights, rows):
    """The rows' shares of their batch's weight, ``w[rows] / w[rows].sum()`` (zeros
    for a batch of weight 0)."""
    weight = weights[rows]
    total = weight.sum()
    return weight / total if total > 0 else torch.zeros_like(weight)


def check_sample_weight(sample_weight, n):
    """A user's stated sample weights as a float64 array (n,), or None; a clear error
    for another shape, negative or non-finite values."""
    if sample_weight is None:
        return None
    if isinstance(sample_weight, torch.Tensor):
        sample_weight = sample_weight.detach().cpu().numpy()
    weights = np.asarray(sample_weight, dtype=np.float64)
    if weights.shape != (n,):
        raise ValueError(
            f"sample_weight must hold one weight per training row, shape ({n},); got "
            f"{weights.shape}."
        )
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError("sample_weight must be finite and non-negative.")
    return weights


def as_weights(sample_weight, n, device):
    """The rows' sample weights as a float64 tensor (M,) (ones for None)."""
    if sample_weight is None:
        return torch.ones(n, dtype=DTYPE, device=device)
    return torch.as_tensor(np.asarray(sample_weight, dtype=np.float64), device=device)


def check_output_gradients(path, module, X, y, loss, dtype, sample_weight=None):
    """Refuse a stated loss whose output gradients are not the recorded ones.

    Parameters
    ----------
    path : WeightPath
        The recorded path, in the training dtype (its weights and output gradients).
    module : torch.nn.Module
        The float64 network.
    X : torch.Tensor
        The float64 training inputs.
    y : torch.Tensor
        The targets as ``loss`` takes them (:func:`loss_targets`).
    loss : StatedLoss
    dtype : torch.dtype
        The training dtype. The output gradients are compared as the cotangents
        they send into the module's output (through the recording's link); the
        tolerance is ``ROUNDING_STEPS`` of the dtype's unit roundoff (the replay's
        rounding allowance, :func:`~._replay.replay_bound`), relative to the step's
        scale ``max(|e|, |e_hat|, a (1 + |f|))``.
    sample_weight : ndarray of shape (M,) or None
        The rows' weights in each batch's weighted mean (None: the plain mean).

    Returns
    -------
    float
        The largest relative difference over the steps.

    Raises
    ------
    RecordingRefused
        Naming the first step beyond the tolerance, the size of the difference and
        the ratio of the recorded to the stated output gradients.
    """
    tolerance = ROUNDING_STEPS * torch.finfo(dtype).eps / 2
    weights_of_rows = as_weights(sample_weight, X.shape[0], X.device)
    module = _as_trained(copy.deepcopy(module), path)
    largest = 0.0
    for step in range(path.n_steps):
        rows = torch.as_tensor(path.batches[step], device=X.device)
        weights = path.unflatten(path.weights[step].to(device=X.device, dtype=DTYPE))
        with torch.enable_grad(), masks_applied(module, path.masks(step)):
            out = functional_call(module, weights, (X[rows],)).detach().requires_grad_(True)
            f = loss.link(out)
        shares = batch_shares(weights_of_rows, rows)
        stated = loss.output_gradient(f, y[rows], shares)
        recorded = path.output_gradients[step].to(device=X.device, dtype=DTYPE)
        if recorded.shape != stated.shape:
            raise RecordingRefused(
                f"Step {step}: the recorded output gradients have shape "
                f"{tuple(recorded.shape)}, the stated loss's {tuple(stated.shape)}."
            )
        # both as cotangents of the module's output (a link's null space, e.g. the
        # constant shift of log_softmax, moves no weight)
        recorded, stated = (
            torch.autograd.grad(f, out, grad_outputs=e, retain_graph=True)[0]
            for e in (recorded, stated)
        )
        f = f.detach()
        scale = max(
            float(recorded.abs().max()),
            float(stated.abs().max()),
            float((1.0 + f.abs().max()) * shares.max()),
        )
        difference = float((recorded - stated).abs().max()) / scale
        largest = max(largest, difference)
        if not difference <= tolerance:
            ratio = float((recorded * stated).sum() / (stated * stated).sum().clamp_min(1e-300))
            raise RecordingRefused(
                f"Step {step}: the recorded output gradients are not those of the stated "
                f"loss ({loss.summary or type(loss.loss).__name__}, the "
                f"{'weighted ' if sample_weight is not None else ''}mean over the "
                f"step's {rows.shape[0]} rows) on the recorded targets: they differ by "
                f"{difference:.3g} relative to the step's scale (rounding allows "
                f"{tolerance:.3g}); the recorded ones are {ratio:.4g} times the stated "
                "ones on average. Another loss or other targets, label smoothing, class "
                "weights, a sum reduction or gradient accumulation without averaging "
                "make another run: state the loss the loop minimised."
            )
    return largest


def float64_twin(module, recorded, replayed, X, y, loss, settings, *, sample_weight=None):
    """The float64 twin of a float32 run: :func:`retrain` of every step from the
    recorded :math:`w_0`, checked to end within the float32 run's rounding bound of
    its recorded final weights (and running statistics).

    Parameters
    ----------
    module : torch.nn.Module
        The float64 network.
    recorded : WeightPath
        The recorded float32 path (what the twin is checked against).
    replayed : WeightPath
        Its float64 path (:func:`~._replay.float64_run`: anchored at the recorded
        weights, or a BatchNorm network's replay): the batches, masks, running
        statistics, learning rates and :math:`w_0` are read.
    X, y, loss, settings, sample_weight
        As :func:`retrain` takes them.

    Returns
    -------
    WeightPath
        ``replayed`` with the twin's weights (and running statistics' values) of
        every step, in memory, and no rounding moves. The rows' shares of the
        statistics' moves stay the replay's (what the sweep differentiates does not
        read them; the kernel of a float32 run is that of its own weights, not the
        twin's).

    Raises
    ------
    RecordingRefused
        When the twin ends beyond the float32 run's rounding bound
        (:func:`~._replay.check_replay`).
    """
    coordinates = retrain(
        module, replayed, X, y, loss, settings, sample_weight=sample_weight, every_step=True
    )
    n_weights = sum(int(torch.Size(shape).numel()) for shape in replayed.param_shapes)
    stats = replayed.running_statistics
    if stats is not None:
        stats = replace(stats, values=coordinates[:, n_weights:])
    twin = replace(
        replayed,
        weights=coordinates[:, :n_weights],
        storage="memory",
        running_statistics=stats,
        rounding_moves=None,  # (a float64 run: its moves are the update's)
    )
    check_replay(recorded, twin)
    return twin


def _as_trained(module, path):
    """``module`` (a copy) with the BatchNorm layers that trained in training mode
    back in training mode, from the recorded initial running statistics (and, for
    ``momentum=None``'s cumulative average, the count of batches before the run:
    its first averaging weight is ``1 / (count + 1)``)."""
    stats = path.running_statistics
    if stats is not None:
        load_statistics(module, stats, 0)
        layers = dict(module.named_modules())
        first = stats.factors[0] if stats.factors else {}
        for name in stats.training_layers:
            layer = layers[name]
            layer.train()
            if layer.momentum is None and name in first:
                with torch.no_grad():
                    layer.num_batches_tracked.fill_(round(1.0 / first[name]) - 1)
    return module


def _coordinates(params, module, path):
    """The flat weights, and the running statistics after them (as
    ``TrainingRun.weights``), on the host."""
    parts = [p.detach().reshape(-1) for p in params]
    stats = path.running_statistics
    if stats is not None:
        buffers = dict(module.named_buffers())
        parts += [buffers[name].detach().reshape(-1) for name in stats.names]
    return torch.cat(parts).cpu()


def retrain(module, path, X, y, loss, settings, *, sample_weight=None, loss_scale=1.0,
            every_step=False):  # fmt: skip
    """The recorded run trained again in float64 by a fresh ``torch.optim`` optimiser.

    From the recorded :math:`w_0`, with the recorded batches, learning rates and
    optimiser settings, each step minimising ``loss_scale`` times the step's loss
    :math:`\\sum_{i \\in B_s} \\omega_i l_i / \\sum_{j \\in B_s} \\omega_j`.

    Parameters
    ----------
    module : torch.nn.Module
        The float64 network (copied; its constants are kept).
    path : WeightPath
    X, y : torch.Tensor
        The float64 training inputs, the targets as ``loss`` takes them.
    loss : Loss
        The training loss (``link`` and ``per_sample``; a recording's
        :class:`StatedLoss`).
    settings : OptimizerSettings or SolverSchedule
        The optimiser at every step: ``settings.optimizer(params)`` a fresh one,
        ``settings.set_step(optimizer, step)`` its learning rates at ``step``.
    sample_weight : ndarray of shape (M,) or None
        The rows' weights (None: ones, the plain mean).
    loss_scale : float, default=1.0
    every_step : bool, default=False
        Return the coordinates of every step (S + 1, W + R), else the final ones
        (W + R,).

    Returns
    -------
    torch.Tensor
        On the host, float64: the flat weights, and with BatchNorm trained in
        training mode its ``R`` running statistics after them (the retraining's own,
        in the order of ``path.running_statistics.names``).
    """
    module = _as_trained(copy.deepcopy(module), path)
    start = path.unflatten(path.weights[0].to(device=X.device, dtype=DTYPE))
    params = []
    with torch.no_grad():
        for name in path.param_names:
            param = module.get_parameter(name)
            param.copy_(start[name].reshape(param.shape))
            param.requires_grad_(True)
            params.append(param)
    optimizer = settings.optimizer(params)
    weight = as_weights(sample_weight, X.shape[0], X.device)
    steps = [_coordinates(params, module, path)] if every_step else None
    for step in range(path.n_steps):
        settings.set_step(optimizer, step)
        optimizer.zero_grad()
        rows = torch.as_tensor(path.batches[step], device=X.device)
        shares = batch_shares(weight, rows)
        with masks_applied(module, path.masks(step)):
            f = loss.link(module(X[rows]))
        (loss_scale * (shares * loss.per_sample(f, y[rows])).sum()).backward()
        for param in params:  # (a parameter the loss does not reach: a zero gradient,
            if param.grad is None:  # as the estimators' loop gives it)
                param.grad = torch.zeros_like(param)
        optimizer.step()
        if every_step:
            steps.append(_coordinates(params, module, path))
    if every_step:
        return torch.stack(steps)
    return _coordinates(params, module, path)
