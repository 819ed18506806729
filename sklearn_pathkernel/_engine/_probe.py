"""Evaluate a module at any point of the weight path, capturing per-layer factors.

One forward pass with hooks on the layers that own parameters, then one batched
backward pass over the requested outputs, gives every layer's input ``a`` and
back-propagated gradient ``delta`` at once; the layer rules turn them into
factors (see ``rules``).

The probe works on its own deep copy of the module (made once, at
construction): its hooks and the per-row forwards it puts in place of some
layers' ``forward`` live on that copy only, and are removed before every
evaluation returns, so the module it was given (an estimator's ``module_``)
is never touched and may be used from other threads meanwhile. The probe
itself serves one thread at a time: while it evaluates, its hooks act on every
pass through its copy, so a second thread's pass would take the first one's
hooks (and give it its own: a moved-output term added twice is a wrong output
and no error). A second thread that asks while another evaluates is refused
with a ``RuntimeError``; each thread has a probe of its own
(:class:`~._steps.ThreadProbes`).

The hooks see a layer's parameters only through that layer's own call. A network
that uses a parameter any other way (a layer called twice, weights tied across
modules, a parameter used in a parent's ``forward`` or outside its layer, a layer
returning a tuple) would get wrong or failing per-layer factors; a dry-run
forward pass finds these, and the probe then differentiates the whole network
at once instead (:class:`~sklearn_pathkernel._engine.rules._jacobian.JacobianRule`).

Query rows evaluated at many points of one step (``rows=``: the kink search, the
quadrature nodes) take the first parameterised layer's output, when it is linear in
its weights, from two products per step and query row (:class:`StepQueries`):
along a step its input is fixed and its output affine in ``t``.
"""

import contextlib
import copy
import functools
import logging
import threading

import torch
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call

from .._path import (
    differentiable_statistics,
    dropout_layers,
    log_softmax,
    masks_applied,
    output_cotangent,
    take_rows,
)
from ._folded_backward import LayerShortcut, folded_grad
from ._hazards import per_layer_hazards
from .rules import make_rule
from .rules._gradients import Gradients
from .rules._jacobian import JacobianRule
from .rules._protocol import PooledCotangent, RowEvaluation, RowWeights

logger = logging.getLogger(__name__)

#: Guards every probe's claim (``NetworkProbe._user``): held for a few operations only.
_CLAIMS = threading.Lock()


def _one_thread_at_a_time(method):
    """A :class:`NetworkProbe` method that installs hooks on its module or runs it:
    the calling thread claims the probe for the call (:meth:`NetworkProbe._claimed`)."""

    @functools.wraps(method)
    def claimed(self, *args, **kwargs):
        with self._claimed():
            return method(self, *args, **kwargs)

    return claimed


