"""Memory checks: fail early, naming the sizes and the way out, instead of swapping."""

import os

# What one block task may hold in its output; larger requests are tiled further.
BLOCK_BUDGET_BYTES = 256 * 2**20


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
