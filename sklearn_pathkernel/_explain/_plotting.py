"""Shared drawing helpers of the result objects (matplotlib, imported when drawing)."""

import numpy as np

from ._frames import pyplot


def check_image_shape(image_shape, n_features):
    """``image_shape`` as a tuple whose product is ``n_features``, or a clear error."""
    try:
        shape = tuple(int(size) for size in image_shape)
    except TypeError:
        raise TypeError(f"image_shape must be a tuple of ints, got {image_shape!r}.") from None
    if not shape or min(shape) < 1 or int(np.prod(shape)) != n_features:
        raise ValueError(
            f"image_shape={shape} does not match the features: the rows have "
            f"{n_features} features, but an image of shape {shape} has "
            f"{int(np.prod(shape)) if shape else 0} pixels."
        )
    return shape


def new_axes(ax, figsize):
    """``ax``, or the axes of a new figure."""
    if ax is not None:
        return ax
    _, ax = pyplot().subplots(figsize=figsize)
    return ax


def draw_image(ax, row, image_shape, title, color="black"):
    """One row drawn as a grey image, without ticks, titled in ``color``."""
    ax.imshow(np.asarray(row).reshape(image_shape), cmap="gray_r")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=8, color=color)


def signed_bars(ax, labels, values, xlabel):
    """Horizontal bars, red for positive and blue for negative values, first on top."""
    positions = np.arange(len(values))[::-1]
    colors = ["#c0392b" if value > 0 else "#2e86c1" for value in values]
    ax.barh(positions, values, color=colors)
    ax.set_yticks(positions)
    ax.set_yticklabels(labels, fontsize=8)
    ax.axvline(0.0, color="k", lw=0.6)
    ax.set_xlabel(xlabel)
    return ax
