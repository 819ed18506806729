"""NetworkProbe: it evaluates its own copy of the network and leaves the given module alone.

The probe puts hooks and per-row forwards (``output_at``) on the layers it
evaluates; on an estimator's ``module_`` they would race with a ``predict`` from
another thread. References: the estimator's own predictions, taken before.
"""

import copy
import dataclasses
import threading

import numpy as np
import torch
from sklearn.datasets import make_blobs
from sklearn.preprocessing import StandardScaler
from torch import nn

from sklearn_pathkernel import DistanceLayer, ExactPathKernelClassifier
from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._engine.rules._distance import DistanceRule


def untouched(module):
    """Whether no module of ``module`` has hooks or an instance ``forward``."""
    return all(
        not layer._forward_hooks and not layer._forward_pre_hooks and "forward" not in vars(layer)
        for layer in module.modules()
    )


def fitted_distance_network():
    X, y = make_blobs(n_samples=40, n_features=4, centers=3, random_state=0)
    X = StandardScaler().fit_transform(X)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = nn.Sequential(DistanceLayer(4, 6, kernel="rbf"), nn.Linear(6, 3))
    clf = ExactPathKernelClassifier(module=module, max_iter=8, learning_rate=0.1, random_state=0)
    return clf.fit(X, y), X


def test_the_probe_works_on_its_own_copy():
    clf, X = fitted_distance_network()
    probe = NetworkProbe(clf.module_, clf.path_, torch.as_tensor(X[:1]))
    assert probe.module is not clf.module_
    assert all(layer not in list(clf.module_.modules()) for layer in probe.layers)
    assert probe.per_row_t and any(isinstance(rule, DistanceRule) for rule in probe.rules)
    path = clf.path_
    t = torch.linspace(0.0, 1.0, 5, dtype=path.weights.dtype)
    probe.output_and_factors(
        path.weights[1], torch.as_tensor(X[:5]), direction=path.step_direction(1), t=t
    )
    assert untouched(clf.module_) and untouched(probe.module)


def test_predict_from_another_thread_during_kernel_and_decompose():
    """Every prediction made while the kernel and a decomposition are computed
    equals the one before it, bitwise; the module keeps no hook or patch."""
    clf, X = fitted_distance_network()
    expected = clf.predict_proba(X)
    done, failures, count = threading.Event(), [], [0]

    def predict_in_a_loop():
        try:
            while not done.is_set():
                if not np.array_equal(clf.predict_proba(X), expected):
                    failures.append("a prediction changed")
                count[0] += 1
        except Exception as error:  # noqa: BLE001 (reported to the main thread)
            failures.append(repr(error))

    worker = threading.Thread(target=predict_in_a_loop)
    worker.start()
    try:
        clf.kernel_(X)
        clf.decompose(X[:4])
    finally:
        done.set()
        worker.join()
    assert not failures, failures[:3]
    assert count[0] > 0
    assert untouched(clf.module_)
    assert np.array_equal(clf.predict_proba(X), expected)


def test_a_float64_t_on_a_float32_path_is_taken_in_the_path_s_dtype(relu_case):
    """Quadrature nodes come in float64; on a float32 path the rows are evaluated
    in float32, as with float32 nodes (no promotion to float64)."""
    module, path, X, _, _ = relu_case
    path = dataclasses.replace(path, weights=path.weights.float())
    probe = NetworkProbe(copy.deepcopy(module).float(), path, X[:1].float())
    t = torch.linspace(0.0, 1.0, 5, dtype=torch.float64)
    start, direction = path.weights[1], path.weights[2] - path.weights[1]
    output = probe.output(start, X[:5].float(), direction=direction, t=t)
    assert output.dtype == torch.float32
    expected = probe.output(start, X[:5].float(), direction=direction, t=t.float())
    torch.testing.assert_close(output, expected, rtol=0, atol=0)


def _two_conv_engine(engine_cases):
    from sklearn_pathkernel._training import SolverSettings

    torch.manual_seed(0)
    module, path, X, y = engine_cases.trained(
        engine_cases.TwoConvCNN(), n=24, n_features=100, steps=4, lr=0.01, batch_size=8,
        solver=SolverSettings(solver="adamw", weight_decay=0.01),
    )  # fmt: skip
    return engine_cases.engine_for(module, path, X, y), module, path, X


def _row_output_calls(monkeypatch):
    """Counts the convolutions' ``row_output`` calls that gave the rows' outputs."""
    from sklearn_pathkernel._engine.rules._conv import Conv2dRule

    calls, original = [], Conv2dRule.row_output

    def counted(self, inputs, weights):
        result = original(self, inputs, weights)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(Conv2dRule, "row_output", counted)
    return calls


def test_row_kernels_equal_the_moved_output_form(engine_cases, monkeypatch):
    """Rows at their own points of a step: each convolution at the row's own
    kernel (``row_kernels``, one grouped convolution) against its output at the
    step's start plus ``t_i`` times its moved output: outputs and factors to
    1e-14 of their scale; rows at ``t = 0`` bit for bit the network at the start."""
    _, module, path, X = _two_conv_engine(engine_cases)
    probe = NetworkProbe(module, path, X[:1])
    start, direction = path.weights[1], path.step_direction(1)
    t = torch.tensor([0.0, 0.2, 0.5, 0.0, 0.9, 1.0], dtype=torch.float64)
    calls = _row_output_calls(monkeypatch)
    found = {}
    for flag in (True, False):
        monkeypatch.setattr(NetworkProbe, "row_kernels", flag)
        found[flag] = (
            probe.output(start, X[:6], direction, t),
            probe.output_and_factors(start, X[:6], direction=direction, t=t),
        )
    assert calls and all(calls)  # (both convolutions, in both passes of the first flag)
    assert len(calls) == 4
    (out, (_, factors)), (other, (_, other_factors)) = found[True], found[False]
    assert (out - other).abs().max() <= 1e-14 * other.abs().max()
    still = t == 0
    assert torch.equal(out[still], probe.output(start, X[:6][still]))
    compared = 0
    for mine, theirs in zip(factors, other_factors, strict=True):
        mine = engine_cases.factor_tensors(mine)
        for name, value in engine_cases.factor_tensors(theirs).items():
            if value.is_floating_point() and value.abs().max() > 0:
                assert (mine[name] - value).abs().max() <= 1e-13 * value.abs().max()
                compared += 1
    assert compared >= 4


def test_decomposition_with_row_kernels_equals_the_moved_output_form(engine_cases, monkeypatch):
    """A whole decomposition (AdamW, mini-batches) with the convolutions at the
    rows' own kernels and with their moved outputs: the contributions to 1e-13
    of their scale, the sum identity to 1e-12 for both."""
    engine, _, _, X = _two_conv_engine(engine_cases)
    A = X[-3:] + 0.1
    calls = _row_output_calls(monkeypatch)
    found = {}
    for flag in (True, False):
        monkeypatch.setattr(NetworkProbe, "row_kernels", flag)
        found[flag] = engine.decompose(A)
        if flag:
            assert any(calls)
    mine, theirs = found[True], found[False]
    scale = np.abs(theirs.contributions).max()
    assert scale > 0
    assert np.abs(mine.contributions - theirs.contributions).max() <= 1e-13 * scale
    np.testing.assert_array_equal(mine.output, theirs.output)
    for parts in (mine, theirs):
        total = parts.bias + parts.contributions.sum(1) + parts.decay
        assert np.abs(total - parts.output).max() <= 1e-12 * max(1.0, np.abs(parts.output).max())
