"""The estimators' optimiser steps as pure functions, for differentiating a run.

A step of every supported ``torch.optim`` optimiser is a map

.. math::

    (w_{s+1}, \\sigma_{s+1}) = U_s(w_s, \\sigma_s, G_s),

of the weights :math:`w_s`, the optimiser state :math:`\\sigma_s` (nothing for plain
SGD, the momentum buffer :math:`b`, Adam's moments :math:`m, v`) and the step's loss
gradient :math:`G_s`. Written with differentiable torch operations, ``torch.func.vjp``
gives the adjoint of the state alongside the weights' (the reverse mode of the exact
update, no linearisation), which is what :mod:`._adjoint` runs backward over the
path. Per rule family, with :math:`\\eta_s` the step's learning rate:

- :class:`SGDMap` (``torch.optim.SGD``, dampening 0): :math:`g = G + \\lambda w`,
  :math:`b' = \\mu b + g` (:math:`b_0 = 0`, so the first step's buffer is :math:`g`,
  as torch's), :math:`w' = w - \\eta (g + \\mu b')` with Nesterov, :math:`w' = w - \\eta
  b'` otherwise (:math:`w' = w - \\eta g` without momentum: no state);
- :class:`AdamMap` (``torch.optim.Adam``/``AdamW``, no amsgrad): AdamW first scales
  :math:`w \\leftarrow (1 - \\eta \\lambda) w`, Adam adds :math:`\\lambda w` to
  :math:`G`; then :math:`m' = \\beta_1 m + (1 - \\beta_1) g`, :math:`v' = \\beta_2 v + (1 -
  \\beta_2) g^2`, and with :math:`t = s + 1`, :math:`w' = w - \\frac{\\eta}{1 - \\beta_1^t}
  \\, m' / (\\sqrt{v'} / \\sqrt{1 - \\beta_2^t} + \\epsilon)`.

Where :math:`v' = 0` (a weight whose gradient has been exactly zero so far)
:math:`\\sqrt{v'}` is not differentiable (:math:`|g|`-like); its derivative is taken as
0 there (the subgradient at the kink), which leaves the true derivative of
:math:`g / (|g| + \\epsilon)` at :math:`g = 0`, :math:`1 / \\epsilon`.

Whether the exact adjoint is the default (:attr:`UpdateMap.stable_adjoint`) is a
property of the family. Gradient descent is stable only where :math:`\\eta_s
\\lambda_{\\max}(H_s) \\lesssim 2`, which bounds the adjoint's per-step factor
:math:`\\|I - \\eta_s H_s\\|` near 1 (measured: the pulled-back gradient grows by at
most 3.3 over 200 steps, momentum included). Adam is stable by its normalisation instead:
in its first steps :math:`\\hat v \\approx g^2`, each coordinate's step is nearly
:math:`\\mathrm{sign}(g)`, and its exact derivative divides by :math:`|g|` coordinate
by coordinate (measured: growth :math:`4 \\cdot 10^4` to :math:`10^6`, one step's
terms :math:`10^5` times the others'), linear only over perturbations far smaller than
a training row's. So Adam's default cuts the Hessian term (``hessian=False`` in
:mod:`._adjoint`).

Parameter groups (a user's own loop, :mod:`._optimizer_settings`): every
hyperparameter, and every step's learning rate, may be a number or a tensor of one
value per weight (its group's), and the maps compute elementwise with it.

A rule family's map is one :class:`UpdateMap` subclass, named by the
optimiser's rule (``OptimizerRule.step_map`` in :mod:`._optimizers`): the rule
describes the optimiser once, its step as a differentiable function included.
"""

from abc import ABC, abstractmethod

import torch


class UpdateMap(ABC):
    """One optimiser's step as a pure function of ``(w, state, G)``.

    :attr:`stable_adjoint` says whether the family's exact adjoint (with the
    Hessian term) is the default of counterfactual attribution (see the module
    docstring).

    Parameters
    ----------
    values : mapping of str to object
        The solver hyperparameters the run was trained with, by their estimator
        names (``SolverSettings.values``): numbers, or (parameter groups that
        differ) tensors of one value per weight.
    learning_rates : sequence of length n_steps, or PerWeight
        The learning rate of every step, as recorded: numbers, or (parameter
        groups whose rates differ) a :class:`PerWeight` that expands each step's
        group rates to one per weight when the step asks.
    """

    #: Whether the exact adjoint is the default (else the Hessian term is cut).
    stable_adjoint = True

    def __init__(self, values, learning_rates):
        self.weight_decay = coefficient(values["weight_decay"])
        if isinstance(learning_rates, PerWeight):
            self.learning_rates = learning_rates
        else:
            self.learning_rates = [coefficient(lr) for lr in learning_rates]

    @property
    @abstractmethod
    def n_state(self):
        """How many weight-sized tensors the state holds."""

    def initial_state(self, weights):
        """The state before the first step: zeros, a tuple of :attr:`n_state` tensors."""
        return tuple(torch.zeros_like(weights) for _ in range(self.n_state))

    @abstractmethod
    def __call__(self, step, weights, state, gradient):
        """``(w_{s+1}, state_{s+1})`` of step ``step`` from ``w_s``, ``state_s`` and
        ``G_s`` (flat tensors; the state a tuple), by differentiable operations."""

    @abstractmethod
    def loss_scaling(self, scale, parameters):
        """Estimator parameters that train exactly the run whose every loss is
        multiplied by ``scale`` (every row's loss weight ``1 + eps`` with ``eps =
        scale - 1``): the check of the scores' sum by real retraining.

        Parameters
        ----------
        scale : float
        parameters : dict
            The estimator's ``learning_rate``, ``weight_decay`` and ``epsilon``.

        Returns
        -------
        dict
            The changed parameters.
        """


