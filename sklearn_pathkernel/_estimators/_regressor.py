"""ExactPathKernelRegressor: a network trained on the squared error, as a kernel machine."""

from ._base import BasePathRegressor
from ._docstrings import FITTED_ATTRIBUTES, PATH_PARAMETERS, fill_doc, training_parameters
from ._networks import MLPNetworkMixin


@fill_doc(
    training_parameters=training_parameters(),
    path_parameters=PATH_PARAMETERS,
    fitted_attributes=FITTED_ATTRIBUTES,
)
class ExactPathKernelRegressor(MLPNetworkMixin, BasePathRegressor):
    """Neural network regressor that is exactly a kernel machine.

    Trains a PyTorch network on the mean squared error (``MLPRegressor``'s loss,
    half the mean over the outputs) with the optimiser of your choice, records
    the weight path, and exposes the network's Exact Path Kernel: per-training-point
    contributions that add up to the prediction (:meth:`decompose`) and a
    scikit-learn kernel (:attr:`kernel_`) for ``GaussianProcessRegressor``,
    ``KernelRidge(kernel="precomputed")``, ``SVR``, pipelines and grid search.
    With the squared error the trained network is exactly a kernel regression
    over its training points: each contribution is the point's residual at every
    step, weighed by the kernel (see the user guide).

    Parameters
    ----------
    module : None, torch.nn.Module or callable, default=None
        The network, mapping X of shape (n_samples, n_features) to predictions
        of shape (n_samples, n_outputs) (``n_outputs = 1`` for a 1-d ``y``).
        ``None`` builds an MLP from ``hidden_layer_sizes`` and ``activation``
        whose output layer starts at zero (so the kernel machine's bias is a
        constant). A module instance is deep-copied and trained from its own
        weights, which are ``w_0`` and stay untouched. A callable
        ``module(n_features, n_outputs) -> nn.Module`` is called at fit, with
        torch's random number generator seeded from ``random_state``.
    hidden_layer_sizes : tuple of int, default=(100,)
        Widths of the hidden layers of the default MLP.
    activation : {"relu", "tanh", "gelu", "softplus", "logistic", "identity"}, \
            default="relu"
        Activation of the default MLP.
    learning_rate : float or callable, default=0.001
        Step size, or a schedule ``learning_rate(step) -> float``.
    max_iter : int, default=200
        Number of epochs.
    batch_size : int or None, default=200
        Mini-batch size (the whole training set when it has fewer rows);
        ``None`` uses the whole training set at every step. The defaults
        (Adam, ``learning_rate=0.001``, batches of 200, 200 epochs) are
        ``MLPRegressor``'s (comparison: ``doc/benchmarks_regression.rst``). The
        kernel's cost grows with the number of steps: a Gram matrix of a
        mini-batch run needs every training row at every step, while
        ``decompose`` needs only each step's batch.
    {training_parameters}
    {path_parameters}

    Attributes
    ----------
    n_outputs_ : int
        Number of outputs (1 for a 1-d ``y``).
    {fitted_attributes}

    See Also
    --------
    ExactPathKernelClassifier : The classifier.
    DistanceKernelRegressor : A network of distance layers with the same kernel API.
    PathKernelTransformer : The EPK Gram matrix as a pipeline step.

    Examples
    --------
    >>> from sklearn.datasets import make_regression
    >>> from sklearn_pathkernel import ExactPathKernelRegressor
    >>> X, y = make_regression(n_samples=60, n_features=4, noise=0.1, random_state=0)
    >>> reg = ExactPathKernelRegressor(hidden_layer_sizes=(16,), max_iter=20,
    ...                                random_state=0).fit(X, y / y.std())
    >>> parts = reg.decompose(X[:2])
    >>> parts.contributions.shape
    (2, 60)
    """

    _parameter_constraints = {
        **BasePathRegressor._parameter_constraints,
        **MLPNetworkMixin._parameter_constraints,
    }

    def __init__(
        self,
        module=None,
        hidden_layer_sizes=(100,),
        activation="relu",
        learning_rate=0.001,
        max_iter=200,
        batch_size=200,
        loss="squared_error",
        solver="adam",
        momentum=0.0,
        nesterovs_momentum=False,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-8,
        weight_decay=0.0,
        shuffle=True,
        tol=None,
        n_iter_no_change=10,
        quadrature="exact",
        n_points=100,
        n_jobs=None,
        step_chunks=None,
        path_storage="memory",
        dtype="float64",
        device="cpu",
        random_state=None,
        verbose=0,
    ):
        self.module = module
        self.hidden_layer_sizes = hidden_layer_sizes
        self.activation = activation
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.loss = loss
        self.solver = solver
        self.momentum = momentum
        self.nesterovs_momentum = nesterovs_momentum
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.weight_decay = weight_decay
        self.shuffle = shuffle
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.quadrature = quadrature
        self.n_points = n_points
        self.n_jobs = n_jobs
        self.step_chunks = step_chunks
        self.path_storage = path_storage
        self.dtype = dtype
        self.device = device
        self.random_state = random_state
        self.verbose = verbose
