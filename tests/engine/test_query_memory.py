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
from sklearn_pathkernel._engine import _features, _test_copy
from sklearn_pathkernel._engine import _planning as _memory
from sklearn_pathkernel._engine._features import MaterialisedFeatures, StepFeatures
from sklearn_pathkernel._engine._modes import OutputMode
from sklearn_pathkernel._engine.integration import _kinks
from sklearn_pathkernel._engine.integration._certificate import StepCheck, StepIntegral
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


def _small_groups(monkeypatch):
    """Passes of one piece and groups of one pass (the grouped route on a small CNN)."""
    monkeypatch.setattr(_memory, "PASS_BUDGET_BYTES", 1)
    monkeypatch.setattr(_test_copy, "NODE_GROUP_BYTES", 1)


def test_a_step_s_nodes_in_groups_give_its_materialised_features(monkeypatch, cnn_recording):
    """``integrate(..., materialised=True)`` with groups of one pass: a
    ``MaterialisedFeatures`` whose layers, directional derivative, products with
    training rows and certificate are those of every node at once (a loop over
    the groups' own ``StepFeatures`` summed by hand, and the ungrouped features)."""
    recording, queries = cnn_recording
    _small_groups(monkeypatch)
    engine = recording._engine()
    test_copy = engine._test_copy
    index, n_outputs = 2, engine.n_outputs
    whole = test_copy.integrate(index, queries, outputs_per_pair=n_outputs, measure_error=True)
    grouped = test_copy.integrate(
        index, queries, outputs_per_pair=n_outputs, measure_error=True, materialised=True
    )
    assert isinstance(grouped.features, MaterialisedFeatures)
    assert isinstance(whole.features, StepFeatures)
    # Independently: each group's nodes evaluated and materialised, summed in a loop.
    step = engine._steps.step(index)
    nodes = test_copy._row_nodes(index, queries, test_copy.n_nodes).nodes
    size = test_copy.group_nodes()
    assert nodes.rows.size > 3 * size  # (many groups)
    by_hand = None
    for begin in range(0, nodes.rows.size, size):
        chunks = test_copy.evaluate(step, queries, nodes.take(slice(begin, begin + size)))
        part = StepFeatures(test_copy.probes.current().rules, chunks, queries.shape[0], n_outputs)
        layers = part.materialised()
        if by_hand is not None:
            layers = [a + b for a, b in zip(by_hand, layers, strict=True)]
        by_hand = layers
    for found, expected, joined in zip(
        grouped.features.materialised(), by_hand, whole.features.materialised(), strict=True
    ):
        torch.testing.assert_close(found, expected, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(found, joined, rtol=1e-12, atol=1e-14)
    direction = test_copy.probes.current().params(step.direction)
    torch.testing.assert_close(
        grouped.features.directional(direction), whole.features.directional(direction)
    )
    np.testing.assert_allclose(grouped.quadrature_error, whole.quadrature_error, atol=1e-14)
    batch = engine._decomposition.X_train[:16]
    train = test_copy.probes.current().factors(step.start, batch, None)
    shape = (queries.shape[0], 16, n_outputs, n_outputs)
    products = [
        features.add_inner(train, OutputMode.PAIRS, torch.zeros(shape, dtype=DTYPE))
        for features in (grouped.features, whole.features)
    ]
    torch.testing.assert_close(*products, rtol=1e-12, atol=1e-13)


def test_the_certificate_refines_grouped_features_as_node_chunks(monkeypatch, cnn_recording):
    """A row taken as failing is searched again and replaced: with the grouped
    evaluator its materialised sums are zeroed and its new nodes' added, the same
    features as the node chunks' refinement (the other rows untouched)."""
    recording, queries = cnn_recording
    _small_groups(monkeypatch)
    engine = recording._engine()
    test_copy = engine._test_copy
    index, n_outputs, n_rows = 3, engine.n_outputs, queries.shape[0]
    step = engine._steps.step(index)
    row_nodes = test_copy._row_nodes(index, queries, test_copy.n_nodes)
    refined = []
    for evaluator in (test_copy, _test_copy.GroupedNodes(test_copy, n_outputs)):
        chunks = evaluator.evaluate(step, queries, row_nodes.nodes)
        features = evaluator.features(chunks, n_rows, n_outputs)
        errors = np.zeros(n_rows)
        errors[1] = 1.0  # (row 1 taken as failing)
        check = StepCheck(errors, np.full(n_rows, 1e-11))
        integral = test_copy.certificate.refine(
            step, queries, test_copy.rule, row_nodes, StepIntegral(chunks, features, check),
            test_copy.n_nodes, n_outputs, evaluator,
        )  # fmt: skip
        assert integral.check.failed().size == 0
        features = integral.features
        if isinstance(features, StepFeatures):  # (the node chunks' route)
            features = MaterialisedFeatures.of(features)
        refined.append(features)
    before = MaterialisedFeatures.of(
        test_copy.features(test_copy.evaluate(step, queries, row_nodes.nodes), n_rows, n_outputs)
    )
    for found, expected, first in zip(
        refined[1].materialised(), refined[0].materialised(), before.materialised(), strict=True
    ):
        torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-14)
        others = [0, *range(2, n_rows)]
        torch.testing.assert_close(found[others], first[others], rtol=1e-12, atol=1e-14)


