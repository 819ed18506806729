"""Docstring fragments shared by the estimators (one text, no copies).

An estimator's docstring holds ``{name}`` placeholders that :func:`fill_doc` replaces
by fragments: a text, or a callable of the class that returns one (the solver
parameters, whose list comes from the registered optimiser rules and whose defaults
come from the estimator's signature). A placeholder without a fragment, a fragment
without a placeholder, or a note on a parameter that does not exist is an error at
import, never a silently unchanged text.
"""

import inspect
import re
import textwrap

from .._training import SOLVERS, solver_hyperparameters, solvers_taking

_NAME_INDENT, _TEXT_INDENT = " " * 4, " " * 8
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")

_SOLVER_TEXT = (
    "The torch.optim optimiser: {options}. The exact path kernel holds for every "
    "solver: its updates are linear in the training gradients once the run's own "
    'Adam preconditioner is taken as given (see the user guide, "Optimisers").'
)


def _literal(value):
    """A default as the parameter docs write it (``"adam"``, ``0.9``, ``1e-8``)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and value != 0 and abs(value) < 1e-3:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return repr(value)


def _solvers(names):
    """``"a"``, ``"b"`` and ``"c"`` (``none`` for no solver)."""
    if not names:
        return "none"
    quoted = [f'``"{name}"``' for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _entry(name, kind, default, text):
    """One numpydoc parameter: ``name : kind, default=...`` and its wrapped description."""
    body = textwrap.fill(
        " ".join(text.split()),
        width=80,
        initial_indent=_TEXT_INDENT,
        subsequent_indent=_TEXT_INDENT,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return f"{name} : {kind}, default={_literal(default)}\n{body}"


def _defaults(cls, names):
    parameters = inspect.signature(cls).parameters
    missing = [name for name in names if name not in parameters]
    if missing:
        raise TypeError(f"{cls.__name__}.__init__ lacks the solver parameters {missing}.")
    return {name: parameters[name].default for name in names}


def solver_parameters(notes=None):
    """The fragment documenting ``solver`` and every registered hyperparameter.

    Parameters
    ----------
    notes : dict of str to str, default=None
        Text appended to a parameter's description (an estimator's reason for its
        own default); a name that is not a solver parameter is a ``KeyError``.

    Returns
    -------
    fragment : callable
        ``fragment(cls) -> str``, the defaults taken from ``cls``'s signature.
    """
    notes = dict(notes or {})
    hyperparameters = solver_hyperparameters()
    unknown = sorted(set(notes) - {"solver", *hyperparameters})
    if unknown:
        raise KeyError(f"Notes on parameters that are not solver parameters: {unknown}.")

    def fragment(cls):
        defaults = _defaults(cls, ["solver", *hyperparameters])
        options = ", ".join(f'``"{name}"`` ({rule.summary})' for name, rule in SOLVERS.items())
        kind = "{" + ", ".join(f'"{name}"' for name in SOLVERS) + "}"
        entries = [
            _entry(
                "solver",
                kind,
                defaults["solver"],
                _SOLVER_TEXT.format(options=options) + " " + notes.get("solver", ""),
            )
        ]
        decoupled = [name for name, rule in SOLVERS.items() if rule.decoupled_decay]
        for name, hyperparameter in hyperparameters.items():
            takers = solvers_taking(name)
            text = hyperparameter.description.format(
                solvers=_solvers(takers),
                coupled=_solvers([s for s in takers if s not in decoupled]),
                decoupled=_solvers([s for s in takers if s in decoupled]),
            )
            entries.append(
                _entry(name, hyperparameter.kind, defaults[name], text + " " + notes.get(name, ""))
            )
        return ("\n" + _NAME_INDENT).join(entries)

    return fragment


_LOOP_PARAMETERS = """shuffle : bool, default=True
        Reshuffle mini-batches each epoch.
    tol : float or None, default=None
        Stop when the training loss has not improved by ``tol`` for
        ``n_iter_no_change`` epochs; ``None`` runs all ``max_iter`` epochs.
    n_iter_no_change : int, default=10
        See ``tol``."""


def loss_parameter(cls):
    """The fragment documenting ``loss``: the losses of ``cls``'s registry
    (``cls._losses``), its default from ``cls``'s signature."""
    default = inspect.signature(cls).parameters["loss"].default
    options = ", ".join(f'``"{name}"`` ({loss.summary})' for name, loss in cls._losses.items())
    kind = "{" + ", ".join(f'"{name}"' for name in cls._losses) + "}"
    text = (
        f"The training loss: {options}. It chooses the function ``f`` the kernel "
        "reproduces (its link) and each training row's output gradient."
    )
    return _entry("loss", kind, default, text)


