"""The recorded path: the ground floor that training writes and the engine reads.

The weights of every step (:class:`WeightPath`, in memory or memory-mapped on
disk), the per-step linear form of the optimiser's update with its backward and
forward accumulations (:class:`UpdateRecord`), coefficients with one value per
parameter block (:class:`Blockwise`), the output links ``f = link(z)``
(:class:`Link`), the recorded dropout masks, BatchNorm's running statistics as
coordinates of the path (:class:`RunningStatistics`), and the memory helpers. It
imports nothing else of the package.
"""

from ._batchnorm import (
    BATCH_NORMS,
    RunningStatistics,
    averaging_factor,
    batch_norm_layers,
    differentiable_statistics,
    eval_forward,
    load_statistics,
    row_shares,
    statistics_factors,
    statistics_names,
    with_running_statistics,
)
from ._blockwise import (
    Blockwise,
    block_values,
    blockwise,
    from_plain,
    layout_by_rules,
    on_layers,
    per_step,
    steps_to_plain,
    to_plain,
    weighted,
)
from ._dropout import MASKED_DROPOUT, dropout_layers, mask_shape, masks_applied, take_rows
from ._links import (
    CERTIFICATE_TOLERANCE,
    FunctionLink,
    IdentityLink,
    Link,
    LogSoftmaxLink,
    log_softmax,
    output_cotangent,
)
from ._memory import available_memory
from ._nested import nested_tensors
from ._update_record import BackwardAccumulation, Deferred, ForwardAccumulation, UpdateRecord
from ._weights import (
    PATH_STORAGES,
    WeightPath,
    allocate_weights,
    flatten_parameters,
    read_row,
    release_pages,
    storage_directory,
)

__all__ = [
    "BATCH_NORMS",
    "RunningStatistics",
    "averaging_factor",
    "batch_norm_layers",
    "differentiable_statistics",
    "eval_forward",
    "load_statistics",
    "row_shares",
    "statistics_factors",
    "statistics_names",
    "with_running_statistics",
    "MASKED_DROPOUT",
    "CERTIFICATE_TOLERANCE",
    "PATH_STORAGES",
    "BackwardAccumulation",
    "Deferred",
    "Blockwise",
    "ForwardAccumulation",
    "FunctionLink",
    "IdentityLink",
    "Link",
    "LogSoftmaxLink",
    "UpdateRecord",
    "WeightPath",
    "dropout_layers",
    "mask_shape",
    "masks_applied",
    "take_rows",
    "allocate_weights",
    "read_row",
    "release_pages",
    "available_memory",
    "block_values",
    "blockwise",
    "flatten_parameters",
    "from_plain",
    "layout_by_rules",
    "log_softmax",
    "nested_tensors",
    "on_layers",
    "output_cotangent",
    "per_step",
    "steps_to_plain",
    "storage_directory",
    "to_plain",
    "weighted",
]
