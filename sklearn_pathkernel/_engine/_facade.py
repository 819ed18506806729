"""The exact path kernel engine: decomposition and Gram matrices of a recorded path.

Notation (as in the user guide): ``f_w(x) = link(module_w(x))`` with K outputs (the
link is the log-softmax for classifiers, the identity for regressors); step
``s`` moves the weights along ``w_s(t) = w_s + t (w_{s+1} - w_s)``; the training
copy of a point uses ``g(x; w_s)``, the gradient at the start of the step, the
test copy ``phi_s(x) = int_0^1 g(x; w_s(t)) dt``. With ``e_{s,i} = -dL_s / df(x_i;
w_s)`` the recorded output gradient, exactly,

    f(x; w_S) = f(x; w_0) + sum_s sum_{i in B_s} <psi_s(x), sum_k e_{s,i,k} g_k(x_i; w_s)> + decay,

where ``psi_s = eta_s phi_s`` for plain gradient descent, and momentum and Adam
(with its preconditioner ``P_s``) accumulate ``P_s phi_s`` backward over the
steps (see :mod:`._decomposition`); the path kernel of step ``s`` is
``<g, P_s g'>``.

:class:`PathKernelEngine` is a facade: it converts the public settings once
(``quadrature`` to a :class:`~.integration._quadrature.Quadrature` rule,
``output`` to an :class:`~._modes.OutputMode`), builds the parts, and delegates:

- :mod:`._steps`: the path's steps on the device, a probe per thread;
- :mod:`._scheduling` and :mod:`._planning`: tasks, tiles and passes;
- :mod:`._test_copy` (with :mod:`.integration`): ``phi_s``, integrated and certified;
- :mod:`._decomposition`: the contributions;
- :mod:`._gram` and :mod:`._blocks`: Gram matrices and diagonals;
- :mod:`._stepwise`: the decomposition's per-step terms and the self-influence.

How it is fast: per step, one forward pass and one batched backward pass give
every layer's factors; the per-layer rules turn factors into Gram blocks without
ever forming an (n, K, W) Jacobian; the training side of a step is computed once
and reused for every node of every query; blocks of (query rows, training rows,
steps) are independent tasks for joblib.
"""

from numbers import Integral

import numpy as np
from sklearn.utils import check_scalar

from .._path import (
    CERTIFICATE_TOLERANCE,
    IdentityLink,
    LogSoftmaxLink,
    with_running_statistics,
)
from ._blocks import GramBlocks
from ._decomposition import Decomposition
from ._device import loadable_device, on_host
from ._fitted import FittedPath
from ._gram import Gram
from ._modes import OutputMode
from ._planning import Planner
from ._scheduling import Scheduler, StepChunks
from ._steps import PathSteps, ThreadProbes
from ._stepwise import StepwiseDecomposition
from ._targets import QueryTargets
from ._test_copy import TestCopy
from .integration._certificate import Certificate
from .integration._degree import path_degree
from .integration._quadrature import Quadrature

#: The parts built from the settings (rebuilt on unpickling, never pickled).
#: The contributions one tile of the coupled self-influence holds (its rows' full
#: decompositions, of which the diagonal is kept).
SELF_TILE_BYTES = 256 * 2**20

_PARTS = (
    "_probes",
    "_steps",
    "_scheduler",
    "_planner",
    "_fitted",
    "_test_copy",
    "_decomposition",
    "_gram",
)


