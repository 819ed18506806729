"""The whole-network Jacobian fallback against independent computations.

References: per-sample gradients by plain autograd loops (one backward pass per
row and output, on a copy of the module holding the path's weights), and the
trained network's own output (the sum identity of the decomposition).
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._engine.rules._jacobian import JacobianRule
from sklearn_pathkernel._path import WeightPath
from sklearn_pathkernel._training import SolverSettings
from sklearn_pathkernel._training._loop import train_module

DTYPE = torch.float64
N_FEATURES, N_CLASSES = 8, 3

# torch has no vmap batching rule for CPU flash attention: it loops, and says so.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


# -- networks the per-layer hooks cannot follow ----------------------------------------


class SharedLinear(nn.Module):
    """(a) The same ``nn.Linear`` applied twice per forward pass."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(N_FEATURES, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        return self.head(torch.tanh(self.mid(h)))


class TiedWeights(nn.Module):
    """(b) ``decoder.weight = encoder.weight``: one tensor under two names."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(N_FEATURES, N_FEATURES)
        self.decoder = nn.Linear(N_FEATURES, N_FEATURES)
        self.decoder.weight = self.encoder.weight
        self.head = nn.Linear(N_FEATURES, N_CLASSES)

    def forward(self, x):
        return self.head(torch.relu(self.decoder(torch.tanh(self.encoder(x)))))


class SelfAttention(nn.Module):
    """(c) ``nn.MultiheadAttention`` over the input read as 4 tokens of width 2."""

    def __init__(self, d_model=2, n_tokens=4):
        super().__init__()
        self.d_model, self.n_tokens = d_model, n_tokens
        self.attention = nn.MultiheadAttention(d_model, 1, batch_first=True)
        self.head = nn.Linear(d_model * n_tokens, N_CLASSES)

    def forward(self, x):
        tokens = x.view(x.shape[0], self.n_tokens, self.d_model)
        mixed, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head(mixed.flatten(1))


class DirectParameter(nn.Module):
    """(d) A parameter used in the module's own forward, next to child layers."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(0.3 * torch.randn(N_FEATURES, 6))
        self.inp = nn.Linear(N_FEATURES, 6)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.inp(x) + x @ self.W))


class WeightOutsideLayer(nn.Module):
    """A layer's parameters used without calling the layer (and the layer called too)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(N_FEATURES, N_FEATURES)
        self.head = nn.Linear(N_FEATURES, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.fc(x)) + torch.tanh(F.linear(x, self.fc.weight))
        return self.head(h)


class FrozenProjection(nn.Module):
    """A frozen layer's weight used in the parent: a constant, no hazard."""

    def __init__(self):
        super().__init__()
        self.projection = nn.Linear(N_FEATURES, 6).requires_grad_(False)
        self.inp = nn.Linear(N_FEATURES, 6)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.inp(x) + F.linear(x, self.projection.weight)))


class FrozenAndShared(nn.Module):
    """A hazard (a layer applied twice) next to a frozen layer: the frozen
    weights stay constants of the fallback, outside the path."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(N_FEATURES, 6).requires_grad_(False)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.frozen(x))
        return self.head(torch.tanh(self.mid(torch.tanh(self.mid(h)))))


class TokensInBatch(nn.Module):
    """A layer applied to tokens folded into the batch axis: its rows are not samples."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Linear(2, 3)
        self.head = nn.Linear(12, N_CLASSES)

    def forward(self, x):
        n = x.shape[0]
        return self.head(torch.tanh(self.tok(x.reshape(4 * n, 2))).reshape(n, 12))


def weight_norm_mlp():
    """A parametrised weight: computed by a module called without inputs."""
    return nn.Sequential(
        parametrizations.weight_norm(nn.Linear(N_FEATURES, 5)), nn.Tanh(), nn.Linear(5, N_CLASSES)
    )


