"""Gram matrices and diagonals of the path kernel, assembled from block tasks.

A Gram between rows ``A`` and ``B``, each row on the training or the test copy,
is four blocks, one per :class:`~._blocks.BlockKind` (the training-by-test block
is the transposed mixed one); each block is a sum of independent tasks over
(tile of rows, chunk of steps), run by the scheduler and summed here. A
symmetric request computes each tile's columns from its first row on and
mirrors them, and is made exactly symmetric. A request that one kind covers
(a training Gram, a cross Gram of test rows against training rows) is that
kind's block, handed back as it is: no assembly, and with one task, no copy
on the host.

Cost: that of the blocks (see :class:`~._blocks.BlockKind`), plus the output
(``nA nB`` numbers, ``K^2`` times that for ``output="full"``) on the host.
"""

from functools import partial

import numpy as np
import torch

from ._blocks import BlockKind
from ._planning import check_fits


def as_mask(flag, n):
    """``flag`` (a bool or an array of bools) as a writable boolean mask of ``n`` rows."""
    return np.broadcast_to(np.asarray(flag, dtype=bool), (n,)).copy()


def numpy_dtype(tensor):
    """The numpy dtype of ``tensor``'s values (float64 for a float64 engine)."""
    return torch.empty(0, dtype=tensor.dtype, device="cpu").numpy().dtype


class Gram:
    """Assembles Grams and diagonals from the tasks of :class:`~._blocks.GramBlocks`.

    Parameters
    ----------
    fitted : FittedPath
        The path and what the engine reads of it.
    blocks : GramBlocks
    """

    def __init__(self, fitted, blocks):
        self.blocks, self.planner, self.scheduler = blocks, fitted.planner, fitted.scheduler
        self.steps, self.nodes, self.n_outputs = fitted.steps, fitted.nodes, fitted.n_outputs

    def gram(self, A, B, a_train, b_train, mode):
        """The Gram of ``A`` and ``B`` (None: ``A`` with ``a_train``) in ``mode``
        (``OutputMode.TRACE`` or ``PAIRS``); see ``PathKernelEngine.gram``."""
        symmetric = B is None
        a_mask = as_mask(a_train, A.shape[0])
        B, b_mask = (A, a_mask) if symmetric else (B, as_mask(b_train, B.shape[0]))
        a_tr, a_te = np.flatnonzero(a_mask), np.flatnonzero(~a_mask)
        b_tr, b_te = np.flatnonzero(b_mask), np.flatnonzero(~b_mask)
        output_shape = mode.output_shape(self.n_outputs)
        check_fits(
            3 * 8 * A.shape[0] * B.shape[0] * int(np.prod(output_shape)),
            f"A {mode.public_output!r} Gram of shape {(A.shape[0], B.shape[0]) + output_shape}",
            "request fewer rows at a time, or output='trace' instead of 'full'.",
        )
        kind = BlockKind.covering(a_mask, b_mask)
        if kind is not None:  # made exactly symmetric by _kind
            return self._kind(kind, A, B, mode, symmetric)
        gram = np.zeros((A.shape[0], B.shape[0]) + output_shape, dtype=numpy_dtype(A))

        def rows(X, index):
            return X[self.steps.on_device(index)]

        if a_tr.size and b_tr.size:
            gram[np.ix_(a_tr, b_tr)] = self._kind(
                BlockKind.TRAINING, rows(A, a_tr), rows(B, b_tr), mode, symmetric
            )
        if a_te.size and b_tr.size:
            gram[np.ix_(a_te, b_tr)] = self._kind(
                BlockKind.MIXED, rows(A, a_te), rows(B, b_tr), mode
            )
        if a_tr.size and b_te.size:
            if symmetric:
                mixed = gram[np.ix_(b_te, a_tr)]
            else:
                mixed = self._kind(BlockKind.MIXED, rows(B, b_te), rows(A, a_tr), mode)
            gram[np.ix_(a_tr, b_te)] = mode.transpose(mixed)
        if a_te.size and b_te.size:
            gram[np.ix_(a_te, b_te)] = self._kind(
                BlockKind.TEST, rows(A, a_te), rows(B, b_te), mode, symmetric
            )
        if symmetric:  # exactly symmetric, not just up to rounding
            mode.symmetrize(gram)
        return gram

    def _kind(self, kind, P, Q, mode, symmetric=False):
        """One kind of block between rows ``P`` and ``Q``, as independent tasks.

        Tasks are (tile of ``P``, chunk of steps); a symmetric request computes
        only the columns from the tile's first row on and mirrors them, and is
        made exactly symmetric. Tiles of ``P`` are as large as the device's
        working budget allows (one tile for a host Gram of a few thousand rows,
        tens of thousands on a GPU). One task's block is the result.
        """
        pairs = mode.values_per_pair(self.n_outputs)
        if kind is BlockKind.TEST:
            tiles = self.planner.tiles(P.shape[0], 8 * Q.shape[0] * pairs)
        else:
            # Test-copy rows: the nodes they take, measured (kinks: many per step for a CNN).
            nodes = self.blocks.test_copy.nodes_per_row(P) if kind is BlockKind.MIXED else None
            tiles = self.planner.task_tiles(
                kind, P.shape[0], Q.shape[0], pairs, self.n_outputs, nodes_per_row=nodes
            )
        keys = [(tile, steps) for tile in tiles for steps in self.scheduler.step_chunks()]
        whole = symmetric and len(keys) == 1  # symmetrized by the task, on its device
        results = self.scheduler.run(
            [
                partial(
                    self.blocks.block,
                    kind,
                    P[tile],
                    Q[tile.start :] if symmetric else Q,
                    steps,
                    mode,
                    symmetric,
                    whole,
                )
                for tile, steps in keys
            ],
            units=len(tiles) * self.scheduler.n_steps,
            desc=f"{kind.name.lower()} Gram {P.shape[0]} x {Q.shape[0]}",
        )
        if len(results) == 1:
            return results[0]
        shape = (P.shape[0], Q.shape[0]) + mode.output_shape(self.n_outputs)
        out = np.zeros(shape, dtype=results[0].dtype)
        for (tile, _), block in zip(keys, results, strict=True):
            offset = tile.start if symmetric else 0
            out[tile, offset:] += block
            if symmetric:
                width = tile.stop - tile.start
                out[tile.stop :, tile] += mode.transpose(block[:, width:])
        return mode.symmetrize(out) if symmetric else out

    def diag(self, A, a_train):
        """``np.diag(gram(A, a_train=a_train))`` without the off-diagonal work."""
        mask = as_mask(a_train, A.shape[0])
        tiles = self.planner.query_tiles(A.shape[0], 0, self.nodes.test_test)
        keys = [(tile, steps) for tile in tiles for steps in self.scheduler.step_chunks()]
        results = self.scheduler.run(
            [partial(self.blocks.diag_block, A[tile], mask[tile], steps) for tile, steps in keys],
            units=len(tiles) * self.scheduler.n_steps,
            desc=f"Gram diagonal of {A.shape[0]} rows",
        )
        diag = np.zeros(A.shape[0], dtype=numpy_dtype(A))
        for (tile, _), block in zip(keys, results, strict=True):
            diag[tile] += block
        return diag
