"""
=====================================================
Convolutional distance network on digits, explained
=====================================================

A :class:`~sklearn_pathkernel.DistanceKernelClassifier` with ``image_shape=(8, 8)``
starts with a :class:`~sklearn_pathkernel.DistanceConv2d` layer: every 3x3 patch
of a digit (padded by one pixel) is compared with 16 learned patch "memories"
(mean squared difference); per memory, each 2x2 window of positions keeps its
best match, the smallest distance (a min-pool: small shifts of a stroke do not
change it), and a linear head reads the pooled distance maps. The memories start on
training patches (k-means++ seeding) and are trained with the rest of the network.

The network is also an exact kernel machine: its output for a test digit is a
bias plus one contribution per training image (``decompose``), and the
contributions add up to the output to rounding error. Below, the learned memories
drawn as 3x3 images, then one test digit and the training images that push its
predicted class up the most and down the most.
"""

import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_digits

from sklearn_pathkernel import DistanceKernelClassifier

X, y = load_digits(return_X_y=True)
X = X / 16.0
X_train, y_train, X_test, y_test = X[:300], y[:300], X[300:], y[300:]

clf = DistanceKernelClassifier(
    image_shape=(8, 8),  # the default conv_layers: ((16, 3, 1, 1, 2),)
    hidden_layer_sizes=(),
    max_iter=60,
    random_state=0,
).fit(X_train, y_train)
print(f"test accuracy on {len(y_test)} digits: {clf.score(X_test, y_test):.3f}")

# %%
# The learned memories
# --------------------
# ``module_[1]`` is the convolutional distance layer; ``memory_images`` views its
# memories as (16, 1, 3, 3) patches.
memories = clf.module_[1].memory_images.detach().numpy()[:, 0]
fig, axes = plt.subplots(2, 8, figsize=(8, 2.4))
for ax, memory in zip(axes.ravel(), memories, strict=True):
    ax.imshow(memory, cmap="gray_r", vmin=0, vmax=1)
    ax.set_axis_off()
fig.suptitle("16 learned 3x3 patch memories")

# %%
# One digit explained by its training images
# ------------------------------------------
# ``decompose`` gives, per training image, its exact contribution to each output
# (log-probability); bias + contributions = output.
digit = X_test[:1]
parts = clf.decompose(digit)
k = int(np.argmax(parts.output[0]))
print(f"predicted {clf.classes_[k]}, true {y_test[0]}")
print(
    "sum identity error:",
    np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max(),
)
contributions = parts.contributions[0, :, k]
order = np.argsort(contributions)
picks = list(order[::-1][:5]) + list(order[:5])
fig, axes = plt.subplots(1, 11, figsize=(11, 1.9))
axes[0].imshow(digit.reshape(8, 8), cmap="gray_r")
axes[0].set_title("test digit", fontsize=8)
for ax, index in zip(axes[1:], picks, strict=True):
    ax.imshow(X_train[index].reshape(8, 8), cmap="gray_r")
    ax.set_title(f"{y_train[index]}: {contributions[index]:+.3f}", fontsize=8)
for ax in axes:
    ax.set_axis_off()
fig.suptitle(f"contributions to class {clf.classes_[k]}: 5 largest, 5 smallest")
plt.show()
