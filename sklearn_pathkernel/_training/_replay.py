"""A recorded run replayed in float64, from its first weights.

A float32 optimiser rounds its own updates: its moves are the recorded linear
form (:class:`~sklearn_pathkernel._path.UpdateRecord`) only up to float32 rounding, so the path
kernel of its recorded weights misses the network's output by about ``1e-6``.
:func:`replay_in_float64` rebuilds the path in float64 from the recorded
:math:`w_0`, with the run's recorded rows, output gradients :math:`e_{s,i}`,
rates and preconditioners :math:`P_s` (Adam's, from the run's own second
moments), each step's gradient

.. math::

    G_s = -\\sum_{i \\in B_s} J_i(w_s)^\\top e_{s,i}

recomputed in float64 at the replayed weights :math:`w_s`
(:class:`~sklearn_pathkernel._path.ForwardAccumulation` turns it into the move). The replayed
path satisfies the linear form to float64 rounding, so its kernel decomposition
is exact (to ``1e-9`` or better) against the float64 network at the replayed
final weights; how far the float32 model is from that network is the
recording's ``model_gap``.
"""

import contextlib
import copy
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch.func import functional_call

from .._path import allocate_weights, load_statistics, masks_applied, release_pages, row_shares

DTYPE = torch.float64
#: Rows of a float32 path converted to float64 at once by :func:`replay_bound` (a
#: block of ``8 ROW_BLOCK W`` bytes: the path is never converted whole).
ROW_BLOCK = 64


@dataclass(frozen=True)
class Float64Run:
    """The float64 network and path whose kernel stands for a run's.

    Attributes
    ----------
    module : torch.nn.Module
        A float64 copy of the network in eval mode, at the final weights of ``path``.
    path : WeightPath
        The recorded path itself (a float64 run) or its float64 replay
        (:func:`replay_in_float64`, checked by :func:`check_replay`).
    """

    module: torch.nn.Module
    path: object
    #: A float32 run anchored at its recorded weights: the largest share of its
    #: per-step rounding bound a rounding move took (:func:`anchored_in_float64`);
    #: None otherwise.
    rounding_share: float = None


def float64_run(module, path, X, link, check_float64=False):
    """The float64 run whose exact kernel the hosts compute, for a run recorded in
    any floating dtype.

    Parameters
    ----------
    module : torch.nn.Module
        The trained network (any floating dtype; not changed).
    path : WeightPath
        Its recorded path, in the training dtype.
    X : torch.Tensor of shape (n_samples, ...)
        The training inputs the path's batches index (any floating dtype).
    link : callable
        ``f = link(module(x))``, the function whose output gradients were recorded.
    check_float64 : bool, default=False
        Check a float64 path's moves against its recorded output gradients
        (:func:`check_moves`): for a user's loop, whose loss the recorder does not
        know; an estimator's loop builds each step from its output gradients.

    Returns
    -------
    Float64Run
        For a float64 path, a float64 copy of ``module`` and ``path`` itself; for
        a float32 one, the float64 replay (refused with ``RecordingRefused`` when
        it ends beyond the run's rounding bound from the recorded final weights)
        and the float64 network at its final weights.
    """
    module64 = copy.deepcopy(module).to(DTYPE).eval()
    if path.weights.dtype == DTYPE:
        if check_float64:
            check_moves(path, module, X, link)
        return Float64Run(module64, path)
    if path.running_statistics is None:
        # the run's own weights, each step's rounding an explicit term
        anchored, share = anchored_in_float64(path, module64, X.to(DTYPE), link)
        return Float64Run(module64, anchored, share)
    replayed = replay_in_float64(path, module64, X.to(DTYPE), link)
    check_replay(path, replayed)
    final = replayed.unflatten(replayed.weights[-1])
    with torch.no_grad():
        for name, param in module64.named_parameters():
            if name in final:
                param.copy_(final[name])
    if replayed.running_statistics is not None:  # BatchNorm's, replayed too
        load_statistics(module64, replayed.running_statistics)
    return Float64Run(module64, replayed)


