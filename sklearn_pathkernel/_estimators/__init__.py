"""The scikit-learn estimators: thin shells that train, record and ask the engine."""

from ._classifier import ExactPathKernelClassifier
from ._distance_classifier import DistanceKernelClassifier
from ._distance_regressor import DistanceKernelRegressor
from ._docstrings import fill_doc, step_chunks_parameter
from ._kernel import ExactPathKernel
from ._regressor import ExactPathKernelRegressor
from ._transformer import PathKernelTransformer

__all__ = [
    "DistanceKernelClassifier",
    "DistanceKernelRegressor",
    "ExactPathKernel",
    "ExactPathKernelClassifier",
    "ExactPathKernelRegressor",
    "PathKernelTransformer",
    "fill_doc",
    "step_chunks_parameter",
]
