"""Gram blocks: which kind covers a request, and the GPU's plan run on the host.

The GPU's plan (products added rule by rule, a cross Gram's training rows in
products, small products in a symmetric Gram) is checked here on the CPU
against the host's plan; tests/engine/test_dtype_and_device.py compares a real
GPU with the CPU.
"""

import numpy as np
import pytest
import torch

from sklearn_pathkernel._engine._blocks import BlockKind
from sklearn_pathkernel._engine._modes import OutputMode
from sklearn_pathkernel._engine._planning import Planner


@pytest.mark.parametrize(
    "a_train, b_train, kind",
    [
        ([1, 1], [1, 1, 1], BlockKind.TRAINING),
        ([0, 0], [1, 1, 1], BlockKind.MIXED),
        ([0, 0], [0, 0, 0], BlockKind.TEST),
        ([1, 1], [0, 0, 0], None),  # the transposed mixed block: assembled
        ([1, 0], [1, 1, 1], None),
        ([0, 0], [1, 0, 1], None),
        ([], [1, 1, 1], None),
    ],
)
def test_the_kind_that_covers_a_request(a_train, b_train, kind):
    mask = lambda flags: np.asarray(flags, dtype=bool)  # noqa: E731
    assert BlockKind.covering(mask(a_train), mask(b_train)) is kind


def test_the_gpu_plan_gives_the_host_plan_s_grams(relu_case, monkeypatch, engine_cases):
    """Products added rule by rule (``LinearRule.add_inner``), a cross Gram's
    training rows in products of ``block_size`` and products of 7 rows: the
    host's Grams to rounding, symmetric ones exactly symmetric."""
    module, path, X, y, A = relu_case
    rows = torch.cat([X[:5], A])
    mask = np.r_[np.ones(5, bool), np.zeros(A.shape[0], bool)]

    def grams(engine):
        return {
            OutputMode.TRACE: [
                engine.gram(X, a_train=True),
                engine.gram(A),
                engine.gram(rows, a_train=mask),
            ],
            OutputMode.PAIRS: [engine.gram(X, a_train=True, output="full")],
            None: [engine.gram(A, X, b_train=True)],
        }

    expected = grams(engine_cases.engine_for(module, path, X, y))
    monkeypatch.setattr(Planner, "accumulates_in_place", property(lambda self: True))
    monkeypatch.setattr(Planner, "product_tiles", Planner.sub_blocks)
    actual = grams(engine_cases.engine_for(module, path, X, y, tile_size=7))
    for mode, values in actual.items():
        for value, reference in zip(values, expected[mode], strict=True):
            np.testing.assert_allclose(value, reference, rtol=1e-12, atol=1e-14)
            if mode is not None:  # symmetric requests
                np.testing.assert_array_equal(value, mode.transpose(value))
