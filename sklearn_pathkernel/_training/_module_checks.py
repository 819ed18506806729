"""Checks of a network at fit, before training: exact, or refused with the reason.

The exact path kernel writes each sample's output as a sum over training points
of inner products of *per-sample* gradients of one deterministic function. A
module can break that silently in three ways, each of which :func:`check_module`
turns into a clear error (or, for dropout, a warning):

- it couples the rows of a batch (a batch mean in ``forward``, BatchNorm without
  running statistics, BatchNorm types other than ``nn.BatchNorm1d`` / ``2d`` in
  training mode): one row's output depends on the others, so it has no per-sample
  gradient. ``nn.BatchNorm1d`` and ``nn.BatchNorm2d`` in training mode are kept:
  each row's gradient is taken through its batch's statistics, and the running
  statistics' moves are split over the rows (``_path/_batchnorm.py``);
- it is random (noise, dropout other than ``nn.Dropout`` and ``nn.Dropout2d``,
  whose masks are recorded): two evaluations disagree;
- its output is not float64 logits (or, for a regressor, predictions) of shape
  (n_samples, n_outputs), or is not
  finite at the initial weights.

The checks are cheap: a few forward passes on a handful of rows. Only when one
fails are the passes repeated with forward hooks, to name the first layer whose
output differs while its inputs agree.
"""

import math
import warnings

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from .._path import BATCH_NORMS, MASKED_DROPOUT, dropout_layers, nested_tensors
from ._module_copy import float64_tensor, module_copy
from ._optimizers import RecordingRefused

# Rows evaluated by the checks (distinct rows among the first _CANDIDATE_ROWS of X).
N_CHECK_ROWS = 4
_CANDIDATE_ROWS = 64
# Largest difference, relative to the largest entry, between two evaluations that
# should agree (a batch and its rows one at a time, or the same rows twice): far
# above the rounding of float64 matrix products, far below any real coupling.
RTOL = 1e-12

_PER_SAMPLE_HINT = (
    "The exact path kernel needs a network that maps each sample on its own "
    "(per-sample gradients); compute every quantity per row (e.g. LayerNorm or "
    "GroupNorm instead of batch statistics)."
)


def check_module(module, X, n_outputs, *, classifier=True):
    """Refuse, with the reason, a module whose path kernel would not be exact.

    Runs at fit on the estimator's own (built or copied) module, before
    training. Leaves the module in eval mode, the mode it is trained and
    evaluated in, except its ``nn.Dropout`` and ``nn.Dropout2d`` layers that
    were in training mode: they are trained with dropout, their masks recorded
    (the path kernel evaluates the training side with them, the query side in
    eval mode), and its ``nn.BatchNorm1d`` and ``nn.BatchNorm2d`` layers that
    were in training mode: they are trained with batch statistics, their running
    statistics followed. Its parameters and buffers are not changed.

    Parameters
    ----------
    module : torch.nn.Module
        The network, on the device of ``X``, in ``X``'s dtype: one of another
        dtype than float64 (trained in float32) is checked on its float64 copy
        (see :func:`_check_in_float64`), the modes set on ``module`` itself.
    X : torch.Tensor of shape (n_samples, n_features)
        The training data (a few distinct rows are evaluated).
    n_outputs : int or None
        The width the output must have (the number of classes, or of the
        regression targets); None (a recorded loop): the width of the module's
        own output, which must be one tensor of shape (n_samples, n_outputs).
    classifier : bool, default=True
        Whether the output is logits of classes (True) or a regressor's
        predictions (False); only the wording of the messages depends on it.

    Raises
    ------
    ValueError
        If a BatchNorm layer has no running statistics or is of another type than
        BatchNorm1d/2d in training mode, if the output of a
        row depends on the other rows of the batch or is random, or if the output
        is not a floating point float64 tensor of shape (n_samples, n_outputs)
        with finite values at the initial weights. The message names the layer
        (qualified name and type) where one can be found, and what to do instead.

    Warns
    -----
    UserWarning
        If the module has other dropout layers (``AlphaDropout``,
        ``FeatureAlphaDropout``, ``Dropout1d``, ``Dropout3d``) or RReLU layers in
        training mode: they are disabled, since their masks are not recorded.
    """
    if X.dtype != torch.float64:
        _check_in_float64(module, X, n_outputs, classifier)
        return
    batch_norms = _check_batch_norm(module)
    _warn_random_layers(module)
    dropout = [layer for _, layer in dropout_layers(module) if layer.training]
    module.eval()
    rows = _distinct_rows(X)
    # A forward pass that updates buffers (a custom running statistic) must not
    # move the initial state: they are put back after the checks.
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(X.device)):
        first = _forward_one_row(module, rows[:1])
        if n_outputs is None:
            n_outputs = _own_width(first)
        _check_output(first, n_outputs, X.dtype, classifier)
        batch = module(rows)
        _check_batch_output(batch, rows.shape[0], n_outputs, classifier)
        _check_finite(batch)
        difference = _difference(batch, module(rows))
        if difference > RTOL:
            _refuse_random(module, rows, difference)
        if rows.shape[0] > 1:
            single = torch.cat([first, *(module(rows[i : i + 1]) for i in range(1, len(rows)))])
            difference = _difference(batch, single)
            if difference > RTOL:
                _refuse_coupled(module, rows, difference)
        for name, buffer in module.named_buffers():
            saved = buffers.get(name)
            if saved is not None and saved.shape == buffer.shape:
                buffer.copy_(saved)
    for layer in dropout:  # trained with dropout: the masks are recorded
        layer.train()
    for layer in batch_norms:  # trained with batch statistics, followed by the recorder
        layer.train()