class RowGuard(nn.Module):
    """A layer applied twice, and Python control flow on each row's values
    (which ``vmap`` cannot batch): a guard that never fires on this data."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(N_FEATURES, 6)
        self.head = nn.Linear(6, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        rows = [row / 2 if float(row.detach().max()) > 100 else row for row in h]
        return self.head(torch.stack(rows)) + self.head(h)


def mlp():
    return nn.Sequential(
        nn.Linear(N_FEATURES, 6), nn.ReLU(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, N_CLASSES)
    )


HAZARDS = {
    "shared_linear": (SharedLinear, "called 2 times"),
    "tied_weights": (TiedWeights, "tied parameters (encoder.weight is decoder.weight)"),
    "self_attention": (SelfAttention, "returns a tuple"),
    "direct_parameter": (DirectParameter, "uses parameters of its own (W)"),
    "weight_outside_layer": (WeightOutsideLayer, "fc.weight is used outside the forward of fc"),
    "row_guard": (RowGuard, "head (Linear) is called 2 times"),
    "tokens_in_batch": (TokensInBatch, "tok (Linear) returns no row per input row"),
    "weight_norm": (weight_norm_mlp, "(ParametrizationList) is called with keyword, non-tensor"),
}


# -- helpers ---------------------------------------------------------------------------


def blobs(n, seed):
    rng = np.random.RandomState(seed)
    centers = 2.0 * rng.randn(N_CLASSES, N_FEATURES)
    y = rng.randint(0, N_CLASSES, n)
    return torch.tensor(centers[y] + rng.randn(n, N_FEATURES)), torch.tensor(y)


def trained(factory, n=24, steps=10, lr=0.3, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = factory().to(DTYPE)
    X, y = blobs(n, seed)
    path = train_module(
        module, X, y, learning_rate=lr, max_iter=steps, random_state=seed, **kwargs
    ).path
    return module, path, X, y


def queries(n=5, seed=1):
    return torch.tensor(np.random.RandomState(seed).randn(n, N_FEATURES) * 1.5)


def trainable_path(module, n_steps=0, scale=0.1, seed=0):
    """A path over the module's trainable parameters only, with random steps."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    start = torch.cat([p.detach().reshape(-1) for _, p in named])
    generator = torch.Generator().manual_seed(seed)
    moves = scale * torch.randn(n_steps, start.numel(), dtype=DTYPE, generator=generator)
    weights = torch.cat([start[None], start[None] + torch.cumsum(moves, 0)])
    return WeightPath(
        weights=weights,
        param_names=[name for name, _ in named],
        param_shapes=[tuple(p.shape) for _, p in named],
    )


def at_weights(module, path, flat):
    """A copy of ``module`` holding the path weights ``flat`` (others unchanged)."""
    copied = copy.deepcopy(module)
    values = path.unflatten(flat)
    with torch.no_grad():
        for name, param in copied.named_parameters():
            if name in values:
                param.copy_(values[name])
    return copied


def autograd_jacobians(module, path, flat, X):
    """(n, K, W): one autograd backward pass per row and output, in path order."""
    copied = at_weights(module, path, flat)
    named = dict(copied.named_parameters())
    params = [named[name] for name in path.param_names]
    rows = []
    for x in X:
        out = F.log_softmax(copied(x[None]), dim=1)[0]
        per_output = []
        for k in range(out.shape[0]):
            grads = torch.autograd.grad(out[k], params, retain_graph=True, allow_unused=True)
            per_output.append(
                torch.cat(
                    [
                        torch.zeros_like(p).reshape(-1) if g is None else g.reshape(-1)
                        for g, p in zip(grads, params, strict=True)
                    ]
                )
            )
        rows.append(torch.stack(per_output))
    return torch.stack(rows)


def brute_force_training_gram(module, path, X):
    """``sum_s <g(x; w_s), g(x'; w_s)>`` summed over outputs, by autograd loops."""
    gram = torch.zeros(X.shape[0], X.shape[0], dtype=DTYPE)
    for step in range(path.n_steps):
        J = autograd_jacobians(module, path, path.weights[step], X).flatten(1)
        gram += J @ J.T
    return gram.numpy()


def assert_sum_identity(module, engine, X_query):
    result = engine.decompose(X_query)
    with torch.no_grad():
        expected = F.log_softmax(module(X_query), dim=1).numpy()
    # (decay: the weight-decay term, exactly 0 without weight decay)
    total = result.bias + result.contributions.sum(1) + result.decay
    np.testing.assert_allclose(total, expected, rtol=0, atol=1e-9)
    np.testing.assert_allclose(result.output, expected, rtol=0, atol=1e-12)


# -- the rule itself ---------------------------------------------------------------------


