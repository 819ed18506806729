"""``dtype="float32"``: the network trained in float32, the kernel of its float64 replay.

Independent computations: the float64 cross-entropy gradient by autograd at the
replayed weights (plain full-batch gradient descent: ``w_{s+1} - w_s = -lr G_s``);
the float64 network at the replayed final weights by ``functional_call``; the
float32 network's own forward pass; the replay bound's formula written out.
"""

import copy
import pickle

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.utils._param_validation import InvalidParameterError
from torch import nn
from torch.func import functional_call

from sklearn_pathkernel import (
    DistanceKernelClassifier,
    ExactPathKernelClassifier,
    ExactPathKernelRegressor,
    RecordingRefused,
)
from sklearn_pathkernel._training._replay import replay_bound, replay_differences

F32, F64 = torch.float32, torch.float64


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    return X[:200] / 16.0, y[:200]


def fit(X, y, **params):
    settings = dict(hidden_layer_sizes=(16,), max_iter=2, batch_size=50, random_state=0)
    return ExactPathKernelClassifier(**{**settings, **params}).fit(X, y)


def check_replayed_decomposition(clf, queries):
    """The identity against the float64 network at the replayed final weights, and the
    model gap against the float32 network's own output."""
    parts = clf.decompose(queries)
    path = clf._engine().path
    module64 = copy.deepcopy(clf.module_).double()
    Q = torch.as_tensor(queries)
    with torch.no_grad():
        final = path.unflatten(path.weights[-1])
        output = torch.log_softmax(functional_call(module64, final, (Q,)), dim=1).numpy()
        own = torch.log_softmax(clf.module_(Q.float()), dim=1).double().numpy()
    np.testing.assert_array_equal(parts.output, output)
    total = parts.bias + parts.contributions.sum(axis=1) + parts.decay
    assert np.abs(total - output).max() <= 1e-9
    assert parts.residual.max() <= 1e-9
    np.testing.assert_array_equal(parts.model_gap, np.abs(own - output).max(axis=1))
    return parts


def test_float32_fit_trains_and_records_in_float32(digits):
    X, y = digits
    clf = fit(X, y, dtype="float32")
    assert all(p.dtype == F32 for p in clf.module_.parameters())
    assert clf.path_.weights.dtype == F32
    assert all(g.dtype == F32 for g in clf.path_.output_gradients)
    single = fit(X, y)
    assert clf.path_.weights.nbytes * 2 == single.path_.weights.nbytes
    # w_0 is the float64 initialisation rounded to float32
    np.testing.assert_array_equal(clf.path_.weights[0], single.path_.weights[0].float())
    # predictions are the float32 network's
    with torch.no_grad():
        own = torch.softmax(clf.module_(torch.as_tensor(X, dtype=F32)), dim=1).double()
    np.testing.assert_allclose(clf.predict_proba(X), own.numpy(), rtol=1e-6, atol=1e-7)
    assert (clf.predict(X) == single.predict(X)).mean() > 0.95


def test_full_batch_float32_path_is_gradient_descent_plus_its_rounding(digits):
    """The float32 run's moves, less their rounding moves, are -lr times the float64
    gradient, by autograd at the recorded weights, of the recorded output gradients'
    linear form ``-sum_i <e_{s,i}, f(x_i; w)>`` (the e_{s,i} are the float32 run's)."""
    X, y = digits
    clf = fit(X, y, dtype="float32", batch_size=None, max_iter=4, learning_rate=0.3)
    path = clf._engine().path
    assert path.weights.dtype == F64 and clf.path_.weights.dtype == F32
    module64 = copy.deepcopy(clf.module_).double()
    X64 = torch.as_tensor(X)
    for step in range(path.n_steps):
        weights = path.unflatten(path.weights[step])
        params = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
        f = torch.log_softmax(functional_call(module64, params, (X64[path.batches[step]],)), 1)
        e = path.output_gradients[step].double()
        grads = torch.autograd.grad(-(f * e).sum(), list(params.values()))
        gradient = torch.cat([g.reshape(-1) for g in grads])
        move = path.weights[step + 1] - path.weights[step] - path.rounding_moves[step]
        assert (move + 0.3 * gradient).abs().max() <= 1e-15 * float(path.weights[step].abs().max())
    # the float32 run's own weights; its rounding moves within its rounding
    assert torch.equal(path.weights, clf.path_.weights.double())
    assert 0 < path.rounding_moves.abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("solver", "margin"),
    [
        (dict(solver="sgd", momentum=0.9, learning_rate=0.05), 20),
        (dict(solver="adam", epsilon=1e-4, learning_rate=0.01), 4),
    ],
    ids=["sgd-momentum", "adam-eps1e-4"],
)
def test_float32_fit_is_exact_for_its_float64_replay(digits, solver, margin):
    """SGD with momentum stays within 1/20 of the replay bound, Adam (epsilon 1e-4:
    its preconditioner at most 1e4) measured at 0.06 of it."""
    X, y = digits
    clf = fit(X, y, dtype="float32", weight_decay=1e-3, **solver)
    parts = check_replayed_decomposition(clf, X[:4] + 0.01)
    assert 0 < parts.model_gap.max() <= 1e-5
    bounds = replay_bound(clf.path_)
    differences = replay_differences(clf.path_, clf._engine().path)
    assert max(differences[k] / bounds[k] for k in bounds) < 1 / margin


