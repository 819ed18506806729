"""Training losses: the function ``f`` the path kernel reproduces, and the loss on it.

A loss has two parts. Its *link* turns the module's output into ``f``, the function
whose change along the path the kernel decomposes (the log-probabilities for
classification, the prediction itself for regression). Its per-sample value
``l(f(x_i), y_i)`` is averaged over a batch with the points' shares ``a_{s,i}``
(sample weights normalised over the batch). Training records, per step and batch
point, the *output gradient*

.. math::

    e_{s,i} = -\\frac{\\partial L_s}{\\partial f(x_i; w_s)} \\in \\mathbb{R}^K,

so that the step's loss gradient is :math:`G_s = -\\sum_{i \\in B_s} \\sum_k e_{s,i,k}
\\nabla_w f_k(x_i; w_s)` for any loss. For the cross-entropy of ``log_softmax``,
:math:`e_{s,i} = a_{s,i}\\, \\mathrm{onehot}(y_i)`; for the squared error of
``MLPRegressor`` (:math:`\\frac{1}{2K} \\|f - y\\|^2`),
:math:`e_{s,i} = a_{s,i} (y_i - f(x_i; w_s)) / K`, the residual at the step's start.

A new loss is one :class:`Loss` subclass.
"""

from abc import ABC, abstractmethod

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


class Loss(ABC):
    """A training loss on ``f = link(module(x))``."""

    #: The largest absolute error, in units of ``f``, that the certificate lets a
    #: step's quadrature have before it integrates the step again more finely.
    certificate_tolerance = 1e-11

    @abstractmethod
    def link(self, out):
        """``f`` from the module's output ``out`` (n, K)."""

    @abstractmethod
    def per_sample(self, f, targets):
        """The loss of each row, (n,), given ``f`` (n, K) and the batch's targets."""


class CrossEntropy(Loss):
    """Cross-entropy of the log-softmax; targets are class codes (n,), int64."""

    def link(self, out):
        return log_softmax(out)

    def per_sample(self, f, targets):
        return -f.gather(1, targets[:, None]).squeeze(1)


class SquaredError(Loss):
    """Half the mean squared error over the outputs (``MLPRegressor``'s loss);
    targets are (n, K) floats."""

    def link(self, out):
        return out

    def per_sample(self, f, targets):
        return 0.5 * (f - targets).square().mean(dim=1)
