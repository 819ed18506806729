"""The decomposition of a scalar target per query (``decompose(X, target=...)``).

Checked through the estimators' public ``decompose`` for plain SGD, momentum and
Adam, classifiers and regressors:

- its identity, ``bias + contributions.sum(1) + decay == T(f)`` with ``T(f)`` from
  the module's own forward pass (``residual``), to 1e-12;
- for an output column (``"output"``, ``"predicted"``, an index per query), the
  column of the full K-output decomposition, to 1e-12;
- for the nonlinear targets (``"margin"``, ``"loss"``) against an independent
  computation: the reference engine of ``tests/_reference.py`` (materialised
  per-example Jacobians of all ``K`` outputs at fixed Gauss nodes, every (step,
  earlier step) pair summed explicitly) with its test feature replaced by the
  chain rule ``sum_q nu_q grad_f T(f(t_q)) . J(t_q)`` on networks where the
  Gauss rule converges spectrally (tanh; identity activations, whose logits are
  polynomials in ``t``, so that the engine takes its exact target-gradient
  weights).
"""

import numpy as np
import pytest
import torch
from _reference import NaivePathKernelEngine, log_proba
from sklearn.datasets import load_digits
from torch.func import grad, vmap

from sklearn_pathkernel import ExactPathKernelClassifier, ExactPathKernelRegressor
from sklearn_pathkernel._engine._targets import LossTarget, MarginTarget, OutputTarget
from sklearn_pathkernel._path import log_softmax

SOLVERS = {
    "sgd": dict(solver="sgd", learning_rate=0.2),
    "momentum": dict(solver="sgd", momentum=0.9, learning_rate=0.1),
    "adam": dict(solver="adam", learning_rate=0.02),
}


def _digits(n=40, n_classes=3):
    X, y = load_digits(return_X_y=True)
    rows = np.random.RandomState(0).permutation(len(y))[:n]
    return X[rows] / 16.0, y[rows] % n_classes


def _classifier(solver, activation="relu", n=40):
    X, y = _digits(n)
    settings = dict(hidden_layer_sizes=(6,), max_iter=3, batch_size=16, random_state=0)
    clf = ExactPathKernelClassifier(activation=activation, **settings, **SOLVERS[solver])
    return clf.fit(X, y), X, y


def _regressor(solver, activation="relu", n=40):
    X, y = _digits(n)
    Y = np.c_[y, 1.0 - y, 0.5 * y].astype(float)
    settings = dict(hidden_layer_sizes=(6,), max_iter=3, batch_size=16, random_state=0)
    reg = ExactPathKernelRegressor(activation=activation, **settings, **SOLVERS[solver])
    return reg.fit(X, Y), X, Y


@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_classifier_targets_add_up_and_columns_match(solver, activation):
    """ReLU: exact nodes (1e-12); tanh: certified nodes, each step to 1e-11 (1e-9)."""
    tolerance = 1e-12 if activation == "relu" else 1e-9
    clf, X, y = _classifier(solver, activation)
    Xq, yq = X[:5], y[:5]
    full = clf.decompose(Xq)
    predicted = clf.predict(Xq)
    codes = np.searchsorted(clf.classes_, yq)
    columns = {
        "output": codes,
        "predicted": np.searchsorted(clf.classes_, predicted),
    }
    for target in ("output", "predicted", "margin", "loss", np.array([2, 0, 1, 1, 0])):
        found = clf.decompose(Xq, target=target, y=yq)
        assert found.contributions.shape == (5, X.shape[0])
        assert found.bias.shape == found.decay.shape == found.output.shape == (5,)
        total = found.bias + found.contributions.sum(1) + found.decay
        np.testing.assert_allclose(total, found.output, rtol=0, atol=tolerance)
        assert found.residual.max() <= tolerance
        picked = columns.get(target) if isinstance(target, str) else target
        if picked is None:
            continue
        rows = np.arange(5)
        np.testing.assert_allclose(
            found.contributions, full.contributions[rows, :, picked], rtol=0, atol=tolerance
        )
        np.testing.assert_allclose(found.bias, full.bias[rows, picked], rtol=0, atol=1e-12)
        np.testing.assert_allclose(found.decay, full.decay[rows, picked], rtol=0, atol=tolerance)
    # the values are the targets' own
    f = clf.predict_log_proba(Xq)
    margin = clf.decompose(Xq, target="margin", y=yq)
    p = np.exp(f[np.arange(5), codes])
    np.testing.assert_allclose(margin.output, np.log(p) - np.log1p(-p), rtol=1e-12)
    loss = clf.decompose(Xq, target="loss", y=yq)
    np.testing.assert_allclose(loss.output, -f[np.arange(5), codes], rtol=1e-12)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_regressor_targets_add_up_and_columns_match(solver):
    reg, X, Y = _regressor(solver)
    Xq, Yq = X[:4], Y[:4]
    full = reg.decompose(Xq)
    columns = np.array([0, 2, 1, 2])
    found = reg.decompose(Xq, target=columns)
    np.testing.assert_allclose(
        found.contributions, full.contributions[np.arange(4), :, columns], rtol=0, atol=1e-12
    )
    assert found.residual.max() <= 1e-12
    loss = reg.decompose(Xq, target="loss", y=Yq)
    assert loss.residual.max() <= 1e-12
    np.testing.assert_allclose(loss.output, 0.5 * ((reg.predict(Xq) - Yq) ** 2).mean(1), rtol=1e-12)


