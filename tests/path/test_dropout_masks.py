"""The network evaluated with recorded dropout masks (``masks_applied``), checked
against the dropout written out by hand, and its refusals."""

import pytest
import torch
from torch import nn

from sklearn_pathkernel._path import dropout_layers, mask_shape, masks_applied, take_rows


def network():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Dropout2d(0.25), nn.Flatten(), nn.Dropout(0.5), nn.Linear(27, 2)
    ).double()


def test_masks_applied_is_the_dropout_written_out():
    module = network().eval()
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    channel = torch.rand(4, 3, 1, 1) > 0.25
    unit = torch.rand(4, 27) > 0.5
    with masks_applied(module, {"1": channel, "3": unit}):
        out = module(x)
    hidden = module[0](x) * (channel.double() / 0.75)
    expected = module[4](hidden.flatten(1) * (unit.double() / 0.5))
    assert torch.equal(out, expected)
    assert torch.equal(module(x), module[4](module[0](x).flatten(1)))  # hooks removed


def test_layers_and_shapes():
    module = network()
    assert [name for name, _ in dropout_layers(module)] == ["1", "3"]
    assert mask_shape(module[1], (4, 3, 3, 3)) == (4, 3, 1, 1)
    assert mask_shape(module[3], (4, 27)) == (4, 27)
    with pytest.raises(ValueError, match=r"Dropout2d expects batched inputs.*\(3, 3, 3\)"):
        mask_shape(module[1], (3, 3, 3))
    masks = {"3": torch.arange(8).reshape(4, 2) > 3}
    assert torch.equal(take_rows(masks, [2, 0])["3"], masks["3"][[2, 0]])
    assert torch.equal(take_rows(masks, slice(1, 3))["3"], masks["3"][1:3])
    assert take_rows(None, [0]) is None


def test_refusals():
    module = network().eval()
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"'3': the recorded mask has shape \(3, 27\)"):
        with masks_applied(module, {"3": torch.ones(3, 27, dtype=torch.bool)}):
            module(x)
    with pytest.raises(ValueError, match="no dropout layer '4'"):
        with masks_applied(module, {"4": torch.ones(4, 2, dtype=torch.bool)}):
            pass
    module[3].train()
    with pytest.raises(ValueError, match="'3' must be in eval mode"):
        with masks_applied(module, {"3": torch.ones(4, 27, dtype=torch.bool)}):
            pass
    assert not module[3]._forward_hooks  # nothing left behind
