"""Memory checks: fail early, naming the sizes and the way out, instead of swapping."""

import os

# What one block task may hold in its output; larger requests are tiled further.
BLOCK_BUDGET_BYTES = 256 * 2**20
# The factors one forward and backward pass of the probe produces. A pass has a
# fixed cost worth thousands of rows of a small network, but a batched backward
# pass over many outputs slows down once its gradients leave the cache; for an MLP
# 64-128-128-10 with 10 outputs (24 KiB of factors a row) this is 512 rows a pass,
# which was faster in a mini-batch run's cross Gram than 4 MiB or 1 MiB passes.
PASS_BUDGET_BYTES = 12 * 2**20
# What one step-major Gram task may hold on the host (its output block and one
# step's factors): at most this, and at most a quarter of the available memory.
HOST_WORKING_BYTES = 2**30


def available_memory():
    """Bytes of memory available to this process (MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return float("inf")


def check_fits(nbytes, request, remedy):
    """Raise a ``MemoryError`` naming ``request`` when ``nbytes`` will not fit."""
    available = available_memory()
    if nbytes > available:
        raise MemoryError(
            f"{request} needs about {nbytes / 2**30:.2f} GiB, but only "
            f"{available / 2**30:.2f} GiB of memory is available; {remedy}"
        )


def rows_per_tile(tile_size, row_bytes, budget=None):
    """Rows per tile: at most ``tile_size``, and few enough for ``budget`` bytes."""
    budget = BLOCK_BUDGET_BYTES if budget is None else budget
    return max(1, min(int(tile_size), int(budget // max(row_bytes, 1))))


def working_budget(device, n_workers=1):
    """Bytes one step-major Gram task may hold, out of ``n_workers`` running at once.

    On the host: ``HOST_WORKING_BYTES``, or a quarter of the available memory if
    that is less. On a GPU: half of its free memory, so that tiles grow with the
    device (one task holds a whole Gram of tens of thousands of rows).
    """
    if device.type == "cuda":
        import torch

        total = torch.cuda.mem_get_info(device)[0] // 2
    else:
        total = min(HOST_WORKING_BYTES, available_memory() // 4)
    return max(BLOCK_BUDGET_BYTES // 16, int(total // max(1, n_workers)))
