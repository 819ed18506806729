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
(``K W`` for the diagonal). Memory: the self-influence holds three ``K W``
arrays and the quadrature nodes' factors per row of a tile (``ROW_BUDGET_BYTES``
in all, the nodes counted on a sample of rows) and one ``W`` buffer per
training point; :meth:`StepwiseDecomposition.terms` keeps the backward
accumulation's buffer of every query row across the steps (``K W`` numbers per
row, besides a tile's temporaries), so many queries go in batches.
"""

from typing import NamedTuple

import numpy as np
import torch

from .._path import layout_by_rules, on_layers, read_row, take_rows
from ._progress import step_progress

#: Bytes of materialised features (features, buffer, psi) per tile of rows.
ROW_BUDGET_BYTES = 256 * 2**20


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

    Parameters
    ----------
    fitted : FittedPath
        The path and what the engine reads of it.
    test_copy : TestCopy
    verbose : int, default=0
        Show the progress over steps.
    """

    def __init__(self, fitted, test_copy, verbose=0):
        self.probes, self.steps, self.test_copy = fitted.probes, fitted.steps, test_copy
        self.verbose = verbose
        self.path, self.update = fitted.path, fitted.path.update
        self.X_train, self.n_outputs = fitted.X_train, fitted.n_outputs
        self.n_train, self.device = fitted.n_train, fitted.X_train.device

    # -- the pieces ----------------------------------------------------------

    def _probe(self):
        return self.probes.current()

    def _scaled_features(self, index, X, with_rows=None, targets=None):
        """``u_s = P_s phi_s(X)`` per rule (n, K, W_l), and the start factors of
        ``with_rows`` when given; with ``targets`` (a ``QueryTargets`` of ``X``'s
        rows), of the scalar targets: (n, 1, W_l)."""
        test_copy = self.test_copy if targets is None else self.test_copy.for_targets(targets)
        # (materialised only: a step's nodes may be evaluated in groups)
        integrated = test_copy.integrate(
            index, X, outputs_per_pair=test_copy.n_outputs, with_rows=with_rows, materialised=True
        )
        u = integrated.features.materialised()
        if self.update.preconditioners is not None:
            scales = self.path.unflatten(read_row(self.update.preconditioners, index, self.device))
            rules = self._probe().rules
            u = [layer * rule.flatten(scales) for layer, rule in zip(u, rules, strict=True)]
        return u, integrated.start_factors

    def _layout(self, dtype):
        """Per-parameter coefficients (parameter groups) laid out per rule."""
        probe = self._probe()
        return layout_by_rules(probe.rules, probe.params, dtype, self.device)

    def _training_gradients(self, index, rows, factors=None):
        """``sum_k e_{s,i,k} g_k(x_i; w_s)`` of the training ``rows`` (a host index
        array), per rule (b, W_l)."""
        probe = self._probe()
        if factors is None:
            start = self.steps.step(index).start
            gradients = self._output_gradients(index, rows)
            X = self.X_train[self.steps.on_device(rows)]
            batch = np.asarray(self.path.batches[index])
            masks = take_rows(self.path.masks(index), _positions(batch, rows))
            factors = probe.training_factors(start, X, gradients, masks)
        return [rule.materialise(f)[:, 0] for rule, f in zip(probe.rules, factors, strict=True)]

    def _output_gradients(self, index, rows):
        """``e_{s,i}`` of the training ``rows`` (all in step ``index``'s batch)."""
        batch = np.asarray(self.path.batches[index])
        position = _positions(batch, rows)
        return self.path.output_gradients[index][position].to(self.device)

    def _tile_rows(self, X):
        """Rows per tile for queries like ``X``: their materialised features and
        their node factors (:meth:`~._test_copy.TestCopy.nodes_per_row`, measured
        on ``X``'s first and last rows) within ``ROW_BUDGET_BYTES``, at least one."""
        row_bytes = 3 * 8 * self.n_outputs * self.path.n_weights
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

    def self_influence(self, first_step=0):
        """``c_i(x_i)`` per training point and output: (M, K), the diagonal of
        ``decompose(X_train).contributions`` (``x_i`` on the test copy).

        With ``first_step``, only the terms of the gradients taken from that
        step on (the diagonal of the attribution over time, summed over those
        steps); steps before it are skipped.
        """
        steps = range(first_step, self.path.n_steps)
        size = self._tile_rows(self.X_train)
        progress = step_progress(self.verbose, len(steps), "self-influence")
        try:
            if self.update.per_step:
                return self._self_influence_per_step(progress.over(steps), size)
            return self._self_influence_accumulated(progress.over(steps), size)
        finally:
            progress.close()

    def _self_influence_per_step(self, steps, size):
        """Plain SGD: only the steps whose batch holds ``i``, ``x_i`` integrated there."""
        M, K = self.n_train, self.n_outputs
        total = torch.zeros((M, K), dtype=self.X_train.dtype, device=self.device)
        for index in steps:
            batch = np.asarray(self.path.batches[index])
            scale = self.update.step_scale(index)
            for tile in self._tiles(batch.size, size):
                rows = batch[tile]
                X = self.X_train[self.steps.on_device(rows)]
                gradients = self._output_gradients(index, rows)
                if self.path.masks(index):  # the training rows with their masks
                    u, _ = self._scaled_features(index, X)
                    train = self._training_gradients(index, rows)
                else:
                    u, start_factors = self._scaled_features(index, X, with_rows=(X, gradients))
                    train = self._training_gradients(index, rows, start_factors)
                diagonal = scale * _diagonal(u, train)
                total.index_add_(0, self.steps.on_device(rows), diagonal)
        return total.cpu().numpy()

    def _self_influence_accumulated(self, steps, size):
        """Momentum, Adam: forward over the steps, with each point's own buffer.

        Exchanging the sums, ``c_i(x_i) = sum_s <u_s(x_i), m_s(i)>`` with ``u_s =
        P_s phi_s`` and ``m_s(i) = sum_{r <= s, i in B_r} c_{s,r} g_r(x_i)``, point
        ``i``'s own share of update ``s``: ``m_s(i) = gamma alpha_s b_s(i) + zeta_s
        [i in B_s] g_s(x_i)`` with the buffer ``b_s(i) = beta b_{s-1}(i) + [i in
        B_s] g_s(x_i)`` (``W`` numbers per point, not ``K W``). A point enters once
        its first batch has been taken.
        """
        update = self.update
        M, K = self.n_train, self.n_outputs
        device, X_train = self.device, self.X_train
        total = torch.zeros((M, K), dtype=X_train.dtype, device=device)
        layout = self._layout(X_train.dtype)
        buffer = None  # per rule, (M, W_l)
        seen = np.zeros(M, dtype=bool)
        for index in steps:
            batch = np.asarray(self.path.batches[index])
            rows = self.steps.on_device(batch)
            gradients = self._training_gradients(index, batch)
            if buffer is None:
                buffer = [g.new_zeros((M, g.shape[1])) for g in gradients]
            n_layers = len(buffer)
            betas = on_layers(update.buffer_decay, layout, n_layers)
            for layer, g, beta in zip(buffer, gradients, betas, strict=True):
                layer.mul_(beta).index_add_(0, rows, g)
            seen[batch] = True
            rates = on_layers(
                update.gradient_scale * update.gradient_rates[index], layout, n_layers
            )
            direct = update.direct_rates[index]
            directs = on_layers(direct, layout, n_layers)
            in_batch = np.full(M, -1)
            in_batch[batch] = np.arange(batch.size)
            active = np.flatnonzero(seen)
            for tile in self._tiles(active.size, size):
                part = active[tile]
                on_device = self.steps.on_device(part)
                u, _ = self._scaled_features(index, X_train[on_device])
                own = [rate * layer[on_device] for rate, layer in zip(rates, buffer, strict=True)]
                position = in_batch[part]
                if direct and (position >= 0).any():
                    local = self.steps.on_device(np.flatnonzero(position >= 0))
                    picked = self.steps.on_device(position[position >= 0])
                    for layer, g, zeta in zip(own, gradients, directs, strict=True):
                        layer.index_add_(0, local, zeta * g[picked])
                total.index_add_(0, on_device, _diagonal(u, own))
        return total.cpu().numpy()


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
