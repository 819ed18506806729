"""Evaluate a module at any point of the weight path, capturing per-layer factors.

One forward pass with hooks on the layers that own parameters, then one batched
backward pass over the requested outputs, gives every layer's input ``a`` and
back-propagated gradient ``delta`` at once; the layer rules turn them into
factors (see ``rules``).

The probe works on its own deep copy of the module (made once, at
construction): its hooks and the per-row forwards it puts in place of some
layers' ``forward`` live on that copy only, and are removed before every
evaluation returns, so the module it was given (an estimator's ``module_``)
is never touched and may be used from other threads meanwhile.

The hooks see a layer's parameters only through that layer's own call. A network
that uses a parameter any other way (a layer called twice, weights tied across
modules, a parameter used in a parent's ``forward`` or outside its layer, a layer
returning a tuple) would get wrong or failing per-layer factors; a dry-run
forward pass finds these, and the probe then differentiates the whole network
at once instead (:class:`~sklearn_pathkernel._engine.rules._jacobian.JacobianRule`).
"""

import copy
import logging

import torch
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from .._nested import nested_tensors
from .._training._losses import log_softmax, output_cotangent
from .rules import make_rule
from .rules._jacobian import JacobianRule
from .rules._protocol import RowEvaluation, RowWeights

logger = logging.getLogger(__name__)


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
    """

    def __init__(self, module, path, example=None, *, force_jacobian=False, link=log_softmax):
        module = copy.deepcopy(module)
        self.module = module
        self.path = path
        self.link = link
        self._unflattened = []  # the last few (flat, version, params)
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
        self._unchecked = not force_jacobian
        if force_jacobian:
            self._use_jacobian("forced (force_jacobian=True)")
        elif example is not None:
            self._check(example)
        self.per_row_t = self.jacobian is None and all(
            rule.row_evaluation is not RowEvaluation.NONE for rule in self.rules
        )

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

    def params(self, flat):
        """``path.unflatten(flat)``, remembered for the last few vectors: a step's
        start and direction are unflattened at every evaluation."""
        for cached, version, params in self._unflattened:
            if cached is flat and version == flat._version:
                return params
        params = self.path.unflatten(flat)
        self._unflattened = [(flat, flat._version, params), *self._unflattened[:3]]
        return params

    def _forward(self, start, X, direction=None, t=None, hook=None, logits=False):
        """``link(module(X))`` with row ``i`` at weights ``start + t_i direction``.

        ``t`` is None (weights ``start``), a float, or a tensor with one value per
        row; per-row values need every layer to support them (``self.per_row_t``):
        a layer linear in its parameters has at ``w + t dw`` its output at ``w``
        plus ``t`` times its "moved" output (the layer applied with ``dw``); any
        other layer's rule computes its output at per-row weights (``output_at``),
        in place of the layer's own forward.
        ``hook(index, inputs, output) -> output`` sees each parameterised layer.
        ``logits=True`` returns ``module(X)`` without the link.
        """
        self._ensure_checked(X)
        if t is not None and not isinstance(t, torch.Tensor):
            start, t = start + t * direction, None
        if t is not None and not self.per_row_t:
            raise ValueError("A per-row t needs every layer to take one (per_row_t); use per_row.")
        params = self.params(start)
        steps = None if t is None else self.params(direction)
        linear = RowEvaluation.MOVED_OUTPUT

        def layer_hook(index):
            def run(layer, inputs, output):
                if steps is not None and self.rules[index].row_evaluation is linear:
                    moved = self.rules[index].moved_output(inputs, steps)
                    output = output + t.view(-1, *([1] * (output.ndim - 1))) * moved
                return output if hook is None else hook(index, inputs, output)

            return run

        handles = []
        if hook is not None or t is not None:
            handles = [
                layer.register_forward_hook(layer_hook(index))
                for index, layer in enumerate(self.layers)
            ]
        replaced = []
        if steps is not None:
            for rule, layer in zip(self.rules, self.layers, strict=True):
                if rule.row_evaluation is RowEvaluation.OUTPUT_AT:
                    layer.forward = _forward_at(rule, RowWeights(params, steps, t))
                    replaced.append(layer)
        try:
            out = functional_call(self.module, params, (X,), tie_weights=self._tied)
            return out if logits else self.link(out)
        finally:
            for handle in handles:
                handle.remove()
            for layer in replaced:
                del layer.forward

    def per_row(self, fn, start, X, direction, t):
        """Apply ``fn(start, X, direction, t)`` with per-row ``t``, falling back to one
        call per distinct ``t`` when some layer is not linear in its parameters.

        ``fn`` returns an object with ``take(rows)`` and a ``cat`` classmethod-like
        helper given as ``fn.cat``.
        """
        self._ensure_checked(X)
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

    def output(self, start, X, direction=None, t=None):
        """``f_w(X)``, shape (n, K), without gradients (weights as in ``_forward``)."""
        return self.output_with_scale(start, X, direction, t)[0]

    def output_with_scale(self, start, X, direction=None, t=None):
        """``f_w(X)`` (n, K) and, per row, the largest absolute logit (n,): ``f`` is
        computed to about ``eps`` times it (a saturated softmax can have small
        log-probabilities from huge logits)."""
        with torch.no_grad():
            result = self.per_row(_LogProba(self), start, X, direction, t)
        return result.value, result.scale

    def factors(self, start, X, outputs=None, *, direction=None, t=None):
        """Per-layer factors of the per-example gradients (see
        :meth:`output_and_factors`), one per layer rule."""
        return self.output_and_factors(start, X, outputs, direction=direction, t=t)[1]

    def output_and_factors(self, start, X, outputs=None, *, direction=None, t=None):
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

        Returns
        -------
        log_proba : torch.Tensor of shape (n, K)
        factors : list of Factors, one per layer rule.
        """
        self._ensure_checked(X)
        if self.jacobian is not None:
            # One vmap over the rows, each at its own weights: no pass per distinct t.
            log_proba, factors = self.jacobian.evaluate(X, start, outputs, direction=direction, t=t)
            return log_proba, [factors]
        result = self.per_row(_FactorsAt(self, outputs), start, X, direction, t)
        return result.log_proba, result.factors

    def factors_with(self, start, X, X_start, outputs_start=None, *, direction, t):
        """``factors(start, X, direction=direction, t=t)`` and ``factors(start,
        X_start, outputs_start)`` from one forward and one backward pass.

        The rows of ``X_start`` sit at the step's start (``t = 0``). Every output
        is back-propagated for all rows (``outputs_start`` then keeps one per row),
        so one pass instead of two pays when ``X_start`` is small next to ``X`` or
        needs every output anyway. Needs ``per_row_t``.

        Returns
        -------
        factors, start_factors : lists of factors, one per layer rule.
        """
        self._ensure_checked(X)
        if not self.per_row_t:
            raise ValueError("factors_with needs every layer to take a per-row t.")
        n = X.shape[0]
        X_all = torch.cat([X, X_start])
        t_all = torch.cat([t, t.new_zeros(X_start.shape[0])])
        _, (factors, start_factors) = self._factors(
            start, X_all, None, direction, t_all, split=(n, outputs_start)
        )
        return factors, start_factors

    def _factors(self, start, X, outputs, direction, t, split=None):
        # ``split=(n, picked)``: rows from n on get their own factors, with every
        # output or, per row, the output ``picked`` (see ``factors_with``).
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
            # Hand a copy downstream, so that an in-place activation cannot
            # overwrite the tensor whose gradient we take.
            return output.clone()

        with torch.enable_grad():
            log_proba = self._forward(start, X, direction, t, hook=capture)
        outs = [out for _, out in captured]
        if outputs is None:
            # Every output of every row from one forward pass: a batched backward
            # pass, cotangent k back-propagating output k.
            n_outputs = log_proba.shape[1]
            eye = torch.eye(n_outputs, dtype=log_proba.dtype, device=log_proba.device)
            cotangent = eye[:, None, :].expand(n_outputs, *log_proba.shape)
        else:
            cotangent = output_cotangent(outputs, log_proba.shape[1], log_proba.dtype)
        grads = torch.autograd.grad(
            log_proba, outs, cotangent, allow_unused=True, is_grads_batched=outputs is None
        )
        point = RowWeights(self.params(start))
        row_weights = None
        if split is None:
            parts = [(slice(None), None)]
        else:
            parts = [(slice(0, split[0]), None), (slice(split[0], None), split[1])]
        factors = [[] for _ in parts]
        for rule, (inputs, out), grad in zip(self.rules, captured, grads, strict=True):
            if outputs is None:  # (K, n, ...) -> (n, K, ...)
                delta = out.new_zeros((n_outputs, *out.shape)) if grad is None else grad
                delta = delta.transpose(0, 1)
            else:
                delta = (torch.zeros_like(out) if grad is None else grad).unsqueeze(1)
            at_own_t = rule.row_evaluation is RowEvaluation.OUTPUT_AT
            if at_own_t and row_weights is None:
                row_steps = None if row_t is None else self.params(base_direction)
                row_weights = RowWeights(self.params(base), row_steps, row_t)
            for part_factors, (rows, picked) in zip(factors, parts, strict=True):
                part_inputs, part_delta = tuple(x[rows] for x in inputs), delta[rows]
                if picked is not None:  # (n, K, ...) -> (n, 1, ...)
                    weights = output_cotangent(picked, part_delta.shape[1], part_delta.dtype)
                    weights = weights.view(*weights.shape, *([1] * (part_delta.ndim - 2)))
                    part_delta = (part_delta * weights).sum(1, keepdim=True)
                at = row_weights.rows(rows) if at_own_t else point
                part_factors.append(rule.factors(part_inputs, part_delta, at))
        if split is None:
            return log_proba.detach(), factors[0]
        return log_proba[: split[0]].detach(), factors


