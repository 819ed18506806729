"""scikit-learn's estimator checks on every public estimator."""

from sklearn.utils.estimator_checks import parametrize_with_checks

from sklearn_pathkernel import ExactPathKernelClassifier, PathKernelTransformer

# Small, fast settings: the checks fit hundreds of times.
ESTIMATORS = [
    ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=100, random_state=0),
    PathKernelTransformer(
        ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=10, random_state=0)
    ),
]


@parametrize_with_checks(ESTIMATORS)
def test_sklearn_compatible_estimator(estimator, check):
    check(estimator)
