"""Why the per-layer rules would be wrong for a network: the probe's dry run.

The per-layer rules read each parameterised layer's input and output from
hooks, once per forward pass; a network that uses a parameter any other way
(a layer called twice, weights tied across modules, a parameter used in a
parent's ``forward`` or outside its layer, a layer returning a tuple) needs the
whole-network :class:`~sklearn_pathkernel._engine.rules._jacobian.JacobianRule`
instead. :func:`per_layer_hazards` finds these, statically and by one forward pass.
"""

import torch
from torch.overrides import TorchFunctionMode

from .._path import nested_tensors


def _name(prefix, module):
    return f"{prefix or '<root>'} ({type(module).__name__})"


def per_layer_hazards(module, path_names, layers, example):
    """Why per-layer rules would be wrong for ``module``: a list of reasons, empty if none.

    The per-layer rules read each parameterised layer's input and output from
    hooks, once per forward pass, and assume its parameters enter the network
    only through that call. Checked statically: no path parameter is tied to
    another name, and no module has path parameters of its own next to
    parameterised children (its rule would re-run the children at the wrong
    weights). Checked by one forward pass on ``example`` (the module's own
    parameter values): every layer with a rule (``layers``) is called exactly
    once, with tensor positional arguments only, and returns a tensor; every
    use of a path parameter by a torch function happens inside its own
    module's forward (a layer never called, ``F.linear(x, self.fc.weight)``
    in a parent, or a parameter read by a sibling all break this).

    Parameters
    ----------
    module : torch.nn.Module
    path_names : set of str
        The path's (trainable) parameter names; other parameters are constants.
    layers : list of torch.nn.Module
        The modules that got a per-layer rule.
    example : torch.Tensor of shape (n, ...)

    Returns
    -------
    list of str
    """
    reasons = []
    by_tensor = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    tied = set()
    for key, names in by_tensor.items():
        if len(names) > 1 and any(name in path_names for name in names):
            reasons.append(f"tied parameters ({' is '.join(names)})")
            tied.add(key)

    owners, names_of = {}, {}
    for prefix, submodule in module.named_modules():
        dotted = f"{prefix}." if prefix else ""
        own = [
            (f"{dotted}{name}", param)
            for name, param in submodule.named_parameters(recurse=False)
            if f"{dotted}{name}" in path_names
        ]
        names_of[id(submodule)] = prefix
        for full, param in own:
            if id(param) not in tied:  # (its other uses are its tie, reported above)
                owners[id(param)] = (submodule, full)
        children_params = [
            f"{dotted}{name}"
            for child_name, child in submodule.named_children()
            for name, _ in child.named_parameters(prefix=child_name)
            if f"{dotted}{name}" in path_names
        ]
        if own and children_params:
            reasons.append(
                f"{_name(prefix, submodule)} uses parameters of its own "
                f"({', '.join(full for full, _ in own)}) next to parameterised children"
            )

    rule_layers = {id(layer): layer for layer in layers}
    calls = dict.fromkeys(rule_layers, 0)
    stack, found = [], []

    n_rows = example.shape[0]

    def before(layer, args, kwargs):
        stack.append(layer)
        # The rules see a layer's positional tensor inputs only (row-major).
        if id(layer) in rule_layers and (
            kwargs or not args or not all(torch.is_tensor(a) for a in args)
        ):
            found.append(
                f"{_name(names_of.get(id(layer)), layer)} is called with keyword, "
                "non-tensor or no arguments"
            )

    def after(layer, args, output):
        stack.pop()
        if id(layer) in rule_layers:
            calls[id(layer)] += 1
            name = _name(names_of.get(id(layer)), layer)
            if not torch.is_tensor(output):
                found.append(f"{name} returns a {type(output).__name__}, not a tensor")
            elif output.ndim == 0 or output.shape[0] != n_rows:
                # e.g. a parametrisation computing a weight: not one output per row
                found.append(f"{name} returns no row per input row")

    handles = []
    for submodule in module.modules():
        handles.append(submodule.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(submodule.register_forward_hook(after))
    uses = _ParameterUses(owners, stack)
    # A module in training mode may update buffers (running statistics) or draw
    # random numbers: the dry run leaves both as they were.
    buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]
    devices = [example.device] if example.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), uses:
            module(example)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    reasons += list(dict.fromkeys(found))
    for key, count in calls.items():
        if count != 1:
            layer = rule_layers[key]
            what = "never called" if count == 0 else f"called {count} times (shared weights)"
            reasons.append(f"{_name(names_of.get(key), layer)} is {what} per forward pass")
    for full, owner in uses.outside.items():
        reasons.append(
            f"{full} is used outside the forward of {_name(names_of.get(id(owner)), owner)}"
        )
    return reasons


class _ParameterUses(TorchFunctionMode):
    """Records path parameters that torch functions use outside their module's forward.

    ``owners`` maps ``id(parameter)`` to (owning module, path name); ``stack``
    is the list of modules whose forward is running (kept by hooks). Uses that
    produce no tensor (``.shape``, ``.size()``) are metadata, not computation.
    """

    def __init__(self, owners, stack):
        super().__init__()
        self.owners, self.stack = owners, stack
        self.outside = {}  # path name -> owning module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        used = [self.owners[id(x)] for x in nested_tensors((args, kwargs)) if id(x) in self.owners]
        if used and next(nested_tensors(result), None) is not None:
            for owner, full in used:
                if not any(running is owner for running in self.stack):
                    self.outside.setdefault(full, owner)
        return result