def _no_grad(tensor):
    return tensor.detach() if tensor.requires_grad else tensor


def _forward_at(rule, weights):
    """A layer's forward with row ``i`` at its own ``weights`` (by its rule)."""

    def forward(*inputs):
        return rule.output_at(inputs, weights)

    return forward


class _LogProba:
    """``per_row`` adapter for plain evaluations (log-probabilities and logit scale)."""

    def __init__(self, probe, value=None, scale=None):
        self.probe, self.value, self.scale = probe, value, scale

    def __call__(self, start, X, direction, t, rows=None):
        logits = self.probe._forward(start, X, direction, t, logits=True)
        return _LogProba(self.probe, self.probe.link(logits), logits.abs().amax(1))

    def cat(self, parts):
        return _LogProba(
            self.probe, torch.cat([p.value for p in parts]), torch.cat([p.scale for p in parts])
        )

    def take(self, rows):
        return _LogProba(self.probe, self.value[rows], self.scale[rows])


class _FactorsAt:
    """``per_row`` adapter for factor evaluations."""

    def __init__(self, probe, outputs, log_proba=None, factors=None):
        self.probe, self.outputs = probe, outputs
        self.log_proba, self.factors = log_proba, factors

    def __call__(self, start, X, direction, t, rows=None):
        outputs = self.outputs if rows is None or self.outputs is None else self.outputs[rows]
        log_proba, factors = self.probe._factors(start, X, outputs, direction, t)
        return _FactorsAt(self.probe, self.outputs, log_proba, factors)

    def cat(self, parts):
        factors = [
            type(parts[0].factors[i]).cat([p.factors[i] for p in parts])
            for i in range(len(parts[0].factors))
        ]
        return _FactorsAt(
            self.probe, self.outputs, torch.cat([p.log_proba for p in parts]), factors
        )

    def take(self, rows):
        return _FactorsAt(
            self.probe, self.outputs, self.log_proba[rows], [f.take(rows) for f in self.factors]
        )


