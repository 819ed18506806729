"""Resident memory of ``decompose`` against the size of the recorded path, in RAM or on disk.

An MLP 64-256-256-10 (85 770 weights) fitted by the estimator on digits (batches of
50, SGD) for ``--steps`` steps, in float64 or float32 (``dtype=``), its path in
memory or in a memory-mapped file (``path_storage="disk"``). Each configuration
runs in a fresh process. After the fit (and, for float32, its float64 replay) the
process's resident memory is sampled every 5 ms while ``decompose`` of
``--queries`` rows runs, split as Linux reports it (``/proc/self/status``):
``RssAnon`` (the process's own memory: tensors, buffers) and ``RssFile``
(pages of mapped files: the memory-mapped path, reclaimable by the kernel at
any time). Printed per configuration: the path's bytes (the recorded path and,
for float32, the float64 replay the engine reads), the peak growth of each during
``decompose``, and its seconds.

    python benchmarks/bench_path_memory.py --steps 400
    python benchmarks/bench_path_memory.py --quick   # 40 steps, 1 query

The machine may be shared: the memory figures are per process and do not depend
on the load; the seconds do.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time


def rss():
    """``(RssAnon, RssFile)`` of this process in bytes (Linux)."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssFile:")):
                name, amount, _ = line.split()
                values[name[:-1]] = int(amount) * 1024
    return values["RssAnon"], values["RssFile"]


class PeakSampler(threading.Thread):
    """Samples :func:`rss` every ``interval`` seconds; keeps the peaks."""

    def __init__(self, interval=0.005):
        super().__init__(daemon=True)
        self.interval, self.running = interval, True
        self.peak_anon, self.peak_file = rss()

    def run(self):
        while self.running:
            anon, file = rss()
            self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)
            time.sleep(self.interval)

    def stop(self):
        self.running = False
        self.join()
        anon, file = rss()
        self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)


def drop_mapped_pages(tensor):
    """Unmap the resident pages of a memory-mapped tensor from this process
    (``madvise(MADV_DONTNEED)``: a shared file mapping keeps its data in the file
    and reads it back on the next touch)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    end = tensor.data_ptr() + tensor.nbytes
    if libc.madvise(start, end - start, 4) != 0:  # MADV_DONTNEED
        raise OSError(ctypes.get_errno(), "madvise failed")


def measure(args):
    """One configuration, in this process: prints one JSON line."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    from sklearn_pathkernel import ExactPathKernelClassifier

    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    batches_per_epoch = -(-X.shape[0] // 50)
    epochs = -(-args.steps // batches_per_epoch)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(256, 256),
        batch_size=50,
        learning_rate=0.05,
        max_iter=epochs,
        random_state=0,
        dtype=args.dtype,
        path_storage=args.storage,
    ).fit(X, y)
    engine_path = clf._engine().path  # (builds the float32 fit's replay: not measured)
    queries = X[: args.queries] + 0.01
    clf.decompose(queries[:1])  # warm-up: the engine's one-off plans and caches
    if args.storage == "disk":  # what decompose itself maps in, from none
        drop_mapped_pages(engine_path.weights)
    before = rss()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    parts = clf.decompose(queries)
    seconds = time.perf_counter() - start
    sampler.stop()
    result = {
        "dtype": args.dtype,
        "storage": args.storage,
        "steps": clf.n_steps_,
        "weights": clf.path_.n_weights,
        "recorded_mib": clf.path_.weights.nbytes / 2**20,
        "engine_path_mib": engine_path.weights.nbytes / 2**20,
        "anon_growth_mib": (sampler.peak_anon - before[0]) / 2**20,
        "file_growth_mib": (sampler.peak_file - before[1]) / 2**20,
        "peak_rss_mib": (sampler.peak_anon + sampler.peak_file) / 2**20,
        "seconds": seconds,
        "residual": float(np.max(parts.residual)),
        "model_gap": float(np.max(parts.model_gap)),
    }
    print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--queries", type=int, default=2)
    parser.add_argument("--dtype", choices=["float64", "float32"], default=None)
    parser.add_argument("--storage", choices=["memory", "disk"], default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 steps, 1 query")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(steps=40, queries=1)
        args = parser.parse_args()
    if args.child:
        measure(args)
        return
    print(
        f"{'dtype':8} {'storage':8} {'steps':>5} {'path MiB':>9} {'engine MiB':>10} "
        f"{'anon +MiB':>9} {'file +MiB':>9} {'RSS MiB':>8} {'s':>6} {'residual':>9} "
        f"{'model_gap':>9}"
    )
    for dtype in [args.dtype] if args.dtype else ["float64", "float32"]:
        for storage in [args.storage] if args.storage else ["memory", "disk"]:
            command = [sys.executable, __file__, "--child", "--steps", str(args.steps)]
            command += ["--queries", str(args.queries), "--dtype", dtype, "--storage", storage]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{r['dtype']:8} {r['storage']:8} {r['steps']:5d} {r['recorded_mib']:9.1f} "
                f"{r['engine_path_mib']:10.1f} {r['anon_growth_mib']:9.1f} "
                f"{r['file_growth_mib']:9.1f} {r['peak_rss_mib']:8.1f} {r['seconds']:6.1f} "
                f"{r['residual']:9.1e} "
                f"{r['model_gap']:9.1e}"
            )


if __name__ == "__main__":
    main()
