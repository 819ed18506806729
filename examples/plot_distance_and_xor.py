"""
=====================================================================
AND and XOR with distance layers ("memories")
=====================================================================

The "Distance Kernel based Neural Networks" note: a layer whose units output the mean
squared difference between the input and a learned vector, a "memory", is a small
kernel machine of its own; the note tried it on AND and XOR.
:class:`~sklearn_pathkernel.DistanceKernelClassifier` stacks such layers
(:class:`~sklearn_pathkernel.DistanceLayer`), initialises the memories on the data by
k-means++ seeding, and trains by full-batch gradient descent.

For each problem: accuracy and loss per epoch (the network is re-evaluated at every
recorded weight state ``path_.weights``), and the learned memories of the first layer
drawn on the input square over the decision regions. The whole network is also exactly
a kernel machine over its training points (checked at the end).
"""

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from torch.func import functional_call

from sklearn_pathkernel import DistanceKernelClassifier

rng = np.random.RandomState(0)
corners = np.array([(0, 0), (0, 1), (1, 0), (1, 1)], dtype=float)
problems = {"AND": np.array([0, 0, 0, 1]), "XOR": np.array([0, 1, 1, 0])}
X = np.repeat(corners, 25, axis=0) + 0.12 * rng.standard_normal((100, 2))
corner = np.repeat(np.arange(4), 25)


def accuracy_per_epoch(clf, X, y):
    """Accuracy of the network at every recorded weight state w_0 .. w_S."""
    X_t = torch.as_tensor(X, dtype=torch.float64)
    accuracies = []
    with torch.no_grad():
        for w in clf.path_.weights:
            logits = functional_call(clf.module_, clf.path_.unflatten(w), (X_t,))
            accuracies.append((F.log_softmax(logits, 1).argmax(1).numpy() == y).mean())
    return np.array(accuracies)


fits = {}
for name, labels in problems.items():
    y = labels[corner]
    start = time.perf_counter()
    clf = DistanceKernelClassifier(
        hidden_layer_sizes=(4,), solver="sgd", learning_rate=0.5, max_iter=60, random_state=0
    ).fit(X, y)
    fits[name] = (clf, y, accuracy_per_epoch(clf, X, y))
    print(
        f"{name}: training accuracy {clf.score(X, y):.3f} after {clf.n_iter_} epochs "
        f"({time.perf_counter() - start:.1f} s)"
    )

# %%
# Learning curves and memories
# ----------------------------
xx, yy = np.meshgrid(np.linspace(-0.5, 1.5, 150), np.linspace(-0.5, 1.5, 150))
grid = np.c_[xx.ravel(), yy.ravel()]
fig, axes = plt.subplots(2, 2, figsize=(10, 8.5))
for row, (name, (clf, y, accuracy)) in enumerate(fits.items()):
    ax = axes[row, 0]
    epochs = np.arange(len(accuracy))
    ax.plot(epochs, accuracy, color="tab:blue", label="accuracy")
    ax.set(xlabel="epoch", ylabel="training accuracy", ylim=(0, 1.05), title=f"{name}")
    ax_loss = ax.twinx()
    ax_loss.plot(
        np.arange(1, len(clf.loss_curve_) + 1), clf.loss_curve_, color="tab:red", label="loss"
    )
    ax_loss.set_ylabel("cross-entropy", color="tab:red")
    ax.legend(handles=ax.lines + ax_loss.lines, loc="center right")

    ax = axes[row, 1]
    regions = clf.predict(grid).reshape(xx.shape)
    ax.contourf(
        xx, yy, regions, levels=[-0.5, 0.5, 1.5], cmap=ListedColormap(["#deebf7", "#fee6ce"])
    )
    ax.scatter(X[:, 0], X[:, 1], c=np.array(["tab:blue", "tab:orange"])[y], s=10)
    memories = clf.module_[0].memories.detach().numpy()
    ax.scatter(
        memories[:, 0],
        memories[:, 1],
        marker="X",
        s=160,
        c="k",
        edgecolors="w",
        label="learned memories",
    )
    ax.set(
        xlim=(-0.5, 1.5),
        ylim=(-0.5, 1.5),
        aspect="equal",
        xlabel="$x_1$",
        ylabel="$x_2$",
        title=f"{name}: decision regions and memories",
    )
    ax.legend(loc="upper center", fontsize=8)
fig.tight_layout()
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=100, bbox_inches="tight")

# %%
# The distance network is a kernel machine too
# --------------------------------------------
clf, y, _ = fits["XOR"]
queries = corners + 0.05
parts = clf.decompose(queries)
error = np.abs(parts.bias + parts.contributions.sum(axis=1) + parts.decay - parts.output).max()
print(f"XOR: max |bias + sum of contributions - network| at 4 queries = {error:.1e}")
plt.show()