@pytest.mark.parametrize("factory", [DirectParameter, SelfAttention, FrozenProjection])
def test_factors_match_autograd_jacobians(factory):
    """Every output, one output per row, and rows at their own point of a step."""
    torch.manual_seed(0)
    module = factory().to(DTYPE)
    path = trainable_path(module, n_steps=1)
    X = queries(n=4)
    start, direction = path.weights[0], path.step_direction(0)
    # budget=1: one row per tile, so that tiles are stitched together too
    for rule in (JacobianRule(module, path), JacobianRule(module, path, budget=1)):
        log_proba, factors = rule.evaluate(X, start)
        expected = autograd_jacobians(module, path, start, X)
        torch.testing.assert_close(factors.grads, expected, rtol=1e-10, atol=1e-12)
        with torch.no_grad():
            own = F.log_softmax(at_weights(module, path, start)(X), dim=1)
        torch.testing.assert_close(log_proba, own, rtol=1e-12, atol=1e-13)

        outputs = torch.tensor([2, 0, 1, 2])
        _, picked = rule.evaluate(X, start, outputs)
        torch.testing.assert_close(
            picked.grads[:, 0], expected[torch.arange(4), outputs], rtol=1e-10, atol=1e-12
        )

        t = torch.tensor([0.0, 0.25, 0.9, 1.0], dtype=DTYPE)
        _, moving = rule.evaluate(X, start, direction=direction, t=t)
        for i in range(4):
            at_t = autograd_jacobians(module, path, start + float(t[i]) * direction, X[i : i + 1])
            torch.testing.assert_close(moving.grads[i : i + 1], at_t, rtol=1e-10, atol=1e-12)
        _, scalar = rule.evaluate(X, start, direction=direction, t=0.5)
        at_half = autograd_jacobians(module, path, start + 0.5 * direction, X)
        torch.testing.assert_close(scalar.grads, at_half, rtol=1e-10, atol=1e-12)


def test_rows_one_by_one_when_vmap_cannot_batch_the_forward():
    torch.manual_seed(0)
    module = RowGuard().to(DTYPE)
    path = trainable_path(module, n_steps=1)
    rule = JacobianRule(module, path)
    X, start, direction = queries(n=3), path.weights[0], path.step_direction(0)
    t = torch.tensor([0.1, 0.5, 0.7], dtype=DTYPE)
    _, factors = rule.evaluate(X, start, direction=direction, t=t)
    assert "vmap" in rule.vmap_failure
    for i in range(3):
        expected = autograd_jacobians(module, path, start + float(t[i]) * direction, X[i : i + 1])
        torch.testing.assert_close(factors.grads[i : i + 1], expected, rtol=1e-10, atol=1e-12)
    _, picked = rule.evaluate(X, start, torch.tensor([1, 2, 0]))
    expected = autograd_jacobians(module, path, start, X)[torch.arange(3), [1, 2, 0]]
    torch.testing.assert_close(picked.grads[:, 0], expected, rtol=1e-10, atol=1e-12)


def test_refuses_jacobians_that_do_not_fit(monkeypatch):
    import sklearn_pathkernel._engine._planning as memory

    torch.manual_seed(0)
    module = SharedLinear().to(DTYPE)
    path = trainable_path(module)
    monkeypatch.setattr(memory, "available_memory", lambda: 1000)
    with pytest.raises(MemoryError, match="whole-network fallback"):
        JacobianRule(module, path).evaluate(queries(n=4), path.weights[0])


def test_protocol_operations_match_materialised_jacobians():
    """inner, directional, integrate and flatten against plain tensor algebra."""
    torch.manual_seed(0)
    module = DirectParameter().to(DTYPE)
    path = trainable_path(module, n_steps=1)
    rule = JacobianRule(module, path)
    start = path.weights[0]
    A, B = queries(n=3, seed=2), queries(n=4, seed=3)
    J_a = autograd_jacobians(module, path, start, A)
    J_b = autograd_jacobians(module, path, start, B)
    left, right = rule.evaluate(A, start)[1], rule.evaluate(B, start)[1]
    torch.testing.assert_close(
        rule.inner(left, right, "pairs"), torch.einsum("nkw,mjw->nmkj", J_a, J_b)
    )
    torch.testing.assert_close(
        rule.inner(left, right, "trace"), torch.einsum("nkw,mkw->nm", J_a, J_b)
    )
    torch.testing.assert_close(rule.inner(left, left, "diag"), (J_a * J_a).sum((1, 2)))
    direction = path.step_direction(0)
    torch.testing.assert_close(rule.flatten(path.unflatten(direction)), direction)
    torch.testing.assert_close(rule.directional(left, path.unflatten(direction)), J_a @ direction)
    rows, weights = torch.tensor([0, 1, 0]), torch.tensor([0.5, 2.0, -1.0], dtype=DTYPE)
    integral = rule.integrate(rows, weights, left, 2)
    torch.testing.assert_close(rule.materialise(integral)[0], 0.5 * J_a[0] - J_a[2])
    torch.testing.assert_close(rule.materialise(integral)[1], 2.0 * J_a[1])


# -- detection ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", HAZARDS)
def test_probe_names_the_hazard(name):
    factory, reason = HAZARDS[name]
    torch.manual_seed(0)
    module = factory().to(DTYPE)
    probe = NetworkProbe(module, trainable_path(module), queries(n=1))
    assert reason in probe.fallback_reason
    assert [type(rule) for rule in probe.rules] == [JacobianRule]
    assert not probe.per_row_t


