"""Benchmark: the exact path kernel at scale on a GPU (or, with ``--quick``, the CPU).

Usage::

    python benchmarks/bench_gpu.py                        # cuda, M in {4000, 16000, 32000}
    python benchmarks/bench_gpu.py --sizes 4000 64000     # other M
    python benchmarks/bench_gpu.py --float32 16000        # also float32 at M=16000 (after
                                                          # every float64 size)
    python benchmarks/bench_gpu.py --profile 16000 --out DIR   # torch.profiler tables
    python benchmarks/bench_gpu.py --quick                # tiny sizes on this machine's
                                                          # device (the CPU here): a smoke run

Network: ReLU MLP 64-128-128-10 (``ExactPathKernelClassifier(hidden_layer_sizes=
(128, 128))``), 50 full-batch gradient-descent steps, float64, on the "digits-like"
data of ``bench_scale.py``. The classifier is fitted on the device, then one
:class:`PathKernelEngine` (default settings) measures, in this process:

    train_gram  ``engine.gram(X, a_train=True)``: M x M
    cross_gram  ``engine.gram(Q, X, b_train=True)``: ``--queries`` test rows x M, per query
    decompose   ``engine.decompose(Q[:--decompose-queries])``, per query

Each time is wall time between ``torch.cuda.synchronize()`` calls, after one
warm-up; ``peak`` is ``torch.cuda.max_memory_allocated`` during the phase.

The floor. Of the training Gram's arithmetic, the products an exact factored
kernel needs after the output subspaces: for a Linear layer ``(d_in + 1) +
r d_out`` multiply-adds per pair of rows and step, with ``r = 2`` output
directions per unit for the last two layers of a classifier and ``r = K`` below
(1879 for this MLP), over the ``M (M + 1) / 2`` pairs of a symmetric Gram:
``flops = 2 S M (M + 1) / 2 * 1879``. ``peak`` is this device's float64 matrix
product rate, measured at the start of the run (an ``--matmul-size`` square
product, median of 10); ``floor = flops / peak``; ``rate`` is flops over the
measured time. The device-to-device copy bandwidth is measured too: some of the
Gram's passes are memory-bound.

Exactness. ``identity``: ``max |bias + sum_i contributions + decay - f(x; w_S)|``
over the decomposed queries; ``cert``: the largest certificate (summed per-step
quadrature error). ``cpu diff``: the largest difference, relative to the largest
entry, between the device's Gram (training and cross) and the CPU engine's on the
same recorded path (a copy of the module and rows on the host), for the first
``--check-rows`` training rows and queries, at the smallest M.

Float32 (``--float32 M``): the same engine built on a float32 copy of the module,
the rows and the recorded path (the float64 run's path, rounded), side by side
with float64: speed-up and error of the Grams (relative to the largest float64
entry) and of the decomposition (identity against the float32 network, and the
largest difference to the float64 contributions).
"""

import argparse
import copy
import datetime
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_scale import digits_like, truncated  # noqa: E402

HIDDEN = (128, 128)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn, *args, **kwargs):
    """``(result, seconds, peak bytes)`` of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return result, seconds, peak


def matmul_rate(device, n, dtype=torch.float64, repeats=10):
    """Flop/s of an n x n x n product (median of ``repeats``, after warm-ups)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=generator, dtype=dtype).to(device)
    b = torch.randn(n, n, generator=generator, dtype=dtype).to(device)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / float(np.median(times))


def copy_bandwidth(device, nbytes=2**31, repeats=10):
    """Bytes/s read plus written by a device-to-device copy."""
    source = torch.ones(nbytes // 8, dtype=torch.float64, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / float(np.median(times))


def macs_per_pair(n_features, hidden, n_outputs):
    """Multiply-adds per pair of rows and step of the trace Gram after the output
    subspaces: ``(d_in + 1) + r d_out`` per Linear layer, ``r = 2`` for the last
    two layers (``r = K`` below)."""
    widths = (n_features, *hidden, n_outputs)
    layers = list(zip(widths[:-1], widths[1:], strict=True))
    total = 0
    for index, (d_in, d_out) in enumerate(layers):
        r = min(2, n_outputs) if index >= len(layers) - 2 else n_outputs
        total += d_in + 1 + r * d_out
    return total


def fit(M, steps, device, n_queries, seed=0):
    from sklearn_pathkernel import ExactPathKernelClassifier

    X, y = digits_like(M + n_queries, seed=seed)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=HIDDEN,
        max_iter=steps,
        learning_rate=0.05,
        random_state=0,
        device=device,
    )
    _, seconds, _ = timed(device, clf.fit, X[:M], y[:M])
    queries = torch.tensor(X[M:], dtype=torch.float64, device=device)
    return clf, queries, seconds


