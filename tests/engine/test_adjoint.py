"""The adjoint sweep against independent computations: autograd through the whole
unrolled run, and finite differences of real retraining."""

import dataclasses

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from torch import nn

from sklearn_pathkernel import ExactPathKernelClassifier, ExactPathKernelRegressor
from sklearn_pathkernel._engine._adjoint import AdjointSweep
from sklearn_pathkernel._engine._targets import MarginTarget, OutputTarget
from sklearn_pathkernel._estimators._explanation_context import estimator_context

#: Smooth networks, every update rule (float64): the certificate holds to 1e-6.
SOLVERS = {
    "sgd-full": dict(solver="sgd", learning_rate=0.3),
    "sgd-mini": dict(solver="sgd", batch_size=8, learning_rate=0.2),
    "momentum": dict(solver="sgd", momentum=0.9, batch_size=10, learning_rate=0.05),
    "nesterov-decay": dict(solver="sgd", momentum=0.8, nesterovs_momentum=True,
                           weight_decay=0.05, batch_size=12, learning_rate=0.05),
    "adam-decay": dict(solver="adam", learning_rate=0.01, weight_decay=0.01, batch_size=10),
    "adamw": dict(solver="adamw", learning_rate=0.01, weight_decay=0.1, batch_size=12),
}  # fmt: skip


def gaussian_data(n=30, d=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int) + (X[:, 2] > 0.8)
    return X, y % classes


def fit(solver, activation="tanh", **params):
    X, y = gaussian_data()
    settings = dict(hidden_layer_sizes=(6,), activation=activation, max_iter=4, random_state=0)
    settings.update(SOLVERS[solver])
    settings.update(params)
    weights = np.linspace(0.5, 1.5, len(y))  # sample weights that are not all ones
    return ExactPathKernelClassifier(**settings).fit(X, y, sample_weight=weights), X, y


@pytest.fixture(scope="module", params=sorted(SOLVERS))
def fitted(request):
    return fit(request.param)


def test_the_run_is_replayed_exactly(fitted):
    clf, X, _ = fitted
    sweep = AdjointSweep(estimator_context(clf).training_run())
    sweep.replay()
    assert sweep.replay_error < 1e-13


def test_certificate_by_retraining(fitted):
    """Central differences of real retraining, one row's sample weight at a time and
    every row's loss at once: the sweep's scores to 1e-6 relative."""
    clf, X, y = fitted
    result = clf.counterfactual(
        X[:3], y[:3], target="margin", certify=3, random_state=1, hessian=True
    )
    certificate = result.certificate
    assert certificate.row_error < 1e-6
    assert certificate.total_error < 1e-6
    assert np.abs(certificate.finite_differences).max() > 1e-4  # not a vacuous check


def _unrolled_scores(clf, X_query, column, momentum=0.0):
    """dT/deps by autograd through the whole run written out (plain GD or momentum)."""
    run = estimator_context(clf).training_run()
    M = run.X.shape[0]
    eps = torch.zeros(M, dtype=torch.float64, requires_grad=True)
    w = run.weights(0).clone().requires_grad_(True)
    buffer = torch.zeros_like(w)
    for step in range(run.n_steps):
        rows, shares = run.batch(step)
        f = run.output(w, run.X[rows])
        loss = (shares * (1 + eps[rows]) * run.loss.per_sample(f, run.y[rows])).sum()
        (g,) = torch.autograd.grad(loss, w, create_graph=True)
        buffer = momentum * buffer + g
        w = w - run.path.learning_rates[step] * buffer
    torch.testing.assert_close(w.detach(), run.weights(run.n_steps), rtol=1e-12, atol=1e-13)
    f = run.output(w, torch.as_tensor(X_query))
    target = MarginTarget()(f[0], torch.tensor(column))
    (scores,) = torch.autograd.grad(target, eps)
    return scores.numpy()


