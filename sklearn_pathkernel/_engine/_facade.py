"""The exact path kernel engine: decomposition and Gram matrices of a recorded path.

Notation (as in the user guide): ``f_w(x) = link(module_w(x))`` with K outputs (the
link is the log-softmax for classifiers, the identity for regressors); step
``s`` moves the weights along ``w_s(t) = w_s + t (w_{s+1} - w_s)``; the training
copy of a point uses ``g(x; w_s)``, the gradient at the start of the step, the
test copy ``phi_s(x) = int_0^1 g(x; w_s(t)) dt``. With ``e_{s,i} = -dL_s / df(x_i;
w_s)`` the recorded output gradient (for the cross-entropy, the point's share of the
batch at its label's output), for plain gradient descent, exactly,

    f(x; w_S) = f(x; w_0) + sum_s sum_{i in B_s} eta_s <phi_s(x), sum_k e_{s,i,k} g_k(x_i; w_s)>;

 momentum, Adam and weight decay replace ``eta_s phi_s``
by the backward-accumulated ``psi_s`` and add a decay term (see ``decompose``).

How it is fast: per step, one forward pass and one batched backward pass give
every layer's factors; the per-layer rules turn factors into Gram blocks without
ever forming an (n, K, W) Jacobian; the training side of a step is computed once
and reused for every node of every query; blocks of (query rows, training rows,
steps) are independent tasks for joblib.
"""

import copy
import math
import threading

import numpy as np
import torch
from joblib import Parallel, delayed
from sklearn.utils import Bunch, gen_even_slices

from .._training._losses import CrossEntropy
from . import _planning as _memory
from ._device import loadable_device, on_host
from ._features import StepFeatures
from ._output_subspace import in_output_subspace
from ._planning import check_fits, rows_per_tile, working_budget
from ._probe import NetworkProbe
from .integration._quadrature import (
    Nodes,
    exact_nodes,
    fixed_rule,
    gauss_on_pieces,
    pieces,
    same_nodes,
    shared_exact_nodes,
)

# A step whose quadrature misses the exact change f(w_{s+1}) - f(w_s) by more than
# this (absolute, in log-probability) is re-integrated on a finer detection grid.
CERTIFICATE_TOL = 1e-11
# ... unless rounding alone explains the miss: f(w_{s+1}) - f(w_s) is known only to
# about eps * |logits|, so with large logits (a saturated softmax on unscaled inputs:
# |logits| ~ 1e3) no quadrature can get below this many eps times the largest logit.
ROUNDING_ULPS = 64
# The test x test integrand is a product of two gradients (twice the polynomial
# degree of one) and carries no certificate: it gets three times the nodes.
TEST_TEST_NODES = 3
REFINEMENT_GRIDS = tuple(np.linspace(0.0, 1.0, n) for n in (9, 65))
# Last resort for rows whose certificate still fails (two kinks closer than the
# grid, e.g. a squared distance plus bias touching zero, or a sharp but smooth
# transition of a nearly saturated softmax): bisect their pieces until each piece's
# own certificate passes, at most this deep and into at most this many pieces per
# row (a row past the cap keeps its pieces; its certificate reports the error).
MAX_BISECTIONS = 48
MAX_PIECES_PER_ROW = 512


def _as_mask(flag, n):
    mask = np.broadcast_to(np.asarray(flag, dtype=bool), (n,))
    return mask.copy()


def _swap(block, mode):
    """The transposed block: (n, m) -> (m, n), (n, m, K, K') -> (m, n, K', K)."""
    axes = (1, 0) if mode == "trace" else (1, 0, 3, 2)
    return block.permute(*axes) if torch.is_tensor(block) else block.transpose(axes)


def _rounding_floor(*scales):
    """Per row, the error that rounding alone can cause in ``f(b) - f(a)``.

    ``scales`` are the rows' largest absolute logits at the points compared.
    """
    return ROUNDING_ULPS * torch.finfo(scales[0].dtype).eps * sum(scales)


def _without_rows(evaluated, rows):
    """The evaluated node chunks without the nodes of ``rows``."""
    kept = []
    for node_rows, weights, factors in evaluated:
        keep = ~torch.isin(node_rows, rows)
        if keep.all():
            kept.append((node_rows, weights, factors))
        elif keep.any():
            kept.append((node_rows[keep], weights[keep], [f.take(keep) for f in factors]))
    return kept