def make_engine(clf, device=None, dtype=torch.float64):
    from sklearn_pathkernel._engine._facade import PathKernelEngine

    device = clf.device_ if device is None else device
    module = copy.deepcopy(clf.module_).to(device=device, dtype=dtype)
    X = clf._fit_X.to(device=device, dtype=dtype)
    path = clf.path_ if dtype == torch.float64 else clf.path_.astype(dtype)
    loss = clf._loss
    return PathKernelEngine(
        module, path, X, link=loss.output_link, certificate_tolerance=loss.certificate_tolerance
    )


def run_phases(engine, queries, n_decompose, device, label=""):
    """Times, peaks and results of the three phases (each time printed as it comes)."""
    X = engine.X_train
    queries = queries.to(engine.X_train.dtype)
    engine.gram(X[:2], a_train=True)  # warm-up
    engine.gram(queries[:2], X[:2], b_train=True)
    out = {}
    out["train_gram"], out["train_s"], out["train_peak"] = timed(
        device, engine.gram, X, a_train=True
    )
    print(f"{label} training Gram: {out['train_s']:.2f} s", flush=True)
    out["cross_gram"], out["cross_s"], out["cross_peak"] = timed(
        device, engine.gram, queries, X, b_train=True
    )
    print(f"{label} cross Gram: {out['cross_s']:.2f} s", flush=True)
    parts, out["decompose_s"], out["decompose_peak"] = timed(
        device, engine.decompose, queries[:n_decompose]
    )
    print(f"{label} decompose: {out['decompose_s']:.2f} s", flush=True)
    total = parts.bias + parts.contributions.sum(1) + parts.decay
    out["identity"] = float(np.abs(total - parts.output).max())
    out["certificate"] = float(parts.quadrature_error.max())
    out["contributions"] = parts.contributions
    return out


def cpu_difference(clf, queries, device_results, rows):
    """Largest |device - CPU| / max |CPU| of the training Gram of the first ``rows``
    training rows and the cross Gram of the first ``rows`` queries (the CPU engine
    on the same recorded path)."""
    cpu = torch.device("cpu")
    engine = make_engine(clf, device=cpu)
    X = engine.X_train[:rows]
    q = queries[:rows].cpu()
    train = engine.gram(X, a_train=True)
    cross = engine.gram(q, engine.X_train, b_train=True)
    # against the device's Grams of the same rows, computed on their own (a larger
    # request's products are the same, but its output subspaces come from more rows)
    diffs = {}
    for name, reference, value in (
        ("train", train, device_results["train_small"]),
        ("cross", cross, device_results["cross_small"]),
    ):
        diffs[name] = float(np.abs(value - reference).max() / np.abs(reference).max())
    return diffs


def relative(value, reference):
    return float(np.abs(value - reference).max() / np.abs(reference).max())


def profile(engine, queries, device, out_dir, steps):
    """torch.profiler tables of the training and cross Gram on the first ``steps`` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from sklearn_pathkernel._engine._facade import PathKernelEngine

    short = truncated(engine.path, steps)
    short_engine = PathKernelEngine(
        engine.module,
        short,
        engine.X_train,
        link=engine.link,
        certificate_tolerance=engine.certificate_tolerance,
    )
    X = engine.X_train
    short_engine.gram(X[:2], a_train=True)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    lines = []
    for name, call in (
        ("train_gram", lambda: short_engine.gram(X, a_train=True)),
        ("cross_gram", lambda: short_engine.gram(queries, X, b_train=True)),
    ):
        sync(device)
        start = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            call()
            sync(device)
        wall = time.perf_counter() - start
        events = prof.key_averages()
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
        lines.append(
            f"== {name}: {steps} steps, M={X.shape[0]}, {queries.shape[0]} queries; wall "
            f"{wall:.3f} s under the profiler; device kernels {device_us / 1e6:.3f} s "
            f"({100 * device_us / 1e6 / wall:.0f} % busy)"
        )
        lines.append(events.table(sort_by=sort, row_limit=30, max_name_column_width=60))
        lines.append(
            events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
        )
    # Where the host's time goes (torch's kernels and numpy alike), by function.
    import cProfile
    import io
    import pstats

    for name, call in (
        ("train_gram", lambda: short_engine.gram(X, a_train=True)),
        ("cross_gram", lambda: short_engine.gram(queries, X, b_train=True)),
    ):
        profiler = cProfile.Profile()
        profiler.enable()
        call()
        sync(device)
        profiler.disable()
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        stats.sort_stats("cumulative").print_stats(25)
        stats.sort_stats("tottime").print_stats(15)
        lines.append(f"== {name}: cProfile, by cumulative and own time\n{stream.getvalue()}")
    text = "\n".join(lines)
    if out_dir:
        with open(os.path.join(out_dir, "profile.txt"), "w") as handle:
            handle.write(text)
    return text


def micro(device):
    """Device-to-host copies of a Gram and the output subspaces' QR, each way."""
    from sklearn_pathkernel._engine import _output_subspace
    from sklearn_pathkernel._engine._transfer import to_host

    def best(fn, repeats=3):
        times = []
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
        return min(times)

    lines = []
    for rows in (16000, 32000) if device.type == "cuda" else (2000,):
        block = torch.randn(rows, rows, dtype=torch.float64, device=device)
        gib = block.nbytes / 2**30

        def pinned(block=block):
            host = torch.empty(block.shape, dtype=block.dtype, pin_memory=device.type == "cuda")
            host.copy_(block)
            return host.numpy()

        for name, fn in (
            ("pageable .cpu()", lambda block=block: block.cpu().numpy()),
            ("pinned, allocated per copy", pinned),
            ("to_host (two pinned buffers)", lambda block=block: to_host(block)),
        ):
            seconds = best(fn, 2)
            lines.append(
                f"copy {gib:.1f} GiB to host, {name}: {seconds:.3f} s, {gib / seconds:.1f} GiB/s"
            )
        del block
    for rows in (16000, 32000) if device.type == "cuda" else (3000,):
        matrices = torch.randn(128, rows, 10, dtype=torch.float64, device=device)
        direct = best(lambda m=matrices: torch.linalg.qr(m, mode="r")[1])
        lines.append(f"QR of (128, {rows}, 10): one batched QR {1e3 * direct:.1f} ms")
        for chunk in (256, 1024, 4096):
            seconds = best(lambda m=matrices, c=chunk: _output_subspace._tall_skinny_r(m, c))
            lines.append(f"  two levels, {chunk}-row chunks: {1e3 * seconds:.1f} ms")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return "\n".join(lines)


