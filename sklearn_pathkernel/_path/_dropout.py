"""Dropout masks: what a training step drew, and the network evaluated with them.

In training mode, ``nn.Dropout`` maps ``a`` to ``a * m / (1 - p)`` with a random
mask ``m`` of zeros and ones (one per entry; ``nn.Dropout2d``: one per row and
channel). For fixed masks this is a deterministic function of the row and the
weights, so the step's move ``sum_{i in B_s} e_{s,i} . grad_w f(x_i; w_s, m_{s,i})``
is a sum over rows as without dropout. The recorder keeps each step's masks
(``|B_s|`` times the layer's units, booleans); :func:`masks_applied` evaluates
the network in eval mode with them put back, row by row, which is the training
side of the path kernel. The query side stays in eval mode (dropout the
identity).
"""

import contextlib

import torch
from torch import nn

#: The dropout layers whose masks are recorded (exact types: a subclass may
#: override ``forward``).
MASKED_DROPOUT = (nn.Dropout, nn.Dropout2d)


def mask_shape(layer, shape):
    """The shape of ``layer``'s mask for an input of ``shape`` (batched)."""
    if type(layer) is nn.Dropout2d:
        if len(shape) != 4:
            raise ValueError(
                f"Dropout2d expects batched inputs of shape (N, C, H, W); got {tuple(shape)}."
            )
        return (shape[0], shape[1], 1, 1)
    return tuple(shape)


def dropout_layers(module):
    """``(name, layer)`` of the recorded dropout layers of ``module`` (p > 0)."""
    return [
        (name, layer)
        for name, layer in module.named_modules()
        if type(layer) in MASKED_DROPOUT and layer.p > 0
    ]


@contextlib.contextmanager
def masks_applied(module, masks):
    """Evaluate ``module`` with its dropout layers replaced by recorded masks.

    Within the context every forward pass of a named dropout layer returns
    ``a * m / (1 - p)``, ``m`` the layer's recorded mask of the pass's rows (the
    layers must be in eval mode, where dropout is the identity). A pass whose
    rows are not those of the masks raises.

    Parameters
    ----------
    module : torch.nn.Module
    masks : dict of str to torch.Tensor of bool, or None
        Per dropout layer (by its name in ``module``), the mask of each row, of
        shape (n_rows, ...) (broadcast against the layer's input). ``None`` or
        empty: the module as it is.
    """
    if not masks:
        yield
        return
    layers = dict(module.named_modules())
    handles = []
    try:
        for name, mask in masks.items():
            layer = layers.get(name)
            if layer is None or type(layer) not in MASKED_DROPOUT:
                raise ValueError(f"The module has no dropout layer {name!r} for its masks.")
            if layer.training:
                raise ValueError(
                    f"Dropout layer {name!r} must be in eval mode for its recorded masks."
                )
            handles.append(layer.register_forward_hook(_apply(name, layer, mask)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _apply(name, layer, mask):
    def hook(_, args, output):
        value = args[0]
        expected = mask_shape(layer, value.shape)
        if tuple(mask.shape) != expected:
            raise RuntimeError(
                f"Dropout layer {name!r}: the recorded mask has shape {tuple(mask.shape)} "
                f"but the pass needs {expected} (other rows than the step's batch)."
            )
        scale = mask.to(device=value.device, dtype=value.dtype) / (1.0 - layer.p)
        return value * scale

    return hook


def take_rows(masks, rows):
    """The masks of some rows (positions in the step's batch) of a step."""
    if not masks:
        return masks
    index = rows if isinstance(rows, slice) else torch.as_tensor(rows)
    return {name: mask[index] for name, mask in masks.items()}
