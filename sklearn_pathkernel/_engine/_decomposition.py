"""Decomposition: each training point's contribution to the network's output.

With ``e_{s,i}`` the recorded output gradient of training point ``i`` at step
``s`` (the cotangent of its loss), the update of step ``s`` is linear in the
gradients of its own and earlier steps, so, exactly,

    f(x; w_S) - f(x; w_0) = sum_s sum_{i in B_s} <psi_s(x), sum_k e_{s,i,k} g_k(x_i; w_s)>
                            - lambda_c sum_s <psi_s, w_s> + sum_s d_s <phi_s, w_s>

where ``psi_s`` is the test side of the update's backward accumulation
(``UpdateRecord.backward()``): ``eta_s phi_s`` for plain gradient descent,
``gamma B_s + zeta_s P_s phi_s`` with the buffer ``B_s = alpha_s P_s phi_s +
beta B_{s+1}`` for momentum and Adam (``P_s`` Adam's preconditioner), and the
last two sums are the decay terms (``UpdateRecord.decay_rate``, the coupled and
decoupled weight decays). A float32 run's path, anchored at its recorded weights,
adds ``sum_s <phi_s, r_s>`` to the decay term: each step's rounding, the part of
its recorded move the linear form does not give (``WeightPath.rounding_moves``).

Cost, per step and query row: the test copy (see :mod:`._test_copy`) and one
product with the batch's factors (per-step updates: every layer keeps its
factored rule); for updates that mix steps, the features materialised
(``K W`` numbers per row) and one matrix product with the batch's per-example
gradients.

A layer of fixed input under updates that mix steps by scalars (SGD's momentum and
Nesterov, with or without weight decay: ``UpdateRecord.scalar_mixing``): a first
``nn.Linear``'s test feature at every step is ``delta_s(x) [x, 1]^T`` with the
query ``x`` itself, so ``psi_s = D_s [x, 1]^T`` with ``D_s`` the same scalar
accumulation of the ``delta_s`` (:class:`FixedInputLayers`). Its accumulation
then costs ``n K d_out`` per step instead of ``n K d_out (d_in + 1)``, and its
product with the batch ``(D_s . delta_i) (x . x_i + 1)``, ``O(n |B| (d_in + K
d_out))``, without forming its gradients: for dattri's MNIST MLP (784-128-64-10,
92 % of the weights in the first layer) only the other 8906 weights are
materialised (see ``doc/benchmarks_field.rst`` for the timings). Adam's
elementwise preconditioner breaks the form: it takes the generic route, as does a
layer whose input moves (checked at every step; the task then reruns on the
generic route). The coupled decay's term takes the layer's ``directional``.

``step_chunks`` (the scheduler's :meth:`~._scheduling.Scheduler.chunks`) cuts that
backward pass into chunks of steps run in parallel, as a scan with a carry
(:mod:`._step_scan`); the same sums to rounding.

A scalar target per query (``targets``, :class:`~._targets.QueryTargets`) takes
the test copy of :math:`T` (``TestCopy.for_targets``): one cotangent per node and
one output everywhere above, so the backward passes, the materialised features
and the products cost one output's work instead of ``K``.
"""

from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from sklearn.utils import Bunch

from .._path import layout_by_rules, read_row, statistics_factors, take_rows, weighted
from ._modes import OutputMode
from ._planning import check_fits
from ._scheduling import SharedByTasks
from ._step_scan import StepScan
from .rules._gradients import FactoredGradients, Gradients


class DecompositionPart(NamedTuple):
    """One task's sums over its steps, for its rows: numpy arrays."""

    contributions: np.ndarray  # (n, M, K)
    decay: np.ndarray  # (n, K)
    quadrature_error: np.ndarray  # (n,)
    statistics: np.ndarray  # (n, M, K): the running statistics' share, or None


class ChunkPart(NamedTuple):
    """A chunk of steps' first pass (from no carried buffer), for its rows."""

    part: DecompositionPart
    carry: list  # the buffer at the chunk's first step, per layer, on the host; or None
    fixed_inputs: dict  # {layer: the rows' inputs} of the layers kept as deltas


