"""Bad input to the explanation API gets a clear error that names the problem."""

import numpy as np
import pytest


def test_k_out_of_range(small_classifier):
    clf, X, _ = small_classifier
    with pytest.raises(ValueError, match="k=61 is out of range: the model has 60 training"):
        clf.explain(X[:1], k=61)
    with pytest.raises(ValueError, match="k=0 is out of range"):
        clf.explain(X[:1], k=0)
    with pytest.raises(TypeError, match="k must be an int"):
        clf.explain(X[:1], k=2.5)


def test_query_of_the_wrong_width(small_classifier):
    clf, X, _ = small_classifier
    for method in (
        clf.explain,
        clf.explain_over_time,
        clf.influence_matrix,
        clf.class_contributions,
    ):
        with pytest.raises(ValueError, match="X has 5 features, but .* is expecting 64"):
            method(X[:2, :5])


def test_image_shape_that_does_not_match(small_classifier):
    clf, X, _ = small_classifier
    result = clf.explain(X[:1], k=2)
    with pytest.raises(
        ValueError,
        match=r"image_shape=\(7, 7\) does not match the features: "
        "the rows have 64 features",
    ):
        result.plot(image_shape=(7, 7))
    with pytest.raises(TypeError, match="image_shape must be a tuple of ints"):
        result.plot(image_shape=8)


def test_a_regressor_asked_for_classes(small_regressor):
    reg, X = small_regressor
    with pytest.raises(ValueError, match="needs classes, but this model is a regressor"):
        reg.explain_over_time(X[:1], by_class=True)
    with pytest.raises(ValueError, match="needs classes, but this model is a regressor"):
        reg.class_contributions(X[:1])


def test_other_settings(small_classifier):
    clf, X, _ = small_classifier
    with pytest.raises(ValueError, match="period must be 'step' or 'epoch', got 'day'"):
        clf.explain_over_time(X[:1], period="day")
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        clf.explain(X[:1], batch_size=0)
    with pytest.raises(ValueError, match="columns must be 2 integer output indices"):
        clf.influence_matrix(X[:2], columns=[0.5, 1.0])
    with pytest.raises(ValueError, match=r"columns must be output indices in \[0, 10\)"):
        clf.influence_matrix(X[:2], columns=np.array([0, 10]))
    result = clf.explain(X[:1], k=2)
    with pytest.raises(ValueError, match="output=10 is out of range"):
        result.plot(output=10)
    with pytest.raises(ValueError, match="query=3 is out of range"):
        result.plot(query=3)


def test_not_fitted():
    from sklearn.exceptions import NotFittedError

    from sklearn_pathkernel import ExactPathKernelClassifier

    with pytest.raises(NotFittedError):
        ExactPathKernelClassifier().explain(np.zeros((1, 2)))
    with pytest.raises(NotFittedError):
        ExactPathKernelClassifier().self_influence()


def test_missing_pandas_says_how_to_get_it(small_classifier, monkeypatch):
    import sys

    clf, X, _ = small_classifier
    result = clf.explain(X[:1], k=2)
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    with pytest.raises(ImportError, match="to_frame\\(\\) needs pandas, an optional dependency"):
        result.to_frame()


def test_counterfactual_bad_input(small_classifier, small_regressor):
    clf, X, y = small_classifier
    with pytest.raises(ValueError, match="method must be one of"):
        clf.explain(X[:1], method="tracin")
    with pytest.raises(ValueError, match="normalize=True is for method='contributions'"):
        clf.explain(X[:1], normalize=True, method="counterfactual")
    with pytest.raises(ValueError, match="first_epoch is for method='contributions'"):
        clf.self_influence(first_epoch=1, method="counterfactual")
    with pytest.raises(ValueError, match="target must be one of"):
        clf.counterfactual(X[:1], target="logit")
    with pytest.raises(ValueError, match="target='loss' needs the queries' true targets"):
        clf.counterfactual(X[:1], target="loss")
    with pytest.raises(ValueError, match=r"y holds labels the model was not trained on: \[11\]"):
        clf.counterfactual(X[:1], [11])
    with pytest.raises(ValueError, match="one label per query"):
        clf.counterfactual(X[:2], y[:1])
    with pytest.raises(ValueError, match="output=10 is out of range"):
        clf.counterfactual(X[:1], output=10)
    with pytest.raises(ValueError, match="certify must be a non-negative int"):
        clf.counterfactual(X[:1], certify=-1)
    with pytest.raises(ValueError, match="h must be a relative step"):
        clf.counterfactual(X[:1], h=0.0)
    with pytest.raises(TypeError, match="hessian must be True, False or None"):
        clf.counterfactual(X[:1], hessian="auto")
    with pytest.raises(ValueError, match="X has 5 features"):
        clf.counterfactual(X[:1, :5])
    reg, X_reg = small_regressor
    with pytest.raises(ValueError, match="target='margin' needs classes"):
        reg.counterfactual(X_reg[:1], target="margin")


def test_counterfactual_certificate_needs_a_reproducible_fit(small_classifier):
    from sklearn.base import clone

    clf, X, y = small_classifier
    unseeded = clone(clf).set_params(random_state=None).fit(X, y)
    with pytest.raises(ValueError, match="Retraining does not reproduce the recorded run"):
        unseeded.counterfactual(X[:1], certify=1)
