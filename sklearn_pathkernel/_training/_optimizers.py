"""The optimiser rules: a ``torch.optim`` optimiser read into the linear form of its updates.

The recorder (:mod:`._recorder`) does not build the optimiser: it reads, at every
step, the hyperparameters the optimiser actually used (its ``param_groups``, so
any learning-rate scheduler, warm-up or manual change is represented) and, after
the step, its state (Adam's second moments and per-parameter step counts). Each
supported optimiser is written in the form of :class:`~sklearn_pathkernel._path.UpdateRecord`,

.. math::

    g_s = G_s + \\lambda_c w_s, \\quad b_s = \\beta b_{s-1} + \\gamma g_s, \\quad
    w_{s+1} - w_s = -P_s \\odot (\\alpha b_s + \\zeta g_s) + d_s w_s,

with the step's rate :math:`r_s` (its largest learning rate, or Adam's largest step
size :math:`\\eta / (1 - \\beta_1^t)`) folded into :math:`\\alpha_s, \\zeta_s`, and what
differs between parameters into the per-coordinate scale :math:`P_s` (relative to
:math:`r_s`: all ones for SGD with one group, as the estimators' paths):

- SGD (dampening 0): :math:`\\beta = \\mu, \\gamma = 1, \\lambda_c = \\lambda`,
  :math:`(\\alpha_s, \\zeta_s) = (r_s, 0)`, or :math:`(\\mu r_s, r_s)` with Nesterov,
  and :math:`P_s = \\eta_{g,s} / r_s` on the coordinates of group :math:`g`;
- Adam and AdamW: :math:`\\beta = \\beta_1, \\gamma = 1 - \\beta_1, (\\alpha_s, \\zeta_s)
  = (r_s, 0)`, :math:`P_s = (\\eta_{g,s} / (1 - \\beta_1^{t}) / r_s) / (\\sqrt{v_s} /
  \\sqrt{1 - \\beta_{2,g}^{t}} + \\epsilon_g)` with :math:`t` the parameter's own step
  count and :math:`v_s` its second moment after the step (``max_exp_avg_sq`` with
  ``amsgrad``); Adam's weight decay is :math:`\\lambda_c`, AdamW's is
  :math:`d_s = -\\eta_s \\lambda`.

With several parameter groups, every coefficient is per parameter, its group's
(a :class:`~sklearn_pathkernel._path.Blockwise`: momentum, Nesterov flag, betas, coupled and
decoupled weight decay may differ between groups), and the form holds
elementwise; with one group (or groups that agree) they are plain numbers.

The kernel's per-step metric is :math:`P_s` (see the engine), so this split is what
makes a recorded estimator run's kernel the same as before: bitwise, for one group.

A parameter without a gradient at a step is skipped by torch.optim: its
coordinates get :math:`P_s = 0` and no decoupled decay (:math:`d_s = 0` there).
What the form cannot hold is refused by :class:`RecordingRefused`: a group's
momentum, betas, Nesterov flag or coupled weight decay that changes during the
run (only learning rates, and so decoupled decays, and Adam's ``eps`` and
``beta_2`` may change), dampening, ``maximize``, and a skipped parameter whose
momentum buffer torch.optim would hold still while the linear form decays it.

Each optimiser is described once, by its :class:`OptimizerRule`: the rule reads
a ``torch.optim`` instance of its class into the linear form (for the estimators'
runs and a user's own loop alike, both recorded by the same recorder) and, as an
estimator solver, builds that instance from the estimator's hyperparameters
(:meth:`OptimizerRule.build`). A new optimiser is one :class:`OptimizerRule`
subclass, registered with :func:`register_optimizer` (under a solver name too
if the estimators should offer it).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .._path import block_values, blockwise
from ._hyperparameters import BETA_1, BETA_2, EPSILON, MOMENTUM, NESTEROVS_MOMENTUM, WEIGHT_DECAY
from ._update_maps import AdamMap, AdamWMap, SGDMap


class RecordingRefused(ValueError):
    """A training run whose exact path kernel cannot be recorded; the message
    names the step and the cause."""


@dataclass(frozen=True)
class LinearForm:
    """The step-independent constants of an optimiser's linear form.

    Attributes
    ----------
    buffer_decay, gradient_scale, coupled_decay : float or Blockwise
        :math:`\\beta`, :math:`\\gamma`, :math:`\\lambda_c` (per parameter where
        the groups differ).
    gradient_rate, direct_rate : float or Blockwise
        :math:`\\alpha` and :math:`\\zeta`, before the per-coordinate scale.
    preconditioned : bool
        Whether the scale differs from the learning rate (Adam).
    """

    buffer_decay: object
    gradient_scale: object
    coupled_decay: object
    gradient_rate: object
    direct_rate: object
    preconditioned: bool


@dataclass(frozen=True)
class StepScales:
    """One step's per-parameter scales and its decoupled decay.

    Attributes
    ----------
    scales : list of (float or torch.Tensor)
        Per path parameter: its :math:`P_s` (a number for every coordinate, or
        a tensor of the parameter's shape, or flat); 0 for a skipped parameter. With
        ``adam_terms``, the tensors are Adam's second moments ``v``, and
        :math:`P_s` follows from them later (:func:`adam_scale`), off the loop.
    decoupled_decay : float or Blockwise
        :math:`d_s` (per parameter where the groups differ; 0 on skipped ones).
    adam_terms : list of (float, float, float) or None
        Per path parameter: ``(step_size / rate, correction, eps)`` of
        :func:`adam_scale`; ``(0, 1, 1)`` for a skipped parameter.
    rate : float
        The step's rate, folded into :math:`\\alpha_s, \\zeta_s` rather than into
        :math:`P_s`: the largest learning rate (SGD) or step size (Adam) of the
        step, so that ``scales`` are relative to it (all ones with one group).
        The kernel's per-step metric is :math:`P_s` (the Gram of a plain SGD run
        carries no learning rate), so the split follows the estimators'.
    flat : bool, default=False
        Whether ``scales`` are 1-d host tensors, one per parameter, in the
        parameters' dtypes (the step log then writes them with one ``torch.cat``).
    arrays : list of ndarray or None, default=None
        With ``flat``: numpy views of ``scales``, when every one has such a view
        (the step log then writes them with one ``numpy.concatenate``).
    learning_rate : float or None, default=None
        The largest learning rate of the used groups, when the rule read it (the
        step log's display rate; read from the groups otherwise).
    """

    scales: list
    decoupled_decay: object
    adam_terms: list = None
    rate: float = 1.0
    flat: bool = False
    arrays: list = None
    learning_rate: float = None


def _relative(values, active):
    """The largest value among active parameters, and each value relative to it
    (0 for skipped ones): exactly 1.0 where a value equals the largest."""
    if all(active):
        rate = max(values, default=0.0)
        if rate != 0:
            return rate, [v / rate for v in values]
    rate = max((v for v, on in zip(values, active, strict=True) if on), default=0.0)
    if rate == 0:
        return 0.0, [0.0 if not on else 1.0 for on in active]
    return rate, [v / rate if on else 0.0 for v, on in zip(values, active, strict=True)]


def adam_scale(second, step_size, correction, eps):
    """torch.optim.Adam's scale, in place on ``second`` (``v``, or
    ``max_exp_avg_sq``): ``step_size / (sqrt(v) / correction + eps)``, with the
    arguments numbers or tensors that broadcast against ``second``. The same
    operations, in the same order and dtype, as ``_single_tensor_adam``."""
    return second.sqrt_().div_(correction).add_(eps).reciprocal_().mul_(step_size)


def _number(value):
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class OptimizerRule(ABC):
    """One ``torch.optim`` optimiser: how its steps read into the linear form, and
    how an estimator builds it.

    An instance reads the steps of one optimiser (:meth:`before_step`,
    :meth:`after_step`); the class builds one for an estimator (:meth:`build`)
    from its declared :attr:`hyperparameters`.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
    params : list of torch.nn.Parameter
        The recorded parameters, in the path's order; each must be in one of the
        optimiser's groups.
    names : list of str
        Their names in the module (for the messages).
    """

    #: The ``torch.optim`` class the rule reads and builds (exactly: a subclass
    #: may change the step, so it is refused, not assumed).
    optimizer_class = None
    #: The rule's own estimator hyperparameters (every rule also takes
    #: :data:`~._hyperparameters.WEIGHT_DECAY`).
    hyperparameters = ()
    #: What the solver is, for the ``solver`` parameter's doc.
    summary = ""
    #: Whether weight decay is decoupled (:math:`d_s`) rather than an L2 term
    #: (:math:`\\lambda_c`), for the parameter docs.
    decoupled_decay = False
    #: The step as a differentiable function (an :class:`~._update_maps.UpdateMap`
    #: class), for counterfactual attribution; None where it has none.
    step_map = None

    @classmethod
    def all_hyperparameters(cls):
        """The rule's hyperparameters, weight decay last."""
        return (*cls.hyperparameters, WEIGHT_DECAY)

    @classmethod
    def build(cls, params, learning_rate, values):
        """The optimiser an estimator trains ``params`` with, at ``learning_rate``,
        from ``values`` (``{name: value}`` of :meth:`all_hyperparameters`)."""
        return cls.optimizer_class(params, lr=learning_rate, **cls.optimizer_arguments(values))

    @classmethod
    @abstractmethod
    def optimizer_arguments(cls, values):
        """The ``optimizer_class`` keyword arguments of the estimator's hyperparameter
        ``values`` (``{name: value}``), learning rate aside."""

    def __init__(self, optimizer, params, names):
        self.optimizer, self.params, self.names = optimizer, params, names
        where = {
            id(p): k for k, group in enumerate(optimizer.param_groups) for p in group["params"]
        }
        missing = [name for p, name in zip(params, names, strict=True) if id(p) not in where]
        if missing:
            raise RecordingRefused(
                f"The parameters {missing} require a gradient but are not in the optimiser: "
                "they would stay constant while the kernel moves them. Freeze them with "
                "requires_grad_(False) before creating the recorder, or give them to the optimiser."
            )
        self.group_of = [where[id(p)] for p in params]
        self.numels = [p.numel() for p in params]
        self._used = sorted(set(self.group_of))
        self._form, self._form_settings = None, None
        self._had_state = [False] * len(params)
        self._skipped = [False] * len(params)

    @classmethod
    def step_values(cls, group):
        """The differentiable step of a recorded loop's parameter group: its
        :class:`~._update_maps.UpdateMap` class and the values it takes (estimator
        names, learning rate aside) of ``group``'s settings, for counterfactual
        attribution; or :class:`RecordingRefused` naming the setting it cannot take."""
        raise RecordingRefused(
            f"Counterfactual attribution has no differentiable step (step_map) for "
            f"torch.optim.{cls.optimizer_class.__name__}."
        )

    def used_groups(self):
        """The indices (into ``param_groups``) of the groups that hold recorded
        parameters, and each recorded parameter's position among them."""
        return list(self._used), [self._used.index(k) for k in self.group_of]

    def skipped_names(self):
        """The recorded parameters some step skipped (no gradient), by name."""
        return [name for name, skipped in zip(self.names, self._skipped, strict=True) if skipped]

    def groups(self):
        """The parameter groups that hold recorded parameters."""
        return [self.optimizer.param_groups[k] for k in self._used]

    def per_parameter(self, value):
        """``value(group)`` (a number) of each recorded parameter's group, as a
        coefficient of the linear form: a number when every parameter's is the same,
        else a :class:`~sklearn_pathkernel._path.Blockwise`."""
        groups = self.optimizer.param_groups
        by_group = {k: float(value(groups[k])) for k in self._used}
        if len(by_group) == 1:  # (the same number blockwise() would give, sooner)
            return by_group[self._used[0]]
        return blockwise([by_group[k] for k in self.group_of], self.numels)

    def form(self, step, settings=None):
        """The linear form of step ``step``, checked to be the same at every step
        (built again only when the settings it is made of change); ``settings``:
        the used groups' :meth:`form_settings`, when already read."""
        if settings is None:
            settings = [self.form_settings(group) for group in self.groups()]
        if settings == self._form_settings:
            return self._form
        form = self.linear_form(step)
        if self._form is not None and form != self._form:
            raise RecordingRefused(
                f"Step {step}: the optimiser's momentum, betas, Nesterov flag or coupled "
                f"weight decay changed during the run ({self._form} before, {form} now); "
                "only the learning rates (and Adam's eps, beta_2) may change between steps."
                + self._cycling_hint()
            )
        self._form, self._form_settings = form, settings
        return form

    def _cycling_hint(self):
        """The scheduler that changes the momentum, when its marks are in the groups."""
        if any("max_momentum" in group for group in self.groups()):
            return (
                " A scheduler cycles the momentum (Adam's beta_1, SGD's momentum): "
                "OneCycleLR or CyclicLR with cycle_momentum=True, their default; pass "
                "cycle_momentum=False to cycle the learning rate only."
            )
        return ""

    def check_skips(self, step, active, form, removed):
        """Refuse skipped parameters (no gradient) the linear form cannot hold;
        ``removed`` flags those the backward pass reached (their gradient was set
        to None by hand, so the kernel's gradient there is not zero)."""
        if all(active) and not any(self._skipped):  # (the loop below's outcome, sooner)
            self._had_state = [True] * len(active)
            return
        n = len(self.params)
        buffer_decay = block_values(form.buffer_decay, n)
        coupled_decay = block_values(form.coupled_decay, n)
        for index, (is_active, name) in enumerate(zip(active, self.names, strict=True)):
            if not is_active:
                if buffer_decay[index] and self._had_state[index]:
                    raise RecordingRefused(
                        f"Step {step}: parameter {name!r} has no gradient but has a momentum "
                        "buffer, which torch.optim holds still while the linear form decays it."
                    )
                if buffer_decay[index] and removed[index]:
                    raise RecordingRefused(
                        f"Step {step}: the gradient of parameter {name!r} was removed after the "
                        "backward pass (set to None), so torch.optim skips it, while the linear "
                        "form's momentum buffer takes the backward pass's gradient."
                    )
                self._skipped[index] = True
            else:
                if self._skipped[index] and buffer_decay[index] and coupled_decay[index]:
                    raise RecordingRefused(
                        f"Step {step}: parameter {name!r} was skipped (no gradient) in earlier "
                        "steps under momentum with coupled weight decay; the linear form's "
                        "buffer would hold that decay."
                    )
                self._had_state[index] = True

    def settings_key(self):
        """Everything :meth:`step_values` reads from the used groups, as read for the
        current step by :meth:`before_step` (numbers, flags and names, in the used
        groups' order; learning rates left out), so that equal keys mean equal
        ``step_values``; None when the rule does not know it (then ``step_values``
        is read at every step)."""
        return None

    def recorded_form(self):
        """The linear form of the recorded steps (the current settings' before any)."""
        return self._form if self._form is not None else self.linear_form(0)

    @abstractmethod
    def check_options(self, step):
        """Refuse the options (per group) the linear form cannot represent."""

    @abstractmethod
    def form_settings(self, group):
        """The settings of ``group`` that :meth:`linear_form` is made of (numbers and
        flags: a tensor setting changed in place is a new value)."""

    @abstractmethod
    def linear_form(self, step):
        """The :class:`LinearForm` of the optimiser's current settings."""

    @abstractmethod
    def before_step(self, step, active, removed):
        """Read what the step will use (before ``optimizer.step``); ``active`` and
        ``removed`` per parameter, as :meth:`check_skips`."""

    @abstractmethod
    def after_step(self, step, active):
        """The step's :class:`StepScales`, from the state after the step."""


