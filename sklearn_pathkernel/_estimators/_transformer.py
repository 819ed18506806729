"""PathKernelTransformer: the learned kernel matrix as a pipeline step."""

import numpy as np
from sklearn.base import (
    BaseEstimator,
    ClassNamePrefixFeaturesOutMixin,
    TransformerMixin,
    _fit_context,
    clone,
)
from sklearn.utils._param_validation import HasMethods
from sklearn.utils.validation import check_is_fitted, validate_data

from ._base import BasePathEstimator


class PathKernelTransformer(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    """Exact path kernel features: the kernel between the data and the training points.

    A supervised transformer: :meth:`fit` trains a path estimator, classifier or
    regressor (a clone of ``estimator``), on ``X, y``; :meth:`transform` maps rows
    to their Exact Path Kernel against the training rows,
    ``estimator_.kernel_(X, X_fit_)``.
    Followed by ``SVC(kernel="precomputed")`` (or any estimator taking a
    precomputed kernel) it makes a kernel machine of the network's learned
    kernel whose settings a grid search can tune, e.g.
    ``epk__estimator__max_iter`` together with ``svc__C``.

    Which copy of input space a row is on follows
    :class:`ExactPathKernel`: a row equal to a training row is on the training
    copy (gradients at the start of each step), any other row on the test copy
    (gradients integrated along each step). So ``transform(X_fit_)`` equals
    ``fit_transform(X, y)``, the symmetric positive semi-definite training
    Gram, and the feature of a row does not depend on the other rows passed.

    Parameters
    ----------
    estimator : estimator object, default=None
        An estimator of this package with a path kernel (``kernel_``), e.g.
        :class:`ExactPathKernelClassifier`, :class:`ExactPathKernelRegressor` or
        :class:`DistanceKernelClassifier`, with any of its solvers. ``None`` uses
        ``ExactPathKernelClassifier(random_state=random_state)``. It is cloned,
        never fitted in place. Nested parameters work with the default too:
        ``set_params(estimator__max_iter=10)`` (as in a pipeline's
        ``epk__estimator__max_iter`` or a grid search over it) first sets
        ``estimator`` to that default classifier, then sets its parameter, and
        ``get_params(deep=True)`` lists the default's parameters.
    random_state : int, RandomState instance or None, default=None
        Seeds the default estimator (``estimator=None``); a given estimator keeps
        its own ``random_state``.

    Attributes
    ----------
    estimator_ : estimator object
        The fitted clone of ``estimator``.
    kernel_ : ExactPathKernel
        The learned kernel, ``estimator_.kernel_``.
    X_fit_ : ndarray of shape (n_samples_fit, n_features)
        The training rows (float64 copy): the columns of the output.
    n_features_in_ : int
        Number of features seen during fit.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names seen during fit, when X has string column names.

    See Also
    --------
    ExactPathKernel : The kernel object itself, for ``SVC(kernel=...)`` and
        Gaussian processes.
    sklearn.svm.SVC : With ``kernel="precomputed"``, the natural next step.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn.pipeline import make_pipeline
    >>> from sklearn.svm import SVC
    >>> from sklearn_pathkernel import ExactPathKernelClassifier, PathKernelTransformer
    >>> X, y = make_blobs(n_samples=40, centers=3, random_state=0)
    >>> net = ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=10, random_state=0)
    >>> PathKernelTransformer(net).fit_transform(X, y).shape
    (40, 40)
    >>> model = make_pipeline(PathKernelTransformer(net), SVC(kernel="precomputed"))
    >>> model.fit(X[:30], y[:30]).predict(X[30:]).shape
    (10,)
    """

    _parameter_constraints = {
        "estimator": [HasMethods(["fit"]), None],
        "random_state": ["random_state"],
    }

    def __init__(self, estimator=None, random_state=None):
        self.estimator = estimator
        self.random_state = random_state

    @staticmethod
    def _default_estimator(random_state):
        from ._classifier import ExactPathKernelClassifier

        return ExactPathKernelClassifier(random_state=random_state)

    def get_params(self, deep=True):
        """Get parameters for this estimator.

        With ``estimator=None`` and ``deep=True`` the default estimator's
        parameters are listed as ``estimator__<name>``, so that they can be
        found and tuned like those of a given estimator.

        Parameters
        ----------
        deep : bool, default=True
            Also return the parameters of the (default) estimator.

        Returns
        -------
        params : dict
            Parameter names mapped to their values.
        """
        params = super().get_params(deep=deep)
        if deep and self.estimator is None:
            default = self._default_estimator(self.random_state)
            params.update(
                (f"estimator__{name}", value) for name, value in default.get_params().items()
            )
        return params

    def set_params(self, **params):
        """Set the parameters of this estimator.

        A nested ``estimator__<name>`` while ``estimator`` is None first sets
        ``estimator`` to the default,
        ``ExactPathKernelClassifier(random_state=random_state)``.

        Parameters
        ----------
        **params : dict
            Estimator parameters, nested ones as ``estimator__<name>``.

        Returns
        -------
        self : PathKernelTransformer
            This transformer.
        """
        nested = any(key.startswith("estimator__") for key in params)
        if nested and params.get("estimator", self.estimator) is None:
            random_state = params.get("random_state", self.random_state)
            params = {**params, "estimator": self._default_estimator(random_state)}
        return super().set_params(**params)

    def _make_estimator(self):
        if self.estimator is None:
            return self._default_estimator(self.random_state)
        if not isinstance(self.estimator, BasePathEstimator):
            raise TypeError(
                "PathKernelTransformer needs an estimator with a path kernel (a kernel_ "
                "attribute), such as ExactPathKernelClassifier or ExactPathKernelRegressor; got "
                f"{type(self.estimator).__name__}."
            )
        return clone(self.estimator)

    @_fit_context(prefer_skip_nested_validation=False)
    def fit(self, X, y, **fit_params):
        """Train the path estimator on ``X, y`` and keep ``X`` as the columns.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training data.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            The estimator's targets: class labels, or values for a regressor
            (the kernel is learned by fitting them).
        **fit_params : dict
            Passed to ``estimator.fit`` (e.g. ``sample_weight``).

        Returns
        -------
        self : object
            The fitted transformer.
        """
        X, y = validate_data(self, X, y, dtype=np.float64, multi_output=True)
        estimator = self._make_estimator().fit(X, y, **fit_params)
        self.estimator_ = estimator
        self.X_fit_ = np.array(X, dtype=np.float64, copy=True)
        self._n_features_out = X.shape[0]
        return self

    def fit_transform(self, X, y, **fit_params):
        """Fit, then return the training Gram ``kernel_(X_fit_)``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training data.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            The estimator's targets: class labels, or values for a regressor.
        **fit_params : dict
            Passed to ``estimator.fit``.

        Returns
        -------
        K : ndarray of shape (n_samples, n_samples)
            The EPK between the training rows, all on the training copy:
            symmetric positive semi-definite.
        """
        self.fit(X, y, **fit_params)
        return self.kernel_(self.X_fit_)

    def transform(self, X):
        """The path kernel between the rows of ``X`` and the training rows.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Rows equal to a training row are on the training copy, others on the
            test copy.

        Returns
        -------
        K : ndarray of shape (n_samples, n_samples_fit)
            ``kernel_(X, X_fit_)``.
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return self.kernel_(X, self.X_fit_)

    @property
    def kernel_(self):
        """The learned :class:`ExactPathKernel` of ``estimator_``."""
        check_is_fitted(self)
        return self.estimator_.kernel_

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.required = True
        return tags
