"""Peak memory of the query-side methods on a CNN with max-pooling, per number of queries.

A recording of a small CNN (two 3x3 convolutions with ReLU and 2x2 max-pooling, 11k
weights, AdamW, float64) on random 28x28 images. Each measurement runs in a fresh
process (peak resident memory is per process): ``decompose`` / ``explain`` of ``n``
queries, or ``self_influence``, at this checkout and, with ``--base REV``, at an
earlier commit (exported by ``_baseline.import_commit``), alternately.

    python benchmarks/bench_query_memory.py --base HEAD~5 --queries 1 4 16

Prints, per method and ``n``: peak RSS growth (MiB) and CPU seconds of each side.
"""

import argparse
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def record(package, M, epochs, batch=64):
    import torch
    import torch.nn.functional as F
    from torch import nn

    g = torch.Generator().manual_seed(0)
    X = torch.randn(M, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (M,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 24), nn.ReLU(), nn.Linear(24, 10),
    ).double()  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = package.TrainingRecorder(model, optimizer, X, y=y)
    for _ in range(epochs):
        order = torch.randperm(M, generator=g)
        for start in range(0, M, batch):
            rows = order[start : start + batch]
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
    return recorder.finish(), X


def measure(args):
    """One measurement, in this process: prints ``peak_growth_mib cpu_seconds``."""
    import torch

    torch.set_num_threads(1)
    if args.base:
        sys.path.insert(0, HERE)
        from _baseline import import_commit

        package = import_commit(args.base)
    else:
        sys.path.insert(0, os.path.dirname(HERE))
        import sklearn_pathkernel as package
    recording, X = record(package, args.train, args.epochs)
    recording._engine()  # the float64 engine, built before the baseline is read
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queries = X[: args.n] + 0.01
    start = time.process_time()
    if args.method == "decompose":
        recording.decompose(queries)
    elif args.method == "explain":
        recording.explain(queries, k=10)
    else:
        recording.self_influence()
    cpu = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{(peak - before) / 1024:.0f} {cpu:.1f}")


def run(method, n, base, train, epochs):
    command = [sys.executable, __file__, "--one", method, "--n", str(n)]
    command += ["--train", str(train), "--epochs", str(epochs)]
    if base:
        command += ["--base", base]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:  # e.g. -9: killed by the kernel for want of memory
        return done.returncode, None
    growth, cpu = done.stdout.split()[-2:]
    return float(growth), float(cpu)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="an earlier commit to compare with")
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--methods", nargs="+", default=["decompose", "explain"])
    parser.add_argument("--train", type=int, default=1000, help="training images M")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.method = args.one
        measure(args)
        return
    sides = [("this checkout", None)] + ([(f"base {args.base}", args.base)] if args.base else [])
    print(f"CNN, M={args.train}, {args.epochs} epochs of batches of 64, AdamW, float64")
    print(f"{'method':<15} {'n':>4}  " + "  ".join(f"{name:>28}" for name, _ in sides))
    for method in args.methods:
        for n in [1] if method == "self_influence" else args.queries:
            cells = []
            for _, base in sides:  # alternately, per row
                growth, cpu = run(method, n, base, args.train, args.epochs)
                if cpu is None:
                    cells.append(f"failed, exit status {growth}")
                else:
                    cells.append(f"{growth:>9.0f} MiB {cpu:>9.1f} CPU-s")
            print(f"{method:<15} {n:>4}  " + "  ".join(f"{cell:>28}" for cell in cells))


if __name__ == "__main__":
    main()