class _InputsMoved(Exception):
    """A layer taken as one of fixed input saw another input at another step."""


class FixedInputLayers:
    """The layers whose accumulated test features are kept as deltas alone.

    Under an update that mixes steps by scalars
    (``UpdateRecord.scalar_mixing``), a layer whose test features at a step
    are ``delta_s(x) [a, 1]^T`` (``rule.outer_factors`` of its integrated
    factors) with the same ``a`` at every step (a first ``nn.Linear``: ``a`` is
    the query itself) has ``psi_r = (sum_s c_{s,r} delta_s) [a, 1]^T``: the
    accumulation runs on the (n, K, d_out) deltas instead of the (n, K,
    d_out (d_in + 1)) features. The layers are those whose factors have that
    form at the first step fed (the run's last); every later step checks that
    their inputs are the same values (``torch.equal``), and raises
    :class:`_InputsMoved` otherwise (the task then reruns on the generic route).

    Parameters
    ----------
    rules : list
        The probe's layer rules.
    enabled : bool
        False: no layer is kept factored (the generic route).
    """

    def __init__(self, rules, enabled):
        self.rules, self.enabled = rules, enabled
        self.inputs = None  # {layer index: (n, d_in)}, from the first step fed

    def of(self, features):
        """``{layer index: FactoredGradients}`` of this step's fixed-input layers."""
        if not self.enabled:
            return {}
        found = {}
        for index, rule in enumerate(self.rules):
            if self.inputs is not None and index not in self.inputs:
                continue
            factors = features.row_factors(index)
            outer = None if factors is None else rule.outer_factors(factors)
            if self.inputs is None:
                if outer is not None:
                    found[index] = outer
            elif outer is None or not torch.equal(outer.inputs, self.inputs[index]):
                raise _InputsMoved(f"layer {index}'s input moved between steps")
            else:
                found[index] = outer
        if self.inputs is None:
            self.inputs = {index: outer.inputs for index, outer in found.items()}
        return found


