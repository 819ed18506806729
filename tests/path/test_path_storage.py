"""Weight path on disk (``path_storage``): same kernels, pickling, size checks."""

import copy
import os
import pickle

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.datasets import make_blobs

from sklearn_pathkernel import ExactPathKernelClassifier
from sklearn_pathkernel._path import _weights as path_module
from sklearn_pathkernel._path import allocate_weights


@pytest.fixture(scope="module")
def data():
    X, y = make_blobs(n_samples=30, centers=3, n_features=4, random_state=0)
    return X, y


def fit(data, **params):
    X, y = data
    params = {"hidden_layer_sizes": (8,), "max_iter": 4, "random_state": 0, **params}
    return ExactPathKernelClassifier(**params).fit(X, y)


def is_memmap_backed(tensor):
    """Whether a tensor's data lies in a mapped weight file (Linux: /proc/self/maps)."""
    if not os.path.exists("/proc/self/maps"):  # pragma: no cover - not Linux
        pytest.skip("needs /proc/self/maps")
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(part, 16) for part in fields[0].split("-"))
            if low <= address < high:
                return len(fields) == 6 and "pathkernel-weights-" in fields[5]
    return False


def kernel_outputs(clf, X):
    return (
        clf.kernel_(X),
        clf.kernel_(X[:3] + 0.25, X),
        clf.decompose(X[:3] + 0.25),
    )


@pytest.mark.parametrize(("storage", "batch_size"), [("directory", None), ("disk", 10)])
def test_disk_path_gives_bitwise_identical_kernels(data, tmp_path, storage, batch_size):
    X, _ = data
    where = tmp_path if storage == "directory" else "disk"
    memory = fit(data, batch_size=batch_size)
    disk = fit(data, batch_size=batch_size, path_storage=where)

    assert memory.path_.storage == "memory"
    assert disk.path_.storage == (
        os.fspath(tmp_path) if storage == "directory" else disk.path_.storage
    )
    assert disk.path_.storage != "memory"
    assert is_memmap_backed(disk.path_.weights)
    assert not is_memmap_backed(memory.path_.weights)
    # The file is unlinked as soon as it is mapped: nothing is left behind.
    assert list(tmp_path.iterdir()) == []
    assert torch.equal(memory.path_.weights, disk.path_.weights)

    gram_m, cross_m, parts_m = kernel_outputs(memory, X)
    gram_d, cross_d, parts_d = kernel_outputs(disk, X)
    np.testing.assert_array_equal(gram_m, gram_d)
    np.testing.assert_array_equal(cross_m, cross_d)
    for key in ("contributions", "bias", "output", "residual"):
        np.testing.assert_array_equal(parts_m[key], parts_d[key])
    np.testing.assert_array_equal(memory.predict_proba(X), disk.predict_proba(X))


def test_early_stopping_on_disk_keeps_only_the_steps_taken(data):
    clf = fit(data, max_iter=200, tol=1e9, n_iter_no_change=2, path_storage="disk")
    assert clf.n_steps_ < 200
    assert clf.path_.weights.shape[0] == clf.n_steps_ + 1
    assert clf.path_.storage != "memory"
    reference = fit(data, max_iter=200, tol=1e9, n_iter_no_change=2)
    assert torch.equal(reference.path_.weights, clf.path_.weights)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copies_of_a_disk_path_are_self_contained_and_in_memory(data, how):
    """Documented behaviour: pickling writes the weights into the pickle."""
    X, _ = data
    disk = fit(data, path_storage="disk")
    copied = pickle.loads(pickle.dumps(disk)) if how == "pickle" else copy.deepcopy(disk)

    assert copied.path_storage == "disk"  # the parameter is unchanged
    assert copied.path_.storage == "memory"  # the copy's weights are in RAM
    assert not is_memmap_backed(copied.path_.weights)
    assert disk.path_.storage != "memory"  # the original is untouched
    assert is_memmap_backed(disk.path_.weights)
    assert torch.equal(copied.path_.weights, disk.path_.weights)
    np.testing.assert_array_equal(copied.kernel_(X), disk.kernel_(X))
    np.testing.assert_array_equal(
        copied.decompose(X[:3]).contributions, disk.decompose(X[:3]).contributions
    )


def test_clone_keeps_the_parameter(data, tmp_path):
    clf = ExactPathKernelClassifier(path_storage=tmp_path)
    assert clone(clf).path_storage == tmp_path


def test_path_too_large_for_memory_names_sizes_and_the_way_out(data, monkeypatch):
    monkeypatch.setattr(path_module, "available_memory", lambda: 1000)
    X, y = data
    clf = ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=4, random_state=0)
    with pytest.raises(MemoryError) as error:
        clf.fit(X, y)
    message = str(error.value)
    n_weights = 4 * 8 + 8 + 8 * 3 + 3
    assert f"4 steps x {n_weights} weights" in message
    assert f"5 x {n_weights} x 8 bytes" in message
    assert "path_storage='disk'" in message and "max_iter" in message
    assert not hasattr(clf, "path_")  # a failed fit leaves the estimator unfitted

    # The way out works: on disk the memory check does not apply.
    clf.set_params(path_storage="disk").fit(X, y)
    assert clf.path_.storage != "memory"


