"""The step-by-step decomposition's self-influence: its scalar targets and the
momentum buffers held in blocks of training points.

Independent computations: the engine's ``decompose`` of the training rows (its
diagonal), and the same self-influence with every buffer held at once.
"""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from sklearn_pathkernel import ExactPathKernelClassifier
from sklearn_pathkernel._engine import OutputTarget, QueryTargets, _stepwise


@pytest.fixture(scope="module")
def momentum_engine():
    X, y = load_digits(return_X_y=True)
    X, y = X[:45] / 16.0, y[:45]
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(7,), solver="sgd", momentum=0.9, batch_size=10, max_iter=3,
        learning_rate=0.1, random_state=0,
    ).fit(X, y)  # fmt: skip
    return clf._engine(), np.searchsorted(clf.classes_, y)


def test_buffers_in_blocks_give_the_same_sums(momentum_engine, monkeypatch):
    """Blocks of 4 training points (12 passes over the steps) against one block,
    every output and a scalar target; both the diagonal of ``decompose``."""
    engine, codes = momentum_engine
    targets = QueryTargets(OutputTarget(), torch.as_tensor(codes))
    whole = engine.stepwise().self_influence()
    whole_target = engine.stepwise().self_influence(targets=targets)
    M = engine.n_train
    expected = engine.decompose(engine.X_train).contributions[np.arange(M), np.arange(M)]
    scale = np.abs(expected).max()
    np.testing.assert_allclose(whole, expected, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(whole_target[:, 0], expected[np.arange(M), codes], rtol=0,
                               atol=1e-12 * scale)  # fmt: skip

    itemsize = 8
    monkeypatch.setattr(_stepwise, "BUFFER_BUDGET_BYTES", 4 * itemsize * engine.path.n_weights)
    stepwise = engine.stepwise()
    assert stepwise._buffer_rows() == 4
    np.testing.assert_allclose(stepwise.self_influence(), whole, rtol=0, atol=1e-14 * scale)
    np.testing.assert_allclose(
        stepwise.self_influence(targets=targets), whole_target, rtol=0, atol=1e-14 * scale
    )
    # a later first step: blocks whose points enter late skip the steps before
    late = engine.stepwise().self_influence(first_step=7, targets=targets)
    monkeypatch.setattr(_stepwise, "BUFFER_BUDGET_BYTES", 2**40)
    np.testing.assert_allclose(
        late, engine.stepwise().self_influence(first_step=7, targets=targets), rtol=0,
        atol=1e-14 * scale,
    )  # fmt: skip


def test_targets_must_cover_the_training_rows(momentum_engine):
    engine, codes = momentum_engine
    targets = QueryTargets(OutputTarget(), torch.as_tensor(codes[:5]))
    with pytest.raises(ValueError, match=r"one label per training row \(45\), got 5"):
        engine.stepwise().self_influence(targets=targets)


@pytest.mark.parametrize("dropout", [False, True])
def test_a_first_linear_layer_kept_factored(dropout, monkeypatch):
    """Momentum on an MLP (with dropout after the hidden layer, masks recorded): the
    first layer's buffer and test features kept as deltas give the sums of every
    layer materialised (``fixed_input_layers = False``) and the diagonal of
    ``decompose``; the second layer, whose input moves, is found out and
    materialised."""
    from torch import nn

    X, y = load_digits(return_X_y=True)
    X, y = X[:40] / 16.0, y[:40]
    torch.manual_seed(0)
    layers = [nn.Linear(64, 9), nn.ReLU()] + ([nn.Dropout(0.2)] if dropout else [])
    module = nn.Sequential(*layers, nn.Linear(9, 10)).double()
    clf = ExactPathKernelClassifier(
        module=module, solver="sgd", momentum=0.9, batch_size=10, max_iter=3,
        learning_rate=0.1, random_state=0,
    ).fit(X, y)  # fmt: skip
    engine, codes = clf._engine(), np.searchsorted(clf.classes_, y)
    targets = QueryTargets(OutputTarget(), torch.as_tensor(codes))
    kept = []
    own_diagonal = _stepwise.StepwiseDecomposition._own_diagonal

    def spied(self, u, own, inputs):
        kept.append(tuple(inputs))
        return own_diagonal(self, u, own, inputs)

    monkeypatch.setattr(_stepwise.StepwiseDecomposition, "_own_diagonal", spied)
    factored = engine.stepwise().self_influence()
    factored_target = engine.stepwise().self_influence(targets=targets)
    assert kept and set(kept) == {(0,)}  # the first layer, at every step
    kept.clear()
    monkeypatch.setattr(_stepwise.StepwiseDecomposition, "fixed_input_layers", False)
    generic = engine.stepwise().self_influence()
    generic_target = engine.stepwise().self_influence(targets=targets)
    assert kept and set(kept) == {()}
    M = engine.n_train
    expected = engine.decompose(engine.X_train).contributions[np.arange(M), np.arange(M)]
    scale = np.abs(expected).max()
    for found in (factored, generic):
        np.testing.assert_allclose(found, expected, rtol=0, atol=1e-12 * scale)
    for found in (factored_target, generic_target):
        np.testing.assert_allclose(
            found[:, 0], expected[np.arange(M), codes], rtol=0, atol=1e-12 * scale
        )