def anchored_in_float64(path, module, X, link):
    r"""A float32 run's own path in float64, every step anchored at its recorded
    weights, with each step's rounding as an explicit term.

    At every step the gradient is recomputed in float64 at the **recorded**
    weights, :math:`G_s = -\sum_{i \in B_s} J_i(w_s)^\top e_{s,i}`, from the
    recorded rows, output gradients and dropout masks, and turned into the move
    :math:`m_s` the recorded update makes of it (the recorded rates and Adam
    preconditioners :math:`P_s`; a momentum buffer or Adam's first moment
    accumulated from these float64 gradients). The recorded move differs from it by
    the step's rounding,

    .. math::

        r_s = w_{s+1} - w_s - m_s,

    which is kept (:attr:`WeightPath.rounding_moves`): the decomposition's decay
    term takes :math:`\langle \phi_s(x), r_s \rangle` beside weight decay, so that

    .. math::

        f(x; w_S) = f(x; w_0) + \sum_i c_i(x) + \mathrm{decay}(x)

    holds to float64 rounding for the float32 weights themselves, evaluated in
    float64. Each step starts from the recorded weights, so rounding does not grow
    along the run (unlike a replay from :math:`w_0`, whose own weights drift from the
    run's where the dynamics amplify rounding: Adam's large preconditioners, long
    runs). The rows' contributions are exactly those of the linear form at the
    recorded weights; only the rounding is not attributed to rows.

    A step whose rounding is beyond what the float32 step can round, at some weight
    :math:`j` of a parameter,

    .. math::

        |r_{s,j}| > c\,u\,\left(|w_{s+1,j}| + |w_{s+1,j} - w_{s,j}| + \rho_{s,j}\,
        \max_{r \le s,\,k} |G_{r,k}|\right),

    with :math:`\rho_{s,j}` the move the update makes of a unit gradient at every
    step (:math:`P_{s,j}` times the step's coefficients summed over the steps its
    buffer holds: how far a gradient's rounding moves the weight; about the learning
    rate for Adam, whatever the gradient's size), the network's largest gradient so
    far (a gradient's rounding is relative to the terms it sums, which a gradient that
    cancels to zero, e.g. an output bias on a class-balanced batch, does not show),
    ``c = ROUNDING_STEPS`` and ``u`` float32's unit roundoff, was
    not the optimiser's step of the recorded gradients (a penalty on the weights,
    weights edited between steps, a setting the recorder does not represent): it is
    refused, naming the step, the parameter and the weight.

    Parameters
    ----------
    path : WeightPath
        The recorded path, in its training dtype, without BatchNorm statistics
        trained in training mode.
    module : torch.nn.Module
        The network; a float64 copy of it is used (not changed).
    X : torch.Tensor of shape (n_samples, ...)
        The training inputs the path's batches index.
    link : callable
        ``f = link(module(x))``, the function whose output gradients were recorded.

    Returns
    -------
    path : WeightPath
        In float64: the recorded weights (exactly: float32 numbers are float64
        numbers), batches, output gradients, rates, update record, and the rounding
        moves.
    share : float
        The largest :math:`|r_{s,j}|` of the run as a share of its bound (at most 1).

    Notes
    -----
    Cost: one forward and backward pass of each step's batch in float64 (the
    training run's work, at float64 speed); memory: the float64 weights and the
    rounding moves, ``8 (2 S + 1) W`` bytes (RAM, or memory-mapped files beside the
    recording's, like its path).
    """
    from ._optimizers import RecordingRefused

    recorded = replace(path, weights=path.weights[:1]).astype(DTYPE)
    # the move a unit gradient at every step would make: how far a gradient's rounding
    # moves each weight (Adam: about the learning rate, whatever the gradient's size)
    unit_response = recorded.update.forward()
    weights, storage = allocate_weights(*path.weights.shape, path.storage, DTYPE)
    rounding, _ = allocate_weights(path.n_steps, path.n_weights, path.storage, DTYPE)
    weights[0] = recorded.weights[0]
    allowance = ROUNDING_STEPS * torch.finfo(path.weights.dtype).eps / 2
    largest_gradient, share = 0.0, 0.0
    for move in _recorded_moves(path, module, X, link):
        step, r = move.step, move.rounding
        unit = unit_response.move(step, torch.zeros_like(r), torch.ones_like(r)).abs()
        # (a gradient's rounding is relative to the terms it sums, which a gradient
        # that cancels to zero does not show: the network's largest gradient so far)
        largest_gradient = max(largest_gradient, float(move.gradient.abs().max()))
        bound = allowance * (move.end.abs() + move.moved.abs() + unit * largest_gradient)
        size = r.abs()
        share = max(share, float((size / bound.clamp_min(torch.finfo(DTYPE).tiny)).max()))
        outside = ~(size <= bound)  # (a NaN is outside too)
        if bool(outside.any()):
            j = int(outside.to(torch.uint8).argmax())
            name, part = next((n, p) for n, p in _parameter_parts(path) if p.start <= j < p.stop)
            raise RecordingRefused(
                f"Step {step}: the recorded move of {name!r} is not the update of the "
                f"step's recorded output gradients to the {path.weights.dtype} run's "
                f"rounding (at its element {j - part.start} it is {float(size[j]):.3g} away, "
                f"beyond the step's rounding {float(bound[j]):.3g}): the step's gradient "
                "was not the backward pass of the module's output on its rows (a penalty "
                "on the weights or an auxiliary loss at this step), the weights were "
                "changed between steps, or the optimiser did something the recorder does "
                "not represent; so the kernel would be of another run."
            )
        weights[step + 1] = move.end.cpu()
        rounding[step] = r.cpu()
        release_pages(weights[step + 1])  # (a path on disk: the row stays in the file)
        release_pages(rounding[step])
    return replace(recorded, weights=weights, storage=storage, rounding_moves=rounding), share


