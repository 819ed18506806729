"""The default network of :class:`ExactPathKernelClassifier`: a plain MLP."""

from torch import nn

ACTIVATIONS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "softplus": nn.Softplus,
    "logistic": nn.Sigmoid,
    "identity": nn.Identity,
}


def make_mlp(n_features, n_classes, hidden_layer_sizes=(100,), activation="relu"):
    """Linear layers of the given widths with ``activation`` between them.

    The output layer starts at zero, so the initial network outputs
    ``log(1 / n_classes)`` for every input: the kernel machine's bias is a
    constant (the EPK paper's Remark 1).
    """
    layers, width = [], n_features
    for size in hidden_layer_sizes:
        layers += [nn.Linear(width, size), ACTIVATIONS[activation]()]
        width = size
    head = nn.Linear(width, n_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return nn.Sequential(*layers, head)
