"""Benchmark: what an output subspace costs and what it saves.

Usage::

    python benchmarks/bench_output_subspace.py
    python benchmarks/bench_output_subspace.py --rows 512 3000 --units 128 --outputs 10
    python benchmarks/bench_output_subspace.py --quick   # 512 right rows only

Deltas with the structure of the layer below a linear head (``sigma'(z) (V[:, o] -
(p . V[:, o]) 1)``: two directions per unit) for ``--rows`` right rows. Side by
side, in one run:

- finding the subspace (``OutputSubspace.of``: unit-norm scaling, QR, SVD) and
  projecting the right rows, per right value (n K d_out), in ns;
- the projection as one multiply-add per output over contiguous slabs (the
  engine's) against a batched product per unit over strided views;
- the delta Gram of ``--left`` left rows with the right rows, with every output
  and projected, and the left rows at which the saving pays for the subspace.

The engine looks for a subspace only with ``_MIN_LEFT_ROWS_PER_OUTPUT`` K left
rows or more (100 K); the break-even printed here is what that constant is set
against.
"""

import argparse
import time

import torch

from sklearn_pathkernel._engine import _output_subspace as _output_subspace
from sklearn_pathkernel._engine._output_subspace import OutputSubspace


def best_of(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def structured_deltas(n, n_outputs, d_out, seed=0):
    """(n, K, d_out) deltas of the layer below a linear head, in the batched
    backward pass's memory order (K, n, d_out), as the probe hands them over."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randn(n_outputs, d_out, generator=generator, dtype=torch.float64)
    logits = torch.randn(n, n_outputs, generator=generator, dtype=torch.float64)
    p = torch.softmax(logits, dim=1)
    mask = (torch.rand(n, d_out, generator=generator) > 0.5).double()
    q = p @ head  # (n, d_out)
    by_output = mask[None] * (head[:, None, :] - q[None])  # (K, n, d_out)
    return by_output.transpose(0, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 3000])
    parser.add_argument("--left", type=int, default=440, help="left rows of the product")
    parser.add_argument("--units", type=int, default=128)
    parser.add_argument("--outputs", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 512 right rows")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(rows=[512])
        args = parser.parse_args()
    _output_subspace._MIN_LEFT_ROWS_PER_OUTPUT = 0  # measure at any size
    K, d_out = args.outputs, args.units
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; K={K}, d_out={d_out}")
    header = (
        f"{'rows':>6}{'rank':>6}{'find ms':>9}{'project ms':>12}{'bmm ms':>9}"
        f"{'ns/value':>10}{'product ms':>12}{'projected':>11}{'break-even':>12}"
    )
    print(header)
    for n in args.rows:
        deltas = structured_deltas(n, K, d_out)
        subspace = OutputSubspace.of(deltas, n_left=n)
        find = best_of(lambda d=deltas: OutputSubspace.of(d, n_left=d.shape[0]))
        project = best_of(lambda s=subspace, d=deltas: s.project(d))
        by_unit = subspace.basis.permute(2, 0, 1)  # (d_out, K, r)
        bmm = best_of(lambda d=deltas, b=by_unit: torch.bmm(d.permute(2, 0, 1), b))
        left = structured_deltas(args.left, K, d_out, seed=1)
        full = best_of(lambda a=left, d=deltas: a.flatten(1) @ d.flatten(1).T)
        small_left, small_right = subspace.project(left), subspace.project(deltas)
        projected = best_of(lambda a=small_left, b=small_right: a.flatten(1) @ b.flatten(1).T)
        cost = find + project
        saving_per_left_row = (full - projected) / args.left
        break_even = cost / saving_per_left_row if saving_per_left_row > 0 else float("inf")
        print(
            f"{n:>6}{subspace.rank:>6}{1e3 * find:>9.2f}{1e3 * project:>12.2f}{1e3 * bmm:>9.2f}"
            f"{1e9 * cost / (n * K * d_out):>10.1f}{1e3 * full:>12.2f}{1e3 * projected:>11.2f}"
            f"{break_even:>12.0f}"
        )
    print(
        "find + project per right value (ns/value); the delta Gram of the left rows with"
        " every output and projected; break-even: left rows whose saving pays for the subspace."
    )


if __name__ == "__main__":
    main()