class _TargetReference(NaivePathKernelEngine):
    """The reference engine for ``T(f)``: its test feature by the chain rule over
    the K outputs' Jacobians at the Gauss nodes, its outputs ``T``'s."""

    def __init__(self, module, path, X_train, target, labels, link=log_softmax):
        self.target, self.labels = target, labels
        super().__init__(module, path, X_train, link=link, quadrature="gauss", n_points=24)
        self.n_outputs = 1

    def _f(self, weights, X):
        f = log_proba(self.module, self.path, weights, X, self.link)
        return vmap(self.target)(f, self.labels[: X.shape[0]])[:, None]

    def _test_feature(self, step, X):
        phi = torch.zeros((X.shape[0], 1, self.path.n_weights), dtype=X.dtype)
        start, direction = self.path.weights[step], self.path.step_direction(step)
        for q, (t, nu) in enumerate(zip(self.nodes, self.node_weights, strict=True)):
            jac = self._jac_at_nodes(step, X, slice(q, q + 1))[0]  # (n, K, W)
            f = log_proba(self.module, self.path, start + t * direction, X, self.link)
            slope = vmap(grad(self.target))(f, self.labels)  # (n, K)
            phi[:, 0] += nu * torch.einsum("nk,nkw->nw", slope, jac)
        return phi


@pytest.mark.parametrize("activation", ["tanh", "identity"])
@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("name", ["margin", "loss"])
def test_nonlinear_targets_match_the_chain_rule_reference(name, solver, activation):
    clf, X, y = _classifier(solver, activation, n=24)
    Xq, yq = X[:3], y[:3]
    found = clf.decompose(Xq, target=name, y=yq)
    codes = torch.as_tensor(np.searchsorted(clf.classes_, yq))
    target = MarginTarget() if name == "margin" else LossTarget(clf._loss)
    X_train = torch.as_tensor(X)
    reference = _TargetReference(clf.module_, clf.path_, X_train, target, codes)
    expected = reference.decompose(torch.as_tensor(Xq))
    np.testing.assert_allclose(found.contributions, expected.contributions[..., 0], atol=1e-10)
    np.testing.assert_allclose(found.decay, expected.decay[:, 0], atol=1e-10)
    # tanh: certified quadrature (each step held to 1e-11); identity: exact nodes
    assert found.residual.max() <= (1e-9 if activation == "tanh" else 1e-12)


@pytest.mark.parametrize("solver", ["sgd", "adam"])
def test_regressor_loss_matches_the_chain_rule_reference(solver):
    reg, X, Y = _regressor(solver, "tanh", n=24)
    Xq, Yq = X[:3], Y[:3]
    found = reg.decompose(Xq, target="loss", y=Yq)
    labels = torch.as_tensor(Yq)
    reference = _TargetReference(
        reg.module_, reg.path_, torch.as_tensor(X), LossTarget(reg._loss), labels,
        link=lambda z: z,
    )  # fmt: skip
    expected = reference.decompose(torch.as_tensor(Xq))
    np.testing.assert_allclose(found.contributions, expected.contributions[..., 0], atol=1e-10)


def test_engine_target_equals_the_column_with_the_engine_api():
    clf, X, _ = _classifier("momentum")
    engine = clf._engine()
    from sklearn_pathkernel._engine import QueryTargets

    Xq = torch.as_tensor(X[:3])
    columns = torch.tensor([1, 0, 2])
    found = engine.decompose(Xq, targets=QueryTargets(OutputTarget(), columns))
    full = engine.decompose(Xq)
    assert found.contributions.shape == (3, X.shape[0], 1)
    np.testing.assert_allclose(
        found.contributions[..., 0], full.contributions[np.arange(3), :, columns.numpy()],
        rtol=0, atol=1e-12,
    )  # fmt: skip
    with pytest.raises(ValueError, match="one per row"):
        engine.decompose(Xq, targets=QueryTargets(OutputTarget(), columns[:2]))


