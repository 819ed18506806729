"""State and reproducibility: fit leaves the user's data, module and random state
alone; pickles, refits, seeds, n_jobs and set_params after fit give the same results."""

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from sklearn.base import clone

SUM_TOL = 1e-9


def test_fit_does_not_modify_user_data(data, make_clf):
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
def test_fit_does_not_modify_user_module(data, as_float32, make_clf):
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


def test_fit_keeps_global_random_state(data, make_clf):
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


@pytest.mark.slow
def test_pickle_loads_in_fresh_process_bitwise(tmp_path, make_clf, make_data):
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


def test_refit_replaces_everything(data, make_clf, make_data, fitted_attributes):
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


@pytest.mark.parametrize("batch_size", [None, 4])
def test_same_random_state_is_bitwise_identical(data, batch_size, make_clf):
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


def test_n_jobs_through_the_estimator(data, make_clf):
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


def test_set_params_after_fit_changes_the_kernel(data, make_clf):
    X, y = data
    X_new = X[:3] + 0.2
    clf = make_clf().fit(X, y)
    exact = clf.kernel_(X_new, X)
    clf.set_params(quadrature="dpk")
    dpk = make_clf(quadrature="dpk").fit(X, y)
    np.testing.assert_array_equal(clf.kernel_(X_new, X), dpk.kernel_(X_new, X))
    assert not np.array_equal(exact, dpk.kernel_(X_new, X))
