"""The fitted path as the engine's parts read it: one frozen value object."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FittedPath:
    """What every computing part of the engine reads of one fitted path.

    ``PathKernelEngine`` builds it once, after the parts that hold the device (the
    path's steps, the probes, the plans), and hands the same object to the parts
    that compute (the test copy, the decomposition, the Gram blocks and Grams, the
    step-by-step terms) instead of each taking the same collaborators one by one.
    Nothing in it changes after it is built.

    Attributes
    ----------
    path : WeightPath
        The recorded path.
    X_train : torch.Tensor of shape (M, ...)
        The training inputs the path's batches index, on the engine's device.
    probes : ThreadProbes
        The network's probes (one per thread).
    steps : PathSteps
        The path's steps on the device.
    scheduler : Scheduler
        joblib tasks over (row tiles, step chunks), and their progress.
    planner : Planner
        Tiles and passes from the memory budget.
    rule : QuadratureRule
        The integration rule along a step.
    nodes : NodeCounts
        The nodes per smooth piece, and the degree they follow from.
    n_outputs : int
        K, the network's outputs.
    """

    path: object
    X_train: torch.Tensor
    probes: object
    steps: object
    scheduler: object
    planner: object
    rule: object
    nodes: object
    n_outputs: int

    @property
    def n_train(self):
        """M, the training points."""
        return self.X_train.shape[0]
