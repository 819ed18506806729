"""Reliability: bad input gets a clear error, faults lose nothing, results reproduce.

Tiny networks and data throughout: every test is about behaviour, not accuracy.
"""

import pickle
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from scipy import sparse
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.utils._param_validation import InvalidParameterError
from sklearn.utils.validation import check_is_fitted

from sklearn_pathkernel import ExactPathKernelClassifier

SUM_TOL = 1e-9


def make_clf(**params):
    defaults = dict(hidden_layer_sizes=(4,), max_iter=3, learning_rate=0.5, random_state=0)
    defaults.update(params)
    return ExactPathKernelClassifier(**defaults)


def make_data(n_samples=12, n_features=3, n_classes=3, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.randn(n_samples, n_features)
    y = np.arange(n_samples) % n_classes
    return X, y


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.fixture(scope="module")
def fitted(data):
    X, y = data
    return make_clf().fit(X, y)


def fitted_attributes(est):
    return sorted(k for k in vars(est) if k.endswith("_") and not k.startswith("__"))


def snapshot(clf, X_query):
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


def assert_same_fit(clf, before, X_query):
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


# -- bad input: a clear error naming the problem ---------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_X_at_fit(data, bad):
    X, y = data
    X = X.copy()
    X[3, 1] = bad
    with pytest.raises(ValueError, match="NaN|infinity"):
        make_clf().fit(X, y)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("method", ["predict", "predict_proba", "decompose", "kernel"])
def test_non_finite_X_after_fit(fitted, data, bad, method):
    X = data[0][:3].copy()
    X[1, 0] = bad
    call = (lambda A: fitted.kernel_(A)) if method == "kernel" else getattr(fitted, method)
    with pytest.raises(ValueError, match="NaN|infinity"):
        call(X)


@pytest.mark.parametrize(
    "call",
    [
        lambda clf, X: clf.predict(X),
        lambda clf, X: clf.predict_proba(X),
        lambda clf, X: clf.decision_function(X),
        lambda clf, X: clf.decompose(X),
        lambda clf, X: clf.kernel_(X),
        lambda clf, X: clf.kernel_(X[:, :3], X),
        lambda clf, X: clf.kernel_.diag(X),
    ],
    ids=["predict", "proba", "decision", "decompose", "kernel", "kernel_Y", "diag"],
)
@pytest.mark.parametrize("n_features", [2, 4])
def test_wrong_n_features_after_fit(fitted, call, n_features):
    X = np.random.RandomState(1).randn(3, n_features)
    with pytest.raises(ValueError, match=rf"{n_features} features.*3 features"):
        call(fitted, X)


@pytest.mark.parametrize(
    "call",
    [
        lambda clf, X, y: make_clf().fit(X, y),
        lambda clf, X, y: clf.predict(X),
        lambda clf, X, y: clf.decompose(X),
        lambda clf, X, y: clf.kernel_(X),
    ],
    ids=["fit", "predict", "decompose", "kernel"],
)
def test_sparse_input_is_a_clear_error(fitted, data, call):
    # Sparse input is not supported (the network takes dense tensors): say so and how to fix.
    X, y = data
    with pytest.raises(TypeError, match="Sparse data.*dense data is required.*toarray"):
        call(fitted, sparse.csr_matrix(X), y)


def test_one_class(data):
    X, _ = data
    with pytest.raises(ValueError, match="at least 2 classes.*only one class: 'a'"):
        make_clf().fit(X, np.full(X.shape[0], "a"))


def test_continuous_y(data):
    X, _ = data
    with pytest.raises(ValueError, match="Unknown label type: continuous"):
        make_clf().fit(X, np.linspace(0.0, 1.0, X.shape[0]))


@pytest.mark.parametrize("width", [1, 2, 5])
def test_module_output_width_names_both(data, width):
    X, y = data  # 3 classes
    with pytest.raises(ValueError, match=rf"shape \(1, {width}\).*3 classes"):
        make_clf(module=torch.nn.Linear(3, width)).fit(X, y)


def test_module_output_of_wrong_rank(data):
    X, y = data
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Flatten(0))
    with pytest.raises(ValueError, match=r"shape \(3,\).*3 classes"):
        make_clf(module=module).fit(X, y)


