"""
=========================================================
Regression as an exact kernel machine, and its GP
=========================================================

With the squared error, a network trained by gradient descent is *exactly* a kernel
regression over its training points: :meth:`ExactPathKernelRegressor.decompose
<sklearn_pathkernel.ExactPathKernelRegressor.decompose>` writes every prediction as
the initial network's output plus one contribution per training point (each point's
residual at every step, weighed by the kernel), and the sum matches the network to
rounding.

Left: a Gaussian process regression on the network's learned kernel (scaled by a
``ConstantKernel``, with a ``WhiteKernel`` for the noise, both fitted by maximum
likelihood), next to one on an RBF kernel. Right: one prediction explained by its
training points: each point's contribution against its position.
"""

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from sklearn_pathkernel import ExactPathKernelRegressor

rng = np.random.RandomState(0)
X = np.sort(rng.uniform(-3, 3, 40))[:, None]
y = np.sin(1.5 * X[:, 0]) + 0.15 * rng.standard_normal(40)

reg = ExactPathKernelRegressor(
    hidden_layer_sizes=(64,), activation="tanh", learning_rate=0.1, max_iter=100, random_state=0
).fit(X, y)
print(f"network R^2 on the training data: {reg.score(X, y):.3f}")

# %%
# The network is a kernel regression over its training points
# -----------------------------------------------------------
grid = np.linspace(-4.5, 4.5, 120)[:, None]
parts = reg.decompose(grid)
machine = parts.bias + parts.contributions.sum(axis=1) + parts.decay
print(f"max |kernel machine - network| on {len(grid)} points: {parts.residual.max():.1e}")

# %%
# Gaussian processes on the learned kernel and on an RBF kernel
# -------------------------------------------------------------
# The EPK has no hyperparameters; a constant factor and a noise level are fitted.
epk_gp = GaussianProcessRegressor(
    kernel=ConstantKernel(1e-2, (1e-6, 1e2)) * reg.kernel_ + WhiteKernel(1e-2),
    normalize_y=True,
    random_state=0,
).fit(X, y)
rbf_gp = GaussianProcessRegressor(
    kernel=ConstantKernel() * RBF() + WhiteKernel(1e-2), normalize_y=True, random_state=0
).fit(X, y)
print(f"learned kernel: {epk_gp.kernel_.k1.k1}, noise {epk_gp.kernel_.k2}")

fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), constrained_layout=True)
ax = axes[0]
for gp, name, colour in [(epk_gp, "GP on the EPK", "tab:blue"), (rbf_gp, "GP on RBF", "tab:green")]:
    mean, std = gp.predict(grid, return_std=True)
    ax.plot(grid[:, 0], mean, color=colour, label=name)
    ax.fill_between(grid[:, 0], mean - 2 * std, mean + 2 * std, color=colour, alpha=0.15)
ax.plot(grid[:, 0], machine, "k--", lw=1, label="network = kernel machine")
ax.scatter(X[:, 0], y, s=12, color="k", zorder=3, label="training points")
ax.set(title="GP regression: mean and 2 std", xlabel="x", ylim=(-3, 3))
ax.legend(loc="lower left", fontsize=8)

# %%
# One prediction, explained by its training points
# ------------------------------------------------
query = np.array([[1.0]])
explained = reg.decompose(query)
contributions = explained.contributions[0]
ax = axes[1]
ax.bar(X[:, 0], contributions, width=0.08, color="tab:purple")
ax.axvline(query[0, 0], color="k", ls=":", label="query x = 1")
ax.set(
    title=(
        f"f(1) = {explained.output[0]:.3f} = bias {explained.bias[0]:.2f} "
        f"+ sum of {len(contributions)} contributions"
    ),
    xlabel="training point x_i",
    ylabel="contribution to f(1)",
)
ax.legend(fontsize=8)
top = np.argsort(-np.abs(contributions))[:3]
print(
    "largest contributions to f(1):",
    ", ".join(f"x={X[i, 0]:.2f}: {contributions[i]:+.3f}" for i in top),
)
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=100, bbox_inches="tight")
plt.show()
