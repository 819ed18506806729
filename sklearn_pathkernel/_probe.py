"""Evaluate a module at any point of the weight path, capturing per-layer factors.

One forward pass with hooks on the layers that own parameters, then one batched
backward pass over the requested outputs, gives every layer's input ``a`` and
back-propagated gradient ``delta`` at once; the layer rules turn them into
factors (see ``_layer_rules``).
"""

import torch
import torch.nn.functional as F
from torch.func import functional_call, jvp

from ._layer_rules import make_rule


class NetworkProbe:
    """The network ``f_w(x) = log_softmax(module_w(x))`` at arbitrary flat weights ``w``.

    Parameters
    ----------
    module : torch.nn.Module
        The network (its own parameter values are never used nor changed).
    path : WeightPath
        Gives the parameter names and shapes of a flat weight vector.
    """

    def __init__(self, module, path):
        self.module = module
        self.path = path
        names = set(path.param_names)
        self.layers, self.rules = [], []
        for prefix, submodule in module.named_modules():
            rule = make_rule(submodule, f"{prefix}." if prefix else "", names)
            if rule is not None:
                self.layers.append(submodule)
                self.rules.append(rule)
        self._n_outputs = None

    def _call(self, flat, X):
        return F.log_softmax(functional_call(self.module, self.path.unflatten(flat), (X,)), dim=1)

    def log_proba(self, flat, X):
        """``f_w(X)``, shape (n, K), without gradients."""
        with torch.no_grad():
            return self._call(flat, X)

    def log_proba_and_slope(self, flat, direction, X):
        """``f_w(X)`` and its derivative along ``direction`` (forward-mode AD)."""
        return jvp(lambda w: self._call(w, X), (flat,), (direction,))

    def factors(self, flat, X, outputs=None):
        """Per-layer factors of the per-example gradients at weights ``flat``.

        Parameters
        ----------
        flat : torch.Tensor of shape (W,)
        X : torch.Tensor of shape (n, ...)
        outputs : torch.Tensor of shape (n,) or None
            ``None`` keeps every output ``k`` (deltas of shape (n, K, ...)); an
            index per row keeps that output only (shape (n, 1, ...)).

        Returns
        -------
        log_proba : torch.Tensor of shape (n, K)
        factors : list of Factors, one per layer rule.
        """
        n = X.shape[0]
        if outputs is None:
            # Every output of every row in one backward pass: stack K copies of
            # the batch, copy k back-propagating output k.
            n_outputs = self.n_outputs(flat, X)
            X = X.repeat(n_outputs, *([1] * (X.ndim - 1)))
            chosen = torch.arange(n_outputs).repeat_interleave(n)
        else:
            chosen = outputs
        flat = flat.detach().requires_grad_(True)  # puts the layer outputs in the graph
        params = self.path.unflatten(flat)
        captured = [None] * len(self.layers)
        hooks = [
            layer.register_forward_hook(self._capture_hook(captured, index))
            for index, layer in enumerate(self.layers)
        ]
        try:
            with torch.enable_grad():
                log_proba = F.log_softmax(functional_call(self.module, params, (X,)), dim=1)
        finally:
            for hook in hooks:
                hook.remove()
        outs = [out for _, out in captured]
        cotangent = F.one_hot(chosen, log_proba.shape[1]).to(log_proba.dtype)
        grads = torch.autograd.grad(log_proba, outs, cotangent, allow_unused=True)
        factors = []
        for rule, (inputs, out), grad in zip(self.rules, captured, grads, strict=True):
            delta = grad if grad is not None else torch.zeros_like(out)
            if outputs is None:
                delta = delta.view(-1, n, *delta.shape[1:]).transpose(0, 1)
                inputs = tuple(x[:n] for x in inputs)
            else:
                delta = delta.unsqueeze(1)
            factors.append(rule.factors(inputs, delta, params))
        return log_proba[:n].detach(), factors

    def n_outputs(self, flat, X):
        """Number of outputs K of the network (evaluated once)."""
        if self._n_outputs is None:
            self._n_outputs = self.log_proba(flat, X[:1]).shape[1]
        return self._n_outputs

    @staticmethod
    def _capture_hook(captured, index):
        def hook(layer, inputs, output):
            if captured[index] is not None:
                raise NotImplementedError(
                    f"The layer {type(layer).__name__} is called more than once per "
                    "forward pass (shared weights); the path kernel engine supports "
                    "layers applied once per sample."
                )
            inputs = tuple(x.detach() for x in inputs if isinstance(x, torch.Tensor))
            # Hand a copy downstream, so an in-place activation cannot overwrite
            # the tensor whose gradient we take.
            captured[index] = (inputs, output)
            return output.clone()

        return hook
