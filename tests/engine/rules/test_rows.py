"""Row helpers: sums of node values into their rows, against plain loops."""

import torch

from sklearn_pathkernel._engine.rules._rows import padded_row_sums, row_sums

DTYPE = torch.float64


def test_padded_row_sums_equal_the_scattered_sums():
    """One weighting or several at once, rows without nodes, shuffled nodes."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.tensor([3, 0, 3, 1, 0, 3, 0])  # rows 2 and 4 have no nodes
    values = torch.randn(7, 2, 3, generator=gen, dtype=DTYPE)
    weights = torch.randn(2, 7, generator=gen, dtype=DTYPE)
    both = padded_row_sums(rows, weights, values, 5)
    assert both.shape == (2, 5, 2, 3)
    for index in range(2):
        expected = row_sums(rows, weights[index], values, 5)
        torch.testing.assert_close(both[index], expected, rtol=1e-14, atol=1e-15)
        one = padded_row_sums(rows, weights[index], values, 5)
        torch.testing.assert_close(one, expected, rtol=1e-14, atol=1e-15)
    assert not both[:, [2, 4]].any()