class PathKernelEngine:
    """Exact path kernel of a module trained along a recorded path.

    Parameters
    ----------
    module : torch.nn.Module
        The network (float64). Only its structure is used; weights come from ``path``.
    path : WeightPath
        The recorded training path.
    X_train : torch.Tensor of shape (M, ...)
        Training inputs, indexed by ``path.batches``. The engine computes on
        their device (``module`` must be there too); the path
        stays where it is (host memory or disk) and each step's weights are
        moved to the device when they are evaluated. Inputs of the public
        methods are moved to the device; results are numpy arrays.
    loss : Loss, default=None
        The training loss (``CrossEntropy()`` when None). Its ``link`` gives ``f``
        from the module's output (the log-softmax of the classifiers, the identity
        of the regressors); its ``certificate_tolerance`` is what the certificate
        holds each step to. What each training point contributes comes from the
        path's output gradients, for any loss.
    quadrature : {"exact", "riemann", "dpk"}, default="exact"
        Integration of the test-copy features along each step.
    n_points : int, default=100
        Points of the ``"riemann"`` rule.
    n_nodes : int, default=4
        Gauss-Legendre nodes per smooth piece for ``"exact"``.
    tile_size : int, default=512
        Rows per forward pass, per side of a matrix product and per block of
        the test x test Gram (on a GPU, products take more: see
        ``_block_size``); bounds the memory of each. Training and cross Gram
        tasks hold as many rows as the device's working budget allows.
    n_jobs : int or None, default=None
        joblib jobs over blocks (respects ``joblib.parallel_config``, e.g. dask).
    verbose : int, default=0
        Show a progress bar over blocks.
    """

    def __init__(
        self,
        module,
        path,
        X_train,
        *,
        loss=None,
        quadrature="exact",
        n_points=100,
        n_nodes=4,
        tile_size=512,
        n_jobs=None,
        verbose=0,
    ):
        self.module = module
        self.path = path
        self.X_train = X_train
        self.loss = CrossEntropy() if loss is None else loss
        self.link = self.loss.link
        self.quadrature = quadrature
        self.n_points = n_points
        self.n_nodes = n_nodes
        self.tile_size = tile_size
        self.n_jobs = n_jobs
        self.verbose = verbose
        self.device = X_train.device
        self._probe = NetworkProbe(module, path, X_train[:1], link=self.link)
        self.n_train = X_train.shape[0]
        self.n_outputs = self._probe.output(self._at(0), X_train[:1]).shape[1]

    def __deepcopy__(self, memo):
        return self  # immutable: copies share it (sklearn's clone deep-copies params)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_thread_probes", None)
        state.pop("_thread_steps", None)
        if self.device.type != "cpu":
            # Host tensors only: the pickle loads on a machine without the device.
            state["module"] = on_host(self.module)
            state["X_train"] = self.X_train.cpu()
            state.pop("_probe", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        device = loadable_device(state.get("device"), "The path kernel engine")
        if device != state.get("device") or "_probe" not in state:
            self.device = device
            self.module = self.module.to(device)
            self.X_train = self.X_train.to(device)
            self._probe = NetworkProbe(self.module, self.path, self.X_train[:1], link=self.link)

    def _at(self, index):
        """Row ``index`` of the weight path (host memory or disk), on the device."""
        return self.path.weights[index].to(self.device)

    def _step(self, step):
        """``w_s`` and ``w_{s+1} - w_s`` of ``step``, on the device.

        Remembered per thread for the last step asked: a step is evaluated many
        times in a row (kinks, nodes, certificate), and the same tensors let the
        probe reuse their unflattened parameters.
        """
        cache = self.__dict__.setdefault("_thread_steps", {})
        ident = threading.get_ident()
        if ident not in cache or cache[ident][0] != step:
            start = self._at(step)
            cache[ident] = (step, start, self._at(step + 1) - start)
        return cache[ident][1:]

    def _as_device_tensor(self, array):
        """A numpy array (row indices, nodes, weights) as a tensor on the device."""
        return torch.as_tensor(array, device=self.device)

    def _metric(self, step):
        """The weight-space metric of step ``step``'s kernel, per rule: Adam's
        preconditioner ``P_s`` in the rule's layout, or None (the identity)."""
        preconditioners = self.path.update.preconditioners
        if preconditioners is None:
            return None
        scales = self.path.unflatten(preconditioners[step].to(self.device))
        return [rule.flatten(scales) for rule in self.probe.rules]

    def _inner(self, left, right, mode, metric):
        """``sum_layers <g_left, P g_right>`` of two factor lists (``metric`` None: P = 1).

        A preconditioner breaks the factored forms of ``inner``: each rule's
        ``metric_inner`` takes it.
        """
        rules = self.probe.rules
        if metric is None:
            pairs = zip(rules, left, right, strict=True)
            return sum(rule.inner(a, b, mode) for rule, a, b in pairs)
        return sum(
            rule.metric_inner(a, b, scale, mode)
            for rule, a, b, scale in zip(rules, left, right, metric, strict=True)
        )

    @property
    def probe(self):
        """The network probe of the calling thread.

        Probes register forward hooks on their module while they evaluate it, so
        every worker thread gets its own copy of the module.
        """
        if threading.current_thread() is threading.main_thread():
            return self._probe
        probes = self.__dict__.setdefault("_thread_probes", {})
        ident = threading.get_ident()
        if ident not in probes:
            probes[ident] = NetworkProbe(
                copy.deepcopy(self.module), self.path, self.X_train[:1], link=self.link
            )
        return probes[ident]

    # -- quadrature ------------------------------------------------------------

    def _evaluate_nodes(self, step, X, nodes, with_rows=None):
        """Factors of every node in chunks: list of ``(rows, weights, factors)``.

        ``with_rows=(X_start, outputs)`` also returns the factors of those rows at
        the step's start (as ``probe.factors(start, X_start, outputs)``), from the
        first chunk's passes when that costs less than passes of their own.
        """
        start, direction = self._step(step)
        chunk = self._pass_rows()
        evaluated, start_factors = [], None
        for begin in range(0, nodes.rows.size, chunk):
            part = nodes.take(slice(begin, begin + chunk))
            rows = self._as_device_tensor(part.rows)
            t = self._as_device_tensor(part.t)
            if (
                with_rows is not None
                and start_factors is None
                and self._share_pass(part.rows.size, *with_rows)
            ):
                factors, start_factors = self.probe.factors_with(
                    start, X[rows], *with_rows, direction=direction, t=t
                )
            else:
                factors = self.probe.factors(start, X[rows], direction=direction, t=t)
            evaluated.append((rows, self._as_device_tensor(part.weights), factors))
        if with_rows is not None and start_factors is None:
            start_factors = self.probe.factors(start, *with_rows)
        return evaluated if with_rows is None else (evaluated, start_factors)

    def _share_pass(self, n_nodes, X_start, outputs):
        """Whether rows at the step's start join the nodes' passes.

        A pass's fixed cost is that of many small rows; sharing it back-propagates
        every output for the joining rows too, so they join when they need every
        output, or when that extra work is at most the nodes' own backward pass.
        """
        if not self.probe.per_row_t:
            return False
        extra = 0 if outputs is None else (self.n_outputs - 1) * X_start.shape[0]
        return extra <= self.n_outputs * n_nodes

    def _certify(self, step, X, features, ends=None):
        """Per row, ``max_k |f(w_{s+1}) - f(w_s) - <phi_s, w_{s+1} - w_s>|``.

        Returns the errors and, per row, the tolerance they are held to:
        ``CERTIFICATE_TOL``, or the rounding floor of the logits where that is
        larger. ``ends``, ``[(f_start, scale_start), (f_end, scale_end)]`` of ``X`` from the
        kink search's passes at ``t = 0`` and ``t = 1``, saves two forward passes.
        """
        start, direction = self._step(step)
        if ends:
            (f_start, scale_start), (f_end, scale_end) = ends
        else:
            f_start, scale_start = self.probe.output_with_scale(start, X)
            f_end, scale_end = self.probe.output_with_scale(self._at(step + 1), X)
        error = f_end - f_start - features.directional(self.probe.params(direction))
        tolerance = torch.clamp(_rounding_floor(scale_start, scale_end), min=CERTIFICATE_TOL)
        return error.abs().amax(1).cpu().numpy(), tolerance.cpu().numpy()

    def _test_features(
        self, step, X, residual=None, n_nodes=None, outputs_per_pair=1, with_rows=None
    ):
        """The test-copy features ``phi_s`` of ``step`` for every row of ``X``.

        Returns a :class:`StepFeatures` (``outputs_per_pair``: see there), and
        with ``with_rows=(X_start, outputs)`` also those rows' factors at the
        step's start (see ``_evaluate_nodes``). The certificate is checked from
        the same factors and added to ``residual``; with ``"exact"``, rows above
        ``CERTIFICATE_TOL`` (kinks that cancel between detection points) are
        integrated again on a finer detection grid, then by bisection.
        """
        start, direction = self._step(step)
        n_nodes = n_nodes or self.n_nodes
        n_rows = X.shape[0]

        def features_of(evaluated):
            return StepFeatures(self.probe.rules, evaluated, n_rows, outputs_per_pair)

        def result(features):
            return features if with_rows is None else (features, start_factors)

        if self.quadrature == "exact":
            kinks, ends = [], []  # kinks: one array per row
            nodes = exact_nodes(self.probe, start, direction, X, n_nodes, kinks=kinks, ends=ends)
        else:
            nodes = same_nodes(np.arange(n_rows), *fixed_rule(self.quadrature, self.n_points))
        evaluated = self._evaluate_nodes(step, X, nodes, with_rows)
        if with_rows is not None:
            evaluated, start_factors = evaluated
        features = features_of(evaluated)
        if self.quadrature != "exact":
            if residual is not None:
                residual += self._certify(step, X, features)[0]
            return result(features)
        errors, tolerance = self._certify(step, X, features, ends)
        for grid in (*REFINEMENT_GRIDS, None):  # None: bisection, the last resort
            failed = np.flatnonzero(errors > tolerance)
            if failed.size == 0:
                break
            if grid is None:
                refined = self._bisected_nodes(step, X, failed, [kinks[r] for r in failed], n_nodes)
            else:
                found = []
                refined = exact_nodes(
                    self.probe, start, direction, X, n_nodes, rows=failed, grid=grid, kinks=found
                )
                for row, row_kinks in zip(failed, found, strict=True):
                    kinks[row] = row_kinks
            # Only the failed rows are evaluated again.
            kept = _without_rows(evaluated, self._as_device_tensor(failed))
            evaluated = kept + self._evaluate_nodes(step, X, refined)
            features = features_of(evaluated)
            errors, tolerance = self._certify(step, X, features, ends)
        if residual is not None:
            residual += errors
        return result(features)

    def _bisected_nodes(self, step, X, rows, kinks, n_nodes):
        """Adaptive nodes: halve every piece whose own certificate fails.

        The pieces start as each row's kink partition (``kinks``, per row). The
        exact change of ``f`` over any piece ``[a, b]`` is known (two forward
        passes), so each piece is certified on its own; a piece holding an
        undetected kink, or a transition too sharp for its nodes, shrinks
        geometrically until its error is negligible. A
        piece passes below ``CERTIFICATE_TOL / 64`` or the rounding floor of its
        ends, whichever is larger; a row stops splitting at ``MAX_PIECES_PER_ROW``
        (so a row that rounding keeps from passing cannot split without end).
        """
        start, direction = self._step(step)
        step_params = self.probe.params(direction)
        tolerance = CERTIFICATE_TOL / 64
        pending = pieces(rows, kinks)
        done = []
        for depth in range(MAX_BISECTIONS + 1):
            piece_rows, a, b = pending
            if piece_rows.size == 0:
                break
            nodes = gauss_on_pieces(piece_rows, a, b, n_nodes)
            if depth == MAX_BISECTIONS:
                done.append(nodes)
                break
            # <integral over each piece, w_{s+1} - w_s>: the nodes' factors, summed per piece
            piece_of_node = self._as_device_tensor(np.repeat(np.arange(piece_rows.size), n_nodes))
            by_piece, offset = [], 0
            for _, weights, factors in self._evaluate_nodes(step, X, nodes):
                by_piece.append(
                    (piece_of_node[offset : offset + weights.numel()], weights, factors)
                )
                offset += weights.numel()
            features = StepFeatures(self.probe.rules, by_piece, piece_rows.size)
            estimate = features.directional(step_params)
            # f at both ends of every piece, in one pass
            X_rows = X[self._as_device_tensor(np.concatenate([piece_rows, piece_rows]))]
            f_ab, scale_ab = self.probe.output_with_scale(
                start,
                X_rows,
                direction,
                self._as_device_tensor(np.concatenate([a, b])),
                            )
            (f_a, f_b), (scale_a, scale_b) = f_ab.chunk(2), scale_ab.chunk(2)
            floor = torch.clamp(_rounding_floor(scale_a, scale_b), min=tolerance)
            ok = ((f_b - f_a - estimate).abs().amax(1) <= floor).cpu().numpy()
            # Rows that would split into more pieces than the cap keep the ones they have.
            n_failing = np.bincount(piece_rows[~ok], minlength=X.shape[0])[piece_rows]
            ok |= 2 * n_failing > MAX_PIECES_PER_ROW
            done.append(nodes.take(np.repeat(ok, n_nodes)))
            bad_rows, bad_a, bad_b = piece_rows[~ok], a[~ok], b[~ok]
            middle = 0.5 * (bad_a + bad_b)
            pending = (
                np.concatenate([bad_rows, bad_rows]),
                np.concatenate([bad_a, middle]),
                np.concatenate([middle, bad_b]),
            )
        return Nodes.cat(done)

    # -- blocks ------------------------------------------------------------------

    def _steps_chunks(self):
        n_chunks = max(1, min(self.path.n_steps, self._n_workers()))
        return list(gen_even_slices(self.path.n_steps, n_chunks))

    def _n_workers(self):
        from joblib import effective_n_jobs

        return effective_n_jobs(self.n_jobs)

    def _run(self, tasks):
        """Run independent block tasks through joblib, in order."""
        if self._n_workers() == 1 or len(tasks) == 1:
            if self.verbose:
                from tqdm.auto import tqdm

                tasks = tqdm(tasks, desc="path kernel blocks")
            return [fn(*args) for fn, *args in tasks]
        # Threads by default (torch releases the GIL in its kernels; nothing to
        # pickle); ``joblib.parallel_config(backend="dask")`` sends blocks to a cluster.
        return Parallel(n_jobs=self.n_jobs, verbose=self.verbose, prefer="threads")(
            delayed(fn)(*args) for fn, *args in tasks
        )

    def _tiles(self, n, row_bytes=0):
        """Row slices of at most ``tile_size`` rows, fewer when rows are large."""
        size = rows_per_tile(self.tile_size, row_bytes)
        return list(gen_even_slices(n, max(1, -(-n // size)))) if n else []

    # -- decomposition -------------------------------------------------------------

    def decompose(self, X):
        """Contributions of every training point to the network's output on ``X``.

        The update of step ``s`` is linear in the gradients of its own and earlier
        steps (see ``_optimizers``). When each step moves along its own gradient,
        unpreconditioned (plain SGD, with or without weight decay), step ``s``'s
        training gradients meet ``phi_s`` alone and every layer keeps its factored
        rule. Otherwise (momentum, Adam, AdamW) they meet
        ``psi_s = gamma B_s + zeta_s P_s phi_s`` with the buffer's test side
        ``B_s = alpha_s P_s phi_s + beta B_{s+1}``, accumulated backward over
        the steps: one pass over the path, materialised per-layer features
        (n x K x W per row tile), one matrix product per step against the
        batch's per-example gradients (``_decompose_accumulated``).

        Parameters
        ----------
        X : torch.Tensor of shape (n, ...)
            Query rows, all on the test copy.

        Returns
        -------
        Bunch
            ``contributions`` (n, M, K), ``bias`` (n, K), ``decay`` (n, K),
            ``output`` (n, K) (``f`` at the path's last weights) and ``residual``
            (n,) (the quadrature's certificate, summed over steps), as float64
            numpy arrays.
        """
        X = X.to(self.device)
        accumulated = not self.path.update.per_step
        row_bytes = 8 * self.n_train * self.n_outputs
        # The features, buffer and psi of a row, materialised over the weights.
        feature_bytes = 4 * 8 * self.n_outputs * self.path.n_weights if accumulated else 0
        check_fits(
            (row_bytes * (1 + self._n_workers()) + feature_bytes) * X.shape[0],
            f"decompose on {X.shape[0]} rows ({self.n_train} training points, "
            f"{self.n_outputs} outputs)",
            "decompose fewer rows at a time.",
        )
        tiles = self._query_tiles(X.shape[0], 2 * row_bytes + feature_bytes, self.n_nodes)
        if accumulated:  # the steps run backward, in order: tiles of rows only
            keys = [(tile, None) for tile in tiles]
            tasks = [(self._decompose_accumulated, X[tile]) for tile in tiles]
        else:
            keys = [(tile, steps) for tile in tiles for steps in self._steps_chunks()]
            tasks = [(self._decompose_block, X[tile], steps) for tile, steps in keys]
        results = self._run(tasks)
        contributions = np.zeros((X.shape[0], self.n_train, self.n_outputs))
        decay = np.zeros((X.shape[0], self.n_outputs))
        residual = np.zeros(X.shape[0])
        for (tile, _), (block, block_decay, block_residual) in zip(keys, results, strict=True):
            contributions[tile] += block
            decay[tile] += block_decay
            residual[tile] += block_residual
        return Bunch(
            contributions=contributions,
            bias=self.probe.output(self._at(0), X).cpu().numpy(),
            decay=decay,
            output=self.probe.output(self._at(-1), X).cpu().numpy(),
            residual=residual,
        )

    def _decompose_block(self, X, steps):
        """Steps whose training gradients meet ``step_scale(s) * phi_s`` alone."""
        update = self.path.update
        contributions = torch.zeros(
            (X.shape[0], self.n_train, self.n_outputs), dtype=X.dtype, device=X.device
        )
        decay = torch.zeros((X.shape[0], self.n_outputs), dtype=X.dtype, device=X.device)
        residual = np.zeros(X.shape[0])
        for step in range(steps.start, steps.stop):
            batch = self._as_device_tensor(self.path.batches[step])
            scale = update.step_scale(step)
            gradients = self.path.output_gradients[step].to(self.device)
            step_block = torch.zeros(
                (X.shape[0], batch.numel(), self.n_outputs), dtype=X.dtype, device=X.device
            )
            features, train = self._test_features(
                step,
                X,
                residual,
                outputs_per_pair=self.n_outputs,
                with_rows=(self.X_train[batch], gradients),
            )
            # (n, batch, K, 1): a training row's factors hold the gradient of
            # sum_k e_{s,i,k} f_k (its output gradient as the cotangent)
            features.add_inner(train, "pairs", step_block.unsqueeze(-1))
            step_block *= scale
            if batch.numel() == self.n_train and torch.equal(
                batch, torch.arange(self.n_train, device=batch.device)
            ):
                contributions += step_block
            else:
                contributions.index_add_(1, batch, step_block)
            # Weight decay: d_s <phi_s, w_s> - lambda_c <psi_s, w_s>, psi_s = scale phi_s
            decay_rate = update.decay_rate(step)
            if decay_rate:
                decay += decay_rate * features.directional(self.probe.params(self._step(step)[0]))
        return contributions.cpu().numpy(), decay.cpu().numpy(), residual

    def _decompose_accumulated(self, X):
        """All steps, backward, for updates that mix steps or are preconditioned.

        With ``u_s = P_s * phi_s`` (materialised per layer), the buffer's test side
        ``B_s = alpha_s u_s + beta B_{s+1}`` and ``psi_s = gamma B_s + zeta_s u_s``,

            f(x; w_S) - f(x; w_0) = sum_s sum_{i in B_s} <psi_s, sum_k e_{s,i,k} g_k(x_i; w_s)>
                                    - lambda_c sum_s <psi_s, w_s> + sum_s d_s <phi_s, w_s>

        (the first sum: the contributions; the rest: ``decay``). Cost per step: the
        test features (as for SGD), their materialisation (n K W), and one matrix
        product of (n K, W) with the batch's per-example gradients (W, |B_s|).
        """
        update, rules = self.path.update, self.probe.rules
        n, n_outputs = X.shape[0], self.n_outputs
        contributions = torch.zeros((n, self.n_train, n_outputs), dtype=X.dtype, device=X.device)
        decay = torch.zeros((n, n_outputs), dtype=X.dtype, device=X.device)
        residual = np.zeros(n)
        accumulation = update.backward()
        for step in reversed(range(self.path.n_steps)):
            start, _ = self._step(step)
            batch = self.path.batches[step]
            gradients = self.path.output_gradients[step].to(self.device)
            # The batch's factors from the nodes' passes when its materialised
            # gradients fit one tile (as decompose does for plain SGD), else by tiles.
            shared = len(self._tiles(len(batch), 8 * self.path.n_weights)) == 1
            features = self._test_features(
                step,
                X,
                residual,
                outputs_per_pair=n_outputs,
                with_rows=(self.X_train[self._as_device_tensor(batch)], gradients)
                if shared
                else None,
            )
            if shared:
                features, train = features
            weights = self.probe.params(start)
            if update.decoupled_decays[step]:
                decay += update.decoupled_decays[step] * features.directional(weights)
            u = features.materialised()
            if update.preconditioners is not None:
                scales = self.path.unflatten(update.preconditioners[step].to(self.device))
                u = [layer * rule.flatten(scales) for layer, rule in zip(u, rules, strict=True)]
            psi = accumulation.psi(step, u)
            if update.coupled_decay:
                decay -= update.coupled_decay * sum(
                    p @ rule.flatten(weights) for p, rule in zip(psi, rules, strict=True)
                )
            if shared:
                self._add_batch_inner(psi, self._as_device_tensor(batch), train, contributions)
                continue
            for part in self._tiles(len(batch), 8 * self.path.n_weights):
                rows = self._as_device_tensor(batch[part])
                train = self.probe.factors(start, self.X_train[rows], gradients[part])
                self._add_batch_inner(psi, rows, train, contributions)
        return contributions.cpu().numpy(), decay.cpu().numpy(), residual

    def _add_batch_inner(self, psi, rows, train, contributions):
        """``contributions[:, i] += <psi, sum_k e_{s,i,k} g_k(x_i; w_s)>`` for the training
        ``rows`` whose factors (output gradients as cotangents) are ``train``: their
        per-example gradients are materialised, one matrix product per layer."""
        block = sum(
            rule.dense_inner(p, f, "pairs")
            for p, rule, f in zip(psi, self.probe.rules, train, strict=True)
        )  # (n, rows, K, 1)
        contributions.index_add_(1, rows, block[..., 0].contiguous())

    def certificate(self, X):
        """Summed per-step quadrature error of the test copy, per row of ``X``."""
        X = X.to(self.device)
        residual = np.zeros(X.shape[0])
        for step in range(self.path.n_steps):
            self._test_features(step, X, residual)
        return residual

    # -- Gram matrices ---------------------------------------------------------------

    def gram(self, A, B=None, *, a_train=False, b_train=False, output="trace"):
        """Exact path kernel between the rows of ``A`` and ``B``.

        Parameters
        ----------
        A : torch.Tensor of shape (nA, ...)
        B : torch.Tensor of shape (nB, ...) or None
            ``None`` means ``B = A`` with ``b_train = a_train``.
        a_train, b_train : bool or array of bool
            Per row: True puts the row on the training copy (gradient at the start
            of each step), False on the test copy (gradient integrated along it).
        output : {"trace", "full"}
            ``"trace"`` sums matching outputs, giving (nA, nB); ``"full"`` keeps
            every output pair, giving (nA, nB, K, K).

        Returns
        -------
        ndarray
        """
        if output not in ("trace", "full"):
            raise ValueError(f"output must be 'trace' or 'full', got {output!r}.")
        mode = "trace" if output == "trace" else "pairs"
        symmetric = B is None
        A = A.to(self.device)
        B = None if symmetric else B.to(self.device)
        a_mask = _as_mask(a_train, A.shape[0])
        B, b_mask = (A, a_mask) if symmetric else (B, _as_mask(b_train, B.shape[0]))
        a_tr, a_te = np.flatnonzero(a_mask), np.flatnonzero(~a_mask)
        b_tr, b_te = np.flatnonzero(b_mask), np.flatnonzero(~b_mask)
        n_outputs = (self.n_outputs,) * 2 if mode == "pairs" else ()
        check_fits(
            3 * 8 * A.shape[0] * B.shape[0] * int(np.prod(n_outputs)),
            f"A {output!r} Gram of shape {(A.shape[0], B.shape[0]) + n_outputs}",
            "request fewer rows at a time, or output='trace' instead of 'full'.",
        )
        gram = np.zeros((A.shape[0], B.shape[0]) + n_outputs)

        def rows(X, index):
            return X[self._as_device_tensor(index)]

        if a_tr.size and b_tr.size:
            gram[np.ix_(a_tr, b_tr)] = self._blocks(
                "discrete", rows(A, a_tr), rows(B, b_tr), mode, symmetric
            )
        if a_te.size and b_tr.size:
            gram[np.ix_(a_te, b_tr)] = self._blocks("mixed", rows(A, a_te), rows(B, b_tr), mode)
        if a_tr.size and b_te.size:
            if symmetric:
                mixed = gram[np.ix_(b_te, a_tr)]
            else:
                mixed = self._blocks("mixed", rows(B, b_te), rows(A, a_tr), mode)
            gram[np.ix_(a_tr, b_te)] = _swap(mixed, mode)
        if a_te.size and b_te.size:
            gram[np.ix_(a_te, b_te)] = self._blocks(
                "test", rows(A, a_te), rows(B, b_te), mode, symmetric
            )
        if symmetric:  # exactly symmetric, not just up to rounding
            gram = 0.5 * (gram + _swap(gram, mode))
        return gram

    def _blocks(self, kind, P, Q, mode, symmetric=False):
        """One kind of block between rows ``P`` and ``Q``, as independent tasks.

        ``kind`` is "discrete" (both on the training copy), "mixed" (``P`` on the
        test copy, ``Q`` on the training copy) or "test" (both on the test copy).
        Tasks are (tile of ``P``, chunk of steps); a symmetric request computes
        only the columns from the tile's first row on and mirrors them.

        Scheduling is step-major: a task computes each step's factors of its rows
        and of ``Q`` once and accumulates the step into its output block, which
        stays in memory across layers and steps. Tiles of ``P`` are as large as
        the device's working budget allows (``working_budget``: one tile for a
        host Gram of a few thousand rows, tens of thousands on a GPU).
        """
        pairs = self.n_outputs**2 if mode == "pairs" else 1
        if kind == "test":
            tiles = self._tiles(P.shape[0], 8 * Q.shape[0] * pairs)
        else:
            tiles = self._task_tiles(kind, P.shape[0], Q.shape[0], pairs)
        keys = [(tile, steps) for tile in tiles for steps in self._steps_chunks()]
        results = self._run(
            [
                (
                    self._block_rows,
                    kind,
                    P[tile],
                    Q[tile.start :] if symmetric else Q,
                    steps,
                    mode,
                    symmetric,
                )
                for tile, steps in keys
            ]
        )
        n_outputs = (self.n_outputs,) * 2 if mode == "pairs" else ()
        out = np.zeros((P.shape[0], Q.shape[0]) + n_outputs)
        for (tile, _), block in zip(keys, results, strict=True):
            offset = tile.start if symmetric else 0
            out[tile, offset:] += block
            if symmetric:
                width = tile.stop - tile.start
                out[tile.stop :, tile] += _swap(block[:, width:], mode)
        return out

    def _task_tiles(self, kind, n_rows, n_other, pairs):
        """Tiles of the rows of a training or mixed block, from the working budget.

        A task holds its output block, one step's factors of its rows (for the
        test copy: of their quadrature nodes, about ``n_nodes + 1`` per row) and
        of the other side's rows (a training Gram: all of them; a mixed block: one
        pass of them), and, for a mixed block on a preconditioned path, its rows'
        features materialised and scaled.
        """
        factor_bytes = self._factor_row_bytes()
        per_row = 8 * n_other * pairs + factor_bytes * (
            1 if kind == "discrete" else self.n_nodes + 1
        )
        if kind == "mixed" and self.path.update.preconditioners is not None:
            per_row += 16 * self.n_outputs * self.path.n_weights  # P_s phi_s, materialised
        shared = factor_bytes * (n_other if kind == "discrete" else self.tile_size)
        budget = working_budget(self.device, self._n_workers())
        size = max(1, (budget - shared) // per_row)
        return list(gen_even_slices(n_rows, max(1, -(-n_rows // size)))) if n_rows else []

    def _factor_row_bytes(self):
        """Bytes of one row's training-copy factors (every output), all layers."""
        if "_row_bytes" not in self.__dict__:
            factors = self._probe.factors(self._at(0), self.X_train[:1])
            self._row_bytes = max(8, sum(f.nbytes for f in factors))
        return self._row_bytes

    def _pass_rows(self):
        """Rows per forward and backward pass of the probe: as many as
        ``PASS_BUDGET_BYTES`` of factors (small networks get few, large passes;
        each pass has a fixed cost), and on a GPU at least ``_block_size()``."""
        rows = max(1, _memory.PASS_BUDGET_BYTES // self._factor_row_bytes())
        return max(rows, self._block_size()) if self.device.type == "cuda" else rows

    def _passes(self, n_rows):
        """Consecutive slices of ``_pass_rows()`` rows."""
        size = self._pass_rows()
        return [slice(begin, min(begin + size, n_rows)) for begin in range(0, n_rows, size)]

    def _query_tiles(self, n_rows, row_bytes, nodes_per_row):
        """Tiles of query rows, one per task of ``decompose`` or ``diag``: as many
        rows as the working budget holds at ``row_bytes`` of results each, plus
        the factors of their quadrature nodes (``nodes_per_row`` and the kink
        search's row)."""
        per_row = row_bytes + (nodes_per_row + 1) * self._factor_row_bytes()
        size = max(1, working_budget(self.device, self._n_workers()) // per_row)
        return list(gen_even_slices(n_rows, max(1, -(-n_rows // size)))) if n_rows else []

    def _sub_blocks(self, n, row_bytes=0, pairs=1):
        """Consecutive slices of at most ``_block_size(pairs)`` rows (fewer for large
        rows): the passes and the sides of one product, aligned from row 0 so that
        two sides of the same rows share their boundaries."""
        size = rows_per_tile(self._block_size(pairs), row_bytes)
        return [slice(begin, min(begin + size, n)) for begin in range(0, n, size)]

    def _block_size(self, pairs=1):
        """Rows per pass and per side of a product.

        ``tile_size`` on the host (blocks whose Grams stay small next to the
        caches). On a GPU, as many rows as an eighth of the working budget holds
        in a product's three square temporaries (input Gram, delta Gram, their
        product; ``pairs`` values per pair of rows), so that each product keeps
        the device busy.
        """
        if self.device.type != "cuda":
            return self.tile_size
        budget = working_budget(self.device, self._n_workers())
        return max(self.tile_size, math.isqrt(budget // (8 * 3 * 8 * pairs)))

    def _factors_of(self, start, X):
        """Training-copy factors of every row of ``X`` (every output) at ``start``,
        computed in passes of ``_pass_rows()`` rows and joined per layer."""
        parts = [self.probe.factors(start, X[rows]) for rows in self._passes(X.shape[0])]
        if len(parts) == 1:
            return parts[0]
        return [type(layer[0]).cat(layer) for layer in zip(*parts, strict=True)]

    def _block_rows(self, kind, P, Q, steps, mode, prefix=False):
        """The block of ``P`` x ``Q`` over ``steps``; ``prefix``: ``P`` is ``Q``'s
        first rows (a tile of a symmetric Gram)."""
        if kind == "discrete":
            return self._training_block(P, Q, steps, mode, prefix)
        n_outputs = (self.n_outputs,) * 2 if mode == "pairs" else ()
        block = torch.zeros((P.shape[0], Q.shape[0]) + n_outputs, dtype=P.dtype, device=P.device)
        q_tiles = self._tiles(Q.shape[0])
        for step in range(steps.start, steps.stop):
            start, metric = self._step(step)[0], self._metric(step)
            right = None
            if kind == "mixed":  # once per step, for all of Q; Q's first tile shares its passes
                pairs = 1 if mode == "trace" else self.n_outputs**2
                features, right = self._test_features(
                    step, P, outputs_per_pair=pairs, with_rows=(Q[q_tiles[0]], None)
                )
                if metric is not None:  # P_s phi_s, once for every tile of Q
                    features = features.scaled(metric)
            for tile in q_tiles:
                if kind == "test":
                    block[:, tile] += self._test_test(step, P, Q[tile], mode, metric)
                    continue
                if right is None or tile is not q_tiles[0]:
                    right = self._factors_of(start, Q[tile])
                features.add_inner(right, mode, block[:, tile])
        return block.cpu().numpy()

    def _training_block(self, P, Q, steps, mode, prefix):
        """Training x training block, step-major.

        Per step, the factors of ``Q`` (and of ``P``, unless it is ``Q``'s
        prefix) are computed once, in passes of ``tile_size`` rows; the block is
        then accumulated in products of ``tile_size`` x ``tile_size`` rows. With
        ``prefix``, products below the diagonal are not computed but mirrored.
        On a preconditioned path products get fewer rows (about 60 for an MLP
        64-128-128-10): the rules' ``metric_inner`` either materialises both
        sides or holds (units, rows, rows) temporaries, which are fastest while
        they stay in cache (for that MLP, blocks of 256 or 512 rows were slower).
        """
        n_outputs = (self.n_outputs,) * 2 if mode == "pairs" else ()
        block = torch.zeros((P.shape[0], Q.shape[0]) + n_outputs, dtype=P.dtype, device=P.device)
        preconditioned = self.path.update.preconditioners is not None
        row_bytes = 16 * self.n_outputs * self.path.n_weights if preconditioned else 0
        pairs = self.n_outputs**2 if mode == "pairs" else 1
        p_blocks = self._sub_blocks(P.shape[0], row_bytes, pairs)
        q_blocks = self._sub_blocks(Q.shape[0], row_bytes, pairs)
        products = [(a, b) for a in p_blocks for b in q_blocks if not prefix or b.start >= a.start]
        for step in range(steps.start, steps.stop):
            start = self._at(step)
            metric = self._metric(step)
            right = self._factors_of(start, Q)
            left = None if prefix else self._factors_of(start, P)
            if mode == "trace" and metric is None:
                right, left = self._in_output_subspaces(right, left, P.shape[0])
            if prefix:
                left = [f.take(slice(0, P.shape[0])) for f in right]
            for a, b in products:
                block[a, b] += self._inner(
                    [f.take(a) for f in left], [f.take(b) for f in right], mode, metric
                )
        if prefix:  # the diagonal square's lower products, from the upper ones
            for a, b in ((a, b) for a in p_blocks for b in q_blocks if b.start < a.start):
                block[a, b] = _swap(block[b, a], mode)
        return block.cpu().numpy()

    def _in_output_subspaces(self, right, left, n_left):
        """Factors of both sides projected, per rule, onto the right rows' output
        subspace where the rule finds one (``left`` None: the left rows are a
        prefix of the right ones). Trace products are unchanged, with fewer
        outputs: two per unit for the last two layers of a classifier."""
        lefts = [[] for _ in right] if left is None else [[f] for f in left]
        pairs = [
            in_output_subspace(rule, r, ls, n_left)
            for rule, r, ls in zip(self.probe.rules, right, lefts, strict=True)
        ]
        projected_right = [r for r, _ in pairs]
        return projected_right, None if left is None else [ls[0] for _, ls in pairs]

    def _test_test(self, step, A, B, mode, metric=None):
        """``sum_q nu_q <g(a; w_s(t_q)), P_s g(b; w_s(t_q))>``, nodes shared by all rows."""
        start, direction = self._step(step)
        t, nu = self._shared_nodes(step, torch.cat([A, B]))
        n_nodes = len(t)
        times = self._as_device_tensor(t)

        def at_nodes(X):  # rows ordered node-major: entry q * n + i
            return self.probe.factors(
                start,
                X.repeat(n_nodes, *([1] * (X.ndim - 1))),
                direction=direction,
                t=times.repeat_interleave(X.shape[0]),
            )

        left, right = at_nodes(A), at_nodes(B)
        total = 0.0
        for q in range(n_nodes):
            rows_a = slice(q * A.shape[0], (q + 1) * A.shape[0])
            rows_b = slice(q * B.shape[0], (q + 1) * B.shape[0])
            node_left = [f.take(rows_a) for f in left]
            node_right = [f.take(rows_b) for f in right]
            if mode == "trace" and metric is None:  # both sides at the same weights
                node_right, node_left = self._in_output_subspaces(
                    node_right, node_left, A.shape[0]
                )
            total = total + nu[q] * self._inner(node_left, node_right, mode, metric)
        return total

    def _shared_nodes(self, step, X):
        if self.quadrature != "exact":
            return fixed_rule(self.quadrature, self.n_points)
        start, direction = self._step(step)
        return shared_exact_nodes(self.probe, start, direction, X, TEST_TEST_NODES * self.n_nodes)

    def diag(self, A, *, a_train=False):
        """``np.diag(gram(A, a_train=a_train))`` without the off-diagonal work."""
        mask = _as_mask(a_train, A.shape[0])
        A = A.to(self.device)
        tiles = self._query_tiles(A.shape[0], 0, TEST_TEST_NODES * self.n_nodes)
        keys = [(tile, steps) for tile in tiles for steps in self._steps_chunks()]
        results = self._run(
            [(self._diag_block, A[tile], mask[tile], steps) for tile, steps in keys]
        )
        diag = np.zeros(A.shape[0])
        for (tile, _), block in zip(keys, results, strict=True):
            diag[tile] += block
        return diag

    def _diag_block(self, A, mask, steps):
        diag = torch.zeros(A.shape[0], dtype=A.dtype, device=A.device)
        train, test = (self._as_device_tensor(np.flatnonzero(m)) for m in (mask, ~mask))
        for step in range(steps.start, steps.stop):
            metric = self._metric(step)
            if train.numel():
                factors = self.probe.factors(self._at(step), A[train])
                diag[train] += self._inner(factors, factors, "diag", metric)
            if test.numel():
                part = torch.zeros(test.numel(), dtype=A.dtype, device=A.device)
                # Same rule as the test x test Gram: products of two gradients
                # need more nodes.
                features = self._test_features(
                    step, A[test], n_nodes=TEST_TEST_NODES * self.n_nodes
                )
                for rows, weights, factors in features.nodes:
                    part.index_add_(
                        0, rows, weights * self._inner(factors, factors, "diag", metric)
                    )
                diag[test] += part
        return diag.cpu().numpy()
