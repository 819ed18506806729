"""Neural networks as exact kernel machines, for scikit-learn.

Public API
----------
ExactPathKernelClassifier
    A PyTorch network trained by gradient descent, with its Exact Path Kernel.
ExactPathKernelRegressor
    The same for regression (squared error): an exact kernel regression.
DistanceKernelClassifier
    A network of distance layers ("memories"), with the same kernel API.
DistanceKernelRegressor
    The same for regression.
ExactPathKernel
    The learned kernel, a ``sklearn.gaussian_process.kernels.Kernel``.
PathKernelTransformer
    The EPK Gram matrix as a pipeline step, for ``SVC(kernel="precomputed")``.
DistanceLayer
    The distance layer, for building your own networks.
DistanceConv2d
    The convolutional distance layer (patches compared with memories), for images.
"""

from ._estimators._classifier import ExactPathKernelClassifier
from ._estimators._distance_classifier import DistanceKernelClassifier
from ._estimators._distance_regressor import DistanceKernelRegressor
from ._estimators._kernel import ExactPathKernel
from ._estimators._regressor import ExactPathKernelRegressor
from ._estimators._transformer import PathKernelTransformer
from ._nn._distance import DistanceLayer
from ._nn._distance_conv import DistanceConv2d

__all__ = [
    "DistanceConv2d",
    "DistanceKernelClassifier",
    "DistanceKernelRegressor",
    "DistanceLayer",
    "ExactPathKernel",
    "ExactPathKernelClassifier",
    "ExactPathKernelRegressor",
    "PathKernelTransformer",
]
__version__ = "0.1.0.dev0"
