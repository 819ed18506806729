"""Scalar targets of a query's output, for counterfactual attribution.

A target turns one query's output ``f`` (K,) and a per-query label into the
scalar :math:`T` whose derivative the adjoint sweep (:mod:`._adjoint`) pulls back
through the run. Each is a pure function of ``f``, written so that ``torch.func``
can take its gradient under ``vmap`` (one label per query):

- :class:`OutputTarget`: :math:`T = f_c`, the output ``c`` (a classifier's
  log-probability of class ``c``, a regressor's output ``c``);
- :class:`MarginTarget`: :math:`T = f_c - \\log \\sum_{k \\ne c} e^{f_k}`, the margin
  of class ``c`` (for the log-softmax, :math:`\\log p_c - \\log(1 - p_c)`, the
  same on the logits);
- :class:`LossTarget`: :math:`T = l(f, y)`, the training loss at the query with
  label (or value) ``y``.
"""

from abc import ABC, abstractmethod

import torch


class Target(ABC):
    """A scalar function of one query's output and its label."""

    #: Whether the label is an output index (else a loss target: a class code or values).
    column_label = True

    @abstractmethod
    def __call__(self, f, label):
        """:math:`T` (a 0-d tensor) of the output ``f`` (K,) and the query's ``label``."""


class OutputTarget(Target):
    """:math:`T = f_c`: the output of column ``c`` (the label)."""

    def __call__(self, f, label):
        return f.gather(0, label.reshape(1))[0]


class MarginTarget(Target):
    """:math:`T = f_c - \\mathrm{logsumexp}_{k \\ne c} f_k`, the margin of class ``c``."""

    def __call__(self, f, label):
        own = torch.arange(f.shape[0], device=f.device) == label
        others = torch.where(own, torch.full_like(f, -torch.inf), f)
        return f.gather(0, label.reshape(1))[0] - torch.logsumexp(others, 0)


class LossTarget(Target):
    """:math:`T = l(f, y)`, the per-sample training loss at the query.

    Parameters
    ----------
    loss : Loss
        The training loss (its ``per_sample``).
    """

    column_label = False

    def __init__(self, loss):
        self.loss = loss

    def __call__(self, f, label):
        return self.loss.per_sample(f[None], label[None])[0]
