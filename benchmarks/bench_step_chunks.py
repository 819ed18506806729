"""Chunks of steps on dask workers: the backward accumulation as a scan.

A run whose decomposition accumulates its steps backward (momentum or Adam) is
decomposed three ways, side by side in one process:

- ``single``: one pass over the steps in this process (``step_chunks=None``);
- ``chunks serial``: the same chunks one after the other in this process
  (``step_chunks=c``): its ratio to ``single`` is the scan's extra work,
  ``1 + rho (c - 1) / c`` with ``rho`` the products' share of a step;
- ``threads``: ``--chunks`` chunks of steps on ``--chunks`` joblib threads
  (``step_chunks=c, n_jobs=c``);
- ``dask``: the same chunks on a ``LocalCluster`` of ``--chunks`` worker processes
  with one thread each (``parallel_config(backend="dask")``).

Printed: the wall time of each, its ratio to ``single``, and the largest
difference of its contributions and decay from ``single``'s. The setting: digits
(8x8, 1797 rows, ``sklearn.datasets.load_digits``), an MLP 64-128-64-10 (17 226
weights) trained by ``torch.optim`` through ``TrainingRecorder``, batches of 64,
``--epochs`` epochs (29 steps each); ``--queries`` test rows, their true class's
log-probability as the scalar target (``--outputs`` for all 10).

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_step_chunks.py --solver momentum``
(the cluster's workers inherit ``OMP_NUM_THREADS``; keep it at one thread per
worker). ``--quick``: one epoch, 4 queries.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from joblib import parallel_config
from sklearn.datasets import load_digits
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._targets import OutputTarget, QueryTargets

#: glibc's malloc settings of the workers: dask's default (MALLOC_TRIM_THRESHOLD_=65536)
#: fixes the mmap threshold at 128 KiB, so that every tensor of a step is a fresh
#: mmap and its pages faulted in again: the chunks ran 2-3x slower per step on the
#: workers than in this process. These settings keep freed tensors' memory for reuse.
WORKER_MALLOC = {
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": 2**30,
    "distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": 2**25,
}


def recorded_run(solver, epochs, seed=0):
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0)
    y = torch.tensor(y)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    ).double()
    if solver == "momentum":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    recorder = TrainingRecorder(model, optimizer, X)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=generator)
        for start in range(0, X.shape[0], 64):
            rows = order[start : start + 64]
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
    return recorder.finish(), X, y


def engine_of(recording, **kwargs):
    base = recording._engine()
    return PathKernelEngine(base.module, base.path, base.X_train, link=base.link, **kwargs)


def timed(engine, X, targets):
    start = time.perf_counter()
    parts = engine.decompose(X, targets=targets)
    return time.perf_counter() - start, parts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--solver", choices=["momentum", "adam"], default="momentum")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of 29 steps")
    parser.add_argument("--queries", type=int, default=40, help="test rows decomposed")
    parser.add_argument("--chunks", type=int, default=2, help="chunks, threads and workers")
    parser.add_argument("--outputs", action="store_true", help="all 10 outputs, not a target")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 epoch, 4 queries")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(epochs=1, queries=4)
        args = parser.parse_args()
    torch.set_num_threads(1)

    recording, X, y = recorded_run(args.solver, args.epochs)
    rows = np.random.RandomState(1).choice(X.shape[0], args.queries, replace=False)
    queries = X[rows] + 0.01
    targets = None if args.outputs else QueryTargets(OutputTarget(), y[rows])
    print(
        f"{args.solver}: {recording.n_steps_} steps, W={recording.path_.n_weights}, "
        f"{args.queries} queries, {'10 outputs' if args.outputs else 'scalar target'}, "
        f"{args.chunks} chunks (machine shared with other processes: ratios, side by side)"
    )
    results = {}
    results["single"] = timed(engine_of(recording), queries, targets)
    serial = engine_of(recording, step_chunks=args.chunks)
    results["chunks serial"] = timed(serial, queries, targets)
    chunked = engine_of(recording, step_chunks=args.chunks, n_jobs=args.chunks)
    results["threads"] = timed(chunked, queries, targets)

    import dask
    from dask.distributed import Client, LocalCluster

    with (
        dask.config.set(WORKER_MALLOC),
        LocalCluster(
            n_workers=args.chunks,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
        ) as cluster,
        Client(cluster),
        parallel_config(backend="dask"),
    ):
        chunked.decompose(queries[:2], targets=None if targets is None else targets.take(slice(2)))
        results["dask"] = timed(chunked, queries, targets)  # (after a warm-up call)
    results["single again"] = timed(engine_of(recording), queries, targets)

    reference = results["single"][1]
    base = results["single"][0]
    print(f"{'route':<14}{'seconds':>10}{'ratio':>8}{'max |diff|':>14}")
    for name, (seconds, parts) in results.items():
        diff = max(
            np.abs(parts.contributions - reference.contributions).max(),
            np.abs(parts.decay - reference.decay).max(),
        )
        print(f"{name:<14}{seconds:>10.2f}{seconds / base:>8.2f}{diff:>14.2e}")


if __name__ == "__main__":
    main()