def test_decompose_in_groups_of_nodes_is_the_decomposition(monkeypatch, cnn_recording):
    """On an AdamW recording, ``decompose`` with every step's nodes in groups of one
    pass (each group's features materialised, its factors dropped) gives the
    contributions, decay and certificate of the same passes held at once."""
    recording, queries = cnn_recording
    monkeypatch.setattr(_memory, "PASS_BUDGET_BYTES", 1)
    expected = recording.decompose(queries)
    seen = _spy(monkeypatch, _test_copy.GroupedNodes, "evaluate_with")
    monkeypatch.setattr(_test_copy, "NODE_GROUP_BYTES", 1)
    parts = recording.decompose(queries)
    assert len(seen) == recording._engine()._steps.path.n_steps  # (every step grouped)
    scale = np.abs(expected.contributions).max()
    np.testing.assert_allclose(parts.contributions, expected.contributions, atol=1e-14 * scale)
    np.testing.assert_allclose(parts.decay, expected.decay, atol=1e-14 * scale)
    np.testing.assert_allclose(parts.quadrature_error, expected.quadrature_error, atol=1e-14)
    assert np.abs(parts.residual).max() < 1e-12


def test_self_influence_in_groups_of_nodes_is_the_same(monkeypatch, cnn_recording):
    """The per-step terms (``self_influence``, ``StepwiseDecomposition``) take
    grouped nodes too: the same scores as the same passes held at once."""
    recording, _ = cnn_recording
    monkeypatch.setattr(_memory, "PASS_BUDGET_BYTES", 2**16)
    stepwise = recording._engine().stepwise()
    expected = stepwise.self_influence(first_step=6)  # (the last two steps)
    seen = _spy(monkeypatch, _test_copy.GroupedNodes, "evaluate")
    monkeypatch.setattr(_test_copy, "NODE_GROUP_BYTES", 1)
    found = stepwise.self_influence(first_step=6)
    assert seen  # (grouped)
    np.testing.assert_allclose(found, expected, rtol=0, atol=1e-13 * np.abs(expected).max())


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


_MEASURE_GROUPS = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import torch
    sys.path[:0] = [{root!r}, {tests!r}]
    torch.set_num_threads(1)
    from test_query_memory import _cnn_loop
    from sklearn_pathkernel._engine import _test_copy
    from sklearn_pathkernel._engine.integration import _kinks

    _test_copy.NODE_GROUP_BYTES = {group_bytes}
    _kinks.GROUP_STATE_BYTES = 2**21  # (the kink search's own groups small in both)
    recording, queries = _cnn_loop(n_extra=1, side=18)
    engine = recording._engine()
    test_copy, probe = engine._test_copy, engine._test_copy.probes.current()
    nodes = {count_nodes} and max(
        test_copy.rule.row_nodes(probe, engine._steps.step(s), queries, test_copy.n_nodes)
        .nodes.rows.size
        for s in range(engine._steps.path.n_steps)
    )
    recording.decompose(queries)  # (first-call allocations)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # (VmHWM from here on)
    with open("/proc/self/statm") as statm:
        before = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    parts = recording.decompose(queries)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
    print(json.dumps({{
        "growth": peak - before,
        "node_bytes": nodes * engine._planner.factor_row_bytes(),
        "contributions": parts.contributions.ravel().tolist(),
        "quadrature_error": parts.quadrature_error.tolist(),
    }}))
    """
)


def _measured_groups(group_bytes, count_nodes=False):
    """A decomposition of one query of a 18x18-image CNN in a fresh process whose
    steps evaluate nodes in groups of ``group_bytes`` of factors: its peak RSS
    growth (a second call, after the first call's allocations), the largest
    step's node factors (with ``count_nodes``; else 0), and the results. Under a
    fixed mmap threshold, so that the tensors freed go back to the system and the
    peak follows the memory held (glibc otherwise keeps freed memory of a size it
    saw freed before)."""
    script = _MEASURE_GROUPS.format(
        root=ROOT,
        tests=os.path.join(ROOT, "tests", "engine"),
        group_bytes=group_bytes,
        count_nodes=count_nodes,
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="resets VmHWM by /proc/self/clear_refs"
)
def test_nodes_in_groups_hold_less_than_the_worst_step_s_node_factors():
    """One query of a max-pooling CNN on an AdamW path (305 nodes of 88 KiB, 29.5
    MiB, at its worst step): with the nodes in groups of 1 MiB the peak grows by
    at least half of the worst step's node factors less than with every node
    held at once (41 against 69 MiB measured), and the decomposition is the
    same."""
    grouped = _measured_groups(2**20)
    whole = _measured_groups(2**40, count_nodes=True)
    assert whole["node_bytes"] > 16 * 2**20  # (a step's nodes hold 16 groups or more)
    saved = whole["growth"] - grouped["growth"]
    assert saved > 0.5 * whole["node_bytes"], (saved / 2**20, whole["node_bytes"] / 2**20)
    expected = np.asarray(whole["contributions"])
    np.testing.assert_allclose(
        grouped["contributions"], expected, rtol=0, atol=1e-14 * np.abs(expected).max()
    )
    np.testing.assert_allclose(grouped["quadrature_error"], whole["quadrature_error"], atol=1e-14)
