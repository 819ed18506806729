"""Links: the function ``f = link(z)`` of the module's output ``z`` that the path kernel
reproduces (the log-probabilities for a classifier, ``z`` itself for a regressor).

The engine differentiates and certifies ``f``; a training loss (see
``sklearn_pathkernel._training``) chooses its link. :func:`output_cotangent` turns a
choice of outputs per row into the cotangent of a backward pass.
"""

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

#: The largest absolute error, in units of ``f``, that the certificate lets a step's
#: quadrature have before it integrates the step again more finely.
CERTIFICATE_TOLERANCE = 1e-11


def output_cotangent(outputs, n_outputs, dtype):
    """Which outputs of each row a backward pass differentiates, as a cotangent (n, K).

    ``outputs`` holds a class code per row (int: that output alone) or a
    cotangent per row (float, e.g. an output gradient ``e_{s,i}``: the
    gradient of ``sum_k e_k f_k``).
    """
    if outputs.is_floating_point():
        return outputs.to(dtype)
    return F.one_hot(outputs, n_outputs).to(dtype)


def log_softmax(out):
    """The classifiers' link: log-probabilities of ``out``'s rows."""
    return F.log_softmax(out, dim=1)


class Link(ABC):
    """The link ``f = link(z)`` from the logits ``z`` (n, K), as an object.

    A link known in closed form also gives its Jacobian ``J(z) = df/dz`` (K x K
    per row), weighted and summed over sample points
    (:meth:`weighted_jacobians`): the exact rule turns gradients of the logits at
    its nodes into gradients of ``f`` with it (``integration/_link_weights.py``).
    One that is not (``closed_form = False``, :class:`FunctionLink`) has the
    engine back-propagate ``f`` itself.
    """

    #: Whether :meth:`weighted_jacobians` is available.
    closed_form = False
    #: Whether ``f`` is affine in ``z`` (a constant Jacobian).
    affine = False

    @abstractmethod
    def __call__(self, out):
        """``f`` (n, K) from the module's output ``out`` (n, K)."""

    def weighted_jacobians(self, coefficients, z):
        """``sum_m coefficients[q, m] J(z[p, m])`` per row ``p`` and weight set ``q``.

        Parameters
        ----------
        coefficients : torch.Tensor of shape (Q, M)
        z : torch.Tensor of shape (P, M, K)
            The logits at ``M`` sample points of each of ``P`` rows.

        Returns
        -------
        torch.Tensor of shape (P, Q, K, K)
            Entry ``[p, q, k, j]``: ``sum_m c[q, m] df_k/dz_j (z[p, m])``.
        """
        raise NotImplementedError(f"{type(self).__name__} has no closed-form Jacobian.")


class FunctionLink(Link):
    """Any callable as a link, without a closed-form Jacobian.

    Parameters
    ----------
    function : callable
        ``f`` from ``z``.
    """

    def __init__(self, function):
        self.function = function

    def __call__(self, out):
        return self.function(out)


class IdentityLink(Link):
    """``f = z``: ``J = I``. Cost of :meth:`weighted_jacobians`: P Q K^2."""

    closed_form = True
    affine = True

    def __call__(self, out):
        return out

    def weighted_jacobians(self, coefficients, z):
        eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
        total = coefficients.sum(1).to(z.dtype)
        return (total[:, None, None] * eye).expand(z.shape[0], -1, -1, -1)


class LogSoftmaxLink(Link):
    """``f = log_softmax(z)``: ``J(z) = I - 1 p(z)^T`` with ``p = softmax(z)``.

    :meth:`weighted_jacobians` is ``(sum_m c_qm) I - 1 r_q^T`` with ``r_q =
    sum_m c_qm p(z_m)``: cost P M K for the softmax and P Q M K for the sums.
    """

    closed_form = True

    def __call__(self, out):
        return log_softmax(out)

    def weighted_jacobians(self, coefficients, z):
        coefficients = coefficients.to(z.dtype)
        # softmax (P, M, K); torch.softmax over a short last axis is several
        # times slower on the CPU than these three operations
        p = (z - z.amax(-1, keepdim=True)).exp_()
        p /= p.sum(-1, keepdim=True)
        r = torch.einsum("qm,pmk->pqk", coefficients, p)  # (P, Q, K)
        eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
        return coefficients.sum(1)[None, :, None, None] * eye - r[:, :, None, :]
