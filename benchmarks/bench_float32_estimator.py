"""The certificate of float32 estimator fits (``dtype="float32"``) on digits, measured.

For each solver, an ``ExactPathKernelClassifier`` (MLP 64-64-10, batches of 50) is
fitted on 1500 digits rows in float32 and in float64 (same seed). Printed per fit:
whether the float64 replay stayed within the run's rounding bound (else the fit is
refused), the largest ratio of the replay's distance to the float32 final weights over
the bound (per parameter tensor), and, over the ``decompose`` of 100 held-out rows,
the largest ``residual`` (against the float64 replayed network) and ``model_gap``
(the float32 network's own output against it), next to the float64 fit's residual.

    python benchmarks/bench_float32_estimator.py --epochs 5
    python benchmarks/bench_float32_estimator.py --quick   # 1 epoch of 300 rows

``--rows`` (1500) sets the training rows.
"""

import argparse

import numpy as np
from sklearn.datasets import load_digits

from sklearn_pathkernel import ExactPathKernelClassifier, RecordingRefused
from sklearn_pathkernel._training._replay import replay_bound, replay_differences

SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate=0.1),
    "sgd momentum 0.9": dict(solver="sgd", momentum=0.9, learning_rate=0.02),
    "adam eps=1e-8": dict(solver="adam", learning_rate=0.003),
    "adam eps=1e-6": dict(solver="adam", learning_rate=0.003, epsilon=1e-6),
    "adam eps=1e-4": dict(solver="adam", learning_rate=0.003, epsilon=1e-4),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=1500, help="training rows (at most 1697)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 epoch, 300 rows")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(epochs=1, rows=300)
        args = parser.parse_args()
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    n = min(args.rows, X.shape[0] - 100)
    X_train, y_train, X_test = X[:n], y[:n], X[n : n + 100]
    print(
        f"{'solver':18} {'steps':>5} {'replay/bound':>12} {'residual32':>10} "
        f"{'model_gap':>9} {'residual64':>10}"
    )
    for name, solver in SOLVERS.items():
        params = dict(hidden_layer_sizes=(64,), batch_size=50, max_iter=args.epochs, random_state=0)
        double = ExactPathKernelClassifier(**params, **solver).fit(X_train, y_train)
        residual64 = double.decompose(X_test).residual.max()
        try:
            single = ExactPathKernelClassifier(**params, **solver, dtype="float32")
            single.fit(X_train, y_train)
        except RecordingRefused as refusal:
            ratio = str(refusal).split(" ends ")[1].split(" from")[0]
            print(
                f"{name:18} {double.n_steps_:5d} {'refused':>12} {'--':>10} {'--':>9} "
                f"{residual64:10.2g}  (the replay ends {ratio} from the weights)"
            )
            continue
        bounds = replay_bound(single.path_)
        differences = replay_differences(single.path_, single._engine().path)
        ratio = max(differences[k] / bounds[k] for k in bounds if bounds[k] > 0)
        parts = single.decompose(X_test)
        print(
            f"{name:18} {single.n_steps_:5d} {ratio:12.3g} {parts.residual.max():10.2g} "
            f"{parts.model_gap.max():9.2g} {residual64:10.2g}"
        )
        assert np.isfinite(parts.residual).all()


if __name__ == "__main__":
    main()
