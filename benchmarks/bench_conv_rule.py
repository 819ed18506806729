"""Benchmark: the Conv2d rule's factored form against materialised per-example gradients.

Usage::

    python benchmarks/bench_conv_rule.py            # M=400, 10 steps (about 2 minutes)
    python benchmarks/bench_conv_rule.py --quick    # M=150, 4 steps

A CNN on the 8x8 digits images whose convolutions go from many positions and few
channels (conv1: 64 positions, 1 -> 16 channels) to few positions and many channels
(conv3: 4 positions, 32 -> 64 channels, 288 + 1 inputs per column). The engine picks
per layer: materialised per-example gradients when ``d_in * d_out`` is small,
factored column x back-propagated Grams when ``P^2 (d_in + d_out) < d_in * d_out``.
In one run, the training Gram and the decomposition of held-out images are timed
with the automatic choice and with every convolution forced to the materialised
form; the script prints both times, their ratio and the largest relative
difference between the two results.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from sklearn_pathkernel import ExactPathKernelClassifier
from sklearn_pathkernel._engine.rules._conv import Conv2dRule
from sklearn_pathkernel._engine.rules._gradients import FactoredGradients


class DigitsCNN(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)  # 8x8, materialised
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)  # 4x4: 16 positions
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)  # 2x2: 4 positions, factored
        self.head = nn.Linear(64, n_classes)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x.view(-1, 1, 8, 8))), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = F.adaptive_avg_pool2d(torch.relu(self.conv3(x)), 1)
        return self.head(x.flatten(1))


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n_train, n_queries, steps = (150, 10, 4) if args.quick else (400, 20, 10)

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    rng = np.random.RandomState(0)
    order = rng.permutation(len(X))
    train, query = order[:n_train], order[n_train : n_train + n_queries]
    clf = ExactPathKernelClassifier(
        module=DigitsCNN(), learning_rate=0.1, max_iter=steps, random_state=0
    )
    _, fit_time = timed(lambda: clf.fit(X[train], y[train]))
    print(
        f"DigitsCNN on digits: M={n_train}, {n_queries} queries, {steps} full-batch steps, "
        f"{sum(p.numel() for p in clf.module_.parameters())} weights, "
        f"{torch.get_num_threads()} torch threads; fit {fit_time:.2f} s"
    )
    probe = clf._engine().probe
    layer_factors = probe.factors(clf.path_.weights[0], clf._fit_X[:1])
    forms = [
        "factored" if isinstance(factors, FactoredGradients) else "materialised"
        for rule, factors in zip(probe.rules, layer_factors, strict=True)
        if isinstance(rule, Conv2dRule)
    ]
    print("convolution forms chosen:", ", ".join(forms))

    results = {}
    automatic = Conv2dRule.factored_is_cheaper
    for label, choice in (("automatic", automatic), ("materialised", lambda *a: False)):
        Conv2dRule.factored_is_cheaper = staticmethod(choice)
        try:
            clf.set_params(n_jobs=1)  # a fresh engine for each setting
            clf.__dict__.pop("_kernel_cache", None)
            kernel = clf.kernel_
            gram, gram_time = timed(lambda kernel=kernel: kernel(X[train]))
            parts, dec_time = timed(lambda: clf.decompose(X[query]))
        finally:
            Conv2dRule.factored_is_cheaper = staticmethod(automatic)
        results[label] = (gram, gram_time, parts, dec_time)

    gram_a, gram_time_a, parts_a, dec_time_a = results["automatic"]
    gram_m, gram_time_m, parts_m, dec_time_m = results["materialised"]
    gram_diff = np.abs(gram_a - gram_m).max() / np.abs(gram_m).max()
    dec_diff = (
        np.abs(parts_a.contributions - parts_m.contributions).max()
        / np.abs(parts_m.contributions).max()
    )
    print(f"{'task':<22}{'automatic':>12}{'materialised':>14}{'ratio':>8}{'max rel diff':>14}")
    print(
        f"{'training Gram':<22}{gram_time_a:>11.2f}s{gram_time_m:>13.2f}s"
        f"{gram_time_m / gram_time_a:>7.1f}x{gram_diff:>14.1e}"
    )
    print(
        f"{'decompose (exact)':<22}{dec_time_a:>11.2f}s{dec_time_m:>13.2f}s"
        f"{dec_time_m / dec_time_a:>7.1f}x{dec_diff:>14.1e}"
    )
    identity = np.abs(parts_a.bias + parts_a.contributions.sum(1) - parts_a.output).max()
    print(f"sum identity (automatic): max |bias + sum - network| = {identity:.1e}")


if __name__ == "__main__":
    main()
