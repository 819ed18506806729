"""The network of the MLP estimators: the user's ``module``, or a plain MLP."""

import copy
from numbers import Integral

from sklearn.utils._param_validation import Interval, StrOptions
from torch import nn

ACTIVATIONS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "softplus": nn.Softplus,
    "logistic": nn.Sigmoid,
    "identity": nn.Identity,
}


def make_mlp(n_features, n_outputs, hidden_layer_sizes=(100,), activation="relu"):
    """Linear layers of the given widths with ``activation`` between them.

    The output layer starts at zero, so the initial network outputs the same
    for every input (``log(1 / n_classes)`` for a classifier, 0 for a
    regressor): the kernel machine's bias is a constant (the EPK paper's Remark 1).
    """
    layers, width = [], n_features
    for size in hidden_layer_sizes:
        layers += [nn.Linear(width, size), ACTIVATIONS[activation]()]
        width = size
    head = nn.Linear(width, n_outputs)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return nn.Sequential(*layers, head)


class MLPNetworkMixin:
    """``_build_module`` of the MLP estimators, from ``module``,
    ``hidden_layer_sizes`` and ``activation``."""

    _parameter_constraints = {
        "module": [nn.Module, callable, None],
        "hidden_layer_sizes": ["array-like", Interval(Integral, 1, None, closed="left")],
        "activation": [StrOptions(set(ACTIVATIONS))],
    }

    def _build_module(self, X, n_outputs):
        n_features = X.shape[1]
        if self.module is None:
            sizes = self.hidden_layer_sizes
            sizes = (sizes,) if isinstance(sizes, Integral) else tuple(sizes)
            return make_mlp(n_features, n_outputs, sizes, self.activation)
        if isinstance(self.module, nn.Module):
            # A deep copy: the user's weights (w_0) stay untouched.
            module = copy.deepcopy(self.module)
        else:
            module = self.module(n_features, n_outputs)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    "The module callable must return a torch.nn.Module, got "
                    f"{type(module).__name__}."
                )
        if not any(True for _ in module.parameters()):
            raise ValueError("The module has no parameters to train.")
        return module
