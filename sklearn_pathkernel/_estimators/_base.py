"""What the PyTorch estimators share: validation, training, the path-kernel
accessors (``kernel_``, ``decompose``), and the classifier and regressor bases.

:class:`BasePathEstimator` trains ``f = link(module(x))`` on a loss (see
``_losses``); the two bases add what differs: the targets (class codes and
``classes_``, or numeric outputs), the loss, and the predictions.
"""

import os
from abc import abstractmethod
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, _fit_context
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import _check_sample_weight, check_is_fitted, validate_data

from .._engine import (
    CPU,
    PathKernelEngine,
    as_tensor,
    checked_against,
    checked_for_targets,
    loadable_device,
    on_host,
    resolve_device,
    target_values,
)
from .._explain import ExplanationMixin, decomposition_targets
from .._training import (
    CLASSIFICATION_LOSSES,
    REGRESSION_LOSSES,
    Float64Run,
    SolverSettings,
    check_module,
    float64_run,
    solver_constraints,
    train_module,
)
from ._explanation_context import estimator_context

DTYPE = torch.float64
#: The ``dtype`` parameter's values: the dtype the network is trained in.
TRAINING_DTYPES = {"float64": torch.float64, "float32": torch.float32}
# Attributes validate_data(reset=True) sets on the estimator.
_VALIDATION_ATTRS = ("n_features_in_", "feature_names_in_")


@dataclass
class Targets:
    """Validated training targets, as :meth:`BasePathEstimator._targets` returns them.

    Attributes
    ----------
    values : ndarray
        What the loss takes: class codes (n,) or outputs (n, n_outputs).
    n_outputs : int
        Width of the module's output.
    attributes : dict
        Fitted attributes to set once training succeeded (e.g. ``classes_``).
    """

    values: np.ndarray
    n_outputs: int
    attributes: dict = field(default_factory=dict)


