"""Benchmark: the engine against an earlier commit's, side by side, at scale.

Usage::

    python benchmarks/bench_vs_commit.py                   # everything; about an hour
    python benchmarks/bench_vs_commit.py --quick           # small sizes, a few minutes
    python benchmarks/bench_vs_commit.py --problems mlp --sizes 4000 --steps 50
    python benchmarks/bench_vs_commit.py --base REV        # another earlier commit

Both packages run in one process (the earlier one exported by ``git archive``,
see ``_baseline.py``), fitted on the same data with the same seed, and every
task is timed alternately on each (earlier first, then current, the order
swapped on every repeat), so that both see the same machine load. The time is
the fastest of ``--repeats`` calls. Problems:

``mlp``
    10 Gaussian classes in 64 dimensions (``bench_engine.scale_data``), ReLU MLP
    64-128-128-10, ``--steps`` full-batch gradient steps (lr 0.05), M training
    rows for M in ``--sizes``, ``--queries`` query rows. Tasks: the training
    Gram ``gram(X, a_train=True)`` (M x M), the cross Gram
    ``gram(Q, X, b_train=True)`` and ``decompose(Q)``, per query.
    Then the roofline of the current training Gram: the flops of its products,
    ``sum_steps sum_layers 2 (M (M + 1) / 2) (d_in + 1 + r d_out)`` (the
    factored Linear rule, one triangle; ``r`` the outputs left per unit after
    projection onto the training rows' output subspace, 2 for the last two
    layers, ``K`` = 10 before them; "GFLOP at K" counts every output), against
    the time this machine's GEMM takes for the same products (random factors of
    the same shapes, in the same blocks of rows), as GFLOP/s.
``minibatch``
    The same MLP trained by mini-batches (M=2000, batch 64, 20 epochs: 640
    steps). A Gram needs every training row's gradient at every step: its floor
    is one full-data pass per step, that is steps-per-epoch times the training
    (which touches each row once per epoch). Reports the cross Gram of the
    queries against that floor; ``decompose`` needs only each step's batch.
``distance``
    ``DistanceKernelClassifier``, M=1000 rows of the same data: ``decompose`` and
    the cross Gram of the queries, per query, for the same network in both
    commits (``solver="sgd", learning_rate=1.5``: 68eeedd's defaults), for
    each commit's own defaults (full-batch Adam now: a different network from
    68eeedd's, so the results are not compared), and for ``solver="adam"`` in
    both (``--distance-settings sgd,defaults,adam``; "adam" needs a base that
    has Adam, e.g. ``--base be800fe``).
``adam``
    The MLP of ``mlp`` trained by full-batch Adam (lr 1e-3), M = the first of
    ``--sizes``: the training Gram, the cross Gram and ``decompose`` of Adam's
    preconditioned kernel. Needs a base that has Adam (``--base be800fe``).

Exactness: the largest relative difference between the two commits' results,
and the current ``decompose``'s certificate (max over rows of
``|bias + sum contributions + decay - output|``, the network's own output).
Timings depend on the machine's load: run on an idle machine.
"""

import argparse
import functools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _baseline import import_commit, relative_difference, side_by_side, timed  # noqa: E402
from bench_engine import scale_data  # noqa: E402

import sklearn_pathkernel  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001 (progress in a log file)

FULL = {"sizes": (3000, 4000), "steps": 50, "queries": 100, "repeats": 1}
QUICK = {"sizes": (500,), "steps": 10, "queries": 20, "repeats": 2}
MINIBATCH = {"n_train": 2000, "batch_size": 64, "epochs": 20}
MINIBATCH_QUICK = {"n_train": 300, "batch_size": 64, "epochs": 4}
DISTANCE = {"n_train": 1000}
# The same network in both commits (68eeedd's defaults: full-batch gradient
# descent), then each commit's own defaults (now full-batch Adam; 68eeedd had
# no Adam): those two train different networks, so their results are not compared.
DISTANCE_SETTINGS = {
    "sgd": ("solver='sgd', learning_rate=1.5", {"solver": "sgd", "learning_rate": 1.5}),
    "defaults": ("each commit's defaults", {}),
    "adam": ("solver='adam'", {"solver": "adam"}),
}
DISTANCE_QUICK = {"n_train": 200}


def fitted(package, make, X, y):
    clf = make(package)
    seconds, clf = timed(lambda: clf.fit(X, y))
    return clf, seconds


