"""Docstring fragments shared by the estimators (one text, no copies)."""

SOLVER_PARAMETERS = """solver : {"sgd", "adam", "adamw"}, default="{solver_default}"
        The torch.optim optimiser: ``"sgd"`` (gradient descent, with optional
        ``momentum``), ``"adam"`` or ``"adamw"``. The exact path kernel holds for
        every solver: its updates are linear in the training gradients once the
        run's own Adam preconditioner is taken as given (see the user guide,
        "Optimisers").
    momentum : float, default=0.0
        Momentum of ``"sgd"`` (dampening 0, as ``torch.optim.SGD``).
    nesterovs_momentum : bool, default=False
        Nesterov momentum for ``"sgd"`` (only with ``momentum > 0``).
    beta_1 : float, default=0.9
        Decay of the first-moment estimate of ``"adam"`` and ``"adamw"``.
    beta_2 : float, default=0.999
        Decay of the second-moment estimate of ``"adam"`` and ``"adamw"``.
    epsilon : float, default=1e-8
        Added to the denominator of ``"adam"`` and ``"adamw"``.
    weight_decay : float, default=0.0
        Weight decay, exactly as torch.optim: an L2 term added to the gradient
        for ``"sgd"`` and ``"adam"``, decoupled (``w <- (1 - lr weight_decay) w``)
        for ``"adamw"``. What it moves is reported apart from the training
        points' contributions (``decompose(X).decay``)."""


TRAINING_PARAMETERS = """""" + SOLVER_PARAMETERS + """
    shuffle : bool, default=True
        Reshuffle mini-batches each epoch.
    tol : float or None, default=None
        Stop when the training loss has not improved by ``tol`` for
        ``n_iter_no_change`` epochs; ``None`` runs all ``max_iter`` epochs.
    n_iter_no_change : int, default=10
        See ``tol``."""

PATH_PARAMETERS = """quadrature : {"exact", "riemann", "dpk"}, default="exact"
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
        computations."""

FITTED_ATTRIBUTES = """module_ : torch.nn.Module
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
        Feature names seen during fit, when X has string column names."""


def fill_doc(**fragments):
    """Class decorator: replace ``{name}`` in the docstring by ``fragments[name]``,
    in the order given (so a fragment may hold a later placeholder)."""

    def decorate(cls):
        doc = cls.__doc__
        for name, text in fragments.items():
            doc = doc.replace("{" + name + "}", text)
        cls.__doc__ = doc
        return cls

    return decorate
