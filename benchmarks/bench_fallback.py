"""Benchmark: the per-layer rules against the whole-network Jacobian fallback.

Usage::

    python benchmarks/bench_fallback.py            # MLP 20-64-64-3, M=200, 20 steps
    python benchmarks/bench_fallback.py --quick    # M=60, 5 steps

Networks the per-layer hooks cannot follow (a layer applied twice, tied weights,
``nn.MultiheadAttention``, parameters used in a parent's ``forward``) are
differentiated as a whole: per-sample Jacobians of ``log_softmax(module(x))``
by ``torch.func`` (:class:`~sklearn_pathkernel._engine.rules._jacobian.JacobianRule`).
To price that, one ReLU MLP that the factored rules handle is timed both ways
in one run: ``decompose`` of held-out queries and the training Gram, with the
engine's own probe and with a probe forced through the ``JacobianRule``. The
script prints both times, their ratio and the largest difference between the
two results relative to the largest entry (both are exact: it is rounding),
then the forward passes without gradients each decomposition ran.
"""

import argparse
import time

import numpy as np
import torch
from torch import nn

from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._training._loop import train_module


def blobs(n, n_features, n_classes, seed):
    rng = np.random.RandomState(seed)
    centers = 2.0 * rng.randn(n_classes, n_features)
    y = rng.randint(0, n_classes, n)
    return torch.tensor(centers[y] + rng.randn(n, n_features)), torch.tensor(y)


def timed(fn, repeat):
    """The result of ``fn`` and the median of ``repeat`` timed calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return value, float(np.median(times))


def jacobian_engine(module, path, X_train):
    """An engine whose probe is forced through the ``JacobianRule`` from the start (so
    that the quadrature it builds is the one of that rule; its decomposition runs on
    this thread's probe, the one built here)."""
    init = NetworkProbe.__init__

    def forced(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "force_jacobian": True})

    NetworkProbe.__init__ = forced
    try:
        return PathKernelEngine(module, path, X_train)
    finally:
        NetworkProbe.__init__ = init


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per task")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n_train, n_queries, steps = (60, 10, 5) if args.quick else (200, 40, 20)
    n_features, width, n_classes = 20, 64, 3

    torch.manual_seed(0)
    X, y = blobs(n_train + n_queries, n_features, n_classes, seed=0)
    X_train, y_train, X_query = X[:n_train], y[:n_train], X[n_train:]
    module = nn.Sequential(
        nn.Linear(n_features, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, n_classes),
    ).double()
    path = train_module(module, X_train, y_train, learning_rate=0.1, max_iter=steps).path

    factored = PathKernelEngine(module, path, X_train)
    jacobian = jacobian_engine(module, path, X_train)
    assert factored.probe.fallback_reason is None
    assert jacobian.probe.fallback_reason is not None

    print(
        f"MLP {n_features}-{width}-{width}-{n_classes} (W={path.n_weights}), "
        f"{n_train} training points, {n_queries} queries, {steps} full-batch steps, "
        f"{torch.get_num_threads()} threads; median of {args.repeat} calls"
    )
    print(f"{'task':<24}{'factored':>12}{'Jacobian':>12}{'ratio':>8}{'rel. diff':>12}")
    tasks = {
        "decompose": lambda engine: engine.decompose(X_query).contributions,
        "training Gram": lambda engine: engine.gram(X_train, a_train=True),
    }
    for name, task in tasks.items():
        fast, fast_time = timed(lambda task=task: task(factored), args.repeat)
        slow, slow_time = timed(lambda task=task: task(jacobian), args.repeat)
        difference = np.abs(fast - slow).max() / np.abs(fast).max()
        print(
            f"{name:<24}{fast_time:>11.3f}s{slow_time:>11.3f}s"
            f"{slow_time / fast_time:>7.1f}x{difference:>12.1e}"
        )
    # Where the decomposition's extra time goes: without per-row weights in the
    # forward pass, the kink search takes one pass per distinct t.
    passes = {}
    for label, engine in (("factored", factored), ("Jacobian", jacobian)):
        probe, counted = engine.probe, [0]
        forward = probe._forward

        def counting(*args, forward=forward, counted=counted, **kwargs):
            counted[0] += bool(kwargs.get("logits"))  # not the factor passes
            return forward(*args, **kwargs)

        probe._forward = counting
        try:
            engine.decompose(X_query)
        finally:
            del probe._forward
        passes[label] = counted[0]
    print(
        "forward passes without gradients per decompose (kink search, log-probabilities): "
        f"factored {passes['factored']}, Jacobian {passes['Jacobian']}"
    )


if __name__ == "__main__":
    main()
