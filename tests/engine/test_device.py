"""The ``device`` parameter: CPU results unchanged, clear errors, device-agnostic code.

This machine (and CI) has no GPU: the CPU path is checked bitwise against the
default, the errors and the pickling fallback with a monkeypatched
``torch.cuda``, and device-agnosticism by a spy that flags every tensor factory
the package calls without a ``device``. The CUDA comparison runs only where
CUDA exists.
"""

import os
import pickle
import sys
from functools import lru_cache

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.datasets import make_blobs
from sklearn.utils._param_validation import InvalidParameterError
from torch.overrides import TorchFunctionMode

import sklearn_pathkernel
from sklearn_pathkernel import (
    DistanceKernelClassifier,
    ExactPathKernel,
    ExactPathKernelClassifier,
    PathKernelTransformer,
)
from sklearn_pathkernel._engine._device import resolve_device
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._nn._builders import make_distance_network

X, y = make_blobs(n_samples=24, centers=3, n_features=4, random_state=0)
X_TEST = X[:5] + 0.25
CPU = torch.device("cpu")
CLASSIFIERS = [ExactPathKernelClassifier, DistanceKernelClassifier]


def small(cls, **params):
    """A small, fast estimator of ``cls``."""
    defaults = {"hidden_layer_sizes": (6,), "max_iter": 4, "random_state": 0}
    if cls is DistanceKernelClassifier:
        # Smooth (no kinks): the engine's kink search on distance layers is slow.
        defaults.update(hidden_layer_sizes=(4,), kernel="rbf", skew_transform="none")
    return cls(**{**defaults, **params})


def outcomes(clf):
    """Everything a fitted estimator hands back, as numpy arrays."""
    kernel = clf.kernel_
    parts = clf.decompose(X_TEST)
    return {
        "weights": clf.path_.weights.numpy(),
        "output_gradients": np.concatenate([c.numpy() for c in clf.path_.output_gradients]),
        "batches": np.concatenate(clf.path_.batches),
        "loss": np.asarray(clf.loss_curve_),
        "proba": clf.predict_proba(X_TEST),
        "decision": clf.decision_function(X_TEST),
        "contributions": parts.contributions,
        "bias": parts.bias,
        "output": parts.output,
        "residual": parts.residual,
        "train_gram": kernel(X),
        "mixed_gram": kernel(X_TEST, X),
        "test_gram": kernel(X_TEST),
        "diag": kernel.diag(X_TEST),
        "full": ExactPathKernel(kernel.engine, output="full")(X_TEST[:2], X[:3]),
    }


def assert_identical(left, right):
    assert left.keys() == right.keys()
    for key in left:
        np.testing.assert_array_equal(left[key], right[key], err_msg=key)


def assert_close(left, right, tol=1e-10):
    for key in left:
        np.testing.assert_allclose(left[key], right[key], rtol=tol, atol=tol, err_msg=key)


# -- the CPU path is the default path, bit for bit --------------------------------


@lru_cache
def default_outcomes(cls, batch_size):
    return outcomes(small(cls, batch_size=batch_size).fit(X, y))


@pytest.mark.parametrize("cls", CLASSIFIERS)
@pytest.mark.parametrize("batch_size", [None, 12])
@pytest.mark.parametrize("device", ["cpu", CPU], ids=["str", "torch.device"])
def test_cpu_device_is_bitwise_the_default(cls, batch_size, device):
    clf = small(cls, batch_size=batch_size, device=device).fit(X, y)
    assert clf.device_ == CPU
    assert all(p.device == CPU for p in clf.module_.parameters())
    assert clf.path_.weights.device == CPU
    assert_identical(outcomes(clf), default_outcomes(cls, batch_size))


def test_transformer_on_cpu_device_is_bitwise_the_default():
    net = small(ExactPathKernelClassifier)
    default = PathKernelTransformer(net)
    on_cpu = PathKernelTransformer(net).set_params(estimator__device=CPU)
    np.testing.assert_array_equal(on_cpu.fit_transform(X, y), default.fit_transform(X, y))
    np.testing.assert_array_equal(on_cpu.transform(X_TEST), default.transform(X_TEST))
    assert on_cpu.estimator_.device_ == CPU


