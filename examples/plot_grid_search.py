"""
=====================================================================
Grid search over a learned-kernel SVM pipeline
=====================================================================

:class:`~sklearn_pathkernel.PathKernelTransformer` turns a path-kernel classifier into
a pipeline step whose output is the Exact Path Kernel: ``fit_transform`` trains the
network and returns the training Gram matrix, ``transform`` the kernel between new rows
(on the test copy) and the training rows. Followed by ``SVC(kernel="precomputed")`` it
is an SVM whose kernel is learned by a network, and
:class:`~sklearn.model_selection.GridSearchCV` tunes the network and the SVM together,
with parameter names such as ``epk__estimator__max_iter``.
"""

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import make_moons
from sklearn.model_selection import GridSearchCV, train_test_split
from sklearn.pipeline import Pipeline
from sklearn.svm import SVC

from sklearn_pathkernel import ExactPathKernelClassifier, PathKernelTransformer

X, y = make_moons(n_samples=150, noise=0.25, random_state=0)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=50, random_state=0)

pipe = Pipeline(
    [
        (
            "epk",
            PathKernelTransformer(
                ExactPathKernelClassifier(
                    hidden_layer_sizes=(16,), learning_rate=0.5, random_state=0
                )
            ),
        ),
        ("svc", SVC(kernel="precomputed")),
    ]
)
param_grid = {"epk__estimator__max_iter": [2, 10, 30], "svc__C": [0.1, 10.0]}

start = time.perf_counter()
search = GridSearchCV(pipe, param_grid, cv=3).fit(X_train, y_train)
print(
    f"grid search ({len(search.cv_results_['params'])} candidates x 3 folds): "
    f"{time.perf_counter() - start:.1f} s"
)
print(f"best parameters: {search.best_params_}, CV accuracy {search.best_score_:.3f}")
print(f"test accuracy of the refitted pipeline: {search.score(X_test, y_test):.3f}")
network = search.best_estimator_.named_steps["epk"].estimator_
print(f"the best pipeline's own network, test accuracy: {network.score(X_test, y_test):.3f}")

# %%
# Mean cross-validated accuracy of every candidate
# -------------------------------------------------
scores = search.cv_results_["mean_test_score"].reshape(
    len(param_grid["epk__estimator__max_iter"]), len(param_grid["svc__C"])
)
fig, ax = plt.subplots(figsize=(5, 4))
image = ax.imshow(scores, cmap="viridis", vmin=0.5, vmax=1.0)
for (i, j), value in np.ndenumerate(scores):
    ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="w" if value < 0.8 else "k")
ax.set(
    xticks=range(len(param_grid["svc__C"])),
    xticklabels=param_grid["svc__C"],
    yticks=range(len(param_grid["epk__estimator__max_iter"])),
    yticklabels=param_grid["epk__estimator__max_iter"],
    xlabel="svc__C",
    ylabel="epk__estimator__max_iter (gradient steps)",
    title="Mean CV accuracy",
)
fig.colorbar(image, ax=ax)
if "__file__" in globals():  # run as a script; sphinx-gallery keeps its own copy
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=100, bbox_inches="tight")
plt.show()
