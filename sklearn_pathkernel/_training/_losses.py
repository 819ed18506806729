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
(a link and a per-sample value; the output gradient follows by autograd), registered
with :func:`register_loss` under the name the estimators' ``loss`` parameter takes
(scikit-learn's name where it has one: ``"log_loss"``, ``"squared_error"``).
"""

from abc import ABC, abstractmethod

import torch

from .._path import CERTIFICATE_TOLERANCE, FunctionLink, IdentityLink, LogSoftmaxLink, log_softmax

#: The classifiers' losses, by the name their ``loss`` parameter takes.
CLASSIFICATION_LOSSES = {}
#: The regressors' losses, by the name their ``loss`` parameter takes.
REGRESSION_LOSSES = {}


def register_loss(name):
    """Class decorator: register a :class:`ClassificationLoss` or
    :class:`RegressionLoss` subclass as the estimators' ``loss=name``. The one
    registration a new loss needs; the estimators' ``loss`` constraint follows."""

    def register(loss):
        registry = CLASSIFICATION_LOSSES if loss.classifies else REGRESSION_LOSSES
        if name in registry:
            raise ValueError(f"A loss named {name!r} is registered already: {registry[name]}.")
        registry[name] = loss
        return loss

    return register


class Loss(ABC):
    """A training loss on the output ``f = link(module(x))``.

    Subclasses give :meth:`link` and :meth:`per_sample`; :meth:`batch_loss` and
    :meth:`output_gradient` follow from them.
    """

    #: The largest absolute error, in units of ``f``, that the certificate lets a
    #: step's quadrature have before it integrates the step again more finely.
    certificate_tolerance = CERTIFICATE_TOLERANCE
    #: Whether the targets are class codes and the module's outputs one score per
    #: class (the module checks' wording: "logits" of "classes", or "predictions").
    classifies = False
    #: What the loss is, for the estimators' ``loss`` parameter doc.
    summary = ""

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


@register_loss("log_loss")
class CrossEntropy(ClassificationLoss):
    """Cross-entropy of the log-softmax: ``f = log_softmax(out)``, ``l = -f_y``.

    Output gradient :math:`e_i = a_i\\, \\mathrm{onehot}(y_i)`; ``f`` is the
    log-probabilities themselves.
    """

    summary = "the mean cross-entropy of ``f = log_softmax(module(x))``"

    #: The link with its Jacobian.
    output_link = LogSoftmaxLink()

    def link(self, out):
        return log_softmax(out)

    def per_sample(self, f, targets):
        return -f.gather(1, targets[:, None]).squeeze(1)

    def log_proba(self, f):
        return f


@register_loss("squared_error")
class SquaredError(RegressionLoss):
    """Half the mean squared error over the outputs (``MLPRegressor``'s loss),
    ``l = |f - y|^2 / (2K)`` with ``f = out``.

    Output gradient :math:`e_i = a_i (y_i - f_i) / K`, the scaled residual.
    """

    summary = "half the mean squared error of ``f = module(x)``, as ``MLPRegressor``"

    #: The link with its Jacobian.
    output_link = IdentityLink()

    def link(self, out):
        return out

    def per_sample(self, f, targets):
        return 0.5 * (f - targets).square().mean(dim=1)