# -- clear errors, before any work ------------------------------------------------


@pytest.mark.parametrize("device", ["gpu", "cuda:abc", "", "CPU", "meta", "mps"])
@pytest.mark.parametrize("cls", CLASSIFIERS)
def test_unknown_or_unsupported_device_raises_before_any_work(cls, device):
    X_bad = X.copy()
    X_bad[0, 0] = np.nan  # the device is checked first: this error never comes
    clf = small(cls, device=device)
    with pytest.raises(ValueError, match=rf"{device!r}.*available on this machine: \['cpu'"):
        clf.fit(X_bad, y)
    assert not hasattr(clf, "n_features_in_")
    assert not hasattr(clf, "module_")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_raises(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    clf = small(ExactPathKernelClassifier, device=device)
    with pytest.raises(ValueError, match=r"CUDA is not available.*available devices: \['cpu'\]"):
        clf.fit(X, y)
    assert not hasattr(clf, "module_")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device(device)


def test_missing_cuda_index_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"'cuda:3'.*has 1 CUDA device.*'cuda:0'"):
        small(DistanceKernelClassifier, device="cuda:3").fit(X, y)


def test_device_of_wrong_type_raises():
    with pytest.raises(InvalidParameterError, match="device"):
        small(ExactPathKernelClassifier, device=0).fit(X, y)


def test_resolve_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device("cpu:0") == CPU
    assert resolve_device(CPU) == CPU


# -- parameters, clone and pickle ---------------------------------------------------


@pytest.mark.parametrize("cls", CLASSIFIERS)
def test_device_parameter_round_trips(cls):
    clf = small(cls)
    assert clf.get_params()["device"] == "cpu"
    assert cls().device == "cpu"
    clf.set_params(device=CPU)
    assert clone(clf).get_params()["device"] == CPU
    assert pickle.loads(pickle.dumps(clf)).device == CPU

    fitted = clf.fit(X, y)
    loaded = pickle.loads(pickle.dumps(fitted))
    assert loaded.device == CPU and loaded.device_ == CPU
    assert clone(loaded).device == CPU
    np.testing.assert_array_equal(loaded.predict_proba(X_TEST), fitted.predict_proba(X_TEST))
    np.testing.assert_array_equal(loaded.kernel_(X_TEST, X), fitted.kernel_(X_TEST, X))


def test_pickle_from_a_cuda_machine_loads_on_the_cpu(monkeypatch):
    # What __getstate__ writes for an estimator fitted on CUDA: host tensors and
    # device_ = cuda:0. On a machine without CUDA it loads on the CPU, with a warning.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    clf = small(ExactPathKernelClassifier, device="cpu").fit(X, y)
    expected = clf.decompose(X_TEST)
    gram = clf.kernel_(X_TEST, X)
    clf.device_ = torch.device("cuda", 0)
    data = pickle.dumps(clf)
    with pytest.warns(UserWarning, match="pickled on device 'cuda:0'.*loaded on the CPU"):
        loaded = pickle.loads(data)
    assert loaded.device_ == CPU
    parts = loaded.decompose(X_TEST)
    np.testing.assert_array_equal(parts.contributions, expected.contributions)
    np.testing.assert_array_equal(loaded.kernel_(X_TEST, X), gram)

    engine = pickle.loads(pickle.dumps(clf._engine()))
    engine.device = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match="engine was pickled on device 'cuda:0'"):
        engine = pickle.loads(pickle.dumps(engine))
    assert engine.device == CPU and engine.X_train.device == CPU
    np.testing.assert_array_equal(ExactPathKernel(engine)(X_TEST, X), gram)


def test_kernel_object_pickles():
    clf = small(DistanceKernelClassifier).fit(X, y)
    kernel = pickle.loads(pickle.dumps(clf.kernel_))
    np.testing.assert_array_equal(kernel(X_TEST, X), clf.kernel_(X_TEST, X))


# -- device-agnostic code: no tensor factory without a device ---------------------

