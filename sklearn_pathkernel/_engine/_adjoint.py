"""Counterfactual attribution: the derivative of a query's output with respect to
each training row's weight in the loss, exactly through the recorded run.

Weight training row ``i``'s loss by :math:`1 + \\varepsilon_i` at every step whose
batch holds it,

.. math::

    L_s(w; \\varepsilon) = \\sum_{i \\in B_s} a_{s,i} (1 + \\varepsilon_i)\\, l(f(x_i; w), y_i),

with :math:`a_{s,i}` the row's share of the batch's sample weight (held fixed), and
let every step be the optimiser's exact update
:math:`(w_{s+1}, \\sigma_{s+1}) = U_s(w_s, \\sigma_s, \\nabla_w L_s(w_s; \\varepsilon))`
(:mod:`._update_maps`; :math:`\\sigma` the optimiser's state). The score of row ``i``
for the scalar target :math:`T(x; w_S)` (:mod:`._targets`) is
:math:`\\partial T / \\partial \\varepsilon_i` at :math:`\\varepsilon = 0`, the
SGD-influence of Hara et al. (2019) made exact for every optimiser: reverse mode
over the steps,

.. math::

    \\lambda_S = \\nabla_w T(x; w_S), \\quad \\mu_S = 0, \\qquad
    (\\lambda_s, \\mu_s, \\delta_s) = \\mathrm{VJP}_{(w_s, \\sigma_s, \\varepsilon)}
    \\big[U_s(w_s, \\sigma_s, \\nabla_w L_s(w_s; \\varepsilon))\\big](\\lambda_{s+1}, \\mu_{s+1}),

and :math:`\\partial T / \\partial \\varepsilon_i = \\sum_{s : i \\in B_s} \\delta_{s,i}`.

Without the Hessian term (``hessian=False``) each step's loss gradient is held at the
recorded weights while the rows' weights move: :math:`\\lambda` then changes only
through the update's explicit dependence on :math:`w` (weight decay) and the optimiser
state's adjoint, i.e. the final target gradient carried back through the optimiser's
accumulation (for plain GD, :math:`\\delta_{s,i} = \\eta_s a_{s,i} \\langle \\nabla T(w_S),
-\\nabla l_i(w_s) \\rangle`, Grad-Dot along the path). It is the derivative of a run
whose later steps do not react to the earlier moves: the form to use when the exact
adjoint grows so much along the run that its linear regime is far smaller than a
row's removal (see the user guide's measurements).
For plain gradient descent this is :math:`\\delta_{s,i} = \\eta_s a_{s,i}\\langle
\\lambda_{s+1}, -\\nabla_w l_i(w_s) \\rangle` and :math:`\\lambda_s = (I - \\eta_s H_s)
\\lambda_{s+1}` with :math:`H_s` the Hessian of the batch loss (a Hessian-vector
product, never formed); momentum's buffer and Adam's two moments carry their own
adjoints :math:`\\mu_s`, exactly (both of Adam's moments depend on :math:`\\varepsilon`).

The estimators' ``sample_weight`` enters through the shares
:math:`a_{s,i} = \\omega_i / \\sum_{j \\in B_s} \\omega_j`. Scaling row ``i``'s sample
weight by :math:`1 + h` moves every share of the batch (the denominator), i.e.
:math:`\\varepsilon_j = [j = i] - a_{s,i}` at step ``s``, so

.. math::

    \\frac{\\partial T}{\\partial \\log \\omega_i} = \\sum_{s : i \\in B_s}
    \\Big(\\delta_{s,i} - a_{s,i} \\sum_{j \\in B_s} \\delta_{s,j}\\Big),

the *weight scores*, which finite differences of real retraining check.

Dropout and BatchNorm trained in training mode are part of the step: each step's
batch is evaluated with the dropout masks its rows drew, and BatchNorm's running
statistics :math:`r` join the state, :math:`(w, r)`, moved by their averaging of the
batch statistics :math:`b_s(w_s)` (:mod:`._adjoint_statistics`); the target is the
eval-mode network's, :math:`T(x; w_S, r_S)`, so :math:`\\lambda` has a component on
:math:`r` too.

Cost and memory: a forward replay of the run (one gradient per step) keeps the
optimiser's state at every step, ``8 S n_state W`` bytes (``n_state`` = 0 for SGD,
1 with momentum, 2 for Adam); the reverse sweep holds the adjoints, ``8 n (1 +
n_state) W`` bytes for ``n`` queries, and per step runs one forward pass of the
batch (shared by all queries) and one backward and one double-backward pass
batched over the queries by ``vmap`` (``n |B_s|`` rows of activations). So one
sweep costs about ``S`` batched Hessian-vector products of ``n`` vectors.
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch.func import functional_call, grad, vjp, vmap

from .._path import masks_applied, read_row, with_running_statistics
from ._adjoint_statistics import RunningStatisticsStep

#: A step's BatchNorm batch statistics without BatchNorm (never written).
_NO_BATCH = {}


def replay_tolerance(training_dtype):
    """How far, relative to the run's largest step, the differentiated update map
    may land from a recorded step's weights: 1e-9 for a float64 run (rounding alone
    gives about 1e-15), ``1000 eps`` of the training dtype otherwise (a float32 run's
    float64 replay took its steps from the float32 run's own output gradients:
    about 1e-7 apart). A step the sweep does not model (a dropout mask not applied,
    a setting read wrong) misses by a fraction of the step itself, and the sweep
    would differentiate another run."""
    if training_dtype == torch.float64:
        return 1e-9
    return 1e3 * torch.finfo(training_dtype).eps


@dataclass(frozen=True)
class TrainingRun:
    """What differentiating a run needs beyond its recorded path.

    Attributes
    ----------
    module : torch.nn.Module
        The network in eval mode (its structure; the weights come from the path).
    path : WeightPath
        The recorded path: the parameters' weights, and BatchNorm's running
        statistics in ``running_statistics`` for a network with BatchNorm trained in
        training mode (whose state is then ``(w, r)``, see
        :mod:`._adjoint_statistics`).
    X : torch.Tensor of shape (M, ...)
        The training rows, on the device the sweep computes on.
    y : torch.Tensor
        The training targets as the loss takes them (class codes or values).
    loss : Loss
    sample_weight : torch.Tensor of shape (M,)
        The rows' sample weights (ones when the fit had none).
    update : UpdateMap
        The optimiser's exact step.
    training_dtype : torch.dtype
        The dtype the network was trained in (``path`` is float64 either way: a
        float32 run's float64 replay). It sets how closely the differentiated steps
        must reproduce the path (:func:`replay_tolerance`).
    """

    module: object
    path: object
    X: torch.Tensor
    y: torch.Tensor
    loss: object
    sample_weight: torch.Tensor
    update: object
    training_dtype: torch.dtype = torch.float64

    @property
    def n_steps(self):
        return self.path.n_steps

    @cached_property
    def statistics(self):
        """The :class:`RunningStatisticsStep` of a network with BatchNorm trained in
        training mode, else None."""
        stats = self.path.running_statistics
        return None if stats is None else RunningStatisticsStep(self.module, stats)

    @cached_property
    def coordinates(self):
        """The state the sweep differentiates along the run: the path with the running
        statistics as coordinates after the weights (the path itself without
        BatchNorm)."""
        return with_running_statistics(self.path)

    @cached_property
    def n_weights(self):
        """The number of weights ``W`` (the coordinates' first ``W``)."""
        return int(sum(torch.Size(shape).numel() for shape in self.path.param_shapes))

    @property
    def network(self):
        """The module the passes evaluate (BatchNorm's private copy, or ``module``)."""
        return self.module if self.statistics is None else self.statistics.module

    def batch(self, step):
        """Step ``step``'s rows (int64 tensor on the device) and their shares ``a_{s,i}``."""
        rows = torch.as_tensor(self.path.batches[step], device=self.X.device)
        weight = self.sample_weight[rows]
        total = weight.sum()
        shares = weight / total if total > 0 else torch.zeros_like(weight)
        return rows, shares

    def weights(self, step):
        """The coordinates at step ``step`` (``w_step``, and ``r_step`` after it with
        BatchNorm), on the device."""
        return read_row(self.coordinates.weights, step, self.X.device)

    def output(self, coordinates, X):
        """``f = link(module(X))`` of the eval-mode network at the flat
        ``coordinates`` (:meth:`weights`)."""
        values = self.coordinates.unflatten(coordinates)
        return self.loss.link(functional_call(self.network, values, (X,)))

    def gradient_function(self, step):
        """``G(w, eps)``: the gradient of step ``step``'s loss with respect to the
        weights ``w`` (W,), every row's share scaled by ``1 + eps`` (eps of shape
        (|B_s|,)), the network evaluated as in training: with the step's recorded
        dropout masks (those its rows drew) and BatchNorm's batch statistics. Returns
        ``(G, batch)``, ``batch`` the BatchNorm layers' batch statistics (empty
        without)."""
        rows, shares = self.batch(step)
        X, y = self.X[rows], self.y[rows]
        masks = self.path.masks(step)
        network = self.network

        def batch_loss(weights, eps):
            with masks_applied(network, masks):
                out = functional_call(network, self.path.unflatten(weights), (X,))
            per_sample = self.loss.per_sample(self.loss.link(out), y)
            return (shares * (1.0 + eps) * per_sample).sum()

        if self.statistics is None:  # (no auxiliary output: functorch's aux costs a few %)
            gradient = grad(batch_loss)
            return (lambda weights, eps: (gradient(weights, eps), _NO_BATCH)), rows, shares

        def with_statistics(weights, eps):
            with self.statistics.training_pass() as batch:
                return batch_loss(weights, eps), batch

        return grad(with_statistics, has_aux=True), rows, shares

    def step_function(self, step, hessian=True):
        """``U_s(c, state, G(w, eps))`` as a function of the coordinates ``c``
        (:meth:`weights`), the optimiser's state and ``eps``; with ``hessian=False``,
        ``U_s(c, state, G(w_s, eps))``: the gradient (and BatchNorm's batch
        statistics) held at the recorded weights, their dependence on ``w`` cut (no
        Hessian term). With BatchNorm the running statistics move by
        :meth:`RunningStatisticsStep.moved`."""
        gradient, rows, shares = self.gradient_function(step)
        statistics, n = self.statistics, self.n_weights
        recorded = None if hessian else self.weights(step)[:n]

        def update(coordinates, state, eps):
            weights = coordinates if statistics is None else coordinates[:n]
            step_gradient, batch = gradient(weights if hessian else recorded, eps)
            moved, state = self.update(step, weights, state, step_gradient)
            if statistics is not None:
                moved = torch.cat([moved, statistics.moved(step, coordinates[n:], batch)])
            return moved, state

        return update, rows, shares


@dataclass(frozen=True)
class SweepResult:
    """What one adjoint sweep gives for ``n`` queries.

    Attributes
    ----------
    scores : ndarray of shape (n, M)
        :math:`\\partial T / \\partial \\varepsilon_i`, each row's loss weight.
    weight_scores : ndarray of shape (n, M)
        :math:`\\partial T / \\partial \\log \\omega_i`, each row's sample weight
        (with the batches' normalisation).
    values : ndarray of shape (n,)
        :math:`T(x; w_S)`.
    adjoint_norms : ndarray of shape (S + 1, n)
        :math:`\\|\\lambda_s\\|` of every query at every step (row ``S`` is
        :math:`\\|\\nabla_w T(x; w_S)\\|`): the adjoint's growth along the run.
    """

    scores: np.ndarray
    weight_scores: np.ndarray
    values: np.ndarray
    adjoint_norms: np.ndarray


class AdjointSweep:
    """The reverse sweep of a :class:`TrainingRun`, batched over queries.

    Parameters
    ----------
    run : TrainingRun

    Attributes
    ----------
    replay_error : float
        After :meth:`replay`: the largest ``|U_s(w_s, state_s, G_s) - w_{s+1}|``
        over steps and weights, relative to the largest step ``|w_{s+1} - w_s|``
        (with BatchNorm, the same of the running statistics, relative to their
        largest move, if larger): how exactly the differentiated update map
        reproduces the recorded run (rounding, about 1e-15, when it is the run's
        optimiser). Beyond
        :func:`replay_tolerance` the sweep is refused (``ValueError``): its scores
        would be the derivative of another run. Computed independently of the
        sweep's scores: each step's update from the recorded weights, against the
        next recorded weights.
    """

    def __init__(self, run):
        self.run = run
        self._states = None
        self.replay_error = None

    def replay(self):
        """The optimiser's state before every step, by replaying the run from the
        recorded weights (one gradient per step); also sets :attr:`replay_error`.
        Memory ``8 S n_state W`` bytes, on the host. Returns the list of states."""
        if self._states is not None:
            return self._states
        run = self.run
        coordinates = run.weights(0)
        state = run.update.initial_state(coordinates[: run.n_weights])
        # the weights, and BatchNorm's running statistics, each against its own moves
        parts = [slice(0, run.n_weights)]
        if run.statistics is not None:
            parts.append(slice(run.n_weights, None))
        states, error, largest = [], [0.0] * len(parts), [0.0] * len(parts)
        for step in range(run.n_steps):
            states.append(tuple(t.cpu() for t in state))
            update, rows, _ = run.step_function(step)
            eps = torch.zeros(rows.shape[0], dtype=coordinates.dtype, device=coordinates.device)
            with torch.no_grad():
                moved, state = update(coordinates, state, eps)
                following = run.weights(step + 1)
                for k, part in enumerate(parts):
                    error[k] = max(error[k], float((moved[part] - following[part]).abs().max()))
                    move = float((following[part] - coordinates[part]).abs().max())
                    largest[k] = max(largest[k], move)
            coordinates = following
        self.replay_error = max(
            e / scale if scale > 0 else e for e, scale in zip(error, largest, strict=True)
        )
        tolerance = replay_tolerance(run.training_dtype)
        if not self.replay_error <= tolerance:
            raise ValueError(
                "Counterfactual attribution refused: the differentiated steps do not "
                "reproduce the recorded run (they land "
                f"{self.replay_error:.3g} of the largest step from the recorded weights, "
                f"beyond the {tolerance:g} of rounding in "
                f"{str(run.training_dtype).removeprefix('torch.')}); their derivative "
                "would be another run's. A part of the training step the sweep does not "
                "model (a layer that is random or batch-dependent in training, a setting "
                "the optimiser's update map does not read) makes that difference."
            )
        self._states = states
        return states

    def target_gradients(self, queries, target, labels, step=None):
        """:math:`T` and :math:`\\nabla_w T(x; w)` of every query: (n,), (n, W), at
        the final weights :math:`w_S` (``step=None``) or at :math:`w_{step}`."""
        run = self.run
        at = run.weights(run.n_steps if step is None else step)

        def value(weights, x, label):
            return target(run.output(weights, x[None])[0], label)

        gradients = vmap(grad(value), in_dims=(None, 0, 0))(at, queries, labels)
        with torch.no_grad():
            values = vmap(value, in_dims=(None, 0, 0))(at, queries, labels)
        return values, gradients

    def run_queries(self, queries, target, labels, hessian=True, horizon=None):
        """The :class:`SweepResult` of ``queries`` (a tensor on the device) for
        ``target`` with one ``label`` per query (a tensor); ``hessian=False`` sweeps
        the run with every step's gradient held at its recorded weights (see
        :meth:`TrainingRun.step_function`).

        ``horizon`` (private, an experiment on attribution benchmarks; None: the exact derivative)
        is a mean number of steps :math:`1/\\gamma \\ge 1`: after each step's
        pullback the adjoints become :math:`\\lambda_s \\leftarrow (1 - \\gamma)
        \\lambda_s + \\gamma \\nabla_w T(x; w_s)` and :math:`\\mu_s \\leftarrow
        (1 - \\gamma) \\mu_s`. A move at step ``s`` is then scored by the target
        ``h`` steps later, :math:`T(x; w_{\\min(s + h, S)})`, in expectation over a
        geometric ``h`` of mean :math:`1/\\gamma` (``P(h) = \\gamma (1 -
        \\gamma)^{h - 1}``, the tail at the run's end): ``horizon=1`` scores each
        step with the target's gradient at the next recorded weights (for plain SGD
        :math:`\\delta_{s,i} = \\eta_s a_{s,i} \\langle \\nabla T(w_{s+1}),
        -\\nabla l_i(w_s) \\rangle`, no later step's reaction), and a horizon much
        longer than the run is the exact derivative. Costs one more target gradient
        per step and query.
        """
        gamma = _horizon_weight(horizon)
        run = self.run
        states = self.replay()
        n, M, S = queries.shape[0], run.X.shape[0], run.n_steps
        values, adjoint = self.target_gradients(queries, target, labels)
        device, dtype = adjoint.device, adjoint.dtype
        state_adjoint = tuple(
            torch.zeros_like(adjoint[:, : run.n_weights]) for _ in range(run.update.n_state)
        )
        scores = torch.zeros((n, M), dtype=dtype, device=device)
        weight_scores = torch.zeros((n, M), dtype=dtype, device=device)
        norms = np.zeros((S + 1, n))
        norms[S] = torch.linalg.vector_norm(adjoint, dim=1).cpu().numpy()
        for step in range(S - 1, -1, -1):
            update, rows, shares = run.step_function(step, hessian)
            weights = run.weights(step)
            state = tuple(t.to(device) for t in states[step])
            eps = torch.zeros(rows.shape[0], dtype=dtype, device=device)
            try:
                _, pullback = vjp(update, weights, state, eps)
                adjoint, state_adjoint, delta = vmap(pullback)((adjoint, state_adjoint))
            except NotImplementedError as error:
                raise NotImplementedError(
                    "Counterfactual attribution differentiates each step's loss gradient "
                    "(a second derivative of the network), which torch does not give "
                    f"for an operation of this module: {error}"
                ) from error
            if gamma is not None:
                _, at_step = self.target_gradients(queries, target, labels, step)
                adjoint = (1.0 - gamma) * adjoint + gamma * at_step
                state_adjoint = tuple((1.0 - gamma) * mu for mu in state_adjoint)
            scores.index_add_(1, rows, delta)
            weight_scores.index_add_(1, rows, delta - shares * delta.sum(1, keepdim=True))
            norms[step] = torch.linalg.vector_norm(adjoint, dim=1).cpu().numpy()
        return SweepResult(
            scores=scores.cpu().numpy(),
            weight_scores=weight_scores.cpu().numpy(),
            values=values.cpu().numpy(),
            adjoint_norms=norms,
        )


def _horizon_weight(horizon):
    """:math:`\\gamma = 1 / horizon` (None for the exact sweep), or a clear error."""
    if horizon is None:
        return None
    if isinstance(horizon, bool) or not isinstance(horizon, int | float | np.integer | np.floating):
        raise TypeError(f"horizon must be a number of steps or None, got {horizon!r}.")
    if not horizon >= 1:  # also NaN
        raise ValueError(f"horizon must be a mean number of steps >= 1, got {horizon!r}.")
    return 1.0 / float(horizon)