@pytest.mark.parametrize("solver", ["sgd-full", "sgd-mini", "momentum"])
def test_against_autograd_through_the_unrolled_run(solver):
    clf, X, _ = fit(solver)
    run = estimator_context(clf).training_run()
    result = AdjointSweep(run).run_queries(
        torch.as_tensor(X[:1]), MarginTarget(), torch.tensor([2])
    )
    expected = _unrolled_scores(clf, X[:1], 2, clf.momentum)
    np.testing.assert_allclose(result.scores[0], expected, rtol=1e-10, atol=1e-14)


def test_weight_scores_are_the_loss_weight_scores_renormalised(fitted):
    """Per step, dT/dlog w_i = delta_i - a_i sum_B delta: the sample-weight scores of a
    batch sum to zero, so over the run they sum to zero (scaling every weight alike
    changes nothing)."""
    clf, X, _ = fitted
    result = clf.counterfactual(X[:2])
    np.testing.assert_allclose(result.scores.sum(1), 0, atol=1e-12 * np.abs(result.scores).sum())


def test_batched_queries_equal_one_at_a_time(fitted):
    clf, X, _ = fitted
    run = estimator_context(clf).training_run()
    sweep = AdjointSweep(run)
    queries, labels = torch.as_tensor(X[:3]), torch.tensor([0, 1, 2])
    together = sweep.run_queries(queries, OutputTarget(), labels)
    for q in range(3):
        alone = sweep.run_queries(queries[q : q + 1], OutputTarget(), labels[q : q + 1])
        np.testing.assert_allclose(together.scores[q], alone.scores[0], rtol=1e-12, atol=1e-16)
    assert together.adjoint_norms.shape == (run.n_steps + 1, 3)


def test_regressor_outputs_and_loss():
    X, y = gaussian_data()
    targets = np.c_[X[:, 0] - X[:, 1], X[:, 2] ** 2]
    reg = ExactPathKernelRegressor(
        hidden_layer_sizes=(5,), activation="softplus", max_iter=3, learning_rate=0.05,
        batch_size=10, momentum=0.5, random_state=0,
    ).fit(X, targets)  # fmt: skip
    for kwargs in (dict(output=1), dict(y=targets[:2], target="loss")):
        certificate = reg.counterfactual(X[:2], certify=2, hessian=True, **kwargs).certificate
        assert certificate.row_error < 1e-6 and certificate.total_error < 1e-6


def test_the_default_rule_is_the_optimiser_familys():
    """Exact for the SGD family, the Hessian term cut for Adam and AdamW."""
    for solver, exact in (("momentum", True), ("adam-decay", False), ("adamw", False)):
        clf, X, _ = fit(solver)
        assert clf.counterfactual(X[:1]).hessian is exact


def test_without_the_hessian_plain_gd_is_grad_dot_along_the_path():
    """hessian=False, plain GD: delta_{s,i} = lr_s a_{s,i} <grad T(w_S), -grad l_i(w_s)>."""
    clf, X, _ = fit("sgd-mini")
    run = estimator_context(clf).training_run()
    sweep = AdjointSweep(run)
    query, label = torch.as_tensor(X[:1]), torch.tensor([1])
    result = sweep.run_queries(query, OutputTarget(), label, hessian=False)
    _, final_gradient = sweep.target_gradients(query, OutputTarget(), label)
    expected = _path_sum(run, lambda step: final_gradient[0])
    np.testing.assert_allclose(result.scores[0], expected, rtol=1e-10, atol=1e-15)


def _path_sum(run, query_gradient):
    """``-sum_s lr_s a_{s,i} <query_gradient(s), grad l_i(w_s)>`` per training row
    ``i``, each row's loss gradient by autograd at the recorded weights."""
    expected = np.zeros(run.X.shape[0])
    for step in range(run.n_steps):
        vector = query_gradient(step)
        rows, shares = run.batch(step)
        for row, share in zip(rows.tolist(), shares.tolist(), strict=True):
            w = run.weights(step).requires_grad_(True)
            f = run.output(w, run.X[row : row + 1])
            (g_row,) = torch.autograd.grad(run.loss.per_sample(f, run.y[row : row + 1]).sum(), w)
            lr = run.path.learning_rates[step]
            expected[row] -= lr * share * float(vector @ g_row)
    return expected