class BasePathEstimator(ExplanationMixin, BaseEstimator):
    """Base class: a torch module trained by gradient descent, path recorded.

    Subclasses name their loss registry (``_losses``), validate the targets
    (:meth:`_targets`), implement :meth:`_build_module` and list their own
    parameters, ``loss`` among them.
    """

    #: The losses the ``loss`` parameter names (a registry of ``_training``).
    _losses = None
    #: ``validate_data`` settings for ``y``.
    _target_validation = {}

    _parameter_constraints = {
        "learning_rate": [Interval(Real, 0, None, closed="neither"), callable],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "batch_size": [Interval(Integral, 1, None, closed="left"), None],
        **solver_constraints(),
        "shuffle": ["boolean"],
        "tol": [Interval(Real, 0, None, closed="left"), None],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "quadrature": [StrOptions({"exact", "riemann", "dpk"})],
        "n_points": [Interval(Integral, 1, None, closed="left")],
        "n_jobs": [Integral, None],
        "step_chunks": [Interval(Integral, 1, None, closed="left"), None],
        "path_storage": [StrOptions({"memory", "disk"}), str, os.PathLike],
        "dtype": [StrOptions(set(TRAINING_DTYPES))],
        "device": [str, torch.device],
        "random_state": ["random_state"],
        "verbose": ["verbose"],
    }

    @property
    def _loss(self):
        """The training loss (a ``Loss``; its link gives the function ``f``): the one
        the estimator was fitted with, else the ``loss`` parameter's. A
        ``set_params(loss=...)`` after fit takes effect at the next fit, so the
        kernel always describes the network that was trained."""
        fitted = self.__dict__.get("_fitted_loss")
        return fitted if fitted is not None else self._losses[self.loss]()

    @abstractmethod
    def _targets(self, y):
        """Validate ``y`` (already through ``validate_data``); return :class:`Targets`."""

    @abstractmethod
    def _build_module(self, X, n_outputs):
        """Return a fresh ``nn.Module`` mapping (n, n_features) to (n, n_outputs).

        ``X`` is the float64 training data as a CPU tensor (for data-dependent
        initialisation). Torch's global generator is seeded from
        ``random_state`` while this runs.
        """

    def _initial_module(self, X, n_outputs, seed, device=CPU, dtype=DTYPE):
        # Seed torch's initialisers without touching the user's global RNG state.
        # Built on the CPU (its generator, its data), then moved: w_0 is the same
        # on every device. In float32, w_0 is the float64 initialisation rounded.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self._build_module(X, n_outputs)
        return module.to(device=device, dtype=DTYPE).to(dtype)

    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y, sample_weight=None):
        """Train the network by gradient descent, recording its weight path.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training data, given to the network as float64 (scale it in a
            :class:`~sklearn.pipeline.Pipeline` if needed).
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            Class labels (classifiers) or target values (regressors).
        sample_weight : array-like of shape (n_samples,), default=None
            Weights of the samples in the mean loss.

        Returns
        -------
        self : object
            The fitted estimator.
        """
        # validate_data sets n_features_in_ / feature_names_in_ before training
        # starts: a failed or interrupted fit puts back what was there before.
        saved = {key: self.__dict__[key] for key in _VALIDATION_ATTRS if key in self.__dict__}
        try:
            return self._fit(X, y, sample_weight)
        except BaseException:
            for key in _VALIDATION_ATTRS:
                self.__dict__.pop(key, None)
            self.__dict__.update(saved)
            raise

    def _fit(self, X, y, sample_weight):
        device = resolve_device(self.device)  # before any work: a clear error
        X, y = validate_data(self, X, y, dtype=np.float64, **self._target_validation)
        targets = self._targets(y)
        sample_weight = _check_sample_weight(
            sample_weight, X, dtype=np.float64, ensure_non_negative=True
        )
        if not sample_weight.sum() > 0:
            raise ValueError("The sample weights must not all be zero.")

        rng = check_random_state(self.random_state)
        dtype = TRAINING_DTYPES[self.dtype]
        X_t = as_tensor(X, CPU)
        module = self._initial_module(
            X_t, targets.n_outputs, rng.randint(np.iinfo(np.int32).max), device, dtype
        )
        X_t = X_t.to(device)
        X_run = X_t.to(dtype)  # what the network is trained on (X_t itself in float64)
        # a copy: the targets may be the user's read-only array (a memmap)
        y_t = torch.tensor(targets.values, device=device)
        if y_t.is_floating_point():
            y_t = y_t.to(dtype)
        # Refused with the reason, or left in eval mode (the mode it is trained in; its
        # nn.Dropout and nn.Dropout2d layers in training mode drop units, masks recorded;
        # its nn.BatchNorm1d/2d layers in training mode use batch statistics, followed).
        loss = self._losses[self.loss]()
        check_module(module, X_run, targets.n_outputs, classifier=loss.classifies)
        result = train_module(
            module,
            X_run,
            y_t,
            loss=loss,
            sample_weight=torch.as_tensor(sample_weight, dtype=dtype, device=device),
            solver=SolverSettings.of(self),
            learning_rate=self.learning_rate,
            max_iter=self.max_iter,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            tol=self.tol,
            n_iter_no_change=self.n_iter_no_change,
            random_state=rng,
            verbose=self.verbose,
            path_storage=self.path_storage,
        )
        for param in module.parameters():
            param.requires_grad_(False)
        # A float32 run's float64 path, checked at fit: a run whose path is another
        # network than the float32 model is refused here, with the reason.
        replay = None if dtype == DTYPE else float64_run(module, result.path, X_t, loss.link)

        # Assign only once training succeeded: a failed fit leaves self as it was.
        self.__dict__.update(targets.attributes)
        self.device_ = device
        self._fitted_loss = loss
        self.module_ = module
        self.n_iter_ = result.n_iter
        self.n_steps_ = result.n_steps
        self.loss_curve_ = result.loss_curve
        self.path_ = result.path
        self._fit_X = X_t
        self._fit_targets = targets.values  # what explanations label the training rows by
        self._fit_sample_weight = sample_weight  # what counterfactual attribution differentiates
        self.__dict__.pop("_kernel_cache", None)
        self.__dict__.pop("_replay_cache", None)
        self.__dict__.pop("_twin_cache", None)
        if replay is not None:
            self.__dict__["_replay_cache"] = replay
        return self

    # -- the network -------------------------------------------------------

    def _output(self, X, transform=None):
        """The output ``f = link(module(X))`` of validated rows, or ``transform(f)``
        (a prediction transform of the loss), on the host: (n, n_outputs)."""
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        with torch.no_grad():
            output = self._own_output(as_tensor(X, self.device_))
            if transform is not None:
                output = transform(output)
            return output.cpu().numpy()

    def _own_output(self, X):
        """``f`` of the trained network itself on float64 rows ``X`` (a tensor on
        ``device_``), evaluated in its training dtype, as float64."""
        X = X.to(self.path_.weights.dtype)
        return self._loss.link(self.module_(X)).to(DTYPE)

    # -- the path kernel ---------------------------------------------------

    def _float64_run(self):
        """The float64 network and path whose exact kernel the engine computes (a
        ``Float64Run``): the fitted ones for a float64 fit, the float64 path of a
        float32 fit, anchored at its weights (:func:`~.._training._replay.float64_run`:
        built once, not pickled)."""
        check_is_fitted(self)
        if self.path_.weights.dtype == DTYPE:
            return Float64Run(self.module_, self.path_)
        cache = self.__dict__.get("_replay_cache")
        if cache is None:
            run = float64_run(self.module_, self.path_, self._fit_X, self._loss.link)
            cache = self.__dict__["_replay_cache"] = run
        return cache

    def _engine(self):
        """The kernel engine of the fitted path (built once, shared by callers)."""
        check_is_fitted(self)
        cache = self.__dict__.get("_kernel_cache")
        settings = (self.quadrature, self.n_points, self.n_jobs, self.step_chunks, self.verbose)
        if cache is not None and settings != (
            cache.quadrature,
            cache.n_points,
            cache.n_jobs,
            cache.step_chunks,
            cache.verbose,
        ):
            cache = None  # set_params after fit: the kernel follows the new settings
        if cache is None:
            run = self._float64_run()
            cache = PathKernelEngine(
                run.module,
                run.path,
                self._fit_X,
                link=self._loss.output_link,
                certificate_tolerance=self._loss.certificate_tolerance,
                quadrature=self.quadrature,
                n_points=self.n_points,
                n_jobs=self.n_jobs,
                step_chunks=self.step_chunks,
                verbose=self.verbose,
            )
            self.__dict__["_kernel_cache"] = cache
        return cache

    def __getstate__(self):
        state = super().__getstate__()
        state = dict(state)
        state.pop("_kernel_cache", None)
        state.pop("_replay_cache", None)  # (rebuilt, bitwise the same, when needed)
        state.pop("_twin_cache", None)
        # Host tensors only: the pickle loads on a machine without the device.
        if "module_" in state:
            state["module_"] = on_host(state["module_"])
            if "_fit_X" in state:
                state["_fit_X"] = state["_fit_X"].cpu()
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "module_" in self.__dict__:
            # Back on the device it was fitted on, or on the CPU (with a warning)
            # when this machine does not have it.
            device = loadable_device(self.__dict__.get("device_"), type(self).__name__)
            self.device_ = device
            self.module_ = self.module_.to(device)
            self._fit_X = self._fit_X.to(device)
        self.__dict__.setdefault("dtype", "float64")  # (pickled before the parameter)
        self.__dict__.setdefault("step_chunks", None)  # (same)

    @property
    def kernel_(self):
        """The learned exact path kernel, a scikit-learn ``Kernel``.

        ``kernel_(A, B)`` is the EPK between the rows of ``A`` and ``B``; a row
        equal to a training row is on the training copy (discrete gradients at
        the start of each step), every other row on the test copy (gradients
        integrated along each step). Use it in ``SVC(kernel=clf.kernel_)``,
        ``GaussianProcessClassifier(kernel=clf.kernel_)`` and the like.
        """
        from ._kernel import ExactPathKernel

        return ExactPathKernel(self._engine())

    def decompose(self, X, *, target=None, y=None, batch_size=None):
        """Write the network's output on ``X`` (or a scalar target of it per query)
        as an exact sum over training points.

        ``bias + contributions.sum(axis=1) + decay`` equals the network's output
        ``f(X)`` (``predict_log_proba(X)`` for the cross-entropy of the
        classifiers, ``predict(X)`` for the squared error of the regressors);
        ``residual`` says by how much it misses, measured against the
        network's own output. ``X`` is always on the test copy, so the
        identity holds at every point, training points included.

        With momentum or Adam a step's update mixes the gradients of earlier
        steps: training point ``i``'s contribution is then everything its
        gradients moved, in every later step, weighed by the run's own
        preconditioner (see the user guide, "Optimisers").

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        target : {"predicted", "output", "margin", "loss"}, array-like of int \
                of shape (n_samples,) or None, default=None
            Decompose one scalar :math:`T` per query instead of every output, at
            the cost of one output instead of ``n_outputs`` (each quadrature node
            back-propagates :math:`\\nabla T` alone, and the query's features meet
            the training points with one output): ``"predicted"``, the
            log-probability of each query's predicted class (classifiers);
            ``"output"``, of its class ``y`` (without ``y``, the predicted class;
            a regressor's output 0); ``"margin"``, :math:`\\log p_c - \\log(1 - p_c)`
            of its class ``y`` (classifiers; without ``y``, the predicted class);
            ``"loss"``, the training loss at ``(x, y)`` (``y`` required); an int
            array, the output of that index per query. The identity and the
            certificate are those of :math:`T`: ``bias + contributions.sum(1) +
            decay == T(f)``, exactly as for the outputs (the quadrature integrates
            :math:`\\nabla_f T(f(w(t)))` along each step, see the user guide,
            "Scalar targets"). For an output index it equals that output's column
            of the full decomposition. None: every output.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs), default=None
            The queries' labels (classes) or values, for ``target``.
        batch_size : int or None, default=None
            Rows integrated at once, at most. None: as many as the engine's
            working budget (1 GiB, or a quarter of the available memory) holds,
            from the memory a row's quadrature nodes take, measured on a sample
            of the rows (a convolutional network's kinks make that hundreds of
            nodes per step). The result, ``8 n_samples n_train n_outputs``
            bytes, is held whole either way: for many rows, use
            :meth:`explain` or :meth:`influence_matrix`, which stream.

        Returns
        -------
        result : :class:`~sklearn.utils.Bunch`
            ``contributions`` (n_samples, n_train, n_outputs): what training point
            ``i`` added to output ``k`` over the whole run; ``bias`` (n_samples,
            n_outputs): the initial network's output; ``decay`` (n_samples,
            n_outputs): what weight decay moved (zeros without it); ``output``
            (n_samples, n_outputs): the trained network's output ``f``
            (log-probabilities of the classes, or the regressor's prediction). A regressor fitted on
            a 1-d ``y`` drops the ``n_outputs`` axis, like its ``predict``;
            ``residual`` (n_samples,): the exactness certificate, ``max_k |bias +
            sum_i contributions + decay - output|``, with ``output`` evaluated by
            the network itself (not by the kernel engine), so that no error of the
            engine or of the recorded path can hide behind it;
            ``quadrature_error`` (n_samples,): the part of it the quadrature
            accounts for, summed over steps; ``model_gap`` (n_samples,): ``max_k``
            of the difference between the trained network's own output in its
            training ``dtype`` and ``output`` (zero for ``dtype="float64"``; for
            a float32 fit, ``output`` and ``residual`` are those of its float32
            weights evaluated in float64, and ``decay`` holds each step's float32
            rounding beside weight decay, see ``dtype``). With BatchNorm trained
            in training mode, also
            ``statistics`` (shaped as ``contributions``): the part of each
            contribution that came through the running statistics' moves (see the
            user guide's "Which modules").
            With ``target``, ``contributions`` (n_samples, n_train), ``bias``,
            ``decay``, ``output`` and ``model_gap`` (n_samples,) are :math:`T`'s
            (``statistics`` too), and ``target`` (its name) and ``labels`` (each
            query's label: an output index, a class code or values) are added.
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        X_t = as_tensor(X, self.device_)
        targets = None
        if target is not None or y is not None:
            targets = decomposition_targets(self._explanation_context(), X_t, target, y)
        parts = self._engine().decompose(X_t, batch_size, targets)
        network = self._float64_run().module  # (module_ itself for a float64 fit)
        with torch.no_grad():  # the network's own forward, at its own (final) weights
            output = self._loss.link(network(X_t)).cpu().numpy()
            own = self._own_output(X_t).cpu().numpy()
        if targets is not None:
            gap = np.abs(target_values(targets, own) - target_values(targets, output))
            return checked_for_targets(parts, output, targets, model_gap=gap)
        return self._outputs_as_fitted(
            checked_against(parts, output, model_gap=np.abs(own - output).max(axis=1))
        )

    def _explanation_context(self):
        """See :class:`~.._explain._mixin.ExplanationMixin`."""
        return estimator_context(self)

    def _outputs_as_fitted(self, parts):
        """The decomposition's output axes as the targets had them (identity here)."""
        return parts


