"""TestCopy: the kink searches of ``nodes_per_row``'s sample reused by ``integrate``."""

import numpy as np
import pytest

from sklearn_pathkernel._engine import _test_copy
from sklearn_pathkernel._engine.integration._quadrature import KinkSplittingRule


@pytest.mark.parametrize("n_queries", [1, 2, 3])
def test_a_small_query_set_is_searched_once_per_sampled_step(n_queries, engine_cases, monkeypatch):
    """A decomposition of one or two query rows (``SAMPLE_ROWS``) searches the
    sampled steps' kinks once, for the memory plan and the integration alike
    (three rows: each search twice, the sample being two of them); the
    contributions equal those of an engine that searches again every time."""
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
    parts = engine_cases.engine_for(module, path, X, y).decompose(A)
    n_steps, sampled = path.n_steps, _test_copy.SAMPLED_STEPS
    reused = sampled if n_queries <= _test_copy.SAMPLE_ROWS else 0
    assert len(searched) == n_steps + sampled - reused
    monkeypatch.setattr(_test_copy, "SAMPLE_ROWS", 0)  # never reused
    searched.clear()
    again = engine_cases.engine_for(module, path, X, y).decompose(A)
    assert len(searched) == n_steps + sampled
    np.testing.assert_array_equal(parts.contributions, again.contributions)
    np.testing.assert_array_equal(parts.quadrature_error, again.quadrature_error)