#: The rules, by the exact ``torch.optim`` class they read.
OPTIMIZER_RULES = {}
#: The rules the estimators offer, by their ``solver`` name.
SOLVERS = {}


def register_optimizer(solver=None):
    """Class decorator: register an :class:`OptimizerRule` for its
    ``optimizer_class`` (recorded loops) and, with ``solver``, as that estimator
    solver. The one registration a new optimiser needs."""

    def register(rule):
        OPTIMIZER_RULES[rule.optimizer_class] = rule
        if solver is not None:
            SOLVERS[solver] = rule
        return rule

    return register


@register_optimizer("sgd")
class SGDRule(OptimizerRule):
    """``torch.optim.SGD``: momentum (dampening 0), Nesterov, L2 weight decay."""

    optimizer_class = torch.optim.SGD
    hyperparameters = (MOMENTUM, NESTEROVS_MOMENTUM)
    step_map = SGDMap
    summary = "gradient descent, with optional ``momentum``"

    @classmethod
    def optimizer_arguments(cls, values):
        momentum = float(values["momentum"])
        return {
            "momentum": momentum,
            # torch (like MLPClassifier) applies Nesterov only with momentum.
            "nesterov": bool(values["nesterovs_momentum"]) and momentum > 0,
            "weight_decay": float(values["weight_decay"]),
        }

    @classmethod
    def step_values(cls, group):
        return SGDMap, {
            "momentum": _number(group["momentum"]),
            "nesterovs_momentum": bool(group["nesterov"]) and _number(group["momentum"]) > 0,
            "weight_decay": _number(group["weight_decay"]),
        }

    def check_options(self, step):
        for group in self.groups():
            if group.get("maximize", False):
                raise RecordingRefused(f"Step {step}: SGD with maximize=True is not supported.")
            if group["momentum"] and group["dampening"]:
                raise RecordingRefused(
                    f"Step {step}: SGD with dampening={group['dampening']} is not represented "
                    "exactly (torch.optim does not dampen the first step); use dampening=0."
                )

    def form_settings(self, group):
        return (
            _number(group["momentum"]),
            bool(group["nesterov"]),
            _number(group["weight_decay"]),
        )

    def linear_form(self, step):
        momentum = self.per_parameter(lambda group: _number(group["momentum"]))

        def nesterov(group):
            return bool(group["nesterov"]) and _number(group["momentum"]) > 0

        decay = self.per_parameter(lambda group: _number(group["weight_decay"]))
        # (alpha, zeta) = (mu, 1) with Nesterov, (1, 0) without
        gradient_rate = self.per_parameter(
            lambda group: _number(group["momentum"]) if nesterov(group) else 1.0
        )
        direct_rate = self.per_parameter(lambda group: 1.0 if nesterov(group) else 0.0)
        return LinearForm(momentum, 1.0, decay, gradient_rate, direct_rate, preconditioned=False)

    def before_step(self, step, active, removed):
        self.check_options(step)
        form = self.form(step)
        self.check_skips(step, active, form, removed)
        groups = self.optimizer.param_groups
        self._rates = [_number(groups[k]["lr"]) for k in self.group_of]

    def settings_key(self):
        # (step_values reads momentum, nesterov and weight decay: the form's settings,
        # which form() leaves equal to the step's)
        return self._form_settings

    def after_step(self, step, active):
        rate, scales = _relative(self._rates, active)
        # (the largest learning rate of the used groups: each has a parameter here)
        return StepScales(scales, 0.0, rate=rate, learning_rate=max(self._rates))


