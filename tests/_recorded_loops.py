"""Small recorded loops shared by the recorder's tests: data, a tanh MLP, an
ordinary loop with the recorder's two lines, and the independent replay of every
step from the recorded linear form."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from sklearn_pathkernel import TrainingRecorder


def data(n=30, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.3).long()
    return X.to(dtype), y


def mlp(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def run(model, optimizer, X, y, *, epochs=3, batch_size=8, scheduler=None, loss=None, seed=1,
        stated=None):  # fmt: skip
    """An ordinary loop, with the recorder's two lines (``stated``: the loss told to
    the recorder, with the targets ``y``, for counterfactual attribution)."""
    loss = loss or (lambda out, target: F.cross_entropy(out, target))
    told = {} if stated is None else {"y": y, "loss": stated}
    recorder = TrainingRecorder(model, optimizer, X, **told)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=generator)
        for start in range(0, X.shape[0], batch_size):
            rows = order[start : start + batch_size]  # a short last batch
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            loss(out, y[rows]).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    return recorder.finish()


def replay(recording, rounding=None):
    """Every step rebuilt from the recorded linear form: (largest weight error,
    largest step). ``rounding``: per step, a part of the move the linear form need
    not give (a float32 run's rounding moves), taken off the recorded move first."""
    path, update = recording.path_, recording.path_.update
    module = recording.module_
    X = recording.X_train_
    buffer, worst, largest = None, 0.0, 0.0
    for step in range(path.n_steps):
        w = path.weights[step].to(torch.float64)
        params = {k: v.requires_grad_(True) for k, v in path.unflatten(w.clone()).items()}
        frozen = {k: v.to(torch.float64) for k, v in module.named_parameters() if k not in params}
        out = functional_call(
            module.to(torch.float64), {**params, **frozen}, (X[path.batches[step]].double(),)
        )
        e = path.output_gradients[step].to(torch.float64)
        grads = torch.autograd.grad(-(e * out).sum(), list(params.values()), allow_unused=True)
        G = torch.cat(
            [
                (torch.zeros_like(p) if g is None else g).reshape(-1)
                for g, p in zip(grads, params.values(), strict=True)
            ]
        )
        g = G + update.coupled_decay * w
        buffer = (
            update.gradient_scale * g
            if buffer is None
            else (update.buffer_decay * buffer + update.gradient_scale * g)
        )
        P = 1.0 if update.preconditioners is None else update.preconditioners[step].double()
        move = -P * (update.gradient_rates[step] * buffer + update.direct_rates[step] * g)
        move = move + update.decoupled_decays[step] * w
        actual = path.weights[step + 1].double() - w
        if rounding is not None:
            actual = actual - rounding[step].double()
        worst = max(worst, float((move - actual).abs().max()))
        largest = max(largest, float(actual.abs().max()))
    module.to(recording.dtype)
    return worst, largest
