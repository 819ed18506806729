"""The training loop: torch.optim run by hand on a tiny network, the record of every
step (weights, batches, output gradients, learning rates), early stopping, refusals."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel._training import SolverSettings
from sklearn_pathkernel._training._loop import train_module
from sklearn_pathkernel._training._losses import SquaredError

DTYPE = torch.float64


def tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DTYPE)


def data(n=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=gen, dtype=DTYPE)
    y = torch.arange(n) % 2
    weight = torch.rand(n, generator=gen, dtype=DTYPE) + 0.5
    return X, y, weight


def test_weights_are_torch_optim_run_by_hand_with_sample_weights_and_batches():
    X, y, weight = data()
    module = tiny()
    schedule = lambda step: 0.3 / (1 + step)  # noqa: E731
    result = train_module(
        module,
        X,
        y,
        sample_weight=weight,
        solver=SolverSettings("sgd", momentum=0.5),
        learning_rate=schedule,
        max_iter=3,
        batch_size=4,
        random_state=0,
    )
    path = result.path
    assert result.n_steps == path.n_steps == 9 and result.n_iter == 3
    by_hand = tiny()
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=schedule(0), momentum=0.5)
    for step, batch in enumerate(path.batches):
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        optimizer.zero_grad()
        index = torch.as_tensor(batch)
        share = weight[index] / weight[index].sum()
        losses = F.cross_entropy(by_hand(X[index]), y[index], reduction="none")
        (share * losses).sum().backward()
        optimizer.step()
        flat = torch.cat([p.detach().reshape(-1) for p in by_hand.parameters()])
        torch.testing.assert_close(path.weights[step + 1], flat, rtol=0, atol=1e-14)
    np.testing.assert_array_equal(path.learning_rates, [schedule(s) for s in range(9)])
    for mine, theirs in zip(module.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-14)


def test_recorded_output_gradients_are_minus_the_loss_gradient_in_f():
    X, _, weight = data()
    targets = torch.randn(10, 2, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    path = train_module(
        tiny(), X, targets, loss=SquaredError(), sample_weight=weight, max_iter=2, batch_size=5
    ).path
    module = tiny()
    for step, batch in enumerate(path.batches):
        torch.nn.utils.vector_to_parameters(path.weights[step], module.parameters())
        index = torch.as_tensor(batch)
        f = module(X[index]).detach()
        share = weight[index] / weight[index].sum()
        expected = share[:, None] * (targets[index] - f) / 2  # e = a (y - f) / K
        torch.testing.assert_close(path.output_gradients[step], expected, rtol=0, atol=1e-15)


def test_full_batch_steps_share_one_index_array():
    X, y, _ = data()
    path = train_module(tiny(), X, y, max_iter=3).path
    assert all(batch is path.batches[0] for batch in path.batches)
    np.testing.assert_array_equal(path.batches[0], np.arange(10))


def test_early_stopping_keeps_only_the_steps_taken():
    X, y, _ = data()
    result = train_module(
        tiny(), X, y, learning_rate=1e-12, max_iter=50, tol=1.0, n_iter_no_change=2
    )
    # The first epoch sets the best loss; two epochs without improvement follow.
    assert result.n_iter == 3 == result.n_steps == len(result.loss_curve)
    assert result.path.weights.shape[0] == 4 and len(result.path.batches) == 3
    assert result.path.update.gradient_rates.shape == (3,)


def test_frozen_parameters_are_not_recorded_and_all_frozen_is_refused():
    X, y, _ = data()
    module = tiny()
    module[0].weight.requires_grad_(False)
    path = train_module(module, X, y, max_iter=1).path
    assert path.param_names == ["0.bias", "2.weight", "2.bias"]
    for param in module.parameters():
        param.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        train_module(module, X, y, max_iter=1)
