"""Brute-force reference for the exact path kernel: the EPK paper's Algorithm 1.

Slow and obvious on purpose, and independent of the fast engine (no per-layer
rules, no kink location): per-example Jacobians ``(n, K, W)`` of
``f_w(x) = link(module_w(x))`` (the log-softmax, or the identity of the regressors)
are materialised with
``torch.func.vmap(jacrev(...))`` and contracted with ``einsum``.

Notation (as in the user guide): step ``s`` moves the weights along
``w_s(t) = w_s + t (w_{s+1} - w_s)``; the training copy of a point uses
``g(x; w_s)``, the test copy ``phi_s(x) = int_0^1 g(x; w_s(t)) dt``, integrated
here by a fixed quadrature rule (nodes ``t_q``, weights ``nu_q`` on ``[0, 1]``).

Use it to check the fast engine on small problems, and as the baseline of
``benchmarks/bench_engine.py``. It has the interface of
:class:`~sklearn_pathkernel._engine._facade.PathKernelEngine`, but has no ``"exact"``
rule: on a smooth network ``"gauss"`` converges spectrally and is the exactness
reference; on a ReLU network every fixed rule converges slowly.
"""

import numpy as np
import torch
from sklearn.utils import Bunch
from torch.func import functional_call, jacrev, vmap

from sklearn_pathkernel._engine.integration._quadrature import Quadrature
from sklearn_pathkernel._path import log_softmax

QUADRATURES = ("riemann", "dpk", "midpoint", "gauss")

# Upper bound on the bytes of one materialised (rows, K, W) Jacobian tile; a few
# such tiles are alive at once.
TILE_BYTES = 256 * 2**20


def quadrature_rule(quadrature, n_points):
    """Nodes ``t`` and weights ``nu`` of a fixed rule on ``[0, 1]``.

    The nodes come from the package's one table of fixed rules
    (:meth:`~sklearn_pathkernel._engine.integration._quadrature.Quadrature.fixed_nodes`):
    the reference shares the nodes and weights with the engine, nothing else.

    Parameters
    ----------
    quadrature : {"riemann", "dpk", "midpoint", "gauss"}
        ``"riemann"``: left Riemann sum ``t = 0, 1/T, ..., (T-1)/T`` (Algorithm 1);
        ``"dpk"``: ``t = 0`` only; ``"midpoint"``: the ``T`` midpoints;
        ``"gauss"``: ``T`` Gauss-Legendre nodes.
    n_points : int
        ``T``, the number of nodes (ignored by ``"dpk"``).

    Returns
    -------
    t, nu : ndarray of shape (n_nodes,)
    """
    if quadrature not in QUADRATURES:
        raise ValueError(
            f"quadrature must be one of {QUADRATURES} for the reference engine, got "
            f"{quadrature!r} (the reference has no kink-splitting 'exact' rule; use "
            "'gauss' on smooth networks)."
        )
    return tuple(Quadrature(quadrature).fixed_nodes(n_points))


def log_proba(module, path, flat_weights, X, link=log_softmax):
    """``f(X; w) = link(module_w(X))`` at the flat weights ``w``, shape (n, K)."""
    with torch.no_grad():
        logits = functional_call(module, path.unflatten(flat_weights), (X,))
    return link(logits)


def jacobian(module, path, flat_weights, X, link=log_softmax):
    """Per-example Jacobians of ``link(module_w(x))`` with respect to ``w``.

    Parameters
    ----------
    module : torch.nn.Module
        The network; only its structure (and buffers) are used.
    path : WeightPath
        Gives the split of a flat weight vector into the module's parameters.
    flat_weights : torch.Tensor of shape (W,) or (n, W)
        One weight vector for all rows, or one per row.
    X : torch.Tensor of shape (n, ...)
    link : callable, default=log_softmax

    Returns
    -------
    torch.Tensor of shape (n, K, W)
        ``J[i, k, w] = d f_k(x_i) / d w_w``, flat weights in ``named_parameters`` order.
    """

    def outputs(weights, x):
        logits = functional_call(module, path.unflatten(weights), (x.unsqueeze(0),))
        return link(logits)[0]

    flat_weights = flat_weights.detach()
    n_weights = flat_weights.shape[-1]
    if X.shape[0] == 0:  # vmap cannot map over an empty batch
        n_outputs = log_proba(module, path, path.weights[0], X[:0]).shape[1]
        return torch.zeros((0, n_outputs, n_weights), dtype=flat_weights.dtype)
    per_row = 0 if flat_weights.ndim == 2 else None
    # chunk_size=1: vmap over the output basis hits wrong batching rules (e.g. cdist).
    return vmap(jacrev(outputs, chunk_size=1), in_dims=(per_row, 0))(flat_weights, X)


