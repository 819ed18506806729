"""The training loop: gradient descent that records its path.

The loss is a sample-weighted mean over each batch of a per-sample loss of the
output ``f = link(module(X))`` (see ``_losses``: cross-entropy of the log-softmax,
or squared error). Every step is taken by a torch.optim optimiser (an optimiser rule of
``_optimizers``: plain SGD, momentum, Nesterov, Adam, AdamW, weight decay) and recorded
by the same :class:`~sklearn_pathkernel._training._recorder.PathRecorder` that
records a user's own loop: the weights of every step, each step's batch and output
gradients ``-dL_s/df(x_i)``, and the update's linear form read from the optimiser
(with Adam's preconditioner taken from the run), which is all the exact path kernel
needs.

Only trainable parameters (``requires_grad=True``) are recorded: frozen ones are
constants of the path, taken from the module itself.
"""

import time
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.utils import check_random_state

from .._path import WeightPath, batch_norm_layers, dropout_layers
from ._losses import CrossEntropy
from ._recorder import PathRecorder
from ._solvers import SolverSettings


@dataclass
class TrainingResult:
    """What :func:`train_module` returns (the module itself is trained in place)."""

    loss_curve: list
    n_iter: int
    n_steps: int
    path: WeightPath | None
    fit_time: float


def learning_rate_at(learning_rate, step):
    """The learning rate of ``step``: a constant, or ``learning_rate(step)``."""
    lr = learning_rate(step) if callable(learning_rate) else learning_rate
    lr = float(lr)
    if not np.isfinite(lr) or lr <= 0:
        raise ValueError(
            f"The learning rate must be a positive finite number; the schedule "
            f"returned {lr!r} at step {step}."
        )
    return lr


def _batches(n_samples, batch_size, shuffle, rng):
    """Index arrays of one epoch; full batch when ``batch_size`` is None."""
    if batch_size is None or batch_size >= n_samples:
        return None  # sentinel: the shared full-batch index array
    order = rng.permutation(n_samples) if shuffle else np.arange(n_samples)
    return [order[i : i + batch_size] for i in range(0, n_samples, batch_size)]


