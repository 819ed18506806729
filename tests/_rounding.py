"""Equality to rounding, for results that a BLAS may round differently by shape.

A tiled computation adds each row's products in the order the BLAS picks for the
tile's shape: bitwise the untiled one's where that order does not depend on the
number of rows (so it was on the AVX-512 processors these tests first ran on), a few
units in the last place apart where it does (MKL on an AVX2 processor).
"""

import numpy as np


def assert_equal_to_rounding(actual, expected, ulps=4):
    """``actual`` equals ``expected`` to ``ulps`` units in the last place of the
    largest value of ``expected``."""
    expected = np.asarray(expected)
    scale = np.abs(expected).max()
    tolerance = ulps * np.finfo(expected.dtype).eps * scale
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance)
