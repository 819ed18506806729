"""Training core shared by the estimators: gradient descent that records its path.

The loss is the (sample-weighted) mean cross-entropy of ``log_softmax(module(X))``
over each batch. With ``solver="sgd"`` and ``momentum=0`` every step is

    w_{s+1} = w_s - lr_s * grad L_s(w_s),

and the run is recorded as a :class:`~sklearn_pathkernel._path.WeightPath`, which
is all the exact path kernel needs. Other solvers train the same way but record
no path, because the path kernel of their updates is not implemented.
"""

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.utils import check_random_state

from ._path import WeightPath, allocate_weights, flatten_parameters


@dataclass
class TrainingResult:
    """What :func:`train_module` returns (the module itself is trained in place)."""

    loss_curve: list
    n_iter: int
    n_steps: int
    path: WeightPath | None
    fit_time: float


def records_path(solver, momentum):
    """Whether a run with these settings can be written as an exact path kernel."""
    return solver == "sgd" and momentum == 0


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


def _make_optimizer(params, solver, learning_rate, momentum):
    if solver == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=momentum)
    if solver == "adam":
        return torch.optim.Adam(params, lr=learning_rate)
    raise ValueError(f"Unknown solver {solver!r}; expected 'sgd' or 'adam'.")


def train_module(
    module,
    X,
    y,
    *,
    sample_weight=None,
    solver="sgd",
    learning_rate=0.1,
    momentum=0.0,
    max_iter=200,
    batch_size=None,
    shuffle=True,
    tol=None,
    n_iter_no_change=10,
    random_state=None,
    verbose=0,
    path_storage="memory",
):
    """Train ``module`` in place on the mean cross-entropy of its log-softmax.

    Parameters
    ----------
    module : torch.nn.Module
        Maps ``X`` of shape (n_samples, ...) to logits (n_samples, n_classes).
        It is run in eval mode (no dropout, frozen normalisation statistics) so
        that training and prediction evaluate one and the same function.
        Training runs on the device of ``X``, where the module, ``y`` and
        ``sample_weight`` must be too.
    X : torch.Tensor of shape (n_samples, ...)
    y : torch.Tensor of shape (n_samples,), int64 class codes.
    sample_weight : torch.Tensor of shape (n_samples,), default=None
    solver : {"sgd", "adam"}
    learning_rate : float or callable
        A constant, or ``learning_rate(step) -> float`` (a schedule over steps).
    momentum : float
        Momentum of ``"sgd"``; 0 is plain gradient descent.
    max_iter : int
        Number of epochs. With ``batch_size=None`` an epoch is one full-batch step.
    batch_size : int or None
    shuffle : bool
        Reshuffle the mini-batches every epoch (seeded by ``random_state``).
    tol, n_iter_no_change : float or None, int
        Stop when the epoch loss has not improved by ``tol`` for
        ``n_iter_no_change`` epochs. ``tol=None`` always runs ``max_iter`` epochs.
    random_state : int, RandomState or None
        Seeds the batch order.
    verbose : int
    path_storage : "memory", "disk" or path-like
        Where the recorded weights ``(max_iter * batches per epoch + 1, W)``
        live: RAM, or a memory-mapped file (see
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
    optimizer = _make_optimizer(params, solver, learning_rate_at(learning_rate, 0), momentum)
    module.eval()

    record = records_path(solver, momentum)
    full_batch = np.arange(n_samples)
    n_batches = (
        1 if _batches(n_samples, batch_size, False, rng) is None else (-(-n_samples // batch_size))
    )
    if record:
        flat0, names, shapes = flatten_parameters(module)
        weights, storage = allocate_weights(
            max_iter * n_batches + 1, flat0.numel(), path_storage, dtype=flat0.dtype
        )
        weights[0] = flat0.to(weights.device)
        path = WeightPath(weights, [], [], None, names, shapes, storage)

    loss_curve, learning_rates = [], []
    best_loss, no_improvement, step = np.inf, 0, 0
    for epoch in range(max_iter):
        batches = _batches(n_samples, batch_size, shuffle, rng) or [full_batch]
        epoch_loss = 0.0
        for batch in batches:
            lr = learning_rate_at(learning_rate, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            index = torch.as_tensor(batch, device=X.device)
            batch_weight = sample_weight[index].sum()
            # A batch whose points all weigh 0 has zero loss: a step that moves nothing.
            share = (
                sample_weight[index] / batch_weight
                if batch_weight > 0
                else torch.zeros_like(sample_weight[index])
            )

            optimizer.zero_grad(set_to_none=True)
            log_proba = F.log_softmax(module(X[index]), dim=1)
            per_sample = -log_proba.gather(1, y[index, None]).squeeze(1)
            loss = (share * per_sample).sum()
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"The training loss became {loss.item()} at step {step} "
                    f"(epoch {epoch}) with learning_rate={lr:g}; lower the "
                    "learning rate or scale the input features."
                )
            loss.backward()
            optimizer.step()

            if record:
                with torch.no_grad():
                    flat = torch.nn.utils.parameters_to_vector(module.parameters())
                    weights[step + 1] = flat.to(weights.device)  # the path stays on the host
                finite = bool(torch.isfinite(weights[step + 1]).all())
            else:  # no path to look at (adam, momentum): check the parameters themselves
                finite = all(bool(torch.isfinite(p).all()) for p in params)
            if not finite:
                raise FloatingPointError(
                    f"The weights stopped being finite at step {step} (epoch "
                    f"{epoch}) with learning_rate={lr:g}; lower the learning rate."
                )
            if record:
                path.batches.append(batch)
                path.coefficients.append((lr * share).detach().to("cpu", copy=True))
                learning_rates.append(lr)
            epoch_loss += loss.item() * float(sample_weight[index].sum())
            step += 1

        epoch_loss /= float(sample_weight.sum())
        loss_curve.append(epoch_loss)
        if verbose:
            print(f"Iteration {epoch + 1}, loss = {epoch_loss:.8f}")
        if tol is not None:
            if epoch_loss > best_loss - tol:
                no_improvement += 1
            else:
                no_improvement = 0
            best_loss = min(best_loss, epoch_loss)
            if no_improvement >= n_iter_no_change:
                break

    if not record:
        path = None
    else:
        if step + 1 < path.weights.shape[0]:
            # Stopped early: drop the unused rows (a view on disk, a copy in RAM).
            path.weights = path.weights[: step + 1]
            if storage == "memory":
                path.weights = path.weights.clone()
        path.learning_rates = np.asarray(learning_rates, dtype=float)
    return TrainingResult(
        loss_curve=loss_curve,
        n_iter=len(loss_curve),
        n_steps=step,
        path=path,
        fit_time=time.perf_counter() - start,
    )
