"""The recorded weight path of a gradient-descent run.

Everything the exact path kernel needs from training: the weights ``w_0 .. w_S``
as one contiguous float64 array, and for every step the batch it used and the
coefficient with which each batch point moved the weights, so that

    w_{s+1} - w_s = sum_{i in B_s} coef_{s,i} * grad_w f_{y_i}(x_i; w_s)

with ``f = log_softmax(module(x))``. For the mean cross-entropy,
``coef_{s,i} = lr_s * sample_weight_i / sum_{j in B_s} sample_weight_j``.
"""

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class WeightPath:
    """Weights along a training run and the data each step used.

    Attributes
    ----------
    weights : torch.Tensor of shape (n_steps + 1, n_weights)
        Flat weights ``w_0 .. w_S`` in the order of ``module.named_parameters()``.
        Row ``s`` is the state before step ``s``; the last row is the final model.
    batches : list of ndarray of int
        ``batches[s]`` holds the training indices of step ``s``. Full-batch steps
        share one array, so a full-batch path stores the indices once.
    coefficients : list of torch.Tensor
        ``coefficients[s][j]`` is the weight of training point ``batches[s][j]``
        in step ``s`` (learning rate times its share of the batch loss).
    learning_rates : ndarray of shape (n_steps,)
        The learning rate used at each step.
    param_names, param_shapes : list
        How a flat weight vector splits into the module's parameters.
    """

    weights: torch.Tensor
    batches: list = field(default_factory=list)
    coefficients: list = field(default_factory=list)
    learning_rates: np.ndarray = None
    param_names: list = field(default_factory=list)
    param_shapes: list = field(default_factory=list)

    @property
    def n_steps(self):
        return self.weights.shape[0] - 1

    @property
    def n_weights(self):
        return self.weights.shape[1]

    @property
    def nbytes(self):
        """Bytes held by the path (weights, batches and coefficients)."""
        seen, total = set(), self.weights.element_size() * self.weights.nelement()
        for batch, coef in zip(self.batches, self.coefficients, strict=False):
            if id(batch) not in seen:
                seen.add(id(batch))
                total += batch.nbytes
            total += coef.element_size() * coef.nelement()
        return total

    def unflatten(self, flat):
        """Split a flat weight vector into a ``{name: tensor}`` parameter dict (views)."""
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.param_shapes]
        return {
            name: chunk.view(shape)
            for name, shape, chunk in zip(
                self.param_names, self.param_shapes, torch.split(flat, sizes), strict=True
            )
        }

    def step_direction(self, step):
        """``w_{s+1} - w_s``, the straight line the weights follow in step ``s``."""
        return self.weights[step + 1] - self.weights[step]


def flatten_parameters(module):
    """Flat float64 copy of a module's parameters, with their names and shapes."""
    names, shapes, tensors = [], [], []
    for name, param in module.named_parameters():
        names.append(name)
        shapes.append(tuple(param.shape))
        tensors.append(param.detach().reshape(-1))
    return torch.cat(tensors), names, shapes
