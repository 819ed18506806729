"""Output subspaces: trace products with fewer outputs, against independent references.

The references: the unprojected products, materialised per-example Jacobians
(``torch.func``) for the training Gram, and the engine's every-output-pair
("full") cross Gram, which never projects.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap

from sklearn_pathkernel._engine import _output_subspace as _output_subspace
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._modes import OutputMode
from sklearn_pathkernel._engine._output_subspace import RANK_RTOL, OutputSubspace
from sklearn_pathkernel._engine._planning import Planner
from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._engine.rules._gradients import Gradients
from sklearn_pathkernel._engine.rules._linear import LinearRule
from sklearn_pathkernel._training._loop import train_module
from sklearn_pathkernel._training._losses import SquaredError

DTYPE = torch.float64
N_CLASSES = 6


def _mlp(sizes, activation=nn.ReLU):
    torch.manual_seed(0)
    layers = []
    for width_in, width_out in zip(sizes[:-2], sizes[1:-1], strict=True):
        layers += [nn.Linear(width_in, width_out), activation()]
    return nn.Sequential(*layers, nn.Linear(sizes[-2], sizes[-1])).to(DTYPE)


def _data(n=40, n_features=5, seed=0):
    rng = np.random.RandomState(seed)
    centers = 2.0 * rng.randn(N_CLASSES, n_features)
    y = rng.randint(0, N_CLASSES, n)
    return torch.tensor(centers[y] + rng.randn(n, n_features)), torch.tensor(y)


@pytest.fixture(scope="module")
def classifier():
    """A ReLU MLP 5-16-12-6 trained for a few full-batch steps."""
    module = _mlp([5, 16, 12, N_CLASSES])
    X, y = _data()
    path = train_module(module, X, y, learning_rate=0.5, max_iter=6, random_state=0).path
    return module, path, X, y


@pytest.fixture(autouse=True)
def always_reduce(monkeypatch):
    """Reduce however small the products (the tests' networks are tiny)."""
    monkeypatch.setattr(_output_subspace, "_MIN_LEFT_ROWS_PER_OUTPUT", 0)


def _probe_factors(module, path, X, step=0, link=None):
    probe = NetworkProbe(module, path, X[:1], **({} if link is None else {"link": link}))
    return probe, probe.factors(path.weights[step], X)


def _ranks(probe, factors):
    """Per rule, the rank of its output subspace for ``factors`` (None: no subspace)."""
    subspaces = (
        rule.output_subspace(f, f.deltas.shape[0])
        for rule, f in zip(probe.rules, factors, strict=True)
    )
    return [None if subspace is None else subspace.rank for subspace in subspaces]


def test_top_two_layers_of_a_classifier_have_two_directions_per_unit(classifier):
    module, path, X, _ = classifier
    probe, factors = _probe_factors(module, path, X, step=3)
    ranks = _ranks(probe, factors)
    # first layer: its units mix through the next one (all K directions); the
    # layer before the head and the head: span(V[:, o], 1) and span(e_o, 1)
    assert ranks == [None, 2, 2]


def test_a_regressor_s_top_two_layers_have_one_direction_per_unit():
    module = _mlp([5, 16, 12, 3], nn.Tanh)
    X, _ = _data()
    targets = torch.tensor(np.random.RandomState(0).randn(len(X), 3))
    loss = SquaredError()
    path = train_module(module, X, targets, loss=loss, learning_rate=0.1, max_iter=4).path
    probe, factors = _probe_factors(module, path, X, step=2, link=loss.link)
    ranks = _ranks(probe, factors)
    assert ranks == [None, 1, 1]


def test_projection_keeps_trace_products_with_rows_outside_the_subspace(classifier):
    """Only the right side must lie in the span: left rows at other weights (the
    test copy's nodes, half-way through a step), deltas or materialised gradients."""
    module, path, X, _ = classifier
    probe, right = _probe_factors(module, path, X, step=3)
    queries = torch.tensor(np.random.RandomState(1).randn(9, 5) * 1.5)
    halfway = 0.5 * (path.weights[3] + path.weights[4])
    left = probe.factors(halfway, queries)
    projected_any = False
    for rule, a, b in zip(probe.rules, left, right, strict=True):
        subspace = rule.output_subspace(b, len(queries))
        if subspace is None:
            continue
        projected_any = True
        expected = rule.inner(a, b, OutputMode.TRACE)
        projected_b = rule.project_outputs(b, subspace)
        for left_form in (a, Gradients(grads=rule.materialise(a))):
            got = rule.inner(
                rule.project_outputs(left_form, subspace), projected_b, OutputMode.TRACE
            )
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-13 * expected.abs().max())
    assert projected_any


