"""The backward accumulation over chunks of steps: a scan with a carry.

Momentum and Adam meet each step's training gradients with ``psi_r = gamma B_r +
zeta_r u_r``, ``B_r = alpha_r u_r + beta B_{r+1}`` (``u_r = P_r phi_r``, see
``UpdateRecord.backward``): a recurrence backward over the steps, so one pass from
the last step to the first. It is linear in the buffer, with a fixed factor
``beta`` (a number, or one per parameter group: elementwise) whatever the
preconditioner, which enters ``u_r`` only. For a chunk of steps ``[a, b)`` and
the buffer ``C = B_b`` that the later steps hand to it,

    B_r = B_r^0 + beta^(b - r) C,     psi_r = psi_r^0 + gamma beta^(b - r) C,

with ``B^0, psi^0`` the chunk's accumulation from no buffer. So the chunks run as a
two-pass scan (:class:`StepScan`):

1. every chunk, in parallel: its steps backward from no buffer (test copy,
   features, products with the batches: all of the single pass's work), handing
   back ``B_a^0``, its buffer at its first step (the first chunk has no one to
   hand it to);
2. the carries, last chunk to first, in the calling process:
   ``C_j = B^0_{b_j} + beta^(len of chunk j+1) C_{j+1}`` (``C`` of the last chunk
   is zero), a few multiply-adds per number of a buffer;
3. every chunk but the last, in parallel: the carry's part ``gamma beta^(b - r)
   C_j`` met with each step's batch (the batch's factors and the products again,
   no test copy), and its share of the coupled weight decay. The decoupled decay
   and the running statistics' shares are terms of ``phi_r``, not ``psi_r``: the
   first pass has them whole.

The sums are those of the single pass, added in another order: equal to rounding
(``tests/engine/test_step_scan.py``: 1e-12). This holds for every update the
engine decomposes by accumulation: SGD with momentum or Nesterov, Adam, AdamW,
coupled or decoupled weight decay, parameter groups. Under scalar mixing a
layer of fixed input keeps its deltas in the buffer (``FixedInputLayers``); the
chunks of a row tile must agree on those layers and their inputs, else the tile
runs again on the generic route.

Cost: pass 1 is the single pass's work, split; pass 3 repeats the products with
the batches (``2 n K W |B|`` flops per step) and the batches' factors for all
chunks but the last, without the test copy; each chunk boundary moves one buffer
(``n K W`` numbers, ``K d_out`` for a layer of fixed input) to the caller and one
back. On dask, the engine's parts (the path among them) go to every worker once for
both passes (``Scheduler.sharing``). Memory: the caller holds the buffers of
``chunks - 1`` boundaries per row tile.
"""

from functools import partial

import torch

from .._path import layout_by_rules, on_layers


class StepScan:
    """Runs a decomposition's backward accumulation over chunks of steps.

    Parameters
    ----------
    decomposition : Decomposition
        The tasks' owner: its ``_accumulated`` (pass 1) and ``_carried`` (pass 3).
    chunks : StepChunks
        The chunks of the path's steps.
    scheduler : Scheduler
        Runs the tasks of each pass (threads, or any joblib backend: dask).
    """

    def __init__(self, decomposition, chunks, scheduler):
        self.decomposition, self.chunks, self.scheduler = decomposition, chunks, scheduler

    def run(self, X, tiles, targets_of, n_outputs, desc):
        """``[(tile, DecompositionPart), ...]`` whose sums per tile are the
        decomposition of the rows ``X[tile]`` (``targets_of(tile)``: their
        :class:`~._targets.QueryTargets` or None)."""
        if len(self.chunks) <= 1:  # (one pass: nothing to share between passes)
            return self._passes(X, tiles, targets_of, n_outputs, desc)
        # On dask: the engine's parts shipped to the workers once, not once per pass.
        with self.scheduler.sharing(self.decomposition):
            return self._passes(X, tiles, targets_of, n_outputs, desc)

    def _passes(self, X, tiles, targets_of, n_outputs, desc):
        owner, chunks = self.decomposition, self.chunks.slices
        n_tiles, n_chunks = len(tiles), len(chunks)

        def first_pass(keys, fixed):
            tasks = [
                partial(
                    owner._accumulated, X[tiles[t]], targets_of(tiles[t]), chunks[j], fixed, j > 0
                )
                for t, j in keys
            ]
            units = sum(chunks[j].stop - chunks[j].start for _, j in keys)
            return dict(zip(keys, self.scheduler.run(tasks, units=units, desc=desc), strict=True))

        keys = [(t, j) for t in range(n_tiles) for j in range(n_chunks)]
        first = first_pass(keys, True)
        # Tiles whose chunks kept different layers as deltas: all their chunks, generic.
        redo = [
            t
            for t in range(n_tiles)
            if not _agree([first[t, j].fixed_inputs for j in range(n_chunks)])
        ]
        if redo:
            first.update(first_pass([(t, j) for t in redo for j in range(n_chunks)], False))
        parts = [(tiles[t], first[t, j].part) for t, j in keys]
        if n_chunks <= 1:
            return parts
        tasks, carried_tiles = [], []
        for t in range(n_tiles):
            carry = None
            for j in reversed(range(n_chunks - 1)):
                later = first[t, j + 1]
                carry = later.carry if carry is None else self._through(later, chunks[j + 1], carry)
                rows = tiles[t]
                n_rows = X[rows].shape[0]
                tasks.append(
                    partial(
                        owner._carried,
                        n_rows,
                        n_outputs,
                        chunks[j],
                        carry,
                        first[t, j].fixed_inputs,
                        X.dtype,
                    )
                )
                carried_tiles.append(rows)
        units = n_tiles * chunks[-1].start
        carried = self.scheduler.run(tasks, units=units, desc=f"{desc}: carries")
        return parts + list(zip(carried_tiles, carried, strict=True))

    def _through(self, later, steps, carry):
        """``B_a^0 + beta^(b - a) C``: the carry ``C`` handed through the chunk ``steps``
        ``= [a, b)`` whose first pass is ``later``."""
        update = self.decomposition.path.update
        probe = self.decomposition.probes.current()
        local = later.carry
        layout = layout_by_rules(probe.rules, probe.params, local[0].dtype, torch.device("cpu"))
        decays = on_layers(update.carry_decay(steps.stop - steps.start), layout, len(local))
        return [b + decay * c for b, decay, c in zip(local, decays, carry, strict=True)]


def _agree(fixed_inputs):
    """Whether every chunk kept the same layers as deltas, with the same inputs."""
    if not fixed_inputs:  # (a path of no steps)
        return True
    first = fixed_inputs[0]
    return all(
        other.keys() == first.keys() and all(torch.equal(other[k], first[k]) for k in first)
        for other in fixed_inputs[1:]
    )
