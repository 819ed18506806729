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
Explainer
    The explanations of a fitted estimator or a recording, as one object: top-k
    proponents and opponents, self-influence, attribution over time, influence
    matrices, by the exact contributions or the counterfactual scores.
Explanation, SelfInfluence, TimeAttribution
    The results of the estimators' ``explain``, ``self_influence`` and
    ``explain_over_time``.
CounterfactualAttribution, RetrainingCertificate
    The result of the estimators' ``counterfactual`` and its check by retraining.
TrainingRecorder
    Records the exact path kernel of a network trained in your own PyTorch loop.
Recording
    What it records: decompose, Gram matrices, the kernel, save and load.
RecordingRefused
    The error a recorder raises for a step it cannot represent exactly.
"""

from ._estimators import (
    DistanceKernelClassifier,
    DistanceKernelRegressor,
    ExactPathKernel,
    ExactPathKernelClassifier,
    ExactPathKernelRegressor,
    PathKernelTransformer,
)
from ._explain import (
    CounterfactualAttribution,
    Explainer,
    Explanation,
    RetrainingCertificate,
    SelfInfluence,
    TimeAttribution,
)
from ._nn import DistanceConv2d, DistanceLayer
from ._recording import Recording, TrainingRecorder
from ._training import RecordingRefused

__all__ = [
    "CounterfactualAttribution",
    "DistanceConv2d",
    "DistanceKernelClassifier",
    "DistanceKernelRegressor",
    "DistanceLayer",
    "ExactPathKernel",
    "ExactPathKernelClassifier",
    "ExactPathKernelRegressor",
    "Explainer",
    "Explanation",
    "PathKernelTransformer",
    "Recording",
    "RecordingRefused",
    "RetrainingCertificate",
    "SelfInfluence",
    "TimeAttribution",
    "TrainingRecorder",
]
__version__ = "0.1.0.dev0"