class NetworkProbe:
    """The network ``f_w(x) = link(module_w(x))`` at arbitrary flat weights ``w``.

    Parameters
    ----------
    module : torch.nn.Module
        The network, deep-copied once: the probe evaluates its copy. Its own
        values are used only for parameters outside the path (frozen ones,
        constants) and for one dry-run forward pass; the module itself is never
        changed, patched or hooked.
    path : WeightPath
        Gives the parameter names and shapes of a flat weight vector.
    example : torch.Tensor of shape (n, ...) or None, default=None
        Input rows for the dry run that decides between per-layer rules and the
        whole-network :class:`~sklearn_pathkernel._engine.rules._jacobian.JacobianRule`
        (one row is enough). ``None`` runs it on the first row the probe
        evaluates.
    force_jacobian : bool, default=False
        Use the ``JacobianRule`` whatever the dry run finds (for tests and
        benchmarks of the fallback).
    link : callable, default=log_softmax
        ``f`` from the module's output (see ``_losses``): the log-softmax of the
        classifiers, the identity of the regressors.

    Attributes
    ----------
    module : torch.nn.Module
        The probe's own copy of the network.
    rules : list of LayerRule
        The per-layer rules, or the single ``JacobianRule``.
    layers : list of torch.nn.Module
        The layer of each per-layer rule (empty with the ``JacobianRule``).
    fallback_reason : str or None
        Why the per-layer rules cannot be used, when they are not (also logged
        at debug level); None when they are.
    per_row_t : bool
        Whether one pass can hold rows at different points of a step.
    affine_first_layer : bool
        Whether query rows evaluated along a step (``rows=`` given) take the
        first layer's output from its two per-step products (see
        :class:`StepQueries`; True). False evaluates that layer at every point
        (the same values up to rounding; for comparisons).
    folded_backward : bool
        Whether the backward pass over every output of a row (``K`` cotangents)
        runs with the cotangents folded into the rows (:func:`~._folded_backward.folded_grad`,
        True) where the graph allows; False, or a graph it cannot fold, takes
        ``torch.autograd.grad(..., is_grads_batched=True)`` (the same values up to
        rounding; for comparisons).
    row_kernels : bool
        Whether a layer linear in its weights, rows at their own points of a step,
        is evaluated at each row's own weights in one operation where its rule
        gives one (``LinearInWeights.row_output``: a convolution's grouped
        convolution, True); False: its output at the step's start plus ``t_i``
        times its moved output (two operations; the same values up to rounding;
        for comparisons).
    """

    affine_first_layer = True
    folded_backward = True
    row_kernels = True

    def __init__(self, module, path, example=None, *, force_jacobian=False, link=log_softmax):
        self._user = (None, 0)  # (the thread evaluating, its nested calls): _claimed
        module = copy.deepcopy(module)
        for _, layer in dropout_layers(module):  # the query side: dropout is the identity
            layer.eval()
        # BatchNorm trained in training mode (the path holds its running statistics):
        # the training side is the batch's pass in training mode, on a copy of its own;
        # the query side is the eval-mode network at the path's statistics.
        self.batch_coupled = path.running_statistics is not None
        self._training_module = None
        if self.batch_coupled:
            names = path.running_statistics.names
            if list(path.param_names[-len(names) :]) != list(names):
                raise ValueError(
                    "A path with BatchNorm's running statistics must be widened first "
                    "(with_running_statistics): the probe differentiates them as weights."
                )
            module.eval()
            self._training_module = copy.deepcopy(module)
            training = set(path.running_statistics.training_layers)
            for name, layer in self._training_module.named_modules():
                if name in training:  # (dropout stays in eval mode: its masks are applied)
                    layer.train()
            differentiable_statistics(module)
        self.module = module
        self.path = path
        self.link = link
        self._unflattened = []  # the last few (flat, version, params)
        self._step_queries = []  # the last few (keys, StepQueries or None)
        # functional_call unties tied weights on every call unless told there are none
        self._tied = len(list(module.named_parameters(remove_duplicate=False))) > len(
            list(module.named_parameters())
        )
        names = set(path.param_names)
        self.layers, self.rules = [], []
        for prefix, submodule in module.named_modules():
            rule = make_rule(submodule, f"{prefix}." if prefix else "", names)
            if rule is not None:
                self.layers.append(submodule)
                self.rules.append(rule)
        self.jacobian, self.fallback_reason = None, None
        self._unchecked = not (force_jacobian or self.batch_coupled)
        if self.batch_coupled:
            self._use_jacobian(
                "BatchNorm trained in training mode: its running statistics are coordinates "
                "of the path and the training rows are coupled through the batch"
            )
        elif force_jacobian:
            self._use_jacobian("forced (force_jacobian=True)")
        elif example is not None:
            self._check(example)
        self.per_row_t = self.jacobian is None and all(
            rule.row_evaluation is not RowEvaluation.NONE for rule in self.rules
        )
        self._input_reaches_first_layer_alone = _input_reaches_first_alone(module, self.layers)

    @contextlib.contextmanager
    def _claimed(self):
        """The probe for the calling thread alone while the block runs (re-entrant):
        the hooks and patched forwards of an evaluation act on every pass through
        the probe's module, whichever thread runs it, so another thread's
        evaluation meanwhile would be wrong (silently, for the moved-output terms
        of per-row points). A second thread is refused: ``RuntimeError``."""
        me = threading.get_ident()
        with _CLAIMS:
            holder, depth = self._user
            if depth and holder != me:
                raise RuntimeError(
                    "A network probe is evaluated by two threads at once: its forward hooks "
                    "would act on both threads' passes and give wrong factors or outputs. "
                    "Each thread needs a probe of its own (ThreadProbes.current())."
                )
            self._user = (me, depth + 1)
        try:
            yield
        finally:
            with _CLAIMS:
                self._user = (me, self._user[1] - 1)

    @_one_thread_at_a_time
    def _check(self, example):
        """The dry run: keep the per-layer rules, or switch to the ``JacobianRule``."""
        self._unchecked = False
        reasons = per_layer_hazards(self.module, set(self.path.param_names), self.layers, example)
        if reasons:
            self._use_jacobian("; ".join(reasons))

    def _ensure_checked(self, X):
        if self._unchecked and X.shape[0]:
            self._check(X[:1])
            self.per_row_t = self.per_row_t and self.jacobian is None

    def _use_jacobian(self, reason):
        self.fallback_reason = reason
        self.jacobian = JacobianRule(self.module, self.path, tie_weights=self._tied, link=self.link)
        self.layers, self.rules = [], [self.jacobian]
        logger.debug(
            "%s: per-sample Jacobians of the whole network instead of per-layer rules: %s",
            type(self.module).__name__,
            reason,
        )

    def __getstate__(self):
        # The caches of the last evaluations are not pickled: they hold the
        # tensors of whole batches of nodes (hundreds of MB shipped to every dask
        # worker with the task's owner otherwise).
        state = self.__dict__.copy()
        state["_unflattened"], state["_step_queries"] = [], []
        state["_user"] = (None, 0)  # (no thread of the unpickled copy evaluates it)
        return state

    def params(self, flat):
        """``path.unflatten(flat)``, remembered for the last few vectors: a step's
        start and direction are unflattened at every evaluation."""
        for cached, version, params in self._unflattened:
            if cached is flat and version == flat._version:
                return params
        params = self.path.unflatten(flat)
        self._unflattened = [(flat, flat._version, params), *self._unflattened[:3]]
        return params

    @_one_thread_at_a_time
    def _forward(self, start, X, direction=None, t=None, hook=None, logits=False, along=None):
        """``link(module(X))`` with row ``i`` at weights ``start + t_i direction``.

        ``t`` is None (weights ``start``), a float, or a tensor with one value per
        row; per-row values need every layer to support them (``self.per_row_t``):
        a layer linear in its parameters has at ``w + t dw`` its output at ``w``
        plus ``t`` times its "moved" output (the layer applied with ``dw``); any
        other layer's rule computes its output at per-row weights (``output_at``),
        in place of the layer's own forward.
        ``hook(index, inputs, output) -> output`` sees each parameterised layer.
        ``logits=True`` returns ``module(X)`` without the link.
        ``along`` (an :class:`AlongStep`, with a per-row ``t``): the first
        ``along.rows.numel()`` rows of ``X`` are those query rows, whose first
        layer's output comes from the step's :class:`StepQueries`.
        """
        self._ensure_checked(X)
        if t is not None and not isinstance(t, torch.Tensor):
            start, t = start + t * direction, None
        if t is not None and t.dtype != start.dtype:  # float64 nodes, a float32 path
            t = t.to(start.dtype)
        if t is not None and not self.per_row_t:
            raise ValueError("A per-row t needs every layer to take one (per_row_t); use per_row.")
        params = self.params(start)
        weights = None if t is None else RowWeights(params, self.params(direction), t)
        with _layers_patched(self.rules, self.layers, weights, hook, along, self.row_kernels):
            out = functional_call(self.module, params, (X,), tie_weights=self._tied)
        return out if logits else self.link(out)

    def per_row(self, fn, start, X, direction, t, rows=None):
        """Apply ``fn(start, X, direction, t)`` with per-row ``t``, falling back to one
        call per distinct ``t`` when some layer is not linear in its parameters.

        ``fn`` returns an object with ``take(rows)`` and a ``cat`` classmethod-like
        helper given as ``fn.cat``; ``fn.reads_inputs`` says whether it keeps the
        layers' inputs (see :meth:`_query_rows`). ``rows`` (a tensor of indices): ``X`` is the
        step's query rows and the rows evaluated are ``X[rows]``, their first
        layer from the step's :class:`StepQueries` where it applies
        (:meth:`along`).
        """
        along = self.along(start, direction, X, rows, t)
        if rows is not None:
            X = self._query_rows(X, rows, along, fn.reads_inputs)
        self._ensure_checked(X)
        if along is not None:
            return fn(start, X, direction, t, along=along)
        if t is None or not isinstance(t, torch.Tensor) or self.per_row_t:
            return fn(start, X, direction, t)
        values, inverse = torch.unique(t, return_inverse=True)
        parts, order = [], []
        for j, value in enumerate(values):
            rows = torch.nonzero(inverse == j).squeeze(1)
            parts.append(fn(start, X[rows], direction, float(value), rows=rows))
            order.append(rows)
        order = torch.cat(order)
        return fn.cat(parts).take(torch.argsort(order))

    def _query_rows(self, X, rows, along, reads_inputs):
        """``X[rows]``, or, where no value of it is read, a view of its shape
        without the copy (``X``'s first row repeated): the evaluation keeps no
        layer's inputs (``reads_inputs`` False: outputs and switching values,
        not factors), the first layer's output comes from the step's
        :class:`StepQueries` (``along``) and the module is a plain
        ``nn.Sequential`` whose first module is that layer (its input goes
        nowhere else). The kink search's and the certificate's passes gathered
        about 4 MiB of query rows per pass for the MNIST MLP, unread."""
        if (
            along is not None
            and not reads_inputs
            and self._input_reaches_first_layer_alone
            and along.queries.index == 0
        ):
            return X[:1].expand(len(rows), *X.shape[1:])
        return _take_rows(X, rows)

    def output(self, start, X, direction=None, t=None, *, rows=None):
        """``f_w(X)``, shape (n, K), without gradients (weights as in ``_forward``;
        ``rows`` as in :meth:`per_row`)."""
        return self.output_with_scale(start, X, direction, t, rows=rows)[0]

    def output_with_scale(self, start, X, direction=None, t=None, *, rows=None):
        """``f_w(X)`` (n, K) and, per row, the largest absolute logit (n,): ``f`` is
        computed to about ``eps`` times it (a saturated softmax can have small
        log-probabilities from huge logits)."""
        with torch.no_grad():
            result = self.per_row(_Output(self), start, X, direction, t, rows)
        return result.value, result.scale

    def logits(self, start, X, direction=None, t=None, *, rows=None):
        """``module(X)`` (n, K), the logits before the link, without gradients
        (weights as in ``_forward``; ``rows`` as in :meth:`per_row`)."""
        with torch.no_grad():
            return self.per_row(_Output(self), start, X, direction, t, rows).logits

    def along(self, start, direction, X, rows, t):
        """The query rows ``X[rows]`` at per-row points ``t`` of the step
        ``start + t direction``, as an :class:`AlongStep` when their first layer
        can come from the step's :class:`StepQueries`, else None."""
        if (
            rows is None
            or direction is None
            or not isinstance(t, torch.Tensor)
            or not self.affine_first_layer
        ):
            return None
        self._ensure_checked(X)
        if not self.per_row_t:
            return None
        queries = self.step_queries(start, direction, X)
        return None if queries is None else AlongStep(queries, rows)

    def step_queries(self, start, direction, X):
        """The :class:`StepQueries` of the rows ``X`` on the step ``start + t
        direction`` (remembered for the last few steps and query sets), or None
        where the first layer called is not linear in its weights."""
        keys = tuple((v, v._version) for v in (start, direction, X))
        for cached, queries in self._step_queries:
            if all(a is b and va == vb for (a, va), (b, vb) in zip(cached, keys, strict=True)):
                return queries
        queries = self._first_layer(start, direction, X)
        self._step_queries = [(keys, queries), *self._step_queries[:1]]
        return queries

    @_one_thread_at_a_time
    def _first_layer(self, start, direction, X):
        """The first parameterised layer called, at ``start`` and moved by
        ``direction``, on the rows of ``X`` (:class:`StepQueries`)."""
        seen = []

        def stop_at(index):
            def run(layer, inputs, output):
                seen.append((index, inputs, output))
                raise _FirstLayerSeen

            return run

        handles = [
            layer.register_forward_hook(stop_at(index)) for index, layer in enumerate(self.layers)
        ]
        try:
            with torch.no_grad():
                functional_call(self.module, self.params(start), (X,), tie_weights=self._tied)
        except _FirstLayerSeen:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if not seen:
            return None
        index, inputs, output = seen[0]
        rule = self.rules[index]
        if rule.row_evaluation is not RowEvaluation.MOVED_OUTPUT:
            return None
        with torch.no_grad():
            moved = rule.moved_output(inputs, self.params(direction))
        return StepQueries(index, output, moved)

    def cotangent_row_bytes(self, start, X, one_output=False):
        """Bytes per row of ``X`` of what a backward pass of :meth:`factors` holds at
        the parameterised layers' outputs (their gradients, all returned at once):
        those outputs' bytes times the cotangents each row carries (every output,
        or one with ``one_output``), from one forward pass without gradients at
        ``start``. Zero without per-layer rules (the Jacobian rule's per-example
        gradients are its factors). An upper bound where the folded backward
        pass gives a min-pool's winners (a ``PooledCotangent``, a quarter of a
        2x2 pool's input): they count at full resolution."""
        held = [0]

        def count(index, inputs, output):
            held[0] += output.nbytes
            return output

        with torch.no_grad():
            logits = self._forward(start, X, hook=count, logits=True)
        cotangents = 1 if one_output else logits.shape[1]
        return held[0] * cotangents // max(1, X.shape[0])

    def factors(
        self, start, X, outputs=None, *, direction=None, t=None, cotangents=None, rows=None
    ):
        """Per-layer factors of the per-example gradients (see
        :meth:`output_and_factors`), one per layer rule."""
        return self.output_and_factors(
            start, X, outputs, direction=direction, t=t, cotangents=cotangents, rows=rows
        )[1]

    @_one_thread_at_a_time
    def training_factors(self, start, X, outputs, masks):
        """:meth:`factors` of training rows at a step's start with the step's
        dropout masks applied (``masks``: layer name to the rows' masks, or None
        without dropout); the rows are those the masks were drawn for, in order.

        With the per-layer rules the batch takes one pass, as without masks. With
        the whole-network Jacobian rule every row takes a pass of its own (its
        mask cannot ride along a ``vmap`` over rows): the same numbers, one
        Python-level call per training row and step.
        """
        self._ensure_checked(X)  # (the dry run, on one row, without the masks)
        if self.batch_coupled:
            return [self._batch_gradients(start, X, outputs, masks)]
        if not masks or self.jacobian is None:
            with masks_applied(self.module, masks):
                return self.factors(start, X, outputs)
        parts = []
        for i in range(X.shape[0]):
            with masks_applied(self.module, take_rows(masks, slice(i, i + 1))):
                parts.append(self.factors(start, X[i : i + 1], outputs[i : i + 1])[0])
        return [type(parts[0]).cat(parts)]

    def _batch_gradients(self, start, X, outputs, masks):
        """Per-row gradients of a batch through its BatchNorm statistics: row ``i``'s
        ``grad_w sum_k outputs[i, k] f_k(x_i; w, B)``, ``f`` the batch's pass in
        training mode (each row's output depends on the whole batch ``X``), as
        :class:`Gradients` (n, 1, W + R), zero on the statistics' coordinates
        (training mode does not read them). One forward pass and one backward pass
        per row (batched where ``torch`` can)."""
        stats = self.path.running_statistics
        n_weights = self.path.n_weights - stats.n_statistics
        n_params = len(self.path.param_names) - len(stats.names)
        w = start[:n_weights].detach().clone().requires_grad_(True)
        weights = dict(
            zip(
                self.path.param_names[:n_params],
                _split(w, self.path.param_shapes[:n_params]),
                strict=True,
            )
        )
        # The module's buffers with the step's statistics, copies: training mode
        # moves them (the pass's output does not depend on them).
        buffers = {n: b.detach().clone() for n, b in self._training_module.named_buffers()}
        buffers.update(
            {
                name: value.detach().clone()
                for name, value in zip(
                    stats.names,
                    _split(start[n_weights:], self.path.param_shapes[n_params:]),
                    strict=True,
                )
            }
        )
        with torch.enable_grad(), masks_applied(self._training_module, masks):
            out = functional_call(
                self._training_module, {**buffers, **weights}, (X,), tie_weights=self._tied
            )
            f = self.link(out)
            per_row = (f * output_cotangent(outputs, f.shape[1], f.dtype)).sum(1)
            eye = torch.eye(X.shape[0], dtype=X.dtype, device=X.device)
            try:
                (grads,) = torch.autograd.grad(
                    per_row, w, grad_outputs=eye, is_grads_batched=True, retain_graph=True
                )
            except RuntimeError:  # a batching rule torch lacks: row by row
                grads = torch.stack(
                    [
                        torch.autograd.grad(per_row[i], w, retain_graph=True)[0]
                        for i in range(X.shape[0])
                    ]
                )
        flat = grads.new_zeros((X.shape[0], 1, self.path.n_weights))
        flat[:, 0, :n_weights] = grads
        return Gradients(flat)

    @_one_thread_at_a_time
    def output_and_factors(
        self, start, X, outputs=None, *, direction=None, t=None, cotangents=None, rows=None
    ):
        """``f`` of the rows and the per-layer factors of their per-example gradients.

        Parameters
        ----------
        start : torch.Tensor of shape (W,)
        X : torch.Tensor of shape (n, ...)
        outputs : torch.Tensor of shape (n,) or (n, K), or None
            ``None`` keeps every output ``k`` (deltas of shape (n, K, ...)); a
            class code per row keeps that output only, a cotangent per row the
            gradient of ``sum_k outputs[i, k] f_k`` (both of shape (n, 1, ...)).
        direction, t : torch.Tensor or None
            Row ``i`` is evaluated at ``start + t_i direction`` (see ``_forward``).
        cotangents : torch.Tensor of shape (n, K, K) or None
            With ``outputs`` None: row ``i``'s ``k``-th gradient is that of
            ``sum_j cotangents[i, k, j] z_j``, the logits ``z`` weighted instead
            of ``f`` (see ``integration/_link_weights.py``). Needs per-layer rules.
        rows : torch.Tensor of indices or None
            The rows evaluated are ``X[rows]`` (see :meth:`per_row`).

        Returns
        -------
        output : torch.Tensor of shape (n, K)
        factors : list of Factors, one per layer rule.
        """
        if rows is not None and self.jacobian is not None:
            X, rows = X[rows], None
        self._ensure_checked(X)
        if self.jacobian is not None and cotangents is not None:
            raise ValueError("Cotangents at the logits need per-layer rules, not the JacobianRule.")
        if self.jacobian is not None:
            # One vmap over the rows, each at its own weights: no pass per distinct t.
            output, factors = self.jacobian.evaluate(X, start, outputs, direction=direction, t=t)
            return output, [factors]
        result = self.per_row(_FactorsAt(self, outputs, cotangents), start, X, direction, t, rows)
        return result.output, result.factors

    def factors_with(
        self, start, X, X_start, outputs_start=None, *, direction, t, cotangents=None,
        node_outputs=None, rows=None,
    ):  # fmt: skip
        """``factors(start, X, direction=direction, t=t)`` and ``factors(start,
        X_start, outputs_start)`` from one forward and one backward pass.

        The rows of ``X_start`` sit at the step's start (``t = 0``). Every output
        is back-propagated for all rows (``outputs_start`` then keeps one per row),
        so one pass instead of two pays when ``X_start`` is small next to ``X`` or
        needs every output anyway. Needs ``per_row_t``. ``cotangents`` (one per
        row of ``X``) as in :meth:`output_and_factors`.

        Where the rows of ``X`` take one cotangent each (a scalar target per
        query: ``cotangents`` (n, 1, K) at the logits, or ``node_outputs`` (n, K)
        on ``f``) and ``outputs_start`` one per row too, the backward pass
        carries one cotangent per row for all of them, not ``K``.

        ``rows`` (indices): the rows of ``X`` evaluated are ``X[rows]`` (see
        :meth:`per_row`).

        Returns
        -------
        factors, start_factors : lists of factors, one per layer rule.
        """
        along = self.along(start, direction, X, rows, t)
        if rows is not None:
            X = _take_rows(X, rows)
        self._ensure_checked(X)
        if not self.per_row_t:
            raise ValueError("factors_with needs every layer to take a per-row t.")
        n = X.shape[0]
        X_all = torch.cat([X, X_start])
        t_all = torch.cat([t, t.new_zeros(X_start.shape[0])])
        _, (factors, start_factors) = self._factors(
            start,
            X_all,
            None,
            direction,
            t_all,
            split=(n, outputs_start),
            cotangents=cotangents,
            node_outputs=node_outputs,
            along=along,
        )
        return factors, start_factors

    def _factors(
        self, start, X, outputs, direction, t, split=None, cotangents=None, node_outputs=None,
        along=None,
    ):  # fmt: skip
        # ``split=(n, picked)``: rows from n on get their own factors, with every
        # output or, per row, the output ``picked`` (see ``factors_with``).
        # ``cotangents`` (n_c, K, K): the first n_c rows back-propagate these
        # at the logits instead of every output of f (``output_and_factors``).
        # Rules of layers not linear in their weights (``output_at``) get the
        # step's start, its direction and t per row, also when all rows share one
        # t: every factor of a step then refers to the same weights.
        # (_no_grad keeps the caller's tensor, so that its unflattened parameters
        # are reused across the evaluations of a step.)
        start = _no_grad(start)
        base, base_direction = start, direction
        row_t = None
        if t is not None:
            row_t = torch.as_tensor(t, dtype=start.dtype, device=start.device).expand(X.shape[0])
        if t is not None and not torch.is_tensor(t):
            start, t = start + t * direction, None  # one point for all rows
        captured = [None] * len(self.layers)
        input_edges = [None] * len(self.layers)  # where each layer's input joins the graph

        def capture(index, inputs, output):
            if captured[index] is not None:
                raise NotImplementedError(
                    f"The layer {type(self.layers[index]).__name__} is called more than "
                    "once per forward pass (shared weights); the path kernel engine "
                    "supports layers applied once per sample."
                )
            if not output.requires_grad:
                # Weights enter as constants: the first layer's output starts the
                # graph of everything downstream (no graph through the weights).
                output = output.detach().requires_grad_(True)
            captured[index] = (tuple(x.detach() for x in inputs if torch.is_tensor(x)), output)
            if inputs and torch.is_tensor(inputs[0]) and inputs[0].requires_grad:
                input_edges[index] = get_gradient_edge(inputs[0])
            # Hand a copy downstream, so that an in-place activation cannot
            # overwrite the tensor whose gradient we take.
            return output.clone()

        with torch.enable_grad():
            logits = self._forward(start, X, direction, t, hook=capture, logits=True, along=along)
            output = self.link(logits)
        outs = [out for _, out in captured]
        single = (
            split is not None
            and split[1] is not None
            and (node_outputs is not None or (cotangents is not None and cotangents.shape[1] == 1))
        )
        if single:  # one cotangent per row, nodes and start rows alike
            roots, cotangent = _single_roots(logits, output, split, cotangents, node_outputs)
        else:
            roots, cotangent = _backward_roots(logits, output, outputs, cotangents)
        batched = outputs is None and not single
        grads = None
        if batched and self.folded_backward:
            shortcuts = self._shortcuts(captured, input_edges, start, direction, t, along)
            pooled = [i for i, rule in enumerate(self.rules) if rule.takes_pooled_cotangents]
            grads = folded_grad(roots, outs, cotangent, shortcuts, pooled)
        if grads is None:
            grads = torch.autograd.grad(
                roots, outs, cotangent, allow_unused=True, is_grads_batched=batched
            )
        point = RowWeights(self.params(start))
        row_weights = None
        if split is None:
            parts = [(slice(None), None)]
        else:
            picked = None if single else split[1]
            parts = [(slice(0, split[0]), None), (slice(split[0], None), picked)]
        factors = [[] for _ in parts]
        n_batched = None  # the backward pass's cotangents per row: K, K' or one
        if batched:
            n_batched = output.shape[1] if cotangents is None else cotangents.shape[1]
        for rule, (inputs, out), grad in zip(self.rules, captured, grads, strict=True):
            delta = _layer_cotangents(out, grad, n_batched)
            at_own_t = rule.row_evaluation is RowEvaluation.OUTPUT_AT
            if at_own_t and row_weights is None:
                row_steps = None if row_t is None else self.params(base_direction)
                row_weights = RowWeights(self.params(base), row_steps, row_t)
            for part_factors, (rows, picked) in zip(factors, parts, strict=True):
                part_inputs = tuple(x[rows] for x in inputs)
                part_delta = _delta_part(delta, rows, picked)
                at = row_weights.rows(rows) if at_own_t else point
                part_factors.append(rule.factors(part_inputs, part_delta, at))
        if split is None:
            return output.detach(), factors[0]
        return output[: split[0]].detach(), factors

    def _shortcuts(self, captured, input_edges, start, direction, t, along):
        """The layers the folded backward pass takes through their rule's
        ``input_vjp`` (rows at per-row weights, ``t`` a tensor): those evaluated
        at the rows' own weights in this pass (linear in their weights with a
        moved output added, not the first layer of query rows along their step;
        or by their rule's ``output_at``) whose rule gives one."""
        if t is None or not torch.is_tensor(t) or direction is None:
            return ()
        first = None if along is None else along.queries.index
        weights = RowWeights(self.params(start), self.params(direction), t)
        shortcuts = []
        for index, (rule, (inputs, out)) in enumerate(zip(self.rules, captured, strict=True)):
            if (
                index == first
                or input_edges[index] is None  # (no gradient goes past it)
                or rule.row_evaluation not in (RowEvaluation.MOVED_OUTPUT, RowEvaluation.OUTPUT_AT)
            ):
                continue
            vjp = rule.input_vjp(inputs, weights)
            if vjp is not None:
                shortcuts.append(LayerShortcut(out, input_edges[index], vjp))
        return shortcuts