def replay_in_float64(path, module, X, link):
    """The float64 replay of a recorded path.

    Parameters
    ----------
    path : WeightPath
        The recorded path (any floating dtype).
    module : torch.nn.Module
        The network; its frozen parameters and buffers are the constants (a float64
        copy is used, the module is not changed).
    X : torch.Tensor of shape (n_samples, ...)
        The training inputs the path's batches index.
    link : callable
        ``f = link(module(x))``, the function whose output gradients were recorded.

    Returns
    -------
    WeightPath
        In float64: ``weights`` replayed (row 0 is the recorded :math:`w_0`), the
        recorded batches, output gradients, learning rates and update record
        (preconditioners in float64).

    Notes
    -----
    Cost: one forward and backward pass of each step's batch in float64 (the
    training run's work, at float64 speed); memory: the float64 weights,
    ``8 (S + 1) W`` bytes, where the recording keeps its own (RAM, or a
    memory-mapped file in its directory).
    """
    # w_0 only: the recorded weights are not converted (they may be on disk)
    recorded = replace(path, weights=path.weights[:1]).astype(DTYPE)
    gradient_at = _StepGradient(path, module, X, link)
    weights, storage = allocate_weights(*path.weights.shape, path.storage, DTYPE)
    weights[0] = recorded.weights[0]
    w = recorded.weights[0].to(X.device)
    accumulation = recorded.update.forward()
    for step in range(path.n_steps):
        w = w + accumulation.move(step, w, gradient_at(step, w))
        weights[step + 1] = w.cpu()
        release_pages(weights[step + 1])  # (a path on disk: the row stays in the file)
    replayed = replace(recorded, weights=weights, storage=storage)
    replayed.running_statistics = gradient_at.statistics.replayed()
    return replayed


