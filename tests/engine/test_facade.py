"""The engine facade: it leaves the module and the path alone, converts its
settings once, and pickles."""

import numpy as np
import pytest
import torch

DTYPE = torch.float64


def test_engine_does_not_touch_module_or_path(relu_case, engine_cases):
    module, path, X, y, A = relu_case
    before = [p.detach().clone() for p in module.parameters()]
    weights = path.weights.clone()
    engine = engine_cases.engine_for(module, path, X, y)
    engine.decompose(A)
    engine.gram(A, X, b_train=True)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert torch.equal(weights, path.weights)


def test_generic_rule_per_example_gradients_match_a_loop():
    """Per-example gradients by torch.func equal autograd one example at a time.

    The distance layer uses ``torch.cdist``, whose batching rule is wrong under a
    vmap over cotangents with unbatched inputs (what ``jacrev`` does): the rule
    must batch inputs and cotangents together.
    """
    from sklearn_pathkernel._engine.rules._layer_rules import GenericRule
    from sklearn_pathkernel._nn._distance import DistanceLayer

    torch.manual_seed(0)
    layer = DistanceLayer(3, 4).to(DTYPE)
    rule = GenericRule(layer, ["memories", "bias"], ["memories", "bias"])
    x = torch.randn(5, 3, dtype=DTYPE)
    delta = torch.randn(5, 2, 4, dtype=DTYPE)
    grads = rule.factors((x,), delta, dict(layer.named_parameters())).grads
    for i in range(5):
        for k in range(2):
            layer.zero_grad()
            (layer(x[i : i + 1])[0] * delta[i, k]).sum().backward()
            expected = torch.cat([layer.memories.grad.reshape(-1), layer.bias.grad])
            torch.testing.assert_close(grads[i, k], expected, rtol=1e-12, atol=1e-14)


def test_pickled_engine_rebuilds_its_parts_and_agrees(relu_case, engine_cases):
    import pickle

    module, path, X, y, A = relu_case
    engine = engine_cases.engine_for(module, path, X, y, quadrature="riemann", n_points=7)
    expected = engine.gram(A, X, b_train=True)
    loaded = pickle.loads(pickle.dumps(engine))
    assert loaded.quadrature == "riemann" and loaded.n_outputs == engine.n_outputs
    assert loaded.probe is not engine.probe
    np.testing.assert_array_equal(loaded.gram(A, X, b_train=True), expected)


def test_an_unknown_quadrature_is_refused_at_construction(relu_case, engine_cases):
    module, path, X, y, _ = relu_case
    with pytest.raises(ValueError, match="Unknown quadrature 'simpson'"):
        engine_cases.engine_for(module, path, X, y, quadrature="simpson")
