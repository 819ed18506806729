"""Scheduler: tasks in order, threads that share torch's threads, the owner as an argument."""

from functools import partial

import pytest
import torch
from joblib import parallel_config

from sklearn_pathkernel._engine._scheduling import Scheduler, SharedByTasks


class Owner(SharedByTasks):
    """A task owner whose path is a stand-in with a size."""

    class path:  # noqa: N801 - the attribute SharedByTasks reads
        nbytes = 10**6

    def threads(self, value):
        return value, torch.get_num_threads()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def test_threads_share_torch_threads_and_restore_them(threads):
    owner = Owner()
    tasks = [partial(owner.threads, value) for value in range(6)]
    results = Scheduler(2, 0, 6).run(tasks)
    assert [value for value, _ in results] == list(range(6))  # in order
    assert {used for _, used in results} == {threads // 2}  # 2 workers x 2 torch threads
    assert torch.get_num_threads() == threads
    # One worker: torch keeps its threads.
    assert {used for _, used in Scheduler(None, 0, 6).run(tasks)} == {threads}
    # Another backend (processes, dask) is left alone.
    with parallel_config(backend="sequential"):
        assert {used for _, used in Scheduler(2, 0, 6).run(tasks)} == {threads}


def test_owner_reports_its_path_in_its_size():
    import sys

    assert sys.getsizeof(Owner()) > Owner.path.nbytes
