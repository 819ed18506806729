"""Kernel blocks on a real dask cluster (two worker processes) equal the local results."""

import numpy as np
import pytest
import torch
from joblib import parallel_config
from sklearn.datasets import make_blobs

distributed = pytest.importorskip("distributed")

from sklearn_pathkernel import ExactPathKernelClassifier  # noqa: E402
from sklearn_pathkernel._engine._facade import PathKernelEngine  # noqa: E402

RTOL = 1e-12


@pytest.fixture(scope="module")
def client(dask_client):
    return dask_client


@pytest.fixture(scope="module")
def problem():
    X, y = make_blobs(n_samples=24, centers=3, n_features=4, random_state=0)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(6,), max_iter=4, batch_size=12, random_state=0
    ).fit(X, y)
    X_t = torch.tensor(X, dtype=torch.float64)
    queries = X_t[:5] + 0.3

    def engine(n_jobs):
        # tile_size=8: several row tiles, so that tasks really are split
        return PathKernelEngine(
            clf.module_, clf.path_, clf._fit_X, n_jobs=n_jobs, tile_size=8
        )

    return engine, X_t, queries


def compute(engine, X, queries):
    return {
        "train_gram": engine.gram(X, a_train=True),
        "query_gram": engine.gram(queries, X, b_train=True),
        "test_gram": engine.gram(queries),
        "full": engine.gram(queries, X, b_train=True, output="full"),
        "decompose": engine.decompose(queries),
        "diag": engine.diag(queries),
    }


def assert_close(actual, expected):
    for key, value in expected.items():
        if isinstance(value, dict):
            for part, array in value.items():
                np.testing.assert_allclose(
                    actual[key][part],
                    array,
                    rtol=RTOL,
                    atol=RTOL * np.abs(array).max(),
                    err_msg=f"{key}.{part}",
                )
        else:
            np.testing.assert_allclose(
                actual[key], value, rtol=RTOL, atol=RTOL * np.abs(value).max(), err_msg=key
            )


@pytest.mark.slow
def test_dask_backend_matches_single_process(client, problem):
    engine, X, queries = problem
    expected = compute(engine(None), X, queries)

    with distributed.get_task_stream(client) as stream, parallel_config(backend="dask"):
        actual = compute(engine(2), X, queries)

    # The blocks really ran on the cluster's worker processes, not in this process.
    assert len(stream.data) > 0
    workers = {task["worker"] for task in stream.data}
    assert workers <= set(client.scheduler_info()["workers"])
    assert_close(actual, expected)


def test_dask_backend_matches_local_threads_exactly(client, problem):
    """Same task split (n_jobs=2) in threads and on dask: the same sums, bitwise."""
    engine, X, queries = problem
    threads = compute(engine(2), X, queries)
    with parallel_config(backend="dask"):
        on_dask = compute(engine(2), X, queries)
    for key, value in threads.items():
        if isinstance(value, dict):
            for part, array in value.items():
                np.testing.assert_array_equal(on_dask[key][part], array, err_msg=f"{key}.{part}")
        else:
            np.testing.assert_array_equal(on_dask[key], value, err_msg=key)


def test_disk_backed_path_is_shipped_to_workers(client, problem):
    """A memory-mapped path is pickled with its data, so remote workers need no file."""
    _, X, queries = problem
    Xn, y = X.numpy(), np.arange(X.shape[0]) % 3
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(6,), max_iter=3, random_state=0, path_storage="disk", n_jobs=2
    ).fit(Xn, y)
    local = clf.kernel_(Xn)
    clf.__dict__.pop("_kernel_cache", None)
    with parallel_config(backend="dask"):
        remote = clf.kernel_(Xn)
    np.testing.assert_allclose(remote, local, rtol=RTOL, atol=RTOL * np.abs(local).max())


@pytest.mark.slow
def test_the_engine_is_scattered_once_per_computation(client, problem, monkeypatch):
    """joblib's dask backend scatters the tasks' owner (network, path, training rows)
    once per call; the tasks refer to it instead of each carrying a copy."""
    from sklearn_pathkernel._engine._scheduling import SharedByTasks

    engine, X, queries = problem
    scattered = []
    scatter = distributed.Client.scatter

    def spy(self, data, *args, **kwargs):
        scattered.append(data)
        return scatter(self, data, *args, **kwargs)

    monkeypatch.setattr(distributed.Client, "scatter", spy)
    expected = engine(2).gram(queries, X, b_train=True)
    with distributed.get_task_stream(client) as stream, parallel_config(backend="dask"):
        actual = engine(2).gram(queries, X, b_train=True)
    np.testing.assert_array_equal(actual, expected)
    owners = [data for data in scattered if isinstance(data, SharedByTasks)]
    assert len(owners) == 1  # one scatter for all of the call's tasks
    assert len(stream.data) > 1  # ... which were several
    assert owners[0].__sizeof__() > engine(2).path.nbytes
