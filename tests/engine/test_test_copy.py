"""TestCopy: the kink searches of ``nodes_per_row``'s sample reused by ``integrate``."""

import numpy as np
import pytest
import torch

from sklearn_pathkernel._engine import _test_copy
from sklearn_pathkernel._engine.integration._quadrature import KinkSplittingRule


@pytest.mark.parametrize("n_queries, batch_size", [(1, None), (2, None), (2, 1), (3, None)])
def test_a_small_query_set_is_searched_once_per_sampled_step(
    n_queries, batch_size, engine_cases, monkeypatch
):
    """A decomposition of one or two query rows (``SAMPLE_ROWS``) searches the
    sampled steps' kinks once, for the memory plan and the integration alike
    (three rows: each search twice, the sample being two of them), also when
    each task holds one of the two rows (``batch_size=1``: the sample's nodes of
    that row); the contributions equal those of an engine that searches again
    every time (to rounding: rows searched in one pass or apart)."""
    module, path, X, y = engine_cases.trained(
        engine_cases.SmallCNN(3), n_features=36, n=30, steps=10, lr=0.3
    )
    A = engine_cases.queries(36, n=n_queries)
    searched = []
    row_nodes = KinkSplittingRule.row_nodes

    def counted(self, probe, step, X, n_nodes):
        searched.append(X.shape[0])
        return row_nodes(self, probe, step, X, n_nodes)

    monkeypatch.setattr(KinkSplittingRule, "row_nodes", counted)
    parts = engine_cases.engine_for(module, path, X, y).decompose(A, batch_size=batch_size)
    n_steps, sampled = path.n_steps, _test_copy.SAMPLED_STEPS
    tasks = 1 if batch_size is None else n_queries
    reused = sampled * tasks if n_queries <= _test_copy.SAMPLE_ROWS else 0
    assert len(searched) == n_steps * tasks + sampled - reused
    monkeypatch.setattr(_test_copy, "SAMPLE_ROWS", 0)  # never reused
    searched.clear()
    again = engine_cases.engine_for(module, path, X, y).decompose(A, batch_size=batch_size)
    assert len(searched) == n_steps * tasks + sampled
    scale = np.abs(again.contributions).max()
    np.testing.assert_allclose(parts.contributions, again.contributions, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(parts.quadrature_error, again.quadrature_error, atol=1e-12)


def test_row_nodes_of_rows_renumbers_a_subset():
    """``RowNodes.of_rows``: the nodes, kinks and ends of the picked rows, in the
    picked order, numbered from 0."""
    from sklearn_pathkernel._engine.integration._kinks import StepEnds
    from sklearn_pathkernel._engine.integration._quadrature import Nodes, RowNodes

    nodes = Nodes(np.array([0, 0, 1, 1, 1, 2]), np.arange(6) / 6, np.arange(1, 7) / 10)
    kinks = [np.array([0.5]), np.array([0.2, 0.7]), np.array([])]
    ends = StepEnds(*(torch.arange(3.0)[:, None] + k for k in range(4)))
    picked = RowNodes(nodes, kinks, ends).of_rows([2, 1])
    np.testing.assert_array_equal(picked.nodes.rows, [0, 1, 1, 1])
    np.testing.assert_array_equal(picked.nodes.t, np.array([5, 2, 3, 4]) / 6)
    np.testing.assert_array_equal(picked.nodes.weights, np.array([6, 3, 4, 5]) / 10)
    assert [k.tolist() for k in picked.kinks] == [[], [0.2, 0.7]]
    for value, full in zip(picked.ends, ends, strict=True):
        torch.testing.assert_close(value, full[[2, 1]])
