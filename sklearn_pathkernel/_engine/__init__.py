"""The kernel engine: exact decompositions and Gram blocks of a recorded path. It reads
the path (``sklearn_pathkernel._path``) and the network, and answers with the
network's output as a sum over its training points, certified against the network
itself (:class:`PathKernelEngine`), or with the derivative of a query's target with
respect to each training row's weight through the whole run (:class:`AdjointSweep`,
given the run's loss and differentiable steps as values); ``integration/`` splits
each step at its kinks and integrates the pieces, ``rules/`` gives each layer's
per-example gradient products.
"""

from ._adjoint import AdjointSweep, TrainingRun
from ._certified import checked_against, checked_for_targets, target_values
from ._device import CPU, as_tensor, loadable_device, on_host, resolve_device
from ._facade import PathKernelEngine
from ._targets import (
    TARGETS,
    LossTarget,
    MarginTarget,
    OutputTarget,
    QueryTargets,
    Target,
)

__all__ = [
    "AdjointSweep",
    "TARGETS",
    "LossTarget",
    "MarginTarget",
    "OutputTarget",
    "QueryTargets",
    "Target",
    "TrainingRun",
    "CPU",
    "PathKernelEngine",
    "as_tensor",
    "checked_against",
    "checked_for_targets",
    "target_values",
    "loadable_device",
    "on_host",
    "resolve_device",
]
