"""The tensors inside nested containers (arguments and results of a module call)."""

import torch


def nested_tensors(value):
    """Yield the tensors in nested tuples, lists and dicts (dicts by their values),
    depth first, in order; anything else holds none."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from nested_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from nested_tensors(item)
