"""The counterfactual scores' certificate: finite differences of real retraining.

Independent of the adjoint sweep, the model is trained again from the same initial
weights and batch order (the host's ``refit``) with

- one training row's sample weight scaled by :math:`1 \\pm h`, for a sample of rows:
  the central difference :math:`(T_+ - T_-) / 2h` estimates that row's score
  :math:`\\partial T / \\partial \\log \\omega_i`;
- every row's loss scaled by :math:`1 \\pm h / \\bar{b}` (:math:`\\bar b` the mean batch
  size, so that the weights move about as much as for one row; through the solver's
  parameters, see
  ``UpdateMap.loss_scaling``: the learning rate for SGD, Adam's ``epsilon``, with the
  L2 weight decay divided alike): the central difference estimates
  :math:`\\sum_i \\partial T / \\partial \\varepsilon_i`, the all-rows identity.

Errors are relative to the largest finite difference of each query (over the rows
checked), so that rows whose score is nearly zero do not blow them up; the sum's,
to the sum of the absolute scores. The
truncation error of a central difference is :math:`O(h^2)` and its rounding error
about :math:`10^{-16} |T| / h`: with the default ``h = 1e-4``, about 1e-8 relative
on smooth networks in float64. Cost: ``2 (rows + 1) + 1`` fits (one reproduces the
run first: a host whose refit does not give the recorded weights, e.g. without a
fixed ``random_state``, is refused).
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RetrainingCertificate:
    """How closely real retraining confirms the counterfactual scores.

    Attributes
    ----------
    rows : ndarray of shape (r,)
        The training rows checked.
    h : float
        The relative step of the central differences.
    finite_differences : ndarray of shape (n, r)
        :math:`(T(\\omega_i (1 + h)) - T(\\omega_i (1 - h))) / 2h` per query and row.
    scores : ndarray of shape (n, r)
        The sweep's ``scores`` of those rows.
    row_error : float
        ``max |scores - finite_differences|`` relative to each query's largest
        ``|finite_differences|``, the worst query.
    total_h : float
        The relative step of the sum's central difference: ``h`` over the mean batch
        size, so that scaling every row's loss moves the weights about as much as
        one row's sample weight does (a step as large as ``h`` for every row crosses
        the kinks of a ReLU network).
    total_difference : ndarray of shape (n,)
        The central difference of every row's loss scaled by ``1 +- total_h``.
    total_score : ndarray of shape (n,)
        The sweep's ``loss_weight_scores.sum(1)``.
    total_error : float
        ``max |total_score - total_difference|`` relative to each query's
        ``sum_i |loss_weight_scores_i|`` (the sum may cancel to far below its terms,
        and the rounding of a difference is relative to the terms), the worst query.
    """

    rows: np.ndarray
    h: float
    finite_differences: np.ndarray
    scores: np.ndarray
    row_error: float
    total_h: float
    total_difference: np.ndarray
    total_score: np.ndarray
    total_error: float

    @property
    def error(self):
        """The larger of :attr:`row_error` and :attr:`total_error`."""
        return max(self.row_error, self.total_error)


def _relative(estimate, reference):
    """``max |estimate - reference|`` over each query's largest ``|reference|``."""
    scale = np.abs(reference).max(axis=-1, keepdims=True) if reference.ndim > 1 else None
    if scale is None:
        scale = np.abs(reference).max()
    scale = np.where(scale > 0, scale, 1.0)
    return float((np.abs(estimate - reference) / scale).max())


def _relative_to(estimate, reference, scale):
    """``max |estimate - reference| / scale`` over queries (a zero scale counts as 1)."""
    scale = np.where(scale > 0, scale, 1.0)
    return float((np.abs(estimate - reference) / scale).max())


def retraining_certificate(context, run, evaluate, attribution, rows, h):
    """The :class:`RetrainingCertificate` of ``attribution`` by retraining.

    Parameters
    ----------
    context : ExplanationContext
        Its ``refit`` retrains.
    run : TrainingRun
    evaluate : callable
        ``evaluate(final_weights) -> ndarray (n,)``: the queries' targets at weights.
    attribution : CounterfactualAttribution
    rows : ndarray of int
    h : float
    """
    if context.refit is None:
        raise ValueError(
            "This model cannot be retrained, so its counterfactual scores cannot be "
            "certified by retraining (certify=0 skips the check)."
        )
    weights = run.sample_weight.cpu().numpy()
    recorded = run.weights(run.n_steps).cpu()
    final, n_steps = context.refit()
    if n_steps != run.n_steps or not torch.allclose(final, recorded, rtol=1e-12, atol=1e-14):
        raise ValueError(
            "Retraining does not reproduce the recorded run (different initial weights, "
            "batch order or number of steps), so finite differences of retraining cannot "
            "certify it: fit with an int random_state and tol=None."
        )

    def target_at(**changes):
        final, steps = context.refit(**changes)
        if steps != run.n_steps:
            raise ValueError(
                f"A retrained run took {steps} steps instead of {run.n_steps}: "
                "early stopping (tol) must be off to certify."
            )
        return evaluate(final)

    differences = np.zeros((attribution.values.shape[0], len(rows)))
    for j, row in enumerate(rows):
        up, down = weights.copy(), weights.copy()
        up[row] *= 1 + h
        down[row] *= 1 - h
        differences[:, j] = (target_at(sample_weight=up) - target_at(sample_weight=down)) / (2 * h)
    scores = attribution.scores[:, rows]

    total_h = h / float(np.mean([len(batch) for batch in run.path.batches]))
    total_difference = (target_at(loss_scale=1 + total_h) - target_at(loss_scale=1 - total_h)) / (
        2 * total_h
    )
    total_score = attribution.loss_weight_scores.sum(axis=1)
    return RetrainingCertificate(
        rows=np.asarray(rows),
        h=h,
        finite_differences=differences,
        scores=scores,
        row_error=_relative(scores, differences) if len(rows) else 0.0,
        total_h=total_h,
        total_difference=total_difference,
        total_score=total_score,
        total_error=_relative_to(
            total_score, total_difference, np.abs(attribution.loss_weight_scores).sum(axis=1)
        ),
    )
