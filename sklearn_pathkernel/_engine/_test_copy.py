"""The test copy of one step: ``phi_s(x)`` of query rows, integrated and certified.

``phi_s(x) = int_0^1 g(x; w_s(t)) dt`` by the engine's quadrature rule
(:mod:`.integration._quadrature`): the rule gives each row its nodes, the probe
evaluates their factors in passes (:meth:`TestCopy.evaluate`), and
:class:`~._features.StepFeatures` holds them; the certificate
(:mod:`.integration._certificate`) measures each row's integration error and,
for an adaptive rule, integrates the failing rows again.

Cost, per step: one forward and backward pass per ``pass_rows`` nodes (a row has
``n_nodes`` per smooth piece for the exact rule, ``T`` for a fixed one), the kink
search's forward passes (exact rule), and the certificate (two forward passes,
free after the kink search). With :class:`~.integration._link_weights.JacobianWeights`
each node back-propagates ``K`` cotangent rows at the logits instead of every
output of ``f``, and the nodes' logits at ``D + 1`` points per piece cost one
forward pass more.
"""

import copy
from typing import NamedTuple

import numpy as np
import torch

from ._features import MaterialisedFeatures, NodeChunk, StepFeatures
from ._planning import NODE_GROUP_BYTES
from .integration._certificate import StepIntegral, without_rows
from .integration._link_weights import GaussWeights
from .integration._quadrature import Nodes

#: Steps at which :meth:`TestCopy.nodes_per_row` counts a sample's nodes.
SAMPLED_STEPS = 4
#: Query sets of at most this many rows are their own sample: the kink searches
#: :meth:`TestCopy.nodes_per_row` ran on them are kept for :meth:`TestCopy.integrate`.
SAMPLE_ROWS = 2


class IntegratedStep(NamedTuple):
    """``phi_s`` of some rows, with what came with it.

    Attributes
    ----------
    features : StepFeatures
    quadrature_error : ndarray of shape (n_rows,) or None
        Per row, the certificate's error (None when it was not asked for and
        the rule did not need it).
    start_factors : list or None
        The factors of the rows asked for with ``with_rows`` at the step's start
        (None without).
    """

    features: StepFeatures
    quadrature_error: object
    start_factors: object


def _matching_rows(sample, X):
    """Per row of ``X``, the index of an equal row of ``sample``; None when some
    row has none (or they live on different devices, or differ in shape)."""
    if sample.device != X.device or sample.shape[1:] != X.shape[1:]:
        return None
    picked = []
    for row in X:
        found = [j for j in range(sample.shape[0]) if torch.equal(sample[j], row)]
        if not found:
            return None
        picked.append(found[0])
    return picked


