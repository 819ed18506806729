"""The engine on another device or dtype, over the same recorded path.

- CUDA (skipped without it): the engine built on a GPU copy of the module and
  rows gives the CPU engine's Grams, diagonal and decomposition to 1e-12, on the
  same recorded path (no second training run whose rounding would differ), also
  where the output subspaces, the GPU's large tiles, small products and the
  pinned staging buffers are in play.
- float32 (runs anywhere): the engine on a float32 copy of the path computes in
  float32 and stays close to float64, with a certificate that reports the float32
  quadrature error instead of refining without end.
"""

import copy

import numpy as np
import pytest
import torch

from sklearn_pathkernel._engine import _planning, _transfer
from sklearn_pathkernel._engine._facade import PathKernelEngine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def recorded(cases, sizes, n, steps):
    """A ReLU MLP of ``sizes`` trained on ``n`` rows, its path and nine queries
    (``cases``: the ``engine_cases`` builders)."""
    module, path, X, _ = cases.trained(
        cases.mlp(sizes), n=n, n_features=sizes[0], n_classes=sizes[-1], steps=steps, lr=0.3
    )
    return module, path, X, cases.queries(sizes[0], n=9)


def engine_on(module, path, X, device="cpu", dtype=torch.float64):
    module = copy.deepcopy(module).to(device=device, dtype=dtype)
    return PathKernelEngine(module, path, X.to(device=device, dtype=dtype))


def results(engine, X, A, many=None):
    """Grams, diagonal and decomposition; the trace cross Gram of ``many`` queries
    (``A`` when None)."""
    parts = engine.decompose(A)
    return {
        "train": engine.gram(X, a_train=True),
        "cross": engine.gram(A if many is None else many, X, b_train=True),
        "cross_full": engine.gram(A, X, b_train=True, output="full"),
        "test": engine.gram(A),
        "diag": engine.diag(A),
        "contributions": parts.contributions,
        "output": parts.output,
        "quadrature_error": parts.quadrature_error,
    }


def assert_agree(actual, expected, rtol):
    for name, reference in expected.items():
        value = actual[name]
        assert isinstance(value, np.ndarray), name
        scale = max(np.abs(reference).max(), 1e-300)
        error = np.abs(value - reference).max() / scale
        assert error <= rtol, f"{name}: {error:.1e} relative to its largest entry"


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes, n, steps, small",
    [
        ((4, 8, 3), 30, 6, False),  # tiny: one tile everywhere
        # output subspaces on (their two-level QR: more than 2 x TSQR_ROWS rows), the
        # cross Gram's large tiles; with small products and staging buffers: a
        # symmetric Gram of several products, copied to the host in many chunks
        ((6, 32, 32, 4), 2500, 3, False),
        ((6, 32, 32, 4), 2500, 2, True),
    ],
)
def test_cuda_engine_gives_the_cpu_results_on_the_same_path(
    sizes, n, steps, small, monkeypatch, engine_cases
):
    if small:
        monkeypatch.setattr(_planning, "GPU_BLOCK_ROWS", 700)
        monkeypatch.setattr(_transfer, "STAGING_BYTES", 2**16)
    module, path, X, A = recorded(engine_cases, sizes, n, steps)
    many = None
    if n > 1000:  # enough query nodes for the output subspaces of the trace cross Gram;
        A, many = A[:3], torch.cat([A] * 30)  # the test x test Gram of few (shared nodes)
    on_cpu = results(engine_on(module, path, X), X, A, many)
    cuda_many = None if many is None else many.cuda()
    on_cuda = results(engine_on(module, path, X, "cuda"), X.cuda(), A.cuda(), cuda_many)
    residual = on_cpu.pop("quadrature_error"), on_cuda.pop("quadrature_error")
    assert_agree(on_cuda, on_cpu, 1e-12)
    assert np.all(residual[1] <= 1e-10) and np.all(residual[0] <= 1e-10)
    np.testing.assert_array_equal(on_cuda["train"], on_cuda["train"].T)


def test_float32_engine_is_close_to_float64_and_certifies_its_own_error(engine_cases):
    module, path, X, A = recorded(engine_cases, (5, 12, 10, 3), 40, 8)
    double = results(engine_on(module, path, X), X, A)
    engine = engine_on(module, path.astype(torch.float32), X, dtype=torch.float32)
    X, A = X.float(), A.float()
    single = results(engine, X, A)
    residual = single.pop("quadrature_error")
    assert single["train"].dtype == np.float32
    assert_agree(single, {k: v for k, v in double.items() if k != "quadrature_error"}, 1e-5)
    # The identity holds to float32 rounding, and the certificate says so: above
    # float64's 1e-11, far below what a missed kink would cost.
    parts = engine.decompose(A)
    identity = np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max()
    assert identity < 1e-4
    assert 1e-9 < residual.max() < 1e-4
