"""Memory planning: requests that cannot fit fail early, and results do not depend
on the tiles, tasks and passes the planner chooses."""

import numpy as np
import pytest
import torch
from _rounding import assert_equal_to_rounding


def test_requests_that_cannot_fit_fail_early_with_sizes(relu_case, monkeypatch, engine_cases):
    from sklearn_pathkernel._engine import _planning as _memory

    module, path, X, y, A = relu_case
    engine = engine_cases.engine_for(module, path, X, y)
    monkeypatch.setattr(_memory, "available_memory", lambda: 1000)
    with pytest.raises(MemoryError, match=r"Gram of shape \(9, 30, 3, 3\).*output='trace'"):
        engine.gram(A, X, b_train=True, output="full")
    with pytest.raises(MemoryError, match="decompose on 9 rows"):
        engine.decompose(A)


def test_large_rows_are_tiled_within_the_block_budget(relu_case, monkeypatch, engine_cases):
    from sklearn_pathkernel._engine import _planning as _memory

    module, path, X, y, A = relu_case
    reference = engine_cases.engine_for(module, path, X, y).gram(A, X, b_train=True, output="full")
    monkeypatch.setattr(_memory, "BLOCK_BUDGET_BYTES", 8 * 30 * 9 * 2)  # two rows per block
    engine = engine_cases.engine_for(module, path, X, y)
    assert len(engine._planner.tiles(9, 8 * 30 * 9)) == 5
    np.testing.assert_allclose(
        engine.gram(A, X, b_train=True, output="full"), reference, rtol=1e-12
    )


@pytest.mark.slow
def test_gram_tasks_split_by_the_working_budget(relu_case, monkeypatch, engine_cases):
    """With a working budget too small for one task, the rows are split into
    several step-major tasks (and the symmetric Gram's tiles mirrored between
    them), with products of ``tile_size`` rows inside each: every block equals
    the one-task result."""
    from sklearn_pathkernel._engine import _planning as _memory
    from sklearn_pathkernel._engine._blocks import BlockKind

    module, path, X, y, A = relu_case
    rows = torch.cat([X[:8], A])
    on_train = np.r_[np.ones(8, bool), np.zeros(len(A), bool)]

    def grams(engine):
        return [
            engine.gram(X, a_train=True),
            engine.gram(A, X, b_train=True),
            engine.gram(A, X, b_train=True, output="full"),
            engine.gram(X[:11], X, a_train=True, b_train=True, output="full"),
            engine.gram(rows, a_train=on_train),
        ]

    expected = grams(engine_cases.engine_for(module, path, X, y))
    monkeypatch.setattr(_memory, "working_budget", lambda device, n_workers=1: 1)
    engine = engine_cases.engine_for(module, path, X, y, tile_size=4)
    tiles = engine._planner.task_tiles(BlockKind.TRAINING, X.shape[0], X.shape[0], 1, 3)
    assert len(tiles) > 2
    for actual, reference in zip(grams(engine), expected, strict=True):
        np.testing.assert_allclose(actual, reference, rtol=1e-12, atol=1e-15)


def test_results_do_not_depend_on_the_pass_size(relu_case, monkeypatch, engine_cases):
    """One row per forward and backward pass (a tiny pass budget) gives the same
    Grams, diagonal and decomposition as the default passes."""
    from sklearn_pathkernel._engine import _planning as _memory

    module, path, X, y, A = relu_case

    def results(engine):
        parts = engine.decompose(A)
        return [
            engine.gram(X, a_train=True),
            engine.gram(A, X, b_train=True, output="full"),
            engine.diag(A),
            parts.contributions,
            parts.quadrature_error,
        ]

    expected = results(engine_cases.engine_for(module, path, X, y))
    monkeypatch.setattr(_memory, "PASS_BUDGET_BYTES", 1)
    engine = engine_cases.engine_for(module, path, X, y)
    assert engine._planner.pass_rows() == 1
    for actual, reference in zip(results(engine), expected, strict=True):
        np.testing.assert_allclose(actual, reference, rtol=1e-12, atol=1e-15)


