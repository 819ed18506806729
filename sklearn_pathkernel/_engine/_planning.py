"""Memory planning: how many rows each task, pass and product holds.

Module functions check a request against the available memory (fail early,
naming the sizes and the way out, instead of swapping) and give the budgets;
:class:`Planner` turns them into the engine's tiles: tasks of query rows, tiles
of a Gram's rows, passes of the probe and sides of a product.

Cost: a one-row probe evaluation and a one-row forward pass, once (the bytes of
a row's factors and of its backward pass's cotangents); the rest is arithmetic
on sizes.
"""

import math

import torch
from sklearn.utils import gen_even_slices

from .._path import available_memory

#: What one block task may hold in its output; larger requests are tiled further.
BLOCK_BUDGET_BYTES = 256 * 2**20
#: The factors one forward and backward pass of the probe produces. A pass has a
#: fixed cost worth thousands of rows of a small network, but a batched backward
#: pass over many outputs slows down once its gradients leave the cache (for an
#: MLP 64-128-128-10 with 10 outputs, 24 KiB of factors a row, this is 512 rows).
PASS_BUDGET_BYTES = 12 * 2**20
#: What a probe pass's backward holds at the layers' outputs (their activations'
#: bytes times the cotangents each row carries: every output, or one for a scalar
#: target). Measured on one thread (every output of the training rows, best of 3):
#: 1000 digit rows of ``DistanceKernelClassifier(image_shape=(8, 8))`` (82 KB a
#: row) took 0.10 s in passes of 100 to 250 rows, 0.116 s in passes of 377 and
#: 0.16 s in one; 200 28x28 rows (1 MB a row) 0.28 s in passes of 10 to 50 rows,
#: 0.34 s in passes of 100 and 0.38 s in one.
PASS_COTANGENT_BYTES = 16 * 2**20
#: What one chunk of memories of a distance layer's factored dense products holds
#: on the host (``SquaredDistanceFamily.dense_inner``): the features' block (c, n,
#: K, D) and the dots (c, n, K, m), small enough to be contracted while in the
#: cache (the products' share of ``decompose`` 1.7x faster on the image cells of
#: ``benchmarks/bench_matrix.py --images`` than all memories at once).
DOTS_CHUNK_BYTES = 8 * 2**20
#: On a GPU, rows per side of a product at most. A symmetric Gram computes the
#: products on and above the diagonal only: products of a quarter of the rows or
#: less leave about 60 % of the pairs, where 14 000-row products (an eighth of an
#: H100's budget) computed 90 % at M = 16 000; 4096 x 4096 products still fill it.
GPU_BLOCK_ROWS = 4096
#: A query row's node factors as held at once during a step, in copies of the
#: factors themselves (the passes' temporaries and the products come on top):
#: on a CNN with max-pooling (2 conv layers, 11k weights, AdamW, M = 1000), one
#: query row raised the peak memory of a decomposition by 400 MiB, 3.3 times its
#: 178 nodes' factors (0.69 MiB each).
NODE_FACTOR_COPIES = 4
#: The node factors a step of ``decompose`` on an update that mixes steps (momentum,
#: Adam) holds at once: its test features are needed materialised only, so nodes
#: beyond this are evaluated in groups of this size, each group's features
#: materialised and summed (``TestCopy.integrate(..., materialised=True)``). One
#: MNIST row of a 12.8k-weight CNN with max-pooling held 406 nodes of 1.31 MiB at
#: once at its worst step.
NODE_GROUP_BYTES = 64 * 2**20
#: What one step-major Gram task may hold on the host (its output block and one
#: step's factors): at most this, and at most a quarter of the available memory.
HOST_WORKING_BYTES = 2**30


def dots_chunk_bytes(device):
    """What one chunk of a layer's factored products may hold on ``device``: a
    cache's worth on the host (``DOTS_CHUNK_BYTES``), ``BLOCK_BUDGET_BYTES`` on a GPU,
    where a few large products keep the device busy."""
    return BLOCK_BUDGET_BYTES if device.type == "cuda" else DOTS_CHUNK_BYTES


def check_fits(nbytes, request, remedy):
    """Raise a ``MemoryError`` naming ``request`` when ``nbytes`` will not fit."""
    available = available_memory()
    if nbytes > available:
        raise MemoryError(
            f"{request} needs about {nbytes / 2**30:.2f} GiB, but only "
            f"{available / 2**30:.2f} GiB of memory is available; {remedy}"
        )


