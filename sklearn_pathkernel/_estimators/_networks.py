"""The estimators' networks: ``_build_module`` from their parameters (mixins)."""

import copy
from numbers import Integral, Real

from sklearn.utils._param_validation import Interval, StrOptions
from torch import nn

from .._nn import (
    ACTIVATIONS,
    INITS,
    KERNELS,
    TRANSFORMS,
    ConvSpec,
    make_distance_conv_network,
    make_distance_network,
    make_mlp,
)


class MLPNetworkMixin:
    """``_build_module`` of the MLP estimators, from ``module``,
    ``hidden_layer_sizes`` and ``activation``."""

    _parameter_constraints = {
        "module": [nn.Module, callable, None],
        "hidden_layer_sizes": ["array-like", Interval(Integral, 1, None, closed="left")],
        "activation": [StrOptions(set(ACTIVATIONS))],
    }

    def _build_module(self, X, n_outputs):
        n_features = X.shape[1]
        if self.module is None:
            sizes = self.hidden_layer_sizes
            sizes = (sizes,) if isinstance(sizes, Integral) else tuple(sizes)
            return make_mlp(n_features, n_outputs, sizes, self.activation)
        if isinstance(self.module, nn.Module):
            # A deep copy: the user's weights (w_0) stay untouched.
            module = copy.deepcopy(self.module)
        else:
            module = self.module(n_features, n_outputs)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    "The module callable must return a torch.nn.Module, got "
                    f"{type(module).__name__}."
                )
        if not any(True for _ in module.parameters()):
            raise ValueError("The module has no parameters to train.")
        return module


def _positive_ints(value, name, lengths):
    """``value`` as a tuple of positive ints of one of ``lengths`` (a ValueError otherwise)."""
    items = (value,) if isinstance(value, Integral) else tuple(value)
    if len(items) not in lengths or any(not isinstance(v, Integral) or v < 1 for v in items):
        raise ValueError(f"{name} must be {lengths} positive integers, got {value!r}.")
    return tuple(int(v) for v in items)


def image_geometry(image_shape, n_features):
    """``image_shape`` as ``(C, H, W)`` (``(H, W)`` is one channel), checked against the
    number of features."""
    shape = _positive_ints(image_shape, "image_shape", (2, 3))
    shape = (1, *shape) if len(shape) == 2 else shape
    if shape[0] * shape[1] * shape[2] != n_features:
        raise ValueError(
            f"image_shape={tuple(image_shape)!r} has {shape[0] * shape[1] * shape[2]} values "
            f"per image but X has {n_features} features."
        )
    return shape


_CONV_FIELDS = ("n_memories", "kernel_size", "stride", "padding", "pool")


def _conv_entry(layer):
    """One entry of ``conv_layers`` as a dict of its given fields."""
    if isinstance(layer, Integral):
        return {"n_memories": layer}
    if isinstance(layer, dict):
        unknown = sorted(set(layer) - set(_CONV_FIELDS), key=str)
        if unknown or "n_memories" not in layer:
            raise ValueError(
                f"conv_layers entry {layer!r}: a dict needs 'n_memories' and may give "
                f"{_CONV_FIELDS[1:]}; unknown keys {unknown}."
            )
        return dict(layer)
    items = tuple(layer)
    if not 2 <= len(items) <= len(_CONV_FIELDS):
        raise ValueError(
            "Each entry of conv_layers must be n_memories, a tuple (n_memories, "
            f"kernel_size[, stride[, padding[, pool]]]) of ints or a dict, got {layer!r}."
        )
    return dict(zip(_CONV_FIELDS, items, strict=False))


def conv_specs(conv_layers):
    """Each layer of ``conv_layers`` as a :class:`ConvSpec`: an int is ``n_memories``
    with 3x3 patches; a tuple gives ``(n_memories, kernel_size[, stride[, padding[,
    pool]]])`` and a dict any of those fields by name (``n_memories`` required);
    stride 1, padding 0 and pool 1 (none) by default."""
    specs = []
    for layer in conv_layers:
        fields = _conv_entry(layer)
        if any(not isinstance(v, Integral) or isinstance(v, bool) for v in fields.values()):
            raise ValueError(
                f"conv_layers entry {layer!r}: n_memories, kernel_size, stride, padding and "
                "pool must be ints."
            )
        spec = ConvSpec(**{name: int(value) for name, value in fields.items()})
        if min(spec.n_memories, spec.kernel_size, spec.stride, spec.pool) < 1 or spec.padding < 0:
            raise ValueError(
                f"conv_layers entry {layer!r}: n_memories, kernel_size, stride and pool must "
                "be positive and padding non-negative."
            )
        specs.append(spec)
    return specs


class DistanceNetworkMixin:
    """``_build_module`` of the distance estimators, from ``hidden_layer_sizes``,
    ``kernel``, ``init``, ``skew_transform``, ``gamma``, ``image_shape``,
    ``conv_layers`` and the estimator's head (``head``; regressors have a linear head).

    With ``image_shape`` set, the rows of ``X`` are flattened images: the network
    starts with the convolutional distance layers of ``conv_layers``
    (:func:`make_distance_conv_network`); with ``image_shape=None`` it is dense."""

    _parameter_constraints = {
        "hidden_layer_sizes": ["array-like", Interval(Integral, 1, None, closed="left")],
        "kernel": [StrOptions(set(KERNELS))],
        "init": [StrOptions(set(INITS))],
        "skew_transform": [StrOptions(set(TRANSFORMS))],
        "gamma": [Interval(Real, 0, None, closed="neither")],
        "image_shape": ["array-like", None],
        "conv_layers": ["array-like"],
    }

    #: The head of an estimator that has no ``head`` parameter.
    head = "linear"

    def _build_module(self, X, n_outputs):
        sizes = self.hidden_layer_sizes
        sizes = (sizes,) if isinstance(sizes, Integral) else tuple(sizes)
        if any(not isinstance(size, Integral) or size < 1 for size in sizes):
            raise ValueError(
                f"hidden_layer_sizes must hold positive integers, got {self.hidden_layer_sizes!r}."
            )
        if self.kernel == "cosine" and self.skew_transform in ("sqrt", "log1p"):
            raise ValueError(
                f"skew_transform={self.skew_transform!r} needs non-negative layer outputs, but the "
                "cosine kernel's similarities are in [-1, 1]; use skew_transform='none' or "
                "'standardize' with kernel='cosine'."
            )
        sizes = [int(size) for size in sizes]
        if self.image_shape is not None:
            return make_distance_conv_network(
                X,
                n_outputs,
                image_geometry(self.image_shape, X.shape[1]),
                conv_specs(self.conv_layers),
                sizes,
                self.kernel,
                self.init,
                self.skew_transform,
                self.head,
                gamma=self.gamma,
            )
        return make_distance_network(
            X,
            n_outputs,
            sizes,
            self.kernel,
            self.init,
            self.skew_transform,
            self.head,
            gamma=self.gamma,
        )