def test_float64_fit_has_no_model_gap(digits):
    X, y = digits
    clf = fit(X, y)
    parts = clf.decompose(X[:3])
    np.testing.assert_array_equal(parts.model_gap, np.zeros(3))
    assert clf._engine().path is clf.path_


def test_adam_whose_gradients_round_to_zero_is_exact_with_its_rounding(digits):
    """Adam's default epsilon (1e-8): at step 0 an output bias's gradient can be zero in
    exact arithmetic (zero output layer, a class with a tenth of the batch), 1e-8 in
    float32, and 1 / (sqrt(v) + eps) ~ 5e7 makes that a move of half the learning
    rate. No training row made that move: anchored at the float32 weights, it is the
    step's rounding move, part of the decay term, and the identity is exact for the
    float32 weights."""
    X, y = digits
    clf = ExactPathKernelClassifier(
        hidden_layer_sizes=(16,), max_iter=2, batch_size=50, random_state=0,
        solver="adam", learning_rate=0.01, dtype="float32",
    ).fit(X, y)  # fmt: skip
    path = clf._engine().path
    assert torch.equal(path.weights, clf.path_.weights.double())
    assert path.rounding_moves.abs().max() >= 1e-3  # (half the learning rate)
    parts = clf.decompose(X[:3])
    # (to float64 rounding of the contributions: the rows' gradients at that bias cancel,
    # each multiplied by Adam's 1 / (sqrt(v) + eps) ~ 5e7)
    scale = np.abs(parts.contributions).sum(axis=1).max()
    assert parts.residual.max() <= 1e-14 * max(1.0, scale)
    assert np.abs(parts.decay).max() > 1e-6  # (the rounding moves' term; no weight decay)


def test_an_error_in_the_recorded_path_beyond_the_bound_is_refused(digits):
    X, y = digits
    clf = fit(X, y, dtype="float32", solver="sgd", momentum=0.9, learning_rate=0.05)
    clf.path_.weights[3:] *= 1.0 + 1e-3  # what an unnoticed edit of the steps would leave
    clf.__dict__.pop("_replay_cache")
    clf.__dict__.pop("_kernel_cache", None)
    with pytest.raises(RecordingRefused, match=r"Step 2: .* beyond the step's rounding"):
        clf.decompose(X[:2])


def test_an_error_in_the_replayed_path_shows_in_the_residual(digits):
    X, y = digits
    clf = fit(X, y, dtype="float32", solver="sgd", momentum=0.9, learning_rate=0.05)
    replayed = clf._engine().path
    replayed.weights[5] += 1e-6  # one step's weights off, within the float32 bound
    clf.__dict__.pop("_kernel_cache")
    assert clf.decompose(X[:3]).residual.max() > 1e-8


def test_pickled_float32_fit_rebuilds_the_same_kernel(digits):
    X, y = digits
    clf = fit(X, y, dtype="float32", solver="sgd", momentum=0.9, learning_rate=0.05)
    before = clf.decompose(X[:2])
    loaded = pickle.loads(pickle.dumps(clf))
    assert "_replay_cache" not in loaded.__dict__  # (rebuilt from path_ on the next query)
    after = loaded.decompose(X[:2])
    for key in ("contributions", "bias", "decay", "output", "residual", "model_gap"):
        np.testing.assert_array_equal(after[key], before[key])


