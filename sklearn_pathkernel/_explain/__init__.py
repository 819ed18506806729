"""Explanations of predictions by the training points that made them.

Built on the engine's exact decomposition: top-k proponents and opponents
(:class:`Explanation`), self-influence linear in the training set
(:class:`SelfInfluence`), attribution over training time
(:class:`TimeAttribution`), normalised and per-class scores, streamed influence
matrices, and the mixin that puts them on every host (:class:`ExplanationMixin`),
each host (an estimator, a recording) supplying its own
:class:`ExplanationContext`, and the one object they build (:class:`Explainer`).
"""

from ._context import ExplanationContext
from ._counterfactual import CounterfactualAttribution
from ._explainer import Explainer
from ._explanation import Explanation
from ._mixin import ExplanationMixin
from ._over_time import TimeAttribution
from ._retraining import RetrainingCertificate
from ._self_influence import SelfInfluence
from ._targets import decomposition_targets, target_names

__all__ = [
    "CounterfactualAttribution",
    "Explainer",
    "ExplanationContext",
    "Explanation",
    "ExplanationMixin",
    "RetrainingCertificate",
    "SelfInfluence",
    "TimeAttribution",
    "decomposition_targets",
    "target_names",
]