def check_moves(path, module, X, link):
    r"""Refuse a float64 recorded path whose moves are not the linear form of its
    recorded output gradients.

    At every step the gradient is recomputed at the **recorded** weights
    :math:`w_s`, :math:`G_s = -\sum_{i \in B_s} J_i(w_s)^\top e_{s,i}`, from the
    recorded rows and output gradients, and turned into a move by the recorded
    update (:class:`~sklearn_pathkernel._path.ForwardAccumulation`); the move must
    land on the recorded :math:`w_{s+1}` within the step's rounding, per
    parameter,

    .. math::

        \max_j |w_{s,j} + m_{s,j} - w_{s+1,j}| \le c\,u\,\left(\max_j |w_{s+1,j}|
        + \max_j |w_{s+1,j} - w_{s,j}|\right),

    with ``c = ROUNDING_STEPS`` and ``u`` float64's unit roundoff. Unlike a replay
    from :math:`w_0`, each step starts from the recorded weights, so rounding does
    not grow along the run (a momentum buffer carries the rounding of earlier
    gradients, decayed: well inside ``c``). Honest runs of 300 steps need ``c`` of
    1.5 to 2.5 (Adam with dead ReLU units, ``eps=1e-12``, gradient accumulation,
    SGD with momentum 0.99: ``benchmarks/bench_move_check.py --section margin``), a
    margin of 400.
    A loss that is not a function of the module's output alone at some step (a
    penalty on the weights switched on mid-run, an auxiliary loss, gradients edited
    with ``check="none"``) moves the weights by more than the recorded output
    gradients explain, and is refused here, naming the first such step, rather than
    giving a kernel whose ``gram`` and explanations (which carry no residual) are of
    another run.

    Parameters
    ----------
    path : WeightPath
        The recorded path, in float64.
    module, X, link
        As :func:`replay_in_float64` takes them.

    Notes
    -----
    Cost: one forward and backward pass of each step's batch in float64 (the
    training run's work); memory: two rows of the path at a time.
    """
    from ._optimizers import RecordingRefused

    u = torch.finfo(DTYPE).eps / 2
    for move in _recorded_moves(path, module, X, link):
        for name, part in _parameter_parts(path):
            end = move.end[part]
            difference = float(move.rounding[part].abs().max())
            bound = ROUNDING_STEPS * u * float(end.abs().max() + move.moved[part].abs().max())
            if not difference <= bound:
                raise RecordingRefused(
                    f"Step {move.step}: the recorded move of {name!r} is not the linear form "
                    f"of the step's recorded output gradients (it lands {difference:.3g} from "
                    f"the recorded weights, beyond the step's rounding {bound:.3g}): the "
                    "step's gradient was not the backward pass of the module's output on "
                    "its rows (a penalty on the weights or an auxiliary loss at this step, "
                    "gradients edited with check='none'), or the optimiser held state (a "
                    "momentum buffer, Adam's first moment) from before the recorder; so the "
                    "kernel would be of another run. Put weight penalties in the optimiser "
                    "(its weight_decay), and create the recorder before the first step."
                )


class _RecordedMove(NamedTuple):
    """One recorded step against the update of its recomputed gradient, in float64 on
    the inputs' device: ``start`` :math:`w_s`, ``end`` :math:`w_{s+1}`, ``moved``
    their difference, ``gradient`` :math:`G_s` at the recorded :math:`w_s`, and
    ``rounding`` :math:`r_s = w_{s+1} - w_s - m_s`, with :math:`m_s` the recorded
    update's move of :math:`G_s`."""

    step: int
    start: torch.Tensor
    end: torch.Tensor
    moved: torch.Tensor
    gradient: torch.Tensor
    rounding: torch.Tensor