def test_a_gpu_plans_capped_products_in_place_and_the_host_keeps_its_own(monkeypatch):
    """On a GPU (planned here without one): products of at most ``GPU_BLOCK_ROWS``
    rows however large the budget, a cross Gram's training rows in such products,
    and products added into the block rule by rule; on the host, ``tile_size``,
    ``tiles`` and sums."""
    from sklearn_pathkernel._engine import _planning
    from sklearn_pathkernel._engine._scheduling import Scheduler

    monkeypatch.setattr(_planning, "working_budget", lambda device, n_workers=1: 2**40)

    def planner(device):
        scheduler = Scheduler(None, 0, 3)
        return _planning.Planner(torch.device(device), 512, 4, None, scheduler, None, None, None)

    gpu, host = planner("cuda"), planner("cpu")
    assert gpu.block_size() == gpu.block_size(100) == _planning.GPU_BLOCK_ROWS
    assert host.block_size() == 512
    assert gpu.product_tiles(10000) == gpu.sub_blocks(10000)
    assert [t.stop - t.start for t in gpu.product_tiles(10000)] == [4096, 4096, 1808]
    assert host.product_tiles(1300) == host.tiles(1300)
    assert gpu.accumulates_in_place and not host.accumulates_in_place


def _cnn_case(engine_cases):
    from sklearn_pathkernel._training import SolverSettings

    cases = engine_cases
    module, path, X, y = cases.trained(
        cases.SmallCNN(3), n=24, n_features=36, steps=6, solver=SolverSettings("adamw"), lr=0.05
    )
    return module, path, X, y, cases.queries(36, n=6)


def test_query_tiles_hold_the_nodes_rows_really_take(monkeypatch, engine_cases):
    """A CNN with max-pooling takes many nodes per row (one piece per kink): the
    tiles of a decomposition and a self-influence come from the nodes measured on
    a sample, so that a budget of two rows' node factors holds two rows, and the
    results do not depend on the tiles."""
    from sklearn_pathkernel._engine import _planning as _memory
    from sklearn_pathkernel._engine import _stepwise

    module, path, X, y, A = _cnn_case(engine_cases)
    engine = engine_cases.engine_for(module, path, X, y)
    expected = engine.decompose(A)
    influence = engine.stepwise().self_influence()

    test_copy = engine._test_copy
    nodes = test_copy.nodes_per_row(A)
    # Independently: the rule's nodes of the sampled rows at the path's first and last step.
    probe = test_copy.probes.current()
    for index in (0, path.n_steps - 1):
        step = engine._steps.step(index)
        counted = test_copy.rule.row_nodes(probe, step, A[[0, -1]], test_copy.n_nodes)
        assert nodes >= np.bincount(counted.nodes.rows).max()
    assert nodes > 2 * test_copy.n_nodes  # kinks: many pieces

    planner = engine._planner
    # What decompose holds per row on an Adam path: two (M, K) results, and the
    # features, buffer and psi materialised over the weights.
    row_bytes = 2 * 8 * X.shape[0] * 3 + 4 * 8 * 3 * path.n_weights
    per_row = planner.query_row_bytes(row_bytes, nodes)
    assert per_row >= _memory.NODE_FACTOR_COPIES * nodes * planner.factor_row_bytes()
    tiles = planner.query_tiles(A.shape[0], row_bytes, nodes, budget=2 * per_row)
    assert [t.stop - t.start for t in tiles] == [2, 2, 2]
    assert len(planner.query_tiles(A.shape[0], row_bytes, nodes, budget=1)) == A.shape[0]

    # The decomposition with a budget of two rows: three tiles, the same sums.
    monkeypatch.setattr(_memory, "working_budget", lambda device, n_workers=1: 2 * per_row)
    small = engine_cases.engine_for(module, path, X, y)
    seen = []
    query_tiles = small._planner.query_tiles
    monkeypatch.setattr(
        small._planner,
        "query_tiles",
        lambda *args, **kwargs: seen.append(query_tiles(*args, **kwargs)) or seen[-1],
    )
    parts = small.decompose(A)
    assert [t.stop - t.start for t in seen[-1]] == [2, 2, 2]
    np.testing.assert_allclose(parts.contributions, expected.contributions, rtol=1e-12, atol=1e-14)
    # The self-influence's tiles: its budget over the measured per-row bytes.
    monkeypatch.setattr(_stepwise, "ROW_BUDGET_BYTES", 3 * per_row)
    stepwise = small.stepwise()
    features = 3 * 8 * 3 * path.n_weights  # three K W arrays per row
    training_row = planner.query_row_bytes(features, test_copy.nodes_per_row(X))
    assert stepwise._tile_rows(X) == 3 * per_row // training_row < X.shape[0]
    np.testing.assert_allclose(stepwise.self_influence(), influence, rtol=1e-12, atol=1e-14)
    # The mixed Gram's query rows: tiles from their measured nodes too.
    from sklearn_pathkernel._engine._blocks import BlockKind

    gram = engine.gram(A, X, b_train=True)
    mixed = small._planner.task_tiles(BlockKind.MIXED, A.shape[0], X.shape[0], 1, 3, nodes)
    assert len(mixed) > 1
    np.testing.assert_allclose(small.gram(A, X, b_train=True), gram, rtol=1e-12, atol=1e-14)