def _backward_roots(logits, output, outputs, cotangents):
    """What the backward pass differentiates, and its cotangents.

    ``outputs`` None: every output of every row, batched (cotangent ``k``
    back-propagating output ``k``), the first ``cotangents.shape[0]`` rows from
    the logits with their ``cotangents`` (n_c, K, K) when given. Else one
    cotangent per row on ``f`` (:func:`output_cotangent`).
    """
    if outputs is not None:
        return [output], [output_cotangent(outputs, output.shape[1], output.dtype)]
    n_outputs = output.shape[1]
    eye = torch.eye(n_outputs, dtype=output.dtype, device=output.device)
    if cotangents is None:
        return [output], [eye[:, None, :].expand(n_outputs, *output.shape)]
    n = cotangents.shape[0]
    if n < output.shape[0] and cotangents.shape[1] != n_outputs:
        raise ValueError("Rows with every output join only nodes with K cotangents each.")
    roots, grads = [logits[:n]], [cotangents.to(logits.dtype).transpose(0, 1)]
    if n < output.shape[0]:
        roots.append(output[n:])
        grads.append(eye[:, None, :].expand(n_outputs, output.shape[0] - n, n_outputs))
    return roots, grads


def _single_roots(logits, output, split, cotangents, node_outputs):
    """One cotangent per row: the first ``split[0]`` rows' at the logits
    (``cotangents`` (n, 1, K)) or on ``f`` (``node_outputs`` (n, K)), the others'
    on ``f`` (``split[1]``, as :func:`output_cotangent` takes it)."""
    n, picked = split
    n_outputs, dtype = output.shape[1], output.dtype
    if node_outputs is not None:
        first = (output[:n], output_cotangent(node_outputs, n_outputs, dtype))
    else:
        first = (logits[:n], cotangents[:, 0].to(logits.dtype))
    second = (output[n:], output_cotangent(picked, n_outputs, dtype))
    return [first[0], second[0]], [first[1], second[1]]


