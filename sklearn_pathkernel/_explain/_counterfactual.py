"""Counterfactual attribution: what the prediction would be with a training row's
weight changed, to first order, exactly through the recorded run.

The exact decomposition says what each training row *contributed in this run*;
the counterfactual score says how the query's target :math:`T` *would change*
if the row weighed differently in training,

.. math::

    \\text{scores}_i = \\frac{\\partial T(x; w_S)}{\\partial \\log \\omega_i},

with :math:`\\omega_i` the row's sample weight: the derivative of the whole run (every
later step's gradients move with the earlier steps' moves), by an adjoint sweep over
the recorded path (see the engine's ``_adjoint``). ``loss_weight_scores`` are the
derivatives with respect to each row's loss weight :math:`1 + \\varepsilon_i` with the
batches' normalisation held (the SGD-influence of Hara et al., 2019); the two differ
by each batch's renormalisation, a per-step constant. The leave-one-out prediction
:math:`T - \\text{scores}_i` is the first-order estimate of :math:`T` refitted with
row ``i``'s sample weight 0.
"""

from dataclasses import dataclass

import numpy as np
import torch

from .._engine import TARGETS, AdjointSweep, LossTarget
from ._retraining import retraining_certificate
from ._self_influence import SelfInfluence
from ._streaming import query_tiles

#: The ``target=`` name, besides the registered targets', of the output of each
#: query's predicted class.
PREDICTED = "predicted"


@dataclass(frozen=True)
class CounterfactualAttribution:
    """Each training row's first-order effect on each query's target.

    Attributes
    ----------
    scores : ndarray of shape (n, M)
        :math:`\\partial T / \\partial \\log \\omega_i`: how much the target rises per
        unit of relative sample weight of row ``i`` (retraining with the row's
        weight scaled by :math:`1 + h` moves :math:`T` by about ``h scores_i``).
        Zero for rows of sample weight 0.
    loss_weight_scores : ndarray of shape (n, M)
        :math:`\\partial T / \\partial \\varepsilon_i` with each row's loss weighted by
        :math:`1 + \\varepsilon_i` in every batch whose normalisation is held.
    values : ndarray of shape (n,)
        :math:`T(x; w_S)`, the trained network's target.
    target : str
        ``"output"``, ``"margin"`` or ``"loss"``.
    columns : ndarray of shape (n,)
        The output (or class) index of each query's target.
    adjoint_norms : ndarray of shape (S + 1, n)
        :math:`\\|\\lambda_s\\|`, the pulled-back target gradient of every query before
        every step (row ``S``: :math:`\\|\\nabla_w T\\|` at the final weights).
    replay_error : float
        How exactly the differentiated update map reproduces the recorded weights
        (relative to the largest step; rounding, about 1e-15).
    hessian : bool
        Whether the sweep kept the Hessian term (the exact derivative) or held every
        step's gradient at its recorded weights (the default for Adam and AdamW).
    certificate : RetrainingCertificate or None
        Finite differences of real retraining (``certify`` rows), or None.
    """

    scores: np.ndarray
    loss_weight_scores: np.ndarray
    values: np.ndarray
    target: str
    columns: np.ndarray
    adjoint_norms: np.ndarray
    replay_error: float
    hessian: bool = True
    certificate: object = None

    @property
    def growth(self):
        """``max_s ||lambda_s|| / ||lambda_S||`` per query (n,): how much the run's
        later dynamics amplify the target's gradient on the way back."""
        final = np.where(self.adjoint_norms[-1] > 0, self.adjoint_norms[-1], 1.0)
        return self.adjoint_norms.max(axis=0) / final

    def loo_predictions(self):
        """First-order leave-one-out targets, ``values[:, None] - scores`` (n, M).

        Removing row ``i`` is its sample weight going to 0; the first-order estimate
        of the refitted target is :math:`T - \\partial T / \\partial \\log \\omega_i`.
        An approximation: it neglects the second and higher orders (see the user
        guide for its measured error against real retraining).
        """
        return self.values[:, None] - self.scores

    def top(self, k=10):
        """The ``k`` rows whose removal would lower (``proponents``) and raise
        (``opponents``) each query's target most: two (n, k) index arrays."""
        order = np.argsort(-self.scores, axis=1, kind="stable")
        return order[:, :k], order[:, ::-1][:, :k]


