"""The estimators' networks: ``_build_module`` from their parameters (mixins)."""

import copy
from numbers import Integral, Real

from sklearn.utils._param_validation import Interval, StrOptions
from torch import nn

from .._nn._builders import ACTIVATIONS, make_distance_network, make_mlp
from .._nn._distance import INITS, KERNELS, TRANSFORMS


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


class DistanceNetworkMixin:
    """``_build_module`` of the distance estimators, from ``hidden_layer_sizes``,
    ``kernel``, ``init``, ``skew_transform``, ``gamma`` and the estimator's head
    (``head``; regressors have a linear head)."""

    _parameter_constraints = {
        "hidden_layer_sizes": ["array-like", Interval(Integral, 1, None, closed="left")],
        "kernel": [StrOptions(set(KERNELS))],
        "init": [StrOptions(set(INITS))],
        "skew_transform": [StrOptions(set(TRANSFORMS))],
        "gamma": [Interval(Real, 0, None, closed="neither")],
    }

    #: The head of an estimator that has no ``head`` parameter.
    head = "linear"

    def _build_module(self, X, n_outputs):
        sizes = self.hidden_layer_sizes
        sizes = (sizes,) if isinstance(sizes, Integral) else tuple(sizes)
        if any(not isinstance(size, Integral) or size < 1 for size in sizes):
            raise ValueError(
                f"hidden_layer_sizes must hold positive integers, got {self.hidden_layer_sizes!r}."
            )
        if self.kernel == "cosine" and self.skew_transform in ("sqrt", "log1p"):
            raise ValueError(
                f"skew_transform={self.skew_transform!r} needs non-negative layer outputs, but the "
                "cosine kernel's similarities are in [-1, 1]; use skew_transform='none' or "
                "'standardize' with kernel='cosine'."
            )
        return make_distance_network(
            X,
            n_outputs,
            [int(size) for size in sizes],
            self.kernel,
            self.init,
            self.skew_transform,
            self.head,
            gamma=self.gamma,
        )