@register_optimizer("adam")
class AdamRule(OptimizerRule):
    """``torch.optim.Adam`` (also with ``amsgrad`` or ``decoupled_weight_decay`` when
    read from a user's loop), exactly as torch computes the step: ``denom = sqrt(v) /
    sqrt(1 - beta_2^t) + eps``, step size ``lr / (1 - beta_1^t)``, with ``t`` the
    parameter's own step count."""

    optimizer_class = torch.optim.Adam
    hyperparameters = (BETA_1, BETA_2, EPSILON)
    step_map = AdamMap
    summary = "Adam"

    @classmethod
    def optimizer_arguments(cls, values):
        return {
            "betas": (float(values["beta_1"]), float(values["beta_2"])),
            "eps": float(values["epsilon"]),
            "weight_decay": float(values["weight_decay"]),
        }

    def __init__(self, optimizer, params, names):
        super().__init__(optimizer, params, names)
        self._held = [None] * len(params)  # per parameter: its _StateViews
        self._views_of_held = None  # their _HeldViews, while the same views are held
        self._settings_key = None  # (read by before_step)

    @classmethod
    def step_values(cls, group):
        if group["amsgrad"]:
            raise RecordingRefused(
                "Counterfactual attribution has no differentiable step for Adam with "
                "amsgrad=True (the running maximum of the second moments)."
            )
        decoupled = cls.decoupled_decay or bool(group.get("decoupled_weight_decay", False))
        return AdamWMap if decoupled else AdamMap, {
            "beta_1": _number(group["betas"][0]),
            "beta_2": _number(group["betas"][1]),
            "epsilon": _number(group["eps"]),
            "weight_decay": _number(group["weight_decay"]),
        }

    def _decoupled(self, group):
        return bool(group.get("decoupled_weight_decay", False)) or isinstance(
            self.optimizer, torch.optim.AdamW
        )

    def check_options(self, step):
        for group in self.groups():
            if group.get("maximize", False):
                raise RecordingRefused(f"Step {step}: Adam with maximize=True is not supported.")

    def form_settings(self, group):
        return (
            _number(group["betas"][0]),
            self._decoupled(group),
            _number(group["weight_decay"]),
        )

    def linear_form(self, step):
        beta_1 = self.per_parameter(lambda group: _number(group["betas"][0]))
        gradient_scale = self.per_parameter(lambda group: 1.0 - _number(group["betas"][0]))
        coupled = self.per_parameter(
            lambda group: 0.0 if self._decoupled(group) else _number(group["weight_decay"])
        )
        return LinearForm(beta_1, gradient_scale, coupled, 1.0, 0.0, preconditioned=True)

    def before_step(self, step, active, removed):
        groups = self.optimizer.param_groups
        # each used group read once, before the step (what the step uses): its
        # options, form settings and decoupled decay, and for after_step its
        # learning rate, betas, eps and second moment's name
        settings, by_group, step_settings, key = [], {}, {}, []
        for k in self._used:
            group = groups[k]
            if group.get("maximize", False):
                self.check_options(step)  # (refuses, naming the option)
            decoupled = self._decoupled(group)
            decay = _number(group["weight_decay"])
            betas = group["betas"]
            beta_1, lr = _number(betas[0]), _number(group["lr"])
            settings.append((beta_1, decoupled, decay))
            # torch.optim skips a parameter without a gradient: no decay there
            by_group[k] = -(lr * decay) if decoupled else 0.0
            step_settings[k] = (
                lr,
                beta_1,
                _number(betas[1]),
                _number(group["eps"]),
                "max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq",
            )
            key.append((*step_settings[k][1:], decoupled, decay))
        self._step_settings, self._settings_key = step_settings, key
        form = self.form(step, settings)
        self.check_skips(step, active, form, removed)
        if len(by_group) == 1 and all(active):  # (blockwise's outcome, sooner)
            self._decoupled_decay = by_group[self._used[0]]
        else:
            decays = [
                by_group[k] if on else 0.0 for k, on in zip(self.group_of, active, strict=True)
            ]
            self._decoupled_decay = blockwise(decays, self.numels)

    def settings_key(self):
        # (step_values reads betas, eps, weight decay, amsgrad and the decoupled flag)
        return self._settings_key

    def after_step(self, step, active):
        settings = self._step_settings  # (read before the step)
        learning_rate = max([value[0] for value in settings.values()])
        states = self.optimizer.state
        held = self._held
        if self._all_active(active):
            # the usual step (every parameter updated): per parameter its state's
            # views (kept while the optimiser holds the same tensors) and step count
            counts = []
            for index, param in enumerate(self.params):
                lr, beta_1, beta_2, group_eps, second = settings[self.group_of[index]]
                state = states[param]
                count, moment = state["step"], state[second]
                kept = held[index]
                if (
                    kept is None
                    or kept.count_tensor is not count
                    or kept.moment_tensor is not moment
                ):
                    kept = held[index] = _StateViews(count, moment)
                    self._views_of_held = None
                counts.append(
                    float(kept.count_view) if kept.count_view is not None else kept.count()
                )
            views = self._views_of_held
            if views is None:
                views = self._views_of_held = _HeldViews(held)
            if views.seconds is not None and counts.count(counts[0]) == len(counts):
                # one step count (and, with one group, one set of terms) for all
                return self._uniform_scales(settings, counts[0], views, learning_rate)
        seconds, sizes, corrections, eps = [], [], [], []
        terms = {}  # per (group, step count): computed once
        flat = True
        parameters = zip(self.params, self.group_of, active, strict=True)
        for index, (param, k, on) in enumerate(parameters):
            if not on:
                seconds.append(0.0)
                sizes.append(0.0)
                corrections.append(1.0)
                eps.append(1.0)
                flat = False
                continue
            lr, beta_1, beta_2, group_eps, second = settings[k]
            state = states[param]
            count, moment = state["step"], state[second]
            kept = held[index]
            if kept is None or kept.count_tensor is not count or kept.moment_tensor is not moment:
                kept = held[index] = _StateViews(count, moment)
                self._views_of_held = None
            # (the views' fields read here rather than through their methods: a
            # call less per parameter and step)
            count = float(kept.count_view) if kept.count_view is not None else kept.count()
            term = terms.get((k, count))
            if term is None:
                # torch.optim.Adam, step by step (_single_tensor_adam).
                term = terms[k, count] = (lr / (1 - beta_1**count), (1 - beta_2**count) ** 0.5)
            sizes.append(term[0])
            corrections.append(term[1])
            eps.append(group_eps)
            # (flat: a view of the optimiser's own tensor, copied by the step log)
            if kept.flat is not None:
                seconds.append(kept.flat)
                flat = flat and kept.on_host
            else:
                seconds.append(kept.moment())
                flat = False
        rate, relative = _relative(sizes, active)
        terms = list(zip(relative, corrections, eps, strict=True))
        return StepScales(
            seconds, self._decoupled_decay, terms, rate, flat, learning_rate=learning_rate
        )

    def _all_active(self, active):
        return active.count(True) == len(active)

    def _uniform_scales(self, settings, count, views, learning_rate):
        """The :class:`StepScales` of a step that updated every parameter, all at the
        same step ``count``: the same numbers as the general case's loop, with the
        terms computed once per group (flat host views of the second moments)."""
        if len(self._used) == 1:
            # one group: one step size, its own rate, so each relative size is 1.0
            # (x / x), unless it is 0 or not finite (then as _relative makes it)
            lr, beta_1, beta_2, group_eps, _ = settings[self._used[0]]
            size = lr / (1 - beta_1**count)
            if 0 < size < float("inf"):
                term = (1.0, (1 - beta_2**count) ** 0.5, group_eps)
                return StepScales(
                    views.seconds,
                    self._decoupled_decay,
                    [term] * len(self.params),
                    size,
                    views.on_host,
                    views.arrays,
                    learning_rate,
                )
        terms = {}
        sizes, corrections, eps = [], [], []
        for k in self.group_of:
            term = terms.get(k)
            if term is None:
                lr, beta_1, beta_2, group_eps, _ = settings[k]
                # torch.optim.Adam, step by step (_single_tensor_adam).
                term = terms[k] = (lr / (1 - beta_1**count), (1 - beta_2**count) ** 0.5, group_eps)
            sizes.append(term[0])
            corrections.append(term[1])
            eps.append(term[2])
        rate, relative = _relative(sizes, [True] * len(sizes))
        terms = list(zip(relative, corrections, eps, strict=True))
        return StepScales(
            views.seconds,
            self._decoupled_decay,
            terms,
            rate,
            views.on_host,
            views.arrays,
            learning_rate,
        )