def training_parameters(notes=None):
    """``loss`` (:func:`loss_parameter`), the solver parameters
    (:func:`solver_parameters`), then ``shuffle``, ``tol`` and ``n_iter_no_change``:
    a fragment ``fragment(cls) -> str``."""
    solver = solver_parameters(notes)

    def fragment(cls):
        return (
            loss_parameter(cls)
            + "\n"
            + _NAME_INDENT
            + solver(cls)
            + "\n"
            + _NAME_INDENT
            + _LOOP_PARAMETERS
        )

    return fragment


IMAGE_PARAMETERS = """image_shape : tuple of int or None, default=None
        ``(H, W)`` or ``(C, H, W)``: each row of ``X`` is an image of this shape,
        flattened (C-order, as ``X.reshape(n, -1)``), and the network starts with
        the convolutional distance layers of ``conv_layers``
        (:class:`DistanceConv2d`: every patch compared with learned patch
        memories, with ``kernel``, ``init`` and ``skew_transform`` as the dense
        layers), whose flattened outputs feed the dense layers of
        ``hidden_layer_sizes`` (``()`` for none). ``None``: a dense network.
        A ``ValueError`` names the sizes when the shape does not match the
        number of features or a patch is larger than its (padded) input.
    conv_layers : tuple, default=((16, 3, 1, 1, 2),)
        The convolutional distance layers (with ``image_shape``). Per layer: an
        int, its number of memories (3x3 patches, stride 1, no padding, no
        pool); a tuple ``(n_memories, kernel_size[, stride[, padding[, pool]]])``;
        or a dict with any of those keys (``n_memories`` required). ``pool > 1``
        follows the layer with a pool over ``pool`` x ``pool`` windows of
        positions (stride ``pool``) that keeps each memory's best match: the
        smallest distance (``kernel="sqeuclidean"`` or ``"euclidean"``) or the
        largest similarity; it comes before ``skew_transform``. The default, 16
        memories of 3x3 patches, padding 1, 2x2 pool, was chosen on digits
        images held out from the reported folds (``doc/benchmarks_distance.rst``).
        A ``ValueError`` names an entry that is not of these forms, or a pool
        larger than the layer's output."""


def step_chunks_parameter(steps):
    """The ``step_chunks`` entry of a parameter list, for the ``steps`` steps
    ("training" or "recorded"): the estimators' and ``Recording``'s."""
    return f"""step_chunks : int or None, default=None
        Contiguous chunks of the {steps} steps, each a task of its own with
        every tile of query rows. None: one per ``n_jobs`` worker where the steps
        are independent (Gram matrices, plain SGD's ``decompose``), one where
        ``decompose`` accumulates them backward (momentum, Nesterov, Adam,
        AdamW). A number splits that accumulation too, as a scan with a carry
        between chunks, so that the chunks run in parallel on threads or dask
        workers: the same decomposition to rounding (1e-12), for more work (the
        products with the batches again for all chunks but the last; see
        ``doc/user_guide/gpu_and_clusters.rst``)."""