def _recorded_moves(path, module, X, link):
    """Every recorded step, first to last, as a :class:`_RecordedMove`: its gradient
    recomputed at the **recorded** weights (:class:`_StepGradient`) and turned into a
    move by the recorded update (:class:`~sklearn_pathkernel._path.ForwardAccumulation`:
    a momentum buffer or Adam's first moment accumulated from these gradients). Each
    step starts from the recorded weights, so rounding does not grow along the run.
    Memory: two rows of the path at a time."""
    gradient_at = _StepGradient(path, module, X, link)
    accumulation = replace(path, weights=path.weights[:1]).astype(DTYPE).update.forward()
    end = path.weights[0].to(device=X.device, dtype=DTYPE)
    for step in range(path.n_steps):
        start, end = end, path.weights[step + 1].to(device=X.device, dtype=DTYPE)
        moved = end - start  # (exact for float32 weights: differences of float32 numbers)
        gradient = gradient_at(step, start)
        rounding = moved - accumulation.move(step, start, gradient)
        yield _RecordedMove(step, start, end, moved, gradient, rounding)


def _parameter_parts(path):
    """``(name, slice)`` of each parameter with weights, in the flat order."""
    offset = 0
    for name, shape in zip(path.param_names, path.param_shapes, strict=True):
        numel = int(torch.Size(shape).numel())
        if numel:
            yield name, slice(offset, offset + numel)
        offset += numel


class _StepGradient:
    """A recorded step's gradient at given weights: the step's rows, dropout masks
    and BatchNorm pass, the float64 network with its constants, the recorded
    output gradients (one forward and one backward pass per call; steps in order).

    Parameters
    ----------
    path : WeightPath
    module : torch.nn.Module
        Copied in float64 (not changed).
    X : torch.Tensor
    link : callable
    """

    def __init__(self, path, module, X, link):
        self.path, self.link = path, link
        device = X.device
        self.module = module = _float64_copy(module, device)
        names = set(path.param_names)
        self.constants = {
            name: value
            for name, value in module.named_parameters(remove_duplicate=False)
            if name not in names
        }
        self.tied = len(list(module.named_parameters(remove_duplicate=False))) > len(
            list(module.named_parameters())
        )
        self.X = X.to(DTYPE)
        self.statistics = _StatisticsReplay(path.running_statistics, module, device)

    def __call__(self, step, w):
        """:math:`G_s` at weights ``w`` (flat, float64, on the inputs' device)."""
        path, X = self.path, self.X
        params = {k: v.requires_grad_(True) for k, v in path.unflatten(w.clone()).items()}
        rows = torch.as_tensor(path.batches[step], device=X.device)
        with masks_applied(self.module, path.masks(step)), self.statistics.step(step) as buffers:
            # (the step's dropout masks; BatchNorm's pass in training mode)
            values = {**self.constants, **buffers, **params}
            out = functional_call(self.module, values, (X[rows],), tie_weights=self.tied)
        out = self.link(out)
        e = path.output_gradients[step].to(device=X.device, dtype=DTYPE)
        grads = torch.autograd.grad(out, list(params.values()), grad_outputs=-e, allow_unused=True)
        return torch.cat(
            [
                (torch.zeros_like(p) if g is None else g).reshape(-1)
                for g, p in zip(grads, params.values(), strict=True)
            ]
        )


