"""A copy of a module with new parameter and buffer tensors, several times faster
than :func:`copy.deepcopy` for the small networks of a recorded loop.

``copy.deepcopy(module)`` walks every submodule through the pickling protocol
(``__reduce_ex__``, then each of its dozen hook dictionaries); creating a
recorder and ``finish`` each copy the user's module once (the module checks on a
float64 copy, the recorded network), which was a third of their fixed cost.
:func:`module_copy` gives what ``copy.deepcopy`` gives (a tree of new submodules
of the same classes, no object shared with the original but immutable ones)
with the parameters and buffers made by a function of the original tensors, so
that the float64 copy needs no second pass (``.to``) and the recorded network's
parameters are its final weights at once.
"""

import copy

import torch
from torch import nn

#: A submodule's dictionaries of hooks (and the set of non-persistent buffer
#: names): a new empty one where the original is empty, else deep-copied (a hook
#: bound to the module must be bound to the copy).
_HOOK_DICTS = frozenset(
    {
        "_backward_pre_hooks",
        "_backward_hooks",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_non_persistent_buffers_set",
    }
)
#: Set by torch.compile on the module; ``nn.Module.__getstate__`` leaves it out.
_NOT_COPIED = frozenset({"_compiled_call_impl"})
_OWN = frozenset({"_parameters", "_buffers", "_modules"})
#: Copy protocols a module class may define for itself; such a module (anywhere in
#: the tree) is copied by ``copy.deepcopy`` as a whole.
_PROTOCOL = ("__deepcopy__", "__copy__", "__reduce__", "__reduce_ex__", "__getstate__",
             "__setstate__")  # fmt: skip


def _plain(cls):
    """Whether ``cls`` copies by its ``__dict__`` (no copy protocol of its own, other
    than ``torch.nn``'s own ``__setstate__``, which only fills in missing defaults)."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            continue
        for name in _PROTOCOL:
            if name in klass.__dict__ and not (
                name == "__setstate__" and klass.__module__.startswith("torch.nn.")
            ):
                return False
    return type(cls) is type  # (a metaclass may build instances its own way)


def module_copy(module, parameter=None, buffer=None):
    """A deep copy of ``module`` whose parameters and buffers are made by functions.

    Parameters
    ----------
    module : torch.nn.Module
    parameter : callable or None, default=None
        ``parameter(name, tensor)`` (the qualified name, the original parameter)
        returns the copy's parameter data (a tensor, no autograd); the copy's
        parameter is of the original's class, with its ``requires_grad``. None: a
        clone of the original.
    buffer : callable or None, default=None
        ``buffer(name, tensor)`` returns the copy's buffer; None: a clone.

    Returns
    -------
    copy : torch.nn.Module
        No object is shared with ``module`` but immutable ones (numbers, strings,
        functions and classes, as ``copy.deepcopy``). A tree with a submodule
        that defines its own copy protocol (``__deepcopy__``, ``__reduce__``, ...)
        is copied by ``copy.deepcopy`` and then given the parameters and buffers
        of the functions.
    """
    parameter = parameter or _clone
    buffer = buffer or _clone
    if not all(_plain(type(m)) for m in module.modules()):
        return _deep_then_set(module, parameter, buffer)
    memo, made = {}, []
    with torch.no_grad():
        new = _copy(module, "", parameter, buffer, memo, made)
    # the other attributes once every submodule, parameter and buffer of the tree
    # has its copy (in the memo): one that refers to any of them gets the copy's
    for original, copied in made:
        state = {}
        for key, value in original.__dict__.items():
            if key in _OWN or key in _NOT_COPIED:
                continue
            if key in _HOOK_DICTS and not value:
                state[key] = type(value)()
            else:
                state[key] = copy.deepcopy(value, memo)
        copied.__dict__.update(state)
    return new


def float64_tensor(name, tensor):
    """A float64 copy of a floating point tensor, a copy of another (the module's
    ``.to(torch.float64)``, on a copy: ``module_copy(module, float64_tensor,
    float64_tensor)``)."""
    if tensor.is_floating_point():
        return tensor.detach().to(torch.float64, copy=True)
    return tensor.detach().clone()


def _clone(name, tensor):
    return tensor.detach().clone(memory_format=torch.preserve_format)


def _copy(module, prefix, parameter, buffer, memo, made):
    """The copy of ``module``'s tree: new submodules with their parameters, buffers
    and children (their other attributes are set by :func:`module_copy`)."""
    found = memo.get(id(module))
    if found is not None:  # (a submodule shared in the tree stays shared)
        return found
    new = object.__new__(type(module))
    memo[id(module)] = new
    made.append((module, new))
    params = {}
    for name, value in module._parameters.items():
        if value is None:
            params[name] = None
            continue
        copied = memo.get(id(value))
        if copied is None:
            data = parameter(prefix + name, value)
            copied = memo[id(value)] = type(value)(data, value.requires_grad)
        params[name] = copied
    buffers = {}
    for name, value in module._buffers.items():
        if value is None:
            buffers[name] = None
            continue
        copied = memo.get(id(value))
        if copied is None:
            copied = memo[id(value)] = buffer(prefix + name, value)
        buffers[name] = copied
    children = {
        name: None
        if child is None
        else _copy(child, f"{prefix}{name}.", parameter, buffer, memo, made)
        for name, child in module._modules.items()
    }
    new.__dict__.update({"_parameters": params, "_buffers": buffers, "_modules": children})
    return new


def _deep_then_set(module, parameter, buffer):
    """``copy.deepcopy``, then each parameter's and buffer's data replaced (each tensor
    once, under its first name, as ``named_parameters`` gives it: a tied weight gets
    the tensor of that name)."""
    new = copy.deepcopy(module)
    originals = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for name, param in new.named_parameters():
            param.data = parameter(name, originals[name])
        done = set()
        for owner_name, owner in new.named_modules():
            prefix = f"{owner_name}." if owner_name else ""
            for name, value in list(owner._buffers.items()):
                if value is None or id(value) in done or prefix + name not in buffers:
                    continue
                made = buffer(prefix + name, buffers[prefix + name])
                owner._buffers[name] = made
                done.add(id(made))
    return new
