"""A decomposition as the hosts return it, certified against the network's own output."""

import numpy as np
import torch
from sklearn.utils import Bunch


def checked_against(parts, output, **extra):
    """The engine's decomposition ``parts`` as the estimators and recordings return it, checked
    against the network's own ``output`` (n, K): ``residual`` is, per query,
    ``max_k |bias + sum_i c_i + decay - output|``, the certificate computed from the
    module's forward pass, independently of the quadrature (whose own bound is
    ``quadrature_error``). ``extra`` fields are added as they are."""
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    if "statistics" in parts:  # BatchNorm's running statistics: their share of the contributions
        extra = {"statistics": parts.statistics, **extra}
    return Bunch(
        contributions=parts.contributions,
        bias=parts.bias,
        decay=parts.decay,
        output=output,
        residual=np.abs(total - output).max(axis=1),
        quadrature_error=parts.quadrature_error,
        **extra,
    )


def target_values(targets, f):
    """The targets' values (n,) of a host array ``f`` (n, K) of outputs."""
    device = targets.labels.device
    return targets.values(torch.as_tensor(f, device=device))[:, 0].cpu().numpy()


def checked_for_targets(parts, output, targets, **extra):
    """:func:`checked_against` for the decomposition of a scalar target per query
    (``parts`` from ``decompose(X, targets=targets)``): ``output`` (n, K), the
    network's own, is taken through the target, and the arrays lose their output
    axis: ``contributions`` (n, M), ``bias``, ``decay``, ``output`` (n,), with
    ``target`` (its name) and ``labels`` (n,) or (n, K) (each query's label)."""
    checked = checked_against(parts, target_values(targets, output)[:, None], **extra)
    for name in ("contributions", "bias", "decay", "output", "statistics"):
        if name in checked:
            checked[name] = checked[name][..., 0]
    checked["target"] = targets.target.name
    checked["labels"] = targets.labels.cpu().numpy()
    return checked