class PathKernelEngine:
    """Exact path kernel of a module trained along a recorded path.

    Parameters
    ----------
    module : torch.nn.Module
        The network. Only its structure is used; weights come from ``path``.
        The engine computes in the path's dtype: float64 (the estimators'), or
        float32 for a float32 copy of the module, rows and path, with the
        certificate held to float32's rounding.
    path : WeightPath
        The recorded training path.
    X_train : torch.Tensor of shape (M, ...)
        Training inputs, indexed by ``path.batches``. The engine computes on
        their device (``module`` must be there too); the path
        stays where it is (host memory or disk) and each step's weights are
        moved to the device when they are evaluated. Inputs of the public
        methods are moved to the device; results are numpy arrays.
    link : Link, default=None
        Gives ``f`` from the module's output (:class:`LogSoftmaxLink`, the
        classifiers' log-softmax, when None; :class:`IdentityLink` for the
        regressors; any callable as a :class:`FunctionLink`). What each training
        point contributes comes from the path's output gradients, for any loss.
    certificate_tolerance : float, default=CERTIFICATE_TOLERANCE
        What the certificate holds each step's quadrature error to, in units of
        ``f`` (1e-11; a training loss says its own).
    quadrature : {"exact", "riemann", "dpk", "midpoint", "gauss"}, default="exact"
        Integration of the test-copy features along each step (see
        :class:`~sklearn_pathkernel._engine.integration._quadrature.Quadrature`).
    n_points : int, default=100
        Points of the fixed rules (``"riemann"``, ``"midpoint"``, ``"gauss"``).
    n_nodes : int, default=4
        Gauss-Legendre nodes per smooth piece for ``"exact"``, at most: where
        ``f`` is a polynomial in ``t`` of degree ``D`` on each piece (ReLU
        networks of linear and convolutional layers with the identity link,
        see :mod:`.integration._degree`), ``ceil(D / 2)`` nodes are exact and the
        engine uses no more (``D`` for the test x test Gram, else ``3 n_nodes``);
        where the logits are such a polynomial and the link has a closed-form
        Jacobian (the classifiers' log-softmax), ``D`` nodes per piece with
        Jacobian-weighted cotangents are exact when ``D <= n_nodes``
        (:mod:`.integration._link_weights`; the test x test Gram keeps
        ``3 n_nodes``).
    tile_size : int, default=512
        Rows per forward pass, per side of a matrix product and per block of
        the test x test Gram (on a GPU, products take more: see
        ``Planner.block_size``); bounds the memory of each. Training and cross
        Gram tasks hold as many rows as the device's working budget allows.
    n_jobs : int or None, default=None
        joblib jobs over blocks (respects ``joblib.parallel_config``, e.g. dask).
    step_chunks : int or None, default=None
        Contiguous chunks the path's steps are cut into, each a task with every
        tile of query rows (at most one per step). None: one per joblib worker
        where the steps are independent (Gram matrices, plain SGD's
        decomposition), one where ``decompose`` accumulates them backward
        (momentum, Nesterov, Adam, AdamW). A number splits the accumulation too,
        as a scan with a carry between chunks (:mod:`._step_scan`): the chunks
        run in parallel, on threads or dask workers; equal to one chunk's
        result to rounding, at the cost of the products with the batches again
        for all chunks but the last, and one buffer (``n K W`` numbers) to the
        caller and back per chunk boundary.
    verbose : int, default=0
        Show a progress bar over blocks.

    Attributes
    ----------
    nodes : NodeCounts
        The nodes per smooth piece the engine integrates with, and the path's
        degree they follow from.
    """

    def __init__(
        self,
        module,
        path,
        X_train,
        *,
        link=None,
        certificate_tolerance=CERTIFICATE_TOLERANCE,
        quadrature="exact",
        n_points=100,
        n_nodes=4,
        tile_size=512,
        n_jobs=None,
        step_chunks=None,
        verbose=0,
    ):
        self.module = module
        # BatchNorm trained in training mode: its running statistics join the path's
        # coordinates (see _path/_batchnorm.py); the same path otherwise.
        self.path = with_running_statistics(path)
        self.X_train = X_train
        self.link = LogSoftmaxLink() if link is None else link
        self.certificate_tolerance = certificate_tolerance
        self.quadrature = quadrature
        self.n_points = n_points
        self.n_nodes = n_nodes
        self.tile_size = tile_size
        self.n_jobs = n_jobs
        if step_chunks is not None and not isinstance(step_chunks, StepChunks):
            check_scalar(step_chunks, "step_chunks", Integral, min_val=1)
        self.step_chunks = step_chunks
        self.verbose = verbose
        self.device = X_train.device
        self.n_train = X_train.shape[0]
        self._build()
        self.n_outputs = self.probe.output(self._steps.weights(0), X_train[:1]).shape[1]
        self._build_computations()

    def _build(self):
        """The parts that hold the device: the path's steps, the probes, the plans."""
        self._rule = Quadrature.of(self.quadrature).rule(self.n_points)
        self._probes = ThreadProbes(self.module, self.path, self.X_train[:1], self.link)
        degrees = tuple(
            path_degree(self.module, self.path.param_names, self.X_train[:1], link).degree
            for link in (self.link, IdentityLink())
        )
        per_layer = self._probes.current().jacobian is None
        self._weighting, self.nodes = self._rule.node_weighting(
            self.link, degrees, self.n_nodes, per_layer
        )
        self._target_weighting = self._rule.target_weighting(
            self.link, degrees, self.n_nodes, per_layer
        )
        self._steps = PathSteps(self.path, self.device)
        self._scheduler = Scheduler(
            self.n_jobs, self.verbose, self.path.n_steps, self.__dict__.get("step_chunks")
        )
        self._planner = Planner(
            self.device,
            self.tile_size,
            self.nodes.per_piece,
            self.path,
            self._scheduler,
            self._probes,
            self._steps,
            self.X_train[:1],
        )

    def _build_computations(self):
        """The parts that compute: the test copy, the decomposition, the Grams."""
        self._fitted = FittedPath(
            self.path,
            self.X_train,
            self._probes,
            self._steps,
            self._scheduler,
            self._planner,
            self._rule,
            self.nodes,
            self.n_outputs,
        )
        certificate = Certificate(self._probes, self._steps, self.certificate_tolerance)
        self._test_copy = TestCopy(
            self._fitted, certificate, self._weighting, self._target_weighting
        )
        self._decomposition = Decomposition(self._fitted, self._test_copy)
        self._gram = Gram(self._fitted, GramBlocks(self._fitted, self._test_copy))

    def __deepcopy__(self, memo):
        return self  # immutable: copies share it (sklearn's clone deep-copies params)

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in _PARTS and k != "_rule"}
        if self.device.type != "cpu":
            # Host tensors only: the pickle loads on a machine without the device.
            state["module"] = on_host(self.module)
            state["X_train"] = self.X_train.cpu()
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        device = loadable_device(state.get("device"), "The path kernel engine")
        if device != state.get("device") or device.type != "cpu":
            self.device = device
            self.module = self.module.to(device)
            self.X_train = self.X_train.to(device)
        self._build()
        self._build_computations()

    @property
    def probe(self):
        """The network probe of the calling thread.

        Probes register forward hooks on their module while they evaluate it, so
        every worker thread gets its own copy of the module.
        """
        return self._probes.current()

    def decompose(self, X, batch_size=None, targets=None):
        """Contributions of every training point to the network's output on ``X``,
        or to a scalar target of it per row.

        The update of step ``s`` is linear in the gradients of its own and earlier
        steps (see ``UpdateRecord``). When each step moves along its own gradient,
        unpreconditioned (plain SGD, with or without weight decay), step ``s``'s
        training gradients meet ``phi_s`` alone and every layer keeps its factored
        rule. Otherwise (momentum, Adam, AdamW) they meet ``psi_s``, accumulated
        backward over the steps: one pass over the path, materialised per-layer
        features (n x K x W per row tile), one matrix product per step against
        the batch's per-example gradients (see :mod:`._decomposition`); under
        SGD's momentum a first ``nn.Linear`` layer, whose input is the query
        itself, keeps its factored form (its W counts out of both).

        Parameters
        ----------
        X : torch.Tensor of shape (n, ...)
            Query rows, all on the test copy.
        batch_size : int or None, default=None
            Query rows integrated at once, at most. None: as many as the
            working budget holds, from the memory a row's quadrature nodes
            take (measured on a sample of the rows); the result, ``8 n M K``
            bytes, is held whole either way.
        targets : QueryTargets or None, default=None
            A scalar target :math:`T(f)` per row (its labels on the device):
            the decomposition of :math:`T` instead of the ``K`` outputs, exactly
            (``T(f(w_S)) - T(f(w_0))`` as a sum over the training points), at the
            cost of one output: each quadrature node back-propagates the one
            cotangent :math:`\\nabla T` (at the logits, integrated against the
            interpolation basis where the link's Jacobian route is exact), and
            the test features meet the training side with one output, not ``K``.
            The certificate checks :math:`T`.

        Returns
        -------
        Bunch
            ``contributions`` (n, M, K), ``bias`` (n, K), ``decay`` (n, K),
            ``output`` (n, K) (``f`` at the path's last weights) and ``quadrature_error``
            (n,) (the quadrature's certificate, summed over steps), as float64
            numpy arrays; with running statistics in the path (BatchNorm trained in
            training mode), ``statistics`` (n, M, K), their part of ``contributions``;
            with ``targets``, ``K`` is 1 and the values are ``T``'s.
        """
        if batch_size is not None:
            check_scalar(batch_size, "batch_size", Integral, min_val=1)
        if targets is not None:
            if targets.n_rows != X.shape[0]:
                raise ValueError(
                    f"targets has {targets.n_rows} labels for {X.shape[0]} rows: one per row."
                )
            targets = QueryTargets(targets.target, targets.labels.to(self.device))
        return self._decomposition.decompose(X.to(self.device), batch_size, targets)

    def output(self, X):
        """``f`` of the rows of ``X`` at the path's final weights: (n, K), a tensor on
        the device."""
        return self.probe.output(self._steps.weights(-1), X.to(self.device))

    def stepwise(self):
        """The decomposition step by step, and the self-influence of the training
        points (a :class:`~._stepwise.StepwiseDecomposition` of this engine)."""
        self._refuse_coupled("the step-by-step decomposition and self-influence")
        return StepwiseDecomposition(self._fitted, self._test_copy, verbose=self.verbose)

    def self_influence(self, first_step=0, targets=None):
        """``c_i(x_i)`` per training point and output: (M, K), or (M, 1) with
        ``targets`` (one per training row), the diagonal of
        ``decompose(X_train).contributions``, without its (M, M, K) array.

        Without running statistics, :meth:`StepwiseDecomposition.self_influence`
        (the terms of the steps from ``first_step`` on). With BatchNorm trained in
        training mode a training row's gradient exists only in its own batch (no
        training copy), so the diagonal is taken from the decomposition of the
        training rows themselves, a tile of rows at a time (``SELF_TILE_BYTES`` of
        contributions): the cost of ``decompose(X_train)``, every step.
        """
        if self.path.running_statistics is None:
            return self.stepwise().self_influence(first_step, targets)
        if first_step:
            self._refuse_coupled("the self-influence from a later epoch (first_epoch)")
        n_outputs = self.n_outputs if targets is None else 1
        size = max(1, SELF_TILE_BYTES // (8 * self.n_train * n_outputs))
        values = np.empty((self.n_train, n_outputs))
        for begin in range(0, self.n_train, size):
            rows = slice(begin, min(begin + size, self.n_train))
            tile = None if targets is None else targets.take(rows)
            parts = self.decompose(self.X_train[rows], targets=tile)
            own = np.arange(rows.stop - rows.start)
            values[rows] = parts.contributions[own, own + begin]
        return values

    def _refuse_coupled(self, what):
        """Refuse ``what`` for a path with BatchNorm trained in training mode."""
        if self.path.running_statistics is not None:
            raise NotImplementedError(
                "Not available for a network with BatchNorm trained in training mode: "
                f"{what}. A training row's gradient there is taken through its "
                "batch's statistics, so it exists only for the batch the row was trained "
                "in, not at an arbitrary step or on its own (the training copy of a Gram), "
                "and the running statistics' moves are no gradients. decompose (and the "
                "explanations by contributions built on it) is exact for such networks."
            )

    def certificate(self, X):
        """Summed per-step quadrature error of the test copy, per row of ``X``."""
        X = X.to(self.device)
        quadrature_error = np.zeros(X.shape[0])
        for index in range(self.path.n_steps):
            integrated = self._test_copy.integrate(index, X, measure_error=True)
            quadrature_error += integrated.quadrature_error
        return quadrature_error

    def gram(self, A, B=None, *, a_train=False, b_train=False, output="trace"):
        """Exact path kernel between the rows of ``A`` and ``B``.

        Parameters
        ----------
        A : torch.Tensor of shape (nA, ...)
        B : torch.Tensor of shape (nB, ...) or None
            ``None`` means ``B = A`` with ``b_train = a_train``.
        a_train, b_train : bool or array of bool
            Per row: True puts the row on the training copy (gradient at the start
            of each step), False on the test copy (gradient integrated along it).
        output : {"trace", "full"}
            ``"trace"`` sums matching outputs, giving (nA, nB); ``"full"`` keeps
            every output pair, giving (nA, nB, K, K).

        Returns
        -------
        ndarray
        """
        self._refuse_coupled("Gram matrices")
        mode = OutputMode.of_output(output)
        A = A.to(self.device)
        B = None if B is None else B.to(self.device)
        return self._gram.gram(A, B, a_train, b_train, mode)

    def diag(self, A, *, a_train=False):
        """``np.diag(gram(A, a_train=a_train))`` without the off-diagonal work."""
        self._refuse_coupled("Gram diagonals")
        return self._gram.diag(A.to(self.device), a_train)