class NoParameters(torch.nn.Module):
    def forward(self, x):
        return torch.zeros(x.shape[0], 3, dtype=x.dtype)


@pytest.mark.parametrize("module", [NoParameters(), lambda n_features, n_classes: NoParameters()])
def test_module_without_parameters(data, module):
    X, y = data
    with pytest.raises(ValueError, match="no parameters"):
        make_clf(module=module).fit(X, y)


@pytest.mark.parametrize("module", ["mlp", 3, np.zeros(3)])
def test_module_not_a_module(data, module):
    X, y = data
    with pytest.raises(InvalidParameterError, match="'module' parameter.*torch.nn"):
        make_clf(module=module).fit(X, y)


def test_module_callable_returning_non_module(data):
    X, y = data
    with pytest.raises(TypeError, match="must return a torch.nn.Module, got ndarray"):
        make_clf(module=lambda n_features, n_classes: np.zeros(3)).fit(X, y)


@pytest.mark.parametrize(
    "params",
    [
        dict(learning_rate=1e300),  # explodes after the first step: weights not finite
        dict(learning_rate=1e300, momentum=0.5),
        dict(learning_rate=lambda step: 1e300 if step == 1 else 0.1),
    ],
    ids=["constant", "momentum", "schedule"],
)
def test_divergent_learning_rate_names_the_step(data, params):
    X, y = data
    clf = make_clf(max_iter=4, **params)
    with pytest.raises(FloatingPointError, match=r"at step \d+ \(epoch \d+\).*learning.rate"):
        clf.fit(X * 1e3, y)
    # No silently NaN model: the estimator stays unfitted.
    with pytest.raises(NotFittedError):
        check_is_fitted(clf)
    assert fitted_attributes(clf) == []


def test_non_finite_loss_names_the_step(data):
    X, y = data
    # Finite at the initial weights (a non-finite initial output is refused before
    # training: tests/test_module_checks.py); the first step makes the logits overflow.
    module = torch.nn.Linear(3, 3).double()
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 1"):
        make_clf(module=module, learning_rate=1e295).fit(X * 1e10, y)


@pytest.mark.parametrize("lr", [0.0, -1.0, np.nan, np.inf])
def test_bad_learning_rate_from_schedule(data, lr):
    X, y = data
    with pytest.raises(ValueError, match=r"positive finite.*at step 0"):
        make_clf(learning_rate=lambda step: lr).fit(X, y)


def test_bad_sample_weights(data):
    X, y = data
    with pytest.raises(ValueError, match="Negative values.*sample_weight"):
        make_clf().fit(X, y, sample_weight=np.r_[-0.5, np.ones(X.shape[0] - 1)])
    with pytest.raises(ValueError, match="non-zero|not all be zero"):
        make_clf().fit(X, y, sample_weight=np.zeros(X.shape[0]))
    with pytest.raises(ValueError, match="NaN"):
        make_clf().fit(X, y, sample_weight=np.r_[np.nan, np.ones(X.shape[0] - 1)])


def test_zero_weight_mini_batch_is_a_no_op_step(data):
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


def test_unfitted_kernel_and_decompose(data):
    with pytest.raises(NotFittedError):
        _ = make_clf().kernel_
    with pytest.raises(NotFittedError):
        make_clf().decompose(data[0])


# -- faults lose nothing ---------------------------------------------------------------


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
def test_fault_keeps_previous_fit(data, fault):
    X, y = data
    clf = make_clf().fit(X, y)
    before = snapshot(clf, X[:4])
    # Other data: 5 features and 2 classes, so anything half-assigned would show.
    X_other, y_other = make_data(n_samples=8, n_features=5, n_classes=2, seed=1)
    clf.set_params(**fault)
    with raises_fault():
        clf.fit(X_other, y_other)
    clf.set_params(module=None, learning_rate=0.5, batch_size=None)
    assert_same_fit(clf, before, X[:4])


def test_fault_keeps_previous_feature_names(data):
    pd = pytest.importorskip("pandas")
    X, y = data
    frame = pd.DataFrame(X, columns=["a", "b", "c"])
    clf = make_clf().fit(frame, y)
    before = snapshot(clf, frame[:4])
    clf.set_params(learning_rate=failing_schedule(1, KeyboardInterrupt))
    with raises_fault():
        clf.fit(X, y)  # a plain array would drop feature_names_in_
    np.testing.assert_array_equal(clf.feature_names_in_, ["a", "b", "c"])
    clf.set_params(learning_rate=0.5)
    assert_same_fit(clf, before, frame[:4])


