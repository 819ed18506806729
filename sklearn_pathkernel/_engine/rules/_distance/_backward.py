"""A distance layer at its own weights with a closed-form backward pass to its input.

The probe back-propagates every output ``k`` of a batch at once (a batched
backward pass, ``K`` cotangents per row) to the layers' outputs. Through a
:class:`~sklearn_pathkernel._nn._distance.DistanceLayer` of the squared-distance
family, torch differentiates ``torch.cdist`` (the layer's exact distances), whose
backward pass has no batching rule: it runs once per cotangent, and forms an
``(n, J, D)`` intermediate each time. On an image distance network (digits,
100 memories of width 256, 1000 rows, 10 outputs) that was two thirds of the
cross Gram's training-row passes.

The layer's gradient with respect to its input is affine in the memories:
``d z_ij / d x_i = s_ij (x_i - m_j)`` with ``s = 2 / D`` ("sqeuclidean"),
``1 / (D k_ij)`` ("euclidean", 0 where ``k = 0``: the layer's convention) and
``-2 gamma_j k_ij / D`` ("rbf"), so a cotangent ``g`` (n, J) pulls back to

    sum_j c_ij (x_i - m_j) = (sum_j c_ij) (x_i - c) - c_i (M - c),   c = g s,

two matrix products whatever the number of cotangents (expanded about the mean
memory ``c``, like the rule's other expansions). The forward values are the
layer's own, bit for bit.

Rows at their own weights (``m_j + t_i dm_j``, the probe's quadrature nodes)
pull back the same way, ``sum_j c_ij (x_i - m_j - t_i dm_j)``: one product more,
with the step (:func:`moving_input_vjp`). Both backward passes broadcast over
a leading dimension of cotangents, so the folded backward pass
(``_engine/_folded_backward.py``) applies them to all ``K`` outputs at once.
"""

import torch

#: The kernels whose input gradient has the affine form above.
AFFINE_KERNELS = ("sqeuclidean", "euclidean", "rbf")


class AffineInputBackward(torch.autograd.Function):
    """``values`` passed through, with the input's gradient ``sum_j c_ij (x_i - m_j)``.

    Its backward pass broadcasts over leading dimensions of the cotangent: a
    ``(K, n, J)`` stack of cotangents pulls back to ``(K, n, D)`` in one call (the
    folded backward pass's ``AffineInput`` rule calls it so)."""

    @staticmethod
    def forward(x, values, slope, centred_x, centred_m):
        return values

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, slope, centred_x, centred_m = inputs
        ctx.save_for_backward(slope, centred_x, centred_m)

    @staticmethod
    def backward(ctx, grad):
        slope, centred_x, centred_m = ctx.saved_tensors
        c = grad * slope
        out = c.sum(-1, keepdim=True) * centred_x
        return out.sub_(c @ centred_m), None, None, None, None


def input_slopes(layer, values):
    """``s_ij`` (n, J) of ``d k(x_i, m_j) / d x_i = s_ij (x_i - m_j)`` for the layer's
    ``values`` ``k`` (n, J) (see the module docstring)."""
    width = layer.in_features
    if layer.kernel == "sqeuclidean":
        return torch.full_like(values, 2.0 / width)
    if layer.kernel == "euclidean":
        positive = values > 0
        return torch.where(positive, 1.0 / (width * torch.where(positive, values, 1.0)), 0.0)
    if layer.kernel == "rbf":
        return -2.0 / width * torch.exp(layer.log_gamma.detach()) * values
    raise ValueError(f"No affine input gradient for the {layer.kernel!r} kernel.")


def own_output(layer, x):
    """``layer(x)`` (n, J), bit for bit, with the closed-form backward pass to ``x``.

    Only where the gradient goes to ``x`` alone: where no gradient is taken (no
    grad mode, an input that does not require one) or where the layer's
    parameters require one, the layer's own forward (and torch's backward)."""
    # (the class's forward: the probe replaces the instance's by this function)
    forward = type(layer).forward.__get__(layer)
    parameters = (layer.memories, layer.bias, layer.log_gamma)
    parameters_constant = not any(p is not None and p.requires_grad for p in parameters)
    if not (torch.is_grad_enabled() and x.requires_grad and parameters_constant):
        return forward(x)
    if layer.kernel not in AFFINE_KERNELS:
        raise ValueError(f"No affine input gradient for the {layer.kernel!r} kernel.")
    with torch.no_grad():
        x_values = x.detach()
        out = forward(x_values)  # (its own values, bit for bit)
        # The slopes of euclidean and rbf read the kernel values without the bias
        # (from the layer, not ``out - bias``: a zero distance stays zero).
        values = out if layer.kernel == "sqeuclidean" else layer.similarity(x_values)
        memories = layer.memories.detach()
        centre = memories.mean(0)
        slope = input_slopes(layer, values)
    return AffineInputBackward.apply(x, out, slope, x_values - centre, memories - centre)


def moving_input_vjp(x, m, dm, t, slope):
    """The input's cotangents of a squared-distance layer with row ``i`` at its own
    memories ``mu_ij = m_j + t_i dm_j``.

    Parameters
    ----------
    x : torch.Tensor of shape (n, D)
        The layer's input.
    m : torch.Tensor of shape (J, D)
        The memories at the step's start.
    dm : torch.Tensor of shape (J, D) or None
        Their step (None: the memories do not move).
    t : torch.Tensor of shape (n,)
        Each row's point along the step.
    slope : torch.Tensor of shape (n, J)
        ``s_ij`` of ``d k(x_i, mu_ij) / d x_i = s_ij (x_i - mu_ij)``.

    Returns
    -------
    callable
        ``(..., n, J) -> (..., n, D)``: cotangents ``g`` of the layer's output to
        ``sum_j c_ij (x_i - mu_ij)`` with ``c = g s``, expanded about the mean
        memory ``c0``: ``(sum_j c_ij) (x_i - c0) - c_i (M - c0) - t_i c_i dM``.
    """
    centre = m.mean(0)
    centred_x, centred_m = x - centre, m - centre
    # The step's term only for the rows off the step's start (the training rows
    # that join a pass sit at t = 0, where it is zero).
    moving = None if dm is None else torch.nonzero(t != 0).flatten()
    if moving is not None and moving.numel() == t.shape[0]:
        moving = slice(None)
    t_col = t[moving, None] if moving is not None else None

    def vjp(cotangents):
        c = cotangents * slope
        out = c.sum(-1, keepdim=True) * centred_x
        out.sub_(c @ centred_m)
        if moving is not None:
            out[..., moving, :] -= t_col * (c[..., moving, :] @ dm)
        return out

    return vjp
