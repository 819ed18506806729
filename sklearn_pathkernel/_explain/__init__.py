"""Explanations of predictions by the training points that made them.

Built on the engine's exact decomposition: top-k proponents and opponents
(:class:`Explanation`), self-influence linear in the training set
(:class:`SelfInfluence`), attribution over training time
(:class:`TimeAttribution`), normalised and per-class scores, streamed influence
matrices, and the mixin that puts them on every host (:class:`ExplanationMixin`),
which supplies its own context (:func:`estimator_context`,
:func:`recording_context`).
"""

from ._counterfactual import CounterfactualAttribution
from ._estimator_context import estimator_context
from ._explanation import Explanation
from ._mixin import ExplanationMixin
from ._over_time import TimeAttribution
from ._recording_context import recording_context
from ._retraining import RetrainingCertificate
from ._self_influence import SelfInfluence

__all__ = [
    "CounterfactualAttribution",
    "Explanation",
    "ExplanationMixin",
    "RetrainingCertificate",
    "SelfInfluence",
    "TimeAttribution",
    "estimator_context",
    "recording_context",
]
