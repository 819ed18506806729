"""A decomposition as the hosts return it, certified against the network's own output."""

import numpy as np
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