def _synthetic(n=50, n_outputs=7, d_out=4, rank=2, extra=0.0, seed=0):
    """Deltas whose unit-o vectors lie in a random rank-``rank`` span, plus ``extra``
    times a direction outside it."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(d_out, n_outputs, rank + 1, generator=generator, dtype=DTYPE)
    bases = torch.linalg.qr(directions)[0]
    coefficients = torch.randn(d_out, n, rank + 1, generator=generator, dtype=DTYPE)
    coefficients[..., rank] *= extra
    return torch.einsum("okr,onr->nko", bases, coefficients)


def test_directions_are_dropped_only_below_the_tolerance():
    exact = _synthetic()
    assert OutputSubspace.of(exact, n_left=50).rank == 2
    # a third direction at rounding level is dropped ...
    assert OutputSubspace.of(_synthetic(extra=1e-15), n_left=50).rank == 2
    # ... one that would change the products above RANK_RTOL is kept, and exactly
    kept = _synthetic(extra=100 * RANK_RTOL)
    subspace = OutputSubspace.of(kept, n_left=50)
    assert subspace.rank == 3
    left = torch.randn(11, 7, 4, dtype=DTYPE)
    expected = left.flatten(1) @ kept.flatten(1).T
    got = subspace.project(left).flatten(1) @ subspace.project(kept).flatten(1).T
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)


def test_small_rows_keep_their_own_directions():
    """A direction carried only by rows 1e14 times smaller than the rest is not
    rounding: it is kept, and their products stay exact relative to them."""
    deltas = _synthetic()  # in the first two directions of each unit's basis
    small = 1e-14 * _synthetic(n=55, extra=1.0)[50:]  # the same bases, all three
    subspace = OutputSubspace.of(torch.cat([deltas, small]), n_left=50)
    assert subspace.rank == 3
    left = torch.randn(11, 7, 4, dtype=DTYPE)
    expected = left.flatten(1) @ small.flatten(1).T
    got = subspace.project(left).flatten(1) @ subspace.project(small).flatten(1).T
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12 * expected.abs().max())


def test_a_direction_only_beyond_the_first_rows_is_found():
    """The span of the first rows is checked against every row: a direction that
    only later rows carry sends it to the factorisation of all of them."""
    later = _synthetic(n=80, extra=1.0)  # three directions ...
    deltas = torch.cat([_synthetic(n=60), later[60:]])  # ... in the last 20 rows only
    subspace = OutputSubspace.of(deltas, n_left=50)
    assert subspace.rank == 3
    left = torch.randn(11, 7, 4, dtype=DTYPE)
    expected = left.flatten(1) @ deltas.flatten(1).T
    got = subspace.project(left).flatten(1) @ subspace.project(deltas).flatten(1).T
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-13 * expected.abs().max())


def test_nothing_to_gain_gives_no_subspace(monkeypatch):
    full_rank = torch.randn(50, 7, 4, dtype=DTYPE)
    assert OutputSubspace.of(full_rank, n_left=50) is None
    assert OutputSubspace.of(_synthetic(n_outputs=1, rank=0), n_left=50) is None
    monkeypatch.setattr(_output_subspace, "_MIN_LEFT_ROWS_PER_OUTPUT", 1)
    assert OutputSubspace.of(_synthetic(), n_left=6) is None  # fewer left rows than outputs


def test_zero_gradients_take_one_direction():
    """A layer whose gradients all vanish (behind a head that starts at zero)."""
    subspace = OutputSubspace.of(torch.zeros(50, 7, 4, dtype=DTYPE), n_left=50)
    assert subspace.rank == 1
    projected = subspace.project(torch.randn(11, 7, 4, dtype=DTYPE))
    assert projected.shape == (11, 1, 4)


def _training_gram_by_jacobians(module, path, X):
    def f(w, x):
        return F.log_softmax(functional_call(module, path.unflatten(w), (x[None],)), 1)[0]

    gram = torch.zeros(len(X), len(X), dtype=DTYPE)
    for step in range(path.n_steps):
        J = vmap(jacrev(f), in_dims=(None, 0))(path.weights[step], X).flatten(1)
        gram += J @ J.T
    return gram.numpy()


@pytest.mark.parametrize("split", ["one task", "products of 7 rows", "tasks of 10 rows"])
def test_engine_grams_with_subspaces_match_independent_references(classifier, split, monkeypatch):
    """Products of a tile with rows beyond it (a task's columns, another task's
    rows, a block that is not symmetric) are projected onto the other side's
    subspace too."""
    module, path, X, y = classifier
    if split == "tasks of 10 rows":
        monkeypatch.setattr(
            Planner,
            "task_tiles",
            lambda self, kind, n, *args, **kwargs: [
                slice(i, min(i + 10, n)) for i in range(0, n, 10)
            ],
        )
    projected = []
    project = LinearRule.project_outputs
    monkeypatch.setattr(
        LinearRule,
        "project_outputs",
        lambda rule, factors, subspace: (
            projected.append(subspace.rank) or project(rule, factors, subspace)
        ),
    )
    engine = PathKernelEngine(module, path, X, tile_size=512 if split == "one task" else 7)
    expected = _training_gram_by_jacobians(module, path, X)
    atol = 1e-13 * np.abs(expected).max()
    np.testing.assert_allclose(engine.gram(X, a_train=True), expected, rtol=1e-12, atol=atol)
    block = engine.gram(X[:15], X, a_train=True, b_train=True)  # not symmetric
    np.testing.assert_allclose(block, expected[:15], rtol=1e-12, atol=atol)
    queries = torch.tensor(np.random.RandomState(2).randn(12, 5) * 1.5)
    trace = engine.gram(queries, X, b_train=True)
    full = engine.gram(queries, X, b_train=True, output="full")  # never projected
    np.testing.assert_allclose(trace, np.einsum("nmkk->nm", full), rtol=1e-12, atol=1e-14)
    gram = engine.gram(queries)  # test x test: each node's rows projected
    np.testing.assert_allclose(np.diag(gram), engine.diag(queries), rtol=1e-12)  # never projected
    assert np.linalg.eigvalsh(gram).min() > -1e-12 * np.abs(gram).max()
    # the products above went through projections: two directions per unit at
    # the top, fewer than K elsewhere when a tile has fewer rows than outputs
    assert 2 in projected and max(projected) < N_CLASSES


def test_results_do_not_depend_on_whether_outputs_are_projected(classifier, monkeypatch):
    module, path, X, y = classifier
    queries = torch.tensor(np.random.RandomState(3).randn(12, 5))
    results = []
    for minimum in (0, 10**9):  # always, never
        monkeypatch.setattr(_output_subspace, "_MIN_LEFT_ROWS_PER_OUTPUT", minimum)
        engine = PathKernelEngine(module, path, X)
        results.append(
            (
                engine.gram(X, a_train=True),
                engine.gram(queries, X, b_train=True),
                engine.gram(queries),
            )
        )
    for projected, plain in zip(*results, strict=True):
        np.testing.assert_allclose(projected, plain, rtol=1e-12, atol=1e-14 * np.abs(plain).max())


@pytest.mark.parametrize("n", [700, 769])
def test_the_two_level_r_is_an_r_of_the_whole_matrix(n):
    """The GPU's tall-skinny QR (run here on the host): ``R^T R`` is the matrix's
    Gram, and its singular values are the matrix's; chunks that do not divide
    the rows are padded with zeros."""
    matrices = torch.randn(3, n, 6, generator=torch.Generator().manual_seed(0), dtype=DTYPE)
    triangle = _output_subspace._tall_skinny_r(matrices, 256)
    assert triangle.shape == (3, 6, 6)
    torch.testing.assert_close(
        triangle.mT @ triangle, matrices.mT @ matrices, rtol=1e-12, atol=1e-10
    )
    torch.testing.assert_close(
        torch.linalg.svdvals(triangle), torch.linalg.svdvals(matrices), rtol=1e-12, atol=0
    )
    assert torch.equal(_output_subspace._r_factor(matrices), torch.linalg.qr(matrices, mode="r")[1])