def test_float32_regressor_and_distance_classifier(digits):
    X, y = digits
    reg = ExactPathKernelRegressor(
        hidden_layer_sizes=(16,), max_iter=2, batch_size=50, learning_rate=0.01,
        random_state=0, dtype="float32",
    ).fit(X, y.astype(float))  # fmt: skip
    assert reg.path_.weights.dtype == F32
    parts = reg.decompose(X[:3])
    assert parts.residual.max() <= 1e-9 and 0 < parts.model_gap.max() <= 1e-4
    with torch.no_grad():
        own = reg.module_(torch.as_tensor(X[:3], dtype=F32))[:, 0].double().numpy()
    np.testing.assert_allclose(reg.predict(X[:3]), own, rtol=0, atol=0)
    dist = DistanceKernelClassifier(
        hidden_layer_sizes=(8,), max_iter=2, batch_size=50, random_state=0, dtype="float32"
    ).fit(X, y)
    assert dist.path_.weights.dtype == F32
    parts = dist.decompose(X[:3])
    assert parts.residual.max() <= 1e-9 and 0 < parts.model_gap.max() <= 1e-5


@pytest.mark.parametrize("value", ["float16", "double", torch.float32, None])
def test_invalid_dtype_is_refused(digits, value):
    X, y = digits
    with pytest.raises(InvalidParameterError, match="'dtype' parameter"):
        ExactPathKernelClassifier(dtype=value).fit(X, y)


@pytest.mark.parametrize("module", [None, "batchnorm"])
def test_counterfactual_of_a_float32_fit_differentiates_its_float64_twin(digits, module):
    """The adjoint sweep differentiates the float64 twin: the run trained again in
    float64 by torch.optim from the recorded w_0 (its steps reproduced to float64
    rounding), whose retraining certifies the scores to 1e-6 (retraining the float32
    fit instead gave float32 rounding over h: 4e-3 at h = 1e-4); the scores are
    within float32 rounding of the float64 fit's."""
    X, y = digits
    params = dict(solver="sgd", momentum=0.9, learning_rate=0.05)
    if module == "batchnorm":
        params["module"] = lambda d, k: nn.Sequential(
            nn.Linear(d, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, k)
        )
    single = fit(X, y, dtype="float32", **params)
    double = fit(X, y, **params)
    result = single.counterfactual(X[:2], y[:2], target="margin", certify=2)
    reference = double.counterfactual(X[:2], y[:2], target="margin")
    assert result.replay_error < 1e-13 and reference.replay_error < 1e-13
    assert result.certificate.error <= 1e-6
    np.testing.assert_allclose(result.scores, reference.scores, rtol=1e-3, atol=1e-6)


def test_a_scalar_target_of_a_float32_fit_is_checked_against_the_replay(digits):
    X, y = digits
    clf = fit(X, y, dtype="float32", solver="sgd", momentum=0.9)
    queries = X[:4]
    full = clf.decompose(queries)
    parts = clf.decompose(queries, target="predicted")
    rows = np.arange(4)
    np.testing.assert_array_equal(parts.output, full.output[rows, parts.labels])
    assert parts.residual.max() <= 1e-9
    Q = torch.as_tensor(queries)
    with torch.no_grad():
        own = torch.log_softmax(clf.module_(Q.float()), dim=1).double().numpy()
    np.testing.assert_allclose(
        parts.model_gap, np.abs(own[rows, parts.labels] - parts.output), rtol=1e-12
    )
    assert 0 < parts.model_gap.max() <= 1e-4


def test_float32_rounding_term_is_the_same_in_chunks_of_steps(digits):
    """The rounding moves join the decay term in every route: Adam's backward
    accumulation in one pass and in chunks of steps (a scan with a carry) give the
    same decomposition, exact for the float32 weights in float64."""
    X, y = digits
    settings = dict(dtype="float32", solver="adam", learning_rate=1e-3, max_iter=3)
    single, chunked = fit(X, y, **settings), fit(X, y, step_chunks=3, **settings)
    assert single._engine().path.rounding_moves.abs().max() > 0
    a, b = single.decompose(X[:3]), chunked.decompose(X[:3])
    np.testing.assert_allclose(b.decay, a.decay, rtol=0, atol=1e-13)
    # (to rounding: the rows' gradients at a bias with 1 / (sqrt(v) + eps) ~ 5e7 cancel)
    np.testing.assert_allclose(b.contributions, a.contributions, rtol=1e-13, atol=1e-13)
    scale = max(1.0, np.abs(a.contributions).sum(axis=1).max())
    assert max(a.residual.max(), b.residual.max()) <= 1e-14 * scale
