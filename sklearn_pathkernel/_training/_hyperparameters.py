"""Solver hyperparameters as estimator parameters: their names, defaults, constraints
and docs, declared once and shared by the optimiser rules that take them."""

from dataclasses import dataclass
from numbers import Real

from sklearn.utils._param_validation import Interval


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
    """

    name: str
    default: object
    constraints: tuple
    description: str
    kind: str = "float"


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