class BasePathClassifier(ClassifierMixin, BasePathEstimator):
    """Base of the classifiers: a :class:`~.._training._losses.ClassificationLoss`
    (the cross-entropy of ``f = log_softmax(module(x))``) on class codes."""

    _losses = CLASSIFICATION_LOSSES
    _parameter_constraints = {
        **BasePathEstimator._parameter_constraints,
        "loss": [StrOptions(CLASSIFICATION_LOSSES.keys())],
    }

    def _targets(self, y):
        check_classification_targets(y)
        classes, codes = np.unique(y, return_inverse=True)
        if classes.shape[0] < 2:
            raise ValueError(
                f"{type(self).__name__} needs samples of at least 2 classes in "
                f"the data, but the data contain only one class: {classes.tolist()[0]!r}."
            )
        return Targets(codes.astype(np.int64), classes.shape[0], {"classes_": classes})

    def predict_log_proba(self, X):
        """Log-probabilities of the classes: the loss's ``log_proba`` of the output
        (``log_softmax(module(X))`` for the cross-entropy).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        log_proba : ndarray of shape (n_samples, n_classes)
            Columns follow ``classes_``.
        """
        return self._output(X, self._loss.log_proba)

    def predict_proba(self, X):
        """Class probabilities, ``exp(predict_log_proba(X))`` (``softmax(module(X))``
        for the cross-entropy).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        proba : ndarray of shape (n_samples, n_classes)
            Columns follow ``classes_``.
        """
        return np.exp(self._output(X, self._loss.log_proba))

    def decision_function(self, X):
        """The network's output ``f`` (the function the path kernel reproduces).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        scores : ndarray of shape (n_samples, n_classes) or (n_samples,)
            ``f``, columns following ``classes_`` (``log_softmax(module(X))`` for
            the cross-entropy). For two classes, scikit-learn's convention:
            ``f_1(x) - f_0(x)`` (the log-odds of ``classes_[1]`` for the
            cross-entropy), positive when ``classes_[1]`` is predicted.
        """
        output = self._output(X)
        if output.shape[1] == 2:
            return output[:, 1] - output[:, 0]
        return output

    def predict(self, X):
        """Predicted class labels.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        y_pred : ndarray of shape (n_samples,)
        """
        log_proba = self._output(X, self._loss.log_proba)
        return self.classes_[np.argmax(log_proba, axis=1)]


