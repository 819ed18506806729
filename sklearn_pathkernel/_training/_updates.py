"""Update rules: the torch.optim updates the estimators train with, written as linear
in the training gradients.

Every supported optimiser is, once the run's own preconditioner is taken as given,

.. math::

    g_s &= G_s + \\lambda_c w_s, \\qquad b_s = \\beta b_{s-1} + \\gamma g_s
    \\quad (b_{-1} = 0), \\\\
    w_{s+1} - w_s &= -P_s \\odot (\\alpha_s b_s + \\zeta_s g_s) + d_s w_s,

with :math:`G_s` the gradient of step :math:`s`'s batch loss at :math:`w_s`,
:math:`\\lambda_c` coupled weight decay (an L2 term in the gradient), :math:`b_s` the
momentum buffer, :math:`P_s` an elementwise preconditioner (ones for SGD), and
:math:`d_s` decoupled weight decay. Per torch.optim (dampening 0), with
:math:`\\eta_s` the learning rate of step :math:`s`:

- SGD: :math:`\\beta = 0, \\gamma = 1, \\alpha_s = \\eta_s, \\zeta_s = 0, d_s = 0`;
- SGD with momentum :math:`\\mu`: :math:`\\beta = \\mu`, otherwise as SGD;
- Nesterov momentum (``g + mu b``): :math:`\\beta = \\mu, \\alpha_s = \\mu \\eta_s,
  \\zeta_s = \\eta_s`;
- Adam: :math:`\\beta = \\beta_1, \\gamma = 1 - \\beta_1, \\alpha_s = \\eta_s /
  (1 - \\beta_1^{s+1}), \\zeta_s = 0`, and
  :math:`P_s = 1 / (\\sqrt{v_s / (1 - \\beta_2^{s+1})} + \\epsilon)` from the run's
  second moments :math:`v_s`;
- AdamW: as Adam with :math:`\\lambda_c = 0` and :math:`d_s = -\\eta_s \\lambda`
  (the weights are multiplied by :math:`1 - \\eta_s \\lambda` first).

With several parameter groups, the constants and rates are per parameter
(:class:`~sklearn_pathkernel._path.Blockwise`, one value per parameter, from its group) and the
form holds elementwise; with one group they are numbers, as above.

A new optimiser is one :class:`UpdateRule` subclass registered in :data:`UPDATE_RULES`;
its hyperparameters are :class:`Hyperparameter` declarations on the class, from which
the estimators' solver settings (:class:`SolverSettings`), parameter constraints
(:func:`solver_constraints`) and parameter docs follow.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from numbers import Real
from types import MappingProxyType

import torch
from sklearn.utils._param_validation import Interval, StrOptions


@dataclass(frozen=True)
class Hyperparameter:
    """A solver hyperparameter, as an estimator parameter.

    Attributes
    ----------
    name : str
        The estimators' parameter (``MLPClassifier``'s name where it has one).
    default : object
        Its default (an estimator may choose another in its signature).
    constraints : tuple
        scikit-learn parameter constraints (``_parameter_constraints`` entries).
    description : str
        Its numpydoc description. ``{solvers}`` stands for the solvers that take
        it; ``{coupled}`` and ``{decoupled}`` for those among them whose weight
        decay is an L2 term or decoupled.
    kind : str, default="float"
        Its type in the parameter docs.
    argument : str or None, default=None
        The rule's keyword argument, when it differs from ``name``.
    """

    name: str
    default: object
    constraints: tuple
    description: str
    kind: str = "float"
    argument: str = None

    @property
    def keyword(self):
        """The :class:`UpdateRule` keyword argument that takes the value."""
        return self.argument or self.name


_UNIT = (Interval(Real, 0, 1, closed="left"),)

MOMENTUM = Hyperparameter(
    "momentum", 0.0, _UNIT, "Momentum of {solvers} (dampening 0, as ``torch.optim.SGD``)."
)
NESTEROVS_MOMENTUM = Hyperparameter(
    "nesterovs_momentum",
    False,
    ("boolean",),
    "Nesterov momentum for {solvers} (only with ``momentum > 0``).",
    kind="bool",
    argument="nesterov",
)
BETA_1 = Hyperparameter("beta_1", 0.9, _UNIT, "Decay of the first-moment estimate of {solvers}.")
BETA_2 = Hyperparameter("beta_2", 0.999, _UNIT, "Decay of the second-moment estimate of {solvers}.")
EPSILON = Hyperparameter(
    "epsilon",
    1e-8,
    (Interval(Real, 0, None, closed="neither"),),
    "Added to the denominator of {solvers}.",
)
WEIGHT_DECAY = Hyperparameter(
    "weight_decay",
    0.0,
    (Interval(Real, 0, None, closed="left"),),
    "Weight decay, exactly as torch.optim: an L2 term added to the gradient\n"
    "for {coupled}, decoupled (``w <- (1 - lr weight_decay) w``) for {decoupled}.\n"
    "What it moves is reported apart from the training points' contributions\n"
    "(``decompose(X).decay``).",
)


class UpdateRule(ABC):
    """One torch.optim update in the linear form of the module docstring.

    Subclasses build the optimizer the estimators train with (the recorder reads
    each step's linear form from the optimizer itself, see ``_optimizers``), give
    the rates :math:`\\alpha_s, \\zeta_s, d_s` of a constant-hyperparameter run, and
    declare their :attr:`hyperparameters`: ``from_settings`` passes each value to the rule's
    keyword argument of the same name (:attr:`Hyperparameter.keyword`).
    """

    #: :math:`\\beta`, :math:`\\gamma`
    buffer_decay = 0.0
    gradient_scale = 1.0
    #: whether weight decay is decoupled (:math:`d_s`) rather than an L2 term (:math:`\\lambda_c`)
    decoupled_decay = False
    #: The rule's own hyperparameters (every rule also takes :data:`WEIGHT_DECAY`).
    hyperparameters = ()
    #: What the solver is, for the ``solver`` parameter's doc.
    summary = ""

    def __init__(self, *, weight_decay=0.0):
        self.weight_decay = float(weight_decay)

    @classmethod
    def all_hyperparameters(cls):
        """The rule's hyperparameters, weight decay last."""
        return (*cls.hyperparameters, WEIGHT_DECAY)

    @classmethod
    def from_settings(cls, settings):
        """The rule for an estimator's :class:`SolverSettings`."""
        return cls(**{h.keyword: settings.values[h.name] for h in cls.all_hyperparameters()})

    @property
    def coupled_decay(self):
        """:math:`\\lambda_c`: weight decay added to the gradient (L2); 0 when decoupled."""
        return 0.0 if self.decoupled_decay else self.weight_decay

    @abstractmethod
    def optimizer(self, params, learning_rate):
        """The ``torch.optim.Optimizer`` that trains ``params``."""

    @abstractmethod
    def rates(self, learning_rate, step):
        """``(alpha_s, zeta_s, d_s)`` of step ``step`` (0-based) at ``learning_rate``."""


class SGDUpdate(UpdateRule):
    """``torch.optim.SGD`` with momentum (dampening 0), Nesterov and L2 weight decay."""

    hyperparameters = (MOMENTUM, NESTEROVS_MOMENTUM)
    summary = "gradient descent, with optional ``momentum``"

    def __init__(self, *, momentum=0.0, nesterov=False, weight_decay=0.0):
        super().__init__(weight_decay=weight_decay)
        self.momentum = float(momentum)
        # torch (like MLPClassifier) applies Nesterov only with momentum.
        self.nesterov = bool(nesterov) and self.momentum > 0
        self.buffer_decay = self.momentum

    def optimizer(self, params, learning_rate):
        return torch.optim.SGD(
            params,
            lr=learning_rate,
            momentum=self.momentum,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
        )

    def rates(self, learning_rate, step):
        if self.nesterov:
            return self.momentum * learning_rate, learning_rate, 0.0
        return learning_rate, 0.0, 0.0


class AdamUpdate(UpdateRule):
    """``torch.optim.Adam`` (no amsgrad), with L2 weight decay added to the gradient."""

    hyperparameters = (BETA_1, BETA_2, EPSILON)
    summary = "Adam"
    #: The torch.optim class that takes the steps.
    optimizer_class = torch.optim.Adam

    def __init__(self, *, beta_1=0.9, beta_2=0.999, epsilon=1e-8, weight_decay=0.0):
        super().__init__(weight_decay=weight_decay)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        self.buffer_decay, self.gradient_scale = self.beta_1, 1.0 - self.beta_1

    def optimizer(self, params, learning_rate):
        return self.optimizer_class(
            params,
            lr=learning_rate,
            betas=(self.beta_1, self.beta_2),
            eps=self.epsilon,
            weight_decay=self.weight_decay,
        )

    def rates(self, learning_rate, step):
        return learning_rate / (1.0 - self.beta_1 ** (step + 1)), 0.0, 0.0


class AdamWUpdate(AdamUpdate):
    """``torch.optim.AdamW``: Adam with decoupled weight decay ``w <- (1 - eta lambda) w``."""

    optimizer_class = torch.optim.AdamW
    decoupled_decay = True
    summary = "Adam with decoupled weight decay"

    def rates(self, learning_rate, step):
        alpha, zeta, _ = super().rates(learning_rate, step)
        return alpha, zeta, -learning_rate * self.weight_decay


#: The solvers, by the name the estimators' ``solver`` parameter takes.
UPDATE_RULES = {"sgd": SGDUpdate, "adam": AdamUpdate, "adamw": AdamWUpdate}


def solver_hyperparameters():
    """Every registered rule's hyperparameters, each once, ``{name: Hyperparameter}``,
    in registration order (weight decay last)."""
    found = {}
    for rule in UPDATE_RULES.values():
        for hyperparameter in rule.all_hyperparameters():
            found.setdefault(hyperparameter.name, hyperparameter)
    weight_decay = found.pop(WEIGHT_DECAY.name)
    return MappingProxyType({**found, weight_decay.name: weight_decay})


def solvers_taking(name):
    """The registered solvers whose rule takes the hyperparameter ``name``, in order."""
    return [
        solver
        for solver, rule in UPDATE_RULES.items()
        if any(h.name == name for h in rule.all_hyperparameters())
    ]


def solver_constraints():
    """The estimators' ``_parameter_constraints`` of ``solver`` and every hyperparameter."""
    return {
        "solver": [StrOptions(set(UPDATE_RULES))],
        **{name: list(h.constraints) for name, h in solver_hyperparameters().items()},
    }


class SolverSettings:
    """An estimator's solver and the values of every registered hyperparameter.

    Parameters
    ----------
    solver : str, default="sgd"
        A key of :data:`UPDATE_RULES`.
    **values
        Hyperparameter values by name (:func:`solver_hyperparameters`); those not
        given take their declared default.
    """

    def __init__(self, solver="sgd", **values):
        known = solver_hyperparameters()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise TypeError(f"Unknown solver hyperparameters {unknown}; expected {list(known)}.")
        self.solver = solver
        self.values = MappingProxyType(
            {name: values.get(name, h.default) for name, h in known.items()}
        )

    @classmethod
    def of(cls, estimator):
        """The settings of an estimator (its ``solver`` and hyperparameter attributes)."""
        return cls(
            estimator.solver,
            **{name: getattr(estimator, name) for name in solver_hyperparameters()},
        )

    def update_rule(self):
        """The registered :class:`UpdateRule` of ``solver``, with these settings."""
        if self.solver not in UPDATE_RULES:
            raise ValueError(
                f"Unknown solver {self.solver!r}; expected one of {sorted(UPDATE_RULES)}."
            )
        return UPDATE_RULES[self.solver].from_settings(self)
