"""DistanceRule: factored per-example gradients of distance layers against torch.func.

References: ``GenericRule`` (per-example gradients materialised by ``torch.func``)
at explicit weights, the layer evaluated at explicit weights, and the network's
own output (the EPK sum identity).
"""

import itertools

import numpy as np
import pytest
import torch
from torch.func import functional_call

import sklearn_pathkernel._engine._planning as planning_module
from sklearn_pathkernel import DistanceKernelClassifier
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine.rules import make_rule
from sklearn_pathkernel._engine.rules._contract import contract
from sklearn_pathkernel._engine.rules._distance import (
    FACTORED_KERNELS,
    DistanceFactors,
    DistanceRule,
)
from sklearn_pathkernel._engine.rules._generic import GenericRule
from sklearn_pathkernel._engine.rules._protocol import RowWeights
from sklearn_pathkernel._engine.rules._registry import RULES
from sklearn_pathkernel._nn._distance import DistanceLayer

DT = torch.float64
MODES = ("trace", "pairs", "diag")
N_FEATURES, N_MEMORIES, N_OUTPUTS = 5, 4, 3


def make_layer(kernel, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = DistanceLayer(N_FEATURES, N_MEMORIES, kernel, bias=bias, dtype=DT)
    with torch.no_grad():  # non-trivial bias and widths
        if layer.bias is not None:
            layer.bias.normal_()
        if layer.log_gamma is not None:
            layer.log_gamma.normal_(0.0, 0.5)
    return layer


def path_of(layer, local=None):
    """Path names (prefix "d."), start weights and a step for ``layer``'s parameters."""
    local = local or [name for name, _ in layer.named_parameters()]
    params = {f"d.{name}": getattr(layer, name).detach().clone() for name in local}
    steps = {name: 0.3 * torch.randn_like(value) for name, value in params.items()}
    return local, params, steps


def rows(layer, n, seed):
    """Inputs with a row on a memory (zero distance) and, for cosine, a zero row."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, dtype=DT, generator=generator)
    x[1] = layer.memories.detach()[2]
    if layer.kernel == "cosine":
        x[0] = 0.0
    delta = torch.randn(n, N_OUTPUTS, N_MEMORIES, dtype=DT, generator=generator)
    t = torch.rand(n, dtype=DT, generator=generator)
    t[1] = 0.0  # exactly on the memory, also at per-row weights
    return x, delta, t


def generic_grads(layer, local, params, x, delta, steps=None, t=None):
    """Per-example gradients (n, K, W) by torch.func, row i at weights params + t_i steps."""
    rule = GenericRule(layer, local, [f"d.{name}" for name in local])
    if t is None:
        return rule.factors((x,), delta, RowWeights(params)).grads
    return torch.cat(
        [
            rule.factors(
                (x[i : i + 1],),
                delta[i : i + 1],
                RowWeights({name: value + t[i] * steps[name] for name, value in params.items()}),
            ).grads
            for i in range(x.shape[0])
        ]
    )


def assert_close(actual, expected, rtol=1e-12):
    scale = expected.abs().max()
    assert (actual - expected).abs().max() <= rtol * scale, (
        (actual - expected).abs().max() / scale
    ).item()


def side(layer, local, params, steps, x, delta, t, moving):
    names = {name: f"d.{name}" for name in local}
    rule = DistanceRule(layer, names)
    weights = RowWeights(params, steps, t) if moving else RowWeights(params)
    factors = rule.factors((x,), delta, weights)
    grads = generic_grads(layer, local, params, x, delta, steps, t if moving else None)
    return rule, factors, grads


@pytest.mark.parametrize("kernel", FACTORED_KERNELS)
@pytest.mark.parametrize("bias", [True, False])
def test_inner_and_directional_equal_materialised_gradients(kernel, bias):
    layer = make_layer(kernel, bias)
    local, params, steps = path_of(layer)
    x, dx, tx = rows(layer, 6, seed=1)
    y, dy, ty = rows(layer, 5, seed=2)
    direction = {name: torch.randn_like(value) for name, value in params.items()}
    flat = torch.cat([direction[f"d.{name}"].reshape(-1) for name in local])
    # Both sides at the step's start, or one or both at their own point of the step.
    for left_moving, right_moving in itertools.product([False, True], repeat=2):
        rule, left, g_left = side(layer, local, params, steps, x, dx, tx, left_moving)
        _, right, g_right = side(layer, local, params, steps, y, dy, ty, right_moving)
        for mode in ("trace", "pairs"):
            assert_close(rule.inner(left, right, mode), contract(g_left, g_right, mode))
        # One output per right row (the decomposition's training side).
        _, right, g_right = side(layer, local, params, steps, y, dy[:, 1:2], ty, right_moving)
        assert_close(rule.inner(left, right, "pairs"), contract(g_left, g_right, "pairs"))
        assert_close(rule.inner(left, left, "diag"), contract(g_left, g_left, "diag"))
        assert_close(rule.directional(left, direction), g_left @ flat)


@pytest.mark.parametrize("kernel", FACTORED_KERNELS)
@pytest.mark.parametrize("moving", [False, True])
def test_row_sums_of_node_gradients(kernel, moving):
    """``materialise_sums``: each row's weighted sum of its nodes' gradients, nodes
    in any order (a node on a memory among them), against summed per-sample
    gradients of torch.func."""
    layer = make_layer(kernel)
    local, params, steps = path_of(layer)
    x, delta, t = rows(layer, 7, seed=3)
    rule, factors, grads = side(layer, local, params, steps, x, delta, t, moving)
    node_rows = torch.tensor([2, 0, 2, 1, 0, 2, 0])
    weights = torch.rand(7, dtype=DT, generator=torch.Generator().manual_seed(4))
    expected = torch.zeros(4, *grads.shape[1:], dtype=DT)
    expected.index_add_(0, node_rows, weights[:, None, None] * grads)
    assert_close(rule.materialise_sums(node_rows, weights, factors, 4), expected)


@pytest.mark.parametrize("kernel", ["sqeuclidean", "euclidean", "rbf"])
@pytest.mark.parametrize("n_dense", [1, 4])
@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["all-memories", "one-memory-chunks"])
def test_dense_inner_with_one_output_per_row(kernel, n_dense, chunk_bytes, monkeypatch):
    """The decomposition's training side (one output per row, a row on a memory):
    the factored form for few dense rows (n K <= D), the materialised one beyond;
    the factored form's memories in one chunk and one by one."""
    if chunk_bytes is not None:
        monkeypatch.setattr(planning_module, "DOTS_CHUNK_BYTES", chunk_bytes)
    layer = make_layer(kernel)
    local, params, steps = path_of(layer)
    x, delta, t = rows(layer, 6, seed=5)
    rule, factors, grads = side(layer, local, params, steps, x, delta[:, :1], t, False)
    assert rule.family.has_dense_form(factors, torch.zeros(n_dense, 2, 1)) == (n_dense == 1)
    dense = torch.randn(n_dense, 2, grads.shape[2], dtype=DT)
    assert_close(rule.dense_inner(dense, factors, "pairs"), contract(dense, grads, "pairs"))


@pytest.mark.parametrize("kernel", FACTORED_KERNELS)
def test_only_the_parameters_in_the_path(kernel):
    layer = make_layer(kernel)
    subsets = [["memories"], ["bias"]] + (
        [["log_gamma"], ["bias", "log_gamma"]] * (kernel == "rbf")
    )
    for local in subsets:
        _, params, steps = path_of(layer, local)
        x, dx, tx = rows(layer, 5, seed=3)
        rule, left, g_left = side(layer, local, params, steps, x, dx, tx, True)
        _, right, g_right = side(layer, local, params, steps, x, dx, tx, False)
        for mode in MODES:
            assert_close(rule.inner(left, right, mode), contract(g_left, g_right, mode))
        direction = {name: torch.randn_like(value) for name, value in params.items()}
        flat = torch.cat([direction[f"d.{name}"].reshape(-1) for name in local])
        assert_close(rule.directional(left, direction), g_left @ flat)


@pytest.mark.parametrize("kernel", FACTORED_KERNELS)
def test_factors_at_other_memories_and_concatenated_factors(kernel):
    """Factors at different memories fall back to materialised gradients; ``cat`` of
    rows at the step's start and rows along it keeps every inner product."""
    layer = make_layer(kernel)
    local, params, steps = path_of(layer)
    x, dx, tx = rows(layer, 5, seed=4)
    rule, start, g_start = side(layer, local, params, steps, x, dx, tx, False)
    moved = {name: value + 0.5 * steps[name] for name, value in params.items()}
    _, other, g_other = side(layer, local, moved, steps, x, dx, tx, False)
    assert_close(rule.inner(start, other, "trace"), contract(g_start, g_other, "trace"))
    _, along, g_along = side(layer, local, params, steps, x, dx, tx, True)
    both = DistanceFactors.cat([start, along])
    g_both = torch.cat([g_start, g_along])
    assert_close(rule.inner(both, both, "trace"), contract(g_both, g_both, "trace"))
    assert_close(
        rule.inner(both.take([7, 2]), both, "pairs"), contract(g_both[[7, 2]], g_both, "pairs")
    )


@pytest.mark.parametrize("kernel", FACTORED_KERNELS)
def test_output_at_per_row_weights_equals_the_layer_at_explicit_weights(kernel):
    layer = make_layer(kernel)
    local, params, steps = path_of(layer)
    names = {name: f"d.{name}" for name in local}
    x, _, t = rows(layer, 7, seed=5)
    x.requires_grad_(True)
    cotangent = torch.randn(7, N_MEMORIES, dtype=DT)
    out = DistanceRule(layer, names).output_at((x,), RowWeights(params, steps, t))
    (grad,) = torch.autograd.grad((out * cotangent).sum(), x)
    for i in range(7):
        weights = {name: params[f"d.{name}"] + t[i] * steps[f"d.{name}"] for name in local}
        expected = functional_call(layer, weights, (x[i : i + 1],))[0]
        (expected_grad,) = torch.autograd.grad((expected * cotangent[i]).sum(), x)
        torch.testing.assert_close(out[i], expected, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(grad[i], expected_grad[i], rtol=1e-12, atol=1e-15)


def test_make_rule_picks_the_factored_rule():
    for kernel in ("sqeuclidean", "euclidean", "rbf", "cosine", "laplacian"):
        layer = DistanceLayer(3, 2, kernel, dtype=DT)
        names = {f"l.{name}" for name, _ in layer.named_parameters()}
        expected = GenericRule if kernel == "laplacian" else DistanceRule
        assert type(make_rule(layer, "l.", names)) is expected
    rule = make_rule(DistanceLayer(3, 2, dtype=DT), "l.", {"l.bias"})  # memories frozen
    assert isinstance(rule, DistanceRule) and rule.path_names == ["l.bias"]


def fit(kernel="sqeuclidean", transform="log1p", sizes=(4,), n=30, steps=5, **kwargs):
    rng = np.random.RandomState(0)
    X = rng.randn(n, 3)
    y = np.arange(n) % 3
    clf = DistanceKernelClassifier(
        hidden_layer_sizes=sizes,
        kernel=kernel,
        skew_transform=transform,
        max_iter=steps,
        random_state=0,
        **kwargs,
    ).fit(X, y)
    return clf, X, rng.randn(5, 3)


def test_per_row_t_equals_one_pass_per_distinct_t():
    clf, X, A = fit("rbf", "standardize", sizes=(4, 3))
    engine = clf._engine()
    probe, path = engine.probe, clf.path_
    assert probe.per_row_t
    start, direction = path.weights[2], path.step_direction(2)
    t = torch.rand(A.shape[0], dtype=DT)
    A = torch.as_tensor(A)
    log_proba, factors = probe.output_and_factors(start, A, direction=direction, t=t)
    train = probe.factors(start, torch.as_tensor(X[:6]))
    probe.per_row_t = False  # the fallback: one forward and backward per distinct t
    try:
        log_proba_ref, factors_ref = probe.output_and_factors(start, A, direction=direction, t=t)
        value_ref = probe.output(start, A, direction, t)
    finally:
        probe.per_row_t = True
    torch.testing.assert_close(log_proba, log_proba_ref, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(probe.output(start, A, direction, t), value_ref)
    for rule, f, f_ref, g in zip(probe.rules, factors, factors_ref, train, strict=True):
        for mode in MODES:
            other = f if mode == "diag" else g
            other_ref = f_ref if mode == "diag" else g
            assert_close(rule.inner(f, other, mode), rule.inner(f_ref, other_ref, mode))


def test_engine_grams_equal_the_generic_rule(monkeypatch):
    """Training, mixed and test x test blocks through the whole engine."""
    clf, X, A = fit("euclidean", "none", n=20, steps=3)
    args = clf.module_, clf.path_, clf._fit_X
    factored = PathKernelEngine(*args)
    assert {type(rule).__name__ for rule in factored.probe.rules} == {"DistanceRule", "LinearRule"}
    monkeypatch.delitem(RULES, DistanceLayer)
    generic = PathKernelEngine(*args)
    assert not generic.probe.per_row_t
    A, X_train = torch.as_tensor(A[:3]), clf._fit_X
    for kwargs in ({"B": X_train, "b_train": True}, {"a_train": True}, {}):
        points = X_train[:8] if kwargs.get("a_train") else A
        np.testing.assert_allclose(
            factored.gram(points, **kwargs), generic.gram(points, **kwargs), rtol=1e-12, atol=0
        )


CASES = [
    (kernel, transform)
    for kernel in FACTORED_KERNELS
    for transform in ("none", "sqrt", "log1p", "standardize")
    # cosine is signed (no sqrt, log1p); a squared distance plus bias crossing zero
    # under sqrt has an infinite derivative there, which no quadrature integrates to
    # 1e-9 (2e-8 with the generic rule as well): not this rule's concern.
    if not (kernel == "cosine" and transform in ("sqrt", "log1p"))
    and (kernel, transform) != ("sqeuclidean", "sqrt")
]


@pytest.mark.parametrize(("kernel", "transform"), CASES)
def test_sum_identity(kernel, transform):
    clf, _, A = fit(kernel, transform)
    assert {type(rule).__name__ for rule in clf._engine().probe.rules} == {
        "DistanceRule",
        "LinearRule",
    }
    parts = clf.decompose(A)
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-9
    assert parts.residual.max() < 1e-9


@pytest.mark.parametrize(
    ("kernel", "head"), [("sqeuclidean", "linear"), ("rbf", "distance"), ("cosine", "distance")]
)
def test_sum_identity_two_hidden_distance_layers(kernel, head):
    transform = "standardize" if kernel == "cosine" else "log1p"
    clf, _, A = fit(kernel, transform, sizes=(5, 4), head=head)
    assert clf._engine().probe.per_row_t
    parts = clf.decompose(A)
    np.testing.assert_allclose(parts.output, clf.predict_log_proba(A), rtol=0, atol=1e-12)
    assert np.abs(parts.bias + parts.contributions.sum(1) - parts.output).max() < 1e-9
    assert parts.residual.max() < 1e-9
