"""
===========================================================
Retraining the kernel machine's weights with an SVM
===========================================================

The EPK paper's Fig. 3. A trained network is exactly a kernel machine,
:math:`f(x) = b + \\sum_i a_i K(x, x_i)`, with the coefficients :math:`a_i` set by
gradient descent. Keeping the network's learned kernel and refitting the coefficients
with a support vector machine, ``SVC(kernel="precomputed")``, gives a new classifier on
the same kernel.

The kernel is the Exact Path Kernel of the trained network
(:attr:`~sklearn_pathkernel.ExactPathKernelClassifier.kernel_`): training rows are on
the training copy (a symmetric positive semi-definite Gram matrix for the SVM), the grid
points on the test copy. An RBF SVM is shown for comparison: the learned kernel is not
stationary, its decision regions extend far from the data along directions the network
learned, where an RBF kernel reverts to the prior.
"""

# %%
# A 2-D, 3-class problem
# ----------------------
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from sklearn.svm import SVC

from sklearn_pathkernel import ExactPathKernelClassifier

rng = np.random.RandomState(0)
means = np.array([(1.0, 4.0), (4.0, 1.0), (5.0, 5.0)])
y = np.repeat(np.arange(3), 30)
X = means[y] + rng.standard_normal((y.size, 2))
X_test_y = np.repeat(np.arange(3), 50)
X_test = means[X_test_y] + rng.standard_normal((X_test_y.size, 2))

clf = ExactPathKernelClassifier(
    hidden_layer_sizes=(32,), learning_rate=0.2, max_iter=30, random_state=0
).fit(X, y)
print(f"network test accuracy: {clf.score(X_test, X_test_y):.3f}")

# %%
# Refit the coefficients with an SVM on the learned kernel
# ---------------------------------------------------------
K_train = clf.kernel_(X)  # (90, 90), training copy
svc = SVC(kernel="precomputed", C=10.0).fit(K_train, y)
acc_epk = svc.score(clf.kernel_(X_test, X), X_test_y)
print(f"SVC on the EPK test accuracy: {acc_epk:.3f}")
rbf = SVC(kernel="rbf", C=10.0).fit(X, y)
print(f"SVC on an RBF kernel test accuracy: {rbf.score(X_test, X_test_y):.3f}")

# %%
# Decision regions on a grid
# --------------------------
# The grid rows are on the test copy: ``kernel_(grid, X)`` integrates each query's
# gradient exactly along every training step. That is the expensive part of this
# example, about linearly in the number of grid points, so the 64 x 64 grid's cross
# Gram is computed once, here, and the SVC predicts every grid point from it. The
# network's own panel needs no kernel at all: ``clf.predict`` is a forward pass.
start = time.perf_counter()
xx, yy = np.meshgrid(np.linspace(-3, 9, 64), np.linspace(-3, 9, 64))
grid = np.c_[xx.ravel(), yy.ravel()]
K_grid = clf.kernel_(grid, X)  # (4096, 90): grid rows against the training rows
print(f"kernel on {len(grid)} grid points: {time.perf_counter() - start:.1f} s")

# %%
# Each panel colours the grid by the predicted class. The SVC on the network's EPK
# keeps the network's kind of regions, long wedges that reach the edges of the plot,
# with boundaries moved by its own coefficients (its support vectors are circled). The
# RBF SVM's regions follow the data and give way to a single class away from it.
panels = [
    ("network", clf.predict(grid)),
    ("SVC on the network's EPK", svc.predict(K_grid)),
    ("SVC on an RBF kernel", rbf.predict(grid)),
]
cmap = ListedColormap(["#9ecae1", "#fdae6b", "#a1d99b"])
point_colors = np.array(["tab:blue", "tab:orange", "tab:green"])
fig, axes = plt.subplots(1, 3, figsize=(13, 4.8), sharey=True, layout="constrained")
for ax, (title, labels) in zip(axes, panels, strict=True):
    ax.pcolormesh(xx, yy, labels.reshape(xx.shape), cmap=cmap, vmin=0, vmax=2, shading="nearest")
    ax.scatter(X[:, 0], X[:, 1], c=point_colors[y], s=14, edgecolors="k", linewidths=0.4)
    if title.startswith("SVC on the network"):
        sv = svc.support_
        ax.scatter(
            X[sv, 0],
            X[sv, 1],
            s=60,
            facecolors="none",
            edgecolors="k",
            linewidths=0.8,
            label="support vectors",
        )
        ax.legend(loc="lower right", fontsize=8)
    ax.set(title=title, xlabel="$x_1$", aspect="equal")
axes[0].set_ylabel("$x_2$")
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=100, bbox_inches="tight")
plt.show()
