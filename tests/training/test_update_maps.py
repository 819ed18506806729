"""The update maps are torch.optim's steps, as pure functions (checked against torch.optim)."""

import numpy as np
import pytest
import torch

from sklearn_pathkernel._training import SOLVERS, SolverSettings
from sklearn_pathkernel._training._optimizers import SGDRule
from sklearn_pathkernel._training._update_maps import AdamMap, SGDMap

SETTINGS = {
    "sgd": SolverSettings("sgd"),
    "sgd-decay": SolverSettings("sgd", weight_decay=0.1),
    "momentum": SolverSettings("sgd", momentum=0.9),
    "nesterov-decay": SolverSettings(
        "sgd", momentum=0.8, nesterovs_momentum=True, weight_decay=0.05
    ),
    "adam": SolverSettings("adam", beta_1=0.8, beta_2=0.95, epsilon=1e-6),
    "adam-decay": SolverSettings("adam", weight_decay=0.1),
    "adamw": SolverSettings("adamw", weight_decay=0.2),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_map_takes_torch_optims_steps(name):
    """Five steps with random gradients and learning rates: the map's weights equal
    torch.optim's to rounding."""
    settings = SETTINGS[name]
    rng = np.random.default_rng(0)
    rates = rng.uniform(0.01, 0.1, 5)
    param = torch.nn.Parameter(torch.tensor(rng.normal(size=7)))
    optimizer = settings.optimizer([param], float(rates[0]))
    step_map = settings.update_map(rates)
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
    assert SETTINGS["sgd"].update_map([0.1]).n_state == 0
    assert SETTINGS["momentum"].update_map([0.1]).n_state == 1
    assert SETTINGS["adam"].update_map([0.1]).n_state == 2
    assert isinstance(SETTINGS["sgd"].update_map([0.1]), SGDMap)
    assert isinstance(SETTINGS["adamw"].update_map([0.1]), AdamMap)


def test_adam_is_differentiable_where_a_moment_is_zero():
    """A weight whose gradient has been 0 has v = 0: sqrt(v)'s derivative is taken as 0,
    not NaN, which leaves the true derivative of ``g / (|g| + eps)`` at 0, ``1 / eps``."""
    step_map = SolverSettings("adam").update_map([0.1])
    weights = torch.zeros(3, dtype=torch.float64)
    state = step_map.initial_state(weights)
    gradient = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64, requires_grad=True)
    moved, _ = step_map(0, weights, state, gradient)
    (derivative,) = torch.autograd.grad(moved.sum(), gradient)
    assert torch.isfinite(derivative).all()
    torch.testing.assert_close(derivative[0], torch.tensor(-0.1 / 1e-8, dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_loss_scaling_trains_the_scaled_loss(name):
    """Steps with the parameters of ``loss_scaling(c)`` on gradients G are the steps on c G."""
    settings = SETTINGS[name]
    parameters = {
        "learning_rate": 0.05,
        "weight_decay": settings.values["weight_decay"],
        "epsilon": settings.values["epsilon"],
    }
    changed = {**parameters, **settings.update_map([0.05]).loss_scaling(1.3, parameters)}
    scaled_settings = SolverSettings(
        settings.solver,
        **{
            **settings.values,
            "weight_decay": changed["weight_decay"],
            "epsilon": changed["epsilon"],
        },
    )
    rng = np.random.default_rng(1)
    weights, gradients = torch.tensor(rng.normal(size=4)), torch.tensor(rng.normal(size=(3, 4)))
    plain = settings.update_map([0.05] * 3)
    scaled = scaled_settings.update_map([changed["learning_rate"]] * 3)
    a, b = weights, weights
    state_a, state_b = plain.initial_state(a), scaled.initial_state(b)
    for step, gradient in enumerate(gradients):
        a, state_a = plain(step, a, state_a, 1.3 * gradient)
        b, state_b = scaled(step, b, state_b, gradient)
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_a_solver_without_a_differentiable_step_is_refused():
    class Plain(SGDRule):
        """SGD offered as another solver, without its step map."""

        step_map = None

    saved = dict(SOLVERS)
    try:
        SOLVERS["plain"] = Plain  # a solver only (reading SGD stays SGDRule's)
        with pytest.raises(ValueError, match="no differentiable step for the solver 'plain'"):
            SolverSettings("plain").update_map([0.1])
    finally:
        SOLVERS.clear()
        SOLVERS.update(saved)
