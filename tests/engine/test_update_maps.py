"""The update maps are torch.optim's steps, as pure functions (checked against torch.optim)."""

import numpy as np
import pytest
import torch

from sklearn_pathkernel._engine._update_maps import AdamMap, SGDMap, update_map
from sklearn_pathkernel._training._updates import AdamUpdate, AdamWUpdate, SGDUpdate

RULES = {
    "sgd": SGDUpdate(),
    "sgd-decay": SGDUpdate(weight_decay=0.1),
    "momentum": SGDUpdate(momentum=0.9),
    "nesterov-decay": SGDUpdate(momentum=0.8, nesterov=True, weight_decay=0.05),
    "adam": AdamUpdate(beta_1=0.8, beta_2=0.95, epsilon=1e-6),
    "adam-decay": AdamUpdate(weight_decay=0.1),
    "adamw": AdamWUpdate(weight_decay=0.2),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_the_map_takes_torch_optims_steps(name):
    """Five steps with random gradients and learning rates: the map's weights equal
    torch.optim's to rounding."""
    rule = RULES[name]
    rng = np.random.default_rng(0)
    rates = rng.uniform(0.01, 0.1, 5)
    param = torch.nn.Parameter(torch.tensor(rng.normal(size=7)))
    optimizer = rule.optimizer([param], float(rates[0]))
    step_map = update_map(rule, rates)
    weights = param.detach().clone()
    state = step_map.initial_state(weights)
    for step, rate in enumerate(rates):
        gradient = torch.tensor(rng.normal(size=7))
        for group in optimizer.param_groups:
            group["lr"] = float(rate)
        param.grad = gradient.clone()
        optimizer.step()
        weights, state = step_map(step, weights, state, gradient)
        torch.testing.assert_close(weights, param.detach(), rtol=1e-14, atol=1e-15)


def test_the_state_is_what_the_rule_keeps():
    assert SGDMap(SGDUpdate(), [0.1]).n_state == 0
    assert SGDMap(SGDUpdate(momentum=0.5), [0.1]).n_state == 1
    assert AdamMap(AdamUpdate(), [0.1]).n_state == 2


def test_adam_is_differentiable_where_a_moment_is_zero():
    """A weight whose gradient has been 0 has v = 0: sqrt(v)'s derivative is taken as 0,
    not NaN, which leaves the true derivative of ``g / (|g| + eps)`` at 0, ``1 / eps``."""
    rule = AdamUpdate()
    step_map = update_map(rule, [0.1])
    weights = torch.zeros(3, dtype=torch.float64)
    state = step_map.initial_state(weights)
    gradient = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64, requires_grad=True)
    moved, _ = step_map(0, weights, state, gradient)
    (derivative,) = torch.autograd.grad(moved.sum(), gradient)
    assert torch.isfinite(derivative).all()
    torch.testing.assert_close(derivative[0], torch.tensor(-0.1 / 1e-8, dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(RULES))
def test_loss_scaling_trains_the_scaled_loss(name):
    """One step with the parameters of ``loss_scaling(c)`` on gradient G is the step on c G."""
    rule = RULES[name]
    parameters = {
        "learning_rate": 0.05,
        "weight_decay": rule.weight_decay,
        "epsilon": getattr(rule, "epsilon", 1e-8),
    }
    changed = {**parameters, **update_map(rule, [0.05]).loss_scaling(1.3, parameters)}
    scaled_rule = type(rule)(
        **{
            key: value
            for key, value in {**rule.__dict__, "weight_decay": changed["weight_decay"],
                               "epsilon": changed["epsilon"]}.items()
            if key in _arguments(rule)
        }
    )  # fmt: skip
    rng = np.random.default_rng(1)
    weights, gradients = torch.tensor(rng.normal(size=4)), torch.tensor(rng.normal(size=(3, 4)))
    plain, scaled = (
        update_map(rule, [0.05] * 3),
        update_map(scaled_rule, [changed["learning_rate"]] * 3),
    )
    a, b = weights, weights
    state_a, state_b = plain.initial_state(a), scaled.initial_state(b)
    for step, gradient in enumerate(gradients):
        a, state_a = plain(step, a, state_a, 1.3 * gradient)
        b, state_b = scaled(step, b, state_b, gradient)
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def _arguments(rule):
    names = {"weight_decay"}
    if isinstance(rule, SGDUpdate):
        return names | {"momentum", "nesterov"}
    return names | {"beta_1", "beta_2", "epsilon"}


def test_an_unknown_rule_is_refused():
    class Other(SGDUpdate):
        pass

    with pytest.raises(ValueError, match="no update map for Other"):
        update_map(Other(), [0.1])
