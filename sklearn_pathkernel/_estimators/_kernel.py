"""ExactPathKernel: the learned path kernel as a scikit-learn ``Kernel``.

The EPK has two copies of input space (user guide, "The Exact Path Kernel"): a
training point is seen through its gradient at the start of each step, any other point through its
gradient integrated along the step. A kernel object is only given arrays, so
the copy is decided per row: a row equal to a training row is on the training
copy, every other row on the test copy. Deciding per row (not per argument)
keeps ``kernel(A, B)`` invariant to the order and to subsets of the rows, and
gives one feature map for a Gaussian process' fit and predict.
"""

import copy
import hashlib
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch
from sklearn.gaussian_process.kernels import Kernel
from sklearn.utils.validation import check_array

OUTPUTS = ("trace", "full")
# Results kept per engine: GaussianProcessRegressor recomputes kernel(X_train)
# at every optimiser step and GaussianProcessClassifier once per class.
CACHE_ENTRIES = 8
CACHE_MAX_BYTES = 2**27


class _EngineMemo:
    """What every kernel of one engine shares: training-row lookup and recent results."""

    def __init__(self, engine):
        X_train = _canonical(engine.X_train.detach().cpu().numpy().reshape(engine.n_train, -1))
        self.train_rows = {row.tobytes() for row in X_train}
        self.n_features = X_train.shape[1]
        self.results = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            value = self.results.get(key)
            if value is not None:
                self.results.move_to_end(key)
            return value

    def put(self, key, value):
        if value.nbytes > CACHE_MAX_BYTES:
            return
        with self.lock:
            self.results[key] = value
            while len(self.results) > CACHE_ENTRIES:
                self.results.popitem(last=False)


_MEMOS = weakref.WeakKeyDictionary()
_MEMOS_LOCK = threading.Lock()


def _memo(engine):
    with _MEMOS_LOCK:
        memo = _MEMOS.get(engine)
        if memo is None:
            memo = _MEMOS[engine] = _EngineMemo(engine)
        return memo


def _canonical(X):
    """A contiguous float64 copy with -0.0 made 0.0, so equal rows have equal bytes."""
    return np.ascontiguousarray(X, dtype=np.float64) + 0.0


def _digest(*arrays):
    h = hashlib.blake2b(digest_size=20)
    for a in arrays:
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.digest()


