"""Attribution over training time: the per-step terms, summing to the contributions."""

import numpy as np
import torch
from _reference import NaivePathKernelEngine
from explain_models import classifier

from sklearn_pathkernel._engine._facade import PathKernelEngine


def test_sums_to_the_contributions(fitted):
    clf, X, _ = fitted
    queries = X[:3] + 0.05
    contributions = clf.decompose(queries).contributions
    scale = max(np.abs(contributions).max(), 1.0)
    steps = clf.explain_over_time(queries, period="step")
    assert steps.values.shape == (3, clf.n_steps_, len(X), len(clf.classes_))
    np.testing.assert_allclose(steps.values.sum(axis=1), contributions, atol=1e-10 * scale)
    epochs = clf.explain_over_time(queries)
    assert epochs.values.shape[1] == clf.n_iter_
    per = clf.n_steps_ // clf.n_iter_
    np.testing.assert_allclose(
        epochs.values, steps.values.reshape(3, clf.n_iter_, per, *steps.values.shape[2:]).sum(2)
    )
    by_class = clf.explain_over_time(queries, by_class=True)
    np.testing.assert_allclose(
        by_class.values.sum(axis=1), clf.class_contributions(queries), atol=1e-10 * scale
    )


def test_a_step_term_holds_only_its_batch(small_classifier):
    clf, X, _ = small_classifier
    steps = clf.explain_over_time(X[:2], period="step")
    for index, batch in enumerate(clf.path_.batches):
        outside = np.setdiff1d(np.arange(len(X)), batch)
        assert not steps.values[:, index, outside].any()
        assert steps.values[:, index, batch].any()


def test_terms_match_the_brute_force_reference():
    """Per gradient step r: sum_{s >= r} c_{s,r} <P_s phi_s, g_r>, by materialised Jacobians."""
    clf, X, _ = classifier("adam", n=30, activation="tanh", max_iter=2)
    path, module = clf.path_, clf.module_
    X_train = torch.tensor(X)
    fast = PathKernelEngine(module, path, X_train, quadrature="gauss", n_points=12)
    naive = NaivePathKernelEngine(module, path, X_train, quadrature="gauss", n_points=12)
    queries = X_train[:2] + 0.1
    phis = [naive._test_feature(s, queries) * naive._preconditioner(s, queries.dtype)
            for s in range(path.n_steps)]  # fmt: skip
    for term in fast.stepwise().terms(queries):
        r = term.step
        grads = naive._training_gradients(r)
        expected = sum(
            path.update.mixing(s, r) * torch.einsum("nkw,bw->nbk", phis[s], grads)
            for s in range(r, path.n_steps)
        ).numpy()
        np.testing.assert_allclose(
            term.values, expected, rtol=0, atol=1e-11 * np.abs(expected).max()
        )


def test_frame_and_plot(small_classifier):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clf, X, _ = small_classifier
    result = clf.explain_over_time(X[:1], by_class=True)
    frame = result.to_frame()
    assert set(frame.columns) == {"query", "epoch", "group", "output", "contribution"}
    np.testing.assert_allclose(frame.contribution.sum(), result.values.sum())
    ax = result.plot(0, output=1)
    assert ax.get_xlabel() == "epoch"
    plt.close("all")


def test_regressor_and_distance_network_sum_to_the_contributions(small_regressor):
    from explain_models import digits

    from sklearn_pathkernel import DistanceKernelClassifier

    reg, X = small_regressor
    steps = reg.explain_over_time(X[:2], period="step")
    contributions = reg.decompose(X[:2]).contributions  # (2, M, 2): a 2-d target
    np.testing.assert_allclose(steps.values.sum(axis=1), contributions, atol=1e-12)
    assert steps.output_names == ("output 0", "output 1")
    X, y = digits(30)
    clf = DistanceKernelClassifier(max_iter=2, batch_size=10, random_state=0).fit(X, y)
    epochs = clf.explain_over_time(X[:2])
    np.testing.assert_allclose(
        epochs.values.sum(axis=1), clf.decompose(X[:2]).contributions, atol=1e-10
    )
    result = clf.self_influence()
    diagonal = clf.decompose(X).contributions[np.arange(30), np.arange(30)]
    np.testing.assert_allclose(result.values, diagonal, atol=1e-10)
