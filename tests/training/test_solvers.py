"""The solver registry: settings, constraints and parameter docs follow from the
optimiser rules' declared hyperparameters, and a new solver with a new hyperparameter
is one class plus its registration (and, for scikit-learn, the estimator's signature)."""

import ast
import inspect
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import make_blobs
from sklearn.utils._param_validation import InvalidParameterError
from torch import nn

from sklearn_pathkernel import (
    DistanceKernelClassifier,
    DistanceKernelRegressor,
    ExactPathKernelClassifier,
    ExactPathKernelRegressor,
)
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._estimators._docstrings import fill_doc, solver_parameters
from sklearn_pathkernel._training import (
    SOLVERS,
    SolverSettings,
    solver_constraints,
    solver_hyperparameters,
)
from sklearn_pathkernel._training._hyperparameters import Hyperparameter
from sklearn_pathkernel._training._loop import train_module
from sklearn_pathkernel._training._optimizers import AdamRule

ESTIMATORS = [
    ExactPathKernelClassifier,
    ExactPathKernelRegressor,
    DistanceKernelClassifier,
    DistanceKernelRegressor,
]


def test_registered_hyperparameters_in_order():
    assert list(solver_hyperparameters()) == [
        "momentum",
        "nesterovs_momentum",
        "beta_1",
        "beta_2",
        "epsilon",
        "weight_decay",
    ]


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: e.__name__)
def test_every_estimator_takes_every_solver_parameter(estimator):
    # scikit-learn needs explicit signatures: this is what catches a forgotten one.
    signature = inspect.signature(estimator).parameters
    for name, hyperparameter in solver_hyperparameters().items():
        assert name in signature, name
        if not (estimator is DistanceKernelClassifier and name == "epsilon"):
            assert signature[name].default == hyperparameter.default, name
    assert set(solver_constraints()) <= set(estimator._parameter_constraints)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: e.__name__)
def test_docstring_states_every_default(estimator):
    doc = estimator.__doc__
    for name, parameter in inspect.signature(estimator).parameters.items():
        match = re.search(rf"^    {name} : .*default=(.+)$", doc, flags=re.MULTILINE)
        assert match, f"{name} is not documented"
        assert ast.literal_eval(match.group(1).strip()) == parameter.default, name


def test_settings_take_defaults_and_refuse_unknown_names():
    settings = SolverSettings("adam", beta_1=0.5)
    assert settings.values["beta_1"] == 0.5 and settings.values["epsilon"] == 1e-8
    params = [nn.Parameter(torch.ones(2))]
    adam = settings.optimizer(params, 0.1).defaults
    assert (adam["betas"], adam["eps"], adam["lr"]) == ((0.5, 0.999), 1e-8, 0.1)
    sgd = SolverSettings("sgd", momentum=0.7, nesterovs_momentum=True).optimizer(params, 0.1)
    assert type(sgd) is torch.optim.SGD
    assert sgd.defaults["momentum"] == 0.7 and sgd.defaults["nesterov"]
    # torch (like MLPClassifier) applies Nesterov only with momentum
    assert (
        not SolverSettings("sgd", nesterovs_momentum=True)
        .optimizer(params, 0.1)
        .defaults["nesterov"]
    )
    with pytest.raises(TypeError, match="Unknown solver hyperparameters.*'betas'"):
        SolverSettings("adam", betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="Unknown solver 'lbfgs'"):
        SolverSettings("lbfgs").optimizer(params, 0.1)


def test_fill_doc_fails_loudly():
    class Missing:
        """No placeholder here."""

    with pytest.raises(ValueError, match=r"no \{text\}"):
        fill_doc(text="x")(Missing)

    class Unfilled:
        """{text} and {other}"""

    with pytest.raises(ValueError, match=r"unfilled placeholders \['\{other\}'\]"):
        fill_doc(text="x")(Unfilled)
    with pytest.raises(KeyError, match="not solver parameters.*'epsilonn'"):
        solver_parameters({"epsilonn": "typo"})


# -- a new optimiser with a new hyperparameter ---------------------------------------

