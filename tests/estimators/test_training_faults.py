"""Faults during training lose nothing: a divergent or failing fit names the step
and leaves the estimator as it was (fitted or not)."""

import numpy as np
import pytest
import torch
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

SUM_TOL = 1e-9


def snapshot(clf, X_query, fitted_attributes):
    """Everything a fit produced, as copies, to compare before/after."""
    return dict(
        module=clf.module_,
        state={k: v.clone() for k, v in clf.module_.state_dict().items()},
        path=clf.path_,
        path_weights=clf.path_.weights.clone(),
        classes=clf.classes_.copy(),
        n_features_in=clf.n_features_in_,
        attributes=fitted_attributes(clf),
        proba=clf.predict_proba(X_query),
        kernel=clf.kernel_(X_query + 0.25, X_query),
    )


def assert_same_fit(clf, before, X_query, fitted_attributes):
    assert clf.module_ is before["module"]
    for key, value in clf.module_.state_dict().items():
        assert torch.equal(value, before["state"][key])
    assert clf.path_ is before["path"]
    assert torch.equal(clf.path_.weights, before["path_weights"])
    np.testing.assert_array_equal(clf.classes_, before["classes"])
    assert clf.n_features_in_ == before["n_features_in"]
    assert fitted_attributes(clf) == before["attributes"]
    np.testing.assert_array_equal(clf.predict_proba(X_query), before["proba"])
    np.testing.assert_array_equal(clf.kernel_(X_query + 0.25, X_query), before["kernel"])


@pytest.mark.parametrize(
    "params",
    [
        dict(learning_rate=1e300),  # explodes after the first step: weights not finite
        dict(learning_rate=1e300, momentum=0.5),
        dict(learning_rate=lambda step: 1e300 if step == 1 else 0.1),
    ],
    ids=["constant", "momentum", "schedule"],
)
def test_divergent_learning_rate_names_the_step(data, params, make_clf, fitted_attributes):
    X, y = data
    clf = make_clf(max_iter=4, **params)
    with pytest.raises(FloatingPointError, match=r"at step \d+ \(epoch \d+\).*learning.rate"):
        clf.fit(X * 1e3, y)
    # No silently NaN model: the estimator stays unfitted.
    with pytest.raises(NotFittedError):
        check_is_fitted(clf)
    assert fitted_attributes(clf) == []


def test_non_finite_loss_names_the_step(data, make_clf):
    X, y = data
    # Finite at the initial weights (a non-finite initial output is refused before
    # training: tests/test_module_checks.py); the first step makes the logits overflow.
    module = torch.nn.Linear(3, 3).double()
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 1"):
        make_clf(module=module, learning_rate=1e295).fit(X * 1e10, y)


def test_zero_weight_mini_batch_is_a_no_op_step(data, make_clf):
    # A mini-batch whose points all weigh 0 moves nothing (it used to divide 0 by 0).
    X, y = data
    weights = np.r_[np.zeros(4), np.ones(X.shape[0] - 4)]
    clf = make_clf(batch_size=4, shuffle=False, max_iter=2).fit(X, y, sample_weight=weights)
    path = clf.path_
    assert path.n_steps == 6
    for step in (0, 3):  # the batches holding points 0..3
        assert np.array_equal(path.batches[step], np.arange(4))
        assert torch.equal(path.weights[step + 1], path.weights[step])
        assert torch.equal(path.output_gradients[step], torch.zeros(4, 3, dtype=torch.float64))
    parts = clf.decompose(X[:3] + 0.1)
    assert np.abs(parts.contributions[:, :4]).max() == 0.0
    assert parts.residual.max() < SUM_TOL


def failing_module_factory(fail_at_call, exception, training_only=False):
    """A module callable whose forward raises ``exception`` on its ``fail_at_call``-th call
    (counting only the training's passes, which take gradients, with ``training_only``:
    the checks before training run without)."""

    def factory(n_features, n_classes):
        class Failing(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(n_features, n_classes)
                self.calls = 0

            def forward(self, x):
                self.calls += torch.is_grad_enabled() or not training_only
                if self.calls == fail_at_call:
                    raise exception("injected fault")
                return self.linear(x)

        return Failing()

    return factory


def failing_schedule(fail_at_step, exception):
    def schedule(step):
        if step == fail_at_step:
            raise exception("injected fault")
        return 0.5

    return schedule


FAULTS = [
    dict(module=failing_module_factory(1, RuntimeError)),  # the output-width check
    dict(module=failing_module_factory(2, RuntimeError, training_only=True)),  # training
    dict(module=failing_module_factory(2, KeyboardInterrupt, training_only=True)),
    dict(learning_rate=failing_schedule(2, RuntimeError)),
    dict(learning_rate=failing_schedule(0, KeyboardInterrupt)),
    dict(batch_size=2, learning_rate=failing_schedule(4, KeyboardInterrupt)),
]


FAULT_IDS = ["forward-check", "forward-train", "forward-interrupt", "lr", "lr-0", "lr-batch"]


def raises_fault():
    return pytest.raises((RuntimeError, KeyboardInterrupt), match="injected fault")


@pytest.mark.parametrize("fault", FAULTS, ids=FAULT_IDS)
def test_fault_keeps_previous_fit(data, fault, make_clf, make_data, fitted_attributes):
    X, y = data
    clf = make_clf().fit(X, y)
    before = snapshot(clf, X[:4], fitted_attributes)
    # Other data: 5 features and 2 classes, so anything half-assigned would show.
    X_other, y_other = make_data(n_samples=8, n_features=5, n_classes=2, seed=1)
    clf.set_params(**fault)
    with raises_fault():
        clf.fit(X_other, y_other)
    clf.set_params(module=None, learning_rate=0.5, batch_size=None)
    assert_same_fit(clf, before, X[:4], fitted_attributes)


def test_fault_keeps_previous_feature_names(data, make_clf, fitted_attributes):
    pd = pytest.importorskip("pandas")
    X, y = data
    frame = pd.DataFrame(X, columns=["a", "b", "c"])
    clf = make_clf().fit(frame, y)
    before = snapshot(clf, frame[:4], fitted_attributes)
    clf.set_params(learning_rate=failing_schedule(1, KeyboardInterrupt))
    with raises_fault():
        clf.fit(X, y)  # a plain array would drop feature_names_in_
    np.testing.assert_array_equal(clf.feature_names_in_, ["a", "b", "c"])
    clf.set_params(learning_rate=0.5)
    assert_same_fit(clf, before, frame[:4], fitted_attributes)


@pytest.mark.parametrize("fault", FAULTS, ids=FAULT_IDS)
def test_fault_leaves_unfitted_estimator_unfitted(data, fault, make_clf, fitted_attributes):
    X, y = data
    clf = make_clf(**fault)
    params = clf.get_params()
    with raises_fault():
        clf.fit(X, y)
    assert fitted_attributes(clf) == []
    assert "_kernel_cache" not in vars(clf)
    with pytest.raises(NotFittedError):
        clf.predict(X)
    assert clf.get_params() == params