def _check_settings(certify, h, hessian):
    if hessian is not None and not isinstance(hessian, bool):
        raise TypeError(f"hessian must be True, False or None, got {hessian!r}.")
    if isinstance(certify, bool) or not isinstance(certify, int | np.integer) or certify < 0:
        raise ValueError(f"certify must be a non-negative int (rows to retrain), got {certify!r}.")
    if not (isinstance(h, float | int) and 0 < h < 1):
        raise ValueError(f"h must be a relative step in (0, 1), got {h!r}.")


def resolve_target(name, is_classifier, loss):
    """The :class:`~sklearn_pathkernel._engine._targets.Target` named ``name``."""
    if name not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {name!r}.")
    cls = TARGETS[name]
    if cls.needs_classes and not is_classifier:
        raise ValueError(f"target={name!r} needs classes, but this model is a regressor.")
    return cls(loss) if cls is LossTarget else cls()


def sweep_queries(sweep, queries, target, labels, batch_size, hessian=True, horizon=None):
    """The sweep over tiles of ``batch_size`` queries, joined: a dict of arrays
    (``horizon``: :meth:`AdjointSweep.run_queries`'s private experiment)."""
    parts = []
    for tile in query_tiles(queries.shape[0], batch_size):
        parts.append(sweep.run_queries(queries[tile], target, labels[tile], hessian, horizon))
    return {
        "scores": np.concatenate([p.weight_scores for p in parts]),
        "loss_weight_scores": np.concatenate([p.scores for p in parts]),
        "values": np.concatenate([p.values for p in parts]),
        "adjoint_norms": np.concatenate([p.adjoint_norms for p in parts], axis=1),
    }


def counterfactual_attribution(
    context, queries, *, y=None, target="output", output=None, columns=None, batch_size=64,
    certify=0, h=1e-4, random_state=0, hessian=None, horizon=None,
):  # fmt: skip
    """A :class:`CounterfactualAttribution` of ``queries`` (a tensor on the device).

    The output indices of the ``"output"`` and ``"margin"`` targets are ``columns``
    (n,) when given, else :func:`query_columns` of ``y`` and ``output``; ``y`` holds
    the loss targets of ``"loss"``. ``certify`` rows, drawn by ``random_state``, are
    checked by retraining with relative step ``h``. ``horizon`` (private, an
    experiment, in no public signature) is :meth:`AdjointSweep.run_queries`'s: not
    the derivative of the run, so it cannot be certified by retraining.
    """
    if horizon is not None and certify:
        raise ValueError("A horizon's scores are not the run's derivative: certify must be 0.")
    if context.training_run is None:
        raise ValueError(
            "Counterfactual attribution needs the training loss, targets, sample weights "
            "and optimiser, which this model does not hold (a recording of a user's own "
            "loop does not know its loss: state it, TrainingRecorder(module, optimizer, X, "
            "y=y, loss='log_loss'), or recording.loss = ...)."
        )
    _check_settings(certify, h, hessian)
    run = context.training_run()
    if hessian is None:
        hessian = run.update.stable_adjoint
    if target == PREDICTED:  # the output of each query's predicted class
        if not context.is_classifier:
            raise ValueError("target='predicted' needs classes, but this model is a regressor.")
        target, y, output = "output", None, None
    target_fn = resolve_target(target, context.is_classifier, run.loss)
    n = queries.shape[0]
    if columns is None:
        columns = query_columns(context, run, queries, y, output)
    if target_fn.column_label:
        per_query = torch.as_tensor(columns, device=queries.device)
    else:
        per_query = loss_labels(context, y, n, run.X)
    sweep = AdjointSweep(run)
    parts = sweep_queries(sweep, queries, target_fn, per_query, batch_size, hessian, horizon)
    attribution = CounterfactualAttribution(
        **parts,
        target=target,
        columns=np.asarray(columns),
        replay_error=sweep.replay_error,
        hessian=bool(hessian),
    )
    if not certify:
        return attribution

    def evaluate(final):
        final = final.to(queries.device)
        with torch.no_grad():
            f = run.output(final, queries)
            return np.array([float(target_fn(f[q], per_query[q])) for q in range(f.shape[0])])

    rng = np.random.default_rng(random_state)
    rows = np.sort(rng.choice(context.n_train, size=min(certify, context.n_train), replace=False))
    certificate = retraining_certificate(context, run, evaluate, attribution, rows, h)
    return CounterfactualAttribution(**{**attribution.__dict__, "certificate": certificate})


