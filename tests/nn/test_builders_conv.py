"""make_distance_conv_network with pools over positions: the layers it builds."""

import pytest
import torch
from torch import nn

from sklearn_pathkernel import DistanceConv2d
from sklearn_pathkernel._nn._builders import ConvSpec, make_distance_conv_network, position_pool
from sklearn_pathkernel._nn._distance import KERNELS, Transform
from sklearn_pathkernel._nn._distance_conv import MinPool2d

DT = torch.float64


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_pool_keeps_the_best_match(kernel):
    """Distances keep the window's smallest value, similarities its largest."""
    pool = position_pool(kernel, 2)
    z = torch.tensor([[[[1.0, 4.0], [3.0, 2.0]]]], dtype=DT)
    best = 1.0 if kernel in ("sqeuclidean", "euclidean") else 4.0
    assert isinstance(pool, MinPool2d if best == 1.0 else nn.MaxPool2d)
    assert pool(z).item() == best


def test_layers_shapes_and_order():
    """conv, pool, transform per spec (the pool before the transform), then the head;
    the output positions are those of the pooled windows."""
    torch.manual_seed(0)
    X = torch.rand(20, 64, dtype=DT)
    specs = [ConvSpec(3, 3, 1, 1, 2), ConvSpec(4, 3, 1, 1, 1)]
    net = make_distance_conv_network(
        X, 5, (1, 8, 8), specs, [], "sqeuclidean", "kmeans++", "log1p", "linear"
    )
    kinds = [type(m) for m in net]
    assert kinds[1:6] == [DistanceConv2d, MinPool2d, Transform, DistanceConv2d, Transform]
    assert net[-1].in_features == 4 * 4 * 4  # 8x8 -> pool 2 -> 4x4, second layer keeps 4x4
    assert net(X).shape == (20, 5)
    # the second layer's memories are patches of the pooled, transformed first layer
    pooled = net[3](net[2](net[1](net[0](X))))
    patches = net[4].patch_rows(pooled)
    gaps = (net[4].memories.detach()[:, None] - patches[None]).abs().amax(dim=2)
    assert gaps.min(dim=1).values.max() == 0


def test_pool_larger_than_the_positions_is_refused():
    X = torch.rand(4, 36, dtype=DT)
    with pytest.raises(ValueError, match=r"pool 5 is larger than the layer's 4 x 4 output"):
        make_distance_conv_network(
            X, 2, (1, 6, 6), [ConvSpec(2, 3, 1, 0, 5)], [], "rbf", "uniform", "none", "linear"
        )
