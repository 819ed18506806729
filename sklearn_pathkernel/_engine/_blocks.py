"""One task of a Gram matrix: a block of rows by rows over a chunk of steps.

Which copy each side is on makes a :class:`BlockKind` (training, mixed or test),
each with its cost; :class:`GramBlocks` computes one block of any kind,
step-major: a task computes each step's factors of its rows and of the other
side once and accumulates the step into its output block, which stays in memory
across layers and steps. The kernel of step ``s`` is
``sum_layers <g_left, P_s g_right>`` (``P_s`` Adam's preconditioner, else the
identity), from the layer rules' factors, never a materialised Jacobian.
"""

import enum

import torch

from ._modes import OutputMode
from ._output_subspace import in_output_subspace
from ._scheduling import SharedByTasks
from ._transfer import to_host


class BlockKind(enum.Enum):
    """Which copy of the path kernel each side of a Gram block is on.

    ``TRAINING``
        Both sides on the training copy, ``g(x; w_s)``. Cost per step: one
        forward and backward pass per row, one product of the two sides'
        factors per layer.
    ``MIXED``
        Left rows on the test copy, ``phi_s(x) = int_0^1 g(x; w_s(t)) dt``,
        right rows on the training copy. Cost per step: the left rows' nodes
        (about ``n_nodes + 1`` passes per row, with the kink search) and one
        product per node and layer, less where a rule integrates a layer first.
    ``TEST``
        Both sides on the test copy, integrated at the same ``t``
        (``sum_q nu_q <g(a; w_s(t_q)), g(b; w_s(t_q))>``, nodes shared by all
        rows, as many as a product of two gradients needs: ``NodeCounts.test_test``).
        Cost per step: the shared nodes' passes of both sides, one product per
        node and layer.
    """

    TRAINING = enum.auto()
    MIXED = enum.auto()
    TEST = enum.auto()

    def factor_rows(self, n_nodes):
        """Rows of factors a task holds per row of its left side, per step."""
        return 1 if self is BlockKind.TRAINING else n_nodes + 1

    def shared_factor_rows(self, n_other, tile_size):
        """Rows of factors a task holds for the other side, per step: all of it
        for a training block, one tile otherwise."""
        return n_other if self is BlockKind.TRAINING else tile_size

    @property
    def materialises_preconditioned(self):
        """Whether the left side's features are materialised under Adam's metric."""
        return self is BlockKind.MIXED

    @classmethod
    def covering(cls, a_mask, b_mask):
        """The one kind that holds every pair of a Gram's rows, or None.

        ``a_mask``, ``b_mask``: per row of each side, whether it is on the
        training copy. Every row on the training copy: ``TRAINING``; the left
        rows on the test copy and the right ones on the training copy:
        ``MIXED``; every row on the test copy: ``TEST``. None for empty sides
        and for mixtures (the Gram is then assembled from several kinds).
        """
        if not (a_mask.size and b_mask.size):
            return None
        sides = (a_mask.all(), not a_mask.any(), b_mask.all(), not b_mask.any())
        return _COVERING.get(sides)


#: (left all training, left all test, right all training, right all test) -> kind
_COVERING = {
    (True, False, True, False): BlockKind.TRAINING,
    (False, True, True, False): BlockKind.MIXED,
    (False, True, False, True): BlockKind.TEST,
}