def _name(prefix, module):
    return f"{prefix or '<root>'} ({type(module).__name__})"


def per_layer_hazards(module, path_names, layers, example):
    """Why per-layer rules would be wrong for ``module``: a list of reasons, empty if none.

    The per-layer rules read each parameterised layer's input and output from
    hooks, once per forward pass, and assume its parameters enter the network
    only through that call. Checked statically: no path parameter is tied to
    another name, and no module has path parameters of its own next to
    parameterised children (its rule would re-run the children at the wrong
    weights). Checked by one forward pass on ``example`` (the module's own
    parameter values): every layer with a rule (``layers``) is called exactly
    once, with tensor positional arguments only, and returns a tensor; every
    use of a path parameter by a torch function happens inside its own
    module's forward (a layer never called, ``F.linear(x, self.fc.weight)``
    in a parent, or a parameter read by a sibling all break this).

    Parameters
    ----------
    module : torch.nn.Module
    path_names : set of str
        The path's (trainable) parameter names; other parameters are constants.
    layers : list of torch.nn.Module
        The modules that got a per-layer rule.
    example : torch.Tensor of shape (n, ...)

    Returns
    -------
    list of str
    """
    reasons = []
    by_tensor = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    tied = set()
    for key, names in by_tensor.items():
        if len(names) > 1 and any(name in path_names for name in names):
            reasons.append(f"tied parameters ({' is '.join(names)})")
            tied.add(key)

    owners, names_of = {}, {}
    for prefix, submodule in module.named_modules():
        dotted = f"{prefix}." if prefix else ""
        own = [
            (f"{dotted}{name}", param)
            for name, param in submodule.named_parameters(recurse=False)
            if f"{dotted}{name}" in path_names
        ]
        names_of[id(submodule)] = prefix
        for full, param in own:
            if id(param) not in tied:  # (its other uses are its tie, reported above)
                owners[id(param)] = (submodule, full)
        children_params = [
            f"{dotted}{name}"
            for child_name, child in submodule.named_children()
            for name, _ in child.named_parameters(prefix=child_name)
            if f"{dotted}{name}" in path_names
        ]
        if own and children_params:
            reasons.append(
                f"{_name(prefix, submodule)} uses parameters of its own "
                f"({', '.join(full for full, _ in own)}) next to parameterised children"
            )

    rule_layers = {id(layer): layer for layer in layers}
    calls = dict.fromkeys(rule_layers, 0)
    stack, found = [], []

    n_rows = example.shape[0]

    def before(layer, args, kwargs):
        stack.append(layer)
        # The rules see a layer's positional tensor inputs only (row-major).
        if id(layer) in rule_layers and (
            kwargs or not args or not all(torch.is_tensor(a) for a in args)
        ):
            found.append(
                f"{_name(names_of.get(id(layer)), layer)} is called with keyword, "
                "non-tensor or no arguments"
            )

    def after(layer, args, output):
        stack.pop()
        if id(layer) in rule_layers:
            calls[id(layer)] += 1
            name = _name(names_of.get(id(layer)), layer)
            if not torch.is_tensor(output):
                found.append(f"{name} returns a {type(output).__name__}, not a tensor")
            elif output.ndim == 0 or output.shape[0] != n_rows:
                # e.g. a parametrisation computing a weight: not one output per row
                found.append(f"{name} returns no row per input row")

    handles = []
    for submodule in module.modules():
        handles.append(submodule.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(submodule.register_forward_hook(after))
    uses = _ParameterUses(owners, stack)
    # A module in training mode may update buffers (running statistics) or draw
    # random numbers: the dry run leaves both as they were.
    buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]
    devices = [example.device] if example.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), uses:
            module(example)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    reasons += list(dict.fromkeys(found))
    for key, count in calls.items():
        if count != 1:
            layer = rule_layers[key]
            what = "never called" if count == 0 else f"called {count} times (shared weights)"
            reasons.append(f"{_name(names_of.get(key), layer)} is {what} per forward pass")
    for full, owner in uses.outside.items():
        reasons.append(
            f"{full} is used outside the forward of {_name(names_of.get(id(owner)), owner)}"
        )
    return reasons


class _ParameterUses(TorchFunctionMode):
    """Records path parameters that torch functions use outside their module's forward.

    ``owners`` maps ``id(parameter)`` to (owning module, path name); ``stack``
    is the list of modules whose forward is running (kept by hooks). Uses that
    produce no tensor (``.shape``, ``.size()``) are metadata, not computation.
    """

    def __init__(self, owners, stack):
        super().__init__()
        self.owners, self.stack = owners, stack
        self.outside = {}  # path name -> owning module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        used = [self.owners[id(x)] for x in nested_tensors((args, kwargs)) if id(x) in self.owners]
        if used and next(nested_tensors(result), None) is not None:
            for owner, full in used:
                if not any(running is owner for running in self.stack):
                    self.outside.setdefault(full, owner)
        return result
