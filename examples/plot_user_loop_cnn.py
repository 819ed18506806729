"""
==========================================================
The exact path kernel of your own PyTorch training loop
==========================================================

A small CNN is trained on scikit-learn's digits in an ordinary PyTorch loop: a
``DataLoader``, ``AdamW``, a cosine learning-rate schedule, float32. Two added lines
record it (:class:`~sklearn_pathkernel.TrainingRecorder` before the loop, and
``recorder.rows(rows)`` in it, naming the training rows of each batch). The recording
then writes the trained network's output on a test image exactly as a sum over the
training images, from which we read the most helpful and the most harmful ones.

The decomposed function is the network's own output (its logits). The kernel is
that of the recorded float32 run itself, computed in float64: every step anchored at
its recorded weights (the gradients recomputed there in float64, with the recorded
rows, output gradients, learning rates and Adam preconditioners), each step's float32
rounding an explicit term of the decay. The certificate compares the sum with the
float32 weights evaluated in float64, and the float32 network's own distance from
that evaluation is reported apart.
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
X_all = digits.data.astype(np.float32) / 16.0
X_train, X_test, y_train, y_test = train_test_split(
    X_all, digits.target, train_size=600, test_size=300, random_state=0, stratify=digits.target
)
X_train, X_test = torch.tensor(X_train), torch.tensor(X_test)
y_train = torch.tensor(y_train)

model = nn.Sequential(
    nn.Unflatten(1, (1, 8, 8)),
    nn.Conv2d(1, 8, 3),  # 8 x 6 x 6
    nn.Tanh(),
    nn.AvgPool2d(2),  # 8 x 3 x 3
    nn.Flatten(),
    nn.Linear(72, 10),
)
epochs = 10
loader = DataLoader(
    TensorDataset(X_train, y_train, torch.arange(len(y_train))), batch_size=50, shuffle=True
)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=1e-3)
schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(loader))

# %%
# The training loop
# -----------------
# An ordinary loop; the two recorder lines are marked.
start = time.perf_counter()
recorder = TrainingRecorder(model, optimizer, X_train)  # added line 1
for _epoch in range(epochs):
    for images, labels, rows in loader:
        optimizer.zero_grad()
        logits = model(images)
        recorder.rows(rows)  # added line 2
        F.cross_entropy(logits, labels).backward()
        optimizer.step()
        schedule.step()
recording = recorder.finish()
with torch.no_grad():
    accuracy = (model(X_test).argmax(1).numpy() == y_test).mean()
print(
    f"{recording.n_steps_} steps recorded in {time.perf_counter() - start:.1f} s, "
    f"{recording.nbytes / recording.n_steps_ / 1024:.1f} KiB per step; "
    f"test accuracy {accuracy:.2f}"
)

# %%
# One test image, explained
# -------------------------
# ``decompose`` returns, for each training image, what it added to each logit over the
# whole run (through Adam's moments and preconditioner, as the run itself did).
# The float32 optimiser rounds each of its updates: the recording anchors every step at
# its recorded float32 weights (on the first ``decompose``), the gradients recomputed
# there in float64, and keeps each step's rounding as a term of ``decay`` (what no
# training image moved). The sum then equals the float32 weights' output evaluated in
# float64 to about 1e-14; the float32 network's own forward pass differs from that
# evaluation by its rounding (``model_gap``). A float64 model is decomposed as trained.
start = time.perf_counter()
query = X_test[:1]
parts = recording.decompose(query)
print(f"decomposition in {time.perf_counter() - start:.1f} s")
predicted = int(parts.output[0].argmax())
print(f"prediction {predicted} (true {y_test[0]})")
print(f"certificate (sum vs the float32 weights in float64): {parts.residual[0]:.1e}")
print(f"  of which the quadrature's bound: {parts.quadrature_error[0]:.1e}")
print(f"float32 forward pass vs its float64 evaluation: {parts.model_gap[0]:.1e}")

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
