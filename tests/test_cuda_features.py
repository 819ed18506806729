"""On a CUDA device, the features added after the GPU port give the CPU's results.

Image distance networks, the recorder of a user's loop (parameter groups, AdamW),
the explanation API and the regressors' reduced node counts: each run on CUDA and on
the CPU from the same data and seed, compared to rounding, with the sum identity
checked on the device's own output. Skipped where no CUDA device is present (CI).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from sklearn_pathkernel import (
    DistanceKernelClassifier,
    ExactPathKernelClassifier,
    ExactPathKernelRegressor,
    TrainingRecorder,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    return data.data[:120] / 16.0, data.target[:120]


def assert_close(a, b, rtol):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * max(np.abs(b).max(), 1e-300))


def test_image_distance_network_on_cuda(digits):
    X, y = digits
    params = dict(image_shape=(8, 8), max_iter=5, batch_size=40, random_state=0)
    on_cpu = DistanceKernelClassifier(**params).fit(X, y)
    on_cuda = DistanceKernelClassifier(**params, device="cuda").fit(X, y)
    assert_close(on_cuda.predict_proba(X[:5]), on_cpu.predict_proba(X[:5]), 1e-10)
    cpu_parts, cuda_parts = on_cpu.decompose(X[:3]), on_cuda.decompose(X[:3])
    assert_close(cuda_parts.contributions, cpu_parts.contributions, 1e-9)
    assert cuda_parts.residual.max() <= 1e-9


def test_explanations_on_cuda(digits):
    X, y = digits
    params = dict(hidden_layer_sizes=(16,), max_iter=5, batch_size=30, random_state=0)
    on_cpu = ExactPathKernelClassifier(**params, solver="adam").fit(X, y)
    on_cuda = ExactPathKernelClassifier(**params, solver="adam", device="cuda").fit(X, y)
    cpu_top, cuda_top = on_cpu.explain(X[:4], k=5), on_cuda.explain(X[:4], k=5)
    assert_close(cuda_top.to_frame()["contribution"], cpu_top.to_frame()["contribution"], 1e-9)
    assert_close(on_cuda.self_influence().scores, on_cpu.self_influence().scores, 1e-9)


def test_regressor_reduced_nodes_on_cuda(digits):
    X, y = digits
    params = dict(hidden_layer_sizes=(16,), max_iter=5, random_state=0)
    on_cpu = ExactPathKernelRegressor(**params).fit(X, y.astype(float))
    on_cuda = ExactPathKernelRegressor(**params, device="cuda").fit(X, y.astype(float))
    assert on_cuda._engine().nodes.per_piece == on_cpu._engine().nodes.per_piece == 1
    assert_close(
        on_cuda.decompose(X[:4]).contributions, on_cpu.decompose(X[:4]).contributions, 1e-9
    )
    assert on_cuda.decompose(X[:4]).residual.max() <= 1e-9


def _recorded_loop(device):
    X_all, y_all = load_digits(return_X_y=True)
    X = torch.tensor(X_all[:200] / 16.0, dtype=torch.float64, device=device)
    y = torch.tensor(y_all[:200], device=device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    model = model.double().to(device)
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    optimizer = torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}],
        lr=0.01,
    )
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    order = torch.randperm(200, generator=torch.Generator().manual_seed(1))
    for rows in order.split(50):
        optimizer.zero_grad()
        logits = model(X[rows.to(device)])
        recorder.rows(rows)
        F.cross_entropy(logits, y[rows.to(device)]).backward()
        optimizer.step()
    return recorder.finish(), X


def test_recorder_of_a_cuda_loop_with_parameter_groups():
    cpu_recording, X_cpu = _recorded_loop("cpu")
    cuda_recording, X_cuda = _recorded_loop("cuda")
    cpu_parts = cpu_recording.decompose(X_cpu[:4])
    cuda_parts = cuda_recording.decompose(X_cuda[:4])
    assert cuda_parts.residual.max() <= 1e-9
    assert_close(cuda_parts.contributions, cpu_parts.contributions, 1e-8)