def rows_per_tile(tile_size, row_bytes, budget=None):
    """Rows per tile: at most ``tile_size``, and few enough for ``budget`` bytes."""
    budget = BLOCK_BUDGET_BYTES if budget is None else budget
    return max(1, min(int(tile_size), int(budget // max(row_bytes, 1))))


def working_budget(device, n_workers=1):
    """Bytes one step-major Gram task may hold, out of ``n_workers`` running at once.

    On the host: ``HOST_WORKING_BYTES``, or a quarter of the available memory if
    that is less. On a GPU: half of its free memory, so that tiles grow with the
    device (one task holds a whole Gram of tens of thousands of rows).
    """
    if device.type == "cuda":
        import torch

        total = torch.cuda.mem_get_info(device)[0] // 2
    else:
        total = min(HOST_WORKING_BYTES, available_memory() // 4)
    return max(BLOCK_BUDGET_BYTES // 16, int(total // max(1, n_workers)))


def _even_tiles(n_rows, size):
    """``n_rows`` in even slices of at most ``size`` rows (none for no rows)."""
    return list(gen_even_slices(n_rows, max(1, -(-n_rows // size)))) if n_rows else []


def _consecutive(n_rows, size):
    """``n_rows`` in consecutive slices of ``size`` rows from row 0, the last shorter."""
    return [slice(begin, min(begin + size, n_rows)) for begin in range(0, n_rows, size)]


class Planner:
    """Tiles, passes and product sizes of one engine.

    Parameters
    ----------
    device : torch.device
    tile_size : int
        Rows per forward pass, per side of a product and per block of the test x
        test Gram on the host (a GPU takes more: see :meth:`block_size`).
    n_nodes : int
        Gauss-Legendre nodes per smooth piece of the exact quadrature.
    path : WeightPath
    scheduler : Scheduler
        Gives the number of workers that share the working budget.
    probes : ThreadProbes
    steps : PathSteps
    example : torch.Tensor
        One training row (the bytes of a row's factors).
    """

    def __init__(self, device, tile_size, n_nodes, path, scheduler, probes, steps, example):
        self.device, self.tile_size, self.n_nodes = device, tile_size, n_nodes
        self.path, self.scheduler = path, scheduler
        self.probes, self.steps, self.example = probes, steps, example
        self._row_bytes = {}  # {one output: bytes}
        self._cotangent_bytes = {}  # {one output: bytes}

    def working_budget(self):
        """Bytes one task may hold (see :func:`working_budget`)."""
        return working_budget(self.device, self.scheduler.n_workers())

    def factor_row_bytes(self, one_output=False):
        """Bytes of one row's training-copy factors (every output; with
        ``one_output``, those of one output, as a scalar target's nodes hold
        them), all layers."""
        if one_output not in self._row_bytes:
            outputs = None
            if one_output:
                outputs = torch.zeros(self.example.shape[0], dtype=torch.long, device=self.device)
            # The calling thread's probe: the first measurement of a scalar target's
            # rows runs in the tasks, on every joblib thread at once.
            probe = self.probes.current()
            factors = probe.factors(self.steps.weights(0), self.example, outputs)
            self._row_bytes[one_output] = max(8, sum(f.nbytes for f in factors))
        return self._row_bytes[one_output]

    def cotangent_row_bytes(self, one_output=False):
        """Bytes one row's backward pass holds at the layers' outputs (every
        output; with ``one_output``, one cotangent), measured once on the example
        row (:meth:`NetworkProbe.cotangent_row_bytes`)."""
        if one_output not in self._cotangent_bytes:
            probe = self.probes.current()
            held = probe.cotangent_row_bytes(self.steps.weights(0), self.example, one_output)
            self._cotangent_bytes[one_output] = held
        return self._cotangent_bytes[one_output]

    def tiles(self, n, row_bytes=0):
        """Row slices of at most ``tile_size`` rows, fewer when rows are large."""
        return _even_tiles(n, rows_per_tile(self.tile_size, row_bytes))

    def task_tiles(self, kind, n_rows, n_other, pairs, n_outputs, nodes_per_row=None):
        """Tiles of the rows of a training or mixed block, from the working budget.

        A task holds its output block (``pairs`` values per pair of rows), one
        step's factors of its rows (``kind.factor_rows``; for a mixed block,
        ``NODE_FACTOR_COPIES`` times those of ``nodes_per_row`` nodes when the
        caller measured them, see :meth:`query_row_bytes`) and of the other
        side's rows (``kind.shared_factor_rows``), and, for a mixed block on a
        preconditioned path, its rows' features materialised and scaled.
        """
        factor_bytes = self.factor_row_bytes()
        if nodes_per_row is None:
            per_row = 8 * n_other * pairs + factor_bytes * kind.factor_rows(self.n_nodes)
        else:
            per_row = self.query_row_bytes(8 * n_other * pairs, nodes_per_row)
        if kind.materialises_preconditioned and self.path.update.preconditioners is not None:
            per_row += 16 * n_outputs * self.path.n_weights  # P_s phi_s, materialised
        shared = factor_bytes * kind.shared_factor_rows(n_other, self.tile_size)
        size = max(1, (self.working_budget() - shared) // per_row)
        return _even_tiles(n_rows, size)

    def query_row_bytes(self, row_bytes, nodes_per_row):
        """Bytes one query row holds during a step: ``row_bytes`` of results and
        the factors of its quadrature nodes (``nodes_per_row`` and the kink
        search's row), ``NODE_FACTOR_COPIES`` times (the passes' own temporaries
        and the products with the training rows come on top of the factors)."""
        return row_bytes + NODE_FACTOR_COPIES * (nodes_per_row + 1) * self.factor_row_bytes()

    def query_tiles(self, n_rows, row_bytes, nodes_per_row, budget=None, max_rows=None):
        """Tiles of query rows, one per task of ``decompose`` or ``diag``: as many
        rows as the working budget (or ``budget`` bytes) holds at
        :meth:`query_row_bytes` each, at least one, and at most ``max_rows``."""
        budget = self.working_budget() if budget is None else budget
        per_row = self.query_row_bytes(row_bytes, nodes_per_row)
        size = max(1, budget // per_row)
        return _even_tiles(n_rows, size if max_rows is None else min(size, max_rows))

    def pass_rows(self, one_output=False):
        """Rows per forward and backward pass of the probe: as many as
        ``PASS_BUDGET_BYTES`` of factors (small networks get few, large passes;
        each pass has a fixed cost) and ``PASS_COTANGENT_BYTES`` held by the
        backward pass at the layers' outputs (:meth:`cotangent_row_bytes`: wide
        activations, as a convolution's, with every output), and on a GPU at
        least :meth:`block_size`. ``one_output``: rows whose factors and
        cotangents hold one output (a scalar target's nodes: 2.5 times as many
        rows for dattri's MNIST MLP, one pass per step instead of two or three
        for a tile of 167 queries)."""
        rows = min(
            PASS_BUDGET_BYTES // self.factor_row_bytes(one_output),
            PASS_COTANGENT_BYTES // max(1, self.cotangent_row_bytes(one_output)),
        )
        rows = max(1, rows)
        return max(rows, self.block_size()) if self.device.type == "cuda" else rows

    def passes(self, n_rows, one_output=False):
        """Consecutive slices of :meth:`pass_rows` rows."""
        return _consecutive(n_rows, self.pass_rows(one_output))

    def sub_blocks(self, n, row_bytes=0, pairs=1):
        """Consecutive slices of at most ``block_size(pairs)`` rows (fewer for large
        rows): the passes and the sides of one product, aligned from row 0 so that
        two sides of the same rows share their boundaries."""
        return _consecutive(n, rows_per_tile(self.block_size(pairs), row_bytes))

    def block_size(self, pairs=1):
        """Rows per pass and per side of a product.

        ``tile_size`` on the host (blocks whose Grams stay small next to the
        caches). On a GPU, as many rows as an eighth of the working budget holds
        in a product's three square temporaries (input Gram, delta Gram, their
        product; ``pairs`` values per pair of rows), so that each product keeps
        the device busy, and at most ``GPU_BLOCK_ROWS`` (so that a symmetric
        Gram skips most products below its diagonal).
        """
        if self.device.type != "cuda":
            return self.tile_size
        rows = math.isqrt(self.working_budget() // (8 * 3 * 8 * pairs))
        return max(self.tile_size, min(GPU_BLOCK_ROWS, rows))

    def product_tiles(self, n):
        """Tiles of the training rows of a mixed block, one product each.

        :meth:`tiles` on the host; on a GPU :meth:`sub_blocks`, as large as its
        products (a Python loop over ``tile_size`` tiles of 32 000 rows kept it
        waiting).
        """
        return self.sub_blocks(n) if self.device.type == "cuda" else self.tiles(n)

    @property
    def accumulates_in_place(self):
        """Whether the rules add each product into a Gram block themselves
        (``LayerRule.add_inner``): on a GPU, where the passes over the (rows,
        rows) temporaries, not the products, bound the training Gram. On the
        host the layers' products are summed first, then added (caches hide
        those passes)."""
        return self.device.type == "cuda"