def small_cnn(n_features, n_classes):
    from torch import nn

    return nn.Sequential(
        nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 3, 2), nn.Tanh(), nn.AvgPool2d(3),
        nn.Flatten(), nn.Linear(3, n_classes),
    )  # fmt: skip


def test_certificate_of_a_convolutional_network():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(24, 16))
    y = (X[:, :8].sum(1) > 0).astype(int)
    clf = ExactPathKernelClassifier(
        module=small_cnn, max_iter=3, batch_size=8, momentum=0.5, learning_rate=0.1,
        random_state=0,
    ).fit(X, y)  # fmt: skip
    certificate = clf.counterfactual(X[:2], y[:2], target="loss", certify=2).certificate
    assert certificate.row_error < 1e-6 and certificate.total_error < 1e-6


def mlp_with_dropout(n_features, n_classes):
    return nn.Sequential(
        nn.Linear(n_features, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, n_classes)
    )


def test_certificate_of_a_network_with_dropout():
    """Each step is differentiated with the dropout masks its rows drew: retraining
    with one row's weight moved (same seed, so the same masks) agrees to 1e-6, and
    the replayed steps land on the recorded weights."""
    X, y = gaussian_data(n=36)
    clf = ExactPathKernelClassifier(
        module=mlp_with_dropout, max_iter=3, batch_size=12, solver="sgd", momentum=0.9,
        learning_rate=0.1, random_state=0,
    ).fit(X, y)  # fmt: skip
    assert clf.path_.dropout_masks is not None
    result = clf.counterfactual(X[:3], y[:3], target="margin", certify=3, random_state=1)
    assert result.replay_error < 1e-13
    certificate = result.certificate
    assert certificate.row_error < 1e-6 and certificate.total_error < 1e-6
    assert np.abs(certificate.finite_differences).max() > 1e-4  # not a vacuous check


