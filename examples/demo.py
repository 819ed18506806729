"""A one-minute tour of sklearn_pathkernel (the README's main command).

Fits a network on scikit-learn's iris data, checks that it is exactly a kernel
machine over its training points, reuses its learned kernel in an SVM and a
Gaussian process, and saves a figure next to this script (demo.png).
"""

import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_iris
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

from sklearn_pathkernel import ExactPathKernelClassifier

start = time.perf_counter()
X, y = load_iris(return_X_y=True)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.3, stratify=y, random_state=0)
scaler = StandardScaler().fit(X_train)
X_train, X_test = scaler.transform(X_train), scaler.transform(X_test)

# 1. A ReLU network trained by full-batch gradient descent, its weight path recorded.
clf = ExactPathKernelClassifier(
    hidden_layer_sizes=(16,), learning_rate=0.2, max_iter=30, random_state=0
).fit(X_train, y_train)
print(f"network: {clf.n_steps_} gradient steps, test accuracy {clf.score(X_test, y_test):.3f}")

# 2. The exact decomposition: initial network + one contribution per training point.
parts = clf.decompose(X_test)
kernel_machine = parts.bias + parts.contributions.sum(axis=1) + parts.decay
error = np.abs(kernel_machine - clf.predict_log_proba(X_test)).max()
print(
    f"kernel machine vs network on {len(X_test)} test points: max |difference| = {error:.1e} "
    f"(certificate {parts.residual.max():.1e})"
)

# 3. The learned kernel in an SVM (coefficients refitted) and in a Gaussian process.
K_train = clf.kernel_(X_train)  # training copy: symmetric positive semi-definite
K_test = clf.kernel_(X_test, X_train)  # test rows on the test copy
svc = SVC(kernel="precomputed", C=10.0).fit(K_train, y_train)
print(f"SVC on the learned kernel: test accuracy {svc.score(K_test, y_test):.3f}")

Y_train = np.eye(3)[y_train]
gp = GaussianProcessRegressor(
    kernel=clf.kernel_, alpha=1e-2 * K_train.diagonal().mean(), optimizer=None, normalize_y=False
).fit(X_train, Y_train)
mean, std = gp.predict(X_test, return_std=True)  # std: (n, 3), equal columns
prior_std = np.sqrt(clf.kernel_.diag(X_test))
print(
    f"GP on the learned kernel: test accuracy {(mean.argmax(1) == y_test).mean():.3f}, "
    f"posterior std / prior std {np.median(std[:, 0] / prior_std):.3f} (median)"
)

# 4. A figure: the training Gram matrix and the kernel machine against the network.
order = np.argsort(y_train, kind="stable")
fig, (ax_gram, ax_fit) = plt.subplots(1, 2, figsize=(10, 4.3))
image = ax_gram.imshow(K_train[np.ix_(order, order)], cmap="viridis")
fig.colorbar(image, ax=ax_gram, shrink=0.85)
ax_gram.set(
    title="EPK training Gram (sorted by class)", xlabel="training point", ylabel="training point"
)
network = clf.predict_log_proba(X_test)
for k, color in enumerate(["tab:blue", "tab:orange", "tab:green"]):
    ax_fit.scatter(network[:, k], kernel_machine[:, k], s=14, color=color, label=f"class {k}")
lims = [network.min() - 0.3, 0.2]
ax_fit.plot(lims, lims, "k--", lw=0.8)
ax_fit.set(
    xlim=lims,
    ylim=lims,
    xlabel="network log-probability",
    ylabel="kernel machine log-probability",
    title=f"Kernel machine vs network (max diff {error:.0e})",
)
ax_fit.legend()
fig.tight_layout()
path = Path(__file__).with_name("demo.png")
fig.savefig(path, dpi=100, bbox_inches="tight")
print(f"figure saved to {path}; total {time.perf_counter() - start:.1f} s")
