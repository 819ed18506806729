"""The long, field-scale benchmark studies, from one entry point.

The everyday benchmarks (time, peak memory, exactness and attribution quality of
the workloads the documentation's tables cite) are the asv suite in
``asv_benchmarks/``; the studies here take minutes to hours (hundreds of
retrainings, thousands of steps, a GPU) and print their own tables::

    python benchmarks/run.py                    # the list of studies
    python benchmarks/run.py field --quick      # a CI-sized smoke run of one
    python benchmarks/run.py field --sections table --rows 4500 ...

Everything after the study's name is passed to its script (``--help`` lists its
options); ``--quick`` makes every study a run of a minute or two.
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name: (script, what it measures). Each script supports ``--quick``.
STUDIES = {
    "field": (
        "bench_field.py",
        "dattri's MNIST-10 MLP at the field's size: LDS, LOO, mislabel AUC against "
        "TRAK, TracIn, Grad-Dot, EK-FAC; time, memory; the GPU run (--device cuda)",
    ),
    "attribution": (
        "bench_attribution.py",
        "attribution quality on small tasks (digits, breast cancer, MNIST) against "
        "dattri's and captum's attributors: fresh- and same-seed LDS, LOO, mislabel AUC",
    ),
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
    "recorder": (
        "bench_recorder.py",
        "the overhead of TrainingRecorder in a user's loop, in interleaved turns",
    ),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in STUDIES:
        print(__doc__)
        width = max(map(len, STUDIES))
        for name, (script, about) in STUDIES.items():
            print(f"  {name:<{width}}  {about} ({script})")
        return 0 if not argv or argv[0] in {"-h", "--help"} else 2
    script, _ = STUDIES[argv[0]]
    sys.argv = [str(HERE / script), *argv[1:]]
    sys.path.insert(0, str(HERE))
    runpy.run_path(str(HERE / script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