def _check_in_float64(module, X, n_outputs, classifier):
    """:func:`check_module` of a network trained in float32, on its float64 copy:
    a float32 batch and its rows one at a time round differently (the products'
    blocking: 1.2e-7 relative on a 784-128 Linear layer), which the checks'
    ``RTOL`` would take for coupled rows, while the kernel is that of the float64
    replay anyway. The modes the checks set (eval, and training for the dropout
    and BatchNorm layers that train) are set on ``module`` as on its copy."""
    copy64 = module_copy(module, float64_tensor, float64_tensor)
    check_module(copy64, X.to(torch.float64), n_outputs, classifier=classifier)
    for own, checked in zip(module.modules(), copy64.modules(), strict=True):
        own.training = checked.training


def _forward_one_row(module, row):
    """The module's output on one row of ``X``; a torch error there that comes from
    the wrong input width (the first Linear or convolution expects another) becomes
    a ValueError naming ``X``'s row shape and the layer's expected input; other
    errors propagate as they are."""
    try:
        return module(row)
    except RuntimeError as error:
        mismatch = _first_layer_input(module, row)
        if not mismatch:
            raise
        raise ValueError(
            f"The module fails on one row of X, shape {tuple(row.shape)} "
            f"({row.shape[1] if row.ndim == 2 else tuple(row.shape[1:])} features per "
            f"row): {mismatch}Torch's error: {error}"
        ) from error


def _first_layer_input(module, row):
    """What the first Linear or convolution expects, when it does not fit ``row``."""
    for name, layer in module.named_modules():
        if isinstance(layer, nn.Linear):
            expected, given, what = layer.in_features, row.shape[-1], "features"
        elif isinstance(layer, nn.modules.conv._ConvNd):
            if row.ndim < 2:
                return ""
            expected, given, what = layer.in_channels, row.shape[1], "channels"
        else:
            continue
        if expected == given:
            return ""
        return (
            f"its first layer {name!r} ({type(layer).__name__}) expects {expected} input "
            f"{what}, but X's rows have {given}. Build the module for the data's width "
            "(the estimators also take a callable module(n_features, n_outputs)). "
        )
    return ""


# -- layers recognised by their type -------------------------------------------------


def _describe(name, layer):
    """Where a problem is: a submodule by its qualified name, or the module's own code."""
    if not name:
        return f"the module's own forward ({type(layer).__name__})"
    return f"layer {name!r} ({type(layer).__name__})"


def _subject(name, layer):
    """A layer found by its type, as the subject of a sentence."""
    if not name:
        return f"The module ({type(layer).__name__})"
    return f"The module's layer {name!r} ({type(layer).__name__})"


def _check_batch_norm(module):
    """Refuse the BatchNorm layers the kernel cannot follow; return those trained in
    training mode (BatchNorm1d/2d with running statistics: per-row gradients
    through the batch statistics, the running statistics' moves split over the
    rows, see ``_path/_batchnorm.py``)."""
    trained = []
    for name, layer in module.named_modules():
        if not isinstance(layer, _BatchNorm):  # SyncBatchNorm and the lazy ones included
            continue
        if layer.running_mean is None or layer.running_var is None:
            raise ValueError(
                f"{_subject(name, layer)} has no running statistics "
                "(track_running_stats=False), so it normalises each batch by its own "
                "statistics even in eval mode: the evaluated network's output on one row "
                "depends on the other rows, and no per-row kernel reproduces it. Build "
                "it with track_running_stats=True, or use LayerNorm or GroupNorm."
            )
        if not layer.training:
            continue
        if type(layer) not in BATCH_NORMS:
            raise ValueError(
                f"{_subject(name, layer)} is in training mode: only nn.BatchNorm1d and "
                "nn.BatchNorm2d are followed in training mode (per-row gradients through "
                "the batch statistics, running statistics split over the rows). Put it in "
                "eval mode (fixed running statistics), or use one of those."
            )
        trained.append(layer)
    return trained


