"""A recorded training run of the user's own loop, with its exact path kernel.

:class:`Recording` is what :meth:`~sklearn_pathkernel.TrainingRecorder.finish`
returns: the module at its final weights, the recorded
:class:`~sklearn_pathkernel._path.WeightPath` and the training inputs.
It offers what a fitted estimator offers: :meth:`decompose`, :meth:`gram`, and
:attr:`kernel_` (an :class:`~sklearn_pathkernel.ExactPathKernel` for
``SVC(kernel=...)`` or Gaussian processes), and the explanation API of
:class:`~.._explain._mixin.ExplanationMixin` (``explain``, ``self_influence``,
``explain_over_time``, ``class_contributions``, ``influence_matrix``; these need
the training targets, ``TrainingRecorder(..., y=y)``: integer labels in ``[0, K)``
make a classifier whose output ``k`` is class ``k``, other targets a regressor;
``counterfactual`` and ``method="counterfactual"`` also need the loss the loop
minimised, ``TrainingRecorder(..., loss=...)``, see :mod:`._counterfactual`),
and :meth:`final_state_dict`, the recorded network's state (to audit or restore).

The function decomposed is the module's own output ``f(x) = module(x)`` (the
logits of a classifier): by the chain rule each step's gradient is
``sum_i J_i^T dL/dout_i`` for any loss of the output, with the output gradients
recorded as the user's loss produced them.

Precision: the kernel is always computed in float64. For a float64 model it is
the kernel of the recorded path, exact to the quadrature's certificate. A float32
optimiser rounds its own updates, so a float32 path meets the update's linear
form only to float32 rounding; the kernel is then that of the float32 run itself
(:func:`~.._training._replay.anchored_in_float64`: every step anchored at its
recorded weights, each gradient recomputed there in float64 from the recorded
rows, output gradients, rates and preconditioners, each step's rounding an
explicit part of the decay term), exact against the float32 weights evaluated in
float64, and ``model_gap`` says how far the float32 model's own forward pass is
from that evaluation. A network with BatchNorm in training mode takes the path's
float64 replay from ``w_0`` instead (:func:`~.._training._replay.replay_in_float64`).

The recording holds the user's module as long as it lives (a live module):
every query first checks, bitwise, that its weights and constants are still
the recorded network's, and refuses otherwise (or, with
``on_mismatch="record"``, says so in every result).
"""

import contextlib
import warnings
from numbers import Integral

import numpy as np
import torch
from sklearn.utils._param_validation import (
    Interval,
    StrOptions,
    validate_parameter_constraints,
)
from sklearn.utils.validation import check_array

from .._engine import PathKernelEngine, checked_against, checked_for_targets, target_values
from .._estimators import ExactPathKernel, fill_doc, step_chunks_parameter
from .._explain import ExplanationMixin, decomposition_targets
from .._path import FunctionLink
from .._training import RecordingRefused, float64_run, largest_difference
from ._explanation_context import recording_context
from ._io import read_recording, read_stated, save_recording

DTYPE = torch.float64


def identity(out):
    """The identity link: ``f`` is the module's output."""
    return out