AMSGRAD = Hyperparameter(
    "amsgrad",
    False,
    ("boolean",),
    "Whether {solvers} divides by the running maximum of the second moments.",
    kind="bool",
)


class AMSGradRule(AdamRule):
    """``torch.optim.Adam(amsgrad=...)`` as an estimator solver (a rule defined here,
    as a user would: the reading of the steps is Adam's, which covers ``amsgrad``)."""

    hyperparameters = (*AdamRule.hyperparameters, AMSGRAD)
    summary = "Adam, optionally AMSGrad"

    @classmethod
    def optimizer_arguments(cls, values):
        return {**super().optimizer_arguments(values), "amsgrad": bool(values["amsgrad"])}


@pytest.fixture
def amsgrad(monkeypatch):
    # the one registration (register_optimizer("ams") would also make it the reader
    # of torch.optim.Adam, which AdamRule already is)
    monkeypatch.setitem(SOLVERS, "ams", AMSGradRule)


def test_a_new_rule_reaches_settings_constraints_and_docs(amsgrad):
    assert solver_hyperparameters()["amsgrad"] is AMSGRAD
    assert "ams" in str(solver_constraints()["solver"][0])
    assert solver_constraints()["amsgrad"] == ["boolean"]
    optimizer = SolverSettings("ams", amsgrad=True).optimizer([nn.Parameter(torch.ones(2))], 0.1)
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["amsgrad"]

    class WithoutTheParameter(ExactPathKernelClassifier):
        """{training_parameters}"""

    with pytest.raises(TypeError, match=r"lacks the solver parameters \['amsgrad'\]"):
        fill_doc(training_parameters=solver_parameters())(WithoutTheParameter)

    class WithTheParameter:
        """{training_parameters}"""

        def __init__(  # scikit-learn's explicit signature: what stays per estimator
            self,
            solver="sgd",
            momentum=0.0,
            nesterovs_momentum=False,
            beta_1=0.9,
            beta_2=0.999,
            epsilon=1e-8,
            amsgrad=False,
            weight_decay=0.0,
        ):
            pass  # pragma: no cover

    doc = fill_doc(training_parameters=solver_parameters())(WithTheParameter).__doc__
    text = " ".join(doc.split())
    assert 'solver : {"sgd", "adam", "adamw", "ams"}, default="sgd"' in doc
    assert "amsgrad : bool, default=False" in doc
    assert 'Whether ``"ams"`` divides by the running maximum' in text
    assert 'second-moment estimate of ``"adam"``, ``"adamw"`` and ``"ams"``.' in text


def test_a_new_rule_trains_as_torch_optim_and_stays_exact(amsgrad):
    X, y = make_blobs(20, n_features=3, centers=3, random_state=0)
    X, y = torch.tensor(X), torch.tensor(y)

    def tanh_mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()

    module = tanh_mlp()
    settings = SolverSettings("ams", amsgrad=True, beta_2=0.9)
    path = train_module(module, X, y, solver=settings, learning_rate=0.05, max_iter=6).path

    by_hand = tanh_mlp()
    optimizer = torch.optim.Adam(by_hand.parameters(), lr=0.05, betas=(0.9, 0.9), amsgrad=True)
    for _ in range(6):
        optimizer.zero_grad()
        F.cross_entropy(by_hand(X), y).backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in by_hand.parameters()])
    torch.testing.assert_close(path.weights[-1], flat, rtol=0, atol=1e-14)

    queries = X[:4] + 0.1
    parts = PathKernelEngine(module, path, X).decompose(queries)
    with torch.no_grad():
        output = F.log_softmax(module(queries), dim=1).numpy()
    np.testing.assert_allclose(
        parts.bias + parts.contributions.sum(1) + parts.decay, output, rtol=0, atol=1e-9
    )


def test_the_estimators_refuse_an_unregistered_solver():
    X, y = make_blobs(12, n_features=2, centers=2, random_state=0)
    with pytest.raises(InvalidParameterError, match="'solver' parameter"):
        ExactPathKernelClassifier(solver="ams").fit(X, y)
