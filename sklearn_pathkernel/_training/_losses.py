"""Training losses: the function ``f`` the path kernel reproduces, and the loss on it.

A loss owns its mathematics. Its *link* turns the module's output into ``f``, the
network's *output*: the function whose change along the path the kernel decomposes
(the log-probabilities for the cross-entropy, the prediction itself for the squared
error). Its per-sample value ``l(f(x_i), y_i)`` is averaged over a batch with the
points' shares ``a_{s,i}`` (sample weights normalised over the batch). Training
records, per step and batch point, the *output gradient*

.. math::

    e_{s,i} = -\\frac{\\partial L_s}{\\partial f(x_i; w_s)} \\in \\mathbb{R}^K,
    \\qquad L_s = \\sum_{i \\in B_s} a_{s,i}\\, l(f(x_i; w_s), y_i),

so that the step's loss gradient is :math:`G_s = -\\sum_{i \\in B_s} \\sum_k e_{s,i,k}
\\nabla_w f_k(x_i; w_s)` for any loss. For the cross-entropy of ``log_softmax``,
:math:`e_{s,i} = a_{s,i}\\, \\mathrm{onehot}(y_i)`; for the squared error of
``MLPRegressor`` (:math:`\\frac{1}{2K} \\|f - y\\|^2`),
:math:`e_{s,i} = a_{s,i} (y_i - f(x_i; w_s)) / K`, the residual at the step's start.

A loss also says what its targets are (:class:`ClassificationLoss`: class codes;
:class:`RegressionLoss`: values), how closely the certificate holds ``f``
(:attr:`Loss.certificate_tolerance`) and how the estimators turn ``f`` into
predictions (:meth:`ClassificationLoss.log_proba`, :meth:`RegressionLoss.prediction`).

A new loss is one subclass of :class:`ClassificationLoss` or :class:`RegressionLoss`
(a link and a per-sample value; the output gradient follows by autograd), set as
the ``_loss`` of the estimator base that trains on it.
"""

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


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


class Loss(ABC):
    """A training loss on the output ``f = link(module(x))``.

    Subclasses give :meth:`link` and :meth:`per_sample`; :meth:`batch_loss` and
    :meth:`output_gradient` follow from them.
    """

    #: The largest absolute error, in units of ``f``, that the certificate lets a
    #: step's quadrature have before it integrates the step again more finely.
    certificate_tolerance = 1e-11
    #: Whether the targets are class codes and the module's outputs one score per
    #: class (the module checks' wording: "logits" of "classes", or "predictions").
    classifies = False

    @abstractmethod
    def link(self, out):
        """The output ``f`` (n, K) from the module's output ``out`` (n, K)."""

    @abstractmethod
    def per_sample(self, f, targets):
        """The loss of each row, (n,), given the output ``f`` (n, K) and the targets."""

    @property
    def output_link(self):
        """The link as a :class:`Link` object (a loss whose link is known in
        closed form gives a subclass with its Jacobian)."""
        return FunctionLink(self.link)

    def batch_loss(self, f, targets, shares):
        """:math:`L = \\sum_i a_i\\, l(f_i, y_i)`, a scalar tensor; ``shares`` (n,) are the
        :math:`a_i`. Cost: one :meth:`per_sample`."""
        return (shares * self.per_sample(f, targets)).sum()

    def output_gradient(self, f, targets, shares):
        """The output gradients :math:`e_i = -\\partial L / \\partial f_i`, (n, K).

        By autograd of :meth:`batch_loss` at ``f`` (detached: no gradient flows to
        the module), exactly the cotangent that ``batch_loss(...).backward()``
        would send into the module. Cost: one :meth:`per_sample` and its backward.
        """
        with torch.enable_grad():
            f = f.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.batch_loss(f, targets, shares), f)
        return -grad


class ClassificationLoss(Loss):
    """A loss on class codes (n,), int64: the module's outputs score the classes."""

    classifies = True

    @abstractmethod
    def log_proba(self, f):
        """The classes' log-probabilities (n, K) from the output ``f`` (n, K): what
        ``predict_log_proba`` returns, and ``predict`` takes the largest of."""


class RegressionLoss(Loss):
    """A loss on target values (n, K), float64."""

    def prediction(self, f):
        """The estimator's prediction (n, K) from the output ``f``: ``f`` itself."""
        return f


class CrossEntropy(ClassificationLoss):
    """Cross-entropy of the log-softmax: ``f = log_softmax(out)``, ``l = -f_y``.

    Output gradient :math:`e_i = a_i\\, \\mathrm{onehot}(y_i)`; ``f`` is the
    log-probabilities themselves.
    """

    #: The link with its Jacobian.
    output_link = LogSoftmaxLink()

    def link(self, out):
        return log_softmax(out)

    def per_sample(self, f, targets):
        return -f.gather(1, targets[:, None]).squeeze(1)

    def log_proba(self, f):
        return f


class SquaredError(RegressionLoss):
    """Half the mean squared error over the outputs (``MLPRegressor``'s loss),
    ``l = |f - y|^2 / (2K)`` with ``f = out``.

    Output gradient :math:`e_i = a_i (y_i - f_i) / K`, the scaled residual.
    """

    #: The link with its Jacobian.
    output_link = IdentityLink()

    def link(self, out):
        return out

    def per_sample(self, f, targets):
        return 0.5 * (f - targets).square().mean(dim=1)
