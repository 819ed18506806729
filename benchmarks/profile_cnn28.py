"""Where one query's ``decompose`` of the 28x28 CNN cell spends its time (issue 36).

The cell of ``bench_matrix.py --cnn28`` (the two-convolution CNN, AdamW, batches of
64, 320 MNIST rows, one epoch: 5 steps), fitted once; then ``decompose`` of its first
query (``--queries``), timed by wall clock around the engine's functions, nested:

- the kink search (``row_kinks``): its sampled forward passes (``sampled_pieces``),
  its closed forms (``closed_form_kinks``) and its regula falsi (``locate_kinks``);
- the link weights (``TestCopy._parts``: the logits at 4 points per piece and the
  Jacobian integrals);
- the node passes (``TestCopy.evaluate``) and their folded backward pass
  (``folded_grad``), split by autograd node kind (the convolutions at the rows' own
  kernels: ``Conv2d input_vjp``);
- the node sums (``GroupedNodes._summed``) and the products (``_batch_inner``);
- the probe's forward passes of every phase (``NetworkProbe._forward``: the kink
  search's, the link weights' and the node passes').

``--cprofile``: the call under ``cProfile`` instead (the 40 functions of largest own
time); ``--torch``: under ``torch.profiler`` (the 25 operations of largest own CPU
time). ``--target NAME``: a scalar target per query (``decompose(..., target=NAME)``).

Usage::

    python benchmarks/profile_cnn28.py [--target predicted] [--cprofile | --torch]
"""

import argparse
import cProfile
import functools
import importlib
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_matrix  # noqa: E402

import sklearn_pathkernel  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001


class NestedTimer:
    """Wall-clock seconds and calls per label of wrapped functions (nested labels
    count inside their caller's too)."""

    def __init__(self):
        self.seconds, self.calls = defaultdict(float), defaultdict(int)

    def wrap(self, owner, attr, label):
        fn = vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - begin
                self.calls[label] += 1

        setattr(owner, attr, timed)

    def wrap_rules(self):
        """Each node kind of the folded walk, and the convolutions' ``input_vjp``."""
        folded = _module("_folded_backward")
        for kind in {type(rule) for rule in folded.FOLDED_VJPS.values()}:
            original = kind.backward

            def backward(rule_self, node, grads, wanted, writable, original=original):
                begin = time.perf_counter()
                try:
                    return original(rule_self, node, grads, wanted, writable)
                finally:
                    label = f"    {type(node).__name__}"
                    self.seconds[label] += time.perf_counter() - begin
                    self.calls[label] += 1

            kind.backward = backward
        conv = _module("rules._conv").Conv2dRule
        input_vjp = conv.input_vjp

        def wrapped(rule_self, inputs, weights):
            vjp = input_vjp(rule_self, inputs, weights)
            if vjp is None:
                return None

            def timed(cotangents):
                begin = time.perf_counter()
                try:
                    return vjp(cotangents)
                finally:
                    self.seconds["    Conv2d input_vjp"] += time.perf_counter() - begin
                    self.calls["    Conv2d input_vjp"] += 1

            return timed

        conv.input_vjp = wrapped

    def report(self):
        """The labels in the order of :data:`ORDER`, the node kinds (four spaces)
        under the folded backward pass, dearest first."""
        kinds = sorted(
            (label for label in self.seconds if label.startswith("    ")),
            key=self.seconds.get,
            reverse=True,
        )
        for label in ORDER:
            labels = kinds if label == "node kinds" else [label]
            for name in labels:
                if name in self.seconds:
                    print(f"{name:34s} {self.seconds[name]:7.2f} s {self.calls[name]:6d} calls")


#: The report's order (``node kinds``: the folded walk's, by time).
ORDER = (
    "kink search",
    "  sampled forward passes",
    "  closed forms",
    "  regula falsi",
    "link weights",
    "node passes",
    "  folded backward",
    "node kinds",
    "node sums",
    "products",
    "forward passes (all phases)",
)


def _module(name):
    return importlib.import_module(f"sklearn_pathkernel._engine.{name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=1)
    parser.add_argument("--target", default=None)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = bench_matrix.CNN28
    X, y, Q = bench_matrix.mnist(config["sizes"][0], args.queries)
    clf = bench_matrix.make_estimator(
        sklearn_pathkernel,
        bench_matrix.CNN28_CELL,
        config["steps"],
        config["batch_size"],
        config["sizes"][0],
    )
    begin = time.perf_counter()
    clf.fit(X, y)
    print(f"fit {time.perf_counter() - begin:.3f} s, {clf.path_.n_steps} steps")
    kwargs = {} if args.target is None else {"target": args.target}

    def run():
        bench_matrix.fresh(clf)
        begin, cpu = time.perf_counter(), time.process_time()
        clf.decompose(Q, **kwargs)
        wall, cpu = time.perf_counter() - begin, time.process_time() - cpu
        print(f"decompose, {len(Q)} queries, target={args.target}: {wall:.2f} s ({cpu:.2f} s CPU)")

    if args.cprofile:
        profile = cProfile.Profile()
        profile.runcall(run)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(40)
        print(out.getvalue())
        return
    if args.torch:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    timer = NestedTimer()
    kinks, test_copy = _module("integration._kinks"), _module("_test_copy")
    timer.wrap(_module("integration._quadrature"), "row_kinks", "kink search")
    timer.wrap(kinks, "sampled_pieces", "  sampled forward passes")
    timer.wrap(kinks, "closed_form_kinks", "  closed forms")
    timer.wrap(kinks, "locate_kinks", "  regula falsi")
    timer.wrap(test_copy.TestCopy, "_parts", "link weights")
    timer.wrap(test_copy.TestCopy, "evaluate", "node passes")
    timer.wrap(_module("_probe").NetworkProbe, "_forward", "forward passes (all phases)")
    timer.wrap(_module("_probe"), "folded_grad", "  folded backward")
    timer.wrap_rules()
    timer.wrap(test_copy.GroupedNodes, "_summed", "node sums")
    timer.wrap(_module("_decomposition").Decomposition, "_batch_inner", "products")
    run()
    timer.report()


if __name__ == "__main__":
    main()
