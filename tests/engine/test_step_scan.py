"""The backward accumulation over chunks of steps (``_engine/_step_scan.py``).

A decomposition with ``step_chunks`` runs the steps of momentum, Nesterov, Adam
and AdamW as a scan with a carry: each chunk from no buffer, the carries combined
last chunk to first, each chunk's products with the carry. Checked against the
single pass (one chunk, the route the rest of the suite validates against brute
force and the network's own output) to 1e-12, for SGD, momentum, Nesterov,
coupled and decoupled weight decay, Adam, AdamW and parameter groups that differ,
full batch and mini-batches, ReLU and tanh, the K outputs and scalar targets, 1,
2 and 3 chunks of uneven sizes; the chunked sums also satisfy the sum identity
against the network's output. One test runs the chunks on a dask LocalCluster of
two worker processes.
"""

import numpy as np
import pytest
import torch
from _recorded_loops import data, run
from joblib import parallel_config
from torch import nn

from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._scheduling import StepChunks
from sklearn_pathkernel._engine._targets import MarginTarget, OutputTarget, QueryTargets

TOLERANCE = 1e-12


def _optimizer(name, model):
    first, rest = list(model[0].parameters()), [p for m in model[1:] for p in m.parameters()]
    return {
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.2),
        "momentum": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "nesterov": lambda: torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, nesterov=True
        ),
        "momentum_decay": lambda: torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05
        ),
        "adam": lambda: torch.optim.Adam(model.parameters(), lr=0.02),
        "adam_decay": lambda: torch.optim.Adam(model.parameters(), lr=0.02, weight_decay=0.05),
        "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1),
        "groups": lambda: torch.optim.SGD(
            [
                {"params": first, "momentum": 0.9},
                {"params": rest, "momentum": 0.5, "weight_decay": 0.01},
            ],
            lr=0.1,
        ),
    }[name]()


def _recording(optimizer, activation, batch_size, epochs):
    X, y = data(30)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), activation(), nn.Linear(6, 3)).double()
    return run(model, _optimizer(optimizer, model), X, y, epochs=epochs, batch_size=batch_size)


def _engine(recording, **kwargs):
    base = recording._engine()
    return PathKernelEngine(base.module, base.path, base.X_train, link=base.link, **kwargs)


def _queries(n=5):
    return torch.tensor(np.random.RandomState(3).randn(n, 4))


def _uneven(n_steps):
    """1, 2 and 3 chunks, the sizes uneven."""
    return [
        StepChunks.of_sizes([n_steps]),
        StepChunks.of_sizes([1, n_steps - 1]),
        StepChunks.of_sizes([n_steps - 3, 1, 2]),
    ]


def _assert_equal_parts(actual, expected):
    for key in ("contributions", "decay", "bias", "output", "quadrature_error"):
        scale = max(1.0, np.abs(expected[key]).max())
        np.testing.assert_allclose(
            actual[key], expected[key], rtol=0, atol=TOLERANCE * scale, err_msg=key
        )


def _assert_identity(parts, engine, X, targets=None):
    """bias + contributions + decay is the network's output (or T of it)."""
    output = engine.output(X)
    if targets is not None:
        output = targets.values(output)
    total = parts.bias + parts.contributions.sum(1) + parts.decay
    np.testing.assert_allclose(total, output.cpu().numpy(), rtol=0, atol=1e-10)


OPTIMIZERS = [
    "sgd",
    "momentum",
    "nesterov",
    "momentum_decay",
    "adam",
    "adam_decay",
    "adamw",
    "groups",
]


@pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh], ids=["relu", "tanh"])
@pytest.mark.parametrize("batching", ["mini", "full"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_chunked_steps_equal_the_single_pass(optimizer, batching, activation):
    batch_size, epochs = (8, 2) if batching == "mini" else (30, 5)
    recording = _recording(optimizer, activation, batch_size, epochs)
    n_steps = recording.n_steps_
    X = _queries()
    single = _engine(recording).decompose(X)
    for chunks in _uneven(n_steps):
        engine = _engine(recording, step_chunks=chunks)
        chunked = engine.decompose(X)
        _assert_equal_parts(chunked, single)
        _assert_identity(chunked, engine, X)
    # The integer setting: even chunks (sizes differ by one where they must).
    _assert_equal_parts(_engine(recording, step_chunks=3).decompose(X), single)


@pytest.mark.parametrize("optimizer", ["momentum", "adamw"])
@pytest.mark.parametrize("target", [OutputTarget(), MarginTarget()], ids=["output", "margin"])
def test_chunked_steps_of_a_scalar_target_equal_the_single_pass(optimizer, target):
    recording = _recording(optimizer, nn.Tanh, 8, 2)
    X = _queries()
    targets = QueryTargets(target, torch.tensor([0, 1, 2, 1, 0]))
    single = _engine(recording).decompose(X, targets=targets)
    for chunks in _uneven(recording.n_steps_)[1:]:
        engine = _engine(recording, step_chunks=chunks)
        chunked = engine.decompose(X, targets=targets)
        assert chunked.contributions.shape == (5, 30, 1)
        _assert_equal_parts(chunked, single)
        _assert_identity(chunked, engine, X, targets)


def test_chunks_with_the_fixed_input_layers_factored_or_not_agree():
    """Momentum keeps the first layer's deltas in the carry (scalar mixing); the
    generic route carries the materialised features: the same sums."""
    recording = _recording("momentum", nn.ReLU, 8, 2)
    X = _queries()
    engine = _engine(recording, step_chunks=3)
    factored = engine.decompose(X)
    engine._decomposition.fixed_input_layers = False
    generic = engine.decompose(X)
    _assert_equal_parts(factored, generic)


def test_chunks_with_several_row_tiles_and_threads():
    """Row tiles x chunks as tasks on two joblib threads: the single pass's sums."""
    recording = _recording("adam", nn.Tanh, 8, 2)
    X = _queries(9)
    single = _engine(recording).decompose(X)
    chunked = _engine(recording, step_chunks=2, n_jobs=2).decompose(X, batch_size=4)
    _assert_equal_parts(chunked, single)


def test_step_chunks_are_checked():
    with pytest.raises(ValueError, match="increasing bounds"):
        StepChunks((0, 3, 3))
    with pytest.raises(ValueError, match="increasing bounds"):
        StepChunks((1, 3))
    assert StepChunks.even(0, 2).slices == []  # (a path of no steps)
    assert StepChunks.even(7, 3).bounds == (0, 3, 5, 7)
    assert StepChunks.even(2, 5).bounds == (0, 1, 2)
    assert [s.stop - s.start for s in StepChunks.of_sizes([1, 4, 2]).slices] == [1, 4, 2]
    recording = _recording("momentum", nn.Tanh, 8, 2)
    with pytest.raises(ValueError, match="step_chunks"):
        _engine(recording, step_chunks=0)
    with pytest.raises(ValueError, match="cover 3 steps; the path has 8"):
        _engine(recording, step_chunks=StepChunks.of_sizes([1, 2])).decompose(_queries())


def test_chunks_on_a_dask_cluster_of_two_workers_equal_the_single_pass(dask_client, monkeypatch):
    distributed = pytest.importorskip("distributed")
    client = dask_client
    recording = _recording("adamw", nn.ReLU, 8, 2)
    X = _queries()
    single = _engine(recording).decompose(X)
    engine = _engine(recording, step_chunks=2, n_jobs=2)
    scattered = []
    scatter = client.scatter

    def counted(data, *args, **kwargs):
        scattered.append(data)
        return scatter(data, *args, **kwargs)

    monkeypatch.setattr(client, "scatter", counted)
    with distributed.get_task_stream(client) as stream, parallel_config(backend="dask"):
        chunked = engine.decompose(X)
    cluster_workers = set(client.scheduler_info()["workers"])
    # The chunks ran on the cluster's worker processes, not in this process, and
    # the engine's parts went to the cluster once for both passes.
    workers = {task["worker"] for task in stream.data}
    assert workers and workers <= cluster_workers
    owner = engine._decomposition
    assert sum(data is owner or data == [owner] for data in scattered) == 1
    _assert_equal_parts(chunked, single)


def test_step_chunks_of_the_estimators_and_recordings():
    """The public switch: an estimator parameter (get_params/set_params, checked,
    reaching the engine after fit) and a recording's option."""
    from sklearn.datasets import make_blobs

    from sklearn_pathkernel import ExactPathKernelClassifier

    X, y = make_blobs(n_samples=24, centers=3, n_features=4, random_state=0)
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(5,), solver="adam", max_iter=3, batch_size=8, random_state=0
    ).fit(X, y)
    assert clf.get_params()["step_chunks"] is None
    single = clf.decompose(X[:4] + 0.1)
    clf.set_params(step_chunks=3)
    assert clf._engine().step_chunks == 3
    chunked = clf.decompose(X[:4] + 0.1)
    _assert_equal_parts(chunked, single)
    with pytest.raises(ValueError, match="step_chunks"):
        clf.set_params(step_chunks=0).decompose(X[:2])

    recording = _recording("nesterov", nn.Tanh, 8, 2)
    single = recording.decompose(_queries().numpy())
    recording.step_chunks = 2
    assert recording._engine().step_chunks == 2
    _assert_equal_parts(recording.decompose(_queries().numpy()), single)
    recording.step_chunks = 0
    with pytest.raises(ValueError, match="step_chunks"):
        recording.decompose(_queries().numpy())


# (AdamW's bound: the first Linear's bias sits just before the BatchNorm, whose zero
# gradient Adam divides by a tiny second moment; the residual shows it, between 1e-10
# and 1e-8: test_batchnorm.py, test_a_bias_before_batchnorm_under_adam_shows_in_the_residual)
@pytest.mark.parametrize(
    ("optimizer", "residual_bound"), [("momentum_decay", 1e-10), ("adamw", 1e-8)]
)
def test_chunks_with_dropout_masks_and_batchnorm_statistics(optimizer, residual_bound):
    """Recorded dropout masks (the training side's own passes) and BatchNorm in
    training mode (rows coupled through their batch; the statistics' shares are
    terms of phi, in the first pass only): the single pass's sums and residual."""
    X, y = data(30)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Dropout(0.3), nn.Linear(6, 3)
    ).double()
    model.train()
    recording = run(model, _optimizer(optimizer, model), X, y, epochs=2, batch_size=8)
    queries = _queries().numpy()
    single = recording.decompose(queries)  # (its engine widens the path by the statistics)
    assert single.statistics is not None
    assert single.residual.max() <= residual_bound
    for n_chunks in (2, 3):
        recording.step_chunks = n_chunks
        chunked = recording.decompose(queries)
        _assert_equal_parts(chunked, single)
        np.testing.assert_allclose(chunked.statistics, single.statistics, rtol=0, atol=1e-12)
        np.testing.assert_allclose(chunked.residual, single.residual, rtol=0, atol=1e-14)
