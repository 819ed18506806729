"""The path's steps on the device and the probe of each thread."""

import dataclasses
import threading

import numpy as np
import torch

from sklearn_pathkernel._engine._steps import PathSteps, Step, ThreadProbes


def test_a_step_is_its_start_and_direction_and_is_remembered_per_thread(
    relu_case,
):
    _, path, _, _, _ = relu_case
    steps = PathSteps(path, torch.device("cpu"))
    step = steps.step(3)
    assert isinstance(step, Step) and step.index == 3
    torch.testing.assert_close(step.start, path.weights[3], rtol=0, atol=0)
    torch.testing.assert_close(step.start + step.direction, path.weights[4], rtol=0, atol=1e-15)
    assert steps.step(3) is step  # the same tensors: the probe reuses their parameters
    assert steps.step(4) is not step and steps.step(3) is not step  # the last step only

    other = []
    thread = threading.Thread(target=lambda: other.append(steps.step(3)))
    thread.start()
    thread.join()
    assert other[0] is not steps.step(3)  # each thread its own
    assert steps.metric(3, []) is None  # gradient descent: the identity metric


def test_each_thread_gets_its_own_probe_on_its_own_module(relu_case):
    module, path, X, _, _ = relu_case
    probes = ThreadProbes(module, path, X[:1], torch.log_softmax)
    assert probes.current() is probes.main
    seen = []

    def work():
        seen.append(probes.current())
        seen.append(probes.current())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen[0] is seen[1] and seen[0] is not probes.main
    assert seen[0].module is not module  # a copy: hooks never touch the caller's module


def test_floating_arrays_come_in_the_path_s_dtype(relu_case):
    """Nodes and weights (float64 numpy arrays) of a float32 path are float32 on
    the device; row indices stay integers."""
    _, path, _, _, _ = relu_case
    steps = PathSteps(dataclasses.replace(path, weights=path.weights.float()), torch.device("cpu"))
    assert steps.on_device(np.linspace(0.0, 1.0, 3)).dtype == torch.float32
    assert steps.on_device(np.arange(3)).dtype == torch.int64
    assert PathSteps(path, torch.device("cpu")).on_device(np.ones(2)).dtype == torch.float64
