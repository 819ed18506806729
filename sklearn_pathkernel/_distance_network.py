"""The network of the distance estimators: distance layers, skew transforms and a head."""

from numbers import Integral, Real

import torch
from sklearn.utils._param_validation import Interval, StrOptions
from torch import nn

from ._distance import (
    DISTANCE_KERNELS,
    INITS,
    KERNELS,
    TRANSFORMS,
    DistanceLayer,
    Negate,
    Transform,
    init_memories,
)

HEADS = ("linear", "distance")


def make_distance_network(
    X, n_classes, hidden_layer_sizes, kernel, init, transform, head, gamma=1.0
):
    """Distance layers of the given widths, each followed by ``transform``, then a head.

    Data-based initialisations see, for each layer, the training data as the
    previous layers map it. ``head="linear"`` is an ``nn.Linear`` starting at
    zero (so the kernel machine's bias ``f(x; w_0)`` is a constant);
    ``head="distance"`` is a distance layer with one memory per class whose
    logits are ``-k(h, c_k) + b_k`` for distance kernels and ``k(h, c_k) + b_k``
    for similarities.
    """
    layers, width, H = [], X.shape[1], X
    for size in hidden_layer_sizes:
        layer = init_memories(
            DistanceLayer(width, size, kernel, gamma=gamma, dtype=X.dtype, device=X.device), H, init
        )
        layers += [layer, Transform(transform)]
        with torch.no_grad():
            H = layers[-1](layer(H))
        width = size
    if head == "linear":
        out = nn.Linear(width, n_classes, dtype=X.dtype, device=X.device)
        nn.init.zeros_(out.weight)
        nn.init.zeros_(out.bias)
        layers.append(out)
    else:
        out = DistanceLayer(width, n_classes, kernel, gamma=gamma, dtype=X.dtype, device=X.device)
        layers.append(out)  # uniform memories: _build_module does not see the labels
        if kernel in DISTANCE_KERNELS:
            layers.append(Negate())
    return nn.Sequential(*layers)


class DistanceNetworkMixin:
    """``_build_module`` of the distance estimators, from ``hidden_layer_sizes``,
    ``kernel``, ``init``, ``skew_transform``, ``gamma`` and the estimator's head
    (``head``; regressors have a linear head)."""

    _parameter_constraints = {
        "hidden_layer_sizes": ["array-like", Interval(Integral, 1, None, closed="left")],
        "kernel": [StrOptions(set(KERNELS))],
        "init": [StrOptions(set(INITS))],
        "skew_transform": [StrOptions(set(TRANSFORMS))],
        "gamma": [Interval(Real, 0, None, closed="neither")],
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
        return make_distance_network(
            X,
            n_outputs,
            [int(size) for size in sizes],
            self.kernel,
            self.init,
            self.skew_transform,
            self.head,
            gamma=self.gamma,
        )