def train_module(
    module,
    X,
    y,
    *,
    loss=None,
    sample_weight=None,
    solver=None,
    learning_rate=0.1,
    max_iter=200,
    batch_size=None,
    shuffle=True,
    tol=None,
    n_iter_no_change=10,
    random_state=None,
    verbose=0,
    path_storage="memory",
):
    """Train ``module`` in place on the sample-weighted mean of a per-sample loss.

    Parameters
    ----------
    module : torch.nn.Module
        Maps ``X`` of shape (n_samples, ...) to the outputs (n_samples, K) that
        ``loss.link`` turns into ``f`` (logits for the cross-entropy).
        It is run in eval mode (frozen normalisation statistics) so that
        training and prediction evaluate one and the same function, except its
        ``nn.Dropout`` / ``nn.Dropout2d`` layers in training mode: they drop
        units during training, with masks the recorder draws and keeps (the
        training side of the kernel uses them), and its ``nn.BatchNorm1d`` /
        ``nn.BatchNorm2d`` layers in training mode: they normalise by batch
        statistics, the recorder follows their running statistics; the module is
        left in eval mode.
        Training runs on the device of ``X``, where the module, ``y`` and
        ``sample_weight`` must be too.
    X : torch.Tensor of shape (n_samples, ...)
    y : torch.Tensor
        Targets as ``loss`` takes them: class codes (n_samples,), int64, for
        the cross-entropy; (n_samples, n_outputs) floats for the squared error.
    loss : Loss or None
        The loss; None is the cross-entropy of the log-softmax.
    sample_weight : torch.Tensor of shape (n_samples,), default=None
    solver : SolverSettings or None
        The optimiser and its settings; None is plain gradient descent.
    learning_rate : float or callable
        A constant, or ``learning_rate(step) -> float`` (a schedule over steps).
    max_iter : int
        Number of epochs. With ``batch_size=None`` an epoch is one full-batch step.
    batch_size : int or None
    shuffle : bool
        Reshuffle the mini-batches every epoch (seeded by ``random_state``).
    tol, n_iter_no_change : float or None, int
        Stop when the epoch loss has not improved by ``tol`` for
        ``n_iter_no_change`` epochs. ``tol=None`` always runs ``max_iter`` epochs.
    random_state : int, RandomState or None
        Seeds the batch order (and the dropout masks, when the module has dropout).
    verbose : int
    path_storage : "memory", "disk" or path-like
        Where the recorded weights ``(max_iter * batches per epoch + 1, W)``
        (and Adam's preconditioners, as many numbers again) live: RAM, or a
        memory-mapped file (see
        :func:`~sklearn_pathkernel._path.allocate_weights`). The values are the same.
        The path is on the host whatever the device: each step's weights and
        coefficients are copied from the device after the step.

    Returns
    -------
    TrainingResult

    Raises
    ------
    FloatingPointError
        If the loss or the weights stop being finite; the message names the step.
    MemoryError
        Before training, if the weight path cannot fit in memory (or on disk).
    """
    start = time.perf_counter()
    rng = check_random_state(random_state)
    n_samples = X.shape[0]
    if sample_weight is None:
        sample_weight = torch.ones(n_samples, dtype=X.dtype, device=X.device)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The module has no trainable parameters (all have requires_grad=False).")
    loss_fn = loss or CrossEntropy()
    optimizer = (solver or SolverSettings()).optimizer(params, learning_rate_at(learning_rate, 0))
    dropout = [layer for _, layer in dropout_layers(module) if layer.training]
    batch_norms = [layer for _, layer in batch_norm_layers(module)]
    module.eval()
    for layer in [*dropout, *batch_norms]:  # (masks recorded; batch statistics followed)
        layer.train()

    full_batch = np.arange(n_samples)
    n_batches = (
        1 if _batches(n_samples, batch_size, False, rng) is None else (-(-n_samples // batch_size))
    )
    recorder = PathRecorder(
        module,
        optimizer,
        X,
        check="none",
        max_steps=max_iter * n_batches,
        link=loss_fn.link,
        storage=path_storage,
        generator=_mask_generator(dropout, rng, X.device),
    )
    stopping = _EarlyStopping(tol, n_iter_no_change)
    loss_curve = []
    for epoch in range(max_iter):
        batches = _batches(n_samples, batch_size, shuffle, rng) or [full_batch]
        epoch_loss = 0.0
        for batch in batches:
            step = recorder.n_steps
            lr = learning_rate_at(learning_rate, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            index = torch.as_tensor(batch, device=X.device)
            share = _shares(sample_weight[index])

            optimizer.zero_grad(set_to_none=False)
            f = loss_fn.link(module(X[index]))
            recorder.rows(batch, output=f)
            loss = loss_fn.batch_loss(f.detach(), y[index], share)
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"The training loss became {loss.item()} at step {step} "
                    f"(epoch {epoch}) with learning_rate={lr:g}; lower the "
                    "learning rate or scale the input features."
                )
            # e = -dL/df, the output gradients the kernel needs; the module's
            # gradient is their backward pass, G_s = -sum_i e_i . grad_w f(x_i).
            output_gradient = loss_fn.output_gradient(f, y[index], share)
            f.backward(-output_gradient)
            for param in params:
                # A parameter the loss does not reach gets a zero gradient, not None,
                # so that every optimiser updates it (momentum, weight decay) as the
                # recorded linear form says.
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            optimizer.step()

            with torch.no_grad():
                finite = all(bool(torch.isfinite(p).all()) for p in params)
            if not finite:
                raise FloatingPointError(
                    f"The weights stopped being finite at step {step} (epoch "
                    f"{epoch}) with learning_rate={lr:g}; lower the learning rate."
                )
            epoch_loss += loss.item() * float(sample_weight[index].sum())

        epoch_loss /= float(sample_weight.sum())
        loss_curve.append(epoch_loss)
        if verbose:
            print(f"Iteration {epoch + 1}, loss = {epoch_loss:.8f}")
        if stopping.stop(epoch_loss):
            break

    module.eval()
    return TrainingResult(
        loss_curve=loss_curve,
        n_iter=len(loss_curve),
        n_steps=recorder.n_steps,
        path=_closed(recorder),
        fit_time=time.perf_counter() - start,
    )


def _mask_generator(dropout, rng, device):
    """The generator of the dropout masks, seeded from ``rng`` (a fit is
    reproducible), or None without dropout (``rng`` is not drawn from then)."""
    if not dropout:
        return None
    return torch.Generator(device=device).manual_seed(int(rng.randint(2**31 - 1)))


def _closed(recorder):
    """The recorder's path, its hooks detached from the module."""
    recorder.close()
    return recorder.path()


def _shares(batch_weight):
    """The points' shares ``a_{s,i}`` of a batch's sample weight. A batch whose points
    all weigh 0 has zero loss: its gradient is 0 (the step may still move the
    weights: momentum, weight decay)."""
    total = batch_weight.sum()
    return batch_weight / total if total > 0 else torch.zeros_like(batch_weight)


class _EarlyStopping:
    """Stop when the epoch loss has not improved by ``tol`` for ``n_iter_no_change``
    epochs (never with ``tol=None``)."""

    def __init__(self, tol, n_iter_no_change):
        self.tol, self.n_iter_no_change = tol, n_iter_no_change
        self.best, self.stale = np.inf, 0

    def stop(self, epoch_loss):
        """Whether training stops after an epoch of loss ``epoch_loss``."""
        if self.tol is None:
            return False
        self.stale = self.stale + 1 if epoch_loss > self.best - self.tol else 0
        self.best = min(self.best, epoch_loss)
        return self.stale >= self.n_iter_no_change
