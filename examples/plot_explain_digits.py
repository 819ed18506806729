"""
=====================================================
Explaining a wrong digit by the training images
=====================================================

A small network trained on scikit-learn's digits gets a test image wrong. Which
training images made it say what it said? Because the network's output is exactly
the initial network's plus one contribution per training point
(:meth:`~sklearn_pathkernel.ExactPathKernelClassifier.decompose`), the question has an
exact answer:

- :meth:`~sklearn_pathkernel.ExactPathKernelClassifier.explain` ranks the training
  images by what they added to the predicted class's log-probability: the
  proponents raised it most, the opponents lowered it most;
- :meth:`~sklearn_pathkernel.ExactPathKernelClassifier.explain_over_time` splits
  each contribution over the epochs of training, here summed per class;
- :meth:`~sklearn_pathkernel.ExactPathKernelClassifier.self_influence` scores each
  training image by what it added to its own label: images the network had to
  memorise, such as wrong labels, score high.
"""

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from sklearn_pathkernel import ExactPathKernelClassifier

X, y = load_digits(return_X_y=True)
X_train, X_test, y_train, y_test = train_test_split(
    X / 16.0, y, train_size=500, test_size=300, stratify=y, random_state=0
)
clf = ExactPathKernelClassifier(
    hidden_layer_sizes=(32,), batch_size=50, max_iter=20, learning_rate=0.2, random_state=0
).fit(X_train, y_train)
print(f"test accuracy {clf.score(X_test, y_test):.3f}")

wrong = np.flatnonzero(clf.predict(X_test) != y_test)
query = X_test[wrong[:1]]
print(f"test image {wrong[0]}: a {y_test[wrong[0]]}, predicted {clf.predict(query)[0]}")

# %%
# The top proponents and opponents of the prediction
# --------------------------------------------------
# ``explain`` keeps the ``k`` strongest training images per output; ``plot`` with
# ``image_shape`` draws the query beside them (red: proponents, blue: opponents,
# with each image's label and contribution).
start = time.perf_counter()
explanation = clf.explain(query, k=6)
print(f"explained in {time.perf_counter() - start:.2f} s")
explanation.plot(0, image_shape=(8, 8))
frame = explanation.to_frame()
predicted = str(clf.predict(query)[0])
print(frame[frame["output"] == predicted].head(6).to_string(index=False))

# %%
# When in training did each class push?
# -------------------------------------
# The contributions to the predicted class, split over the epochs and summed over
# the training images of each class; the black line is their running total. The
# per-epoch terms add up exactly to the contributions.
over_time = clf.explain_over_time(query, period="epoch", by_class=True)
column = int(np.searchsorted(clf.classes_, clf.predict(query)[0]))
contributions = clf.decompose(query).contributions
per_class = np.array([contributions[0, y_train == c, column].sum() for c in clf.classes_])
print(
    "epochs sum to the contributions: max |difference| = "
    f"{np.abs(over_time.values[0].sum(axis=0)[:, column] - per_class).max():.1e}"
)
over_time.plot(0, output=column, top=4)
plt.title(f"contributions to class {predicted}, per epoch and class")

# %%
# Finding wrong labels by self-influence
# --------------------------------------
# Flip 10 % of the training labels, train again, and rank the training images by
# their contribution to their own (possibly wrong) label. The curve is the share
# of flipped labels found against the share of the training set inspected.
rng = np.random.RandomState(0)
flipped = np.zeros(y_train.size, dtype=bool)
flipped[rng.choice(y_train.size, y_train.size // 10, replace=False)] = True
noisy = y_train.copy()
noisy[flipped] = (y_train[flipped] + rng.randint(1, 10, flipped.sum())) % 10
noisy_clf = ExactPathKernelClassifier(**clf.get_params()).fit(X_train, noisy)
start = time.perf_counter()
influence = noisy_clf.self_influence()
print(f"self-influence of {y_train.size} training images in {time.perf_counter() - start:.1f} s")
print(
    f"AUC {influence.auc(flipped):.3f}; flipped labels found in the top 10 %: "
    f"{influence.found_at(flipped, 0.1):.0%}, top 20 %: {influence.found_at(flipped, 0.2):.0%}"
)
influence.plot(flipped)
plt.show()
