"""Per-layer rules: inner products of per-example gradients without Jacobians.

For a layer with parameters ``theta`` and input ``a``, the per-example gradient of
an output ``f_k`` is a function of ``a`` and of ``delta_k = d f_k / d(layer output)``
only. Each rule turns the captured ``(a, delta)`` of a batch into *factors* and
computes inner products between the factors of two batches:

- Linear: ``<g_i, g_j> = (a_i . a_j + 1) (delta_i . delta_j)`` (the ``+1`` is the
  bias), never forming the ``d_out x d_in`` gradient.
- Conv2d: the per-example weight gradient ``delta @ unfold(a)^T`` is formed per
  layer (it is small: one kernel's worth of weights), then contracted.
- Anything else with parameters: per-example gradients by ``torch.func``
  (``vmap`` of ``grad``), then contracted.

Factors hold ``delta`` for several outputs at once: shape (n, n_outputs, ...).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap


class Factors:
    """Per-layer factors of a batch: either ``(inputs, deltas)`` or materialised grads."""

    __slots__ = ("inputs", "deltas", "grads")

    def __init__(self, inputs=None, deltas=None, grads=None):
        self.inputs, self.deltas, self.grads = inputs, deltas, grads

    @staticmethod
    def cat(parts):
        """Stack the rows of several Factors of the same layer."""
        fields = zip(*((p.inputs, p.deltas, p.grads) for p in parts), strict=True)
        return Factors(*(None if f[0] is None else torch.cat(f) for f in fields))

    def take(self, rows):
        """The factors of a subset of rows."""
        return Factors(
            *(None if f is None else f[rows] for f in (self.inputs, self.deltas, self.grads))
        )


def _flat_direction(direction, names):
    return torch.cat([direction[name].reshape(-1) for name in names if name is not None])


def _contract(left, right, mode):
    """Inner products over the last axis of (n, K1, W) and (m, K2, W) tensors.

    ``mode="trace"`` sums matching outputs (K1 == K2) -> (n, m); ``"pairs"`` keeps
    every output pair -> (n, m, K1, K2); ``"diag"`` pairs row i with row i of the
    same batch and sums outputs -> (n,).
    """
    if mode == "trace":
        return left.reshape(left.shape[0], -1) @ right.reshape(right.shape[0], -1).T
    if mode == "pairs":
        return torch.einsum("nkw,mjw->nmkj", left, right)
    return (left * right).sum(dim=(1, 2))


class LinearRule:
    """``nn.Linear`` on 2-D input: factored form, cost O(n m (d_in + K d_out))."""

    def __init__(self, module, weight_name, bias_name):
        self.module = module
        self.weight_name, self.bias_name = weight_name, bias_name

    def zero_weight(self):
        return torch.zeros_like(self.module.weight)

    def moved_output(self, inputs, steps):
        """The layer applied with the weight change ``steps`` (it is linear in them)."""
        weight = steps[self.weight_name] if self.weight_name else None
        bias = steps[self.bias_name] if self.bias_name else None
        if weight is None:
            return torch.zeros_like(F.linear(inputs[0], self.zero_weight())) + bias
        return F.linear(inputs[0], weight, bias)

    def factors(self, inputs, delta, params):
        a = inputs[0]
        if a.ndim == 2:
            return Factors(inputs=a, deltas=delta)
        # Applied along extra axes (sequence, pixels): sum the outer products.
        parts = []
        if self.weight_name is not None:
            parts.append(torch.einsum("nk...o,n...i->nkoi", delta, a).flatten(2))
        if self.bias_name is not None:
            parts.append(delta.flatten(2, -2).sum(2))
        return Factors(grads=torch.cat(parts, dim=2))

    def inner(self, left, right, mode):
        if left.grads is not None:
            return _contract(left.grads, right.grads, mode)
        if mode == "diag":
            input_gram = (left.inputs * right.inputs).sum(1)
        else:
            input_gram = left.inputs @ right.inputs.T
        if self.weight_name is None:
            input_gram = torch.zeros_like(input_gram)
        if self.bias_name is not None:
            input_gram = input_gram + 1.0
        delta_gram = _contract(left.deltas, right.deltas, mode)
        if mode == "pairs":
            return input_gram[:, :, None, None] * delta_gram
        return input_gram * delta_gram

    def directional(self, factors, direction):
        """``<g_k(x), direction>`` per row and output: (n, K)."""
        if factors.grads is not None:
            step = _flat_direction(direction, (self.weight_name, self.bias_name))
            return factors.grads @ step
        moved = torch.zeros(factors.deltas.shape[::2], dtype=factors.deltas.dtype)
        if self.weight_name is not None:
            moved = factors.inputs @ direction[self.weight_name].T
        if self.bias_name is not None:
            moved = moved + direction[self.bias_name]
        return torch.einsum("nko,no->nk", factors.deltas, moved)


class Conv2dRule:
    """``nn.Conv2d``: per-example weight gradients from the unfolded input (im2col)."""

    def __init__(self, module, weight_name, bias_name):
        self.module = module
        self.weight_name, self.bias_name = weight_name, bias_name

    def moved_output(self, inputs, steps):
        """The convolution applied with the weight change ``steps`` (it is linear in them)."""
        conv = self.module
        weight = steps[self.weight_name] if self.weight_name else torch.zeros_like(conv.weight)
        bias = steps[self.bias_name] if self.bias_name else None
        return F.conv2d(inputs[0], weight, bias, conv.stride, conv.padding, conv.dilation)

    def factors(self, inputs, delta, params):
        conv = self.module
        # delta: (n, K, C_out, H_out, W_out) -> (n, K, C_out, P)
        delta = delta.flatten(3)
        parts = []
        if self.weight_name is not None:
            patches = F.unfold(
                inputs[0], conv.kernel_size, conv.dilation, conv.padding, conv.stride
            )  # (n, C_in * kh * kw, P)
            parts.append(torch.einsum("nkop,nip->nkoi", delta, patches).flatten(2))
        if self.bias_name is not None:
            parts.append(delta.sum(-1))
        return Factors(grads=torch.cat(parts, dim=2))

    def inner(self, left, right, mode):
        return _contract(left.grads, right.grads, mode)

    def directional(self, factors, direction):
        return factors.grads @ _flat_direction(direction, (self.weight_name, self.bias_name))


class GenericRule:
    """Any module with parameters: per-example gradients via ``torch.func``.

    Only the module's own (direct) parameters are differentiated; the forward
    must treat batch rows independently.
    """

    def __init__(self, module, local_names, path_names):
        self.module = module
        self.local_names = local_names  # names inside the module
        self.path_names = path_names  # the same parameters' names in the path

    def factors(self, inputs, delta, params):
        module, names = self.module, self.local_names
        theta = {
            name: params[full].detach() for name, full in zip(names, self.path_names, strict=False)
        }
        constants = {
            name: value.detach()
            for name, value in module.named_parameters(recurse=False)
            if name not in theta
        }

        def output_dot(theta, args, cotangent):
            batched = tuple(arg.unsqueeze(0) for arg in args)
            out = functional_call(module, {**constants, **theta}, batched)
            return (out.squeeze(0) * cotangent).sum()

        # One vmap over (example, output) pairs. (A nested vmap over the outputs,
        # with unbatched inputs, hits wrong batching rules, e.g. for cdist.)
        n, k = delta.shape[:2]
        pairs = tuple(arg.repeat_interleave(k, dim=0) for arg in inputs)
        per_pair = vmap(grad(output_dot), in_dims=(None, 0, 0))
        grads = per_pair(theta, pairs, delta.reshape(n * k, *delta.shape[2:]))
        return Factors(grads=torch.cat([grads[name].reshape(n, k, -1) for name in names], 2))

    def inner(self, left, right, mode):
        return _contract(left.grads, right.grads, mode)

    def directional(self, factors, direction):
        return factors.grads @ _flat_direction(direction, self.path_names)


def make_rule(module, prefix, path_names):
    """The rule for ``module``'s direct parameters that are part of the path, or None."""
    local = [name for name, _ in module.named_parameters(recurse=False)]
    in_path = [name for name in local if f"{prefix}{name}" in path_names]
    if not in_path:
        return None
    full = {name: f"{prefix}{name}" for name in in_path}
    exact_type = type(module)
    if exact_type in (nn.Linear, nn.Conv2d) and set(local) <= {"weight", "bias"}:
        rule = LinearRule if exact_type is nn.Linear else Conv2dRule
        supported = exact_type is nn.Linear or (
            module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
        if supported:
            return rule(module, full.get("weight"), full.get("bias"))
    return GenericRule(module, in_path, [full[name] for name in in_path])