def test_path_too_large_for_the_disk(monkeypatch, tmp_path):
    class Usage:
        free = 100

    monkeypatch.setattr(path_module.shutil, "disk_usage", lambda directory: Usage)
    with pytest.raises(MemoryError, match="free on the disk"):
        allocate_weights(11, 5, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_mini_batch_steps_are_counted_in_the_estimate(monkeypatch):
    sizes = []
    monkeypatch.setattr(path_module, "available_memory", lambda: sizes.append(1) or float("inf"))
    weights, storage = allocate_weights(3 * 4 + 1, 10)
    assert storage == "memory" and weights.shape == (13, 10) and sizes


def test_invalid_storage(data, tmp_path):
    X, y = data
    with pytest.raises(ValueError, match="not a directory"):
        fit(data, path_storage=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="path_storage"):
        ExactPathKernelClassifier(path_storage=3).fit(X, y)


def test_astype_rounds_every_floating_tensor_and_keeps_the_rest(data):
    X, y = data
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(4,), solver="adam", max_iter=3, random_state=0
    ).fit(X, y)
    path = clf.path_
    single = path.astype(torch.float32)
    assert single.weights.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in single.output_gradients)
    assert single.update.preconditioners.dtype == torch.float32
    torch.testing.assert_close(single.weights, path.weights.float(), rtol=0, atol=0)
    assert single.batches is path.batches and single.n_steps == path.n_steps
    assert path.weights.dtype == torch.float64  # the original is untouched


def mapped_file(tensor):
    """The name of the mapped file a tensor's data lies in (Linux), or None."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(part, 16) for part in fields[0].split("-"))
            if low <= address < high and len(fields) == 6:
                return fields[5].strip()
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_allocate_weights_on_disk_in_the_run_dtype(tmp_path, dtype):
    weights, storage = allocate_weights(5, 7, tmp_path, dtype)
    assert weights.dtype == dtype and storage == os.fspath(tmp_path)
    assert is_memmap_backed(weights)
    width = 8 * weights.element_size()
    assert f".f{width} " in mapped_file(weights) + " "  # (the file's suffix: its numbers' width)
    assert list(tmp_path.iterdir()) == []


def test_float32_fit_keeps_its_path_in_float32_on_disk(data, tmp_path):
    """A float32 run's path is float32 where it is stored (half the float64 bytes);
    memory and disk give the same float32 numbers, replays and kernels, bitwise."""
    X, _ = data
    memory = fit(data, dtype="float32")
    disk = fit(data, dtype="float32", path_storage=tmp_path)
    double = fit(data)
    assert disk.path_.weights.dtype == torch.float32 and is_memmap_backed(disk.path_.weights)
    assert disk.path_.weights.nbytes * 2 == double.path_.weights.nbytes
    assert torch.equal(memory.path_.weights, disk.path_.weights)
    # the float64 replay the engine reads sits where the recorded path does
    replay = disk._engine().path
    assert replay.weights.dtype == torch.float64 and replay.storage == os.fspath(tmp_path)
    assert is_memmap_backed(replay.weights)
    assert torch.equal(memory._engine().path.weights, replay.weights)
    parts_m, parts_d = memory.decompose(X[:3] + 0.25), disk.decompose(X[:3] + 0.25)
    for key in ("contributions", "bias", "output", "residual", "model_gap"):
        np.testing.assert_array_equal(parts_m[key], parts_d[key])
    assert list(tmp_path.iterdir()) == []


def resident_file_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    pytest.skip("needs RssFile in /proc/self/status")  # pragma: no cover


def test_released_pages_leave_the_process_and_keep_their_numbers(tmp_path):
    """``release_pages`` unmaps a written weight file's pages (resident memory falls
    by about its size) and the numbers read back afterwards are the ones written."""
    if not os.path.exists("/proc/self/status"):  # pragma: no cover - not Linux
        pytest.skip("needs /proc/self/status")
    weights, _ = allocate_weights(64, 2**17, tmp_path)  # 64 MiB
    values = torch.arange(64 * 2**17, dtype=torch.float64).reshape(64, 2**17)
    weights.copy_(values)
    before = resident_file_bytes()
    assert path_module.release_pages(weights)
    assert before - resident_file_bytes() > 48 * 2**20
    assert torch.equal(weights, values)  # paged back in from the file
    # row by row, as the engine reads: a private copy, the row's pages released
    for index in (0, 17, 63):
        row = path_module.read_row(weights, index, torch.device("cpu"))
        assert torch.equal(row, values[index]) and row.data_ptr() != weights[index].data_ptr()


def test_memory_that_is_not_a_weight_file_is_never_released(tmp_path):
    """Releasing anonymous memory would zero it: refused for a tensor in RAM, a copy
    of a mapped path, and a tensor that only starts inside a mapping."""
    in_ram = torch.arange(2**20, dtype=torch.float64)
    assert not path_module.release_pages(in_ram)
    assert torch.equal(in_ram, torch.arange(2**20, dtype=torch.float64))
    weights, _ = allocate_weights(4, 1024, tmp_path)
    weights.fill_(1.5)
    copied = weights.clone()
    assert not path_module.release_pages(copied) and bool((copied == 1.5).all())
    row = path_module.read_row(in_ram.reshape(4, -1), 2, torch.device("cpu"))
    assert row.data_ptr() == in_ram.reshape(4, -1)[2].data_ptr()  # (in RAM: no copy)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_adam_paths_on_disk_give_bitwise_identical_kernels(data, tmp_path, dtype):
    """Weights and Adam's preconditioners read row by row from disk, pages released:
    the same numbers as in memory."""
    X, _ = data
    params = dict(solver="adam", epsilon=1e-4, batch_size=10, learning_rate=0.01, dtype=dtype)
    memory = fit(data, **params)
    disk = fit(data, path_storage=tmp_path, **params)
    assert is_memmap_backed(disk.path_.update.preconditioners)
    parts_m, parts_d = memory.decompose(X[:3] + 0.25), disk.decompose(X[:3] + 0.25)
    for key in ("contributions", "bias", "decay", "output", "residual", "model_gap"):
        np.testing.assert_array_equal(parts_m[key], parts_d[key])
    np.testing.assert_array_equal(memory.kernel_(X[:5]), disk.kernel_(X[:5]))
