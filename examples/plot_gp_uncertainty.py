"""
======================================================
Gaussian-process uncertainty from the learned kernel
======================================================

The EPK paper's Fig. 5. The Exact Path Kernel of a trained network is a covariance
function: a Gaussian process with it as prior, regressed on the network's logits (here
its log-probabilities) at the training points, gives a mean close to the network and a
standard deviation at every query. Sampling the GP posterior and pushing the samples
through a softmax (Monte-Carlo) turns that into uncertainty on the class probabilities.

Left: the kernel's prior standard deviation :math:`\\sqrt{K(x, x)}` on a grid (query
points on the test copy), relative to its mean at the training points. Right: the
Monte-Carlo standard deviation of the predicted class probability. The learned kernel
is not stationary: unlike an RBF kernel, its prior variance varies strongly across the
plane and keeps growing far from the data. The uncertainty on the probabilities lies
along the network's decision boundaries; away from them, even far from the training
points, the GP is confident, as the paper observed.
"""

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from scipy.special import softmax
from sklearn.gaussian_process import GaussianProcessRegressor

from sklearn_pathkernel import ExactPathKernelClassifier

rng = np.random.RandomState(0)
means = np.array([(1.0, 4.0), (4.0, 1.0), (5.0, 5.0)])
y = np.repeat(np.arange(3), 30)
X = means[y] + rng.standard_normal((y.size, 2))

clf = ExactPathKernelClassifier(
    hidden_layer_sizes=(32,), learning_rate=0.2, max_iter=30, random_state=0
).fit(X, y)

# %%
# A GP on the network's logits
# ----------------------------
# The GP regresses the network's log-probabilities at the training points, with the
# learned kernel as its covariance function.
kernel = clf.kernel_
targets = clf.predict_log_proba(X)
offset = targets.mean(axis=0)
# The EPK's values are large (thousands here) while logits are of order one: scale the
# targets by the kernel's typical standard deviation at the data, which is the same as
# dividing the kernel by its mean diagonal, then scale the predictions back.
scale = np.sqrt(np.mean(kernel.diag(X)))
alpha = 1e-3 * scale**2  # a small jitter, relative to the kernel's scale
gp = GaussianProcessRegressor(kernel=kernel, alpha=alpha, optimizer=None)
gp.fit(X, (targets - offset) * scale)

# %%
# Prediction on a 64 x 64 grid
# ----------------------------
# The grid points are not training points, so they are on the test copy: each one's
# gradient is integrated exactly along every training step. That is where the time
# goes, about linearly in the number of grid points. ``gp.predict(..., return_std=True)``
# asks the kernel for two things only: the cross Gram ``kernel(grid, X)`` (for the
# mean and the variance reduction) and the self-similarities ``kernel.diag(grid)``
# (never the 4096 x 4096 Gram of the grid). The kernel memoises its recent results, so
# the prior standard deviation below reuses that same ``diag`` instead of recomputing
# it.
start = time.perf_counter()
xx, yy = np.meshgrid(np.linspace(-3, 9, 64), np.linspace(-3, 9, 64))
grid = np.c_[xx.ravel(), yy.ravel()]
mean, std = gp.predict(grid, return_std=True)
std = std[:, 0] / scale  # the outputs share the kernel: equal standard deviations
mean = mean / scale + offset
prior_std = np.sqrt(kernel.diag(grid)) / scale
print(f"GP prediction on {len(grid)} grid points: {time.perf_counter() - start:.1f} s")
agree = (mean.argmax(axis=1) == clf.predict(grid)).mean()
print(f"GP mean and network predict the same class on {agree:.1%} of the grid")

# %%
# Monte-Carlo over the softmax
# ----------------------------
# Independent outputs share the kernel, so each logit is Gaussian with the same
# standard deviation at a grid point.
n_samples = 500
samples = mean[None] + std[None, :, None] * rng.standard_normal((n_samples, *mean.shape))
proba = softmax(samples, axis=2)
predicted = mean.argmax(axis=1)
proba_std = proba[:, np.arange(len(grid)), predicted].std(axis=0)
print(
    f"MC std of the predicted class probability: median {np.median(proba_std):.3f}, "
    f"max {proba_std.max():.3f}"
)

# %%
# What the figure shows
# ---------------------
# Each of the 64 x 64 cells is one grid point. On the left, the prior standard
# deviation changes by an order of magnitude across the plane and is largest far from
# the training points: the learned kernel is not stationary. On the right, the
# Monte-Carlo standard deviation is close to zero almost everywhere and high in narrow
# bands along the network's decision boundaries, which run on well outside the data.
fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
for ax, values, title in [
    (axes[0], prior_std, r"prior std $\sqrt{K(x, x)}$ / mean at the data"),
    (axes[1], proba_std, "MC std of the predicted class probability"),
]:
    mesh = ax.pcolormesh(xx, yy, values.reshape(xx.shape), cmap="viridis", shading="auto")
    fig.colorbar(mesh, ax=ax, shrink=0.85)
    ax.scatter(
        X[:, 0],
        X[:, 1],
        c=np.array(["tab:blue", "tab:orange", "tab:red"])[y],
        s=12,
        edgecolors="w",
        linewidths=0.4,
    )
    ax.set(title=title, xlabel="$x_1$", aspect="equal")
axes[0].set_ylabel("$x_2$")
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=100, bbox_inches="tight")
plt.show()
