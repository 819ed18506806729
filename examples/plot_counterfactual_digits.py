"""
=========================================================
What made a wrong digit, and what would undo it
=========================================================

Two questions about the training images behind a wrong prediction:

- *what did each image contribute in this run?* The exact contributions
  (``explain(X)``) add up to the network's output;
- *what would the prediction be without that image?* The counterfactual scores
  (``explain(X, method="counterfactual")``, ``counterfactual(X)``) are the derivative of
  the output with respect to each image's sample weight, through the whole run: every
  later step reacts to the image's earlier pull.

The second is checked against real retraining: the model is fitted again without the
top counterfactual proponent (its sample weight 0, same seed and batch order) and the
prediction moves as the first-order estimate says.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np
from sklearn.base import clone
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
wrong = np.flatnonzero(clf.predict(X_test) != y_test)
query = X_test[wrong[:1]]
predicted = clf.predict(query)[0]
print(f"test image {wrong[0]}: a {y_test[wrong[0]]}, predicted {predicted}")

# %%
# What each training image contributed in this run
# ------------------------------------------------
clf.explain(query, k=6).plot(0, image_shape=(8, 8))

# %%
# What removing each training image would change
# ----------------------------------------------
# The proponents are the images whose removal would lower the predicted class's
# log-probability most.
clf.explain(query, k=6, method="counterfactual").plot(0, image_shape=(8, 8))

# %%
# Checked by retraining without the strongest counterfactual proponent
# ---------------------------------------------------------------------
column = int(np.searchsorted(clf.classes_, predicted))
found = clf.counterfactual(query, output=column)
top = int(found.top(1)[0][0, 0])
weights = np.ones(len(y_train))
weights[top] = 0.0
refit = clone(clf).fit(X_train, y_train, sample_weight=weights)
print(f"log p({predicted}) now {found.values[0]:.3f}")
print(f"  estimated without image {top}: {found.loo_predictions()[0, top]:.3f}")
print(f"  retrained without image {top}: {refit.predict_log_proba(query)[0, column]:.3f}")
print(f"growth of the pulled-back gradient along the run: {found.growth[0]:.2f}")
plt.show()