def _warn_random_layers(module):
    random_layers = [
        f"{name!r} ({type(layer).__name__}"
        + (f", p={layer.p:g})" if isinstance(layer, _DropoutNd) else ")")
        for name, layer in module.named_modules()
        if layer.training
        and type(layer) not in MASKED_DROPOUT
        and ((isinstance(layer, _DropoutNd) and layer.p > 0) or isinstance(layer, nn.RReLU))
    ]
    if random_layers:
        warnings.warn(
            f"Dropout is disabled: the module's layers {', '.join(random_layers)} are "
            "random in training mode, but the network is trained and evaluated in eval "
            "mode (dropout is the identity there, RReLU uses its mean slope), because "
            "the exact path kernel needs a deterministic network. Put the module in eval "
            "mode (module.eval()) before fit to silence this warning.",
            UserWarning,
            stacklevel=2,
        )


# -- the output ----------------------------------------------------------------------


def _what(classifier):
    return "logits" if classifier else "predictions"


def _check_output(out, n_outputs, dtype, classifier):
    """The output of one row: a float64 tensor of shape (1, n_outputs)."""
    what = _what(classifier)
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"The module must return a tensor of {what} of shape (n_samples, "
            f"{n_outputs}), but it returned a {type(out).__name__}; if it computes "
            f"several values, wrap it in a module whose forward returns the {what} only."
        )
    if out.ndim != 2 or out.shape[1] != n_outputs:
        raise ValueError(
            f"The module maps X to outputs of shape {tuple(out.shape)} for one "
            f"sample, but the target has {_count(n_outputs, classifier)}: it must "
            f"output {what} of shape (n_samples, {n_outputs})."
        )
    if not out.is_floating_point():
        raise ValueError(
            f"The module's output has dtype {out.dtype}: it must return floating point {what}."
        )
    if out.dtype != dtype:
        raise ValueError(
            f"The path kernel is computed in {_dtype_name(dtype)} (the estimator "
            f"converts the module and X to it), but the module's output is "
            f"{_dtype_name(out.dtype)}: its forward casts to {_dtype_name(out.dtype)} "
            "(e.g. .float(), .to(torch.float32), or a tensor created with the default "
            "dtype). Keep the computation in the input's dtype (x.dtype)."
        )


def _own_width(out):
    """The width of a module's output on one row, which must be one tensor of shape
    (1, n_outputs) (a recorded loop's module: no target gives the width)."""
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        described = (
            f"a tensor of shape {tuple(out.shape)}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise RecordingRefused(
            "The module's output must be one tensor of shape (n_samples, n_outputs); got "
            f"{described}."
        )
    return out.shape[1]


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _count(n_outputs, classifier):
    if classifier:
        return f"{n_outputs} classes"
    return f"{n_outputs} output" + ("s" if n_outputs != 1 else "")


def _check_batch_output(out, n_rows, n_outputs, classifier):
    if out.shape != (n_rows, n_outputs):
        raise ValueError(
            f"The module maps {n_rows} samples to outputs of shape {tuple(out.shape)}: "
            f"it must output one row of {_what(classifier)} per sample, of shape (n_samples, "
            f"{n_outputs})."
        )


def _check_finite(out):
    if bool(torch.isfinite(out).all()):
        return
    problems = []
    for kind, mask in (("NaN", torch.isnan(out)), ("inf", torch.isinf(out))):
        n_bad = int(mask.any(dim=1).sum())
        if n_bad:
            problems.append(f"{kind} in {n_bad}")
    if problems:
        raise ValueError(
            f"The module's output at its initial weights contains "
            f"{' and '.join(problems)} of the {out.shape[0]} rows checked: the loss and "
            "its gradient would not be finite. Check the module's forward and initial "
            "weights (e.g. a log or a division of zero, or uninitialised parameters "
            "such as torch.empty)."
        )


# -- coupled rows and randomness, and the layer responsible -------------------------


def _refuse_random(module, rows, difference):
    runs = [_record(module, lambda: module(rows)) for _ in range(2)]
    culprit = _first_culprit(runs[0], runs[1:], _same_shape_difference)
    where = f", first at {_describe(*culprit)}" if culprit else ""
    raise ValueError(
        f"The module's output is random: two evaluations of the same rows in eval "
        f"mode differ (by up to {difference:.1e} relative){where}. The exact path "
        "kernel needs a deterministic network; remove the randomness (noise, or "
        "F.dropout(..., training=True)) or make it depend on self.training, which "
        "is False during training and evaluation, and keep forward from changing "
        "the module's own state."
    )


