"""
==================================================
Which training points made a prediction
==================================================

The EPK paper's Fig. 6. The trained network's log-probabilities at a query point are
exactly the initial network's output plus one contribution per training point
(:meth:`~sklearn_pathkernel.ExactPathKernelClassifier.decompose`). Here the queries are
the three class means of a 2-D, 3-class problem; each panel colours every training
point by what it added to one output (column) at one query (row, star). The diagonal
panels show the predicted class.

Contributions are not proportional to the distance to the query: the points that move
a prediction most are often near the decision boundaries, the points the network kept
misclassifying late in training.
"""

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap, TwoSlopeNorm

from sklearn_pathkernel import ExactPathKernelClassifier

rng = np.random.RandomState(0)
means = np.array([(1.0, 4.0), (4.0, 1.0), (5.0, 5.0)])
y = np.repeat(np.arange(3), 30)
X = means[y] + rng.standard_normal((y.size, 2))

clf = ExactPathKernelClassifier(
    hidden_layer_sizes=(32,), learning_rate=0.2, max_iter=30, random_state=0
).fit(X, y)

start = time.perf_counter()
parts = clf.decompose(means)
print(f"decomposition of 3 queries in {time.perf_counter() - start:.1f} s")
identity = parts.bias + parts.contributions.sum(axis=1) + parts.decay
print(f"max |bias + sum of contributions - network| = {np.abs(identity - parts.output).max():.1e}")
for q in range(3):
    top = np.argsort(-parts.contributions[q, :, q])[:3]
    print(
        f"query {q}: largest contributions to its own class from training points {top}, "
        f"values {np.round(parts.contributions[q, top, q], 3)}"
    )

# %%
# Contributions on the input plane
# --------------------------------
# Background: the network's decision regions. Red: the training point raised that
# output's log-probability, blue: lowered it; one colour scale per row (query). The
# diagonal panels look pale because the predicted class's log-probability only rises
# from ``-log 3`` to near 0, while the other classes' log-probabilities are pushed far
# down: training points near the boundaries contribute most, with both signs.
xx, yy = np.meshgrid(np.linspace(-3, 9, 200), np.linspace(-3, 9, 200))
regions = clf.predict(np.c_[xx.ravel(), yy.ravel()]).reshape(xx.shape)
background = ListedColormap(["#deebf7", "#fee6ce", "#e5f5e0"])

fig, axes = plt.subplots(3, 3, figsize=(11, 10.5), sharex=True, sharey=True)
for q in range(3):
    values = parts.contributions[q]  # (n_train, n_classes)
    bound = np.abs(values).max()
    for k in range(3):
        ax = axes[q, k]
        ax.pcolormesh(xx, yy, regions, cmap=background, vmin=0, vmax=2, shading="nearest")
        sc = ax.scatter(
            X[:, 0],
            X[:, 1],
            c=values[:, k],
            cmap="RdBu_r",
            norm=TwoSlopeNorm(0.0, -bound, bound),
            s=22,
            edgecolors="k",
            linewidths=0.3,
        )
        ax.plot(*means[q], marker="*", color="k", ms=16, mec="w")
        ax.set_title(f"query {q}, output {k}", fontsize=10)
        ax.set_aspect("equal")
    fig.colorbar(sc, ax=axes[q, :].tolist(), shrink=0.85, label="contribution")
for ax in axes[-1]:
    ax.set_xlabel("$x_1$")
for ax in axes[:, 0]:
    ax.set_ylabel("$x_2$")
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=90, bbox_inches="tight")
plt.show()
