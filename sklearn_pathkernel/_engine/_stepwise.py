"""The decomposition step by step, and each training point's contribution to itself.

The engine's decomposition (see :mod:`._decomposition`) sums, for every query
``x`` and training point ``i``,

    c_i(x) = sum_s [i in B_s] <psi_s(x), sum_k e_{s,i,k} g_k(x_i; w_s)>,

over the steps ``s``, with ``psi_s`` the test side of step ``s``'s training
gradients (``eta_s phi_s`` for plain gradient descent; momentum and Adam
accumulate ``P_r phi_r`` of the later steps ``r >= s`` backward, see
``UpdateRecord.backward``). This module keeps the terms apart:

- :meth:`StepwiseDecomposition.terms` hands back each step's term ``(n, |B_s|,
  K)`` (the steps last to first), from which the explanations build the
  attribution over training time; the terms sum to the contributions exactly
  (up to the order of the floating-point sums);
- :meth:`StepwiseDecomposition.self_influence` gives ``c_i(x_i)``, the diagonal
  of ``decompose(X_train).contributions``, without its ``(M, M, K)`` array: for
  updates that move along their own gradient (plain SGD), only the steps whose
  batch holds ``i`` are integrated at ``x_i``, ``sum_s |B_s|`` test copies in all
  (``M`` times the epochs); for updates that mix steps (momentum, Adam), every
  step from ``i``'s first batch on (up to ``M S`` test copies), met by ``i``'s
  own momentum buffer (``W`` numbers per point) instead of the ``K W`` of the
  backward accumulation; no product with the other training points in either case.

Both work on materialised features (``K W`` numbers per row and layer,
``W`` the weights): each step's ``psi_s`` meets the batch's per-example
gradients in one product per layer. Cost per step and row: the test copy (as
``decompose``), ``K W`` for the features, and ``|B_s| K W`` for the term
(``K W`` for the diagonal). A scalar target per row (``QueryTargets``, e.g. a
classifier's own label's log-probability) makes every ``K`` here 1: one
output's work. Memory: the self-influence holds three ``K W`` arrays and the
quadrature nodes' factors per row of a tile (``ROW_BUDGET_BYTES`` in all, the
nodes counted on a sample of rows) and, for momentum and Adam, one ``W`` buffer
per training point of a block (``BUFFER_BUDGET_BYTES`` in all; more points take
more passes over the steps); :meth:`StepwiseDecomposition.terms` keeps the backward
accumulation's buffer of every query row across the steps (``K W`` numbers per
row, besides a tile's temporaries), so many queries go in batches.
"""

from typing import NamedTuple

import numpy as np
import torch

from .._path import layout_by_rules, on_layers, read_row, take_rows
from ._modes import OutputMode
from ._progress import step_progress
from .rules._gradients import FactoredGradients

#: Bytes of materialised features (features, buffer, psi) per tile of rows.
ROW_BUDGET_BYTES = 256 * 2**20
#: Bytes of the accumulated self-influence's momentum buffers (``W`` numbers per
#: training point) held at once; more points go in blocks, a pass over the steps each.
BUFFER_BUDGET_BYTES = 2**30


class StepTerm(NamedTuple):
    """One step's term of the decomposition of some query rows.

    Attributes
    ----------
    step : int
    batch : ndarray of shape (b,)
        The training indices of the step's batch.
    values : ndarray of shape (n, b, K)
        ``<psi_s(x), sum_k e_{s,i,k} g_k(x_i; w_s)>`` per query row and batch row.
    """

    step: int
    batch: np.ndarray
    values: np.ndarray


