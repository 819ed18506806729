"""Memory of the query-side methods: the planner's tiles, the kink search in
groups of pieces, integrals taken chunk by chunk of nodes, and the peak memory of
a decomposition of many queries measured in a fresh process."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import TrainingRecorder
from sklearn_pathkernel._engine import _features
from sklearn_pathkernel._engine import _planning as _memory
from sklearn_pathkernel._engine._features import StepFeatures
from sklearn_pathkernel._engine.integration import _kinks
from sklearn_pathkernel._engine.rules._conv import Conv2dRule, ConvGradients
from sklearn_pathkernel._engine.rules._gradients import Gradients

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPE = torch.float64
#: The bound the tests state: a decomposition's peak memory grows by at most the
#: planner's working budget and this much (what a process allocates on top of its
#: tiles: the passes' temporaries, the results, the allocator's slack).
FIXED_BYTES = 32 * 2**20
#: The working budget given to the planner in the measured process.
BUDGET_BYTES = 54_000_000


def _cnn_loop(n_extra=0, side=12, seed=0):
    """A recorded AdamW run of conv 1->8 3x3, ReLU, 2x2 max-pool, linear (2k
    weights) on 64 random images, 8 steps; and ``n_extra`` other images."""
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(64 + n_extra, 1, side, side, generator=generator, dtype=DTYPE)
    y = torch.randint(0, 4, (64,), generator=generator)
    torch.manual_seed(seed)
    width = 8 * ((side - 2) // 2) ** 2
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(width, 4)
    ).to(DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    recorder = TrainingRecorder(model, optimizer, X[:64])
    for _ in range(2):
        for start in range(0, 64, 16):
            rows = torch.arange(start, start + 16)
            optimizer.zero_grad()
            out = model(X[rows])
            recorder.rows(rows)
            F.cross_entropy(out, y[rows]).backward()
            optimizer.step()
    return recorder.finish(), X[64:]


@pytest.fixture(scope="module")
def cnn_recording():
    return _cnn_loop(n_extra=6, side=10)


def _spy(monkeypatch, owner, name):
    """Record the results of ``owner.name`` in a list, calling through."""
    seen, original = [], getattr(owner, name)

    def spy(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(owner, name, spy)
    return seen


def test_the_planner_s_query_tiles_respect_a_budget_on_a_cnn_recording(monkeypatch, cnn_recording):
    """Under a budget of two and a half rows' planned bytes, a recording's
    decomposition runs in tiles of two rows, each within the budget, and gives the
    decomposition of one tile."""
    recording, queries = cnn_recording
    expected = recording.decompose(queries)
    engine = recording._engine()
    planner = engine._planner
    nodes = engine._test_copy.nodes_per_row(queries)
    # What decompose plans per row on an AdamW path: two (M, K) results, and the
    # features, buffer and psi materialised over the weights.
    n_train, n_outputs, n_weights = 64, 4, engine._decomposition.path.n_weights
    row_bytes = 2 * 8 * n_train * n_outputs + 4 * 8 * n_outputs * n_weights
    per_row = planner.query_row_bytes(row_bytes, nodes)
    assert per_row >= _memory.NODE_FACTOR_COPIES * nodes * planner.factor_row_bytes()
    budget = int(2.5 * per_row)
    monkeypatch.setattr(_memory, "working_budget", lambda device, n_workers=1: budget)
    seen = _spy(monkeypatch, planner, "query_tiles")
    parts = recording.decompose(queries)
    sizes = [tile.stop - tile.start for tile in seen[-1]]
    assert sizes == [2, 2, 2]
    assert all(size * per_row <= budget for size in sizes)
    np.testing.assert_allclose(parts.contributions, expected.contributions, rtol=1e-12, atol=1e-14)
    assert parts.residual.max() < 1e-9


def test_the_kink_search_in_groups_of_pieces_finds_the_same_nodes(monkeypatch, cnn_recording):
    """With groups of one piece (``GROUP_STATE_BYTES`` of one byte) the search
    takes many groups per level and finds every row's nodes as at once."""
    recording, queries = cnn_recording
    engine = recording._engine()
    test_copy = engine._test_copy
    probe = test_copy.probes.current()
    step = engine._steps.step(3)
    whole = test_copy.rule.row_nodes(probe, step, queries, test_copy.n_nodes)
    groups = _spy(monkeypatch, _kinks, "_groups")
    monkeypatch.setattr(_kinks, "GROUP_STATE_BYTES", 1)
    grouped = test_copy.rule.row_nodes(probe, step, queries, test_copy.n_nodes)
    assert max(len(slices) for slices in groups) > 10  # (many groups in a level)
    assert np.bincount(whole.nodes.rows).max() > 4 * test_copy.n_nodes  # (kinks)
    for found, expected in zip(grouped.kinks, whole.kinks, strict=True):
        np.testing.assert_array_equal(found, expected)