@pytest.mark.parametrize("fault", FAULTS, ids=FAULT_IDS)
def test_fault_leaves_unfitted_estimator_unfitted(data, fault):
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


def test_fit_does_not_modify_user_data(data):
    X, y = data
    # float64 C-contiguous: the layout validation passes through without a copy.
    # (Our own copy: the fixture is shared by the module and zeroed below.)
    X, y = X.copy(order="C"), y.astype(np.int64)
    weights = np.linspace(0.5, 1.5, X.shape[0])
    copies = X.copy(), y.copy(), weights.copy()
    clf = make_clf(batch_size=5).fit(X, y, sample_weight=weights)
    clf.predict(X)
    clf.decompose(X[:3])
    clf.kernel_(X)
    clf.kernel_(X[:3] + 0.1, X)
    clf.kernel_.diag(X)
    for after, before in zip((X, y, weights), copies, strict=True):
        np.testing.assert_array_equal(after, before)
        assert after.flags.writeable
    # Nor does the fitted estimator keep a view of them.
    X[:] = 0.0
    assert clf._fit_X.abs().sum() > 0


@pytest.mark.parametrize("as_float32", [False, True])
def test_fit_does_not_modify_user_module(data, as_float32):
    X, y = data
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    if not as_float32:
        module = module.double()
    module.train()
    state = {k: v.clone() for k, v in module.state_dict().items()}
    dtype = next(module.parameters()).dtype
    clf = make_clf(module=module).fit(X, y)
    clf.decompose(X[:2])
    assert clf.module_ is not module
    assert module.training
    assert all(p.requires_grad and p.grad is None for p in module.parameters())
    assert next(module.parameters()).dtype == dtype
    for key, value in module.state_dict().items():
        assert torch.equal(value, state[key])
    # w_0 of the path is the user's module, converted to float64.
    w0 = torch.cat([v.reshape(-1).double() for v in state.values()])
    assert torch.equal(clf.path_.weights[0], w0)
    # Refitting starts from the user's weights again: the same path.
    weights = clf.path_.weights.clone()
    assert torch.equal(clf.fit(X, y).path_.weights, weights)


def test_fit_keeps_global_random_state(data):
    X, y = data
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()  # noqa: NPY002
    make_clf(batch_size=3).fit(X, y)
    assert torch.equal(torch.get_rng_state(), torch_state)
    after = np.random.get_state()  # noqa: NPY002
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1])


PICKLE_SCRIPT = textwrap.dedent(
    """
    import pickle, sys
    import numpy as np
    with open(sys.argv[1], "rb") as f:
        clf, X, X_new = pickle.load(f)
    parts = clf.decompose(X_new)
    np.savez(
        sys.argv[2],
        proba=clf.predict_proba(X_new),
        log_proba=clf.predict_log_proba(X_new),
        predict=clf.predict(X_new),
        gram=clf.kernel_(X),
        cross=clf.kernel_(X_new, X),
        test=clf.kernel_(X_new),
        contributions=parts.contributions,
        bias=parts.bias,
        residual=parts.residual,
    )
    """
)