def mlp_with_batchnorm(n_features, n_classes):
    # (no bias before BatchNorm: its gradient is zero but for rounding, which Adam
    # would amplify into noise in the finite differences)
    return nn.Sequential(
        nn.Linear(n_features, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(),
        nn.Linear(8, n_classes),
    )  # fmt: skip


@pytest.mark.parametrize(
    "settings, h",
    [
        (dict(solver="sgd", momentum=0.9, learning_rate=0.1), 1e-4),
        (dict(solver="adam", learning_rate=0.01), 3e-6),
    ],
    ids=["momentum", "adam"],
)
def test_certificate_of_a_network_with_batchnorm(settings, h):
    """BatchNorm trained in training mode: each step's loss on batch statistics, the
    running statistics moved by their averaging, the target the eval-mode network's.
    Retraining with one row's weight moved agrees to 1e-6 (Adam's central
    differences are curved: its h is smaller), and the replayed steps land on the
    recorded weights and statistics."""
    X, y = gaussian_data(n=36)
    clf = ExactPathKernelClassifier(
        module=mlp_with_batchnorm, max_iter=3, batch_size=12, random_state=0, **settings
    ).fit(X, y)
    stats = clf.path_.running_statistics
    assert stats is not None and not torch.equal(stats.values[0], stats.values[-1])
    result = clf.counterfactual(
        X[:3], y[:3], target="margin", certify=3, random_state=1, hessian=True, h=h
    )
    assert result.replay_error < 1e-13
    certificate = result.certificate
    assert certificate.row_error < 1e-6 and certificate.total_error < 1e-6
    assert np.abs(certificate.finite_differences).max() > 1e-4  # not a vacuous check
    logits = clf.decision_function(X[:3])  # (the eval-mode network's target)
    margins = [f[c] - logsumexp(np.delete(f, c)) for f, c in zip(logits, y[:3], strict=True)]
    np.testing.assert_allclose(result.values, margins, rtol=0, atol=1e-12)


def test_regressor_with_batchnorm_and_relu():
    """A regressor (squared error) with BatchNorm before a ReLU: certified by
    retraining; the self-influence is the decomposition's diagonal."""
    rng = np.random.RandomState(0)
    X = rng.randn(40, 4)
    y = X[:, 0] - X[:, 1] ** 2
    reg = ExactPathKernelRegressor(
        module=lambda d, k: nn.Sequential(
            nn.Linear(d, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, k)
        ),
        max_iter=3, batch_size=10, random_state=0, solver="sgd", momentum=0.9,
        learning_rate=0.05,
    ).fit(X, y)  # fmt: skip
    result = reg.counterfactual(X[:3], certify=3)
    assert result.replay_error < 1e-13 and result.certificate.error < 1e-6
    own = np.arange(len(X))
    np.testing.assert_array_equal(
        reg.self_influence().values[:, 0], reg.decompose(X).contributions[own, own]
    )


def test_self_influence_and_explanations_of_a_network_with_batchnorm():
    """The counterfactual's self-influence and explanations need no training copy:
    they work with BatchNorm, the self scores the diagonal of the rows' scores."""
    X, y = gaussian_data(n=36)
    clf = ExactPathKernelClassifier(
        module=mlp_with_batchnorm, max_iter=2, batch_size=12, solver="sgd", random_state=0
    ).fit(X, y)
    own = clf.self_influence(method="counterfactual", target="margin").values[:, 0]
    rows = np.diagonal(clf.counterfactual(X, y, target="margin").scores)
    np.testing.assert_allclose(own, rows, rtol=1e-12, atol=1e-15)
    explanation = clf.explain(X[:2], method="counterfactual", k=3)
    scores = clf.counterfactual(X[:2], target="output", output=0).scores  # (class 0's)
    np.testing.assert_allclose(
        explanation.proponent_values[:, 0], -np.sort(-scores, axis=1)[:, :3], rtol=1e-12,
        atol=1e-15,
    )  # fmt: skip


def test_dropout_and_batchnorm_together():
    """Both parts of a training step at once: the recorded masks and the batch
    statistics, the running statistics as state; certified by retraining."""
    X, y = gaussian_data(n=36)
    clf = ExactPathKernelClassifier(
        module=lambda d, k: nn.Sequential(
            nn.Linear(d, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.2),
            nn.Linear(8, k),
        ),
        max_iter=3, batch_size=12, solver="sgd", momentum=0.9, learning_rate=0.1,
        random_state=0,
    ).fit(X, y)  # fmt: skip
    assert clf.path_.dropout_masks is not None and clf.path_.running_statistics is not None
    result = clf.counterfactual(X[:2], y[:2], target="margin", certify=3, random_state=1)
    assert result.replay_error < 1e-13
    assert result.certificate.row_error < 1e-6 and result.certificate.total_error < 1e-6
    assert np.abs(result.certificate.finite_differences).max() > 1e-4


def test_running_statistics_are_part_of_the_differentiated_step():
    """With BatchNorm, a sweep that left the running statistics' move out would miss
    the recorded statistics: refused like any step it does not reproduce."""
    X, y = gaussian_data(n=36)
    clf = ExactPathKernelClassifier(
        module=mlp_with_batchnorm, max_iter=2, batch_size=12, solver="sgd", random_state=0
    ).fit(X, y)
    run = estimator_context(clf).training_run()
    stats = run.path.running_statistics
    frozen = dataclasses.replace(stats, factors=[{} for _ in stats.factors])
    path = dataclasses.replace(run.path, running_statistics=frozen)
    with pytest.raises(ValueError, match="do not reproduce the recorded run"):
        AdjointSweep(dataclasses.replace(run, path=path)).replay()


def test_a_sweep_whose_steps_miss_the_recorded_run_is_refused(fitted):
    """The sweep replays every step from the recorded weights before differentiating
    it: a run it does not reproduce (here the rows moved by 1 %, as a dropout mask
    left out or a setting read wrong would) is refused, never differentiated."""
    clf, _, _ = fitted
    run = estimator_context(clf).training_run()
    moved = dataclasses.replace(run, X=run.X * 1.01)
    with pytest.raises(ValueError, match="do not reproduce the recorded run"):
        AdjointSweep(moved).replay()
    with pytest.raises(ValueError, match="do not reproduce the recorded run"):
        AdjointSweep(moved).run_queries(run.X[:1], MarginTarget(), torch.tensor([0]))


def _schedule(step):
    return 0.3 / (1.0 + 0.5 * step)


def test_a_learning_rate_schedule():
    clf, X, y = fit("momentum", learning_rate=_schedule)
    assert len(set(clf.path_.learning_rates)) > 1
    certificate = clf.counterfactual(X[:2], y[:2], target="margin", certify=2).certificate
    assert certificate.row_error < 1e-6 and certificate.total_error < 1e-6


# -- the private geometric horizon (issue 34's experiment) ---------------------------


@pytest.mark.parametrize("solver", ["sgd-mini", "momentum"])
def test_no_horizon_is_the_exact_sweep_bit_for_bit(solver):
    clf, X, _ = fit(solver)
    sweep = AdjointSweep(estimator_context(clf).training_run())
    queries, labels = torch.as_tensor(X[:2]), torch.tensor([0, 2])
    exact = sweep.run_queries(queries, MarginTarget(), labels)
    unset = sweep.run_queries(queries, MarginTarget(), labels, horizon=None)
    for name in ("scores", "weight_scores", "values", "adjoint_norms"):
        np.testing.assert_array_equal(getattr(unset, name), getattr(exact, name))
    # and a horizon far longer than the run (gamma = 1e-12) is the exact derivative
    endless = sweep.run_queries(queries, MarginTarget(), labels, horizon=1e12)
    np.testing.assert_allclose(endless.scores, exact.scores, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("solver", ["sgd-mini", "momentum"])
def test_horizon_one_is_each_steps_gradient_against_the_next_targets(solver):
    """horizon=1 (gamma = 1): the momentum's adjoint is zeroed at every step, so
    delta_{s,i} = lr_s a_{s,i} <grad T(w_{s+1}), -grad l_i(w_s)>, written out row by
    row with autograd at the recorded weights."""
    clf, X, _ = fit(solver)
    run = estimator_context(clf).training_run()
    query, column = torch.as_tensor(X[3:4]), 1
    result = AdjointSweep(run).run_queries(query, MarginTarget(), torch.tensor([column]), horizon=1)

    def target_gradient(step):  # at the weights after the step
        after = run.weights(step + 1).requires_grad_(True)
        target = MarginTarget()(run.output(after, query)[0], torch.tensor(column))
        return torch.autograd.grad(target, after)[0]

    expected = _path_sum(run, target_gradient)
    assert np.abs(expected).max() > 1e-3  # not a vacuous check
    np.testing.assert_allclose(result.scores[0], expected, rtol=1e-12, atol=1e-15)


def test_horizon_between_interpolates_and_is_checked():
    """A finite horizon differs from both ends; bad horizons are refused clearly."""
    clf, X, _ = fit("sgd-mini")
    sweep = AdjointSweep(estimator_context(clf).training_run())
    queries, labels = torch.as_tensor(X[:1]), torch.tensor([0])
    ends = [sweep.run_queries(queries, MarginTarget(), labels, horizon=h).scores for h in (1, None)]
    middle = sweep.run_queries(queries, MarginTarget(), labels, horizon=4.0).scores
    assert min(np.abs(middle - end).max() for end in ends) > 1e-6
    for bad, error in ((0.5, ValueError), (float("nan"), ValueError), (True, TypeError),
                       ("4", TypeError)):  # fmt: skip
        with pytest.raises(error, match="horizon"):
            sweep.run_queries(queries, MarginTarget(), labels, horizon=bad)