class GramBlocks(SharedByTasks):
    """The blocks of one engine's Gram matrices and diagonals.

    Parameters
    ----------
    fitted : FittedPath
        The path and what the engine reads of it.
    test_copy : TestCopy
    """

    def __init__(self, fitted, test_copy):
        self.probes, self.steps, self.planner = fitted.probes, fitted.steps, fitted.planner
        self.test_copy, self.rule = test_copy, fitted.rule
        self.nodes, self.n_outputs, self.path = fitted.nodes, fitted.n_outputs, fitted.path

    def inner(self, left, right, mode, metric):
        """``sum_layers <g_left, P g_right>`` of two factor lists (``metric`` None: P = 1).

        A preconditioner breaks the factored forms of ``inner``: each rule's
        ``metric_inner`` takes it.
        """
        rules = self.probes.current().rules
        if metric is None:
            pairs = zip(rules, left, right, strict=True)
            return sum(rule.inner(a, b, mode) for rule, a, b in pairs)
        return sum(
            rule.metric_inner(a, b, scale, mode)
            for rule, a, b, scale in zip(rules, left, right, metric, strict=True)
        )

    def add_inner(self, left, right, mode, metric, out):
        """``out += inner(left, right, mode, metric)``, and ``out`` returned.

        An accumulator, as torch's ``out=`` (the training Gram's hot loop sums
        every product into one block in place). Where the planner says so (on a
        GPU) and without a metric, each rule adds its products into ``out``
        itself (:meth:`LayerRule.add_inner`: fewer passes over the (rows, rows)
        temporaries); otherwise the layers' products are summed, then added.
        """
        if metric is not None or not self.planner.accumulates_in_place:
            out += self.inner(left, right, mode, metric)
            return out
        for rule, a, b in zip(self.probes.current().rules, left, right, strict=True):
            rule.add_inner(a, b, mode, out)
        return out

    def factors_of(self, start, X):
        """Training-copy factors of every row of ``X`` (every output) at ``start``,
        computed in passes of ``pass_rows()`` rows and joined per layer."""
        probe = self.probes.current()
        parts = [probe.factors(start, X[rows]) for rows in self.planner.passes(X.shape[0])]
        if len(parts) == 1:
            return parts[0]
        return [type(layer[0]).cat(layer) for layer in zip(*parts, strict=True)]

    def _zeros(self, P, Q, mode):
        shape = (P.shape[0], Q.shape[0]) + mode.output_shape(self.n_outputs)
        return torch.zeros(shape, dtype=P.dtype, device=P.device)

    def block(self, kind, P, Q, steps, mode, prefix=False, whole=False):
        """The block of ``P`` x ``Q`` over ``steps`` (a slice), as a numpy array.

        ``prefix``: ``P`` is ``Q``'s first rows (a tile of a symmetric Gram);
        ``whole``: they are all of them over every step (the whole symmetric
        Gram), which is then made exactly symmetric on the device.
        """
        if kind is BlockKind.TRAINING:
            return self._training_block(P, Q, steps, mode, prefix, whole)
        block = self._zeros(P, Q, mode)
        if kind is BlockKind.MIXED:
            q_tiles = self.planner.product_tiles(Q.shape[0])
        else:
            q_tiles = self.planner.tiles(Q.shape[0])
        for index in self.progress.over(range(steps.start, steps.stop)):
            start = self.steps.step(index).start
            metric = self.steps.metric(index, self.probes.current().rules)
            right = None
            # once per step, for all of Q; Q's first tile shares its passes
            if kind is BlockKind.MIXED:
                integrated = self.test_copy.integrate(
                    index,
                    P,
                    outputs_per_pair=mode.values_per_pair(self.n_outputs),
                    with_rows=(Q[q_tiles[0]], None),
                )
                features, right = integrated.features, integrated.start_factors
                if metric is not None:  # P_s phi_s, once for every tile of Q
                    features = features.scaled(metric)
            for tile in q_tiles:
                if kind is BlockKind.TEST:
                    block[:, tile] += self._test_test(index, P, Q[tile], mode, metric)
                    continue
                if right is None or tile is not q_tiles[0]:
                    right = self.factors_of(start, Q[tile])
                features.add_inner(right, mode, block[:, tile])
        return self._handed_back(block, mode, whole, self.planner.block_size())

    def _training_block(self, P, Q, steps, mode, prefix, whole):
        """Training x training block, step-major.

        Per step, the factors of ``Q`` (and of ``P``, unless it is ``Q``'s
        prefix) are computed once, in passes; the block is then accumulated in
        products of ``block_size`` x ``block_size`` rows. With ``prefix``,
        products below the diagonal are not computed but mirrored. On a
        preconditioned path products get fewer rows (``row_bytes``: both sides'
        gradients materialised): the rules' ``metric_inner`` either materialises
        both sides or holds (units, rows, rows) temporaries, which are fastest
        while they stay in cache.
        """
        block = self._zeros(P, Q, mode)
        preconditioned = self.path.update.preconditioners is not None
        row_bytes = 16 * self.n_outputs * self.path.n_weights if preconditioned else 0
        pairs = mode.values_per_pair(self.n_outputs)
        p_blocks = self.planner.sub_blocks(P.shape[0], row_bytes, pairs)
        q_blocks = self.planner.sub_blocks(Q.shape[0], row_bytes, pairs)
        products = [(a, b) for a in p_blocks for b in q_blocks if not prefix or b.start >= a.start]
        for index in self.progress.over(range(steps.start, steps.stop)):
            start = self.steps.weights(index)
            metric = self.steps.metric(index, self.probes.current().rules)
            right = self.factors_of(start, Q)
            left = None if prefix else self.factors_of(start, P)
            if mode is OutputMode.TRACE and metric is None:
                right, left = self._in_output_subspaces(right, left, P.shape[0])
            if prefix:
                left = [f.take(slice(0, P.shape[0])) for f in right]
            for a, b in products:
                self.add_inner(
                    [f.take(a) for f in left], [f.take(b) for f in right], mode, metric, block[a, b]
                )
        if prefix:  # the diagonal square's lower products, from the upper ones
            for a, b in ((a, b) for a in p_blocks for b in q_blocks if b.start < a.start):
                block[a, b] = mode.transpose(block[b, a])
        return self._handed_back(block, mode, whole, self.planner.block_size(pairs))

    @staticmethod
    def _handed_back(block, mode, whole, size):
        """A task's ``block`` as a numpy array (:func:`~._transfer.to_host`); the
        ``whole`` symmetric Gram made exactly symmetric first, on its device, in
        squares of ``size`` rows."""
        if whole:
            mode.symmetrize(block, size)
        return to_host(block)

    def _in_output_subspaces(self, right, left, n_left):
        """Factors of both sides projected, per rule, onto the right rows' output
        subspace where the rule finds one (``left`` None: the left rows are a
        prefix of the right ones). Trace products are unchanged, with fewer
        outputs: two per unit for the last two layers of a classifier."""
        lefts = [[] for _ in right] if left is None else [[f] for f in left]
        pairs = [
            in_output_subspace(rule, r, ls, n_left)
            for rule, r, ls in zip(self.probes.current().rules, right, lefts, strict=True)
        ]
        projected_right = [r for r, _ in pairs]
        return projected_right, None if left is None else [ls[0] for _, ls in pairs]

    def _test_test(self, index, A, B, mode, metric=None):
        """``sum_q nu_q <g(a; w_s(t_q)), P_s g(b; w_s(t_q))>``, nodes shared by all rows."""
        step = self.steps.step(index)
        probe = self.probes.current()
        t, nu = self.rule.shared_nodes(probe, step, torch.cat([A, B]), self.nodes.test_test)
        n_nodes = len(t)
        times = self.steps.on_device(t)

        def at_nodes(X):  # rows ordered node-major: entry q * n + i
            return probe.factors(
                step.start,
                X.repeat(n_nodes, *([1] * (X.ndim - 1))),
                direction=step.direction,
                t=times.repeat_interleave(X.shape[0]),
            )

        left, right = at_nodes(A), at_nodes(B)
        total = 0.0
        for q in range(n_nodes):
            rows_a = slice(q * A.shape[0], (q + 1) * A.shape[0])
            rows_b = slice(q * B.shape[0], (q + 1) * B.shape[0])
            node_left = [f.take(rows_a) for f in left]
            node_right = [f.take(rows_b) for f in right]
            if mode is OutputMode.TRACE and metric is None:  # both sides at the same weights
                node_right, node_left = self._in_output_subspaces(node_right, node_left, A.shape[0])
            total = total + nu[q] * self.inner(node_left, node_right, mode, metric)
        return total

    def diag_block(self, A, mask, steps):
        """The diagonal of ``A``'s Gram over ``steps``: rows where ``mask`` on the
        training copy, the others on the test copy (their own nodes, as many as
        the test x test Gram's)."""
        diag = torch.zeros(A.shape[0], dtype=A.dtype, device=A.device)
        train = self.steps.on_device(mask.nonzero()[0])
        test = self.steps.on_device((~mask).nonzero()[0])
        for index in self.progress.over(range(steps.start, steps.stop)):
            metric = self.steps.metric(index, self.probes.current().rules)
            if train.numel():
                factors = self.probes.current().factors(self.steps.weights(index), A[train])
                diag[train] += self.inner(factors, factors, OutputMode.DIAG, metric)
            if test.numel():
                part = torch.zeros(test.numel(), dtype=A.dtype, device=A.device)
                # Same rule as the test x test Gram: products of two gradients
                # need more nodes.
                features = self.test_copy.integrate(
                    index, A[test], n_nodes=self.nodes.test_test
                ).features
                for rows, weights, factors in features.nodes:
                    part.index_add_(
                        0, rows, weights * self.inner(factors, factors, OutputMode.DIAG, metric)
                    )
                diag[test] += part
        return diag.cpu().numpy()
