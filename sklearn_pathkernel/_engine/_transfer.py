"""Blocks from the device to the host, as numpy arrays.

A block on the host is its array (no copy). From a GPU, a small block is one
``.cpu()`` copy; a large one (a whole training Gram: 8 GB at M = 32 000) goes
through two page-locked (pinned) buffers in turn: while one chunk is copied
from the device into one buffer, the previous chunk is copied from the other
buffer into the host array. A direct copy of the block into pageable memory
moved 1.2-1.3 GB/s on an H100 virtual machine (about 7 s for that Gram); pinned
buffers run at the link's speed, and allocating a pinned array of the whole
block each time costs as much as the copy.

Cost: one pass over the block on the device's link and one over host memory;
``2 STAGING_BYTES`` of pinned memory while it runs.
"""

import torch

#: Bytes of each of the two pinned buffers a large block is staged through; blocks
#: of at most twice this are copied directly.
STAGING_BYTES = 64 * 2**20


def to_host(block):
    """``block`` (a tensor) as a numpy array on the host, with the same values.

    Parameters
    ----------
    block : torch.Tensor

    Returns
    -------
    ndarray
    """
    if block.device.type != "cuda" or block.nbytes <= 2 * STAGING_BYTES:
        return block.cpu().numpy()
    with torch.cuda.device(block.device):
        return _staged(block)


def _staged(block):
    """A CUDA ``block`` copied to a new host array through two pinned buffers."""
    flat = block.contiguous().view(-1)
    host = torch.empty(flat.shape, dtype=block.dtype)
    size = max(1, STAGING_BYTES // block.element_size())
    buffers = [torch.empty(size, dtype=block.dtype, pin_memory=True) for _ in range(2)]
    pending = None  # (event, offset, buffer) of the chunk on its way
    for index, begin in enumerate(range(0, flat.numel(), size)):
        part = flat[begin : begin + size]
        buffer = buffers[index % 2][: part.numel()]
        buffer.copy_(part, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        if pending is not None:  # the previous chunk, while this one is on its way
            _drain(host, *pending)
        pending = (arrived, begin, buffer)
    _drain(host, *pending)
    return host.view(block.shape).numpy()


def _drain(host, arrived, begin, buffer):
    """Wait for a chunk to arrive in its pinned ``buffer``, then copy it into ``host``."""
    arrived.synchronize()
    host[begin : begin + buffer.numel()].copy_(buffer)