PACKAGE = os.path.dirname(sklearn_pathkernel.__file__)
FACTORIES = {
    getattr(torch, name)
    for name in (
        "arange",
        "as_tensor",
        "asarray",
        "empty",
        "eye",
        "full",
        "linspace",
        "ones",
        "rand",
        "randint",
        "randn",
        "randperm",
        "tensor",
        "zeros",
    )
}


class FactorySpy(TorchFunctionMode):
    """Records the package's tensor factories called without a ``device``.

    Such a tensor lands on torch's default device (the CPU), not on the device
    of the data it is combined with.
    """

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            frame = sys._getframe(1)  # the caller of the factory
            if frame.f_code.co_filename.startswith(PACKAGE):
                where = os.path.relpath(frame.f_code.co_filename, PACKAGE)
                self.calls.append(f"{where}:{frame.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "clf",
    [
        small(ExactPathKernelClassifier),
        small(ExactPathKernelClassifier, batch_size=10, quadrature="riemann", n_points=3),
        # The default distance network: kinks, data-based init (few steps: slow engine).
        DistanceKernelClassifier(hidden_layer_sizes=(4,), max_iter=2, random_state=0),
    ],
    ids=["mlp", "mlp-minibatch-riemann", "distance"],
)
def test_no_tensor_factory_without_device(clf):
    spy = FactorySpy()
    with spy:
        clf.fit(X, y)
        clf.predict_proba(X_TEST)
        clf.decompose(X_TEST)
        kernel = clf.kernel_
        kernel(X)
        kernel(X_TEST, X)
        kernel(X_TEST)
        kernel.diag(X_TEST)
        kernel.diag(X)
        ExactPathKernel(kernel.engine, output="full")(X_TEST[:2], X[:3])
        kernel.engine.certificate(torch.as_tensor(X_TEST))
    assert spy.calls == []


@pytest.mark.parametrize("init", ["uniform", "samples", "kmeans++"])
@pytest.mark.parametrize("head", ["linear", "distance"])
def test_distance_network_creates_no_tensor_without_device(init, head):
    spy = FactorySpy()
    with spy:
        make_distance_network(torch.as_tensor(X), 3, [4, 3], "rbf", init, "log1p", head, gamma=1.0)
    assert spy.calls == []


def test_engine_moves_inputs_to_its_device():
    clf = small(ExactPathKernelClassifier).fit(X, y)
    engine = PathKernelEngine(clf.module_, clf.path_, clf._fit_X)
    assert engine.device == CPU
    gram = engine.gram(torch.as_tensor(X_TEST), torch.as_tensor(X), b_train=True)
    np.testing.assert_array_equal(gram, clf.kernel_(X_TEST, X))


# -- CUDA: the CPU results, to rounding ---------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cls", CLASSIFIERS)
@pytest.mark.parametrize("batch_size", [None, 10])
def test_cuda_gives_the_cpu_results(cls, batch_size):
    on_cpu = small(cls, batch_size=batch_size).fit(X, y)
    on_cuda = small(cls, batch_size=batch_size, device="cuda").fit(X, y)
    assert on_cuda.device_.type == "cuda"
    assert all(p.device.type == "cuda" for p in on_cuda.module_.parameters())
    assert on_cuda.path_.weights.device == CPU  # the path stays on the host
    assert all(c.device == CPU for c in on_cuda.path_.output_gradients)
    # Same initial weights: drawn on the CPU whatever the device.
    assert torch.equal(on_cuda.path_.weights[0], on_cpu.path_.weights[0])
    cuda_outcomes = outcomes(on_cuda)
    assert_close(cuda_outcomes, outcomes(on_cpu))
    assert all(isinstance(value, np.ndarray) for value in cuda_outcomes.values())

    loaded = pickle.loads(pickle.dumps(on_cuda))
    assert loaded.device_ == on_cuda.device_
    np.testing.assert_array_equal(loaded.predict_proba(X_TEST), on_cuda.predict_proba(X_TEST))
    net = small(cls, batch_size=batch_size, device="cuda")
    transformer = PathKernelTransformer(net).fit(X, y)
    np.testing.assert_allclose(
        transformer.transform(X_TEST), on_cpu.kernel_(X_TEST, X), rtol=1e-10, atol=1e-10
    )