class Decomposition(SharedByTasks):
    """Decomposes the network's output on query rows over the training points.

    Parameters
    ----------
    fitted : FittedPath
        The path and what the engine reads of it.
    test_copy : TestCopy

    Attributes
    ----------
    fixed_input_layers : bool
        Whether updates that mix steps by scalars keep the layers of fixed input
        factored (see :class:`FixedInputLayers`; True). False takes the generic
        route (the same values; for comparisons).
    """

    fixed_input_layers = True

    def __init__(self, fitted, test_copy):
        self.probes, self.steps, self.planner = fitted.probes, fitted.steps, fitted.planner
        self.scheduler, self.test_copy, self.path = fitted.scheduler, test_copy, fitted.path
        self.X_train, self.n_nodes = fitted.X_train, fitted.nodes.per_piece
        self.n_outputs, self.n_train = fitted.n_outputs, fitted.n_train

    def decompose(self, X, batch_size=None, targets=None):
        """See ``PathKernelEngine.decompose``; ``X`` on the device, at most
        ``batch_size`` rows per tile (None: the planner's tiles); ``targets`` (a
        :class:`~._targets.QueryTargets` of ``X``'s rows, or None) makes the
        output one scalar per row."""
        accumulated = not self.path.update.per_step
        chunks = self.scheduler.chunks(accumulated)
        n_outputs = self.n_outputs if targets is None else 1
        row_bytes = 8 * self.n_train * n_outputs
        # The features, buffer and psi of a row, materialised over the weights; the
        # buffers of a row handed between chunks of steps.
        feature_bytes = 4 * 8 * n_outputs * self.path.n_weights if accumulated else 0
        boundaries = max(0, len(chunks) - 1) if accumulated else 0
        carry_bytes = 8 * n_outputs * self.path.n_weights * boundaries
        # Tiles from the nodes a query row really takes (kinks: tens to hundreds per step
        # for a CNN), measured on a sample, not the nodes of one smooth piece.
        nodes = self._test_copy_of(targets)[0].nodes_per_row(X)
        tiles = self.planner.query_tiles(
            X.shape[0], 2 * row_bytes + feature_bytes, nodes, max_rows=batch_size
        )
        # Every row's results are held to the end; the features only by the tiles
        # that run at once (one per worker), the carries of every tile until combined.
        widest = max((t.stop - t.start for t in tiles), default=0)
        held = min(X.shape[0], widest * self.scheduler.n_workers())
        check_fits(
            (row_bytes * (1 + self.scheduler.n_workers()) + carry_bytes) * X.shape[0]
            + feature_bytes * held,
            f"decompose on {X.shape[0]} rows ({self.n_train} training points, {n_outputs} outputs)",
            "decompose fewer rows at a time, or pass a smaller batch_size.",
        )

        def of(tile):
            return None if targets is None else targets.take(tile)

        desc = f"decompose {X.shape[0]} rows"
        if accumulated:  # the steps run backward: chunks of steps as a scan with a carry
            parts = StepScan(self, chunks, self.scheduler).run(X, tiles, of, n_outputs, desc)
        else:
            keys = [(tile, steps) for tile in tiles for steps in chunks.slices]
            tasks = [partial(self._per_step, X[tile], steps, of(tile)) for tile, steps in keys]
            results = self.scheduler.run(tasks, units=len(tiles) * self.path.n_steps, desc=desc)
            parts = [(tile, part) for (tile, _), part in zip(keys, results, strict=True)]
        contributions = np.zeros((X.shape[0], self.n_train, n_outputs))
        decay = np.zeros((X.shape[0], n_outputs))
        quadrature_error = np.zeros(X.shape[0])
        coupled = self.path.running_statistics is not None
        statistics = np.zeros_like(contributions) if coupled else None
        for tile, part in parts:
            contributions[tile] += part.contributions
            decay[tile] += part.decay
            quadrature_error[tile] += part.quadrature_error
            if part.statistics is not None:
                statistics[tile] += part.statistics
        probe = self.probes.current()
        extra = {} if statistics is None else {"statistics": statistics}

        def value(f):
            return f if targets is None else targets.values(f)

        return Bunch(
            **extra,
            contributions=contributions,
            bias=value(probe.output(self.steps.weights(0), X)).cpu().numpy(),
            decay=decay,
            output=value(probe.output(self.steps.weights(-1), X)).cpu().numpy(),
            quadrature_error=quadrature_error,
        )

    def _test_copy_of(self, targets):
        """The test copy, and the outputs per row, of the rows of a task."""
        if targets is None:
            return self.test_copy, self.n_outputs
        return self.test_copy.for_targets(targets), 1

    def _per_step(self, X, steps, targets=None):
        """Steps whose training gradients meet ``step_scale(s) * phi_s`` alone."""
        update = self.path.update
        test_copy, n_outputs = self._test_copy_of(targets)
        contributions = torch.zeros(
            (X.shape[0], self.n_train, n_outputs), dtype=X.dtype, device=X.device
        )
        decay = torch.zeros((X.shape[0], n_outputs), dtype=X.dtype, device=X.device)
        quadrature_error = np.zeros(X.shape[0])
        statistics = self._statistics_block(X, n_outputs)
        for index in self.progress.over(range(steps.start, steps.stop)):
            batch = self.steps.on_device(self.path.batches[index])
            scale = update.step_scale(index)
            gradients = self.path.output_gradients[index].to(self.steps.device)
            masks = self.path.masks(index)
            # (with dropout masks, or rows coupled through BatchNorm, the training rows
            # take a pass of their own)
            own_pass = bool(masks) or statistics is not None
            integrated = test_copy.integrate(
                index,
                X,
                outputs_per_pair=n_outputs,
                with_rows=None if own_pass else (self.X_train[batch], gradients),
                measure_error=True,
            )
            start_factors = integrated.start_factors
            if own_pass:
                start_factors = self.probes.current().training_factors(
                    self.steps.step(index).start, self.X_train[batch], gradients, masks
                )
            quadrature_error += integrated.quadrature_error
            step_block = torch.zeros(
                (X.shape[0], batch.numel(), n_outputs), dtype=X.dtype, device=X.device
            )
            # (n, batch, K, 1): a training row's factors hold the gradient of
            # sum_k e_{s,i,k} f_k (its output gradient as the cotangent)
            integrated.features.add_inner(start_factors, OutputMode.PAIRS, step_block.unsqueeze(-1))
            step_block *= scale
            if batch.numel() == self.n_train and torch.equal(
                batch, torch.arange(self.n_train, device=batch.device)
            ):
                contributions += step_block
            else:
                contributions.index_add_(1, batch, step_block)
            if statistics is not None:
                self._add_statistics(index, integrated.features, batch, statistics, X)
            # Weight decay: d_s <phi_s, w_s> - lambda_c <psi_s, w_s>, psi_s = scale phi_s
            decay_rate = update.decay_rate(index)
            if decay_rate:
                factor, direction = weighted(
                    decay_rate, self.steps.step(index).start, self.probes.current().params
                )
                decay += factor * integrated.features.directional(direction)
            if self.path.rounding_moves is not None:  # (a float32 run's rounding)
                decay += self._rounding_term(index, integrated.features)
        return self._part(contributions, decay, quadrature_error, statistics)

    def _rounding_term(self, index, features):
        """``<phi_s, r_s>``: the part of step ``index``'s recorded move that no
        training row made, a float32 run's rounding (``WeightPath.rounding_moves``)."""
        row = read_row(self.path.rounding_moves, index, self.steps.device)
        return features.directional(self.path.unflatten(row))

    def _statistics_block(self, X, n_outputs):
        """(n, M, K) zeros for the running statistics' shares, or None without them."""
        if self.path.running_statistics is None:
            return None
        shape = (X.shape[0], self.n_train, n_outputs)
        return torch.zeros(shape, dtype=X.dtype, device=X.device)

    def _add_statistics(self, index, features, batch, statistics, X):
        """Row ``i``'s share of step ``index``'s move of the running statistics,
        ``<phi_s, delta r_{s,i}>`` (``phi_s`` along the joint path of weights and
        statistics), into ``statistics`` (n, M, K)."""
        stats = self.path.running_statistics
        shares = stats.shares[index].to(device=X.device, dtype=X.dtype)
        factors = Gradients(statistics_factors(shares, self.path.n_weights - stats.n_statistics))
        block = torch.zeros(
            (X.shape[0], len(batch), statistics.shape[2]), dtype=X.dtype, device=X.device
        )
        features.add_inner([factors], OutputMode.PAIRS, block.unsqueeze(-1))
        statistics.index_add_(1, self.steps.on_device(batch), block)

    @staticmethod
    def _part(contributions, decay, quadrature_error, statistics):
        """The task's sums on the host; the statistics' shares join the contributions."""
        if statistics is not None:
            contributions = contributions + statistics
            statistics = statistics.cpu().numpy()
        return DecompositionPart(
            contributions.cpu().numpy(), decay.cpu().numpy(), quadrature_error, statistics
        )

    def _accumulated(self, X, targets, steps, fixed_inputs=True, carry_out=False):
        """The steps ``steps`` (a slice: all of them, or a chunk), backward, for
        updates that mix steps or are preconditioned, from no carried buffer: a
        :class:`ChunkPart` (see :mod:`._step_scan` for the chunks' carries).

        With ``u_s = P_s * phi_s`` (materialised per layer, except the layers of
        fixed input under scalar mixing: :class:`FixedInputLayers`) and ``psi_s``
        from the update's backward accumulation (see the module docstring). Cost
        per step: the test features (as for SGD), their materialisation (n K W),
        and one matrix product of (n K, W) with the batch's per-example gradients
        (W, |B_s|); a layer of fixed input costs n K d_out and its factored
        product instead. ``carry_out``: the chunk's buffer at its first step is
        handed back (on the host) for the chunks before it.
        """
        enabled = fixed_inputs and self.fixed_input_layers and self.path.update.scalar_mixing
        try:
            return self._accumulated_by(X, targets, steps, enabled, carry_out)
        except _InputsMoved:
            return self._accumulated_by(X, targets, steps, False, carry_out)

    def _layout(self, dtype):
        probe = self.probes.current()
        return layout_by_rules(probe.rules, probe.params, dtype, self.steps.device)

    def _accumulated_by(self, X, targets, steps, fixed_inputs, carry_out):
        """:meth:`_accumulated`, keeping the fixed-input layers factored if ``fixed_inputs``."""
        update = self.path.update
        test_copy, n_outputs = self._test_copy_of(targets)
        n = X.shape[0]
        contributions = torch.zeros((n, self.n_train, n_outputs), dtype=X.dtype, device=X.device)
        decay = torch.zeros((n, n_outputs), dtype=X.dtype, device=X.device)
        quadrature_error = np.zeros(n)
        statistics = self._statistics_block(X, n_outputs)
        probe = self.probes.current()
        accumulation = update.backward(self._layout(X.dtype))
        fixed_layers = FixedInputLayers(probe.rules, fixed_inputs)
        for index in self.progress.over(reversed(range(steps.start, steps.stop))):
            start = self.steps.step(index).start
            rules = self.probes.current().rules
            batch = self.path.batches[index]
            gradients = self.path.output_gradients[index].to(self.steps.device)
            # The batch's factors from the nodes' passes when its materialised
            # gradients fit one tile (as decompose does for plain SGD), else by tiles.
            masks = self.path.masks(index)
            shared = (
                not masks
                and statistics is None
                and len(self.planner.tiles(len(batch), 8 * self.path.n_weights)) == 1
            )
            integrated = test_copy.integrate(
                index,
                X,
                outputs_per_pair=n_outputs,
                with_rows=(self.X_train[self.steps.on_device(batch)], gradients)
                if shared
                else None,
                measure_error=True,
                materialised=True,
            )
            quadrature_error += integrated.quadrature_error
            features = integrated.features
            if statistics is not None:
                self._add_statistics(index, features, batch, statistics, X)
            params = self.probes.current().params
            if update.decoupled_decays[index]:
                factor, direction = weighted(update.decoupled_decays[index], start, params)
                decay += factor * features.directional(direction)
            if self.path.rounding_moves is not None:  # (a float32 run's rounding)
                decay += self._rounding_term(index, features)
            fixed = fixed_layers.of(features)  # (empty unless the steps mix by scalars)
            u = features.materialised(keep=fixed)
            for layer, outer in fixed.items():
                u[layer] = outer.deltas
            if update.preconditioners is not None:
                row = read_row(update.preconditioners, index, self.steps.device)
                scales = self.path.unflatten(row)
                u = [layer * rule.flatten(scales) for layer, rule in zip(u, rules, strict=True)]
            psi = accumulation.psi(index, u)
            inputs = {layer: outer.inputs for layer, outer in fixed.items()}
            self._meet_steps_batch(
                index,
                psi,
                inputs,
                contributions,
                decay,
                integrated.start_factors if shared else None,
                coupled=statistics is not None,
            )
        carry = None
        if carry_out:
            carry = [layer.cpu() for layer in accumulation.buffer]
        inputs = {} if fixed_layers.inputs is None else fixed_layers.inputs
        return ChunkPart(
            self._part(contributions, decay, quadrature_error, statistics),
            carry,
            {layer: value.cpu() for layer, value in inputs.items()},
        )

    def _carried(self, n_rows, n_outputs, steps, carry, inputs, dtype):
        """The part of a carried buffer ``carry`` (:math:`B_{steps.stop}`, per layer,
        on the host) in the steps ``steps``: its :meth:`~BackwardAccumulation.carried`
        ``psi`` met with each step's batch, and its share of the coupled decay term;
        the layers in ``inputs`` ({layer: the query rows' inputs}) hold deltas. A
        :class:`DecompositionPart` with zero quadrature error and no statistics (the
        carry has no test features of its own). Cost per step: the batch's factors
        and the products of the first pass, without the test copy."""
        device = self.steps.device
        update = self.path.update
        carry = [layer.to(device) for layer in carry]
        inputs = {layer: value.to(device) for layer, value in inputs.items()}
        contributions = torch.zeros((n_rows, self.n_train, n_outputs), dtype=dtype, device=device)
        decay = torch.zeros((n_rows, n_outputs), dtype=dtype, device=device)
        accumulation = update.backward(self._layout(dtype), carry, steps.stop)
        coupled = self.path.running_statistics is not None
        for index in self.progress.over(reversed(range(steps.start, steps.stop))):
            psi = accumulation.carried(index)
            self._meet_steps_batch(index, psi, inputs, contributions, decay, None, coupled)
        return DecompositionPart(
            contributions.cpu().numpy(), decay.cpu().numpy(), np.zeros(n_rows), None
        )

    def _meet_steps_batch(self, index, psi, inputs, contributions, decay, shared, coupled):
        """Step ``index``'s terms of ``psi`` (per layer; the layers in ``inputs`` hold
        deltas of factors with those inputs): the coupled decay, into ``decay``, and
        the products with the batch's training gradients, into ``contributions``
        (from ``shared``, the batch's factors of the test copy's passes, if given;
        the whole batch at once if its rows are ``coupled`` by BatchNorm; else by
        tiles of the batch)."""
        update = self.path.update
        start = self.steps.step(index).start
        probe = self.probes.current()
        rules, params = probe.rules, probe.params
        for layer, rows in inputs.items():  # psi = (sum_s c_s delta_s) [a, 1]^T
            psi[layer] = FactoredGradients(rows, psi[layer])
        if update.coupled_decay:
            factor, direction = weighted(update.coupled_decay, start, params)
            decay -= factor * sum(
                rule.directional(p, direction) if layer in inputs else p @ rule.flatten(direction)
                for layer, (p, rule) in enumerate(zip(psi, rules, strict=True))
            )
        batch = self.path.batches[index]
        if shared is not None:
            rows = self.steps.on_device(batch)
            contributions.index_add_(1, rows, self._batch_inner(psi, shared, inputs))
            return
        gradients = self.path.output_gradients[index].to(self.steps.device)
        masks = self.path.masks(index)
        if coupled:  # the rows are coupled: the whole batch at once
            rows = self.steps.on_device(batch)
            train = probe.training_factors(start, self.X_train[rows], gradients, masks)
            contributions.index_add_(1, rows, self._batch_inner(psi, train, inputs))
            return
        for part in self.planner.tiles(len(batch), 8 * self.path.n_weights):
            rows = self.steps.on_device(batch[part])
            train = probe.training_factors(
                start, self.X_train[rows], gradients[part], take_rows(masks, part)
            )
            contributions.index_add_(1, rows, self._batch_inner(psi, train, inputs))

    def _batch_inner(self, psi, train, fixed=()):
        """``<psi, sum_k e_{s,i,k} g_k(x_i; w_s)>`` (n, rows, K) for the training rows
        whose factors (output gradients as cotangents) are ``train``: their
        per-example gradients are materialised, one matrix product per layer; the
        layers in ``fixed`` hold factors and meet them by the rule's ``inner``,
        ``(D . delta_i) (a . a_i + 1)``."""
        rules = self.probes.current().rules
        block = sum(
            rule.inner(p, f, OutputMode.PAIRS)
            if layer in fixed
            else rule.dense_inner(p, f, OutputMode.PAIRS)
            for layer, (p, rule, f) in enumerate(zip(psi, rules, train, strict=True))
        )  # (n, rows, K, 1)
        return block[..., 0].contiguous()