def _contract(left, right, output):
    """``sum_w left[a, k, w] right[b, k', w]``: trace over k = k', or every (k, k')."""
    if output == "trace":
        return torch.einsum("akw,bkw->ab", left, right)
    return torch.einsum("akw,blw->abkl", left, right)


def _contract_at_nodes(nu, left, right, output):
    """``sum_q nu_q sum_w left[q, a, k, w] right[q, b, k', w]`` (same node on both sides)."""
    if output == "trace":
        return torch.einsum("q,qakw,qbkw->ab", nu, left, right)
    return torch.einsum("q,qakw,qblw->abkl", nu, left, right)


def _as_mask(flag, n):
    """``flag`` as a boolean mask of ``n`` rows (its own copy of the engine's
    ``as_mask``: the reference shares nothing with the engine but the nodes table)."""
    return np.broadcast_to(np.asarray(flag, dtype=bool), (n,)).copy()


class NaivePathKernelEngine:
    """Exact path kernel by materialised Jacobians (reference implementation).

    Parameters
    ----------
    module : torch.nn.Module
        The network (float64). Only its structure is used; weights come from ``path``.
    path : WeightPath
        The recorded training path.
    X_train : torch.Tensor of shape (M, ...)
        Training inputs, indexed by ``path.batches``.
    link : callable, default=log_softmax
        ``f`` from the module's output.
    quadrature : {"riemann", "dpk", "midpoint", "gauss"}, default="gauss"
        Fixed rule integrating the test-copy gradient along each step. ``"exact"``
        (the fast engine's kink-splitting rule) is not available here.
    n_points : int, default=100
        Nodes of the rule.
    n_nodes : int, default=4
        Unused; accepted for interface compatibility with the fast engine.
    tile_size : int, default=256
        Maximum rows per materialised Jacobian tile (also capped so that a tile
        stays under ``TILE_BYTES``).
    n_jobs : int or None, default=None
        Unused (the reference runs serially); accepted for compatibility.
    verbose : int, default=0
        Show a progress bar over steps.
    """

    def __init__(
        self,
        module,
        path,
        X_train,
        *,
        link=log_softmax,
        quadrature="gauss",
        n_points=100,
        n_nodes=4,
        tile_size=256,
        n_jobs=None,
        verbose=0,
    ):
        self.module = module
        self.path = path
        self.X_train = X_train
        self.link = link
        self.quadrature = quadrature
        self.n_points = n_points
        self.n_nodes = n_nodes
        self.tile_size = tile_size
        self.n_jobs = n_jobs
        self.verbose = verbose
        self.nodes, self.node_weights = quadrature_rule(quadrature, n_points)
        self.n_train = X_train.shape[0]
        self.n_outputs = self._f(path.weights[0], X_train[:1]).shape[1]

    # -- building blocks ----------------------------------------------------------

    def _f(self, weights, X):
        return log_proba(self.module, self.path, weights, X, self.link)

    def _jac(self, weights, X):
        return jacobian(self.module, self.path, weights, X, self.link)

    def _rows_per_tile(self):
        per_row = max(1, self.n_outputs * self.path.n_weights * 8)
        return max(1, min(int(self.tile_size), TILE_BYTES // per_row))

    def _tiles(self, n):
        rows = self._rows_per_tile()
        return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]

    def _node_chunks(self, n_rows):
        """Slices of the quadrature nodes such that ``nodes x n_rows`` Jacobians fit a tile."""
        size = max(1, self._rows_per_tile() // max(1, n_rows))
        n = self.nodes.size
        return [slice(start, min(start + size, n)) for start in range(0, n, size)]

    def _jac_at_nodes(self, step, X, nodes):
        """``g(X; w_s(t_q))`` for the nodes ``q`` in the slice ``nodes``: (q, n, K, W).

        All (node, row) pairs go through one vmapped call (one weight vector per pair).
        """
        t = torch.as_tensor(self.nodes[nodes], dtype=self.path.weights.dtype)
        weights = self.path.weights[step] + t[:, None] * self.path.step_direction(step)
        n_nodes, n_rows = t.numel(), X.shape[0]
        rows = X.repeat(n_nodes, *([1] * (X.ndim - 1)))
        jac = self._jac(weights.repeat_interleave(n_rows, dim=0), rows)
        return jac.view(n_nodes, n_rows, *jac.shape[1:])

    def _nu(self, nodes, dtype):
        return torch.as_tensor(self.node_weights[nodes], dtype=dtype)

    def _steps(self):
        steps = range(self.path.n_steps)
        if self.verbose:
            from tqdm.auto import tqdm

            return tqdm(steps, desc="reference path kernel steps")
        return steps

    def _test_feature(self, step, X):
        """``phi_s(X) = sum_q nu_q g(X; w_s(t_q))``, shape (n, K, W)."""
        phi = torch.zeros((X.shape[0], self.n_outputs, self.path.n_weights), dtype=X.dtype)
        for nodes in self._node_chunks(X.shape[0]):
            phi += torch.einsum(
                "q,qnkw->nkw", self._nu(nodes, X.dtype), self._jac_at_nodes(step, X, nodes)
            )
        return phi

    def _step_residual(self, step, X, phi):
        """``max_k |f(w_{s+1}) - f(w_s) - <phi_s, w_{s+1} - w_s>|`` per row."""
        change = self._f(self.path.weights[step + 1], X) - self._f(self.path.weights[step], X)
        linear = torch.einsum("nkw,w->nk", phi, self.path.step_direction(step))
        return (change - linear).abs().amax(1)

    def _training_gradients(self, step):
        """``sum_k e_{s,i,k} g_k(x_i; w_s)`` of step ``s``'s batch rows, (|B_s|, W),
        with ``e_{s,i}`` the recorded output gradient (so that ``w_{s+1} - w_s``
        is their sum times the learning rate, for plain gradient descent)."""
        rows = torch.as_tensor(np.asarray(self.path.batches[step]))
        X, e = self.X_train[rows], self.path.output_gradients[step].to(self.X_train.dtype)
        grads = torch.empty((len(rows), self.path.n_weights), dtype=X.dtype)
        for tile in self._tiles(len(rows)):
            jac = self._jac(self.path.weights[step], X[tile])
            grads[tile] = torch.einsum("nkw,nk->nw", jac, e[tile])
        return grads

    # -- decomposition ---------------------------------------------------------------

    def _preconditioner(self, step, dtype):
        """``P_s`` (W,), ones without one."""
        preconditioners = self.path.update.preconditioners
        if preconditioners is None:
            return torch.ones(self.path.n_weights, dtype=dtype)
        return preconditioners[step].to(dtype)

    def decompose(self, X):
        """Contributions of every training point to the network's output on ``X``.

        Every (step, earlier step) pair is summed explicitly,

            contributions[x, i] = sum_s sum_{r <= s} c_{s,r}
                                  <P_s phi_s(x), sum_k e_{r,i,k} g_k(x_i; w_r)>,

        ``decay = sum_s d_s <phi_s, w_s> - lambda_c sum_s sum_{r<=s} c_{s,r}
        <P_s phi_s, w_r>``: S^2 products, for checking the fast engine's backward
        accumulation on small paths.

        Parameters
        ----------
        X : torch.Tensor of shape (n, ...)
            Query rows, all on the test copy.

        Returns
        -------
        Bunch
            ``contributions`` (n, M, K), ``bias`` (n, K), ``decay`` (n, K),
            ``output`` (n, K) and ``quadrature_error`` (n,), as float64 numpy arrays.
        """
        update = self.path.update
        contributions = torch.zeros((X.shape[0], self.n_train, self.n_outputs), dtype=X.dtype)
        decay = torch.zeros((X.shape[0], self.n_outputs), dtype=X.dtype)
        residual = torch.zeros(X.shape[0], dtype=X.dtype)
        batches = [torch.as_tensor(np.asarray(batch)) for batch in self.path.batches]
        training_gradients = {}  # step r -> sum_k e_{r,i,k} g_k(x_i; w_r) of its batch
        for step in self._steps():
            phi = self._test_feature(step, X)
            residual += self._step_residual(step, X, phi)
            decay += update.decoupled_decays[step] * phi @ self.path.weights[step]
            weighted = phi * self._preconditioner(step, X.dtype)
            for earlier in range(step + 1):
                c = self.path.update.mixing(step, earlier)
                if c == 0:
                    continue
                if earlier not in training_gradients:
                    training_gradients[earlier] = self._training_gradients(earlier)
                # c_{s,r} is per weight where parameter groups differ: applied
                # to the weights before the contraction
                values = torch.einsum("nkw,bw->nbk", c * weighted, training_gradients[earlier])
                contributions.index_add_(1, batches[earlier], values)
                decay -= update.coupled_decay * c * weighted @ self.path.weights[earlier]
        return Bunch(
            contributions=contributions.numpy(),
            bias=self._f(self.path.weights[0], X).numpy(),
            decay=decay.numpy(),
            output=self._f(self.path.weights[-1], X).numpy(),
            quadrature_error=residual.numpy(),
        )

    def certificate(self, X):
        """Summed per-step quadrature error of the test copy, per row of ``X``."""
        residual = torch.zeros(X.shape[0], dtype=X.dtype)
        for step in self._steps():
            for tile in self._tiles(X.shape[0]):
                phi = self._test_feature(step, X[tile])
                residual[tile] += self._step_residual(step, X[tile], phi)
        return residual.numpy()

    # -- Gram matrices ------------------------------------------------------------------

    def gram(self, A, B=None, *, a_train=False, b_train=False, output="trace"):
        """Exact path kernel between the rows of ``A`` and ``B``.

        Every entry is computed (no symmetry is assumed), so symmetry of the result
        is a real check.

        Parameters
        ----------
        A : torch.Tensor of shape (nA, ...)
        B : torch.Tensor of shape (nB, ...) or None
            ``None`` means ``B = A`` with ``b_train = a_train``.
        a_train, b_train : bool or array of bool
            Per row: True puts the row on the training copy (gradient at the start
            of each step), False on the test copy (gradient integrated along it).
        output : {"trace", "full"}
            ``"trace"`` gives (nA, nB); ``"full"`` keeps every output pair,
            (nA, nB, K, K).

        Returns
        -------
        ndarray
        """
        if output not in ("trace", "full"):
            raise ValueError(f"output must be 'trace' or 'full', got {output!r}.")
        a_mask = _as_mask(a_train, A.shape[0])
        if B is None:
            B, b_mask = A, a_mask
        else:
            b_mask = _as_mask(b_train, B.shape[0])
        extra = (self.n_outputs,) * 2 if output == "full" else ()
        gram = torch.zeros((A.shape[0], B.shape[0]) + extra, dtype=A.dtype)
        for step in self._steps():
            for ta in self._tiles(A.shape[0]):
                side_a = self._features(step, A[ta], a_mask[ta])
                for tb in self._tiles(B.shape[0]):
                    side_b = self._features(step, B[tb], b_mask[tb])
                    gram[ta, tb] += self._gram_step(step, side_a, side_b, output)
        return gram.numpy()

    def _features(self, step, X, train_mask):
        """One tile's features of a step: training rows ``g(x; w_s)``, test rows ``phi_s(x)``."""
        train, test = (torch.as_tensor(np.flatnonzero(m)) for m in (train_mask, ~train_mask))
        return Bunch(
            X=X,
            train=train,
            test=test,
            jac=self._jac(self.path.weights[step], X[train]),
            phi=self._test_feature(step, X[test]),
        )

    def _gram_step(self, step, a, b, output):
        """One step's kernel ``<., P_s .>`` between two tiles, each row on its own copy."""
        extra = (self.n_outputs,) * 2 if output == "full" else ()
        block = torch.zeros((a.X.shape[0], b.X.shape[0]) + extra, dtype=a.X.dtype)
        scale = self._preconditioner(step, a.X.dtype)
        block[a.train[:, None], b.train] = _contract(a.jac * scale, b.jac, output)
        block[a.test[:, None], b.train] = _contract(a.phi * scale, b.jac, output)
        block[a.train[:, None], b.test] = _contract(a.jac * scale, b.phi, output)
        if a.test.numel() and b.test.numel():
            # Test x test integrates the product, both sides at the same t.
            for nodes in self._node_chunks(a.test.numel() + b.test.numel()):
                node_a = self._jac_at_nodes(step, a.X[a.test], nodes)
                node_b = self._jac_at_nodes(step, b.X[b.test], nodes)
                block[a.test[:, None], b.test] += _contract_at_nodes(
                    self._nu(nodes, a.X.dtype), node_a * scale, node_b, output
                )
        return block

    def diag(self, A, *, a_train=False):
        """The diagonal of ``gram(A, a_train=a_train)``, computed row by row.

        Parameters
        ----------
        A : torch.Tensor of shape (nA, ...)
        a_train : bool or array of bool

        Returns
        -------
        ndarray of shape (nA,)
        """
        mask = _as_mask(a_train, A.shape[0])
        diag = torch.zeros(A.shape[0], dtype=A.dtype)
        for step in self._steps():
            for tile in self._tiles(A.shape[0]):
                rows = np.arange(A.shape[0])[tile]
                train = torch.as_tensor(rows[mask[tile]])
                test = torch.as_tensor(rows[~mask[tile]])
                scale = self._preconditioner(step, A.dtype)
                jac = self._jac(self.path.weights[step], A[train])
                diag[train] += (jac.square() * scale).sum((1, 2))
                for nodes in self._node_chunks(test.numel()):
                    jac = self._jac_at_nodes(step, A[test], nodes)
                    diag[test] += torch.einsum(
                        "q,qnkw,w->n", self._nu(nodes, A.dtype), jac.square(), scale
                    )
        return diag.numpy()
