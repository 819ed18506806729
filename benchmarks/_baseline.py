"""An earlier commit's ``sklearn_pathkernel``, importable next to the current one.

Benchmarks that compare the engine with an earlier commit run both in one
process, interleaved, so that both see the same machine load (a shared 2-core
machine drifts by tens of percent from minute to minute). The earlier package
is exported with ``git archive`` into a cache folder under a private name
(``sklearn_pathkernel_<commit>``); its modules import each other relatively, so
it works under any name.
"""

import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(tempfile.gettempdir(), "sklearn_pathkernel_baselines")


def import_commit(rev):
    """The package ``sklearn_pathkernel`` of commit ``rev`` as a module."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short=10", rev],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    name = f"sklearn_pathkernel_{commit}"
    target = os.path.join(CACHE, name)
    if not os.path.isdir(target):
        os.makedirs(CACHE, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit, "sklearn_pathkernel"],
            cwd=REPO,
            check=True,
            capture_output=True,
        ).stdout
        staging = tempfile.mkdtemp(dir=CACHE)
        with tempfile.TemporaryFile() as tar_file:
            tar_file.write(archive)
            tar_file.seek(0)
            with tarfile.open(fileobj=tar_file) as tar:
                tar.extractall(staging, filter="data")
        os.replace(os.path.join(staging, "sklearn_pathkernel"), target)
        os.rmdir(staging)
    if CACHE not in sys.path:
        sys.path.insert(0, CACHE)
    return importlib.import_module(name)


def timed(fn):
    """``(seconds, result)`` of one call of ``fn``."""
    begin = time.perf_counter()
    result = fn()
    return time.perf_counter() - begin, result


def side_by_side(tasks, repeats):
    """``tasks``: {name: callable} (one per package); the fastest time of each and its
    last result, the calls alternated (forward, then backward) so drift hits both."""
    names = list(tasks)
    times = {name: [] for name in names}
    results = {}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            elapsed, results[name] = timed(tasks[name])
            times[name].append(elapsed)
    return {name: min(t) for name, t in times.items()}, results


def relative_difference(a, b):
    """``max |a - b| / max |a|``."""
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-300))
