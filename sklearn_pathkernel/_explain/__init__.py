"""Explanations of predictions by the training points that made them.

Built on the engine's exact decomposition: top-k proponents and opponents
(:mod:`._explanation`), self-influence linear in the training set
(:mod:`._self_influence`), attribution over training time (:mod:`._over_time`),
normalised and per-class scores (:mod:`._scoring`), streamed influence matrices
(:mod:`._streaming`), and the mixin that puts them on every estimator
(:mod:`._mixin`).
"""