def test_pickle_loads_in_fresh_process_bitwise(tmp_path):
    X, y = make_data(n_samples=9)
    y = np.array(["cat", "dog", "emu"])[y]
    clf = make_clf(batch_size=4).fit(X, y)
    X_new = X[:3] + 0.3
    parts = clf.decompose(X_new)
    expected = dict(
        proba=clf.predict_proba(X_new),
        log_proba=clf.predict_log_proba(X_new),
        predict=clf.predict(X_new),
        gram=clf.kernel_(X),
        cross=clf.kernel_(X_new, X),
        test=clf.kernel_(X_new),
        contributions=parts.contributions,
        bias=parts.bias,
        residual=parts.residual,
    )
    (tmp_path / "load.py").write_text(PICKLE_SCRIPT)
    with open(tmp_path / "clf.pkl", "wb") as f:
        pickle.dump((clf, X, X_new), f)
    subprocess.run(
        [sys.executable, *(str(tmp_path / name) for name in ("load.py", "clf.pkl", "out"))],
        check=True,
        timeout=300,
    )
    with np.load(tmp_path / "out.npz") as got:
        for key, value in expected.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_refit_replaces_everything(data):
    pd = pytest.importorskip("pandas")
    X, y = data
    X_b, y_b = make_data(n_samples=10, n_features=2, n_classes=2, seed=3)
    y_b = np.array(["no", "yes"])[y_b]
    refit = make_clf().fit(pd.DataFrame(X, columns=["a", "b", "c"]), y)
    refit.kernel_(X)  # fill the kernel cache of the first fit
    refit.decompose(pd.DataFrame(X[:2], columns=["a", "b", "c"]))
    refit.fit(X_b, y_b)
    fresh = make_clf().fit(X_b, y_b)
    assert not hasattr(refit, "feature_names_in_")
    assert fitted_attributes(refit) == fitted_attributes(fresh)
    assert refit.n_features_in_ == 2
    np.testing.assert_array_equal(refit.classes_, ["no", "yes"])
    assert torch.equal(refit.path_.weights, fresh.path_.weights)
    assert refit.loss_curve_ == fresh.loss_curve_
    X_new = X_b[:3] + 0.2
    np.testing.assert_array_equal(refit.predict_proba(X_new), fresh.predict_proba(X_new))
    np.testing.assert_array_equal(refit.kernel_(X_b), fresh.kernel_(X_b))
    np.testing.assert_array_equal(refit.kernel_(X_new, X_b), fresh.kernel_(X_new, X_b))
    np.testing.assert_array_equal(
        refit.decompose(X_new).contributions, fresh.decompose(X_new).contributions
    )


# -- reproducibility -------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [None, 4])
def test_same_random_state_is_bitwise_identical(data, batch_size):
    X, y = data
    X_new = X[:3] + 0.1
    a = make_clf(batch_size=batch_size, random_state=7).fit(X, y)
    b = make_clf(batch_size=batch_size, random_state=7).fit(X, y)
    assert torch.equal(a.path_.weights, b.path_.weights)
    for batch_a, batch_b in zip(a.path_.batches, b.path_.batches, strict=True):
        np.testing.assert_array_equal(batch_a, batch_b)
    np.testing.assert_array_equal(a.kernel_(X), b.kernel_(X))
    np.testing.assert_array_equal(a.kernel_(X_new, X), b.kernel_(X_new, X))
    np.testing.assert_array_equal(a.kernel_(X_new), b.kernel_(X_new))
    parts_a, parts_b = a.decompose(X_new), b.decompose(X_new)
    np.testing.assert_array_equal(parts_a.contributions, parts_b.contributions)
    # A clone fits the same; another seed does not.
    assert torch.equal(clone(a).fit(X, y).path_.weights, a.path_.weights)
    c = make_clf(batch_size=batch_size, random_state=8).fit(X, y)
    assert not torch.equal(c.path_.weights, a.path_.weights)


def test_n_jobs_through_the_estimator(data):
    X, y = data
    clf = make_clf(batch_size=5, max_iter=4).fit(X, y)
    X_new = X[:5] + 0.2
    serial = clf.kernel_(X), clf.kernel_(X_new, X), clf.kernel_(X_new)
    serial_parts = clf.decompose(X_new).contributions
    clf.set_params(n_jobs=2)
    assert clf._engine().n_jobs == 2  # set_params after fit reaches the engine
    parallel = clf.kernel_(X), clf.kernel_(X_new, X), clf.kernel_(X_new)
    for a, b in zip(serial, parallel, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12 * np.abs(a).max())
    np.testing.assert_allclose(
        clf.decompose(X_new).contributions,
        serial_parts,
        rtol=1e-12,
        atol=1e-12 * np.abs(serial_parts).max(),
    )


def test_set_params_after_fit_changes_the_kernel(data):
    X, y = data
    X_new = X[:3] + 0.2
    clf = make_clf().fit(X, y)
    exact = clf.kernel_(X_new, X)
    clf.set_params(quadrature="dpk")
    dpk = make_clf(quadrature="dpk").fit(X, y)
    np.testing.assert_array_equal(clf.kernel_(X_new, X), dpk.kernel_(X_new, X))
    assert not np.array_equal(exact, dpk.kernel_(X_new, X))


