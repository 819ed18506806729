"""The counterfactual's retraining certificate against its step ``h``, cell by cell.

``counterfactual(X, y, target="margin", certify=3, h=h)`` reports the relative error
of the scores of 3 training rows (and of their sum, the "total") against central
differences of real retraining with the row's weight moved by ``1 +- h``. An error
that falls as ``h`` grows is rounding in the retraining divided by ``h``; one that
grows with ``h`` is the curvature of the retrained target (the ``h^2`` of central
differences). The cells (digits, 120 rows, a 64-16-10 tanh MLP, batches of 30):

- ``float32 sgd``: a float32 fit with momentum. Its scores are those of its float64
  twin, which the certificate retrains; with ``--base REV`` the same cell of an
  earlier commit runs beside it (a commit that certified a float32 fit by refitting
  in float32 shows that refit's rounding over ``h``);
- ``float32 batchnorm``: the same with ``BatchNorm1d`` after the first layer;
- ``adam batchnorm``: float64, Adam, ``BatchNorm1d`` (no bias before it), the exact
  adjoint (``hessian=True``): its central differences are curved.

Run: ``python benchmarks/counterfactual_certificates.py --base REV``; ``--quick``: two
steps ``h`` (``--base`` still runs beside it when given).
"""

import argparse
import os
import sys

import numpy as np
from sklearn.datasets import load_digits
from torch import nn

import sklearn_pathkernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baseline import import_commit  # noqa: E402

STEPS = (1e-6, 3e-6, 1e-5, 1e-4, 1e-3, 1e-2)
#: ``--quick``: the steps of a smoke run.
QUICK_STEPS = (1e-5, 1e-3)


def mlp(d, k):
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, k))


def with_batchnorm(d, k):
    return nn.Sequential(
        nn.Linear(d, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, k)
    )


MOMENTUM = dict(solver="sgd", momentum=0.9, learning_rate=0.05)
CELLS = {
    "float32 sgd": (dict(module=mlp, dtype="float32", **MOMENTUM), None),
    "float32 batchnorm": (dict(module=with_batchnorm, dtype="float32", **MOMENTUM), None),
    "adam batchnorm": (dict(module=with_batchnorm, solver="adam", learning_rate=0.01), True),
}


def certificates(package, settings, hessian, X, y, steps=STEPS):
    """(row error, total error) of each step ``h``, or the error's message."""
    clf = package.ExactPathKernelClassifier(
        batch_size=30, max_iter=3, random_state=0, tol=None, **settings
    ).fit(X, y)
    found = {}
    for h in steps:
        try:
            result = clf.counterfactual(X[:2], y[:2], target="margin", certify=3, h=h,
                                        hessian=hessian)  # fmt: skip
        except (ValueError, NotImplementedError) as error:
            return str(error).split(":")[0]
        found[h] = (result.certificate.row_error, result.certificate.total_error)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="an earlier commit, run beside this one")
    parser.add_argument("--quick", action="store_true", help="a smoke run: two steps h")
    args = parser.parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    X, y = load_digits(return_X_y=True)
    X, y = X[:120] / 16, y[:120]
    packages = {"this": sklearn_pathkernel}
    if args.base:
        packages[args.base] = import_commit(args.base)
    print("row error / total error of the certificate, by h")
    print(f"{'cell':20s} {'commit':10s} " + " ".join(f"{h:>19g}" for h in steps))
    for cell, (settings, hessian) in CELLS.items():
        for name, package in packages.items():
            found = certificates(package, settings, hessian, X, y, steps)
            if isinstance(found, str):
                print(f"{cell:20s} {name:10s} {found}")
                continue
            errors = " ".join(f"{row:9.1e} /{total:8.1e}" for row, total in found.values())
            print(f"{cell:20s} {name:10s} {errors}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