class TestCopy:
    """Integrates and certifies the test copy of a step.

    Parameters
    ----------
    fitted : FittedPath
        The path, its probes, steps, plans, quadrature rule, node counts (Gauss-Legendre
        nodes per smooth piece: ``fitted.nodes.per_piece``) and outputs.
    certificate : Certificate
    weighting : NodeWeighting or None, default=None
        How the nodes weight the backward pass
        (:mod:`.integration._link_weights`); None: their Gauss weights.
    """

    __test__ = False  # not a pytest class

    def __init__(self, fitted, certificate, weighting=None, target_weighting=None):
        self.probes, self.steps, self.planner = fitted.probes, fitted.steps, fitted.planner
        self.rule, self.certificate = fitted.rule, certificate
        self.n_nodes, self.n_outputs = fitted.nodes.per_piece, fitted.n_outputs
        self.weighting = GaussWeights(self.n_nodes) if weighting is None else weighting
        self.target_weighting = target_weighting
        self.targets = None
        # (step index, nodes per piece) -> (rows, RowNodes) of nodes_per_row's
        # searches on a whole query set; shared by this test copy's copies
        self._sampled = {}

    def for_targets(self, targets):
        """This test copy for a scalar target per row (a
        :class:`~._targets.QueryTargets` of the rows of the ``X`` it will be given):
        one term per node, :math:`\\int \\nabla_w T(f(x; w_s(t))) dt`, instead of ``K``;
        its certificate checks :math:`T`. The rows' factors have one output."""
        if self.target_weighting is None:
            raise ValueError("This test copy has no weighting for scalar targets.")
        other = copy.copy(self)
        other.weighting = self.target_weighting.bind(targets)
        other.n_nodes = other.weighting.nodes_per_piece
        other.n_outputs, other.targets = 1, targets
        other.certificate = self.certificate.for_targets(targets)
        return other

    def with_gauss_weights(self, n_nodes):
        """This test copy with ``n_nodes`` Gauss-Legendre nodes per piece and
        their scalar weights (what products of two gradients, node by node,
        need)."""
        if self.targets is not None:
            raise ValueError("Node-by-node products are for the K outputs, not a target.")
        other = copy.copy(self)
        other.n_nodes, other.weighting = n_nodes, GaussWeights(n_nodes)
        return other

    def nodes_per_row(self, X, n_nodes=None):
        """The most quadrature nodes a row of ``X`` takes, measured on a sample.

        The rule's nodes of ``X``'s first and last rows at ``SAMPLED_STEPS``
        steps spread over the path (the kink search only: forward passes of two
        rows). A row's factors at its nodes are what a step holds per query row
        (``nodes x`` :meth:`~._planning.Planner.factor_row_bytes`), and the
        exact rule's nodes follow the kinks: a few per step for an MLP, a
        hundred or more for a convolutional network with max-pooling.

        Parameters
        ----------
        X : torch.Tensor of shape (n, ...)
            Query rows, on the device.
        n_nodes : int or None, default=None
            Nodes per smooth piece (None: the engine's).

        Returns
        -------
        int
            At least the rule's nodes of one piece.
        """
        n_nodes = self.n_nodes if n_nodes is None else n_nodes
        sample = X[[0, X.shape[0] - 1]] if X.shape[0] > 1 else X
        n_steps = self.steps.path.n_steps
        if n_steps == 0 or X.shape[0] == 0:
            return n_nodes
        indices = np.unique(np.linspace(0, n_steps - 1, SAMPLED_STEPS).round().astype(int))
        most = n_nodes
        probe = self.probes.current()
        self._sampled.clear()
        for index in indices:
            row_nodes = self.rule.row_nodes(probe, self.steps.step(int(index)), sample, n_nodes)
            if X.shape[0] <= SAMPLE_ROWS:  # the sample is X: integrate takes these again
                self._sampled[(int(index), n_nodes)] = (sample, row_nodes)
            counts = np.bincount(row_nodes.nodes.rows, minlength=sample.shape[0])
            most = max(most, int(counts.max()))
        return most

    def _row_nodes(self, index, X, n_nodes):
        """The rule's nodes of the rows ``X`` on step ``index``: those
        :meth:`nodes_per_row` searched when it sampled these very rows there
        (a task may hold some of them), else the rule's own search."""
        kept = self._sampled.get((int(index), n_nodes))
        if kept is not None:
            sample, row_nodes = kept
            picked = _matching_rows(sample, X)
            if picked is not None:
                same = picked == list(range(sample.shape[0]))
                return row_nodes if same else row_nodes.of_rows(picked)
        return self.rule.row_nodes(self.probes.current(), self.steps.step(index), X, n_nodes)

    def features(self, chunks, n_rows, outputs_per_pair=1):
        """The :class:`StepFeatures` of evaluated node ``chunks`` of ``n_rows`` rows."""
        return StepFeatures(self.probes.current().rules, chunks, n_rows, outputs_per_pair)

    def evaluate(self, step, X, nodes):
        """Factors of every node, in passes: a list of :class:`NodeChunk`."""
        probe = self.probes.current()
        chunks = []
        for part, weights in self._parts(probe, step, X, nodes):
            rows, t = self.steps.on_device(part.rows), self.steps.on_device(part.t)
            factors = probe.factors(
                step.start,
                X,
                weights.outputs,
                direction=step.direction,
                t=t,
                cotangents=weights.cotangents,
                rows=rows,
            )
            chunks.append(NodeChunk(rows, self.steps.on_device(weights.weights), factors))
        return chunks

    def evaluate_with(self, step, X, nodes, X_start, outputs):
        """:meth:`evaluate`, and the factors of the rows ``X_start`` at the step's
        start (as ``probe.factors(start, X_start, outputs)``): the first
        ``pass_rows`` of them from the nodes' first pass when that costs less than
        passes of their own, the others in passes of the planner's rows.

        Returns
        -------
        chunks : list of NodeChunk
        start_factors : list
        """
        probe = self.probes.current()
        chunks, start_parts, joined = [], [], 0
        for part, weights in self._parts(probe, step, X, nodes):
            rows, t = self.steps.on_device(part.rows), self.steps.on_device(part.t)
            moved = {
                "direction": step.direction,
                "t": t,
                "cotangents": weights.cotangents,
                "rows": rows,
            }
            if not start_parts and self._share_pass(part.rows.size, X_start, outputs):
                # as many as a pass holds (they carry the nodes' cotangents)
                joined = min(X_start.shape[0], self._pass_rows())
            if not start_parts and joined:
                factors, first = probe.factors_with(
                    step.start,
                    X,
                    X_start[:joined],
                    None if outputs is None else outputs[:joined],
                    node_outputs=weights.outputs,
                    **moved,
                )
                start_parts.append(first)
            else:
                factors = probe.factors(step.start, X, weights.outputs, **moved)
            chunks.append(NodeChunk(rows, self.steps.on_device(weights.weights), factors))
        joined = joined if start_parts else 0
        one_output = outputs is not None  # (a class code or a cotangent per row)
        for rows in self.planner.passes(X_start.shape[0] - joined, one_output):
            rows = slice(joined + rows.start, joined + rows.stop)
            picked = None if outputs is None else outputs[rows]
            start_parts.append(probe.factors(step.start, X_start[rows], picked))
        if len(start_parts) == 1:
            return chunks, start_parts[0]
        return chunks, [type(layer[0]).cat(layer) for layer in zip(*start_parts, strict=True)]

    def _parts(self, probe, step, X, nodes):
        """The nodes in passes of the planner's size, each with its
        :class:`~.integration._link_weights.NodeWeights`."""
        size = self._pass_nodes()
        starts = range(0, nodes.rows.size, size)
        parts = (nodes.take(slice(begin, begin + size)) for begin in starts)
        return [(part, self.weighting.weigh(probe, step, X, part)) for part in parts]

    def _pass_nodes(self):
        """Nodes per pass: the planner's rows, in whole pieces."""
        per_piece = self.weighting.nodes_per_piece
        return max(per_piece, self._pass_rows() // per_piece * per_piece)  # whole pieces

    def _pass_rows(self):
        """The planner's rows per pass of nodes (a scalar target's nodes, and the
        rows joining them, hold one output)."""
        return self.planner.pass_rows(one_output=self.targets is not None)

    def group_nodes(self):
        """Nodes per group of :meth:`integrate` with ``materialised``: as many whole
        passes as ``NODE_GROUP_BYTES`` of factors hold, at least one."""
        per_pass = self._pass_nodes()
        node_bytes = self.planner.factor_row_bytes(one_output=self.targets is not None)
        return per_pass * max(1, NODE_GROUP_BYTES // (node_bytes * per_pass))

    @property
    def nodes_evaluator(self):
        """What evaluates nodes into :class:`NodeChunk` s (itself; see
        :class:`GroupedNodes`)."""
        return self

    def without_rows(self, chunks, rows):
        """The evaluated node ``chunks`` without the nodes of ``rows`` (positions,
        a tensor)."""
        return without_rows(chunks, rows)

    def _share_pass(self, n_nodes, X_start, outputs):
        """Whether rows at the step's start join the nodes' passes.

        A pass's fixed cost is that of many small rows; sharing it back-propagates
        every output for the joining rows too, so they join when they need every
        output, or when that extra work is at most the nodes' own backward pass.
        """
        if not self.probes.current().per_row_t:
            return False
        if self.targets is not None:  # one cotangent per row for all: free to join
            return outputs is not None
        extra = 0 if outputs is None else (self.n_outputs - 1) * X_start.shape[0]
        return extra <= self.n_outputs * n_nodes

    def integrate(
        self,
        index,
        X,
        *,
        n_nodes=None,
        outputs_per_pair=1,
        with_rows=None,
        measure_error=False,
        materialised=False,
    ):
        """The test-copy features ``phi_s`` of step ``index`` for every row of ``X``.

        Parameters
        ----------
        index : int
        X : torch.Tensor of shape (n, ...)
        n_nodes : int, default=None
            Nodes per smooth piece: None, the engine's nodes and weighting;
            a number, that many Gauss-Legendre nodes with their scalar weights
            (node by node products of two gradients need these).
        outputs_per_pair : int, default=1
            See :class:`StepFeatures`.
        with_rows : tuple (X_start, outputs) or None
            Also the factors of these rows at the step's start (see
            :meth:`evaluate_with`).
        measure_error : bool, default=False
            Measure the certificate even for a rule that does not refine.
        materialised : bool, default=False
            The caller needs the features materialised only (``materialised()``,
            ``directional``, ``add_inner``): when the step's nodes hold more than
            ``NODE_GROUP_BYTES`` of factors they are evaluated in groups of that
            size (:class:`GroupedNodes`), each group's features materialised and
            summed and its factors dropped (the features are then a
            :class:`~._features.MaterialisedFeatures`, the same sums to rounding).

        Returns
        -------
        IntegratedStep
            With an adaptive rule, rows above their tolerance (kinks that cancel
            between detection points) were integrated again.
        """
        if n_nodes is not None:
            return self.with_gauss_weights(n_nodes).integrate(
                index,
                X,
                outputs_per_pair=outputs_per_pair,
                with_rows=with_rows,
                measure_error=measure_error,
                materialised=materialised,
            )
        step = self.steps.step(index)
        n_nodes = self.n_nodes
        n_rows = X.shape[0]
        row_nodes = self._row_nodes(index, X, n_nodes)
        evaluator = self
        if materialised and row_nodes.nodes.rows.size > self.group_nodes():
            evaluator = GroupedNodes(self, outputs_per_pair)
        if with_rows is None:
            chunks, start_factors = evaluator.evaluate(step, X, row_nodes.nodes), None
        else:
            chunks, start_factors = evaluator.evaluate_with(step, X, row_nodes.nodes, *with_rows)
        features = evaluator.features(chunks, n_rows, outputs_per_pair)
        if not self.rule.adaptive:
            error = None
            if measure_error:
                error = self.certificate.check(step, X, features, row_nodes.ends).errors
            return IntegratedStep(features, error, start_factors)
        check = self.certificate.check(step, X, features, row_nodes.ends)
        integral = self.certificate.refine(
            step,
            X,
            self.rule,
            row_nodes,
            StepIntegral(chunks, features, check),
            n_nodes,
            outputs_per_pair,
            evaluator,
        )
        return IntegratedStep(integral.features, integral.check.errors, start_factors)


class GroupedNodes:
    """A test copy's nodes evaluated group by group, each group's features
    materialised and summed (``TestCopy.integrate(..., materialised=True)``).

    A group is :meth:`TestCopy.group_nodes` consecutive nodes: whole passes, the
    same passes as the nodes evaluated at once. Only one group's factors are held
    at a time (``NODE_GROUP_BYTES``), and (n_rows, K, W) numbers of sums; the
    evaluated "chunks" this gives the certificate are
    :class:`~._features.MaterialisedFeatures` of the rows, one per call of
    :meth:`evaluate`, which :meth:`without_rows` zeroes row by row.

    Cost: each group's features materialised (``n_rows K W`` numbers per group)
    on top of the nodes' own work.

    Parameters
    ----------
    test_copy : TestCopy
    outputs_per_pair : int
        See :class:`~._features.StepFeatures`.
    """

    def __init__(self, test_copy, outputs_per_pair):
        self.test_copy, self.outputs_per_pair = test_copy, outputs_per_pair
        self.size = test_copy.group_nodes()

    @property
    def nodes_evaluator(self):
        """The test copy (bisection sums its nodes per piece, not per row)."""
        return self.test_copy

    def _groups(self, nodes):
        return [nodes.take(slice(b, b + self.size)) for b in range(0, nodes.rows.size, self.size)]

    def _summed(self, chunks, n_rows):
        """The materialised features of one group's node ``chunks``."""
        features = self.test_copy.features(chunks, n_rows, self.outputs_per_pair)
        return MaterialisedFeatures.of(features)

    def evaluate(self, step, X, nodes):
        """The nodes' features, materialised and summed group by group: a list of
        one :class:`~._features.MaterialisedFeatures`."""
        total = None
        for group in self._groups(nodes):
            chunks = self.test_copy.evaluate(step, X, group)
            part = self._summed(chunks, X.shape[0])
            del chunks  # (the group's factors, before the next group's)
            total = part if total is None else total.add_(part)
        return [self.features([], X.shape[0]) if total is None else total]

    def evaluate_with(self, step, X, nodes, X_start, outputs):
        """:meth:`evaluate`, and the factors of the rows ``X_start`` at the step's
        start (from the first group's passes, as ``TestCopy.evaluate_with``)."""
        groups = self._groups(nodes)
        if not groups:
            return self.evaluate(step, X, nodes), self.test_copy.probes.current().factors(
                step.start, X_start, outputs
            )
        chunks, start_factors = self.test_copy.evaluate_with(step, X, groups[0], X_start, outputs)
        first = self._summed(chunks, X.shape[0])
        del chunks
        if len(groups) > 1:
            first.add_(self.evaluate(step, X, Nodes.cat(groups[1:]))[0])
        return [first], start_factors

    def features(self, chunks, n_rows, outputs_per_pair=None):
        """The sum of evaluated ``chunks`` (:class:`~._features.MaterialisedFeatures`),
        new tensors (the certificate keeps the chunks)."""
        return MaterialisedFeatures.total(chunks, self.test_copy.probes.current().rules, n_rows)

    def without_rows(self, chunks, rows):
        """``chunks`` with the rows ``rows`` (positions, a tensor) zeroed."""
        return [chunk.without_rows(rows) for chunk in chunks]
