"""DistanceKernelRegressor: a network of distance layers, as an exact kernel regression."""

from ._base import BasePathRegressor
from ._docstrings import (
    FITTED_ATTRIBUTES,
    IMAGE_PARAMETERS,
    PATH_PARAMETERS,
    fill_doc,
    training_parameters,
)
from ._networks import DistanceNetworkMixin


@fill_doc(
    training_parameters=training_parameters(),
    image_parameters=IMAGE_PARAMETERS,
    path_parameters=PATH_PARAMETERS,
    fitted_attributes=FITTED_ATTRIBUTES,
)
class DistanceKernelRegressor(DistanceNetworkMixin, BasePathRegressor):
    """Network of distance layers ("memories"), trained on the squared error, as a kernel machine.

    Each hidden layer compares its input with learned memories
    (:class:`DistanceLayer`: by default the mean squared difference of the
    "Distance Kernel based Neural Networks" seed), reshapes the distances per
    example against their chi-squared skew (``skew_transform``), and feeds the next
    layer; a linear head (starting at zero) maps the last layer to the outputs.
    The network is trained on the mean squared error and, like
    :class:`ExactPathKernelRegressor`, exposes its Exact Path Kernel:
    :meth:`decompose` and :attr:`kernel_`.

    Parameters
    ----------
    hidden_layer_sizes : tuple of int, default=(100,)
        Number of memories of each distance layer.
    kernel : {"sqeuclidean", "euclidean", "rbf", "laplacian", "cosine"}, \
            default="sqeuclidean"
        How a distance layer compares an input with a memory (see
        :class:`DistanceLayer`).
    init : {"uniform", "kmeans++", "samples"}, default="kmeans++"
        Initial memories: ``nn.Linear``'s uniform range, or rows of the training
        data (as the previous layers map it) chosen by k-means++ seeding or at
        random. Memories beyond the number of samples stay uniform.
    skew_transform : {"none", "sqrt", "log1p", "standardize"}, default="log1p"
        Per-example remedy for the chi-squared skew of squared distances before
        the next layer: ``"sqrt"`` and ``"log1p"`` act on ``max(z, 0)`` (for the
        non-negative kernels); ``"standardize"`` centres and scales each
        example's outputs over the layer's memories. ``"log1p"`` is the default
        because it is the only one that learns XOR for every seed (squared
        distances share one ``|x|^2`` term, so without a transform a linear head
        sees only ``|x|^2``, ``x`` and 1, which on Boolean inputs is linear), and
        it is smooth with slope 1 at 0, where ``"sqrt"``'s derivative is
        infinite. Measurements: ``doc/benchmarks_distance.rst``.
    gamma : float, default=1.0
        Initial width of the ``"rbf"`` and ``"laplacian"`` kernels (learned).
    {image_parameters}
    learning_rate : float or callable, default=0.01
        Step size, or a schedule ``learning_rate(step) -> float``. The default
        goes with Adam: with the squared error, plain gradient descent on a
        hundred distance features diverges already at ``learning_rate=0.1``
        (the linear head's curvature grows with the number of memories).
    max_iter : int, default=300
        Number of epochs. With ``batch_size=None`` each epoch is one full-batch
        gradient descent step: the training path of the EPK paper.
    batch_size : int or None, default=None
        Mini-batch size; ``None`` uses the whole training set at every step.
    {training_parameters}
    {path_parameters}

    Attributes
    ----------
    n_outputs_ : int
        Number of outputs (1 for a 1-d ``y``).
    {fitted_attributes}

    See Also
    --------
    ExactPathKernelRegressor : The same kernel API on a multilayer perceptron.
    DistanceKernelClassifier : The classifier.
    DistanceLayer : The layer, for building your own networks.

    Notes
    -----
    Distances are means over features, so scale the features (for example
    with :class:`~sklearn.preprocessing.StandardScaler` in a pipeline).

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_pathkernel import DistanceKernelRegressor
    >>> X = np.linspace(-2, 2, 30)[:, None]
    >>> reg = DistanceKernelRegressor(hidden_layer_sizes=(8,), max_iter=50,
    ...                               random_state=0).fit(X, np.sin(X[:, 0]))
    >>> reg.decompose(X[:2]).contributions.shape
    (2, 30)
    """

    _parameter_constraints = {
        **BasePathRegressor._parameter_constraints,
        **DistanceNetworkMixin._parameter_constraints,
    }

    def __init__(
        self,
        hidden_layer_sizes=(100,),
        kernel="sqeuclidean",
        init="kmeans++",
        skew_transform="log1p",
        gamma=1.0,
        image_shape=None,
        conv_layers=((16, 3, 1, 1, 2),),
        learning_rate=0.01,
        max_iter=300,
        batch_size=None,
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
        self.hidden_layer_sizes = hidden_layer_sizes
        self.kernel = kernel
        self.init = init
        self.skew_transform = skew_transform
        self.gamma = gamma
        self.image_shape = image_shape
        self.conv_layers = conv_layers
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