class ExactPathKernel(Kernel):
    """The Exact Path Kernel of a trained network.

    The kernel a fitted path estimator (e.g. :class:`ExactPathKernelClassifier`
    or :class:`ExactPathKernelRegressor`) has learned, as a
    :class:`sklearn.gaussian_process.kernels.Kernel`: use it in
    ``SVC(kernel=clf.kernel_)``, ``GaussianProcessClassifier(kernel=clf.kernel_)``
    or ``GaussianProcessRegressor(kernel=ConstantKernel() * clf.kernel_)``.
    Get it from the classifier's ``kernel_`` attribute rather than building it.

    ``k(x, x') = sum_s sum_k <phi_s(x)_k, P_s * phi_s(x')_k>`` sums over the
    training steps ``s`` and the outputs ``k`` of the network's output ``f``
    (log-probabilities of the classes for the cross-entropy), with ``P_s`` the
    run's elementwise preconditioner of step ``s`` (Adam's; ones for gradient
    descent, momentum and Nesterov; user guide, "Optimisers"). **Which
    copy a row is on** (the paper's two copies of input space, made explicit):
    a row equal to a training row (bitwise after conversion to float64, with
    ``-0.0 == 0.0``) is on the *training copy*, ``phi_s(x_i) = grad_w f(x_i; w_s)``
    at the start of each step; every other row is on the *test copy*,
    ``phi_s(x) = int_0^1 grad_w f(x; w_s(t)) dt`` along each step (two rows on
    the test copy share ``t``: ``int_0^1 <g(x; t), g(x'; t)> dt``). The rule is
    per row, so ``k(A, B)`` does not depend on the order of the rows or on
    which other rows are passed, and any matrix ``k(X)`` is a Gram matrix of
    these features: symmetric positive semi-definite. Consequently a training
    point moved by ``1e-12`` is on the test copy and gets a different kernel row.

    The kernel has no hyperparameters (``theta`` is empty): scale it with
    :class:`~sklearn.gaussian_process.kernels.ConstantKernel` if needed.

    Parameters
    ----------
    engine : PathKernelEngine
        The fitted kernel engine of an estimator's training path (immutable;
        shared, never copied, by :func:`~sklearn.base.clone` and
        :func:`copy.deepcopy`).
    output : {"trace", "full"}, default="trace"
        ``"trace"`` sums over matching outputs: ``k(A, B)`` has shape
        ``(n_A, n_B)``, as every scikit-learn consumer expects. ``"full"`` keeps
        every output pair ``(k, k')``: shape ``(n_A, n_B, K, K)``, for analysis
        only (SVC and Gaussian processes need ``"trace"``).

    Attributes
    ----------
    n_features_in_ : int
        Number of features of the training data (and of every argument).

    See Also
    --------
    ExactPathKernelClassifier : The network whose kernel this is.
    PathKernelTransformer : The kernel matrix as a pipeline step.

    Notes
    -----
    Recent results (per engine, at most 8, each under 128 MiB) are memoised, so
    the repeated ``k(X_train)`` of a Gaussian process' optimiser and of its
    one-vs-rest classes is computed once. Returned arrays are always fresh copies.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn.svm import SVC
    >>> from sklearn_pathkernel import ExactPathKernelClassifier
    >>> X, y = make_blobs(n_samples=30, centers=3, random_state=0)
    >>> clf = ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=10,
    ...                                 random_state=0).fit(X, y)
    >>> kernel = clf.kernel_
    >>> kernel(X).shape                 # training rows: the training-copy Gram
    (30, 30)
    >>> kernel(X[:2] + 0.5, X).shape    # new rows: test copy
    (2, 30)
    >>> svc = SVC(kernel=kernel).fit(X, y)
    """

    def __init__(self, engine, output="trace"):
        self.engine = engine
        self.output = output

    # -- sharing the engine ----------------------------------------------------

    def __sklearn_clone__(self):
        # GaussianProcessClassifier clones the kernel once per class: never copy the engine.
        return type(self)(self.engine, output=self.output)

    def __deepcopy__(self, memo):
        return type(self)(self.engine, output=copy.deepcopy(self.output, memo))

    def __eq__(self, other):
        return (
            type(self) is type(other)
            and self.engine is other.engine
            and self.output == other.output
        )

    def __hash__(self):
        return hash((type(self), id(self.engine), self.output))

    def __repr__(self):
        engine = self.engine
        try:
            details = (
                f"n_train={engine.n_train}, n_outputs={engine.n_outputs}, "
                f"n_steps={engine.path.n_steps}, quadrature={engine.quadrature!r}"
            )
        except AttributeError:
            details = type(engine).__name__
        output = "" if self.output == "trace" else f", output={self.output!r}"
        return f"{type(self).__name__}({details}{output})"

    # -- kernel API --------------------------------------------------------------

    @property
    def requires_vector_input(self):
        """True: rows are feature vectors (their values decide the copy)."""
        return True

    def is_stationary(self):
        """False: the kernel depends on where the points are, not on ``x - x'``."""
        return False

    @property
    def n_features_in_(self):
        return _memo(self.engine).n_features

    def __call__(self, X, Y=None, eval_gradient=False):
        """The kernel matrix ``k(X, Y)``.

        Parameters
        ----------
        X : array-like of shape (n_samples_X, n_features)
            Rows equal to a training row are on the training copy, the others on
            the test copy.
        Y : array-like of shape (n_samples_Y, n_features), default=None
            Same rule. ``None`` means ``Y = X`` (the result is then exactly
            symmetric).
        eval_gradient : bool, default=False
            Also return the gradient with respect to the (log) hyperparameters;
            the kernel has none, so it is an empty ``(n_samples_X, n_samples_X, 0)``
            array. Only with ``Y=None``.

        Returns
        -------
        K : ndarray of shape (n_samples_X, n_samples_Y)
            With ``output="full"``: shape (n_samples_X, n_samples_Y, K, K).
        K_gradient : ndarray of shape (n_samples_X, n_samples_X, 0)
            Only when ``eval_gradient`` is True.
        """
        if eval_gradient and Y is not None:
            raise ValueError("Gradient can only be evaluated when Y is None.")
        self._check_output()
        X = self._validate(X, "X")
        if Y is not None:
            Y = self._validate(Y, "Y")
            if Y.shape == X.shape and np.array_equal(X, Y):
                Y = None  # same rows: the exactly symmetric computation
        key = ("gram", self.output, _digest(X) if Y is None else _digest(X, Y))
        K = self._memoised(key, lambda: self._gram(X, Y))
        if eval_gradient:
            return K, np.empty((X.shape[0], X.shape[0], 0))
        return K

    def diag(self, X):
        """The self-similarities ``k(x, x)``, equal to ``np.diag(self(X))``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Same per-row copy rule as :meth:`__call__`.

        Returns
        -------
        K_diag : ndarray of shape (n_samples,)
            With ``output="full"``: shape (n_samples, K, K) (computed from the
            full matrix ``self(X)``).
        """
        self._check_output()
        X = self._validate(X, "X")
        return self._memoised(("diag", self.output, _digest(X)), lambda: self._diag(X))

    # -- internals ---------------------------------------------------------------

    def _check_output(self):
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {self.output!r}.")

    def _validate(self, X, name):
        X = check_array(X, dtype=np.float64, ensure_all_finite=True, input_name=name)
        n_features = self.n_features_in_
        if X.shape[1] != n_features:
            raise ValueError(
                f"{name} has {X.shape[1]} features, but the path kernel was learned "
                f"on data with {n_features} features."
            )
        return _canonical(X)

    def _on_train_copy(self, X):
        train_rows = _memo(self.engine).train_rows
        return np.fromiter((row.tobytes() in train_rows for row in X), bool, X.shape[0])

    def _tensor(self, X):
        # A copy shaped like the training inputs (a fresh tensor: user memory never
        # shared), on the engine's device; results come back as numpy arrays.
        X_train = self.engine.X_train
        tensor = torch.tensor(X, dtype=torch.float64, device=X_train.device)
        return tensor.reshape((X.shape[0],) + tuple(X_train.shape[1:]))

    def _gram(self, X, Y):
        engine = self.engine
        if Y is None:
            return engine.gram(self._tensor(X), a_train=self._on_train_copy(X), output=self.output)
        return engine.gram(
            self._tensor(X),
            self._tensor(Y),
            a_train=self._on_train_copy(X),
            b_train=self._on_train_copy(Y),
            output=self.output,
        )

    def _diag(self, X):
        if self.output == "full":
            full = self._gram(X, None)
            return np.ascontiguousarray(np.einsum("iikl->ikl", full))
        return self.engine.diag(self._tensor(X), a_train=self._on_train_copy(X))

    def _memoised(self, key, compute):
        memo = _memo(self.engine)
        value = memo.get(key)
        if value is None:
            value = np.asarray(compute(), dtype=np.float64)
            memo.put(key, value)
        # Callers may write into the result (GaussianProcessRegressor adds alpha in place).
        return value.copy()
