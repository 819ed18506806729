"""module_copy: what copy.deepcopy gives, with parameters and buffers made by functions."""

import copy

import pytest
import torch
from torch import nn

from sklearn_pathkernel._training._module_copy import module_copy


class _Tied(nn.Module):
    """A shared submodule, a tied weight, a plain tensor attribute, a mutable
    attribute and a hook bound to the module."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        self.second.weight = self.first.weight  # tied
        self.shared = nn.Sequential(self.first, nn.Tanh())
        self.register_buffer("scale", torch.tensor([2.0]))
        self.register_buffer("steps", torch.tensor(3))
        self.offset = torch.ones(3)  # a plain tensor attribute
        self.calls = []  # mutable: the copy's own
        self.register_forward_hook(self._count)

    def _count(self, module, args, output):
        self.calls.append(1)

    def forward(self, x):
        return self.second(self.shared(x)) * self.scale + self.offset


def _same_values(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_same_outputs_and_nothing_shared():
    torch.manual_seed(0)
    module = _Tied()
    copied = module_copy(module)
    x = torch.randn(4, 3)
    assert torch.equal(copied(x), module(x))
    originals = {id(t) for t in [*module.parameters(), *module.buffers()]}
    storages = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    for t in [*copied.parameters(), *copied.buffers()]:
        assert id(t) not in originals
        assert t.untyped_storage().data_ptr() not in storages
    # the tree's sharing is kept: the tied weight and the shared submodule
    assert copied.second.weight is copied.first.weight
    assert copied.shared[0] is copied.first
    # the plain tensor attribute and the list are the copy's own
    assert copied.offset is not module.offset and torch.equal(copied.offset, module.offset)
    module.calls.clear()
    copied(x)
    assert module.calls == [] and len(copied.calls) == 2  # (the hook is bound to the copy)
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in module.named_parameters()]
    assert [n for n, _ in copied.named_buffers()] == [n for n, _ in module.named_buffers()]


def test_matches_deepcopy_state():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))
    module[1].train()
    module[3].weight.requires_grad_(False)
    ours, theirs = module_copy(module), copy.deepcopy(module)
    expected = theirs.state_dict()
    for name, value in ours.state_dict().items():
        assert _same_values(value, expected[name]), name
    assert list(ours.state_dict()) == list(expected)
    assert [p.requires_grad for p in ours.parameters()] == [True, True, True, True, False, True]
    assert [m.training for m in ours.modules()] == [m.training for m in module.modules()]
    assert all(type(p) is nn.Parameter for p in ours.parameters())
    x = torch.randn(2, 1, 4, 4)
    assert torch.equal(ours.eval()(x), theirs.eval()(x))


def test_functions_make_parameters_and_buffers():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    names = []

    def to64(name, tensor):
        names.append(name)
        if tensor.is_floating_point():
            return tensor.detach().to(torch.float64, copy=True)
        return tensor.detach().clone()

    copied = module_copy(module, to64, to64)
    expected = copy.deepcopy(module).to(torch.float64)
    for name, value in copied.state_dict().items():
        assert _same_values(value, expected.state_dict()[name]), name
    assert list(copied.state_dict()) == list(expected.state_dict())
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                     "1.running_var", "1.num_batches_tracked"]  # fmt: skip
    assert module[0].weight.dtype == torch.float32  # (the original untouched)


class _OwnProtocol(nn.Linear):
    """A module with its own copy protocol: copied by copy.deepcopy."""

    def __deepcopy__(self, memo):
        new = nn.Linear.__new__(type(self))
        new.__dict__ = copy.deepcopy(self.__dict__, memo)
        new.copied_by_protocol = True
        return new


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_own_copy_protocol_is_used(dtype):
    module = nn.Sequential(_OwnProtocol(2, 2))
    copied = module_copy(module, lambda name, t: t.detach().to(dtype, copy=True))
    assert copied[0].copied_by_protocol
    assert copied[0].weight.dtype == dtype
    assert torch.equal(copied[0].weight.to(torch.float32), module[0].weight.detach())
    assert copied[0].weight.untyped_storage().data_ptr() != module[0].weight.data_ptr()


@pytest.mark.parametrize("protocol", [False, True])
def test_tied_weight_made_once_under_its_first_name(protocol):
    first = _OwnProtocol(2, 2) if protocol else nn.Linear(2, 2)
    module = nn.Sequential(first, nn.Linear(2, 2))
    module[1].weight = module[0].weight
    names = []

    def made(name, tensor):
        names.append(name)
        return torch.full_like(tensor, float(len(names)))

    copied = module_copy(module, made)
    assert copied[1].weight is copied[0].weight
    assert names == ["0.weight", "0.bias", "1.bias"]
    assert torch.equal(copied[0].weight, torch.full((2, 2), 1.0))


class _Refers(nn.Module):
    """Holds, in a plain list, a submodule that comes later in the tree."""

    def __init__(self):
        super().__init__()
        self.later = []

    def forward(self, x):
        return x


def test_attribute_referring_to_a_later_submodule_gets_its_copy():
    module = nn.Sequential(_Refers(), nn.Linear(2, 2))
    module[0].later.append(module[1])
    copied = module_copy(module, lambda name, t: t.detach().to(torch.float64, copy=True))
    assert copied[0].later[0] is copied[1]
    assert copied[1].weight.dtype == torch.float64
    assert module[0].later[0] is module[1]  # (the original's list untouched)
