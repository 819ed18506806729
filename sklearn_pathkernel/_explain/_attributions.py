"""The attributions an explanation can rank training points by (``method=``).

An attribution scores every training point ``i`` for every query ``x`` and output
``k``: the exact contributions of ``decompose`` (what point ``i`` added to
``f_k(x)`` in this run), or the counterfactual scores (how ``f_k(x)`` would move if
point ``i`` weighed more, through the whole run). :class:`Attribution` is the
protocol every explanation of :class:`~._explainer.Explainer` is written against:
the scores of a tile of queries (:meth:`Attribution.tile`), and each training
point's score for its own output (:meth:`Attribution.self_influence`). A new
attribution is one subclass registered with :func:`register_attribution`; the
top-k tables, plots, influence matrices, per-class sums and self-influence follow.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from .._engine import AdjointSweep
from ._counterfactual import counterfactual_outputs, counterfactual_self_influence, sweep_queries
from ._self_influence import scalar_self_influence, self_influence

#: The attributions, by the name ``method=`` takes.
ATTRIBUTIONS = {}


def register_attribution(name):
    """Class decorator: register an :class:`Attribution` as ``method=name``."""

    def register(attribution):
        attribution.name = name
        ATTRIBUTIONS[name] = attribution
        return attribution

    return register


@dataclass(frozen=True)
class ScoreTile:
    """One tile of queries' scores.

    Attributes
    ----------
    scores : ndarray of shape (n, M, K)
        Training point ``i``'s score for query ``q`` and output ``k`` (``K`` is 1
        for a scalar target per query).
    output : ndarray of shape (n, K)
        The network's output at the queries.
    bias, decay : ndarray of shape (n, K)
        The parts of ``output`` no training point holds (NaN where the attribution
        does not decompose the output).
    """

    scores: np.ndarray
    output: np.ndarray
    bias: np.ndarray
    decay: np.ndarray


class Attribution(ABC):
    """How training points are scored for queries (see the module docstring).

    Subclasses are registered with :func:`register_attribution`; ``name`` is the
    registered name.
    """

    name = None
    #: Whether the scores decompose the output (``bias + scores.sum(1) + decay ==
    #: output``), so that normalising by the path norms and resolving over time
    #: mean something.
    decomposes = False

    @abstractmethod
    def tile(self, context, queries, targets=None):
        """The :class:`ScoreTile` of ``queries`` (a tensor of query rows); with
        ``targets`` (a ``QueryTargets`` of those rows), of one scalar per query at
        the cost of one output: ``K`` is 1."""

    @abstractmethod
    def self_influence(self, context, first_epoch, batch_size, targets=None):
        """Each training point's score for its own output: a ``SelfInfluence``;
        with ``targets`` (a ``QueryTargets`` of the training rows), for its own
        scalar target at the cost of one output per row: ``values`` (M, 1)."""

    @classmethod
    def from_options(cls, hessian=None):
        """The attribution with the explainer's options (those it takes: the
        contributions take none)."""
        return cls()

    def check_options(self, normalize=False, first_epoch=0):
        """Refuse, by name, the options this attribution has no meaning for."""
        if not self.decomposes and normalize:
            raise ValueError(
                f"normalize=True is for method='contributions' only, not {self.name!r}."
            )
        if not self.decomposes and first_epoch != 0:
            raise ValueError(f"first_epoch is for method='contributions' only, not {self.name!r}.")


@register_attribution("contributions")
class Contributions(Attribution):
    """The exact terms of ``decompose``: what each point added in this run.

    Cost per tile: one ``decompose`` of its queries (of one output with a target).
    """

    decomposes = True

    def tile(self, context, queries, targets=None):
        parts = context.engine.decompose(queries, targets=targets)
        return ScoreTile(parts.contributions, parts.output, parts.bias, parts.decay)

    def self_influence(self, context, first_epoch, batch_size, targets=None):
        return self_influence(context, first_epoch, targets)


@register_attribution("counterfactual")
class Counterfactual(Attribution):
    """The counterfactual scores: ``d f_k(x) / d log w_i`` through the whole run
    (see ``counterfactual``), with the ``"output"`` target of every output.

    Parameters
    ----------
    hessian : bool or None, default=None
        As ``counterfactual``'s: None follows the optimiser family's rule.

    Cost per tile: ``n K`` adjoint vectors swept over the run (``n`` with a
    target).
    """

    def __init__(self, hessian=None):
        self.hessian = hessian

    @classmethod
    def from_options(cls, hessian=None):
        return cls(hessian=hessian)

    def tile(self, context, queries, targets=None):
        n = queries.shape[0]
        if targets is not None:
            run = self._run(context)
            hessian = run.update.stable_adjoint if self.hessian is None else self.hessian
            found = sweep_queries(
                AdjointSweep(run), queries, targets.target, targets.labels, n, hessian
            )
            output = found["values"][:, None]
            missing = np.full_like(output, np.nan)
            return ScoreTile(found["scores"][..., None], output, missing, missing)
        scores, output = counterfactual_outputs(context, queries, n, False, self.hessian)
        missing = np.full_like(output, np.nan)
        return ScoreTile(scores, output, missing, missing)

    def self_influence(self, context, first_epoch, batch_size, targets=None):
        if targets is None:
            return counterfactual_self_influence(context, batch_size, self.hessian)
        run = self._run(context)
        hessian = run.update.stable_adjoint if self.hessian is None else self.hessian
        found = sweep_queries(  # one adjoint vector per row, batch_size rows at a time
            AdjointSweep(run), context.engine.X_train, targets.target, targets.labels,
            batch_size, hessian,
        )  # fmt: skip
        return scalar_self_influence(context, np.diagonal(found["scores"]).copy(), targets)

    @staticmethod
    def _run(context):
        """The context's ``TrainingRun``, or a clear error where it has none."""
        if context.training_run is None:
            raise ValueError(
                "Counterfactual attribution needs the training loss, targets, sample "
                "weights and optimiser, which this model does not hold."
            )
        return context.training_run()


def attribution_of(method, hessian=None):
    """The :class:`Attribution` ``method`` names (or is), or a clear error."""
    if isinstance(method, Attribution):
        return method
    if method not in ATTRIBUTIONS:
        raise ValueError(f"method must be one of {list(ATTRIBUTIONS)}, got {method!r}.")
    return ATTRIBUTIONS[method].from_options(hessian=hessian)
