"""
==============================================================
The network is a kernel machine: prediction vs prediction
==============================================================

The EPK paper's Fig. 4. A ReLU network 100-64-3 is trained by full-batch gradient
descent on three 100-dimensional Gaussian classes (means ``(1, 4, 0, ...)``,
``(4, 1, 0, ...)`` and ``(5, 5, 0, ...)``, standard deviation 1). Its output on test
points is then written as a kernel machine over the training points with
:meth:`~sklearn_pathkernel.ExactPathKernelClassifier.decompose`:

.. math::

   f(x; w_S) = f(x; w_0) + \\sum_i \\mathrm{contribution}_i(x).

The kernel machine's prediction and the network's prediction agree to machine
precision, for every class and every test point.
"""

# %%
# Data and network
# ----------------
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from sklearn_pathkernel import ExactPathKernelClassifier

rng = np.random.RandomState(0)
means = np.zeros((3, 100))
means[:, :2] = [(1, 4), (4, 1), (5, 5)]


def sample(n_per_class):
    y = np.repeat(np.arange(3), n_per_class)
    return means[y] + rng.standard_normal((y.size, 100)), y


X_train, y_train = sample(100)
X_test, y_test = sample(20)

start = time.perf_counter()
clf = ExactPathKernelClassifier(
    hidden_layer_sizes=(64,), learning_rate=0.05, max_iter=50, random_state=0
).fit(X_train, y_train)
print(f"{clf.n_steps_} full-batch steps in {time.perf_counter() - start:.1f} s")
print(f"test accuracy of the network: {clf.score(X_test, y_test):.3f}")

# %%
# The exact decomposition
# -----------------------
# ``bias`` is the initial network (a constant, ``-log 3``: the last layer starts at
# zero); ``contributions`` holds what every training point added to every output.
start = time.perf_counter()
parts = clf.decompose(X_test)
kernel_machine = parts.bias + parts.contributions.sum(axis=1) + parts.decay
network = clf.predict_log_proba(X_test)
difference = np.abs(kernel_machine - network)
print(f"decomposition of {len(X_test)} test points in {time.perf_counter() - start:.1f} s")
print(f"max |kernel machine - network| = {difference.max():.2e}")
print(f"max certificate (|kernel machine - network|) = {parts.residual.max():.2e}")

# %%
# Kernel machine against network
# ------------------------------
# Left: the log-probability of each class from the kernel machine (y) against the
# network (x), one dot per test point and class. Right: the absolute difference,
# at the level of float64 rounding (differences of exactly 0 are drawn at 1e-17).
fig, (ax, ax_err) = plt.subplots(1, 2, figsize=(10, 4.2))
colors = ["tab:blue", "tab:orange", "tab:green"]
for k in range(3):
    ax.scatter(network[:, k], kernel_machine[:, k], s=14, color=colors[k], label=f"class {k}")
lims = [network.min() - 0.5, 0.3]
ax.plot(lims, lims, color="k", lw=0.8, ls="--", label="y = x")
ax.set(
    xlim=lims,
    ylim=lims,
    xlabel="network log-probability",
    ylabel="kernel machine log-probability",
    title="Kernel machine vs network",
)
ax.legend(loc="upper left")

for k in range(3):
    ax_err.semilogy(
        np.arange(len(X_test)),
        np.maximum(difference[:, k], 1e-17),
        "o",
        ms=4,
        color=colors[k],
        label=f"class {k}",
    )
ax_err.axhline(np.finfo(np.float64).eps, color="k", lw=0.8, ls=":", label="float64 eps")
ax_err.set(
    xlabel="test point",
    ylabel="|kernel machine - network|  (0 drawn at 1e-17)",
    ylim=(5e-18, 1e-10),
    title=f"Difference (max {difference.max():.1e})",
)
ax_err.legend(loc="upper right", fontsize=8)
fig.tight_layout()
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=100, bbox_inches="tight")
plt.show()
