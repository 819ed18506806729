"""BatchNorm's running statistics as coordinates of the path (``_path/_batchnorm.py``).

Independent computations: torch's own BatchNorm layers (their running statistics
after a training-mode pass; their eval-mode output), and the widened path's update
record checked coordinate by coordinate.
"""

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_pathkernel._path import (
    Blockwise,
    RunningStatistics,
    UpdateRecord,
    WeightPath,
    averaging_factor,
    differentiable_statistics,
    row_shares,
    with_running_statistics,
)


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.BatchNorm1d(3), (7, 3)),
        (nn.BatchNorm1d(3), (5, 3, 4)),
        (nn.BatchNorm2d(3), (4, 3, 2, 5)),
        (nn.BatchNorm1d(3, momentum=None), (6, 3)),
        (nn.BatchNorm2d(3, momentum=0.7, affine=False), (3, 3, 3, 3)),
    ],
    ids=["1d", "1d-length", "2d", "cumulative", "2d-no-affine"],
)
def test_row_shares_add_up_to_torch_s_update(layer, shape):
    """The rows' shares add up to the move of torch's own running statistics (unbiased
    variance, momentum or 1 / num_batches_tracked), several passes in a row."""
    layer = layer.double().train()
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        h = 2 * torch.randn(shape, generator=generator, dtype=torch.float64) + 1
        mean, var = layer.running_mean.clone(), layer.running_var.clone()
        layer(h)
        shares = row_shares(h, mean, var, averaging_factor(layer))
        assert shares.shape == (shape[0], 6)
        move = torch.cat([layer.running_mean - mean, layer.running_var - var])
        assert (shares.sum(0) - move).abs().max() <= 1e-15


def test_a_single_value_per_channel_is_refused():
    with pytest.raises(ValueError, match="more than one value per channel"):
        row_shares(torch.ones(1, 3), torch.zeros(3), torch.ones(3), 0.1)


@pytest.mark.parametrize("affine", [True, False])
def test_the_differentiable_forward_is_torch_s_eval_forward(affine):
    torch.manual_seed(0)
    layer = nn.BatchNorm2d(3, affine=affine).double().eval()
    with torch.no_grad():
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
        if affine:
            layer.weight.uniform_(0.5, 2)
            layer.bias.uniform_(-1, 1)
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    expected = layer(x)
    module = nn.Sequential(layer)
    differentiable_statistics(module)
    assert (module(x) - expected).abs().max() <= 1e-14
    # ... and differentiable in the running statistics (F.batch_norm is not)
    mean = layer.running_mean.clone().requires_grad_(True)
    out = torch.func.functional_call(module, {"0.running_mean": mean}, (x,))
    (gradient,) = torch.autograd.grad(out.sum(), mean)
    scale = layer.weight if affine else torch.ones(3, dtype=torch.float64)
    analytic = -scale / torch.sqrt(layer.running_var + layer.eps) * 16
    assert (gradient - analytic.detach()).abs().max() <= 1e-12


def small_path(preconditioners=None, coupled_decay=0.0, decoupled=(0.0, 0.0)):
    weights = torch.arange(3 * 5, dtype=torch.float64).reshape(3, 5)
    update = UpdateRecord(
        buffer_decay=0.9,
        gradient_scale=1.0,
        coupled_decay=coupled_decay,
        gradient_rates=np.array([0.1, 0.1]),
        direct_rates=np.zeros(2),
        decoupled_decays=np.array(decoupled, dtype=float),
        preconditioners=preconditioners,
    )
    stats = RunningStatistics(
        ["1.running_mean", "1.running_var"],
        [(2,), (2,)],
        torch.arange(3 * 4, dtype=torch.float64).reshape(3, 4) / 10,
        [torch.ones(4, 4), torch.ones(4, 4)],
        ["1"],
        [{"1": 0.1}, {"1": 0.1}],
    )
    return WeightPath(
        weights,
        [np.arange(4), np.arange(4)],
        [torch.zeros(4, 2), torch.zeros(4, 2)],
        np.array([0.1, 0.1]),
        ["0.weight", "0.bias"],
        [(2, 2), (1,)],
        update=update,
        running_statistics=stats,
    )


def test_the_widened_path_holds_the_statistics_as_coordinates():
    path = small_path(
        preconditioners=torch.full((2, 5), 3.0), coupled_decay=0.01, decoupled=(0.02, 0.0)
    )
    widened = with_running_statistics(path)
    assert widened.param_names == ["0.weight", "0.bias", "1.running_mean", "1.running_var"]
    assert widened.n_weights == 9
    assert torch.equal(widened.weights[:, :5], path.weights)
    assert torch.equal(widened.weights[:, 5:], path.running_statistics.values)
    update = widened.update
    # decays: as recorded on the weights, zero on the statistics
    expected = [0.01] * 5 + [0.0] * 4
    assert torch.equal(update.coupled_decay.flat(), torch.tensor(expected, dtype=torch.float64))
    step0 = update.decoupled_decays[0]
    assert isinstance(step0, Blockwise)
    assert torch.equal(step0.flat(), torch.tensor([0.02] * 5 + [0.0] * 4, dtype=torch.float64))
    assert update.decoupled_decays[1] == 0.0
    assert torch.equal(update.preconditioners[:, :5], path.update.preconditioners)
    assert not update.preconditioners[:, 5:].any()
    assert update.buffer_decay == 0.9 and update.per_step is False
    unflattened = widened.unflatten(widened.weights[1])
    assert torch.equal(unflattened["1.running_var"], path.running_statistics.values[1, 2:])


def test_a_path_without_statistics_is_not_widened():
    path = small_path()
    path.running_statistics = None
    assert with_running_statistics(path) is path


def test_truncated_and_rounded_statistics():
    stats = small_path().running_statistics
    short = stats.truncated(1)
    assert short.values.shape == (2, 4) and len(short.shares) == len(short.factors) == 1
    assert small_path().astype(torch.float32).running_statistics.values.dtype == torch.float32
