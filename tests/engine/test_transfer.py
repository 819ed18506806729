"""Blocks handed to the host: the same values, through pinned buffers from a GPU."""

import numpy as np
import pytest
import torch

from sklearn_pathkernel._engine import _transfer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_host_block_is_its_array():
    block = torch.arange(6.0, dtype=torch.float64).view(2, 3)
    host = _transfer.to_host(block)
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, block.numpy())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_large_block_comes_back_exactly_through_the_staging_buffers(dtype, monkeypatch):
    # 2**12 bytes a buffer: a (300, 7) block in several chunks, the last one short
    monkeypatch.setattr(_transfer, "STAGING_BYTES", 2**12)
    block = torch.randn(300, 7, dtype=dtype, device="cuda")
    host = _transfer.to_host(block)
    assert (
        isinstance(host, np.ndarray)
        and host.shape == (300, 7)
        and host.dtype == block.cpu().numpy().dtype
    )
    np.testing.assert_array_equal(host, block.cpu().numpy())
