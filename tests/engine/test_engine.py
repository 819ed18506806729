"""The exact path kernel engine against independent computations.

The independent references: the network's own output (the sum identity), and a
brute-force EPK built from materialised per-example Jacobians (``torch.func``)
with high-order quadrature on smooth networks.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap

from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._training._loop import train_module

DTYPE = torch.float64


def blobs(n, n_features, n_classes, seed):
    rng = np.random.RandomState(seed)
    centers = 2.0 * rng.randn(n_classes, n_features)
    y = rng.randint(0, n_classes, n)
    X = centers[y] + rng.randn(n, n_features)
    return torch.tensor(X), torch.tensor(y)


def mlp(sizes, activation=nn.ReLU, zero_head=False, seed=0):
    torch.manual_seed(seed)  # every test network starts from the same weights
    layers = []
    for width_in, width_out in zip(sizes[:-2], sizes[1:-1], strict=True):
        layers += [nn.Linear(width_in, width_out), activation()]
    head = nn.Linear(sizes[-2], sizes[-1])
    if zero_head:
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    return nn.Sequential(*layers, head).to(DTYPE)


class SmallCNN(nn.Module):
    """Conv -> ReLU -> max-pool -> linear, on 6x6 single-channel images."""

    def __init__(self, n_classes):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Linear(3 * 3 * 3, n_classes)

    def forward(self, x):
        x = x.view(-1, 1, 6, 6)
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.head(x.flatten(1))


def trained(module, n=40, n_features=5, n_classes=3, seed=0, steps=12, lr=0.5, **kwargs):
    torch.manual_seed(seed)
    module = module.to(DTYPE)
    X, y = blobs(n, n_features, n_classes, seed)
    result = train_module(
        module, X, y, learning_rate=lr, max_iter=steps, random_state=seed, **kwargs
    )
    return module, result.path, X, y


def engine_for(module, path, X, y, **kwargs):
    return PathKernelEngine(module, path, X, **kwargs)


def queries(n_features, n=7, seed=1):
    return torch.tensor(np.random.RandomState(seed).randn(n, n_features) * 1.5)


# -- brute force ------------------------------------------------------------------


def jacobians(module, path, flat, X):
    """Per-example Jacobians of log_softmax outputs, (n, K, W), by torch.func."""

    def f(w, x):
        return F.log_softmax(functional_call(module, path.unflatten(w), (x[None],)), 1)[0]

    return vmap(jacrev(f), in_dims=(None, 0))(flat, X)


def jacobians_along(module, path, start, direction, t, X):
    """Jacobians at every ``start + t_q direction`` at once: (T, n, K, W)."""
    weights = start[None] + torch.as_tensor(t, dtype=DTYPE)[:, None] * direction[None]

    def f(w, x):
        return F.log_softmax(functional_call(module, path.unflatten(w), (x[None],)), 1)[0]

    return vmap(vmap(jacrev(f), in_dims=(None, 0)), in_dims=(0, None))(weights, X)


def brute_force(module, path, X_train, y_train, A, rule=("gauss", 24)):
    """Decomposition and Grams from materialised Jacobians.

    ``rule`` is ("gauss", n) Gauss-Legendre nodes (fast convergence on smooth
    networks) or ("midpoint", T) (O(1/T) across kinks, for ReLU networks).
    """
    kind, n_points = rule
    if kind == "gauss":
        nodes, weights = np.polynomial.legendre.leggauss(n_points)
        nodes, weights = 0.5 * (nodes + 1), 0.5 * weights
    else:
        nodes, weights = (np.arange(n_points) + 0.5) / n_points, np.full(n_points, 1 / n_points)
    nu = torch.as_tensor(weights, dtype=DTYPE)
    M, n = X_train.shape[0], A.shape[0]
    K = jacobians(module, path, path.weights[0], A[:1]).shape[1]
    contributions = torch.zeros(n, M, K, dtype=DTYPE)
    gram_train = torch.zeros(M, M, dtype=DTYPE)
    gram_test_train = torch.zeros(n, M, K, K, dtype=DTYPE)
    gram_test = torch.zeros(n, n, dtype=DTYPE)
    for s in range(path.n_steps):
        start, direction = path.weights[s], path.step_direction(s)
        J_train = jacobians(module, path, start, X_train)
        J_test = jacobians_along(module, path, start, direction, nodes, A)  # (T, n, K, W)
        phi = torch.einsum("q,qnkw->nkw", nu, J_test)
        gram_test += torch.einsum("q,qnkw,qmkw->nm", nu, J_test, J_test)
        gram_train += torch.einsum("nkw,mkw->nm", J_train, J_train)
        gram_test_train += torch.einsum("nkw,mjw->nmkj", phi, J_train)
        batch = torch.as_tensor(path.batches[s])
        g_y = J_train[batch, y_train[batch]]  # (|B|, W)
        coefficient = path.learning_rates[s] / batch.numel()  # the mean over the batch
        contributions[:, batch] += torch.einsum("nkw,bw->nbk", phi, g_y) * coefficient
    return contributions, gram_train, gram_test_train, gram_test


# -- the sum identity on many architectures ----------------------------------------


ARCHITECTURES = {
    "relu-1": lambda: mlp([5, 16, 3], zero_head=True),
    "relu-2": lambda: mlp([5, 12, 10, 3]),
    "relu-3": lambda: mlp([5, 10, 8, 8, 3]),
    "tanh": lambda: mlp([5, 12, 3], nn.Tanh),
    "gelu": lambda: mlp([5, 12, 10, 3], nn.GELU),
    "softplus": lambda: mlp([5, 12, 3], nn.Softplus),
    "leaky-relu": lambda: mlp([5, 12, 10, 3], nn.LeakyReLU),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_sum_identity_mlps(name):
    module, path, X, y = trained(ARCHITECTURES[name]())
    A = torch.cat([queries(5), X[:3]])  # training points too, on the test copy
    parts = engine_for(module, path, X, y).decompose(A)
    reconstructed = parts.bias + parts.contributions.sum(axis=1)
    with torch.no_grad():
        network = F.log_softmax(module(A), 1).numpy()
    np.testing.assert_allclose(parts.output, network, rtol=0, atol=1e-12)
    assert np.abs(reconstructed - network).max() < 1e-9
    assert parts.residual.max() < 1e-9


def test_sum_identity_cnn_with_max_pool():
    module, path, X, y = trained(SmallCNN(3), n_features=36, n=30, steps=10, lr=0.3)
    A = queries(36, n=5)
    parts = engine_for(module, path, X, y).decompose(A)
    with torch.no_grad():
        network = F.log_softmax(module(A), 1).numpy()
    assert np.abs(parts.bias + parts.contributions.sum(1) - network).max() < 1e-9


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 7},  # mini-batches, shuffled
        {"learning_rate": lambda step: 0.6 / (1 + 0.2 * step)},  # a schedule
        {"sample_weight": torch.linspace(0.2, 2.0, 40, dtype=DTYPE)},
    ],
    ids=["mini-batch", "schedule", "sample-weight"],
)
def test_sum_identity_other_paths(kwargs):
    torch.manual_seed(0)
    module = mlp([5, 12, 3])
    X, y = blobs(40, 5, 3, 0)
    lr = kwargs.pop("learning_rate", 0.5)
    path = train_module(module, X, y, learning_rate=lr, max_iter=4, random_state=0, **kwargs).path
    A = queries(5)
    parts = engine_for(module, path, X, y).decompose(A)
    with torch.no_grad():
        network = F.log_softmax(module(A), 1).numpy()
    assert np.abs(parts.bias + parts.contributions.sum(1) - network).max() < 1e-9


def test_training_points_outside_a_batch_contribute_nothing_in_that_step():
    torch.manual_seed(0)
    module = mlp([5, 8, 3])
    X, y = blobs(20, 5, 3, 0)
    path = train_module(module, X, y, learning_rate=0.5, max_iter=1, batch_size=5).path
    engine = engine_for(module, path, X, y)
    total = engine.decompose(queries(5)).contributions
    used = np.zeros(20, dtype=bool)
    for batch in path.batches:
        used[batch] = True
    assert used.all()  # one epoch: every point in exactly one batch, each contributes
    assert (np.abs(total).sum(axis=(0, 2)) > 0).all()


# -- against the brute-force kernel ------------------------------------------------


@pytest.fixture(scope="module")
def smooth_case():
    module, path, X, y = trained(mlp([4, 6, 3], nn.Tanh), n=15, n_features=4, steps=5)
    A = queries(4, n=6)
    return module, path, X, y, A, brute_force(module, path, X, y, A)


def test_decomposition_matches_brute_force(smooth_case):
    module, path, X, y, A, (contributions, *_) = smooth_case
    parts = engine_for(module, path, X, y).decompose(A)
    # Exact to the quadrature's certificate (1e-11 absolute per step): compared
    # relative to the largest contribution, not entry by entry.
    expected = contributions.numpy()
    np.testing.assert_allclose(
        parts.contributions, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max()
    )


def test_grams_match_brute_force(smooth_case):
    module, path, X, y, A, (_, gram_train, gram_test_train, gram_test) = smooth_case
    engine = engine_for(module, path, X, y)
    np.testing.assert_allclose(engine.gram(X, a_train=True), gram_train.numpy(), rtol=1e-10)
    full = engine.gram(A, X, a_train=False, b_train=True, output="full")
    expected = gram_test_train.numpy()
    np.testing.assert_allclose(full, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())
    trace = engine.gram(A, X, a_train=False, b_train=True)
    np.testing.assert_allclose(trace, np.einsum("nmkk->nm", full), rtol=1e-12)
    np.testing.assert_allclose(engine.gram(A), gram_test.numpy(), rtol=1e-9)
    # the transposed block is the transpose
    np.testing.assert_allclose(engine.gram(X, A, a_train=True, b_train=False), trace.T, rtol=1e-12)


def test_relu_grams_match_fine_brute_force():
    """On a ReLU net the brute force needs many nodes (O(1/T) across kinks)."""
    module, path, X, y = trained(mlp([3, 5, 2]), n=10, n_features=3, n_classes=2, steps=3, lr=1.0)
    A = queries(3, n=4)
    _, _, gram_test_train, gram_test = brute_force(module, path, X, y, A, ("midpoint", 20000))
    engine = engine_for(module, path, X, y)
    full = engine.gram(A, X, b_train=True, output="full")
    scale = np.abs(full).max()
    assert np.abs(full - gram_test_train.numpy()).max() < 1e-4 * scale
    assert np.abs(engine.gram(A) - gram_test.numpy()).max() < 1e-4 * np.abs(engine.gram(A)).max()


# -- kernel properties --------------------------------------------------------------


@pytest.fixture(scope="module")
def relu_case():
    module, path, X, y = trained(mlp([5, 16, 12, 3]), n=30, steps=8)
    return module, path, X, y, queries(5, n=9)


def test_training_gram_symmetric_psd(relu_case):
    module, path, X, y, _ = relu_case
    gram = engine_for(module, path, X, y).gram(X, a_train=True)
    np.testing.assert_array_equal(gram, gram.T)
    assert np.linalg.eigvalsh(gram).min() > -1e-10 * np.abs(gram).max()


def test_test_gram_symmetric_psd_and_diag(relu_case):
    module, path, X, y, A = relu_case
    engine = engine_for(module, path, X, y)
    gram = engine.gram(A)
    np.testing.assert_allclose(gram, gram.T, rtol=1e-13)
    assert np.linalg.eigvalsh(gram).min() > -1e-10 * np.abs(gram).max()
    np.testing.assert_allclose(engine.diag(A), np.diag(gram), rtol=1e-10)
    np.testing.assert_allclose(engine.diag(X, a_train=True), np.diag(engine.gram(X, a_train=True)))


def test_mixed_copies_gram_is_psd(relu_case):
    """Training-copy and test-copy rows together: inner products in one space."""
    module, path, X, y, A = relu_case
    rows = torch.cat([X[:8], A])
    on_train = np.r_[np.ones(8, bool), np.zeros(len(A), bool)]
    gram = engine_for(module, path, X, y).gram(rows, a_train=on_train)
    np.testing.assert_allclose(gram, gram.T, rtol=1e-12)
    assert np.linalg.eigvalsh(gram).min() > -1e-10 * np.abs(gram).max()


def test_invariance_to_tiles_and_jobs(relu_case):
    module, path, X, y, A = relu_case
    reference = engine_for(module, path, X, y)
    for kwargs in ({"tile_size": 7}, {"tile_size": 11, "n_jobs": 2}):
        other = engine_for(module, path, X, y, **kwargs)
        np.testing.assert_allclose(
            other.gram(X, a_train=True), reference.gram(X, a_train=True), rtol=1e-12
        )
        np.testing.assert_allclose(
            other.gram(A, X, b_train=True), reference.gram(A, X, b_train=True), rtol=1e-12
        )
        np.testing.assert_allclose(
            other.decompose(A).contributions,
            reference.decompose(A).contributions,
            rtol=1e-12,
            atol=1e-16,
        )


def test_prior_schemes_converge_to_exact(relu_case):
    module, path, X, y, A = relu_case
    exact = engine_for(module, path, X, y).decompose(A).contributions
    errors = []
    for quadrature, n_points in [("dpk", 1), ("riemann", 10), ("riemann", 100)]:
        approx = engine_for(module, path, X, y, quadrature=quadrature, n_points=n_points)
        errors.append(np.abs(approx.decompose(A).contributions - exact).max())
    assert errors[0] > errors[1] > errors[2] > 0
    assert errors[2] < errors[0] / 20  # first order: 100 points gain > 20x on one


def test_certificate_measures_quadrature_error(relu_case):
    module, path, X, y, A = relu_case
    assert engine_for(module, path, X, y).certificate(A).max() < 1e-10
    riemann = engine_for(module, path, X, y, quadrature="riemann", n_points=5)
    parts = riemann.decompose(A)
    sum_error = np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max(1)
    assert parts.residual.max() > 1e-6
    # the certificate bounds the error of the sum identity (up to rounding)
    assert (sum_error <= parts.residual + 1e-12).all()


def test_engine_does_not_touch_module_or_path(relu_case):
    module, path, X, y, A = relu_case
    before = [p.detach().clone() for p in module.parameters()]
    weights = path.weights.clone()
    engine = engine_for(module, path, X, y)
    engine.decompose(A)
    engine.gram(A, X, b_train=True)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert torch.equal(weights, path.weights)


def test_requests_that_cannot_fit_fail_early_with_sizes(relu_case, monkeypatch):
    from sklearn_pathkernel._engine import _planning as _memory

    module, path, X, y, A = relu_case
    engine = engine_for(module, path, X, y)
    monkeypatch.setattr(_memory, "available_memory", lambda: 1000)
    with pytest.raises(MemoryError, match=r"Gram of shape \(9, 30, 3, 3\).*output='trace'"):
        engine.gram(A, X, b_train=True, output="full")
    with pytest.raises(MemoryError, match="decompose on 9 rows"):
        engine.decompose(A)


def test_large_rows_are_tiled_within_the_block_budget(relu_case, monkeypatch):
    from sklearn_pathkernel._engine import _planning as _memory

    module, path, X, y, A = relu_case
    reference = engine_for(module, path, X, y).gram(A, X, b_train=True, output="full")
    monkeypatch.setattr(_memory, "BLOCK_BUDGET_BYTES", 8 * 30 * 9 * 2)  # two rows per block
    engine = engine_for(module, path, X, y)
    assert len(engine._planner.tiles(9, 8 * 30 * 9)) == 5
    np.testing.assert_allclose(
        engine.gram(A, X, b_train=True, output="full"), reference, rtol=1e-12
    )


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


def test_sum_identity_distance_network():
    from sklearn_pathkernel import DistanceKernelClassifier

    X, y = blobs(30, 3, 3, 0)
    clf = DistanceKernelClassifier(hidden_layer_sizes=(4,), max_iter=5, random_state=0)
    clf.fit(X.numpy(), y.numpy())
    A = queries(3, n=4)
    parts = clf.decompose(A.numpy())
    assert (
        np.abs(parts.bias + parts.contributions.sum(1) - clf.predict_log_proba(A.numpy())).max()
        < 1e-9
    )


def test_bisection_certifies_a_double_crossing_the_grids_miss():
    """A squared distance plus bias touching zero twice within ~1e-8 of ``t``.

    Kink detection compares pieces at grid points and misses both crossings; the
    certificate catches the error and bisection fixes it.
    """
    from sklearn_pathkernel import DistanceKernelClassifier

    X, y = blobs(60, 4, 3, 0)
    clf = DistanceKernelClassifier(
        hidden_layer_sizes=(8,), max_iter=5, learning_rate=0.5, random_state=0
    ).fit(X.numpy(), y.numpy())
    parts = clf.decompose(X[:10].numpy() + 0.3)
    assert parts.residual.max() < 1e-9
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-9


def test_saturated_softmax_on_unscaled_inputs_is_certified_without_blowup():
    """Features near 100 (scikit-learn's idempotence check): the first steps swing the
    softmax between saturated states. Each step's change is then known only to about
    eps * |logits| (~1e-13), and its integrand has sharp smooth transitions between
    the kinks. Bisection starts from the kink partition, resolves the transitions and
    accepts the rounding floor, instead of halving pieces without end."""
    rng = np.random.RandomState(0)
    X = torch.tensor(rng.normal(loc=100, size=(60, 2)))
    y = torch.tensor((X[:, 0] > 100).numpy().astype(np.int64))
    torch.manual_seed(0)
    module = mlp([2, 100, 2], zero_head=True)
    path = train_module(module, X, y, learning_rate=0.1, max_iter=3).path
    engine = engine_for(module, path, X, y)
    A = torch.tensor(rng.normal(loc=100, size=(4, 2)))
    _, scale = engine.probe.output_with_scale(path.weights[1], A)
    assert scale.min() > 100  # saturated after one step: the case this test is about
    parts = engine.decompose(A)
    assert parts.residual.max() < 1e-10
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-10


def test_gram_tasks_split_by_the_working_budget(relu_case, monkeypatch):
    """With a working budget too small for one task, the rows are split into
    several step-major tasks (and the symmetric Gram's tiles mirrored between
    them), with products of ``tile_size`` rows inside each: every block equals
    the one-task result."""
    from sklearn_pathkernel._engine import _planning as _memory
    from sklearn_pathkernel._engine._blocks import BlockKind

    module, path, X, y, A = relu_case
    rows = torch.cat([X[:8], A])
    on_train = np.r_[np.ones(8, bool), np.zeros(len(A), bool)]

    def grams(engine):
        return [
            engine.gram(X, a_train=True),
            engine.gram(A, X, b_train=True),
            engine.gram(A, X, b_train=True, output="full"),
            engine.gram(X[:11], X, a_train=True, b_train=True, output="full"),
            engine.gram(rows, a_train=on_train),
        ]

    expected = grams(engine_for(module, path, X, y))
    monkeypatch.setattr(_memory, "working_budget", lambda device, n_workers=1: 1)
    engine = engine_for(module, path, X, y, tile_size=4)
    tiles = engine._planner.task_tiles(BlockKind.TRAINING, X.shape[0], X.shape[0], 1, 3)
    assert len(tiles) > 2
    for actual, reference in zip(grams(engine), expected, strict=True):
        np.testing.assert_allclose(actual, reference, rtol=1e-12, atol=1e-15)


def test_results_do_not_depend_on_the_pass_size(relu_case, monkeypatch):
    """One row per forward and backward pass (a tiny pass budget) gives the same
    Grams, diagonal and decomposition as the default passes."""
    from sklearn_pathkernel._engine import _planning as _memory

    module, path, X, y, A = relu_case

    def results(engine):
        parts = engine.decompose(A)
        return [
            engine.gram(X, a_train=True),
            engine.gram(A, X, b_train=True, output="full"),
            engine.diag(A),
            parts.contributions,
            parts.residual,
        ]

    expected = results(engine_for(module, path, X, y))
    monkeypatch.setattr(_memory, "PASS_BUDGET_BYTES", 1)
    engine = engine_for(module, path, X, y)
    assert engine._planner.pass_rows() == 1
    for actual, reference in zip(results(engine), expected, strict=True):
        np.testing.assert_allclose(actual, reference, rtol=1e-12, atol=1e-15)
