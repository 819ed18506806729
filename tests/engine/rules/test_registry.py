"""make_rule: the registry picks the rule registered for a module's exact type.

A module type without a rule, a subclass of a registered type, or a
configuration the registered rule declines gets the generic torch.func rule;
a module without parameters in the path gets none.
"""

import pytest
import torch
from torch import nn

from sklearn_pathkernel import DistanceLayer
from sklearn_pathkernel._engine.rules import make_rule
from sklearn_pathkernel._engine.rules._conv import Conv2dRule
from sklearn_pathkernel._engine.rules._distance import DistanceRule
from sklearn_pathkernel._engine.rules._generic import GenericRule
from sklearn_pathkernel._engine.rules._linear import LinearRule
from sklearn_pathkernel._engine.rules._registry import RULES, register_rule


def names_of(module, prefix="m."):
    return {f"{prefix}{name}" for name, _ in module.named_parameters()}


class ScaledLinear(nn.Linear):
    """A subclass may change ``forward``: not matched by the ``nn.Linear`` rule."""

    def forward(self, x):
        return 2.0 * super().forward(x)


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (nn.Linear(3, 2), LinearRule),
        (nn.Conv2d(1, 2, 3), Conv2dRule),
        (DistanceLayer(3, 2, "rbf"), DistanceRule),
        (DistanceLayer(3, 2, "laplacian"), GenericRule),  # declined: no factored form
        (nn.Conv2d(2, 2, 3, groups=2), GenericRule),  # declined configuration
        (nn.Conv2d(1, 2, 3, padding="same"), GenericRule),
        (ScaledLinear(3, 2), GenericRule),  # exact types only
        (nn.LayerNorm(3), GenericRule),  # no rule registered
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, nn.Module) else None,
)
def test_make_rule_picks_the_registered_rule(module, expected):
    assert type(make_rule(module, "m.", names_of(module))) is expected


def test_parameters_outside_the_path():
    layer = nn.Linear(3, 2)
    assert make_rule(layer, "m.", {"other.weight"}) is None
    rule = make_rule(layer, "m.", {"m.bias"})
    assert (rule.weight_name, rule.bias_name, rule.path_names) == (None, "m.bias", ["m.bias"])
    generic = make_rule(nn.LayerNorm(3), "", {"bias"})
    assert (generic.local_names, generic.path_names) == (["bias"], ["bias"])


def test_registering_a_rule_and_refusing_a_second_one(monkeypatch):
    class Doubler(nn.Linear):
        pass

    monkeypatch.setitem(RULES, Doubler, LinearRule)  # restored after the test
    assert type(make_rule(Doubler(3, 2), "m.", names_of(Doubler(3, 2)))) is LinearRule
    with pytest.raises(ValueError, match="already registered"):
        register_rule(nn.Linear)(GenericRule)
    assert RULES[nn.Linear] is LinearRule


def test_the_rule_refers_to_the_module_it_was_made_for():
    layer = nn.Linear(3, 2).to(torch.float64)
    assert make_rule(layer, "", {"weight"}).module is layer
