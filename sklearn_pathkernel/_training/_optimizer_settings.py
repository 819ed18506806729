"""The optimiser's settings at every recorded step of a user's loop.

The recorder reads each step of a user's optimiser into the linear form of its update
(:mod:`._optimizers`): rates and Adam's preconditioner :math:`P_s` as the step used
them. Differentiating the run (counterfactual attribution) or training it again needs
the optimiser's step itself, which the linear form does not determine (Adam's
:math:`\\beta_2` and :math:`\\epsilon` are inside :math:`P_s`). :class:`SettingsLog`
hooks the optimiser beside the recorder and keeps, per step, every recorded group's
learning rate, and once the group's other settings;
:class:`OptimizerSettings` turns them into the step as a differentiable function (the
rule's :class:`~._update_maps.UpdateMap`, with per-weight values where the parameter
groups differ) and into a fresh ``torch.optim`` optimiser that takes the same steps.

Only the learning rates may change along the run (schedulers, warm-up, manual
changes); a run whose map cannot be the optimiser's step says why
(:attr:`OptimizerSettings.refusal`): another setting changed, a parameter was skipped
(no gradient) at a step, or the optimiser held state (a momentum buffer, Adam's
moments) from before the recorder.
"""

import copy
from dataclasses import dataclass, replace

import numpy as np
import torch

from ._optimizers import OPTIMIZER_RULES, RecordingRefused
from ._update_maps import PerWeight


@dataclass(frozen=True)
class OptimizerSettings:
    """What a recorded loop's optimiser did at every step, beyond the linear form.

    Attributes
    ----------
    optimizer_class : type
        The ``torch.optim`` class.
    groups : tuple of dict
        Per recorded group (a group holding recorded parameters): its settings at
        the first step, ``params`` left out.
    learning_rates : ndarray of shape (n_steps, n_groups)
        Every step's learning rate of every recorded group.
    group_of : tuple of int
        Per path parameter, its group (an index into ``groups``).
    numels : tuple of int
        Per path parameter, its number of weights.
    refusal : str or None
        Why the steps are not the optimiser's step of these settings (None when
        they are).
    """

    optimizer_class: type
    groups: tuple
    learning_rates: np.ndarray
    group_of: tuple
    numels: tuple
    refusal: str | None = None

    @property
    def n_steps(self):
        return self.learning_rates.shape[0]

    def truncated(self, n_steps):
        """The settings of the first ``n_steps`` steps (early stopping)."""
        return replace(self, learning_rates=self.learning_rates[:n_steps])

    def _require(self):
        if self.refusal is not None:
            raise RecordingRefused(self.refusal)

    def _per_weight(self, values, dtype, device):
        """One value per group as a number (all the same) or a per-weight tensor."""
        if all(v == values[0] for v in values):
            return values[0]
        per_parameter = [float(values[k]) for k in self.group_of]
        return torch.repeat_interleave(
            torch.tensor(per_parameter, dtype=dtype, device=device),
            torch.tensor(self.numels, device=device),
        )

    def update_map(self, dtype=torch.float64, device=None):
        """The run's step as a differentiable function: the rule's
        :class:`~._update_maps.UpdateMap` over the recorded learning rates, its
        settings per weight where the groups differ; or :class:`RecordingRefused`."""
        self._require()
        rule = OPTIMIZER_RULES[self.optimizer_class]
        found = [rule.step_values(group) for group in self.groups]
        classes = {cls for cls, _ in found}
        if len(classes) > 1:
            raise RecordingRefused(
                "Counterfactual attribution needs one kind of step for every parameter "
                f"group; these groups take {sorted(c.__name__ for c in classes)} (e.g. Adam "
                "groups with and without decoupled_weight_decay)."
            )
        values = {
            name: self._per_weight([v[name] for _, v in found], dtype, device)
            for name in found[0][1]
        }
        rates = self.learning_rates
        if (rates == rates[:, :1]).all():
            rates = rates[:, 0]
        else:  # (expanded per weight step by step: S W numbers are a path's worth)
            rates = PerWeight(rates, self.group_of, self.numels, dtype, device)
        return found[0][0](values, rates)

    def optimizer(self, params):
        """A fresh ``optimizer_class`` over ``params`` (the path's parameters, in
        order) with the recorded groups' settings."""
        self._require()
        groups = [{**copy.deepcopy(settings), "params": []} for settings in self.groups]
        for param, k in zip(params, self.group_of, strict=True):
            groups[k]["params"].append(param)
        return self.optimizer_class(groups)

    def set_step(self, optimizer, step):
        """Give ``optimizer`` (:meth:`optimizer`'s) step ``step``'s learning rates."""
        for group, rate in zip(optimizer.param_groups, self.learning_rates[step], strict=True):
            group["lr"] = float(rate)