class _StatisticsReplay:
    """BatchNorm's running statistics replayed in float64 along the replay: each
    step's pass in training mode (the recorded layers), its rows' shares of the
    statistics' move from the replayed inputs (the recorded averaging weights),
    and the statistics they add up to."""

    def __init__(self, stats, module, device):
        self.stats, self.module = stats, module
        if stats is None:
            return
        self.layers = dict(module.named_modules())
        self.values = [stats.values[0].to(device=device, dtype=DTYPE)]
        self.shares = []
        self.sizes = [int(torch.Size(shape).numel()) for shape in stats.shapes]

    @contextlib.contextmanager
    def step(self, step):
        """Within: the step's statistics as buffers (a dict for ``functional_call``),
        the training layers in training mode; after: the step's shares and the
        next statistics."""
        if self.stats is None:
            yield {}
            return
        stats, current = self.stats, self.values[-1]
        parts = dict(zip(stats.names, torch.split(current.clone(), self.sizes), strict=True))
        inputs, handles = {}, []
        for name in stats.training_layers:
            layer = self.layers[name]
            layer.train()
            handles.append(layer.register_forward_pre_hook(_keep(inputs, name)))
        try:
            yield parts
        finally:
            for handle in handles:
                handle.remove()
            for name in stats.training_layers:
                self.layers[name].eval()
        shares, offset = [], 0
        n_rows = next(iter(inputs.values())).shape[0] if inputs else 0
        for name, size in zip(stats.names[::2], self.sizes[::2], strict=True):
            layer_name = name.rsplit(".", 1)[0] if "." in name else ""
            if layer_name in inputs:
                mean = current[offset : offset + size]
                var = current[offset + size : offset + 2 * size]
                factor = stats.factors[step][layer_name]
                shares.append(row_shares(inputs[layer_name], mean, var, factor))
            else:
                shares.append(current.new_zeros((n_rows, 2 * size)))
            offset += 2 * size
        shares = torch.cat(shares, dim=1)
        self.shares.append(shares.cpu())
        self.values.append(current + shares.sum(0))

    def replayed(self):
        """The replayed :class:`RunningStatistics` (None without)."""
        if self.stats is None:
            return None
        return replace(
            self.stats,
            values=torch.stack([v.cpu() for v in self.values]),
            shares=self.shares,
        )


def _keep(inputs, name):
    def hook(_, args):
        inputs[name] = args[0].detach()

    return hook


def _float64_copy(module, device):
    """A float64 copy of ``module`` in eval mode on ``device``, without gradients."""
    copy64 = copy.deepcopy(module).to(device=device, dtype=DTYPE).eval()
    for param in copy64.parameters():
        param.requires_grad_(False)
    return copy64


#: The rounding allowance per step, in units of the training dtype's unit roundoff
#: (see :func:`replay_bound`).
ROUNDING_STEPS = 1024


def replay_bound(path):
    """How far, per parameter, the float64 replay of a run may end from the run's own
    final weights by rounding alone.

    Each float32 step rounds the move it adds (``|fl(w + m) - (w + m)| <= u |w_{s+1}|``,
    ``u`` the unit roundoff) and computes the move itself from a rounded gradient and
    rounded optimiser arithmetic: a relative error of a few ``u`` of the move. With
    a step size in the stable range the error of one step is not amplified by the
    later ones (``|I - P_s H_s| <= 1``), so the errors add up:

    .. math::

        \\max_j |\\hat w_{S,j} - w_{S,j}| \\le c\\,u \\sum_{s<S}
        \\left(\\max_j |w_{s+1,j}| + \\max_j |w_{s+1,j} - w_{s,j}|\\right),

    per parameter tensor, with ``c`` a small multiple of the roundings of one step
    (gradient, moments, update). Adam breaks the stability assumption where its
    preconditioner is large (second moments near zero, e.g. a ReLU unit dead in
    one run and not in the other): there a rounding difference grows. Measured on
    honest float32 runs (digits, batches of 50): SGD with momentum reached
    ``0.1 u``, the AdamW CNN of the user guide ``1.4 u``, an Adam MLP 64-64-64-10
    with ReLU ``31 u`` of the sum; so ``c = ROUNDING_STEPS = 1024``, a margin of
    30 over the worst. A representation error (a setting read wrong, weights
    changed outside the steps) moves the replay by a fraction of the moves
    themselves, caught once that fraction exceeds ``c u`` (about 6e-5 in
    float32). A run whose
    replay leaves the bound (the same Adam MLP at 30 epochs ended 0.37 apart) is
    refused: its float64 replay is another network than the float32 model.

    Over thousands of steps the stability assumption fails with any optimiser: the
    run's dynamics amplify rounding geometrically while the bound grows linearly
    with the steps. On an MLP 784-128-64-10 with dropout (SGD, momentum 0.9,
    batches of 64, 1988 steps on 2250 MNIST rows), four float32 fits from other
    seeds ended at 0.28, 0.43, 0.41 and 1.55 of the bound (the last refused); the
    3976-step run on 4500 rows stayed within it. At that length train in float64.

    Parameters
    ----------
    path : WeightPath
        The recorded path, in its training dtype.

    Returns
    -------
    dict of str to float
        Per parameter name, the bound (0 for a float64 path: its kernel is of the
        recorded weights themselves).
    """
    if path.weights.dtype == DTYPE:
        return dict.fromkeys(path.param_names, 0.0)
    u = torch.finfo(path.weights.dtype).eps / 2
    numels = [int(torch.Size(shape).numel()) for shape in path.param_shapes]
    sums = [0.0] * len(numels)
    weights = path.weights
    # blocks of ROW_BLOCK steps (the rows s .. s + ROW_BLOCK, one shared with the next
    # block), each converted to float64 on its own: memory 8 (ROW_BLOCK + 1) W bytes
    for start in range(0, path.n_steps, ROW_BLOCK):
        block = weights[start : min(start + ROW_BLOCK, path.n_steps) + 1]
        rows = block.to(DTYPE, copy=True)
        release_pages(block)
        offset = 0
        for index, numel in enumerate(numels):
            columns = rows[:, offset : offset + numel]
            if numel:
                sizes = columns[1:].abs().amax(dim=1) + columns.diff(dim=0).abs().amax(dim=1)
                sums[index] += float(sizes.sum())
            offset += numel
    return {
        name: ROUNDING_STEPS * u * total for name, total in zip(path.param_names, sums, strict=True)
    }


