"""
===========================================================
A BatchNorm CNN trained in your own loop, explained exactly
===========================================================

A small convolutional network with a ``BatchNorm2d`` layer is trained on
scikit-learn's digits in an ordinary PyTorch loop, BatchNorm in training mode (the
default): each batch is normalised by its own mean and variance, and the running
statistics the trained network uses in eval mode are averaged along the way. Two added
lines record the loop (:class:`~sklearn_pathkernel.TrainingRecorder` before it, and
``recorder.rows(rows)`` in it).

Two things make BatchNorm different from a per-row layer, and both are represented
exactly:

- a training row's gradient depends on the other rows of its batch (through the batch
  statistics). The step's gradient is still the sum of the rows' gradients, each
  taken through the batch's pass, so the weights' move splits over the rows;
- the running statistics move by averaging, not by gradient. Their move is itself a
  sum over the batch's rows (each row's share of the new mean and variance), and is
  integrated along the step together with the weights: a term of each row's
  contribution of its own (``statistics``).

The decomposed function is the trained network in eval mode (running statistics), and
the certificate compares the sum of the contributions with that network's own output.
See :ref:`batchnorm_kernel` for the formulas, and for what is not available when rows
are coupled through a batch (Gram matrices, self-influence).
"""

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sklearn_pathkernel import TrainingRecorder

torch.manual_seed(0)
torch.set_num_threads(1)
digits = load_digits()
X_all = digits.data / 16.0
X_train, X_test, y_train, y_test = train_test_split(
    X_all, digits.target, train_size=400, test_size=200, random_state=0, stratify=digits.target
)
X_train, X_test = torch.tensor(X_train), torch.tensor(X_test)  # float64
y_train = torch.tensor(y_train)

model = nn.Sequential(
    nn.Unflatten(1, (1, 8, 8)),
    nn.Conv2d(1, 8, 3, bias=False),  # 8 x 6 x 6 (no bias: BatchNorm removes it)
    nn.BatchNorm2d(8),
    nn.ReLU(),
    nn.AvgPool2d(2),  # 8 x 3 x 3
    nn.Flatten(),
    nn.Linear(72, 10),
).double()
loader = DataLoader(
    TensorDataset(X_train, y_train, torch.arange(len(y_train))),
    batch_size=50,
    shuffle=True,
    drop_last=True,  # (a batch of one row has no variance)
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

# %%
# The training loop
# -----------------
# An ordinary loop, BatchNorm in training mode; the two recorder lines are marked.
start = time.perf_counter()
recorder = TrainingRecorder(model, optimizer, X_train)  # added line 1
model.train()
for _epoch in range(4):
    for images, labels, rows in loader:
        optimizer.zero_grad()
        logits = model(images)
        recorder.rows(rows)  # added line 2
        F.cross_entropy(logits, labels).backward()
        optimizer.step()
model.eval()  # the trained network: running statistics
recording = recorder.finish()
with torch.no_grad():
    accuracy = (model(X_test).argmax(1).numpy() == y_test).mean()
print(
    f"{recording.n_steps_} steps recorded in {time.perf_counter() - start:.1f} s; "
    f"test accuracy {accuracy:.2f}"
)
stats = recording.path_.running_statistics
print(
    f"running statistics followed: {stats.n_statistics} numbers per step, "
    f"{stats.shares[0].shape[1]} per row and step for its share of their move"
)

# %%
# One test image, explained
# -------------------------
# ``decompose`` returns, for each training image, what it added to each logit over the
# whole run: through its gradients (taken through its batches' statistics, and carried
# by momentum to the later steps) and through its shares of the running statistics'
# moves. ``statistics`` is the second part alone.
start = time.perf_counter()
query = X_test[:1]
parts = recording.decompose(query)
print(f"decomposition in {time.perf_counter() - start:.1f} s")
predicted = int(parts.output[0].argmax())
print(f"prediction {predicted} (true {y_test[0]})")
print(f"certificate (sum vs the eval-mode network): {parts.residual[0]:.1e}")
print(f"  of which the quadrature's bound: {parts.quadrature_error[0]:.1e}")
through_statistics = parts.statistics[0, :, predicted].sum()
total = parts.contributions[0, :, predicted].sum()
print(
    f"logit {predicted} moved by {total:+.3f} over training, {through_statistics:+.3f} "
    "of it through the running statistics"
)

contributions = parts.contributions[0, :, predicted]
helpful = np.argsort(-contributions)[:5]
harmful = np.argsort(contributions)[:5]
print("most helpful:", helpful, np.round(contributions[helpful], 3))
print("most harmful:", harmful, np.round(contributions[harmful], 3))

fig, axes = plt.subplots(2, 6, figsize=(10, 4))
for row, (title, chosen) in enumerate([("helpful", helpful), ("harmful", harmful)]):
    axes[row, 0].imshow(query[0].reshape(8, 8), cmap="gray_r")
    axes[row, 0].set_title(f"test image\npredicted {predicted}", fontsize=9)
    for col, index in enumerate(chosen, start=1):
        axes[row, col].imshow(X_train[index].reshape(8, 8), cmap="gray_r")
        axes[row, col].set_title(
            f"{title}: label {int(y_train[index])}\n{contributions[index]:+.3f}", fontsize=9
        )
for ax in axes.ravel():
    ax.set_axis_off()
fig.tight_layout()
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=90, bbox_inches="tight")
plt.show()