class BasePathRegressor(RegressorMixin, BasePathEstimator):
    """Base of the regressors: a :class:`~.._training._losses.RegressionLoss` on
    numeric targets, ``MLPRegressor``'s half mean squared error of ``f = module(x)``
    (no link) over the outputs, averaged over each batch with the sample weights.
    """

    _losses = REGRESSION_LOSSES
    _parameter_constraints = {
        **BasePathEstimator._parameter_constraints,
        "loss": [StrOptions(REGRESSION_LOSSES.keys())],
    }
    _target_validation = {"multi_output": True, "y_numeric": True}

    def _targets(self, y):
        y = np.asarray(y, dtype=np.float64)
        if not np.isfinite(y).all():
            raise ValueError("The target y contains NaN or infinity.")
        values = y.reshape(y.shape[0], -1)
        return Targets(values, values.shape[1], {"n_outputs_": values.shape[1], "_y_ndim": y.ndim})

    def predict(self, X):
        """The network's prediction: the loss's ``prediction`` of the output
        ``f`` (``module(X)`` itself for the squared error, the function the path
        kernel reproduces).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        y_pred : ndarray of shape (n_samples,) or (n_samples, n_outputs)
            1-d when the model was fitted on a 1-d ``y``.
        """
        prediction = self._output(X, self._loss.prediction)
        return prediction[:, 0] if self._y_ndim == 1 else prediction

    def _outputs_as_fitted(self, parts):
        if self._y_ndim != 1:
            return parts
        for key in ("contributions", "bias", "decay", "output", "statistics"):
            if key in parts:
                parts[key] = parts[key][..., 0]
        return parts

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        return tags
