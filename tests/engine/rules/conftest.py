"""Shared references of the layer-rule tests."""

import pytest
import torch

from sklearn_pathkernel._engine.rules._contract import contract


def _metric_reference(g_left, scale, g_right, mode):
    """``<g_left, scale * g_right>`` in ``mode`` from materialised gradients."""
    return contract(g_left * scale, g_right, mode)


def _assert_metric_close(actual, reference):
    """Equal to 1e-12, relative to the reference's largest entry."""
    torch.testing.assert_close(
        actual, reference, rtol=1e-12, atol=1e-12 * reference.abs().max().item()
    )


@pytest.fixture
def metric_reference():
    """The materialised reference of ``metric_inner`` (a function)."""
    return _metric_reference


@pytest.fixture
def assert_metric_close():
    """The tolerance of the metric products against their reference (a function)."""
    return _assert_metric_close