def engine_of(clf):
    return clf.kernel_.engine


def row(label, times, extra=""):
    base, new = times["base"], times["new"]
    return f"{label:<26}{base:>10.3f}{new:>10.3f}{base / new:>8.1f}x  {extra}"


def header(title, unit="s"):
    print(title)
    print(f"{'task':<26}{'base ' + unit:>10}{'now ' + unit:>10}{'ratio':>9}  exactness")
    print("-" * 78)


# -- the roofline of the training Gram --------------------------------------------------


def linear_widths(module, n_outputs):
    """(d_in + 1, K d_out) of every Linear layer: the factored rule's two Grams."""
    return [
        (layer.in_features + 1, n_outputs * layer.out_features)
        for layer in module.modules()
        if isinstance(layer, torch.nn.Linear)
    ]


def projected_widths(engine):
    """(d_in + 1, r d_out) of every Linear layer: the two Grams the engine
    computes, ``r`` the outputs left after projection onto the training rows'
    output subspace (``K`` where the rule finds none), at the last step (at the
    first, a head that starts at zero leaves the layer below it no gradient)."""
    rows = engine.X_train[:512]
    factors = engine.probe.factors(engine.path.weights[engine.path.n_steps - 1], rows)
    widths = []
    for rule, layer in zip(engine.probe.rules, factors, strict=True):
        subspace = rule.output_subspace(layer, engine.n_train)
        n_outputs, d_out = layer.deltas.shape[1:]
        rank = n_outputs if subspace is None else subspace.rank
        widths.append((layer.inputs.shape[1] + 1, rank * d_out))
    return widths