def _layer_cotangents(out, grad, n_outputs):
    """A layer's cotangents (n, K, ...) from the batched backward pass over every
    output (``grad`` (K, n, ...), ``n_outputs`` K), or (n, 1, ...) from a single
    one (``n_outputs`` None); zeros where the output does not reach ``f``; a
    :class:`PooledCotangent` (rows first already) as the folded pass gave it."""
    if isinstance(grad, PooledCotangent):
        return grad
    if n_outputs is not None:  # (K, n, ...) -> (n, K, ...)
        delta = out.new_zeros((n_outputs, *out.shape)) if grad is None else grad
        return delta.transpose(0, 1)
    return (torch.zeros_like(out) if grad is None else grad).unsqueeze(1)


def _delta_part(delta, rows, picked):
    """The cotangents (n, K, ...) of some rows, with ``picked`` (None: all K)
    applied as :func:`_picked` does; a pooled one's values only (its winners do
    not depend on the cotangent)."""
    if isinstance(delta, PooledCotangent):
        part = delta.rows(rows)
        return part if picked is None else part.with_values(_picked(part.values, picked))
    return delta[rows] if picked is None else _picked(delta[rows], picked)


def _picked(delta, picked):
    """(n, K, ...) -> (n, 1, ...): per row, the output ``picked`` (a class code) or
    the cotangent ``picked`` (n, K) applied to the outputs."""
    weights = output_cotangent(picked, delta.shape[1], delta.dtype)
    weights = weights.view(*weights.shape, *([1] * (delta.ndim - 2)))
    return (delta * weights).sum(1, keepdim=True)


