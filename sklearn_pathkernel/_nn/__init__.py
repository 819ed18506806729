"""Network building blocks: distance layers and the estimators' default networks."""

from ._builders import (
    ACTIVATIONS,
    HEADS,
    ConvSpec,
    make_distance_conv_network,
    make_distance_network,
    make_mlp,
)
from ._distance import (
    COSINE_EPS,
    INITS,
    KERNELS,
    SIMILARITIES,
    TRANSFORMS,
    DistanceLayer,
    kernel_values,
)
from ._distance_conv import DistanceConv2d

__all__ = [
    "ACTIVATIONS",
    "COSINE_EPS",
    "HEADS",
    "INITS",
    "KERNELS",
    "SIMILARITIES",
    "TRANSFORMS",
    "ConvSpec",
    "DistanceConv2d",
    "DistanceLayer",
    "kernel_values",
    "make_distance_conv_network",
    "make_distance_network",
    "make_mlp",
]