def test_decompose_batch_size_caps_the_tiles(relu_case, engine_cases):
    from sklearn_pathkernel import ExactPathKernelClassifier

    module, path, X, y, A = relu_case
    engine = engine_cases.engine_for(module, path, X, y)
    expected = engine.decompose(A)
    parts = engine.decompose(A, batch_size=2)
    np.testing.assert_allclose(parts.contributions, expected.contributions, rtol=1e-12, atol=1e-15)
    # (rounding-level estimates, about 1.5e-15 here: the first layer's per-step
    # products are taken over each tile's rows, so tiles round them differently)
    np.testing.assert_allclose(parts.quadrature_error, expected.quadrature_error, atol=1e-14)
    with pytest.raises(ValueError, match="batch_size == 0, must be >= 1"):
        engine.decompose(A, batch_size=0)
    with pytest.raises(TypeError, match="batch_size must be an instance of int"):
        engine.decompose(A, batch_size=1.5)
    # The estimators and recordings pass it through.
    Xn, yn = X.numpy(), y.numpy()
    clf = ExactPathKernelClassifier(hidden_layer_sizes=(4,), max_iter=3, random_state=0)
    clf.fit(Xn, yn)
    np.testing.assert_allclose(
        clf.decompose(A.numpy(), batch_size=1).contributions,
        clf.decompose(A.numpy()).contributions,
        rtol=1e-12,
        atol=1e-15,
    )