def _split(flat, shapes):
    """A flat vector as one view per shape."""
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return [
        chunk.view(shape) for chunk, shape in zip(torch.split(flat, sizes), shapes, strict=True)
    ]


def _input_reaches_first_alone(module, layers):
    """Whether the module's input is read by its first parameterised layer alone:
    a plain ``nn.Sequential`` (its own ``forward``, no pre-hooks) whose first
    module is ``layers[0]`` (without pre-hooks of its own)."""
    return (
        isinstance(module, torch.nn.Sequential)
        and type(module).forward is torch.nn.Sequential.forward
        and len(module) > 0
        and len(layers) > 0
        and module[0] is layers[0]
        and not module._forward_pre_hooks
        and not module[0]._forward_pre_hooks
    )


def _take_rows(X, rows):
    """``X[rows]`` for a tensor of row indices: ``index_select`` where it applies
    (the same rows, about twice as fast as advanced indexing on the host)."""
    if (
        isinstance(rows, torch.Tensor)
        and rows.ndim == 1
        and rows.dtype in (torch.int64, torch.int32)
        and rows.device == X.device
        and X.ndim > 0
    ):
        return X.index_select(0, rows)
    return X[rows]


def _no_grad(tensor):
    return tensor.detach() if tensor.requires_grad else tensor