def test_bad_targets_are_refused_by_name():
    clf, X, y = _classifier("sgd")
    with pytest.raises(ValueError, match="target must be one of"):
        clf.decompose(X[:2], target="logit")
    with pytest.raises(ValueError, match="needs the queries' true targets"):
        clf.decompose(X[:2], target="loss")
    with pytest.raises(ValueError, match="columns must be"):
        clf.decompose(X[:2], target=np.array([0, 7]))
    with pytest.raises(ValueError, match="labels the model was not trained on"):
        clf.decompose(X[:2], target="output", y=np.array([0, 9]))
    with pytest.raises(ValueError, match="pass target= too"):
        clf.decompose(X[:2], y=y[:2])
    reg, Xr, _ = _regressor("sgd")
    with pytest.raises(ValueError, match="needs classes"):
        reg.decompose(Xr[:2], target="margin")
    with pytest.raises(ValueError, match="needs classes"):
        reg.decompose(Xr[:2], target="predicted")


def _column_and_identity(engine, Q, columns, identity=1e-12):
    """The output target equals the full decomposition's column; the margin adds up."""
    from sklearn_pathkernel._engine import QueryTargets

    target = MarginTarget()
    full = engine.decompose(Q)
    picked = engine.decompose(Q, targets=QueryTargets(OutputTarget(), columns))
    rows = np.arange(Q.shape[0])
    scale = max(1.0, np.abs(full.contributions).max())
    np.testing.assert_allclose(
        picked.contributions[..., 0], full.contributions[rows, :, columns.numpy()],
        rtol=0, atol=1e-12 * scale,
    )  # fmt: skip
    found = engine.decompose(Q, targets=QueryTargets(target, columns))
    total = found.bias + found.contributions.sum(1) + found.decay
    assert np.abs(total - found.output).max() <= identity
    return found


@pytest.mark.parametrize("solver", ["sgd", "adam"])
def test_convolutional_max_pool_network(engine_cases, solver):
    """Conv and max-pool layers (the conv rule, kinks of max-pool and ReLU)."""
    from sklearn_pathkernel._training import SolverSettings

    lr = 0.3 if solver == "sgd" else 0.02
    module, path, X, y = engine_cases.trained(
        engine_cases.SmallCNN(3), n=20, n_features=36, steps=4, lr=lr,
        solver=SolverSettings(solver),
    )  # fmt: skip
    engine = engine_cases.engine_for(module, path, X, y)
    Q = engine_cases.queries(36, n=3)
    _column_and_identity(engine, Q, torch.tensor([0, 2, 1]))


def test_distance_network():
    """The distance layers' rules."""
    from sklearn_pathkernel import DistanceKernelClassifier

    X, y = _digits(30)
    clf = DistanceKernelClassifier(max_iter=3, random_state=0).fit(X, y)
    Q = torch.as_tensor(X[:3] + 0.01)
    _column_and_identity(clf._engine(), Q, torch.tensor([1, 0, 2]), identity=1e-9)


def test_whole_network_jacobian_fallback(engine_cases, monkeypatch):
    """The probe's whole-network Jacobian rule: the target's cotangent on f per node."""
    from sklearn_pathkernel._engine._probe import NetworkProbe

    init = NetworkProbe.__init__

    def forced(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "force_jacobian": True})

    monkeypatch.setattr(NetworkProbe, "__init__", forced)
    module, path, X, y = engine_cases.trained(engine_cases.mlp([5, 8, 3]), n=20, steps=4)
    engine = engine_cases.engine_for(module, path, X, y)
    assert engine.probe.jacobian is not None
    _column_and_identity(engine, engine_cases.queries(5, n=3), torch.tensor([2, 1, 0]),
                         identity=1e-9)  # fmt: skip


def test_fixed_quadrature_is_the_column_of_the_same_rule(engine_cases):
    """A fixed rule (riemann): the target's nodes are the rule's own."""
    module, path, X, y = engine_cases.trained(engine_cases.mlp([5, 8, 3]), n=20, steps=4)
    engine = engine_cases.engine_for(module, path, X, y, quadrature="riemann", n_points=7)
    _column_and_identity(engine, engine_cases.queries(5, n=3), torch.tensor([0, 0, 2]),
                         identity=np.inf)  # fmt: skip