class StepwiseDecomposition:
    """Per-step terms and the self-influence of a recorded path
    (``PathKernelEngine.stepwise()`` builds one from the engine's parts).

    Attributes
    ----------
    fixed_input_layers : bool
        Whether the self-influence under scalar mixing keeps a layer of fixed
        input (a first ``nn.Linear``) factored (see
        :meth:`_self_influence_accumulated`); False: every layer materialised
        (the generic route, for comparison).

    Parameters
    ----------
    fitted : FittedPath
        The path and what the engine reads of it.
    test_copy : TestCopy
    verbose : int, default=0
        Show the progress over steps.
    """

    fixed_input_layers = True

    def __init__(self, fitted, test_copy, verbose=0):
        self.probes, self.steps, self.test_copy = fitted.probes, fitted.steps, test_copy
        self.verbose = verbose
        self.path, self.update = fitted.path, fitted.path.update
        self.X_train, self.n_outputs = fitted.X_train, fitted.n_outputs
        self.n_train, self.device = fitted.n_train, fitted.X_train.device

    # -- the pieces ----------------------------------------------------------

    def _probe(self):
        return self.probes.current()

    def _scaled_features(self, index, X, with_rows=None, targets=None, keep=()):
        """``u_s = P_s phi_s(X)`` per rule (n, K, W_l), and the start factors of
        ``with_rows`` when given; with ``targets`` (a ``QueryTargets`` of ``X``'s
        rows), of the scalar targets: (n, 1, W_l). The layers in ``keep`` (no
        preconditioner) stay factored: their ``FactoredGradients`` ``(a,
        delta)``, or :class:`_Unfactored` is raised where they are not."""
        test_copy = self.test_copy if targets is None else self.test_copy.for_targets(targets)
        # (materialised only: a step's nodes may be evaluated in groups)
        integrated = test_copy.integrate(
            index, X, outputs_per_pair=test_copy.n_outputs, with_rows=with_rows, materialised=True
        )
        u = integrated.features.materialised(keep=keep)
        rules = self._probe().rules
        for layer in keep:
            factors = integrated.features.row_factors(layer)
            outer = None if factors is None else rules[layer].outer_factors(factors)
            if outer is None:
                raise _Unfactored(layer, "its test features are not factored")
            u[layer] = outer
        if self.update.preconditioners is not None:
            scales = self.path.unflatten(read_row(self.update.preconditioners, index, self.device))
            rules = self._probe().rules
            u = [layer * rule.flatten(scales) for layer, rule in zip(u, rules, strict=True)]
        return u, integrated.start_factors

    def _layout(self, dtype):
        """Per-parameter coefficients (parameter groups) laid out per rule."""
        probe = self._probe()
        return layout_by_rules(probe.rules, probe.params, dtype, self.device)

    def _training_factors(self, index, rows):
        """The factors of ``sum_k e_{s,i,k} g_k(x_i; w_s)`` of the training ``rows``
        (a host index array, all in step ``index``'s batch), per rule."""
        start = self.steps.step(index).start
        gradients = self._output_gradients(index, rows)
        X = self.X_train[self.steps.on_device(rows)]
        batch = np.asarray(self.path.batches[index])
        masks = take_rows(self.path.masks(index), _positions(batch, rows))
        return self._probe().training_factors(start, X, gradients, masks)

    def _training_gradients(self, index, rows, factors=None):
        """``sum_k e_{s,i,k} g_k(x_i; w_s)`` of the training ``rows`` (a host index
        array), per rule (b, W_l)."""
        probe = self._probe()
        if factors is None:
            factors = self._training_factors(index, rows)
        return [rule.materialise(f)[:, 0] for rule, f in zip(probe.rules, factors, strict=True)]

    def _output_gradients(self, index, rows):
        """``e_{s,i}`` of the training ``rows`` (all in step ``index``'s batch)."""
        batch = np.asarray(self.path.batches[index])
        position = _positions(batch, rows)
        return self.path.output_gradients[index][position].to(self.device)

    def _tile_rows(self, X, n_outputs=None):
        """Rows per tile for queries like ``X``: their materialised features of
        ``n_outputs`` outputs (None: the ``K`` outputs) and their node factors
        (:meth:`~._test_copy.TestCopy.nodes_per_row`, measured on ``X``'s first
        and last rows) within ``ROW_BUDGET_BYTES``, at least one."""
        n_outputs = self.n_outputs if n_outputs is None else n_outputs
        row_bytes = 3 * 8 * n_outputs * self.path.n_weights
        nodes = self.test_copy.nodes_per_row(X)
        per_row = self.test_copy.planner.query_row_bytes(row_bytes, nodes)
        return max(1, ROW_BUDGET_BYTES // per_row)

    @staticmethod
    def _tiles(n_rows, size):
        """Consecutive row slices of ``size`` rows."""
        return [slice(begin, min(begin + size, n_rows)) for begin in range(0, n_rows, size)]

    # -- the terms -----------------------------------------------------------

    def terms(self, X, targets=None):
        """Each step's term of the decomposition of ``X``, the steps last to first.

        Parameters
        ----------
        X : torch.Tensor of shape (n, ...)
            Query rows (on the test copy), on the engine's device.
        targets : QueryTargets or None, default=None
            A scalar target per row (see ``PathKernelEngine.decompose``): the
            terms of ``T``, one output's work, ``values`` (n, b, 1).

        Yields
        ------
        StepTerm
            Over all tiles of rows, ``values`` has every row of ``X``: the rows
            are cut into tiles of ``ROW_BUDGET_BYTES`` only inside each step.
        """
        tiles = self._tiles(X.shape[0], self._tile_rows(X))
        accumulations = [self.update.backward(self._layout(X.dtype)) for _ in tiles]
        progress = step_progress(self.verbose, self.path.n_steps, f"terms of {X.shape[0]} rows")
        for index in progress.over(reversed(range(self.path.n_steps))):
            batch = np.asarray(self.path.batches[index])
            gradients = self._training_gradients(index, batch)
            n_outputs = self.n_outputs if targets is None else 1
            values = np.empty((X.shape[0], batch.size, n_outputs))
            for tile, accumulation in zip(tiles, accumulations, strict=True):
                of_tile = None if targets is None else targets.take(tile)
                u, _ = self._scaled_features(index, X[tile], targets=of_tile)
                psi = accumulation.psi(index, u)
                values[tile] = _inner(psi, gradients).cpu().numpy()
            yield StepTerm(index, batch, values)
        progress.close()

    # -- the self-influence ----------------------------------------------------

    def self_influence(self, first_step=0, targets=None):
        """``c_i(x_i)`` per training point and output: (M, K), the diagonal of
        ``decompose(X_train).contributions`` (``x_i`` on the test copy).

        Parameters
        ----------
        first_step : int, default=0
            Only the terms of the gradients taken from that step on (the
            diagonal of the attribution over time, summed over those steps);
            steps before it are skipped.
        targets : QueryTargets or None, default=None
            A scalar target per training row (its ``n_rows`` is ``M``, in the
            order of the training rows): ``c_i(x_i)`` of row ``i``'s own target
            :math:`T_i`, (M, 1), the diagonal of ``decompose(X_train,
            targets=targets).contributions``, at the cost of one output per row
            (each quadrature node back-propagates :math:`\\nabla T_i` alone, and
            the features hold one output).

        Returns
        -------
        ndarray of shape (M, K), or (M, 1) with ``targets``
        """
        if targets is not None and targets.n_rows != self.n_train:
            raise ValueError(
                f"targets must hold one label per training row ({self.n_train}), "
                f"got {targets.n_rows}."
            )
        steps = range(first_step, self.path.n_steps)
        n_outputs = self.n_outputs if targets is None else 1
        size = self._tile_rows(self.X_train, n_outputs)
        if self.update.per_step:
            progress = step_progress(self.verbose, len(steps), "self-influence")
            route = self._self_influence_per_step
        else:
            blocks = len(self._tiles(self.n_train, self._buffer_rows()))
            progress = step_progress(self.verbose, blocks * len(steps), "self-influence")
            route = self._self_influence_accumulated
        try:
            return route(steps, size, targets, progress)
        finally:
            progress.close()

    def _buffer_rows(self):
        """Training points whose momentum buffers (``W`` numbers each) one pass of
        the accumulated route holds: ``BUFFER_BUDGET_BYTES`` of them, at least one."""
        itemsize = torch.empty((), dtype=self.X_train.dtype).element_size()
        return max(1, BUFFER_BUDGET_BYTES // (itemsize * max(self.path.n_weights, 1)))

    def _self_influence_per_step(self, steps, size, targets, progress):
        """Plain SGD: only the steps whose batch holds ``i``, ``x_i`` integrated there."""
        M = self.n_train
        K = self.n_outputs if targets is None else 1
        total = torch.zeros((M, K), dtype=self.X_train.dtype, device=self.device)
        for index in progress.over(steps):
            batch = np.asarray(self.path.batches[index])
            scale = self.update.step_scale(index)
            for tile in self._tiles(batch.size, size):
                rows = batch[tile]
                on_device = self.steps.on_device(rows)
                X = self.X_train[on_device]
                own = None if targets is None else targets.take(on_device)
                gradients = self._output_gradients(index, rows)
                if self.path.masks(index):  # the training rows with their masks
                    u, _ = self._scaled_features(index, X, targets=own)
                    train = self._training_gradients(index, rows)
                else:
                    u, start_factors = self._scaled_features(
                        index, X, with_rows=(X, gradients), targets=own
                    )
                    train = self._training_gradients(index, rows, start_factors)
                diagonal = scale * _diagonal(u, train)
                total.index_add_(0, on_device, diagonal)
        return total.cpu().numpy()

    def _self_influence_accumulated(self, steps, size, targets, progress):
        """Momentum, Adam: forward over the steps, with each point's own buffer.

        Exchanging the sums, ``c_i(x_i) = sum_s <u_s(x_i), m_s(i)>`` with ``u_s =
        P_s phi_s`` and ``m_s(i) = sum_{r <= s, i in B_r} c_{s,r} g_r(x_i)``, point
        ``i``'s own share of update ``s``: ``m_s(i) = gamma alpha_s b_s(i) + zeta_s
        [i in B_s] g_s(x_i)`` with the buffer ``b_s(i) = beta b_{s-1}(i) + [i in
        B_s] g_s(x_i)`` (``W`` numbers per point, not ``K W``). A point enters once
        its first batch has been taken. The points go in blocks of
        :meth:`_buffer_rows` (one pass over the steps each), so that the buffers
        held stay within ``BUFFER_BUDGET_BYTES`` whatever ``M``; each point's sum
        over the steps is the same in any block.

        Under scalar mixing (SGD, momentum, Nesterov), a layer whose per-example
        gradients are ``delta [a, 1]^T`` with the input ``a`` of the row itself at
        every step (a first ``nn.Linear``: ``a = x_i``) keeps that form on both
        sides (``fixed_input_layers``): the buffer holds ``sum c delta`` (``d_out``
        numbers, not ``d_out (d_in + 1)``), the test features their deltas, and
        they meet by ``(a_x . a_i + 1) (delta_x . m_i)``. A block whose layer is
        not factored at some step (or whose input moved) reruns on the generic
        route.
        """
        M = self.n_train
        K = self.n_outputs if targets is None else 1
        total = torch.zeros((M, K), dtype=self.X_train.dtype, device=self.device)
        fixed = self.fixed_input_layers and self.update.scalar_mixing
        for block in self._tiles(M, self._buffer_rows()):
            excluded = set() if fixed else None
            over = progress.over(steps)
            while True:
                try:
                    total[block] = self._accumulate_block(block, over, size, targets, excluded)
                    break
                except _Unfactored as error:  # that layer materialised, from the start
                    excluded.add(error.layer)
                    over = steps
        return total.cpu().numpy()

    def _accumulate_block(self, block, steps, size, targets, excluded):
        """The accumulated route's ``c_i(x_i)`` of the training points ``block`` (a
        slice of ``range(M)``): (n_block, K), keeping the layers of fixed input
        factored but those in ``excluded`` (None: keep none)."""
        update, X_train = self.update, self.X_train
        layout = self._layout(X_train.dtype)
        n_block = block.stop - block.start
        K = self.n_outputs if targets is None else 1
        out = torch.zeros((n_block, K), dtype=X_train.dtype, device=self.device)
        buffer = None  # per rule, (n_block, W_l), or (n_block, d_out) for a kept layer
        keep, inputs = (), {}  # the kept layers, and each one's inputs (n_block, d_in)
        seen = np.zeros(n_block, dtype=bool)
        for index in steps:
            batch = np.asarray(self.path.batches[index])
            mine = batch[(batch >= block.start) & (batch < block.stop)]
            if buffer is None and mine.size == 0:
                continue  # no point of the block seen yet: nothing to add
            gradients = None
            if mine.size:
                factors = self._training_factors(index, mine)
                if buffer is None and excluded is not None:
                    keep = self._fixed_layers(index, mine[:1], factors, targets, excluded)
                gradients = self._own_gradients(factors, keep, inputs, mine - block.start, seen)
            if buffer is None:
                buffer = [g.new_zeros((n_block, g.shape[1])) for g in gradients]
            n_layers = len(buffer)
            betas = on_layers(update.buffer_decay, layout, n_layers)
            local = self.steps.on_device(mine - block.start)
            for number, (layer, beta) in enumerate(zip(buffer, betas, strict=True)):
                layer.mul_(beta)
                if mine.size:
                    layer.index_add_(0, local, gradients[number])
            seen[mine - block.start] = True
            rates = on_layers(
                update.gradient_scale * update.gradient_rates[index], layout, n_layers
            )
            direct = update.direct_rates[index]
            directs = on_layers(direct, layout, n_layers)
            in_batch = np.full(n_block, -1)
            in_batch[mine - block.start] = np.arange(mine.size)
            active = np.flatnonzero(seen)
            for tile in self._tiles(active.size, size):
                part = active[tile]
                on_device = self.steps.on_device(part)
                rows = self.steps.on_device(part + block.start)
                own_targets = None if targets is None else targets.take(rows)
                u, _ = self._scaled_features(index, X_train[rows], targets=own_targets, keep=keep)
                own = [rate * layer[on_device] for rate, layer in zip(rates, buffer, strict=True)]
                position = in_batch[part]
                if direct and (position >= 0).any():
                    at = self.steps.on_device(np.flatnonzero(position >= 0))
                    picked = self.steps.on_device(position[position >= 0])
                    for layer, g, zeta in zip(own, gradients, directs, strict=True):
                        layer.index_add_(0, at, zeta * g[picked])
                own_inputs = {layer: inputs[layer][on_device] for layer in keep}
                out.index_add_(0, on_device, self._own_diagonal(u, own, own_inputs))
        return out

    def _fixed_layers(self, index, row, factors, targets, excluded):
        """The layers to keep factored: those whose training ``factors`` and whose
        test features of the training row ``row`` (a host index array of one
        row, in step ``index``'s batch) at step ``index`` are both ``delta [a,
        1]^T`` (a layer integrated over its nodes with one input per row, a first
        ``nn.Linear``). That the inputs stay put is checked at every later step."""
        rules = self._probe().rules
        rows = self.steps.on_device(row)
        test_copy = self.test_copy
        if targets is not None:
            test_copy = test_copy.for_targets(targets.take(rows))
        features = test_copy.integrate(
            index, self.X_train[rows], outputs_per_pair=test_copy.n_outputs
        ).features
        keep = []
        for layer, (rule, f) in enumerate(zip(rules, factors, strict=True)):
            test = features.row_factors(layer)
            if layer in excluded:
                continue
            if rule.outer_factors(f) is not None and test is not None:
                if rule.outer_factors(test) is not None:
                    keep.append(layer)
        return tuple(keep)

    def _own_gradients(self, factors, keep, inputs, local, seen):
        """The training rows' gradients per rule, materialised (b, W_l) or, for the
        ``keep`` layers, their deltas (b, d_out), the rows' inputs written into
        ``inputs`` (``{layer: (n_block, d_in)}``, the block's rows ``local``, a
        host array) at their first batch and checked equal at every later one."""
        rules = self._probe().rules
        gradients = []
        for layer, (rule, f) in enumerate(zip(rules, factors, strict=True)):
            if layer not in keep:
                gradients.append(rule.materialise(f)[:, 0])
                continue
            outer = rule.outer_factors(f)
            if outer is None:
                raise _Unfactored(layer, "its training gradients are not factored")
            if layer not in inputs:
                inputs[layer] = outer.inputs.new_zeros((seen.size, outer.inputs.shape[1]))
            before = seen[local]
            on_device = self.steps.on_device(local)
            if before.any():
                old = self.steps.on_device(np.flatnonzero(before))
                if not torch.equal(inputs[layer][on_device[old]], outer.inputs[old]):
                    raise _Unfactored(layer, "its input moved between steps")
            inputs[layer][on_device] = outer.inputs
            gradients.append(outer.deltas[:, 0])
        return gradients

    def _own_diagonal(self, u, own, inputs):
        """``sum_l <u_l(row i), own_l(row i)>`` per row and output (n, K); the layers
        in ``inputs`` (``{layer: the rows' own inputs}``) hold ``FactoredGradients``
        on the test side and deltas on their own side, met by the rule's inner
        product of factors, ``(a_x . a_i + 1) (delta_x . m_i)``, output by output."""
        rules = self._probe().rules
        total = 0.0
        for layer, (p, g) in enumerate(zip(u, own, strict=True)):
            if layer not in inputs:
                total = total + _diagonal([p], [g])
                continue
            right = FactoredGradients(inputs[layer], g[:, None])
            columns = [
                rules[layer].inner(
                    FactoredGradients(p.inputs, p.deltas[:, k : k + 1]), right, OutputMode.DIAG
                )
                for k in range(p.deltas.shape[1])
            ]
            total = total + torch.stack(columns, 1)
        return total


class _Unfactored(Exception):
    """Layer ``layer``, kept factored, is not at some step (the block reruns with it
    materialised)."""

    def __init__(self, layer, why):
        super().__init__(f"layer {layer}: {why}")
        self.layer = layer


def _positions(batch, rows):
    """Positions of ``rows`` in ``batch`` (every row is in it)."""
    order = np.argsort(batch, kind="stable")
    return torch.as_tensor(order[np.searchsorted(batch, rows, sorter=order)])


def _inner(psi, gradients):
    """``sum_l <psi_l(row), gradient_l(batch row)>``: (n, K, W) x (b, W) -> (n, b, K)."""
    return sum(
        torch.einsum("nkw,bw->nbk", p.reshape(*p.shape[:2], -1), g.reshape(g.shape[0], -1))
        for p, g in zip(psi, gradients, strict=True)
    )


def _diagonal(psi, gradients):
    """``sum_l <psi_l(row i), gradient_l(row i)>``: (n, K, W) x (n, W) -> (n, K)."""
    return sum(
        torch.einsum("nkw,nw->nk", p.reshape(*p.shape[:2], -1), g.reshape(g.shape[0], -1))
        for p, g in zip(psi, gradients, strict=True)
    )