@contextlib.contextmanager
def _layers_patched(rules, layers, weights, hook, along=None, row_kernels=True):
    """The probe's own layers set up for one forward pass, and restored after it
    whatever happens: with rows at per-row ``weights`` (a ``RowWeights``, or None),
    layers linear in their weights add ``t_i`` times their moved output (a forward
    hook), the others' forward is their rule's ``output_at``; with every row at the
    same weights, the layers whose rule ``replaces_own_forward`` run its
    ``own_output`` (their values, its backward pass); with ``along``
    (an :class:`AlongStep`) the first layer's forward is its step's products;
    ``hook(index, inputs, output) -> output`` sees each parameterised layer."""
    handles, replaced = [], []
    first = None if along is None else along.queries.index
    # per layer: whether its last call gave the rows' own outputs (``row_output``)
    own_rows = [False] * len(layers)

    def layer_hook(index):
        rule = rules[index]

        def run(layer, inputs, output):
            if (
                weights is not None
                and rule.row_evaluation is RowEvaluation.MOVED_OUTPUT
                and index != first
                and not own_rows[index]
            ):
                moved = rule.moved_output(inputs, weights.steps)
                output = output + weights.t.view(-1, *([1] * (output.ndim - 1))) * moved
            own_rows[index] = False
            return output if hook is None else hook(index, inputs, output)

        return run

    try:
        if hook is not None or weights is not None:
            for index, layer in enumerate(layers):
                handles.append(layer.register_forward_hook(layer_hook(index)))
        if weights is not None:
            for index, (rule, layer) in enumerate(zip(rules, layers, strict=True)):
                if rule.row_evaluation is RowEvaluation.OUTPUT_AT:
                    replaced.append(layer)
                    layer.forward = _forward_at(rule, weights)
                elif (
                    row_kernels
                    and rule.row_evaluation is RowEvaluation.MOVED_OUTPUT
                    and index != first
                ):
                    replaced.append(layer)
                    layer.forward = _forward_at_rows(layer, rule, weights, own_rows, index)
        else:  # every row at the same weights: the rules that replace the forward
            for index, layer in enumerate(layers):
                if rules[index].replaces_own_forward:
                    replaced.append(layer)
                    layer.forward = _own_forward(rules[index])
        if along is not None:
            layer = layers[first]
            replaced.append(layer)
            layer.forward = _forward_along(layer, along, weights.t)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for layer in replaced:
            vars(layer).pop("forward", None)


