"""Recordings of this commit and of an earlier one, compared bitwise.

The same loops (an MLP on random data, mini-batches of 8 with a short last batch,
a cosine schedule) are recorded by this commit's :class:`TrainingRecorder` and by
an earlier commit's (``git archive``, see ``_baseline.py``), in one process, for
Adam (coupled weight decay), AdamW and SGD (Nesterov momentum, weight decay), one
and two parameter groups, float32 and float64. Compared with ``torch.equal`` /
``np.array_equal``: the weights, Adam's preconditioners, the rows, the output
gradients, the learning rates and the per-step coefficients, and ``decompose`` on
four rows (contributions, bias, residual).

Run: ``python benchmarks/recorder_identical.py REV [--hidden 7]`` (``--hidden
30000``: wide enough that Adam's preconditioners are finished in several blocks).
``--quick`` without ``REV`` compares the working tree with ``HEAD``. The exit status
is 1 when some recording differs.
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import sklearn_pathkernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baseline import import_commit  # noqa: E402

OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=1e-2),
    "sgd": lambda params: torch.optim.SGD(
        params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
}


def record(package, optimizer, dtype, groups, hidden):
    torch.manual_seed(0)
    X = torch.randn(60, 5, dtype=dtype)
    y = (X[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 3)).to(dtype)
    params = model.parameters()
    if groups:
        params = [{"params": model[0].parameters(), "lr": 0.05}, {"params": model[2].parameters()}]
    optimizer = OPTIMIZERS[optimizer](params)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 24)
    recorder = package.TrainingRecorder(model, optimizer, X, y)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        order = torch.randperm(60, generator=generator)
        for start in range(0, 60, 8):
            rows = order[start : start + 8]
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
            schedule.step()
    recording = recorder.finish()
    return recording, recording.decompose(X[:4])


def identical(mine, theirs):
    (a, parts_a), (b, parts_b) = mine, theirs
    pa, pb = a.path_, b.path_
    ua, ub = pa.update, pb.update
    same = torch.equal(pa.weights, pb.weights)
    same &= (ua.preconditioners is None) == (ub.preconditioners is None)
    if ua.preconditioners is not None:
        same &= torch.equal(ua.preconditioners, ub.preconditioners)
    same &= len(pa.batches) == len(pb.batches)
    same &= all(np.array_equal(x, z) for x, z in zip(pa.batches, pb.batches, strict=True))
    same &= all(
        torch.equal(x, z) for x, z in zip(pa.output_gradients, pb.output_gradients, strict=True)
    )
    same &= np.array_equal(pa.learning_rates, pb.learning_rates)
    for field in ("gradient_rates", "direct_rates", "decoupled_decays"):
        same &= repr(getattr(ua, field)) == repr(getattr(ub, field))
    for field in ("contributions", "bias", "residual"):
        same &= np.array_equal(np.asarray(getattr(parts_a, field)), getattr(parts_b, field))
    return bool(same)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("base", nargs="?", help="the earlier commit (--quick: HEAD)")
    parser.add_argument("--hidden", type=int, default=7)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: against HEAD when no commit is given",
    )
    args = parser.parse_args()
    if args.base is None:
        if not args.quick:
            parser.error("the earlier commit is needed (or --quick, which takes HEAD)")
        args.base = "HEAD"
    print(f"this tree against {args.base}")
    base = import_commit(args.base)
    torch.set_num_threads(1)
    everything = True
    for optimizer in OPTIMIZERS:
        for dtype in (torch.float32, torch.float64):
            for groups in (False, True):
                same = identical(
                    record(sklearn_pathkernel, optimizer, dtype, groups, args.hidden),
                    record(base, optimizer, dtype, groups, args.hidden),
                )
                everything &= same
                print(
                    f"{optimizer:<6} {str(dtype):<14} {'2 groups' if groups else '1 group':<9}"
                    f"{'identical' if same else 'DIFFERENT'}"
                )
    print("all identical" if everything else "SOME DIFFER")
    sys.exit(0 if everything else 1)


if __name__ == "__main__":
    main()