class _HeldViews:
    """The flat second moments of all parameters (their :class:`_StateViews`), as the
    lists a step's :class:`StepScales` takes, made once while the views are kept.

    Parameters
    ----------
    held : list of _StateViews
    """

    def __init__(self, held):
        flats = [kept.flat for kept in held]
        #: The flat views, one per parameter (None when one is not contiguous).
        self.seconds = None if any(f is None for f in flats) else flats
        self.on_host = self.seconds is not None and all(kept.on_host for kept in held)
        arrays = [kept.array for kept in held]
        #: Numpy views of them (None unless every one has one).
        self.arrays = None if not self.on_host or any(a is None for a in arrays) else arrays


class _StateViews:
    """Views of one parameter's Adam state, kept while the optimiser holds the same
    tensors (torch.optim updates them in place): the step count through numpy (read
    without a torch call, when it is a host tensor) and the second moment flat.

    Parameters
    ----------
    count : torch.Tensor or number
        ``state["step"]``.
    moment : torch.Tensor
        ``state["exp_avg_sq"]`` (or ``"max_exp_avg_sq"``).
    """

    def __init__(self, count, moment):
        self.count_tensor, self.moment_tensor = count, moment
        #: A numpy view of the step count (None when it is not a host tensor).
        self.count_view = _scalar_view(count)
        #: The second moment, flat (a view; None when it is not contiguous).
        self.flat = moment.detach().view(-1) if moment.is_contiguous() else None
        self.on_host = self.flat is not None and moment.is_cpu
        #: A numpy view of the flat second moment (None unless a host tensor of a
        #: numpy dtype).
        self.array = (
            self.flat.numpy()
            if self.on_host and moment.dtype in (torch.float64, torch.float32, torch.float16)
            else None
        )

    def holds(self, count, moment):
        """Whether these are views of ``count`` and ``moment``."""
        return self.count_tensor is count and self.moment_tensor is moment

    def moment(self):
        """The second moment now, flat (a view; a copy when it is not contiguous)."""
        if self.flat is not None:
            return self.flat
        return self.moment_tensor.detach().reshape(-1)

    def count(self):
        """The step count now, as a float."""
        if self.count_view is not None:
            return float(self.count_view)
        return _number(self.count_tensor)


def _scalar_view(value):
    """A numpy view of a one-number host tensor (read without a torch call), else None."""
    if isinstance(value, torch.Tensor) and value.is_cpu and value.numel() == 1:
        if value.dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
            return value.detach().numpy()
    return None


@register_optimizer("adamw")
class AdamWRule(AdamRule):
    """``torch.optim.AdamW``: Adam with decoupled weight decay ``w <- (1 - eta lambda) w``."""

    optimizer_class = torch.optim.AdamW
    summary = "Adam with decoupled weight decay"
    decoupled_decay = True
    step_map = AdamWMap


def rule_for(optimizer, params, names):
    """The :class:`OptimizerRule` reading ``optimizer``, or a refusal naming it."""
    rule = OPTIMIZER_RULES.get(type(optimizer))
    if rule is None:
        supported = ", ".join(f"torch.optim.{c.__name__}" for c in OPTIMIZER_RULES)
        raise RecordingRefused(
            f"The optimiser {type(optimizer).__name__} cannot be recorded exactly; "
            f"supported: {supported}."
        )
    return rule(optimizer, params, names)
