"""The generic layer rule: per-example gradients of any layer by ``torch.func``."""

import torch

from sklearn_pathkernel._engine.rules._generic import GenericRule
from sklearn_pathkernel._engine.rules._protocol import RowWeights
from sklearn_pathkernel._nn._distance import DistanceLayer


def test_generic_rule_per_example_gradients_match_a_loop():
    """Per-example gradients by torch.func equal autograd one example at a time.

    The distance layer uses ``torch.cdist``, whose batching rule is wrong under a
    vmap over cotangents with unbatched inputs (what ``jacrev`` does): the rule
    must batch inputs and cotangents together.
    """
    torch.manual_seed(0)
    layer = DistanceLayer(3, 4).to(torch.float64)
    rule = GenericRule(layer, ["memories", "bias"], ["memories", "bias"])
    x = torch.randn(5, 3, dtype=torch.float64)
    delta = torch.randn(5, 2, 4, dtype=torch.float64)
    grads = rule.factors((x,), delta, RowWeights(dict(layer.named_parameters()))).grads
    for i in range(5):
        for k in range(2):
            layer.zero_grad()
            (layer(x[i : i + 1])[0] * delta[i, k]).sum().backward()
            expected = torch.cat([layer.memories.grad.reshape(-1), layer.bias.grad])
            torch.testing.assert_close(grads[i, k], expected, rtol=1e-12, atol=1e-14)