def test_one_output_regressor_loss():
    """A regressor fitted on a 1-d ``y``: ``y`` of the queries 1-d too."""
    X, y = _digits(30)
    reg = ExactPathKernelRegressor(hidden_layer_sizes=(5,), max_iter=2, batch_size=10,
                                   random_state=0).fit(X, y.astype(float))  # fmt: skip
    found = reg.decompose(X[:3], target="loss", y=y[:3].astype(float))
    assert found.contributions.shape == (3, 30)
    assert found.residual.max() <= 1e-12
    np.testing.assert_allclose(found.output, 0.5 * (reg.predict(X[:3]) - y[:3]) ** 2, rtol=1e-12)
    full = reg.decompose(X[:3])
    np.testing.assert_allclose(reg.decompose(X[:3], target="output").contributions,
                               full.contributions, rtol=0, atol=1e-12)  # fmt: skip


def _cotangents_per_node_pass(monkeypatch):
    """Per node pass of the probe (rows at their own points of a step), its route
    and the cotangents per row its backward pass carries: the folded route's
    ``K'``, the batched autograd route's ``K'``, or 1 for a plain autograd pass."""
    from sklearn_pathkernel._engine import _probe

    passes, inside = [], []
    factors, folded_grad = _probe.NetworkProbe._factors, _probe.folded_grad
    grad = torch.autograd.grad

    def in_pass(self, start, X, outputs, direction, t, *args, **kwargs):
        inside.append(torch.is_tensor(t))
        try:
            return factors(self, start, X, outputs, direction, t, *args, **kwargs)
        finally:
            inside.pop()

    def folded(roots, inputs, grad_roots, shortcuts=(), pooled=()):
        if inside and inside[-1]:
            passes.append(("folded", {int(g.shape[0]) for g in grad_roots}))
        return folded_grad(roots, inputs, grad_roots, shortcuts, pooled)

    def autograd(outputs, inputs, grad_outputs=None, *args, is_grads_batched=False, **kwargs):
        if inside and inside[-1]:
            counts = {int(g.shape[0]) for g in grad_outputs} if is_grads_batched else {1}
            passes.append(("batched" if is_grads_batched else "plain", counts))
        return grad(outputs, inputs, grad_outputs, *args, is_grads_batched=is_grads_batched,
                    **kwargs)  # fmt: skip

    monkeypatch.setattr(_probe.NetworkProbe, "_factors", in_pass)
    monkeypatch.setattr(_probe, "folded_grad", folded)
    monkeypatch.setattr(torch.autograd, "grad", autograd)
    return passes


@pytest.mark.parametrize("queries", [1, 3])
def test_two_conv_cnn_target_passes_carry_one_cotangent(engine_cases, monkeypatch, queries):
    """The 28x28 CNN's layers (two convolutions, ReLU, max-pools), AdamW: every
    node pass of a scalar target back-propagates one cotangent per row (the K
    outputs' node passes carry K); the output target is the K-output
    decomposition's column to 1e-13 of its scale and adds up to 1e-12, the margin
    to 1e-9 (one query and three: the passes' routes differ with the rows that
    join them)."""
    from sklearn_pathkernel._engine import QueryTargets
    from sklearn_pathkernel._training import SolverSettings

    torch.manual_seed(0)
    module, path, X, y = engine_cases.trained(
        engine_cases.TwoConvCNN(), n=24, n_features=100, steps=4, lr=0.01, batch_size=8,
        solver=SolverSettings(solver="adamw", weight_decay=0.01),
    )  # fmt: skip
    engine = engine_cases.engine_for(module, path, X, y)
    Q = X[-queries:] + 0.1
    passes = _cotangents_per_node_pass(monkeypatch)
    full = engine.decompose(Q)
    assert passes and all(counts == {3} for _, counts in passes)
    passes.clear()
    columns = torch.tensor([2, 0, 1])[:queries]
    picked = engine.decompose(Q, targets=QueryTargets(OutputTarget(), columns))
    assert passes and all(counts == {1} for _, counts in passes)
    rows = np.arange(queries)
    expected = full.contributions[rows, :, columns.numpy()]
    scale = np.abs(expected).max()
    assert scale > 0
    assert np.abs(picked.contributions[..., 0] - expected).max() <= 1e-13 * scale
    total = picked.bias + picked.contributions.sum(1) + picked.decay
    assert np.abs(total - picked.output).max() <= 1e-12
    margin = engine.decompose(Q, targets=QueryTargets(MarginTarget(), columns))
    total = margin.bias + margin.contributions.sum(1) + margin.decay
    assert np.abs(total - margin.output).max() <= 1e-9