def _forward_at_rows(layer, rule, weights, own_rows, index):
    """A layer linear in its weights with row ``i`` at its own weights by its rule's
    ``row_output`` (noted in ``own_rows[index]``: the hook then adds no moved
    output), or, where the rule gives none, by the layer's own forward (the hook
    adds ``t_i`` times the moved output)."""
    own = type(layer).forward.__get__(layer)

    def forward(*inputs):
        out = rule.row_output(inputs, weights)
        if out is None:
            return own(*inputs)
        own_rows[index] = True
        return out

    return forward


def _forward_at(rule, weights):
    """A layer's forward with row ``i`` at its own ``weights`` (by its rule)."""

    def forward(*inputs):
        return rule.output_at(inputs, weights)

    return forward


def _own_forward(rule):
    """A layer's forward at its own weights by its rule (``rule.own_output``)."""

    def forward(*inputs):
        return rule.own_output(inputs)

    return forward


def _forward_along(layer, along, t):
    """The first layer's forward with its query rows from their step's products
    (:meth:`StepQueries.output`) and any rows after them at the step's start (``t``
    zero, :meth:`NetworkProbe.factors_with`) by the layer's own forward."""
    own = type(layer).forward.__get__(layer)
    n = along.rows.numel()

    def forward(*inputs):
        out = along.queries.output(along.rows, t[:n])
        if inputs[0].shape[0] > n:
            rest = own(*(x[n:] if torch.is_tensor(x) else x for x in inputs))
            out = torch.cat([out, rest])
        return out

    return forward


