"""How far a float32 recording's float64 replay is from the float32 run, next to how far
the same loop trained in float64 is from it.

A float32 run (``TrainingRecorder``) is decomposed through its float64 replay (the
recorded ``w_0``, rows, output gradients, rates and Adam preconditioners, each
gradient recomputed in float64); ``model_gap`` is the float32 model's distance to the
replay's final network. The reference is the distance from the float32 run to the
same loop (same ``w_0``, batches, optimiser) trained in float64: what float32
rounding alone moves. Both as ``max |logit difference|`` over 200 held-out rows,
after every epoch, for the README's MLP and a CNN with max-pooling, with SGD and
AdamW. A run whose replay ends beyond the run's rounding bound (the recording refuses
it) is printed as ``refused``.

    python benchmarks/bench_float32_gap.py [--epochs 4] [--n 1000]
    python benchmarks/bench_float32_gap.py --quick   # 2 epochs of 200 rows
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import RecordingRefused, TrainingRecorder


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 24), nn.ReLU(), nn.Linear(24, 10),
    )  # fmt: skip


def data(kind, n):
    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        from sklearn.datasets import make_blobs

        X, y = make_blobs(n_samples=n, n_features=10, centers=3, random_state=0)
        return torch.tensor(X), torch.tensor(y)
    # images with class structure: a class-dependent blob on noise
    y = torch.randint(0, 10, (n,), generator=g)
    X = 0.5 * torch.randn(n, 1, 28, 28, generator=g, dtype=torch.float64)
    rows, cols = (y // 5) * 12 + 6, (y % 5) * 5 + 2
    for i in range(n):
        X[i, 0, rows[i] : rows[i] + 8, cols[i] : cols[i] + 5] += 1.5
    return X, y


def train(kind, optimizer_name, dtype, X, y, epochs, record, batch=50, lr=None):
    torch.manual_seed(0)
    model = (mlp() if kind == "mlp" else cnn()).to(dtype)
    X = X.to(dtype)
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr or 0.05)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr or 0.01)
    recorder = TrainingRecorder(model, optimizer, X, y=y) if record else None
    g = torch.Generator().manual_seed(1)
    snapshots = []
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=g)
        for start in range(0, X.shape[0], batch):
            rows = order[start : start + batch]
            optimizer.zero_grad()
            out = model(X[rows])
            if recorder is not None:
                recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
        snapshots.append(
            {k: v.detach().to(torch.float64).clone() for k, v in model.state_dict().items()}
        )
    return model, snapshots, (recorder.finish() if recorder else None)


def logits(kind, state, X):
    model = (mlp() if kind == "mlp" else cnn()).double().eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(X.double())


def replay_states(recording, kind, steps_per_epoch):
    run = recording._float64_run()
    module, path = run.module, run.path
    states = []
    for epoch_end in range(steps_per_epoch, path.n_steps + 1, steps_per_epoch):
        weights = path.unflatten(path.weights[epoch_end])
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        state.update({k: v.detach().clone() for k, v in weights.items()})
        states.append(state)
    return states


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 epochs, 200 rows")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(epochs=2, n=200)
        args = parser.parse_args()
    torch.set_num_threads(1)
    print("max |logit difference| over 200 held-out rows, after each epoch")
    print(f"{'network':<5} {'optimiser':<6} {'epoch':>5} {'float32 vs replay':>18} "
          f"{'float32 vs float64 run':>22} {'ratio':>6} {'max |logit|':>11}")  # fmt: skip
    for kind in ("mlp", "cnn"):
        X, y = data(kind, args.n + 200)
        X_train, y_train, X_test = X[: args.n], y[: args.n], X[args.n :]
        for optimizer_name in ("sgd", "adamw"):
            _, s32, recording = train(
                kind, optimizer_name, torch.float32, X_train, y_train, args.epochs, True
            )
            _, s64, _ = train(
                kind, optimizer_name, torch.float64, X_train, y_train, args.epochs, False
            )
            steps_per_epoch = recording.n_steps_ // args.epochs
            try:
                replayed = replay_states(recording, kind, steps_per_epoch)
            except RecordingRefused as refusal:  # the replay left the run's rounding bound
                ends = str(refusal).split(" ends ")[1].split(" from")[0]
                print(f"{kind:<5} {optimizer_name:<6} {'':>5} {'refused':>18}  "
                      f"(the replay ends {ends} from the final weights)")  # fmt: skip
                continue
            for epoch in range(args.epochs):
                f32 = logits(kind, s32[epoch], X_test)
                gap = (f32 - logits(kind, replayed[epoch], X_test)).abs().max().item()
                train_gap = (f32 - logits(kind, s64[epoch], X_test)).abs().max().item()
                print(
                    f"{kind:<5} {optimizer_name:<6} {epoch + 1:>5} {gap:>18.2e} "
                    f"{train_gap:>22.2e} {gap / train_gap:>6.1f} {f32.abs().max().item():>11.1f}"
                )
    np.set_printoptions()


if __name__ == "__main__":
    main()
