"""scikit-learn's estimator checks on every public estimator."""

from sklearn.utils.estimator_checks import parametrize_with_checks

from sklearn_pathkernel import (
    DistanceKernelClassifier,
    ExactPathKernelClassifier,
    PathKernelTransformer,
)

# Small, fast settings: the checks fit hundreds of times.
ESTIMATORS = [
    ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=100, random_state=0),
    PathKernelTransformer(
        ExactPathKernelClassifier(hidden_layer_sizes=(8,), max_iter=10, random_state=0)
    ),
    # init="uniform": the data-based inits (default "kmeans++") pick training rows,
    # so duplicating a row is not the same as weighting it by 2.
    DistanceKernelClassifier(hidden_layer_sizes=(8,), init="uniform", max_iter=100, random_state=0),
]


@parametrize_with_checks(ESTIMATORS)
def test_sklearn_compatible_estimator(estimator, check):
    check(estimator)
