"""The fallback rule: any module with parameters, per-example gradients by ``torch.func``.

For a module ``z = h(a; theta)`` and cotangents ``delta_k``, the per-example
gradient ``g_k = d (delta_k . h(a; theta)) / d theta`` is formed by one
``vmap`` of ``grad`` over (row, output) pairs and kept materialised
(:class:`~sklearn_pathkernel._engine.rules._gradients.Gradients`): ``n K W``
numbers and about one backward pass of the module per pair; inner products are
contractions, ``O(n m K W)``.
"""

import torch
from torch.func import functional_call, grad, vmap

from ._gradients import Gradients, MaterialisedRule
from ._protocol import RowEvaluation
from ._registry import register_fallback


@register_fallback
class GenericRule(MaterialisedRule):
    """Any module with parameters: per-example gradients via ``torch.func``.

    Only the module's own (direct) parameters are differentiated; the forward
    must treat batch rows independently. Used for modules without a registered
    rule (see ``_registry``).

    Parameters
    ----------
    module : torch.nn.Module
    local_names : list of str
        The module's parameters in the path, by their names in the module.
    path_names : list of str
        The same parameters' names in the path.
    """

    # No per-row form: its factors re-run the module at one set of weights.
    row_evaluation = RowEvaluation.NONE

    def __init__(self, module, local_names, path_names):
        self.module = module
        self.local_names = local_names  # names inside the module
        self.path_names = path_names  # the same parameters' names in the path

    @classmethod
    def for_module(cls, module, names):
        return cls(module, list(names), list(names.values()))

    def factors(self, inputs, delta, weights):
        """The gradients (n, K, W_layer), the rows at ``weights.params``."""
        module, names, params = self.module, self.local_names, weights.params
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
        return Gradients(torch.cat([grads[name].reshape(n, k, -1) for name in names], 2))
