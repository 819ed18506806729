"""Training: the loop, the recorder that writes the path, losses and optimiser rules.

It trains a module with ``torch.optim`` (the estimators' loop, :func:`train_module`),
or watches a user's own loop (:class:`PathRecorder`), and writes what happened
as a recorded path (``sklearn_pathkernel._path``), refusing with
:class:`RecordingRefused` any step it cannot represent exactly.
"""

from ._loop import train_module
from ._losses import (
    CLASSIFICATION_LOSSES,
    REGRESSION_LOSSES,
    CrossEntropy,
    Loss,
    SquaredError,
    register_loss,
)
from ._module_checks import check_module
from ._optimizer_settings import OptimizerSettings, SettingsLog
from ._optimizers import OPTIMIZER_RULES, SOLVERS, RecordingRefused
from ._recorder import PathRecorder, RecordedRun
from ._replay import Float64Run, check_replay, float64_run, replay_in_float64
from ._solvers import (
    SolverSettings,
    solver_constraints,
    solver_hyperparameters,
    solvers_taking,
)
from ._stated_loss import (
    StatedLoss,
    check_output_gradients,
    check_sample_weight,
    float64_twin,
    loss_targets,
    resolve_loss,
    retrain,
)
from ._weight_watch import largest_difference

__all__ = [
    "CLASSIFICATION_LOSSES",
    "OPTIMIZER_RULES",
    "REGRESSION_LOSSES",
    "SOLVERS",
    "CrossEntropy",
    "Float64Run",
    "Loss",
    "OptimizerSettings",
    "RecordingRefused",
    "SettingsLog",
    "StatedLoss",
    "SolverSettings",
    "SquaredError",
    "PathRecorder",
    "RecordedRun",
    "check_module",
    "check_output_gradients",
    "check_sample_weight",
    "loss_targets",
    "resolve_loss",
    "retrain",
    "float64_twin",
    "check_replay",
    "float64_run",
    "largest_difference",
    "register_loss",
    "replay_in_float64",
    "solver_constraints",
    "solver_hyperparameters",
    "solvers_taking",
    "train_module",
]
