"""The scalar target of each query that a decomposition or an explanation is of.

``target=`` of ``decompose``, ``explain`` and ``influence_matrix`` names a
registered :class:`~sklearn_pathkernel._engine._targets.Target` (``"output"``,
``"margin"``, ``"loss"``), ``"predicted"`` (the output of each query's predicted
class), or gives one output index per query; :func:`decomposition_targets`
turns it, with the queries' labels ``y``, into the engine's ``QueryTargets``.
"""

import numpy as np
import torch

from .._engine import TARGETS, OutputTarget, QueryTargets
from ._counterfactual import PREDICTED, class_codes, loss_labels, resolve_target
from ._streaming import check_columns


def target_names():
    """Every name ``target=`` takes."""
    return [*TARGETS, PREDICTED]


def decomposition_targets(context, queries, target, y=None):
    """The :class:`QueryTargets` of ``queries`` (a tensor on the device), or None.

    Parameters
    ----------
    context : ExplanationContext
    queries : torch.Tensor of shape (n, ...)
    target : None, str or array-like of int of shape (n,)
        None: every output (no target). ``"predicted"``: ``f_c`` with ``c`` each
        query's predicted class (classifiers). ``"output"`` and ``"margin"``:
        of each query's class ``y`` (classifiers; without ``y``, the predicted
        class; a regressor's ``"output"`` is output 0). ``"loss"``: the training
        loss at ``(x, y)`` (``y`` required). An int array: ``f_c`` with one
        output index ``c`` per query.
    y : array-like or None
        The queries' labels (classes) or values.
    """
    if target is None:
        if y is not None:
            raise ValueError("y holds the queries' labels for a target: pass target= too.")
        return None
    n, n_outputs = queries.shape[0], context.engine.n_outputs
    device = queries.device
    if not isinstance(target, str):
        columns = check_columns(np.asarray(target), n, n_outputs)
        return QueryTargets(OutputTarget(), torch.as_tensor(columns, device=device))
    if target == PREDICTED:
        context.require_classes("target='predicted'")
        return QueryTargets(OutputTarget(), _predicted(context, queries))
    if target not in TARGETS:
        raise ValueError(
            f"target must be one of {target_names()} or output indices, got {target!r}."
        )
    loss = None
    if not TARGETS[target].column_label:
        if context.training_run is None:
            raise ValueError(
                f"target={target!r} needs the training loss, which this model does not hold "
                "(a recording of a user's own loop does not know its loss)."
            )
        loss = context.training_run().loss
    chosen = resolve_target(target, context.is_classifier, loss)
    if chosen.column_label:
        if not context.is_classifier:
            labels = torch.zeros(n, dtype=torch.long, device=device)
        elif y is None:
            labels = _predicted(context, queries)
        else:
            labels = torch.as_tensor(class_codes(context, y, n), device=device)
        return QueryTargets(chosen, labels)
    return QueryTargets(chosen, loss_labels(context, y, n, queries))


def _predicted(context, queries):
    """Each query's predicted class (the largest output at the final weights)."""
    return context.engine.output(queries).argmax(1)


def training_targets(context, target):
    """The :class:`QueryTargets` of the training rows for their self-influence, or
    None (``target`` None: every output).

    Each row's target is read with its own training label or value as ``y``
    (``"output"`` and ``"margin"`` of a classifier: its own label's class;
    ``"loss"``: the training loss at ``(x_i, y_i)``); ``"predicted"``: its
    predicted class at the final weights; an int array of shape (M,): that
    output per row. See :func:`decomposition_targets`.
    """
    if target is None:
        return None
    # (the labels are ignored where the target takes none: "predicted", a regressor's
    # output, an int array)
    return decomposition_targets(context, context.engine.X_train, target, context.targets)