def _refuse_coupled(module, rows, difference):
    batch = _record(module, lambda: module(rows))
    singles = [_record(module, lambda i=i: module(rows[i : i + 1])) for i in range(len(rows))]
    culprit = _first_culprit(batch, singles, _rows_difference)
    where = f", first at {_describe(*culprit)}" if culprit else ""
    raise ValueError(
        f"The module couples the rows of a batch: one row's output depends on the "
        f"other rows (evaluated on {len(rows)} rows together and one row at a time, "
        f"the outputs differ by up to {difference:.1e} relative{where}). " + _PER_SAMPLE_HINT
    )


class _Call:
    __slots__ = ("name", "layer", "inputs", "outputs")

    def __init__(self, name, layer, inputs, outputs):
        self.name, self.layer, self.inputs, self.outputs = name, layer, inputs, outputs


def _record(module, run):
    """Every submodule call of ``run()``, in the order the calls return."""
    calls = []

    def hook(name):
        def record(layer, args, kwargs, output):
            calls.append(_Call(name, layer, _tensors((args, kwargs)), _tensors(output)))

        return record

    handles = [
        layer.register_forward_hook(hook(name), with_kwargs=True)
        for name, layer in module.named_modules()
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _tensors(value):
    """The tensors in a nest of tuples, lists and dicts, as copies (a later
    in-place operation must not change what was recorded)."""
    return [tensor.detach().clone() for tensor in nested_tensors(value)]


def _first_culprit(reference, others, difference):
    """``(name, layer)`` of the first call whose inputs agree between the runs but
    whose outputs do not, or None (no such call, or the runs called different
    layers)."""
    for index, call in enumerate(reference):
        if any(len(run) <= index or run[index].layer is not call.layer for run in others):
            return None
        inputs = _leaves_difference(call.inputs, [run[index].inputs for run in others], difference)
        if inputs is not None and inputs > RTOL:
            continue  # already different on entry: the cause is earlier
        outputs = _leaves_difference(
            call.outputs, [run[index].outputs for run in others], difference
        )
        if outputs is not None and outputs > RTOL:
            return call.name, call.layer
    return None


def _leaves_difference(reference, others, difference):
    if any(len(leaves) != len(reference) for leaves in others):
        return math.inf
    values = [
        difference(tensor, [leaves[j] for leaves in others]) for j, tensor in enumerate(reference)
    ]
    values = [value for value in values if value is not None]
    return max(values) if values else None


def _same_shape_difference(tensor, others):
    return max(_difference(tensor, other) for other in others)


def _rows_difference(batch, singles):
    """How far the rows of ``batch`` are from ``singles`` (the rows evaluated one at a
    time); None when ``batch`` has no dimension of rows to compare."""
    if all(single.shape == batch.shape for single in singles):  # no dimension of rows
        return _same_shape_difference(batch, singles)
    n_rows = len(singles)
    dims = [
        dim
        for dim in range(batch.ndim)
        if batch.shape[dim] == n_rows
        and all(
            single.shape == batch.shape[:dim] + (1,) + batch.shape[dim + 1 :] for single in singles
        )
    ]
    if not dims:
        return None
    return min(
        max(_difference(batch.narrow(dim, i, 1), single) for i, single in enumerate(singles))
        for dim in dims
    )


def _difference(a, b):
    """Largest ``|a - b|`` relative to the largest finite entry of either; 0 when
    equal (equal non-finite entries included), inf when the shapes differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if torch.equal(a, b):
        return 0.0
    if not a.is_floating_point():
        return math.inf
    a, b = a.double(), b.double()
    diff = (a - b).abs()
    if bool(torch.isfinite(diff).all()):  # the usual case: finite, rounding apart
        return float(diff.max()) / float(torch.maximum(a.abs().max(), b.abs().max()))
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(same.all()):  # NaN in the same places, nothing else apart
        return 0.0
    diff = float(diff[~same].max())
    finite = torch.cat([a[torch.isfinite(a)], b[torch.isfinite(b)]])
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    if not math.isfinite(diff) or scale == 0.0:
        return math.inf
    return diff / scale


def _distinct_rows(X):
    """Up to ``N_CHECK_ROWS`` distinct rows of ``X``, the first ones (duplicates
    would hide a coupling such as ``x - x.mean(0)``)."""
    candidates = X[:_CANDIDATE_ROWS]
    values = candidates.detach().cpu().numpy()
    chosen = []
    for i, row in enumerate(values):
        if not any(np.array_equal(row, values[j]) for j in chosen):
            chosen.append(i)
            if len(chosen) == N_CHECK_ROWS:
                break
    return candidates[torch.as_tensor(chosen, device=X.device)]


def _rng_devices(device):
    """The CUDA devices whose generators a random module could draw from (the checks
    run in ``fork_rng``: the user's global generators stay as they were)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
