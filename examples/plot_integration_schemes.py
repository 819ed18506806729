"""
==========================================================================
DPK, Riemann sums and the exact scheme on a CNN
==========================================================================

The EPK paper's Fig. 7. The test copy of a query needs the integral of its gradient
along every training step. The Discrete Path Kernel of prior work takes one point (the
start of the step), the paper's Algorithm 1 a left Riemann sum with T points; this
package's default splits each step at the kinks of the ReLUs and max-pools and uses
Gauss-Legendre nodes on each smooth piece.

A small CNN (a user ``nn.Module``: ``nn.Unflatten`` to 1x8x8, ``Conv2d``, ``ReLU``,
``MaxPool2d``, ``Flatten``, and a ``Linear`` head initialised at zero) is trained on
scikit-learn's digits; the decomposition of the test outputs is compared with the
network for each scheme: the error, and what it costs.

The split costs little: the kinks of the convolution's ReLUs follow in closed form
from the pre-activations at the two ends of a step (they are linear in the step), and
only the max-pool winners are searched.
"""

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from sklearn_pathkernel import ExactPathKernelClassifier


def small_cnn(n_features, n_classes):
    head = nn.Linear(4 * 4 * 4, n_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 4, kernel_size=3, padding=1),  # 4 x 8 x 8
        nn.ReLU(),
        nn.MaxPool2d(2),  # 4 x 4 x 4
        nn.Flatten(),
        head,
    )


X, y = load_digits(return_X_y=True)
X = X / 16.0
X_train, X_test, y_train, y_test = train_test_split(
    X, y, train_size=300, test_size=30, stratify=y, random_state=0
)
clf = ExactPathKernelClassifier(
    module=small_cnn, learning_rate=0.3, max_iter=20, random_state=0
).fit(X_train, y_train)
network = clf.predict_log_proba(X_test)
print(f"CNN: {clf.n_steps_} full-batch steps, training accuracy {clf.score(X_train, y_train):.3f}")

# %%
# The four schemes
# ----------------
schemes = [
    ("DPK\n(1 point)", dict(quadrature="dpk")),
    ("Riemann\nT=10", dict(quadrature="riemann", n_points=10)),
    ("Riemann\nT=200", dict(quadrature="riemann", n_points=200)),
    ("exact", dict(quadrature="exact")),
]
errors, seconds, machines = [], [], []
for name, params in schemes:
    clf.set_params(**params)
    start = time.perf_counter()
    parts = clf.decompose(X_test)
    seconds.append(time.perf_counter() - start)
    machines.append(parts.bias + parts.contributions.sum(axis=1) + parts.decay)
    errors.append(np.abs(machines[-1] - network).max())
    print(
        f"{name.replace(chr(10), ' '):>16}: max |kernel machine - network| = {errors[-1]:.1e}, "
        f"certificate {parts.residual.max():.1e}, {seconds[-1]:.1f} s"
    )

# %%
# Error and cost side by side
# ---------------------------
names = [name for name, _ in schemes]
fig, (ax_err, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
ax_err.bar(names, errors, color=["tab:red", "tab:orange", "tab:olive", "tab:green"])
ax_err.set(
    yscale="log",
    ylabel="max |kernel machine - network|",
    title="Error of the kernel machine (log-probability)",
)
ax_err.axhline(np.finfo(np.float64).eps, color="k", lw=0.8, ls=":")
ax_time.bar(names, seconds, color=["tab:red", "tab:orange", "tab:olive", "tab:green"])
ax_time.set(ylabel="seconds", title=f"Cost of decompose ({len(X_test)} queries)")
fig.tight_layout()
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=100, bbox_inches="tight")
plt.show()
