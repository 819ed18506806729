"""Row helpers: sums of node values into their rows, against plain loops."""

import torch

from sklearn_pathkernel._engine.rules._rows import (
    padded_by_row,
    padded_row_sums,
    row_outer_sums,
    row_sums,
)

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


def test_padded_by_row_holds_each_rows_entries_in_order_then_zeros():
    """Against a plain loop; the outer sums of the blocks are row_outer_sums."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.tensor([3, 0, 3, 1, 0, 3, 0])  # rows 2 and 4 have no entries
    left = torch.randn(7, 4, generator=gen, dtype=DTYPE)
    right = torch.randn(7, 3, generator=gen, dtype=DTYPE)
    blocks = padded_by_row(rows, 5, left, right)
    assert [block.shape for block in blocks] == [(5, 3, 4), (5, 3, 3)]
    for values, block in zip((left, right), blocks, strict=True):
        for row in range(5):
            entries = values[rows == row]
            assert torch.equal(block[row, : len(entries)], entries)
            assert not block[row, len(entries) :].any()
    sums = blocks[0].transpose(1, 2) @ blocks[1]
    torch.testing.assert_close(sums, row_outer_sums(rows, left, right, 5), rtol=0, atol=0)