class SGDMap(UpdateMap):
    """``torch.optim.SGD``: momentum (dampening 0), Nesterov, L2 weight decay."""

    stable_adjoint = True

    def __init__(self, values, learning_rates):
        super().__init__(values, learning_rates)
        self.momentum = coefficient(values["momentum"])
        nesterov = values["nesterovs_momentum"]
        if isinstance(nesterov, torch.Tensor):  # per weight (parameter groups)
            self.nesterov = nesterov.bool() & (self.momentum > 0)
        else:
            # torch (like MLPClassifier) applies Nesterov only with momentum.
            self.nesterov = bool(nesterov) and self.momentum > 0

    @property
    def n_state(self):
        return 1 if _nonzero(self.momentum) else 0

    def __call__(self, step, weights, state, gradient):
        lr = self.learning_rates[step]
        g = gradient + self.weight_decay * weights if _nonzero(self.weight_decay) else gradient
        if not _nonzero(self.momentum):
            return weights - lr * g, ()
        (buffer,) = state
        # (a group without momentum: its buffer is its gradient, as torch's direction)
        buffer = self.momentum * buffer + g
        if isinstance(self.nesterov, torch.Tensor):
            direction = torch.where(self.nesterov, g + self.momentum * buffer, buffer)
        else:
            direction = g + self.momentum * buffer if self.nesterov else buffer
        return weights - lr * direction, (buffer,)

    def loss_scaling(self, scale, parameters):
        # w - lr c (G + (lambda / c) w) = w - lr (c G + lambda w); the buffer scales by c.
        return {
            "learning_rate": _scaled(parameters["learning_rate"], scale),
            "weight_decay": parameters["weight_decay"] / scale,
        }


class AdamMap(UpdateMap):
    """``torch.optim.Adam`` (no amsgrad), with L2 weight decay added to the gradient."""

    n_state = 2
    stable_adjoint = False
    #: Whether weight decay is decoupled (AdamW) rather than an L2 term.
    decoupled_decay = False

    def __init__(self, values, learning_rates):
        super().__init__(values, learning_rates)
        self.beta_1, self.beta_2 = coefficient(values["beta_1"]), coefficient(values["beta_2"])
        self.epsilon = coefficient(values["epsilon"])

    def __call__(self, step, weights, state, gradient):
        lr = self.learning_rates[step]
        if self.decoupled_decay:
            weights = weights * (1.0 - lr * self.weight_decay)
            g = gradient
        else:
            g = gradient + self.weight_decay * weights if _nonzero(self.weight_decay) else gradient
        m, v = state
        m = self.beta_1 * m + (1.0 - self.beta_1) * g
        v = self.beta_2 * v + (1.0 - self.beta_2) * g * g
        t = step + 1
        step_size = lr / (1.0 - self.beta_1**t)
        correction = (1.0 - self.beta_2**t) ** 0.5
        denominator = _safe_sqrt(v) / correction + self.epsilon
        return weights - step_size * m / denominator, (m, v)

    def loss_scaling(self, scale, parameters):
        # m / (sqrt(v) + eps / c) = c m / (sqrt(c^2 v) + eps): Adam of c g with eps.
        changed = {"epsilon": parameters["epsilon"] / scale}
        if not self.decoupled_decay:
            changed["weight_decay"] = parameters["weight_decay"] / scale
        return changed


class PerWeight:
    """Per-step values of parameter groups, one tensor of one value per weight when
    step ``s`` asks (``values[s]``); memory: the groups' values, not ``S W`` numbers.

    Parameters
    ----------
    values : ndarray of shape (n_steps, n_groups)
    group_of : sequence of int
        Per parameter (in the flat weights' order), its group.
    numels : sequence of int
        Per parameter, its number of weights.
    dtype : torch.dtype
    device : torch.device or None
    """

    def __init__(self, values, group_of, numels, dtype=torch.float64, device=None):
        self.values = values
        self._index = torch.repeat_interleave(
            torch.as_tensor(list(group_of), device=device),
            torch.as_tensor(list(numels), device=device),
        )
        self.dtype, self.device = dtype, device

    def __len__(self):
        return len(self.values)

    def __getitem__(self, step):
        row = torch.as_tensor(self.values[step], dtype=self.dtype, device=self.device)
        return row[self._index]


def coefficient(value):
    """A hyperparameter as the maps use it: a float, or a tensor of one value per
    weight (kept as it is)."""
    return value if isinstance(value, torch.Tensor) else float(value)


def _nonzero(value):
    """Whether a coefficient (a number or a per-weight tensor) is anywhere nonzero."""
    return bool((value != 0).any()) if isinstance(value, torch.Tensor) else value != 0


class _ScaledSchedule:
    """A learning-rate schedule times a constant."""

    def __init__(self, schedule, scale):
        self.schedule, self.scale = schedule, scale

    def __call__(self, step):
        return self.schedule(step) * self.scale


def _scaled(learning_rate, scale):
    """A learning rate (a number or a schedule) times ``scale``."""
    if callable(learning_rate):
        return _ScaledSchedule(learning_rate, scale)
    return learning_rate * scale


def _safe_sqrt(v):
    """``sqrt(v)`` with derivative 0 where ``v == 0`` (instead of infinity)."""
    positive = v > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, v, torch.ones_like(v))), 0.0)


class AdamWMap(AdamMap):
    """``torch.optim.AdamW``: Adam with decoupled weight decay ``w <- (1 - eta lambda) w``."""

    decoupled_decay = True