def gram_flops(n, widths, n_steps):
    return n_steps * sum(2 * (n * (n + 1) // 2) * (a + d) for a, d in widths)


def gemm_seconds(n, widths, n_steps, block=512):
    """This machine's time for the training Gram's products: the upper triangle of
    blocks of ``block`` rows, both Grams of every layer, times the steps (one
    step timed, best of three)."""
    generator = torch.Generator().manual_seed(0)
    factors = [
        (torch.randn(n, a, generator=generator), torch.randn(n, d, generator=generator))
        for a, d in widths
    ]
    starts = range(0, n, block)

    def one_step():
        for a, d in factors:
            for i in starts:
                rows = slice(i, i + block)
                a[rows] @ a[i:].T
                d[rows] @ d[i:].T

    one_step()
    return n_steps * min(timed(one_step)[0] for _ in range(3))


def gemm_rate():
    """GFLOP/s of one large float64 matrix product (4000 x 1280 x 4000)."""
    a = torch.randn(4000, 1280)
    a @ a.T
    return 2 * 4000 * 4000 * 1280 / min(timed(lambda: a @ a.T)[0] for _ in range(3)) / 1e9


# -- problems ---------------------------------------------------------------------------------


def mlp(packages, sizes, steps, n_queries, repeats):
    roofline = [mlp_size(packages, n, steps, n_queries, repeats) for n in sizes]
    rate = gemm_rate()
    print(
        f"Roofline of the training Gram (this machine's GEMM: {rate:.0f} GFLOP/s "
        "on 4000 x 1280 x 4000)"
    )
    print(
        f"{'M':>6}{'GFLOP at K':>12}{'GFLOP':>9}{'GEMM s':>9}{'engine s':>10}"
        f"{'GFLOP/s':>9}{'engine / GEMM':>15}"
    )
    for n, all_outputs, flops, gemm, engine_time in roofline:
        print(
            f"{n:>6}{all_outputs / 1e9:>12.0f}{flops / 1e9:>9.0f}{gemm:>9.1f}{engine_time:>10.1f}"
            f"{flops / engine_time / 1e9:>9.1f}{engine_time / gemm:>14.2f}x"
        )
    print()


def cross_gram(fits, X_queries, repeats, compare=True):
    """Times of ``gram(queries, X_train, b_train=True)`` and the commits' difference."""
    queries = torch.tensor(X_queries, dtype=torch.float64)
    engines = {name: engine_of(clf) for name, (clf, _) in fits.items()}
    times, grams = side_by_side(
        {name: lambda e=e: e.gram(queries, e.X_train, b_train=True) for name, e in engines.items()},
        repeats,
    )
    difference = relative_difference(grams["base"], grams["new"]) if compare else None
    return times, difference


def decompose(fits, X_queries, repeats, compare=True):
    """Times of ``decompose(queries)``, the commits' difference and the current certificate."""
    times, parts = side_by_side(
        {name: lambda c=c: c.decompose(X_queries) for name, (c, _) in fits.items()}, repeats
    )
    difference = (
        relative_difference(parts["base"].contributions, parts["new"].contributions)
        if compare
        else None
    )
    return times, difference, parts["new"].residual.max()


def per_query(times, n_queries):
    return {name: 1e3 * t / n_queries for name, t in times.items()}


def compared(difference):
    return "not compared" if difference is None else f"diff {difference:.1e}"


def mlp_size(packages, n, steps, n_queries, repeats):
    """The three tasks at one size; returns the roofline's (M, flops with every output,
    flops of the products computed, GEMM s, engine s)."""

    def make(package):
        return package.ExactPathKernelClassifier(
            hidden_layer_sizes=(128, 128), learning_rate=0.05, max_iter=steps, random_state=0
        )

    X, y = scale_data(n + n_queries, seed=0)
    fits = {name: fitted(package, make, X[:n], y[:n]) for name, package in packages.items()}
    engines = {name: engine_of(clf) for name, (clf, _) in fits.items()}
    fit_time = fits["new"][1]
    header(
        f"MLP 64-128-128-10, M={n}, {steps} full-batch steps, {n_queries} queries "
        f"(fit {fit_time:.2f} s)"
    )
    train_time = three_tasks(fits, X[n:], repeats)
    widths = projected_widths(engines["new"])
    every_output = linear_widths(fits["new"][0].module_, engines["new"].n_outputs)
    all_outputs = gram_flops(n, every_output, steps)
    flops = gram_flops(n, widths, steps)
    return n, all_outputs, flops, gemm_seconds(n, widths, steps), train_time


def three_tasks(fits, X_queries, repeats):
    """Training Gram, cross Gram and ``decompose`` printed side by side; returns the
    current training Gram's time."""
    engines = {name: engine_of(clf) for name, (clf, _) in fits.items()}
    fit_time, n_queries = fits["new"][1], X_queries.shape[0]
    times, grams = side_by_side(
        {name: lambda e=e: e.gram(e.X_train, a_train=True) for name, e in engines.items()},
        repeats,
    )
    difference = relative_difference(grams["base"], grams["new"])
    print(
        row(
            "training Gram",
            times,
            f"diff {difference:.1e}; Gram / fit {times['new'] / fit_time:.0f}x",
        )
    )
    train_time = times["new"]
    times, difference = cross_gram(fits, X_queries, repeats)
    times = per_query(times, n_queries)
    share = 100 * times["new"] / 1e3 / fit_time
    print(
        row(
            "cross Gram, per query (ms)",
            times,
            f"{compared(difference)}; per query / fit {share:.2f}%",
        )
    )
    times, difference, certificate = decompose(fits, X_queries, repeats)
    print(
        row(
            "decompose, per query (ms)",
            per_query(times, n_queries),
            f"{compared(difference)}; certificate {certificate:.1e}",
        )
    )
    print()
    return train_time


def adam(packages, n, steps, n_queries, repeats):
    """The MLP trained by Adam: the preconditioned kernel's three tasks."""

    def make(package):
        return package.ExactPathKernelClassifier(
            hidden_layer_sizes=(128, 128),
            solver="adam",
            learning_rate=1e-3,
            max_iter=steps,
            random_state=0,
        )

    X, y = scale_data(n + n_queries, seed=0)
    fits = {name: fitted(package, make, X[:n], y[:n]) for name, package in packages.items()}
    header(
        f"MLP 64-128-128-10, Adam, M={n}, {steps} full-batch steps, {n_queries} queries "
        f"(fit {fits['new'][1]:.2f} s)"
    )
    three_tasks(fits, X[n:], repeats)


def minibatch(packages, sizes, n_queries, repeats):
    n, batch, epochs = sizes["n_train"], sizes["batch_size"], sizes["epochs"]
    steps_per_epoch = -(-n // batch)

    def make(package):
        return package.ExactPathKernelClassifier(
            hidden_layer_sizes=(128, 128),
            learning_rate=0.05,
            batch_size=batch,
            max_iter=epochs,
            random_state=0,
        )

    X, y = scale_data(n + n_queries, seed=0)
    fits = {name: fitted(package, make, X[:n], y[:n]) for name, package in packages.items()}
    fit_time = fits["new"][1]
    floor = steps_per_epoch * fit_time
    header(
        f"Mini-batch MLP 64-128-128-10, M={n}, batch {batch}, {epochs} epochs "
        f"({steps_per_epoch * epochs} steps), {n_queries} queries (fit {fit_time:.2f} s; "
        f"Gram floor = {steps_per_epoch} steps per epoch x fit = {floor:.1f} s)"
    )
    times, difference = cross_gram(fits, X[n:], repeats)
    ratios = f"base {times['base'] / floor:.2f}x, now {times['new'] / floor:.2f}x"
    print(row("cross Gram (s)", times, f"{compared(difference)}; / floor: {ratios}"))
    times, difference, certificate = decompose(fits, X[n:], repeats)
    print(
        row(
            "decompose (s)",
            times,
            f"{compared(difference)}; certificate {certificate:.1e}; "
            f"/ floor {times['new'] / floor:.2f}x",
        )
    )
    print()


def distance(packages, sizes, n_queries, repeats, settings):
    """``settings``: keys of ``DISTANCE_SETTINGS``."""
    for setting in settings:
        label, params = DISTANCE_SETTINGS[setting]
        distance_setting(packages, sizes["n_train"], n_queries, repeats, label, params)


def distance_setting(packages, n, n_queries, repeats, label, params):
    def make(package):
        return package.DistanceKernelClassifier(random_state=0, **params)

    X, y = scale_data(n + n_queries, seed=0)
    fits = {name: fitted(package, make, X[:n], y[:n]) for name, package in packages.items()}
    same = bool(params)  # the same network in both commits: results compared
    header(
        f"DistanceKernelClassifier, {label}, M={n}, {n_queries} queries "
        f"(fit: base {fits['base'][1]:.2f} s, now {fits['new'][1]:.2f} s)",
        unit="ms",
    )
    times, difference, certificate = decompose(fits, X[n:], repeats, compare=same)
    print(
        row(
            "decompose, per query",
            per_query(times, n_queries),
            f"{compared(difference)}; certificate {certificate:.1e}",
        )
    )
    times, difference = cross_gram(fits, X[n:], repeats, compare=same)
    print(row("cross Gram, per query", per_query(times, n_queries), compared(difference)))
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="68eeedd", help="earlier commit (default 68eeedd)")
    parser.add_argument("--quick", action="store_true", help="small sizes, a few minutes")
    parser.add_argument(
        "--problems", default="mlp,minibatch,distance", help="comma-separated subset"
    )
    parser.add_argument(
        "--distance-settings",
        default="sgd",
        help="comma-separated: sgd (the same network in both commits), defaults (each "
        "commit's own; now Adam), adam (needs a base with Adam)",
    )
    parser.add_argument("--sizes", type=int, nargs="+", help="training rows of the MLP problem")
    parser.add_argument("--steps", type=int, help="full-batch steps of the MLP problem")
    parser.add_argument("--queries", type=int, help="query rows")
    parser.add_argument("--repeats", type=int, help="calls per task and package (fastest kept)")
    args = parser.parse_args()
    config = dict(QUICK if args.quick else FULL)
    for key in ("sizes", "steps", "queries", "repeats"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    torch.set_default_dtype(torch.float64)
    packages = {"base": import_commit(args.base), "new": sklearn_pathkernel}
    print(
        f"base: {args.base} ({packages['base'].__name__}); now: {sklearn_pathkernel.__file__}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"load {os.getloadavg()[0]:.1f}\n"
    )
    problems = args.problems.split(",")
    if "mlp" in problems:
        mlp(packages, config["sizes"], config["steps"], config["queries"], config["repeats"])
    if "minibatch" in problems:
        sizes = MINIBATCH_QUICK if args.quick else MINIBATCH
        minibatch(packages, sizes, min(config["queries"], 20), config["repeats"])
    if "adam" in problems:
        adam(packages, config["sizes"][0], config["steps"], config["queries"], config["repeats"])
    if "distance" in problems:
        sizes = DISTANCE_QUICK if args.quick else DISTANCE
        settings = args.distance_settings.split(",")
        distance(packages, sizes, min(config["queries"], 20), config["repeats"], settings)
    print(f"load at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