def check_rows(X, row_shape, device, *, name="X"):
    """Query rows for a recording, validated as strictly as an estimator's ``X``.

    Parameters
    ----------
    X : torch.Tensor or array-like of shape (n, *row_shape)
        The rows; a tensor keeps its values (any real dtype), anything else goes
        through scikit-learn's ``check_array`` (no sparse matrices, no strings).
    row_shape : tuple of int
        The shape of one training row (``X_train.shape[1:]``).
    device : torch.device
        Where the float64 result lives.
    name : str, default="X"
        The argument's name, for the messages.

    Returns
    -------
    torch.Tensor of shape (n, *row_shape), float64 on ``device``.

    Raises
    ------
    ValueError
        For complex values, a shape other than ``(n, *row_shape)`` with
        ``n >= 1``, or a NaN or infinite value (the message names the first row
        that holds one).
    """
    if isinstance(X, torch.Tensor):
        if X.is_complex():
            raise ValueError(f"Complex data not supported: {name} has dtype {X.dtype}.")
        X = X.detach()
    else:
        X = check_array(
            X, dtype=np.float64, allow_nd=True, ensure_2d=False, ensure_all_finite=False,
            ensure_min_samples=0, input_name=name,
        )  # fmt: skip
    X = torch.as_tensor(X).to(device=device, dtype=DTYPE)
    row_shape = tuple(row_shape)
    expected = f"(n_queries, {', '.join(map(str, row_shape))})"
    if X.ndim == len(row_shape) and tuple(X.shape) == row_shape:
        raise ValueError(
            f"{name} has shape {tuple(X.shape)}, the shape of one training row: queries "
            f"must be {expected}; for a single query pass {name}[None] (or "
            f"{name}.reshape(1, -1) for flat rows)."
        )
    if X.ndim != len(row_shape) + 1 or tuple(X.shape[1:]) != row_shape:
        raise ValueError(
            f"{name} has rows of shape {tuple(X.shape[1:])} (shape {tuple(X.shape)}), but "
            f"this recording's training rows have shape {row_shape}: queries must be "
            f"{expected}."
        )
    if X.shape[0] == 0:
        raise ValueError(f"Found array with 0 sample(s) (shape {tuple(X.shape)}) in {name}.")
    finite = torch.isfinite(X.reshape(X.shape[0], -1)).all(dim=1)
    if not bool(finite.all()):
        row = int(torch.nonzero(~finite)[0, 0])
        what = "NaN" if bool(torch.isnan(X[row]).any()) else "infinity"
        raise ValueError(
            f"Input {name} contains {what} (first in row {row}; "
            f"{int((~finite).sum())} of {X.shape[0]} rows are not finite)."
        )
    return X


def output_function(link):
    """``f`` of a recording's module output: ``link``, or the identity when None."""
    return identity if link is None else link


