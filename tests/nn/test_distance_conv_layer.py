"""DistanceConv2d: every patch compared with the memories, against explicit loops."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import DistanceConv2d, DistanceLayer
from sklearn_pathkernel._nn._distance import KERNELS, init_memories

DT = torch.float64


def reference(layer, x):
    """Output by explicit slicing of the zero-padded input, one position at a time,
    each patch compared by a DistanceLayer holding the same memories."""
    (kh, kw), (sh, sw), (ph, pw) = layer.kernel_size, layer.stride, layer.padding
    dense = DistanceLayer(layer.in_features, layer.n_memories, layer.kernel, bias=False, dtype=DT)
    with torch.no_grad():
        dense.memories.copy_(layer.memories)
        if layer.log_gamma is not None:
            dense.log_gamma.copy_(layer.log_gamma)
    padded = F.pad(x, (pw, pw, ph, ph))
    height = (padded.shape[2] - kh) // sh + 1
    width = (padded.shape[3] - kw) // sw + 1
    out = torch.empty(x.shape[0], layer.n_memories, height, width, dtype=DT)
    for r in range(height):
        for c in range(width):
            patch = padded[:, :, r * sh : r * sh + kh, c * sw : c * sw + kw].reshape(x.shape[0], -1)
            out[:, :, r, c] = dense(patch)
    if layer.bias is not None:
        out = out + layer.bias[:, None, None]
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "geometry",
    [{"kernel_size": 3}, {"kernel_size": (3, 2), "stride": (2, 1), "padding": (1, 0)}],
    ids=["plain", "strided-padded"],
)
def test_forward_equals_explicit_patches(kernel, geometry):
    torch.manual_seed(0)
    layer = DistanceConv2d(2, 4, kernel=kernel, dtype=DT, **geometry)
    with torch.no_grad():
        layer.bias.normal_()
        if layer.log_gamma is not None:
            layer.log_gamma.normal_(0.0, 0.3)
    x = torch.randn(3, 2, 6, 5, dtype=DT)
    out = layer(x)
    conv = nn.Conv2d(2, 4, dtype=DT, **geometry)
    assert out.shape == conv(x).shape
    torch.testing.assert_close(out, reference(layer, x), rtol=1e-13, atol=1e-14)


def test_memory_on_a_patch_gives_exact_zero_and_finite_gradient():
    layer = DistanceConv2d(1, 2, 2, kernel="euclidean", bias=False, dtype=DT)
    x = torch.randn(1, 1, 4, 4, dtype=DT)
    with torch.no_grad():
        layer.memories[0] = x[0, 0, 1:3, 2:4].reshape(-1)
    out = layer(x)
    assert out[0, 0, 1, 2] == 0.0
    out.sum().backward()
    assert torch.isfinite(layer.memories.grad).all()


def test_memory_images_view_and_parameter_count():
    layer = DistanceConv2d(3, 5, (2, 4), dtype=DT)
    conv = nn.Conv2d(3, 5, (2, 4))
    assert layer.memory_images.shape == conv.weight.shape
    assert layer.memory_images.data_ptr() == layer.memories.data_ptr()
    assert sum(p.numel() for p in layer.parameters()) == sum(p.numel() for p in conv.parameters())


@pytest.mark.parametrize("method", ["samples", "kmeans++"])
def test_data_based_init_copies_training_patches(method):
    torch.manual_seed(0)
    layer = DistanceConv2d(1, 6, 3, dtype=DT)
    x = torch.randn(4, 1, 5, 5, dtype=DT)
    patches = layer.patch_rows(x)
    assert patches.shape == (4 * 9, 9)
    init_memories(layer, patches, method)
    for memory in layer.memories.detach():
        assert (patches == memory).all(1).any()


def test_patch_rows_are_the_reference_patches():
    layer = DistanceConv2d(2, 1, 2, stride=2, dtype=DT)
    x = torch.arange(2 * 2 * 4 * 4, dtype=DT).view(2, 2, 4, 4)
    rows = layer.patch_rows(x).view(2, 2, 2, 8)  # (n, H_out, W_out, D)
    torch.testing.assert_close(rows[1, 0, 1], x[1, :, 0:2, 2:4].reshape(-1))


@pytest.mark.parametrize(
    ("args", "x_shape", "match"),
    [
        ((1, 2, 5), (2, 1, 4, 4), "patch height 5 is larger than the padded input height 4"),
        ((1, 2, (2, 6)), (2, 1, 4, 4), "patch width 6 is larger"),
        ((3, 2, 2), (2, 1, 4, 4), r"in_channels=3\), got \(2, 1, 4, 4\)"),
        ((1, 2, 2), (2, 16), r"expects input of shape \(n, 1, H, W\)"),
    ],
)
def test_clear_errors_on_bad_input(args, x_shape, match):
    layer = DistanceConv2d(*args, dtype=DT)
    with pytest.raises(ValueError, match=match):
        layer(torch.zeros(x_shape, dtype=DT))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kernel": "manhattan"}, "Unknown kernel"),
        ({"kernel_size": 0}, "kernel_size must be an int >= 1"),
        ({"stride": (1, 2, 3)}, "stride must be"),
        ({"padding": -1}, "padding must be an int >= 0"),
        ({"n_memories": 0}, "n_memories must be a positive int"),
        ({"gamma": 0.0}, "gamma must be positive"),
    ],
)
def test_clear_errors_on_bad_parameters(kwargs, match):
    params = {"in_channels": 1, "n_memories": 2, "kernel_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        DistanceConv2d(**params)


@pytest.mark.parametrize("pool_size, shape", [(2, (6, 6)), (2, (7, 5)), (3, (6, 9)), (1, (4, 4))])
def test_min_pool_is_the_window_minimum(pool_size, shape):
    """MinPool2d against explicit windows: the minimum of each pool_size x
    pool_size block (stride pool_size, partial blocks dropped)."""
    from sklearn_pathkernel._nn._distance_conv import MinPool2d

    torch.manual_seed(0)
    z = torch.randn(3, 2, *shape, dtype=DT)
    out = MinPool2d(pool_size)(z)
    rows, cols = shape[0] // pool_size, shape[1] // pool_size
    assert out.shape == (3, 2, rows, cols)
    for r in range(rows):
        for c in range(cols):
            rs, cs = (
                slice(r * pool_size, (r + 1) * pool_size),
                slice(c * pool_size, (c + 1) * pool_size),
            )
            block = z[:, :, rs, cs]
            assert torch.equal(out[:, :, r, c], block.amin(dim=(2, 3)))


@pytest.mark.parametrize("pool_size", [0, 1.5, "2"])
def test_min_pool_rejects_bad_sizes(pool_size):
    from sklearn_pathkernel._nn._distance_conv import MinPool2d

    with pytest.raises(ValueError, match="pool_size must be a positive int"):
        MinPool2d(pool_size)
