"""The estimators' solver settings, derived from the registered optimiser rules.

An estimator's ``solver`` names a rule registered with
:func:`~._optimizers.register_optimizer` (:data:`~._optimizers.SOLVERS`); every
rule declares its hyperparameters (:class:`~._hyperparameters.Hyperparameter`),
from which the estimators' solver settings (:class:`SolverSettings`), parameter
constraints (:func:`solver_constraints`) and parameter docs follow. Nothing here
knows a particular optimiser.
"""

from types import MappingProxyType

from sklearn.utils._param_validation import StrOptions

from ._hyperparameters import WEIGHT_DECAY
from ._optimizers import SOLVERS


def solver_hyperparameters():
    """Every registered rule's hyperparameters, each once, ``{name: Hyperparameter}``,
    in registration order (weight decay last)."""
    found = {}
    for rule in SOLVERS.values():
        for hyperparameter in rule.all_hyperparameters():
            found.setdefault(hyperparameter.name, hyperparameter)
    weight_decay = found.pop(WEIGHT_DECAY.name)
    return MappingProxyType({**found, weight_decay.name: weight_decay})


def solvers_taking(name):
    """The registered solvers whose rule takes the hyperparameter ``name``, in order."""
    return [
        solver
        for solver, rule in SOLVERS.items()
        if any(h.name == name for h in rule.all_hyperparameters())
    ]


def solver_constraints():
    """The estimators' ``_parameter_constraints`` of ``solver`` and every hyperparameter."""
    return {
        # the registry's live view: a solver registered later is accepted too
        "solver": [StrOptions(SOLVERS.keys())],
        **{name: list(h.constraints) for name, h in solver_hyperparameters().items()},
    }


class SolverSettings:
    """An estimator's solver and the values of every registered hyperparameter.

    Parameters
    ----------
    solver : str, default="sgd"
        A key of :data:`~._optimizers.SOLVERS`.
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

    @property
    def rule(self):
        """The registered optimiser rule (class) of ``solver``."""
        if self.solver not in SOLVERS:
            raise ValueError(f"Unknown solver {self.solver!r}; expected one of {sorted(SOLVERS)}.")
        return SOLVERS[self.solver]

    def update_map(self, learning_rates):
        """The solver's step as a differentiable function (its rule's
        ``step_map``) over the recorded ``learning_rates``, or a clear error."""
        step_map = self.rule.step_map
        if step_map is None:
            raise ValueError(
                f"Counterfactual attribution has no differentiable step for the solver "
                f"{self.solver!r}; supported: "
                f"{sorted(name for name, rule in SOLVERS.items() if rule.step_map)}."
            )
        return step_map(self.values, learning_rates)

    def optimizer(self, params, learning_rate):
        """The ``torch.optim`` optimiser of ``solver`` with these settings, training
        ``params`` at ``learning_rate``."""
        rule = self.rule
        return rule.build(
            params, learning_rate, {h.name: self.values[h.name] for h in rule.all_hyperparameters()}
        )

    def schedule(self, learning_rates):
        """These settings over a run's recorded ``learning_rates`` (one per step): what
        :func:`~._stated_loss.retrain` trains again with, as a recording's
        :class:`~._optimizer_settings.OptimizerSettings`."""
        return SolverSchedule(self, tuple(float(rate) for rate in learning_rates))


class SolverSchedule:
    """An estimator's solver over its recorded learning rates.

    Parameters
    ----------
    settings : SolverSettings
    learning_rates : tuple of float
        Every step's learning rate.
    """

    def __init__(self, settings, learning_rates):
        self.settings = settings
        self.learning_rates = learning_rates

    def optimizer(self, params):
        """A fresh optimiser of the solver over ``params``."""
        return self.settings.optimizer(params, self.learning_rates[0])

    def set_step(self, optimizer, step):
        """Give ``optimizer`` step ``step``'s learning rate (every group)."""
        for group in optimizer.param_groups:
            group["lr"] = self.learning_rates[step]