@fill_doc(step_chunks=step_chunks_parameter("recorded"))
class Recording(ExplanationMixin):
    """The exact path kernel of a training run recorded in the user's own loop.

    Parameters
    ----------
    module : torch.nn.Module
        The network (a copy), at its final weights, in its training dtype.
    path : WeightPath
        The recorded path, in the training dtype.
    X : torch.Tensor of shape (n_samples, ...)
        The training inputs the path's rows index.
    dtype : torch.dtype
        The dtype the network was trained in.
    quadrature : {"exact", "riemann", "dpk"}, default="exact"
        How each step's test copy is integrated, as the estimators'
        ``quadrature``: ``"exact"`` splits the step at its kinks and certifies
        the result; ``"riemann"`` (``n_points`` nodes) and ``"dpk"`` (one node)
        are the paper's approximations, kept for comparison.
    n_points : int, default=100
        Nodes of ``quadrature="riemann"``.
    n_jobs : int or None, default=None
        Blocks (tiles of query rows x chunks of steps) computed at once through
        joblib, in threads by default or on any ``joblib.parallel_config``
        backend (dask); ``None`` is one unless a joblib context says otherwise.
        Torch's own threads multiply with it: keep ``n_jobs *
        torch.get_num_threads()`` at most the cores.
    {step_chunks}
    verbose : int, default=0
        Progress bars over the steps of long computations (decompositions,
        Gram matrices, self-influence) when positive.
    link : callable or None, default=None
        ``f = link(module(x))``, the function decomposed (the recorder's).
    targets : array-like of shape (n_samples,) or (n_samples, K), default=None
        The training targets, if the recorder was given them (for explanations
        that group training points by class).
    live_module : torch.nn.Module or None, default=None
        The user's own module (the recorder's), checked before every query to
        still be the recorded network; not pickled.
    on_mismatch : {"refuse", "record"}, default="refuse"
        What a query does when the live module is not the recorded network
        (see :class:`~sklearn_pathkernel.TrainingRecorder`).
    mismatch : str or None, default=None
        How the user's module differed from the recorded network at ``finish``
        (``on_mismatch="record"``).
    model_difference : float, default=0.0
        The largest difference of a weight or constant behind ``mismatch``.
    loss : str, Loss or None, default=None
        The loss the loop minimised, on ``f`` (the recorder's ``loss``): a
        registered name (``"log_loss"``, ``"squared_error"``) or a ``Loss``;
        counterfactual attribution needs it. A plain attribute: set it later
        (``recording.loss = "log_loss"``) to state it after the run.
    sample_weight : array-like of shape (n_samples,) or None, default=None
        The rows' weights in each batch's weighted mean loss (the recorder's);
        None for the plain mean. A plain attribute, as ``loss``.
    optimizer_settings : OptimizerSettings or None, default=None
        The optimiser's settings at every step (kept by the recorder), which
        counterfactual attribution and its retraining need.

    Attributes
    ----------
    module_, path_, X_train_ : as given
    n_steps_ : int
        Optimiser steps recorded.
    model_mismatch_ : str or None
        None when the user's module is the recorded network (bitwise); else how
        it differs (only with ``on_mismatch="record"``).
    model_difference_ : float
        The largest difference between a weight or constant of the user's
        module and the recorded network's (0.0 when they are the same).
    optimizer_settings_ : OptimizerSettings or None
        As given.

    Notes
    -----
    ``quadrature``, ``n_points``, ``n_jobs``, ``step_chunks`` and ``verbose`` are plain
    attributes: set them on the recording that
    :meth:`~sklearn_pathkernel.TrainingRecorder.finish` returns
    (``recording.n_jobs = 2``) at any time, and the next computation follows
    them (a float32 run's float64 path is kept). They are checked there, with
    the estimators' rules.
    """

    _option_constraints = {
        "quadrature": [StrOptions({"exact", "riemann", "dpk"})],
        "n_points": [Interval(Integral, 1, None, closed="left")],
        "n_jobs": [Integral, None],
        "step_chunks": [Interval(Integral, 1, None, closed="left"), None],
        "verbose": ["verbose"],
    }

    def __init__(
        self,
        module,
        path,
        X,
        *,
        dtype=DTYPE,
        quadrature="exact",
        n_points=100,
        n_jobs=None,
        step_chunks=None,
        verbose=0,
        link=None,
        targets=None,
        live_module=None,
        on_mismatch="refuse",
        mismatch=None,
        model_difference=0.0,
        loss=None,
        sample_weight=None,
        optimizer_settings=None,
    ):
        self.link = link
        self.loss = loss
        self.sample_weight = sample_weight
        self.optimizer_settings_ = optimizer_settings
        self._live_module = live_module
        self.on_mismatch = on_mismatch
        self.model_mismatch_ = mismatch
        self.model_difference_ = float(model_difference)
        self.targets_ = None if targets is None else np.asarray(targets)
        self.module_ = module
        self.path_ = path
        self.X_train_ = X
        self.dtype = dtype
        self.quadrature = quadrature
        self.n_points = n_points
        self.n_jobs = n_jobs
        self.step_chunks = step_chunks
        self.verbose = verbose
        self._engine_cache = None
        self._replay_cache = None
        self._stated_cache = None

    @property
    def n_steps_(self):
        return self.path_.n_steps

    @property
    def epochs_(self):
        """The epoch of every step, (n_steps,): a new epoch starts at the step that
        uses a training row again (the rows of one epoch are distinct)."""
        epochs, seen, epoch = np.zeros(self.n_steps_, dtype=np.int64), set(), 0
        for step, rows in enumerate(self.path_.batches):
            rows = rows.tolist()
            if seen.intersection(rows):
                epoch, seen = epoch + 1, set()
            seen.update(rows)
            epochs[step] = epoch
        return epochs

    @property
    def nbytes(self):
        """Bytes held by the recording's path (weights, preconditioners, rows,
        output gradients); the training inputs are the user's."""
        return self.path_.nbytes

    def _explanation_context(self):
        """The recording as an explanation's context (see
        :func:`~._explanation_context.recording_context`)."""
        return recording_context(self)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_engine_cache"] = None
        state["_live_module"] = None  # (the user's object, not part of the recording)
        state["_replay_cache"] = None
        state["_stated_cache"] = None
        return state

    def __setstate__(self, state):
        # Recordings pickled before the options n_points and verbose existed.
        defaults = {"n_points": 100, "verbose": 0, "_replay_cache": None, "_stated_cache": None}
        defaults["step_chunks"] = None  # (and before step_chunks)
        # (and before counterfactual attribution: no loss, no optimiser settings)
        defaults.update(loss=None, sample_weight=None, optimizer_settings_=None)
        self.__dict__.update({**defaults, **state})

    def final_state_dict(self):
        """The recorded network's final state: the recorded weights after the last
        step (a float32 run's, which the kernel is of, see the notes), and
        the constants; the ``state_dict`` of the network the kernel is of, in the
        training dtype, to compare with the model's own."""
        final = self.path_.unflatten(self.path_.weights[-1])
        return {
            name: final[name].reshape(value.shape).clone() if name in final else value.clone()
            for name, value in self.module_.state_dict().items()
        }

    # -- the user's module -------------------------------------------------------

    def _check_live(self):
        """Refuse (or flag) a query when the user's module is no longer the recorded
        network: weights or constants changed since ``finish``."""
        live = self._live_module
        if live is not None:
            difference = largest_difference(_state(live), _state(self.module_))
            if difference is not None:
                name, size = difference
                message = (
                    f"The model's {name!r} differs from the recorded network by up to "
                    f"{size:.4g} (changed since recorder.finish()): the model you hold is "
                    "not the recorded network."
                )
                if self.on_mismatch == "refuse":
                    raise RecordingRefused(
                        message + " Restore its weights (recording.final_state_dict()) or "
                        "record the new run."
                    )
                if size > self.model_difference_:
                    self.model_mismatch_, self.model_difference_ = message, size
        if self.model_mismatch_ is not None:
            warnings.warn(
                f"{self.model_mismatch_} The model you hold is not the recorded network: the "
                "results are the recorded network's kernel (model_difference_ says how far "
                "the model is from it).",
                UserWarning,
                stacklevel=3,
            )

    # -- float64 evaluation ------------------------------------------------------

    def _options(self):
        """The engine's settings, checked (a clear error names a bad one)."""
        options = {name: getattr(self, name) for name in self._option_constraints}
        validate_parameter_constraints(self._option_constraints, options, "Recording")
        return options

    def _float64_run(self):
        """The float64 module at the final weights and its path (a ``Float64Run``):
        the recorded ones for a float64 run, the float64 path of a float32 one,
        anchored at its weights (built once)."""
        if self._replay_cache is None:
            link = output_function(self.link)
            self._replay_cache = float64_run(
                self.module_, self.path_, self.X_train_, link, check_float64=True
            )
        return self._replay_cache

    def _engine(self):
        """The float64 engine of the recorded path, rebuilt when an option changed,
        after the check of the user's module."""
        self._check_live()
        options = self._options()
        cache = self._engine_cache
        if cache is None or options != {name: getattr(cache, name) for name in options}:
            run = self._float64_run()
            self._engine_cache = PathKernelEngine(
                run.module,
                run.path,
                self.X_train_.to(DTYPE),
                link=FunctionLink(output_function(self.link)),
                **options,
            )
        return self._engine_cache

    def _rows(self, X, name="X"):
        """Validated query rows (:func:`check_rows`) as float64 on the training
        inputs' device."""
        return check_rows(X, self.X_train_.shape[1:], self.X_train_.device, name=name)

    def decompose(self, X, *, target=None, y=None, batch_size=None):
        """Write the network's output on ``X`` (or a scalar target of it per query)
        as an exact sum over training points.

        ``bias + contributions.sum(axis=1) + decay`` equals ``output``, the float64
        evaluation of the module at the recorded final weights.

        Parameters
        ----------
        X : torch.Tensor or array-like of shape (n, ...)
            Query rows, shaped like the training inputs.
        target : {"predicted", "output", "margin"}, array-like of int of shape \
                (n,) or None, default=None
            One scalar per query instead of every output, at the cost of one
            output (see the estimators' ``decompose``; ``"loss"`` needs the
            training loss, which a recording does not know). None: every output.
        y : array-like of shape (n,), default=None
            The queries' classes, for ``target``.
        batch_size : int or None, default=None
            Rows integrated at once, at most (None: as many as the working
            budget holds, from the memory a row's quadrature nodes take); the
            result, ``8 n n_train K`` bytes, is held whole either way.

        Returns
        -------
        Bunch
            ``contributions`` (n, n_train, K): what each training row moved each
            output over the run; ``bias`` (n, K): the output at the initial
            weights; ``decay`` (n, K): what weight decay moved (and, for a float32
            run, each step's float32 rounding); ``output`` (n, K): the module's
            output at the final weights, in float64;
            ``residual`` (n,): ``max_k |bias + sum contributions + decay -
            output|``, the certificate against the module itself;
            ``quadrature_error`` (n,): the part the quadrature accounts for;
            ``model_gap`` (n,): ``max_k`` of the difference between the
            user's own module (the live one, else the recorded network) in its
            training dtype and ``output`` (zero for a float64 model);
            ``model_difference`` (float): the largest difference between a
            weight or constant of the user's module and the recorded network
            (0.0: the same network, bitwise). With BatchNorm trained in
            training mode, also ``statistics`` (n, n_train, K): the part of each
            contribution that came through the running statistics' moves.
            With ``target``, the arrays are ``T``'s (``contributions`` (n,
            n_train), the others (n,)), with ``target`` and ``labels`` (see the
            estimators' ``decompose``).
        """
        X64 = self._rows(X)
        engine = self._engine()
        targets = None
        if target is not None or y is not None:
            targets = decomposition_targets(self._explanation_context(), X64, target, y)
        parts = engine.decompose(X64, batch_size, targets)
        own_module = self.module_ if self._live_module is None else self._live_module
        with torch.no_grad():
            link = output_function(self.link)
            output = link(engine.module(X64)).cpu().numpy()
            # (in eval mode, the network explained: a module left in training mode
            # would drop units or normalise by the query batch, and move its statistics)
            with _in_eval_mode(own_module):
                own = link(own_module(X64.to(self.dtype))).to(DTYPE).cpu().numpy()
        if targets is not None:
            return checked_for_targets(
                parts,
                output,
                targets,
                model_gap=np.abs(target_values(targets, own) - target_values(targets, output)),
                model_difference=self.model_difference_,
            )
        return checked_against(
            parts,
            output,
            model_gap=np.abs(own - output).max(axis=1),
            model_difference=self.model_difference_,
        )

    def gram(self, A, B=None, *, a_train=False, b_train=False, output="trace"):
        """The exact path kernel between the rows of ``A`` and ``B`` (see
        ``PathKernelEngine.gram``): ``a_train``/``b_train`` put rows on the training
        copy (the three Gram blocks: train x train, train x test, test x test)."""
        A = self._rows(A, "A")
        B = None if B is None else self._rows(B, "B")
        return self._engine().gram(A, B, a_train=a_train, b_train=b_train, output=output)

    @property
    def kernel_(self):
        """The learned kernel as a scikit-learn ``Kernel`` on flattened rows (a row
        equal to a training row is on the training copy)."""
        return ExactPathKernel(self._engine())

    # -- storage ---------------------------------------------------------------------

    def save(self, directory):
        """Write the recording to ``directory`` (see :func:`~._io.save_recording`)."""
        save_recording(self, directory)

    @classmethod
    def load(cls, directory, module, X, link=None):
        """Load a recording saved by :meth:`save` (see
        :func:`~._io.read_recording`): needs the module (its structure; its
        weights are set from the recording), the training inputs and, if the
        recorder had one, its ``link``. A registered loss name comes back with the
        optimiser's settings (counterfactual attribution); a ``Loss`` instance is
        code, not stored: set ``recording.loss`` again."""
        loss, sample_weight, settings = read_stated(directory)
        run = read_recording(directory, module, X, link=link)
        return cls(
            **run.arguments(), loss=loss, sample_weight=sample_weight, optimizer_settings=settings
        )


@contextlib.contextmanager
def _in_eval_mode(module):
    """``module`` in eval mode within, each submodule's own mode restored after."""
    modes = [(layer, layer.training) for layer in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for layer, training in modes:
            layer.training = training


def _state(module):
    """A module's parameters and buffers, by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}
