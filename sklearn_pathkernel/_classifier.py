"""ExactPathKernelClassifier: a network trained by gradient descent, as a kernel machine."""

from numbers import Integral

from sklearn.utils._param_validation import Interval, StrOptions
from torch import nn

from ._base import BasePathClassifier, copy_module
from ._docstrings import SOLVER_PARAMETERS, fill_doc
from ._mlp import ACTIVATIONS, make_mlp


@fill_doc(solver_parameters=SOLVER_PARAMETERS)
class ExactPathKernelClassifier(BasePathClassifier):
    """Neural network classifier that is exactly a kernel machine.

    Trains a PyTorch network on the mean cross-entropy of its log-softmax by
    gradient descent, records the weight path, and exposes the network's Exact
    Path Kernel (EPK, Bell, Geyer et al.): per-training-point contributions
    that add up to the network's output (:meth:`decompose`) and a
    scikit-learn kernel (:attr:`kernel_`) for ``SVC``, Gaussian processes,
    pipelines and grid search.

    Parameters
    ----------
    module : None, torch.nn.Module or callable, default=None
        The network, mapping X of shape (n_samples, n_features) to logits of
        shape (n_samples, n_classes); the estimator adds the log-softmax.
        ``None`` builds an MLP from ``hidden_layer_sizes`` and ``activation``
        whose output layer starts at zero (so the kernel machine's bias is a
        constant). A module instance is deep-copied and trained from its own
        weights, which are ``w_0`` and stay untouched. A callable
        ``module(n_features, n_classes) -> nn.Module`` is called at fit, with
        torch's random number generator seeded from ``random_state``.
    hidden_layer_sizes : tuple of int, default=(100,)
        Widths of the hidden layers of the default MLP.
    activation : {"relu", "tanh", "gelu", "softplus", "logistic", "identity"}, \
            default="relu"
        Activation of the default MLP.
    learning_rate : float or callable, default=0.1
        Step size, or a schedule ``learning_rate(step) -> float``.
    max_iter : int, default=200
        Number of epochs. With ``batch_size=None`` each epoch is one full-batch
        gradient descent step: the training path of the EPK paper.
    batch_size : int or None, default=None
        Mini-batch size; ``None`` uses the whole training set at every step.
    {solver_parameters}
    shuffle : bool, default=True
        Reshuffle mini-batches each epoch.
    tol : float or None, default=None
        Stop when the training loss has not improved by ``tol`` for
        ``n_iter_no_change`` epochs; ``None`` runs all ``max_iter`` epochs.
    n_iter_no_change : int, default=10
        See ``tol``.
    quadrature : {"exact", "riemann", "dpk"}, default="exact"
        How the test-copy features integrate the gradient along each step:
        ``"exact"`` splits each step at the kinks of the network and uses
        Gauss-Legendre nodes on each smooth piece; ``"riemann"`` is the paper's
        left Riemann sum with ``n_points`` points; ``"dpk"`` uses the gradient
        at the start of the step (the Discrete Path Kernel of prior work).
    n_points : int, default=100
        Points of the ``"riemann"`` rule.
    n_jobs : int or None, default=None
        Parallel jobs (joblib) over blocks of kernel computations.
    path_storage : "memory", "disk" or path-like, default="memory"
        Where the recorded weight path, an array of ``(n_steps + 1) x n_weights``
        float64 numbers, is kept: ``"memory"`` (RAM), ``"disk"`` (a
        memory-mapped file in the system's temporary directory) or a memory-mapped
        file in the given directory, for long trainings whose path does not fit
        in RAM. Kernels and decompositions are identical either way. Before
        training, the path's size is checked against the available memory (or
        free disk space) and a ``MemoryError`` names the sizes if it cannot fit.
        Pickling writes the weights into the pickle; the unpickled estimator
        holds them in memory.
    device : str or torch.device, default="cpu"
        Where the network is trained and evaluated and the kernel computed:
        ``"cpu"``, ``"cuda"`` (the current CUDA device), ``"cuda:1"`` or a
        ``torch.device``. Checked at :meth:`fit`: a ``ValueError`` names the
        device and the available ones when it is unknown or absent. The initial
        weights are drawn on the CPU, so they do not depend on the device.
        ``module_`` and the training data live on the device (``device_``); the
        weight path stays on the host (``path_storage``), one step at a time is
        moved to the device; results are numpy arrays. A pickle holds CPU
        tensors: it loads on a machine without the device (on the CPU, with a
        warning) and back on the device where there is one.
    random_state : int, RandomState instance or None, default=None
        Seeds the initial weights and the mini-batch order.
    verbose : int, default=0
        Print the training loss per epoch and show progress of kernel
        computations.

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
        Class labels; output ``k`` of the network belongs to ``classes_[k]``.
    module_ : torch.nn.Module
        The trained network (float64, weights ``w_S``), on ``device_``.
    device_ : torch.device
        Where ``module_`` and the training data live and the computations run:
        ``device`` at fit (after unpickling, the CPU if this machine lacks it).
    path_ : WeightPath
        The recorded weight path, on the
        host (RAM or a memory-mapped file, see ``path_storage``).
    n_iter_ : int
        Epochs run.
    n_steps_ : int
        Gradient descent steps taken.
    loss_curve_ : list of float
        Training loss per epoch.
    n_features_in_ : int
        Number of features seen during fit.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names seen during fit, when X has string column names.

    See Also
    --------
    DistanceKernelClassifier : A network of distance layers with the same kernel API.
    PathKernelTransformer : The EPK Gram matrix as a pipeline step.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_pathkernel import ExactPathKernelClassifier
    >>> X, y = make_blobs(n_samples=60, centers=3, random_state=0)
    >>> clf = ExactPathKernelClassifier(hidden_layer_sizes=(16,), max_iter=20,
    ...                                 random_state=0).fit(X, y)
    >>> parts = clf.decompose(X[:2])
    >>> parts.contributions.shape
    (2, 60, 3)
    """

    _parameter_constraints = {
        **BasePathClassifier._parameter_constraints,
        "module": [nn.Module, callable, None],
        "hidden_layer_sizes": ["array-like", Interval(Integral, 1, None, closed="left")],
        "activation": [StrOptions(set(ACTIVATIONS))],
    }

    def __init__(
        self,
        module=None,
        hidden_layer_sizes=(100,),
        activation="relu",
        learning_rate=0.1,
        max_iter=200,
        batch_size=None,
        solver="sgd",
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
        path_storage="memory",
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
        self.path_storage = path_storage
        self.device = device
        self.random_state = random_state
        self.verbose = verbose

    def _build_module(self, X, n_classes):
        n_features = X.shape[1]
        if self.module is None:
            sizes = self.hidden_layer_sizes
            sizes = (sizes,) if isinstance(sizes, Integral) else tuple(sizes)
            return make_mlp(n_features, n_classes, sizes, self.activation)
        if isinstance(self.module, nn.Module):
            module = copy_module(self.module)
        else:
            module = self.module(n_features, n_classes)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    "The module callable must return a torch.nn.Module, got "
                    f"{type(module).__name__}."
                )
        if not any(True for _ in module.parameters()):
            raise ValueError("The module has no parameters to train.")
        return module