def replay_differences(recorded, replayed):
    """Per parameter, ``max_j |replayed w_S - recorded w_S|``."""
    differences, offset = {}, 0
    final = replayed.weights[-1]
    own = recorded.weights[-1].to(DTYPE)
    for name, shape in zip(recorded.param_names, recorded.param_shapes, strict=True):
        numel = int(torch.Size(shape).numel())
        part = slice(offset, offset + numel)
        differences[name] = float((final[part] - own[part]).abs().max()) if numel else 0.0
        offset += numel
    return differences


def check_replay(recorded, replayed):
    """Refuse a float64 replay that ends beyond the run's rounding (:func:`replay_bound`)
    from the recorded final weights: the recorded linear form is not what the
    optimiser did."""
    from ._optimizers import RecordingRefused

    if recorded.weights.dtype == DTYPE:
        return
    bounds = replay_bound(recorded)
    differences = replay_differences(recorded, replayed)
    if recorded.running_statistics is not None:  # BatchNorm's running statistics, too
        values = recorded.running_statistics.values.to(DTYPE)
        u = torch.finfo(recorded.weights.dtype).eps / 2
        gap = (replayed.running_statistics.values[-1] - values[-1]).abs().max()
        differences["running statistics"] = float(gap)
        sizes = values[1:].abs().amax(dim=1) + values.diff(dim=0).abs().amax(dim=1)
        bounds["running statistics"] = ROUNDING_STEPS * u * float(sizes.sum())
    for name, difference in differences.items():
        if not difference <= bounds[name]:
            raise RecordingRefused(
                f"The float64 replay of the {recorded.weights.dtype} run ends {difference:.3g} "
                f"from the recorded final weights of {name!r}, beyond the run's rounding bound "
                f"{bounds[name]:.3g}: the replay is another network than the float32 model, "
                f"so no certificate of it would be about the model. Either the run's rounding "
                f"grew along its {recorded.n_steps} steps (a long run's dynamics amplify it, "
                "with any optimiser; Adam's preconditioner does where second moments are near "
                "zero, e.g. ReLU units dead in one run and not in the other, or gradients "
                "that round to zero in float32): train in float64 (the default), or give "
                "Adam an epsilon well above the float32 rounding of the gradients, which "
                "bounds that amplification by 1/epsilon; or the recorded steps are not what "
                "the optimiser did (a setting the recorder does not represent)."
            )
