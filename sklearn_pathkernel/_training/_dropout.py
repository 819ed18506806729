"""The dropout masks of a recorded training run, drawn by the recorder itself.

While a module is recorded, each ``nn.Dropout`` / ``nn.Dropout2d`` layer in
training mode gets its output replaced by ``a * m / (1 - p)`` with a mask ``m``
that the recorder draws (``bernoulli(1 - p)`` from torch's generator, the
distribution of the layer's own masks) and keeps. Drawing the mask, rather than
reading it back from the layer's output, is what makes it exact: where ``a`` is
zero the output does not say whether the entry was dropped, but the gradient
with respect to ``a`` does depend on it. The training then runs with the very
masks the kernel uses.
"""

import contextlib

import torch

from .._path import dropout_layers, mask_shape


class MaskDraws:
    """Draws, keeps and replays the dropout masks of a module's forward passes.

    Parameters
    ----------
    module : torch.nn.Module
        The recorded module; its dropout layers get a forward pre-hook and a
        forward hook (removed by :meth:`close`).
    generator : torch.Generator or None, default=None
        Where the masks are drawn from (on the inputs' device); None: torch's
        default generator, as the layers themselves.
    """

    def __init__(self, module, generator=None):
        self.layers = dropout_layers(module)
        self.generator = generator
        self._pass = {}  # layer name -> mask drawn in the current forward pass
        self._inputs = {}
        self._replay = None
        self._handles = []
        for name, layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._keep_input(name)))
            self._handles.append(layer.register_forward_hook(self._masked(name)))

    def start_pass(self, *_):
        """A forward pass of the whole module begins (a root pre-hook)."""
        self._pass = {}

    def take(self):
        """The masks of the last forward pass, on the host (layer name to booleans)."""
        masks, self._pass = self._pass, {}
        return {name: mask.cpu() for name, mask in masks.items()}

    @contextlib.contextmanager
    def replaying(self, masks):
        """Forward passes within use ``masks`` instead of drawing new ones."""
        self._replay = masks or {}
        try:
            yield
        finally:
            self._replay = None

    def close(self):
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _keep_input(self, name):
        def hook(layer, args):
            if not layer.training:
                return None
            value = args[0]
            self._inputs[name] = value
            if layer.inplace:  # the layer overwrites its input: keep the original
                return (value.clone(), *args[1:])
            return None

        return hook

    def _masked(self, name):
        def hook(layer, args, output):
            if not layer.training:
                return None
            value = self._inputs.pop(name)
            shape = mask_shape(layer, value.shape)
            if self._replay is not None:
                mask = self._replay[name].to(value.device)
            else:
                if name in self._pass:
                    raise RuntimeError(
                        f"Dropout layer {name!r} is called twice in one forward pass; the "
                        "recorder keeps one mask per layer and pass."
                    )
                draw = torch.empty(shape, dtype=value.dtype, device=value.device)
                mask = draw.bernoulli_(1.0 - layer.p, generator=self.generator).bool()
                self._pass[name] = mask
            return value * (mask.to(value.dtype) / (1.0 - layer.p))

        return hook