# -- edge sizes and input types --------------------------------------------------------


def check_exact(clf, X_train, X_new):
    """The sum identity, certificate and Gram symmetry on a fitted estimator."""
    parts = clf.decompose(X_new)
    total = parts.bias + parts.contributions.sum(axis=1)
    assert np.abs(total - clf.predict_log_proba(X_new)).max() < SUM_TOL
    assert parts.residual.max() < SUM_TOL
    assert parts.contributions.shape == (len(X_new), len(X_train), len(clf.classes_))
    gram = clf.kernel_(X_train)
    assert gram.shape == (len(X_train), len(X_train))
    np.testing.assert_array_equal(gram, gram.T)
    assert np.all(np.isfinite(gram))


def test_two_samples_one_per_class():
    X, y = np.array([[0.0, 1.0], [1.0, -1.0]]), np.array([3, 7])
    clf = make_clf().fit(X, y)
    np.testing.assert_array_equal(clf.classes_, [3, 7])
    assert clf.decision_function(X).shape == (2,)
    check_exact(clf, X, X + 0.1)


def test_one_feature():
    X, y = make_data(n_samples=8, n_features=1, n_classes=2)
    clf = make_clf().fit(X, y)
    assert clf.n_features_in_ == 1
    check_exact(clf, X, np.array([[0.3], [-2.0]]))


def test_many_classes():
    X, y = make_data(n_samples=24, n_features=2, n_classes=12)
    clf = make_clf(max_iter=2).fit(X, y)
    assert clf.predict_proba(X[:2]).shape == (2, 12)
    check_exact(clf, X, X[:2] + 0.1)


def test_string_labels():
    X, y = make_data(n_samples=9)
    labels = np.array(["setosa", "versicolor", "virginica"], dtype=object)[y]
    clf = make_clf().fit(X, labels)
    np.testing.assert_array_equal(clf.classes_, ["setosa", "versicolor", "virginica"])
    assert set(clf.predict(X)) <= set(labels)
    # Same network as integer labels in the same order.
    ints = make_clf().fit(X, y)
    assert torch.equal(clf.path_.weights, ints.path_.weights)
    check_exact(clf, X, X[:2] + 0.1)


def test_float32_input(data):
    X, y = data
    X32 = X.astype(np.float32)
    clf = make_clf().fit(X32, y)
    ref = make_clf().fit(X32.astype(np.float64), y)
    assert torch.equal(clf.path_.weights, ref.path_.weights)
    assert clf.predict_proba(X32).dtype == np.float64
    # float32 training rows are on the training copy (exact after conversion to float64).
    np.testing.assert_array_equal(clf.kernel_(X32), ref.kernel_(X32.astype(np.float64)))
    check_exact(clf, X32, X32[:2] + np.float32(0.1))


def test_read_only_memmap_input(data, tmp_path):
    X, y = data
    filename = tmp_path / "X.dat"
    writable = np.memmap(filename, dtype=np.float64, mode="w+", shape=X.shape)
    writable[:] = X
    writable.flush()
    del writable
    X_map = np.memmap(filename, dtype=np.float64, mode="r", shape=X.shape)
    assert not X_map.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. torch's "non-writable array"
        clf = make_clf().fit(X_map, y)
        check_exact(clf, X_map, X_map[:2])
        np.testing.assert_array_equal(clf.kernel_(X_map), clf.kernel_(X))
    np.testing.assert_array_equal(X_map, X)
    ref = make_clf().fit(X, y)
    assert torch.equal(clf.path_.weights, ref.path_.weights)


def test_pandas_dataframe_input(data):
    pd = pytest.importorskip("pandas")
    X, y = data
    frame = pd.DataFrame(X, columns=["a", "b", "c"])
    clf = make_clf().fit(frame, pd.Series(y))
    np.testing.assert_array_equal(clf.feature_names_in_, ["a", "b", "c"])
    ref = make_clf().fit(X, y)
    np.testing.assert_array_equal(clf.predict_proba(frame), ref.predict_proba(X))
    np.testing.assert_array_equal(clf.kernel_(frame), ref.kernel_(X))
    check_exact(clf, frame, frame[:2] + 0.1)
    with pytest.raises(ValueError, match="feature names"):
        clf.predict(frame[["c", "b", "a"]])
