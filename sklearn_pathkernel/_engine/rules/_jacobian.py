"""The whole network as one rule: materialised per-sample Jacobians by ``torch.func``.

The per-layer rules (``_linear``, ``_conv``, ``_distance``, ``_generic``) read
each layer's input and back-propagated gradient from hooks on the layers that
own parameters. That is right only when every such layer is called once per
forward pass, returns a tensor, and is the only place its parameters are used.
When a network breaks one of these (a layer applied twice, weights tied across
modules, a parameter used in a parent's ``forward``, ``nn.MultiheadAttention``...),
the probe uses this rule instead: it needs nothing of the network but that a
sample's output depends only on that sample and the parameters.

For row ``x`` at flat path weights ``w``, the rule forms the Jacobian of
``f(x; w) = link(module_w(x[None]))[0]`` with respect to ``w``: ``jacrev``
of a ``functional_call`` of the whole module on one sample, ``vmap``-ed over the
rows. Parameters outside the path (frozen ones) keep the module's own values.
"""

import logging

import torch
from torch.func import functional_call, grad, jacrev, vmap

from ..._path import log_softmax, output_cotangent
from .._planning import BLOCK_BUDGET_BYTES, check_fits, rows_per_tile
from ._gradients import Gradients, MaterialisedRule
from ._protocol import RowEvaluation, RowWeights

# Bytes per Jacobian entry held while a tile is evaluated (an estimate): the
# result, jacrev's vector-Jacobian products before they are stacked into it, and
# about as much again for per-row weights and the vmapped activations.
_BYTES_PER_ENTRY = 3 * 8

logger = logging.getLogger(__name__)