@pytest.mark.parametrize("factory", [mlp, FrozenProjection, lambda: nn.LayerNorm(N_FEATURES)])
def test_probe_keeps_per_layer_rules_without_hazards(factory):
    """A frozen parameter is a constant: its use outside its layer is harmless."""
    torch.manual_seed(0)
    module = factory().to(DTYPE)
    path = trainable_path(module)
    assert "projection.weight" not in path.param_names
    probe = NetworkProbe(module, path, queries(n=1))
    assert probe.fallback_reason is None
    assert JacobianRule not in [type(rule) for rule in probe.rules]
    # without an example, the dry run happens on the first rows evaluated
    lazy = NetworkProbe(module, path)
    lazy.output(path.weights[0], queries(n=2))
    assert lazy.fallback_reason is None


def test_lazy_dry_run_finds_the_hazard():
    torch.manual_seed(0)
    module = SharedLinear().to(DTYPE)
    path = trainable_path(module)
    probe = NetworkProbe(module, path)
    log_proba, factors = probe.output_and_factors(path.weights[0], queries(n=3))
    assert "called 2 times" in probe.fallback_reason
    torch.testing.assert_close(
        factors[0].grads, autograd_jacobians(module, path, path.weights[0], queries(n=3))
    )


def test_dry_run_leaves_buffers_and_random_state_alone():
    """A module in training mode would update its running statistics and draw
    dropout masks."""
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Linear(N_FEATURES, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 3)
    )
    module = module.to(DTYPE).train()
    before = {name: b.clone() for name, b in module.named_buffers()}
    rng = torch.get_rng_state()
    NetworkProbe(module, trainable_path(module), queries(n=2))
    for name, buffer in module.named_buffers():
        torch.testing.assert_close(buffer, before[name], rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)


# -- end to end ------------------------------------------------------------------------


@pytest.mark.parametrize("name", HAZARDS)
def test_decompose_sums_to_the_trained_network(name):
    factory, reason = HAZARDS[name]
    module, path, X, y = trained(factory)
    engine = PathKernelEngine(module, path, X)
    assert reason in engine.probe.fallback_reason
    assert_sum_identity(module, engine, queries())


@pytest.mark.parametrize(
    "settings",
    [
        dict(solver="sgd", momentum=0.8, weight_decay=0.02),
        dict(solver="adamw", weight_decay=0.1, epsilon=1e-6),
    ],
    ids=["momentum-decay", "adamw"],
)
@pytest.mark.parametrize("factory", [FrozenAndShared, DirectParameter])
def test_fallback_with_other_solvers_and_mini_batches(factory, settings):
    """Momentum and Adam accumulate materialised features over the steps: the
    fallback's single rule serves them too. Frozen weights are not in the path."""
    lr = 0.02 if settings["solver"] == "adamw" else 0.1
    module, path, X, y = trained(
        factory, steps=3, lr=lr, batch_size=8, solver=SolverSettings(**settings)
    )
    assert not any(name.startswith("frozen") for name in path.param_names)
    engine = PathKernelEngine(module, path, X)
    assert engine.probe.fallback_reason is not None
    assert_sum_identity(module, engine, queries())
    assert np.abs(engine.decompose(queries()).decay).max() > 0


def test_plain_mlp_keeps_factored_rules_and_forced_fallback_agrees():
    module, path, X, y = trained(mlp)
    engine = PathKernelEngine(module, path, X)
    assert engine.probe.fallback_reason is None
    forced = PathKernelEngine(module, path, X)
    forced._probes.main = NetworkProbe(module, path, X[:1], force_jacobian=True)
    assert forced.probe.fallback_reason.startswith("forced")
    assert_sum_identity(module, engine, queries())
    assert_sum_identity(module, forced, queries())
    np.testing.assert_allclose(
        forced.decompose(queries()).contributions,
        engine.decompose(queries()).contributions,
        rtol=0,
        atol=1e-11,
    )


def test_training_gram_of_the_fallback():
    """Symmetric PSD, and equal to the sum of Jacobian products over the steps."""
    module, path, X, y = trained(SelfAttention, n=12, steps=4)
    engine = PathKernelEngine(module, path, X)
    assert engine.probe.fallback_reason is not None
    gram = engine.gram(X, a_train=True)
    np.testing.assert_array_equal(gram, gram.T)
    assert np.linalg.eigvalsh(gram).min() > -1e-10 * np.abs(gram).max()
    np.testing.assert_allclose(
        gram, brute_force_training_gram(module, path, X), rtol=1e-10, atol=1e-12
    )