class _FirstLayerSeen(Exception):
    """Stops the forward pass of :meth:`NetworkProbe._first_layer`."""


class StepQueries:
    """Query rows on one step, with their first layer's output in two products.

    The first parameterised layer called sees an input that does not depend on
    the path's weights (the query itself, or a fixed function of it); when it is
    linear in its weights (``RowEvaluation.MOVED_OUTPUT``), its output at ``w_s +
    t dw_s`` is exactly ``z_s + t dz_s``, with ``z_s`` its output at the step's
    start and ``dz_s`` the layer applied with the step's change: two products per
    step and query row instead of two per evaluated point. (The per-point route
    computes the same sum, from products over other batches of rows: the values
    differ by rounding only. A ReLU after it switches at ``t = -z_s / dz_s``.)

    Parameters
    ----------
    index : int
        The layer's position among the probe's rules.
    start_output, moved_output : torch.Tensor of shape (n, ...)
        ``z_s`` and ``dz_s`` of every query row.
    """

    def __init__(self, index, start_output, moved_output):
        self.index, self.start_output, self.moved_output = index, start_output, moved_output

    def output(self, rows, t):
        """``z_s + t dz_s`` of the query rows ``rows``, row ``i`` at ``t[i]``."""
        t = t.to(self.start_output.dtype).view(-1, *([1] * (self.start_output.ndim - 1)))
        out = _take_rows(self.moved_output, rows)
        if out.data_ptr() == self.moved_output.data_ptr():  # (a view: not ours to write)
            out = out.clone()
        # ``z_s + t dz_s`` in the rows' own copy (the same sums, bit for bit): the
        # first layer's outputs of a pass are its largest tensor (pieces x 16 x 26
        # x 26 numbers for the 28x28 CNN), each temporary a few MB
        return out.mul_(t).add_(_take_rows(self.start_output, rows))


class AlongStep:
    """Query rows ``rows`` of a step's :class:`StepQueries`, as one pass evaluates them."""

    def __init__(self, queries, rows):
        self.queries = queries
        self.rows = torch.as_tensor(rows, device=queries.start_output.device)


class _Output:
    """``per_row`` adapter for plain evaluations (the output ``f`` and the logit scale)."""

    reads_inputs = False  # (no layer's inputs kept: see NetworkProbe._query_rows)

    def __init__(self, probe, value=None, scale=None, logits=None):
        self.probe, self.value, self.scale, self.logits = probe, value, scale, logits

    def __call__(self, start, X, direction, t, rows=None, along=None):
        logits = self.probe._forward(start, X, direction, t, logits=True, along=along)
        return _Output(self.probe, self.probe.link(logits), logits.abs().amax(1), logits)

    def cat(self, parts):
        return _Output(
            self.probe,
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("value", "scale", "logits")),
        )

    def take(self, rows):
        return _Output(self.probe, self.value[rows], self.scale[rows], self.logits[rows])


class _FactorsAt:
    """``per_row`` adapter for factor evaluations."""

    reads_inputs = True  # (every layer's inputs are its factors)

    def __init__(self, probe, outputs, cotangents=None, output=None, factors=None):
        self.probe, self.outputs, self.cotangents = probe, outputs, cotangents
        self.output, self.factors = output, factors

    def __call__(self, start, X, direction, t, rows=None, along=None):
        outputs, cotangents = (
            (self.outputs, self.cotangents)
            if rows is None
            else tuple(None if v is None else v[rows] for v in (self.outputs, self.cotangents))
        )
        output, factors = self.probe._factors(
            start, X, outputs, direction, t, cotangents=cotangents, along=along
        )
        return _FactorsAt(self.probe, self.outputs, self.cotangents, output, factors)

    def cat(self, parts):
        factors = [
            type(parts[0].factors[i]).cat([p.factors[i] for p in parts])
            for i in range(len(parts[0].factors))
        ]
        return _FactorsAt(
            self.probe,
            self.outputs,
            self.cotangents,
            torch.cat([p.output for p in parts]),
            factors,
        )

    def take(self, rows):
        return _FactorsAt(
            self.probe,
            self.outputs,
            self.cotangents,
            self.output[rows],
            [f.take(rows) for f in self.factors],
        )