def save(out_dir, header, rows):
    """``results.json`` in ``out_dir`` (none without one), rewritten after each row."""
    if out_dir:
        with open(os.path.join(out_dir, "results.json"), "w") as handle:
            json.dump({**header, "rows": rows}, handle, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--sizes", nargs="*", type=int, default=[4000, 16000, 32000])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--queries", type=int, default=1000, help="rows of the cross Gram")
    parser.add_argument("--decompose-queries", type=int, default=100)
    parser.add_argument(
        "--check-rows", type=int, default=200, help="rows checked on the CPU (smallest M); 0: none"
    )
    parser.add_argument("--float32", nargs="*", type=int, default=[], help="M to run in float32")
    parser.add_argument("--profile", type=int, default=None, help="M to profile")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (runs on a CPU)")
    parser.add_argument("--micro", action="store_true", help="also time copies and QR variants")
    parser.add_argument("--out", default=None, help="directory for results.json and profile.txt")
    parser.add_argument("--label", default="", help="a name printed with the table")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.queries = [300, 600], 5, 40
        args.decompose_queries, args.check_rows, args.matmul_size = 10, 50, 1024
        args.float32 = args.float32 or [300]
        args.profile = args.profile or 300
        args.profile_steps = 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)

    import sklearn_pathkernel

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak64 = matmul_rate(device, args.matmul_size)
    peak32 = matmul_rate(device, args.matmul_size, torch.float32)
    bandwidth = copy_bandwidth(device, 2**31 if device.type == "cuda" else 2**27)
    macs = macs_per_pair(64, HIDDEN, 10)
    header = {
        "label": args.label,
        "date": datetime.date.today().isoformat(),
        "device": name,
        "torch": torch.__version__,
        "package": os.path.dirname(sklearn_pathkernel.__file__),
        "command": " ".join(sys.argv),
        "fp64_matmul_tflops": peak64 / 1e12,
        "fp32_matmul_tflops": peak32 / 1e12,
        "copy_tb_s": bandwidth / 1e12,
        "macs_per_pair": macs,
    }
    print(
        f"{args.label} {name}, torch {torch.__version__}, package {header['package']}\n"
        f"float64 matmul {args.matmul_size}^3: {peak64 / 1e12:.1f} TFLOP/s; float32 "
        f"(no TF32): {peak32 / 1e12:.1f} TFLOP/s; device copy {bandwidth / 1e12:.2f} TB/s "
        f"(read + write); {macs} multiply-adds per pair and step",
        flush=True,
    )
    if args.micro or args.quick:
        print(micro(device), flush=True)
    rows, kept = [], {}
    for M in args.sizes:
        clf, queries, fit_s = fit(M, args.steps, device, args.queries)
        print(f"M={M}: fitted in {fit_s:.2f} s", flush=True)
        engine = make_engine(clf)
        try:
            result = run_phases(engine, queries, args.decompose_queries, device, f"M={M}")
        except torch.OutOfMemoryError as error:
            print(f"M={M}: out of GPU memory ({str(error)[:200]})", flush=True)
            break
        flops = 2 * args.steps * M * (M + 1) / 2 * macs
        row = {
            "M": M,
            "fit_s": fit_s,
            "train_s": result["train_s"],
            "floor_s": flops / peak64,
            "tflops": flops / result["train_s"] / 1e12,
            "train_peak_gib": (result["train_peak"] or 0) / 2**30,
            "cross_ms_per_query": 1e3 * result["cross_s"] / args.queries,
            "cross_peak_gib": (result["cross_peak"] or 0) / 2**30,
            "decompose_ms_per_query": 1e3 * result["decompose_s"] / args.decompose_queries,
            "decompose_peak_gib": (result["decompose_peak"] or 0) / 2**30,
            "identity": result["identity"],
            "certificate": result["certificate"],
        }
        gram = result["train_gram"]
        # exactly symmetric (the first 1000 rows: a transposed pass over 8 GB is slow)
        row["symmetric"] = bool(np.array_equal(gram[:1000], gram[:, :1000].T))
        if args.check_rows and M == min(args.sizes):
            n = args.check_rows
            small = {
                "train_small": engine.gram(engine.X_train[:n], a_train=True),
                "cross_small": engine.gram(queries[:n], engine.X_train, b_train=True),
            }
            row["cpu_diff"] = cpu_difference(clf, queries, small, n)
        rows.append(row)
        print(json.dumps(row), flush=True)
        save(args.out, header, rows)
        if args.profile == M:
            print(profile(engine, queries, device, args.out, args.profile_steps), flush=True)
        if M in args.float32:  # after every float64 size: kept until then
            kept[M] = (row, clf, queries, result)
        del result, gram, engine, clf
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for M, (row, clf, queries, result) in kept.items():
        engine32 = make_engine(clf, dtype=torch.float32)
        r32 = run_phases(engine32, queries, args.decompose_queries, device, f"float32 M={M}")
        row["float32"] = {
            "train_s": r32["train_s"],
            "cross_ms_per_query": 1e3 * r32["cross_s"] / args.queries,
            "decompose_ms_per_query": 1e3 * r32["decompose_s"] / args.decompose_queries,
            "train_peak_gib": (r32["train_peak"] or 0) / 2**30,
            "train_error": relative(r32["train_gram"], result["train_gram"]),
            "cross_error": relative(r32["cross_gram"], result["cross_gram"]),
            "contribution_error": relative(r32["contributions"], result["contributions"]),
            "identity": r32["identity"],
            "certificate": r32["certificate"],
        }
        print(json.dumps({"M": M, "float32": row["float32"]}), flush=True)
        save(args.out, header, rows)
        del engine32, r32

    print(
        f"\n{args.label} {name}, S={args.steps}, float64; peak {peak64 / 1e12:.1f} TFLOP/s; "
        f"{args.queries} queries (cross), {args.decompose_queries} (decompose)"
    )
    print(
        f"{'M':>6} {'fit':>7} {'train':>8} {'floor':>7} {'x floor':>7} {'TFLOP/s':>7} "
        f"{'peak':>8} {'cross/q':>9} {'decomp/q':>9} {'peak':>8} {'identity':>9} "
        f"{'cert':>8} {'cpu diff':>8}"
    )
    for r in rows:
        diff = max(r.get("cpu_diff", {"-": float("nan")}).values())
        print(
            f"{r['M']:>6} {r['fit_s']:6.2f}s {r['train_s']:7.2f}s {r['floor_s']:6.2f}s "
            f"{r['train_s'] / r['floor_s']:6.1f}x {r['tflops']:7.2f} "
            f"{r['train_peak_gib']:5.1f}GiB {r['cross_ms_per_query']:7.3f}ms "
            f"{r['decompose_ms_per_query']:7.2f}ms {r['decompose_peak_gib']:5.1f}GiB "
            f"{r['identity']:9.1e} {r['certificate']:8.1e} {diff:8.1e}"
        )
    for r in rows:
        if "float32" in r:
            f = r["float32"]
            print(
                f"float32 M={r['M']}: train {f['train_s']:.2f}s "
                f"({r['train_s'] / f['train_s']:.2f}x), cross {f['cross_ms_per_query']:.3f} "
                f"ms/q ({r['cross_ms_per_query'] / f['cross_ms_per_query']:.2f}x), decompose "
                f"{f['decompose_ms_per_query']:.2f} ms/q "
                f"({r['decompose_ms_per_query'] / f['decompose_ms_per_query']:.2f}x); errors "
                f"vs float64: train {f['train_error']:.1e}, cross {f['cross_error']:.1e}, "
                f"contributions {f['contribution_error']:.1e}; identity {f['identity']:.1e}, "
                f"certificate {f['certificate']:.1e}"
            )


if __name__ == "__main__":
    main()