PATH_PARAMETERS = (
    """quadrature : {"exact", "riemann", "dpk"}, default="exact"
        How the test-copy features integrate the gradient along each step:
        ``"exact"`` splits each step at the kinks of the network and uses
        Gauss-Legendre nodes on each smooth piece; ``"riemann"`` is the paper's
        left Riemann sum with ``n_points`` points; ``"dpk"`` uses the gradient
        at the start of the step (the Discrete Path Kernel of prior work).
    n_points : int, default=100
        Points of the ``"riemann"`` rule.
    n_jobs : int or None, default=None
        Parallel jobs (joblib) over blocks of kernel computations.
    """
    + step_chunks_parameter("training")
    + """
    path_storage : "memory", "disk" or path-like, default="memory"
        Where the recorded weight path, an array of ``(n_steps + 1) x n_weights``
        numbers in the training ``dtype``, is kept: ``"memory"`` (RAM), ``"disk"`` (a
        memory-mapped file in the system's temporary directory) or a memory-mapped
        file in the given directory, for long trainings whose path does not fit
        in RAM. Kernels and decompositions are identical either way. Before
        training, the path's size is checked against the available memory (or
        free disk space) and a ``MemoryError`` names the sizes if it cannot fit.
        Pickling writes the weights into the pickle; the unpickled estimator
        holds them in memory.
    dtype : {"float64", "float32"}, default="float64"
        The dtype the network is trained in, as a user's own loop would: with
        ``"float32"``, ``module_`` (what ``predict`` evaluates), the training
        arithmetic and ``path_`` (4 bytes a number, half the float64 path) are
        float32. The kernel is always computed in float64: for a float32 fit it
        is the exact kernel of the float32 run itself, every step anchored at
        its recorded weights (each gradient recomputed there in float64, with the
        recorded batches, output gradients, rates and preconditioners) and each
        step's float32 rounding an explicit part of ``decompose``'s ``decay``;
        built at fit, each step checked to be its gradients' update to float32
        rounding (else refused: a ``RecordingRefused`` names the step and the
        parameter), and held in float64 where ``path_storage`` says
        (``8 (2 n_steps + 1) n_weights`` bytes more; not pickled, rebuilt
        bitwise on the next query). ``decompose``'s ``residual`` is then
        measured against the float32 weights evaluated in float64, and
        ``model_gap`` says how far the float32 network's own forward pass is
        from that (about ``1e-6``). A network with BatchNorm in training mode
        takes its float64 replay from ``w_0`` instead, refused when it drifts
        beyond the run's rounding. See the user guide, "Float32 runs".
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
        Print the training loss per epoch and show a progress bar over the
        steps of kernel computations (Grams, decompositions, self-influence),
        which moves with each recorded step of each tile of rows."""
)

FITTED_ATTRIBUTES = """module_ : torch.nn.Module
        The trained network (in ``dtype``, weights ``w_S``), on ``device_``.
    device_ : torch.device
        Where ``module_`` and the training data live and the computations run:
        ``device`` at fit (after unpickling, the CPU if this machine lacks it).
    path_ : WeightPath
        The recorded weight path, in ``dtype``, on the
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
    """Class decorator: replace each ``{name}`` of the docstring by ``fragments[name]``
    (a text, or ``fragment(cls) -> str``).

    Raises ``ValueError`` when a fragment's placeholder is not in the docstring or
    a placeholder is left without a fragment.
    """

    def decorate(cls):
        doc = cls.__doc__
        for name, fragment in fragments.items():
            placeholder = "{" + name + "}"
            if placeholder not in doc:
                raise ValueError(f"The docstring of {cls.__name__} has no {placeholder}.")
            doc = doc.replace(placeholder, fragment(cls) if callable(fragment) else fragment)
        left = _PLACEHOLDER.findall(doc)
        if left:
            raise ValueError(f"The docstring of {cls.__name__} has unfilled placeholders {left}.")
        cls.__doc__ = doc
        return cls

    return decorate
