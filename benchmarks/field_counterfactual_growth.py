"""The counterfactual's adjoint on the field's run: does it grow along 3976 steps?

Trains dattri's MNIST-10 MLP at the field's size (``bench_field.py``'s table: 4500
rows, 56 epochs of batches of 64, SGD with momentum 0.9, dropout 0.1; the path on
disk), sweeps the counterfactual of the first ``--queries`` test points' margins, and
prints the sweep's ``replay_error`` (how exactly the differentiated steps land on the
recorded weights) and the adjoint's growth ``max_s |lambda_s| / |lambda_S|`` per
query, with the median ``|lambda_s| / |lambda_S|`` one epoch back, a sixth of the run
back, at mid-run and at step 0. About 3 CPU-minutes for 16 queries.

    python benchmarks/field_counterfactual_growth.py --queries 16
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _attribution_tasks import make_task  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4500)
    parser.add_argument("--epochs", type=int, default=56)
    args = parser.parse_args()
    task = make_task("mnist10", args.rows, 500)
    task.settings.update(max_iter=args.epochs, path_storage="disk")
    clf = task.fit(seed=0)
    start = time.process_time()
    found = clf.counterfactual(
        task.X_test[: args.queries], task.y_test[: args.queries], target="margin"
    )
    print(f"sweep {time.process_time() - start:.0f} CPU-s, {clf.n_steps_} steps, "
          f"hessian={found.hessian}, replay_error {found.replay_error:.2g}")  # fmt: skip
    growth = found.growth
    print(f"growth max_s |lambda_s| / |lambda_S|: median {np.median(growth):.3g} "
          f"(min {growth.min():.3g}, max {growth.max():.3g})")  # fmt: skip
    norms = found.adjoint_norms
    S = norms.shape[0] - 1
    per_epoch = -(-S // args.epochs)
    for label, step in [("one epoch back", S - per_epoch), ("a sixth back", S - S // 6),
                        ("mid-run", S // 2), ("step 0", 0)]:  # fmt: skip
        ratio = np.median(norms[step] / norms[S])
        print(f"  {label} (step {step}): median |lambda_s| / |lambda_S| {ratio:.3g}")


if __name__ == "__main__":
    main()
