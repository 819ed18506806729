"""Scalar targets of a query's output: counterfactual attribution, decomposition.

A target turns one query's output ``f`` (K,) and a per-query label into the
scalar :math:`T` whose derivative the adjoint sweep (:mod:`._adjoint`) pulls back
through the run, and which the decomposition writes as a sum over the training
points at the cost of one output (:class:`QueryTargets`: the query side's
cotangent is :math:`\\nabla_f T` at each quadrature node, contracted before the
products with the training side). Each is a pure function of ``f``, written so
that ``torch.func`` can take its gradient under ``vmap`` (one label per query):

- :class:`OutputTarget`: :math:`T = f_c`, the output ``c`` (a classifier's
  log-probability of class ``c``, a regressor's output ``c``);
- :class:`MarginTarget`: :math:`T = f_c - \\log \\sum_{k \\ne c} e^{f_k}`, the margin
  of class ``c`` (for the log-softmax, :math:`\\log p_c - \\log(1 - p_c)`, the
  same on the logits);
- :class:`LossTarget`: :math:`T = l(f, y)`, the training loss at the query with
  label (or value) ``y``.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch.func import vmap

#: The targets by the name ``target=`` takes (:func:`register_target`).
TARGETS = {}


def register_target(name, needs_classes=False):
    """Class decorator: register a :class:`Target` as ``target=name`` (of the
    decomposition, the explanations and the counterfactual scores);
    ``needs_classes``: for classifiers only."""

    def register(target):
        target.name, target.needs_classes = name, needs_classes
        TARGETS[name] = target
        return target

    return register


class Target(ABC):
    """A scalar function of one query's output and its label."""

    name = None
    #: Whether the target is for classifiers only.
    needs_classes = False

    #: Whether the label is an output index (else a loss target: a class code or values).
    column_label = True
    #: Whether :math:`T` is linear in ``f`` (its gradient does not move along a step).
    linear = False
    #: Whether fitting a training point lowers :math:`T` at it (a loss), rather
    #: than raising it (its own label's output or margin): the sign a ranking by
    #: self-influence reads :math:`T`'s contributions with.
    lowered_by_fitting = False

    @abstractmethod
    def __call__(self, f, label):
        """:math:`T` (a 0-d tensor) of the output ``f`` (K,) and the query's ``label``."""

    def values(self, f, labels):
        """:math:`T` of many rows: ``f`` (n, K), ``labels`` (n, ...) -> (n,)."""
        return vmap(self)(f, labels)

    def gradients(self, f, labels):
        """:math:`\\nabla_f T` of many rows (n, K): one backward pass (each value
        depends on its own row)."""
        f = f.detach().requires_grad_(True)
        with torch.enable_grad():
            return torch.autograd.grad(self.values(f, labels).sum(), f)[0]


@register_target("output")
class OutputTarget(Target):
    """:math:`T = f_c`: the output of column ``c`` (the label)."""

    linear = True

    def __call__(self, f, label):
        return f.gather(0, label.reshape(1))[0]

    def values(self, f, labels):
        return f.gather(1, labels.reshape(-1, 1))[:, 0]

    def gradients(self, f, labels):
        return torch.nn.functional.one_hot(labels, f.shape[1]).to(f.dtype)


@register_target("margin", needs_classes=True)
class MarginTarget(Target):
    """:math:`T = f_c - \\mathrm{logsumexp}_{k \\ne c} f_k`, the margin of class ``c``."""

    def __call__(self, f, label):
        own = torch.arange(f.shape[0], device=f.device) == label
        others = torch.where(own, torch.full_like(f, -torch.inf), f)
        return f.gather(0, label.reshape(1))[0] - torch.logsumexp(others, 0)

    def values(self, f, labels):
        own = torch.arange(f.shape[1], device=f.device)[None] == labels.reshape(-1, 1)
        others = torch.where(own, torch.full_like(f, -torch.inf), f)
        return f.gather(1, labels.reshape(-1, 1))[:, 0] - torch.logsumexp(others, 1)


@register_target("loss")
class LossTarget(Target):
    """:math:`T = l(f, y)`, the per-sample training loss at the query.

    Parameters
    ----------
    loss : Loss
        The training loss (its ``per_sample``).
    """

    column_label = False
    lowered_by_fitting = True

    def __init__(self, loss):
        self.loss = loss

    def __call__(self, f, label):
        return self.loss.per_sample(f[None], label[None])[0]

    def values(self, f, labels):
        return self.loss.per_sample(f, labels)


@dataclass(frozen=True)
class QueryTargets:
    """A :class:`Target` with one label per query row: what the decomposition of a
    scalar per query takes.

    Parameters
    ----------
    target : Target
    labels : torch.Tensor of shape (n,) or (n, K)
        Row ``r``'s label (an output index, a class code, or a loss's values), on
        the engine's device.
    """

    target: Target
    labels: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.target, Target):
            raise TypeError(f"target must be a Target, got {type(self.target).__name__}.")

    @property
    def n_rows(self):
        """The query rows."""
        return self.labels.shape[0]

    def take(self, rows):
        """The targets of the rows ``rows`` (an index or a slice)."""
        return QueryTargets(self.target, self.labels[rows])

    def repeated(self, times):
        """Row ``r``'s label ``times`` times in a row (the points of its pieces)."""
        return QueryTargets(self.target, self.labels.repeat_interleave(times, dim=0))

    def values(self, f):
        """:math:`T` of each row's output ``f`` (n, K): (n, 1)."""
        with torch.no_grad():
            return self.target.values(f, self.labels)[:, None]

    def output_gradients(self, f):
        """:math:`\\nabla_f T` at each row's output ``f`` (n, K): (n, K), the
        cotangent on ``f`` whose backward pass is the gradient of :math:`T`."""
        return self.target.gradients(f, self.labels)

    def logit_gradients(self, link, z):
        """:math:`\\nabla_z T(\\mathrm{link}(z))` at each row's logits ``z`` (n, K):
        (n, K), the cotangent at the logits."""

        z = z.detach().requires_grad_(True)
        with torch.enable_grad():  # one backward pass: each value depends on its own row
            values = self.target.values(link(z), self.labels)
            return torch.autograd.grad(values.sum(), z)[0]