def query_columns(context, run, queries, y, output):
    """The output index of each query's ``"output"`` or ``"margin"`` target (n,):
    ``output`` for every query when given; else a classifier's label ``y`` (its class's
    index) or, without ``y``, the predicted class; a regressor's output 0."""
    n, n_outputs = queries.shape[0], context.engine.n_outputs
    if output is not None:
        if isinstance(output, bool) or not isinstance(output, int | np.integer):
            raise TypeError(f"output must be an int, got {type(output).__name__}.")
        if not 0 <= output < n_outputs:
            raise ValueError(f"output={output} is out of range: the model has {n_outputs} outputs.")
        return np.full(n, int(output))
    if not context.is_classifier:
        return np.zeros(n, dtype=int)
    if y is not None:
        return class_codes(context, y, n)
    with torch.no_grad():
        f = run.output(run.weights(run.n_steps), queries)
    return f.argmax(1).cpu().numpy()


def class_codes(context, y, n):
    """The output index of each label of ``y`` (n,), or a clear error."""
    y = np.asarray(y)
    if y.shape != (n,):
        raise ValueError(f"y must hold one label per query: shape ({n},), got {y.shape}.")
    classes = context.classes
    codes = np.searchsorted(classes, y)
    codes = np.minimum(codes, classes.size - 1)
    unknown = classes[codes] != y
    if unknown.any():
        raise ValueError(
            f"y holds labels the model was not trained on: {np.unique(y[unknown])[:5].tolist()}; "
            f"its classes are {classes.tolist()}."
        )
    return codes


def loss_labels(context, y, n, like):
    """The loss targets of the queries (as the loss takes them), from ``y``: class
    codes, or values in the dtype and on the device of the tensor ``like``."""
    if y is None:
        raise ValueError("target='loss' needs the queries' true targets: pass y.")
    if context.is_classifier:
        return torch.as_tensor(class_codes(context, y, n), device=like.device)
    values = np.asarray(y, dtype=np.float64)
    values = values.reshape(n, -1) if values.ndim == 1 else values
    if values.shape != (n, context.engine.n_outputs):
        raise ValueError(
            f"y must hold the queries' target values, shape ({n}, {context.engine.n_outputs}) "
            f"(or ({n},) for one output); got {np.asarray(y).shape}."
        )
    return torch.as_tensor(values, dtype=like.dtype, device=like.device)


def counterfactual_outputs(context, queries, batch_size, diagonal=False, hessian=None):
    """The ``"output"`` scores of every output of every query: (n, M, K) scores and
    the (n, K) outputs; with ``diagonal`` (the queries are the training rows) only
    each row's own scores, (n, K). ``n K`` adjoint vectors, ``batch_size`` at a time."""
    n, K = queries.shape[0], context.engine.n_outputs
    repeated = queries.repeat_interleave(K, dim=0)
    columns = np.tile(np.arange(K), n)
    found = counterfactual_attribution(
        context, repeated, columns=columns, batch_size=batch_size, hessian=hessian
    )
    values = found.values.reshape(n, K)
    scores = found.scores.reshape(n, K, -1)
    if diagonal:
        return scores[np.arange(n), :, np.arange(n)], values
    return np.moveaxis(scores, 2, 1), values


def counterfactual_self_influence(context, batch_size, hessian=None):
    """The counterfactual :class:`SelfInfluence`: each training row's score for its
    own output (a classifier's own label; every output of a regressor)."""
    rows = context.engine.X_train
    M, K = context.n_train, context.engine.n_outputs
    if context.is_classifier:
        codes = context.label_codes()
        found = counterfactual_attribution(
            context, rows, columns=codes, batch_size=batch_size, hessian=hessian
        )
        own = np.diagonal(found.scores).copy()
        values = np.full((M, K), np.nan)
        values[np.arange(M), codes] = own
        scores = own
    else:
        values, _ = counterfactual_outputs(context, rows, batch_size, True, hessian)
        scores = np.abs(values).sum(axis=1)
    return SelfInfluence(values, scores, context.targets, context.output_names)
