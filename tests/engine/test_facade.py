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
