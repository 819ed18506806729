"""Network builders: the default MLP and the distance networks of the estimators."""

from dataclasses import dataclass

import torch
from torch import nn

from ._distance import DISTANCE_KERNELS, DistanceLayer, Negate, Transform, init_memories
from ._distance_conv import DistanceConv2d, MinPool2d

ACTIVATIONS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "softplus": nn.Softplus,
    "logistic": nn.Sigmoid,
    "identity": nn.Identity,
}


def make_mlp(n_features, n_outputs, hidden_layer_sizes=(100,), activation="relu"):
    """Linear layers of the given widths with ``activation`` between them.

    The output layer starts at zero, so the initial network outputs the same
    for every input (``log(1 / n_classes)`` for a classifier, 0 for a
    regressor): the kernel machine's bias is a constant (the EPK paper's Remark 1).
    """
    layers, width = [], n_features
    for size in hidden_layer_sizes:
        layers += [nn.Linear(width, size), ACTIVATIONS[activation]()]
        width = size
    head = nn.Linear(width, n_outputs)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return nn.Sequential(*layers, head)


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


#: At most this many training patches are given to a data-based initialisation
#: (drawn at random): k-means++ seeding costs ``O(rows k D)``.
MAX_INIT_PATCHES = 20000


def _init_rows(rows):
    """At most ``MAX_INIT_PATCHES`` of ``rows``, drawn by torch's global generator."""
    if rows.shape[0] <= MAX_INIT_PATCHES:
        return rows
    return rows[torch.randperm(rows.shape[0], device="cpu")[:MAX_INIT_PATCHES].to(rows.device)]


@dataclass(frozen=True)
class ConvSpec:
    """One convolutional distance layer of :func:`make_distance_conv_network`.

    ``n_memories`` memories of ``kernel_size`` x ``kernel_size`` patches, moved by
    ``stride`` over the input padded by ``padding`` zeros, then a pool over
    ``pool`` x ``pool`` windows of positions (stride ``pool``; 1: no pool).
    """

    n_memories: int
    kernel_size: int = 3
    stride: int = 1
    padding: int = 0
    pool: int = 1


def position_pool(kernel, pool):
    """The pool over positions after a convolutional distance layer with ``kernel``.

    Distances (:data:`DISTANCE_KERNELS`) are small where a patch matches, so the
    pool keeps the smallest (:class:`MinPool2d`); similarities keep the largest
    (``nn.MaxPool2d``). Both are piecewise linear."""
    return MinPool2d(pool) if kernel in DISTANCE_KERNELS else nn.MaxPool2d(pool)


def make_distance_conv_network(
    X,
    n_classes,
    image_shape,
    conv_layers,
    hidden_layer_sizes,
    kernel,
    init,
    transform,
    head,
    gamma=1.0,
):
    """Convolutional distance layers on images, then :func:`make_distance_network`.

    ``X`` (n, C H W) holds flattened images of ``image_shape`` ``(C, H, W)``; the
    network unflattens them and applies, per :class:`ConvSpec` of ``conv_layers``,
    a :class:`DistanceConv2d`, its pool over positions (:func:`position_pool`,
    when ``pool > 1``) and ``transform``; the flattened result feeds the dense
    distance layers ``hidden_layer_sizes`` and the head. The pool comes before the
    transform: the transforms that act per value are nondecreasing, so the order
    does not change the values, and the pooled values stay the distance layer's
    outputs, quadratic along a training step (the engine solves for their
    switches in closed form). Data-based initialisations see the training images'
    patches as the previous layers map them (at most ``MAX_INIT_PATCHES`` of
    them, drawn at random).
    """
    stem = [nn.Unflatten(1, tuple(image_shape))]
    with torch.no_grad():
        H = stem[0](X)
    for spec in conv_layers:
        layer = DistanceConv2d(
            H.shape[1],
            spec.n_memories,
            spec.kernel_size,
            spec.stride,
            spec.padding,
            kernel,
            gamma=gamma,
            dtype=X.dtype,
            device=X.device,
        )
        height, width = layer.check_input(H)
        if spec.pool > min(height, width):
            raise ValueError(
                f"conv_layers entry {spec}: pool {spec.pool} is larger than the layer's "
                f"{height} x {width} output positions."
            )
        init_memories(layer, _init_rows(layer.patch_rows(H)), init)
        stem.append(layer)
        if spec.pool > 1:
            stem.append(position_pool(kernel, spec.pool))
        stem.append(Transform(transform))
        with torch.no_grad():
            H = nn.Sequential(*stem[1:])(stem[0](X))
    stem.append(nn.Flatten())
    dense = make_distance_network(
        H.flatten(1), n_classes, hidden_layer_sizes, kernel, init, transform, head, gamma=gamma
    )
    return nn.Sequential(*stem, *dense)