def test_accumulated_features_are_counted_for_the_tiles_held_at_once(engine_cases, monkeypatch):
    """Momentum's test features are materialised per tile, not per row of the
    call: with memory for a few tiles' features (not for every row's), a
    decomposition in small tiles runs and equals the untiled one; with less
    than one tile's, it is refused before any work, naming the request."""
    from sklearn_pathkernel._engine import _planning as _memory
    from sklearn_pathkernel._training import SolverSettings

    module = engine_cases.mlp([5, 7, 6, 3])
    module, path, X, y = engine_cases.trained(
        module, n=24, steps=6, lr=0.1, solver=SolverSettings(solver="sgd", momentum=0.9),
        batch_size=8,
    )  # fmt: skip
    engine = engine_cases.engine_for(module, path, X, y)
    A = torch.randn(40, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = engine.decompose(A)
    feature_bytes = 4 * 8 * 3 * path.n_weights  # a row's features, buffer and psi
    results_bytes = 8 * 24 * 3 * 2 * len(A)  # every row's results (one worker)
    assert feature_bytes * len(A) > 10 * feature_bytes * 2  # all rows' would not fit
    monkeypatch.setattr(_memory, "available_memory", lambda: results_bytes + 10 * feature_bytes)
    found = engine.decompose(A, batch_size=2)
    assert_equal_to_rounding(found.contributions, expected.contributions)
    monkeypatch.setattr(_memory, "available_memory", lambda: results_bytes + feature_bytes)
    with pytest.raises(MemoryError, match="decompose on 40 rows.*batch_size"):
        engine.decompose(A, batch_size=2)


def test_the_cotangents_a_backward_pass_holds_bound_its_rows(monkeypatch, engine_cases):
    """``cotangent_row_bytes`` is what the probe's backward pass returns at the
    layers' outputs per row (counted in that pass: every output, or one; a
    min-pool's winners at full resolution, an upper bound), and passes hold
    ``PASS_COTANGENT_BYTES`` of it, however small the factors."""
    from sklearn_pathkernel._engine import _planning, _probe
    from sklearn_pathkernel._engine.rules._protocol import PooledCotangent

    clf, _, _ = engine_cases.image_distance_classifier(24, 3)
    engine = clf.kernel_.engine
    planner = engine._planner
    held = []
    layer_cotangents = _probe._layer_cotangents

    def counted(out, grad, n_outputs):
        if isinstance(grad, PooledCotangent):  # (the planner's bound: at full resolution)
            held.append(grad.shape.numel() * grad.values.element_size())
        else:
            held.append(0 if grad is None else grad.nbytes)
        return layer_cotangents(out, grad, n_outputs)

    monkeypatch.setattr(_probe, "_layer_cotangents", counted)
    probe, start, x = planner.probes.current(), planner.steps.weights(0), engine.X_train[:2]
    for one_output in (False, True):
        held.clear()
        outputs = torch.zeros(2, dtype=torch.long) if one_output else None
        probe.factors(start, x, outputs)
        assert planner.cotangent_row_bytes(one_output) == sum(held) // 2 > 0
    assert planner.cotangent_row_bytes() == engine.n_outputs * planner.cotangent_row_bytes(True)
    # the cotangents, not the factors, set the rows
    monkeypatch.setattr(_planning, "PASS_BUDGET_BYTES", 2**40)
    monkeypatch.setattr(_planning, "PASS_COTANGENT_BYTES", 3 * planner.cotangent_row_bytes())
    assert planner.pass_rows() == 3
    assert planner.pass_rows(one_output=True) == 3 * engine.n_outputs
    monkeypatch.setattr(_planning, "PASS_COTANGENT_BYTES", 1)
    assert planner.pass_rows() == 1


def test_passes_bounded_by_their_cotangents_equal_one_pass(monkeypatch, engine_cases):
    """A cross Gram (every output) and a decomposition of an image network in
    passes of three rows (a small cotangent budget) equal those in one pass."""
    from sklearn_pathkernel._engine import _planning

    clf, _, Q = engine_cases.image_distance_classifier(24, 3)
    A = torch.tensor(Q)

    def results(budget):
        monkeypatch.setattr(_planning, "PASS_BUDGET_BYTES", 2**40)
        monkeypatch.setattr(_planning, "PASS_COTANGENT_BYTES", budget)
        clf.__dict__.pop("_kernel_cache", None)
        engine = clf.kernel_.engine
        rows = engine._planner.pass_rows()
        parts = engine.decompose(A)
        gram = engine.gram(A, engine.X_train, b_train=True, output="full")
        return rows, [np.asarray(gram), parts.contributions, parts.output]

    rows, expected = results(2**40)
    assert rows >= 24
    few = 3 * clf.kernel_.engine._planner.cotangent_row_bytes()
    rows, found = results(few)
    assert rows == 3
    for actual, reference in zip(found, expected, strict=True):
        scale = np.abs(reference).max()
        assert scale > 0
        assert np.abs(actual - reference).max() <= 1e-15 * scale


def test_factored_products_chunk_for_the_cache_on_the_host_only():
    """A chunk of a layer's factored products holds a cache's worth on the host and
    a block's budget on a GPU (no CUDA needed to name the device)."""
    from sklearn_pathkernel._engine import _planning

    assert _planning.dots_chunk_bytes(torch.device("cpu")) == _planning.DOTS_CHUNK_BYTES
    assert _planning.dots_chunk_bytes(torch.device("cuda")) == _planning.BLOCK_BUDGET_BYTES
    assert _planning.DOTS_CHUNK_BYTES < _planning.BLOCK_BUDGET_BYTES
