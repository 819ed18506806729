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