class JacobianRule(MaterialisedRule):
    """Every trainable parameter of a network at once, by per-sample Jacobians.

    Factors are the materialised Jacobians, :class:`Gradients` (n, K, W) in path
    order (``W`` the number of weights in the path); inner products are matrix
    products of them.

    Cost: ``n K W`` numbers of memory per batch of ``n`` rows (the factored
    per-layer rules hold ``n`` times the layers' widths instead), and about ``K``
    backward passes per row (one with ``outputs``), each through a one-row
    forward pass, batched over the rows by ``vmap``. Rows are evaluated in tiles
    that keep the intermediate vector-Jacobian products within
    ``BLOCK_BUDGET_BYTES``. A forward pass that ``vmap`` cannot batch
    (data-dependent control flow, ``.item()``) is evaluated row by row instead:
    the same numbers, one Python-level pass per row (``vmap_failure`` says why).

    Parameters
    ----------
    module : torch.nn.Module
        The network; its own parameter values are used only for parameters
        outside the path.
    path : WeightPath
        Names and shapes of the flat weights (the trainable parameters).
    tie_weights : bool, default=False
        Whether the module has tied parameters (one tensor under two names):
        ``functional_call`` then substitutes the path's value for every name.
    budget : int or None, default=None
        Bytes of Jacobian per tile; ``None`` means ``BLOCK_BUDGET_BYTES``.
    """

    # The probe's own forward passes (kink search, outputs) run the
    # whole module at one scalar t per pass; ``factors`` takes per-row t itself.
    # Not registered for any module type: the probe chooses it for the whole
    # network (see ``per_layer_hazards``).
    row_evaluation = RowEvaluation.NONE

    def __init__(self, module, path, *, tie_weights=False, budget=None, link=log_softmax):
        self.module = module
        self.link = link
        self.path = path
        self.path_names = list(path.param_names)
        self.tie_weights = tie_weights
        self.budget = BLOCK_BUDGET_BYTES if budget is None else budget
        # Why vmap over rows failed on this module (then rows go one by one), or None.
        self.vmap_failure = None

    def _output(self, flat, x):
        """``link(module(x))`` of one sample at flat path weights, (K,)."""
        out = functional_call(
            self.module, self.path.unflatten(flat), (x[None],), tie_weights=self.tie_weights
        )
        return self.link(out)[0]

    def evaluate(self, X, start, outputs=None, *, direction=None, t=None):
        """``f`` and the Jacobians of the rows of ``X`` at flat path weights (the
        probe's call): :meth:`output_and_factors` with the rows' weights and
        cotangents formed from the arguments below.

        Parameters
        ----------
        X : torch.Tensor of shape (n, ...)
        start : torch.Tensor of shape (W,)
            Flat path weights.
        outputs : torch.Tensor of shape (n,) or (n, K), or None
            ``None`` differentiates every output (grads (n, K, W)); a class code
            or a cotangent per row differentiates that output, or ``sum_k
            outputs[i, k] f_k``, only (grads (n, 1, W)).
        direction : torch.Tensor of shape (W,) or None
        t : float, torch.Tensor of shape (n,) or None
            Row ``i`` is evaluated at ``start + t_i direction`` (all rows at
            ``start`` when ``t`` is None; a scalar ``t`` moves ``start``, as the
            probe's forward pass does).

        Returns
        -------
        output : torch.Tensor of shape (n, K)
        factors : Gradients
        """
        start, unflatten = start.detach(), self.path.unflatten
        if torch.is_tensor(t) and t.ndim > 0:
            weights = RowWeights(unflatten(start), unflatten(direction.detach()), t)
        elif t is not None:
            weights = RowWeights(unflatten(start + float(t) * direction.detach()))
        else:
            weights = RowWeights(unflatten(start))
        n_outputs = self.n_outputs(X, weights)
        if outputs is None:  # every output: the identity cotangents on f
            eye = torch.eye(n_outputs, dtype=X.dtype, device=X.device)
            delta = eye.expand(X.shape[0], n_outputs, n_outputs)
        else:
            delta = output_cotangent(outputs, n_outputs, X.dtype)[:, None]
        return self.output_and_factors((X,), delta, weights)

    def n_outputs(self, X, weights):
        """``K``, the number of outputs of ``f``, from one row of ``X`` (one
        forward pass of one row, without gradients)."""
        row = X[0] if X.shape[0] else X.new_zeros(X.shape[1:])
        with torch.no_grad():
            return self._output(self.flatten(weights.params).detach(), row).shape[0]

    def factors(self, inputs, delta, weights):
        """The per-sample Jacobians of the rows (see :meth:`output_and_factors`)."""
        return self.output_and_factors(inputs, delta, weights)[1]

    def output_and_factors(self, inputs, delta, weights):
        """``f`` of the rows of ``X`` and their per-sample Jacobians.

        Parameters
        ----------
        inputs : tuple of one torch.Tensor of shape (n, ...)
            The network's input rows ``X``.
        delta : torch.Tensor of shape (n, K', K)
            Per row, the cotangents on ``f`` to differentiate: the identity
            (every output: ``jacrev``, about K backward passes per row), or one
            cotangent per row (K' = 1: a class code's one-hot, an output
            gradient; one backward pass per row), or any K' cotangents (the
            Jacobian contracted with them).
        weights : RowWeights
            Row ``i`` at ``params + t_i steps`` (all rows at ``params`` without
            ``t``). Per-row weights are formed tile by tile, so one call
            evaluates every node of a step.

        Returns
        -------
        output : torch.Tensor of shape (n, K)
        factors : Gradients
            The Jacobians (n, K', W), in path order.
        """
        X = inputs[0]
        start = self.flatten(weights.params).detach()
        per_row = weights.moving
        direction = self.flatten(weights.steps).detach() if per_row else None
        (n, kept, n_outputs), n_weights = delta.shape, start.shape[0]
        if n == 0:
            return X.new_zeros((0, n_outputs)), Gradients(X.new_zeros((0, kept, n_weights)))
        every = kept == n_outputs and torch.equal(
            delta, torch.eye(n_outputs, dtype=delta.dtype, device=delta.device).expand_as(delta)
        )
        # The result is materialised whole: refuse clearly rather than swap.
        check_fits(
            8 * n * kept * n_weights,
            f"Per-sample Jacobians of {n} rows x {kept} outputs x {n_weights} weights "
            "(the whole-network fallback)",
            "evaluate fewer rows at a time (the engine's tile_size, the training batch "
            "size), or use a network whose parameterised layers are each called once per "
            "forward pass (see the probe's fallback_reason).",
        )
        row_bytes = _BYTES_PER_ENTRY * (n_outputs if not every and kept > 1 else kept)
        size = rows_per_tile(n, row_bytes * max(n_weights, 1), self.budget)
        output, grads = [], []
        for begin in range(0, n, size):
            rows = slice(begin, begin + size)
            tile_weights = start
            if per_row:
                t_rows = weights.t[rows].to(start.dtype)
                tile_weights = start + t_rows[:, None] * direction[None]
            picked = None if every else delta[rows]
            values, jacobians = self._tile(X[rows], tile_weights, picked, per_row)
            output.append(values)
            grads.append(jacobians)
        return torch.cat(output), Gradients(torch.cat(grads))

    def _tile(self, X, weights, cotangents, per_row):
        """``(output, grads)`` of a tile: ``vmap`` over its rows, or a loop over
        them once ``vmap`` has failed on this module. ``cotangents`` (n, K', K)
        or None for every output."""
        # Each row: its output f (aux) and the Jacobian of every output,
        # or the gradient of its one cotangent (one backward pass, not K).
        if cotangents is None or cotangents.shape[1] > 1:

            def one_row(flat, x):
                values = self._output(flat, x)
                return values, values.detach()

            per_row_fn, args = jacrev(one_row, has_aux=True), (weights, X)
        else:

            def one_output(flat, x, cotangent):
                values = self._output(flat, x)
                return (values * cotangent).sum(), values.detach()

            per_row_fn, args = grad(one_output, has_aux=True), (weights, X, cotangents[:, 0])
        in_dims = (0 if per_row else None, *([0] * (len(args) - 1)))
        if self.vmap_failure is None:
            try:
                jacobians, output = vmap(per_row_fn, in_dims=in_dims)(*args)
                return output, _selected(jacobians, cotangents)
            except RuntimeError as error:
                # E.g. data-dependent control flow or .item() in the forward pass,
                # which vmap cannot batch: the same computation, row by row.
                self.vmap_failure = str(error).splitlines()[0]
                logger.debug("JacobianRule: vmap failed, rows one by one: %s", error)
        rows = []
        for i in range(X.shape[0]):
            row_args = [
                arg if dim is None else arg[i] for arg, dim in zip(args, in_dims, strict=True)
            ]
            rows.append(per_row_fn(*row_args))
        jacobians = torch.stack([row[0] for row in rows])
        output = torch.stack([row[1] for row in rows])
        return output, _selected(jacobians, cotangents)


def _selected(jacobians, cotangents):
    """(n, K', W): the Jacobians (n, K, W) of every output, contracted with
    ``cotangents`` (n, K', K) when there are several; a single cotangent's
    gradients (n, W) get their output axis back."""
    if cotangents is None:
        return jacobians
    if cotangents.shape[1] == 1:
        return jacobians.unsqueeze(1)
    return torch.bmm(cotangents, jacobians)