class SettingsLog:
    """Keeps a recorded optimiser's settings at every step (:class:`OptimizerSettings`).

    Register :meth:`before_step` and :meth:`after_step` as the optimiser's step
    hooks after the recorder's (so a step the recorder refuses is not kept). Cost
    per step: one learning rate per recorded group; the other settings are compared
    with the first step's through the rule's ``step_values``, read again only when
    the rule's :meth:`~._optimizers.OptimizerRule.settings_key` (what
    ``step_values`` reads, as the rule read it for the step) differs from the last
    step's.

    Parameters
    ----------
    rule : OptimizerRule
        The recorder's rule of the optimiser.
    """

    def __init__(self, rule):
        self.rule = rule
        self._used, self._group_of = rule.used_groups()
        self._groups, self._values, self._rates = None, None, []
        self._refusal = None
        self._key = None  # the rule's settings_key of the last step read

    def before_step(self, optimizer, args, kwargs):
        if self._rates or self._refusal is not None:
            return
        held = [name for p, name in zip(self.rule.params, self.rule.names, strict=True)
                if optimizer.state.get(p)]  # fmt: skip
        if held:
            self._refusal = (
                f"The optimiser held state (momentum buffers, Adam's moments or step "
                f"counts) for {held[:3]} from before the recorder was created: the "
                "recorded run does not start from the optimiser's initial state, so its "
                "steps cannot be taken again. Create the optimiser and the recorder together."
            )

    def after_step(self, optimizer, args, kwargs):
        groups = [optimizer.param_groups[k] for k in self._used]
        step = len(self._rates)
        self._rates.append([float(group["lr"]) for group in groups])
        if self._refusal is not None:
            return
        key = self.rule.settings_key()
        if key is not None and self._groups is not None and key == self._key:
            return  # (the settings step_values reads are the last step's: the same values)
        try:
            values = [self.rule.step_values(group) for group in groups]
        except RecordingRefused as refusal:
            self._refusal = str(refusal)
            return
        if self._groups is None:
            self._groups = tuple(
                {name: copy.deepcopy(value) for name, value in group.items() if name != "params"}
                for group in groups
            )
            self._values = values
            self._key = key
        elif values == self._values:
            self._key = key
        else:
            changed = _changed(self._values, values)
            self._refusal = (
                f"Step {step}: the optimiser's {changed} changed during the run; only the "
                "learning rates may change for the optimiser's step to be taken again "
                "(counterfactual attribution, retraining)."
            )

    def settings(self, n_steps):
        """The :class:`OptimizerSettings` of the first ``n_steps`` recorded steps."""
        refusal = self._refusal
        skipped = self.rule.skipped_names()
        if refusal is None and skipped:
            refusal = (
                f"The parameters {skipped[:3]} had no gradient at some step, which "
                "torch.optim skips (no update, no state change), while the optimiser's "
                "step as a function moves every weight."
            )
        rates = np.asarray(self._rates, dtype=float).reshape(-1, len(self._used))[:n_steps]
        return OptimizerSettings(
            optimizer_class=type(self.rule.optimizer),
            groups=self._groups if self._groups is not None else (),
            learning_rates=rates,
            group_of=tuple(self._group_of),
            numels=tuple(self.rule.numels),
            refusal=refusal if n_steps else "The recording has no steps.",
        )


def _changed(before, now):
    """The setting (and group) whose value differs, for the refusal's message."""
    for k, ((_, old), (_, new)) in enumerate(zip(before, now, strict=True)):
        for name in old:
            if old[name] != new[name]:
                return f"{name} of parameter group {k} ({old[name]} -> {new[name]})"
    return "kind of step"