def _conv_nodes(constant_columns, seed=0):
    """A convolution's factors at the nodes of 3 rows (shuffled), as
    ``ConvGradients``; constant columns: each row's input at all its nodes."""
    gen = torch.Generator().manual_seed(seed)
    conv = nn.Conv2d(2, 3, 3).to(DTYPE)
    rule = Conv2dRule(conv, "weight", "bias")
    n_rows, counts = 3, torch.tensor([5, 2, 6])
    rows = torch.arange(n_rows).repeat_interleave(counts)
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    weights = torch.rand(rows.numel(), generator=gen, dtype=DTYPE)
    images = torch.randn(n_rows if constant_columns else rows.numel(), 2, 5, 5, generator=gen)
    images = images.to(DTYPE)[rows] if constant_columns else images.to(DTYPE)
    deltas = torch.randn(rows.numel(), 2, 3, 3, 3, generator=gen, dtype=DTYPE)
    factors = rule.factors((images,), deltas, None)
    assert isinstance(factors, ConvGradients)
    return rule, rows, weights, factors, n_rows


@pytest.mark.parametrize("constant_columns", [True, False])
def test_a_convolution_s_integral_by_chunks_is_the_weighted_sum_of_its_nodes(
    monkeypatch, constant_columns
):
    """``StepFeatures`` of nodes in three chunks: each row's weighted sum of its
    nodes' gradients (a loop over the nodes), without joining the chunks, and the
    same as the joined route's integral."""
    rule, rows, weights, factors, n_rows = _conv_nodes(constant_columns)
    grads = factors.grads  # (E, K, W_layer): each node's gradients
    expected = torch.zeros(n_rows, *grads.shape[1:], dtype=DTYPE)
    for node in range(rows.numel()):
        expected[rows[node]] += weights[node] * grads[node]
    cuts = [slice(0, 4), slice(4, 9), slice(9, None)]
    evaluated = [
        (rows[cut], weights[cut], [ConvGradients(factors.columns[cut], factors.deltas[cut])])
        for cut in cuts
    ]
    joined = _spy(monkeypatch, _features, "_joined")
    features = StepFeatures([rule], evaluated, n_rows)
    assert not joined  # (no copy of every node's factors)
    (integral,) = features.layers[0]
    assert integral.rows is None and isinstance(integral.factors, Gradients)
    torch.testing.assert_close(integral.factors.grads, expected, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(features.materialised()[0], expected, rtol=1e-12, atol=1e-13)
    # The joined route (the rule's own integrate over all nodes at once).
    monkeypatch.setattr(_features, "_integrated_by_chunks", lambda *args: None)
    route = StepFeatures([rule], evaluated, n_rows).materialised()[0]
    torch.testing.assert_close(route, expected, rtol=1e-12, atol=1e-13)


_MEASURE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    sys.path[:0] = [{root!r}, {tests!r}]
    torch.set_num_threads(1)
    from test_query_memory import _cnn_loop
    from sklearn_pathkernel._engine import _planning

    budget = {budget}
    if budget:
        _planning.working_budget = lambda device, n_workers=1: budget
    recording, queries = _cnn_loop(n_extra=12)
    recording.decompose(queries[:1])  # (first-call allocations)
    with open("/proc/self/statm") as statm:
        before = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    recording.decompose(queries)
    # (VmHWM, this process's own peak: ru_maxrss would keep the parent's at the
    # exec, pytest's own resident memory after other tests)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
    print(json.dumps({{"growth": peak - before}}))
    """
)


def _measured_growth(budget):
    """Peak RSS growth (bytes) of a decomposition of 12 queries in a fresh process
    whose planner has ``budget`` bytes (0: the planner's own)."""
    script = _MEASURE.format(root=ROOT, tests=os.path.join(ROOT, "tests", "engine"), budget=budget)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])["growth"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_the_peak_memory_of_many_queries_stays_within_the_budget():
    """12 queries of a max-pooling CNN (about 100 nodes a row at its worst step):
    under a working budget of 51.5 MiB (tiles of 3 rows) the process's peak grows
    by at most the budget and ``FIXED_BYTES``; the same queries in one tile (the
    planner's own budget, 1 GiB at most) grow it by more: the tiles bound it."""
    tiled = _measured_growth(BUDGET_BYTES)
    assert tiled <= BUDGET_BYTES + FIXED_BYTES, tiled / 2**20
    whole = _measured_growth(0)
    assert whole > BUDGET_BYTES + FIXED_BYTES, whole / 2**20
