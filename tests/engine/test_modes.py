"""The output modes of a Gram product."""

import numpy as np
import pytest
import torch

from sklearn_pathkernel._engine._modes import OutputMode


def test_public_outputs_map_to_modes_and_back():
    assert OutputMode.of_output("trace") is OutputMode.TRACE
    assert OutputMode.of_output("full") is OutputMode.PAIRS
    assert OutputMode.PAIRS.public_output == "full"
    with pytest.raises(ValueError, match="'trace' or 'full'"):
        OutputMode.of_output("pairs")


def test_shapes_and_transposes():
    assert OutputMode.TRACE.output_shape(3) == () and OutputMode.PAIRS.output_shape(3) == (3, 3)
    assert OutputMode.TRACE.values_per_pair(3) == 1 and OutputMode.PAIRS.values_per_pair(3) == 9
    block = np.arange(2 * 4 * 3 * 5).reshape(2, 4, 3, 5)
    np.testing.assert_array_equal(OutputMode.PAIRS.transpose(block), np.einsum("nmkl->mnlk", block))
    tensor = torch.arange(8.0).reshape(2, 4)
    assert torch.equal(OutputMode.TRACE.transpose(tensor), tensor.T)


@pytest.mark.parametrize("mode", [OutputMode.TRACE, OutputMode.PAIRS])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_symmetrize_in_squares_is_the_mean_with_the_transpose_bitwise(mode, as_tensor):
    """In place, square by square (sizes that do not divide the rows), the same
    values as ``0.5 * (gram + transpose(gram))``: exactly symmetric."""
    rng = np.random.RandomState(0)
    gram = rng.randn(*((11, 11) + mode.output_shape(3)))
    expected = 0.5 * (gram + mode.transpose(gram))
    block = torch.tensor(gram) if as_tensor else gram.copy()
    result = mode.symmetrize(block, size=4)
    assert result is block
    values = result.numpy() if as_tensor else result
    np.testing.assert_array_equal(values, expected)
    np.testing.assert_array_equal(values, mode.transpose(values))
