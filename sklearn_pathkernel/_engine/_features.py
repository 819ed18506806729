"""The test copy of one step, ``phi_s(x)``, held as the layer rules' factors.

The quadrature gives row ``r``'s feature as a weighted sum over its nodes,
``phi_s(x_r) = sum_e weights_e g(x_r; w_s(t_e))``. Its inner product with a
training row is then one inner product per node. Where a layer's rule can sum
its factors over each row's nodes first (``rule.integrate``: a first layer, whose
input does not move along the step, or a small layer whose gradient is cheap to
materialise), the integral is taken once, before the inner products with every
training row, instead of after.

Cost, per step: for a layer integrated first, one set of factors per row; for
the others, one product per node with the other rows (``nodes x m`` per layer,
cut to the block budget), summed into the rows.
"""

from typing import NamedTuple

import torch

from ._modes import OutputMode
from ._output_subspace import in_output_subspace
from ._planning import rows_per_tile
from .rules._gradients import Gradients
from .rules._rows import row_sums


class NodeChunk(NamedTuple):
    """Quadrature nodes with their factors: node ``e`` belongs to row ``rows[e]``
    with weight ``weights[e]``; ``factors`` has one entry per rule (``rows`` and
    ``weights`` None: one integral per row)."""

    rows: torch.Tensor
    weights: torch.Tensor
    factors: object


class StepFeatures:
    """``phi_s`` of ``n_rows`` rows, layer by layer.

    Parameters
    ----------
    rules : list
        The network probe's layer rules.
    evaluated : list of NodeChunk
        The quadrature's nodes, in chunks; ``factors`` has one entry per rule.
    n_rows : int
    outputs_per_pair : int, default=1
        Values per pair of rows of the inner products these features are for
        (1 for a trace, K K' for every output pair): rules weigh the cost of
        materialising a layer's sums against it.

    Attributes
    ----------
    nodes : list of NodeChunk
        ``evaluated``, per node (for the same-``t`` products of the test x test kernel).
    layers : list of list of NodeChunk
        Per rule, its chunks (``factors`` that rule's); ``rows`` None when the
        factors hold one integral per row.
    """

    def __init__(self, rules, evaluated, n_rows, outputs_per_pair=1):
        self.rules, self.nodes, self.n_rows = rules, evaluated, n_rows
        self.layers = []
        for index, rule in enumerate(rules):
            chunks = [NodeChunk(rows, weights, f[index]) for rows, weights, f in evaluated]
            integral = joined = None
            if len(chunks) > 1:  # (summed chunk by chunk where the rule can)
                integral = rule.integrate_chunks(chunks, n_rows, outputs_per_pair)
                if integral is None:  # (materialised gradients: added chunk by chunk)
                    integral = _integrated_by_chunks(rule, chunks, n_rows)
            if integral is None:
                joined = _joined(chunks)
                integral = (
                    None if joined is None else rule.integrate(*joined, n_rows, outputs_per_pair)
                )
            if integral is not None:
                self.layers.append([NodeChunk(None, None, integral)])
            else:  # one chunk of every node: the products are cut to the budget later
                self.layers.append([] if joined is None else [joined])

    def add_inner(self, right, mode, out):
        """Accumulate ``<phi_s(row), g(right row)>`` per pair into ``out``; returns ``out``.

        An accumulator, as torch's ``out=`` (the Gram's hot loop sums every step
        into one block in place). ``right`` holds the factors of the other rows
        (one entry per rule); ``out`` has shape (n_rows, m) for
        ``OutputMode.TRACE``, (n_rows, m, K, K') for ``OutputMode.PAIRS``.
        Per-node products are weighted by the rules (``node_inner``) and summed
        into their rows; for ``PAIRS`` the sums are taken in the (n_rows, K, m,
        K') layout of the rules' matrix products, so that no node-sized array is
        copied to another layout.
        """
        by_output = None  # PAIRS: the node sums, (n_rows, K, m, K')
        for rule, chunks, right_factors in zip(self.rules, self.layers, right, strict=True):
            if mode is OutputMode.TRACE:
                chunks, right_factors = _in_output_subspace(
                    rule, chunks, right_factors, self.n_rows
                )
            for rows, weights, factors in _product_chunks(chunks, out):
                if rows is None:
                    out += rule.inner(factors, right_factors, mode)
                    continue
                values = rule.node_inner(factors, weights, right_factors, mode)
                if mode is not OutputMode.PAIRS:
                    out.index_add_(0, rows, values)
                    continue
                if by_output is None:
                    by_output = out.new_zeros(
                        (out.shape[0], out.shape[2], out.shape[1], out.shape[3])
                    )
                # (contiguous for a rule's matrix product: index_add_ is several
                # times faster from a contiguous source)
                by_output.index_add_(0, rows, values.transpose(1, 2).contiguous())
        if by_output is not None:
            out += by_output.transpose(1, 2)
        return out

    def materialised(self, keep=()):
        """``phi_s`` itself, per rule: (n_rows, K, W_layer) in the rule's layout.

        Needed where the features meet an elementwise weighting of weight space
        (Adam's preconditioner) or are accumulated over steps (momentum).
        Costs n_rows x K x W numbers. The layers whose indices are in ``keep``
        are not materialised: their entries are None.
        """
        return [
            None if index in keep else _materialised(rule, chunks, self.n_rows)
            for index, (rule, chunks) in enumerate(zip(self.rules, self.layers, strict=True))
        ]

    def row_factors(self, index):
        """Layer ``index``'s factors when they hold one integral per row (the
        layer was integrated before the products, see ``rule.integrate``), else
        None (the layer keeps its nodes)."""
        chunks = self.layers[index]
        if len(chunks) == 1 and chunks[0].rows is None:
            return chunks[0].factors
        return None

    def scaled(self, metric):
        """``P_s phi_s`` for the elementwise metric ``metric`` (one scale per rule,
        in the rules' ``flatten`` layout): see :class:`ScaledFeatures`."""
        return ScaledFeatures(self, metric)

    def directional(self, direction):
        """``<phi_s(row), direction>`` per row and output: (n_rows, K).

        ``direction`` holds one tensor per parameter name (a weight change).
        """
        total = 0.0
        for rule, chunks in zip(self.rules, self.layers, strict=True):
            for rows, weights, factors in chunks:
                slope = rule.directional(factors, direction)
                total = total + (
                    slope if rows is None else row_sums(rows, weights, slope, self.n_rows)
                )
        return total


class MaterialisedFeatures:
    """``phi_s`` of ``n_rows`` rows held materialised: per rule, (n_rows, K, W_layer).

    What a step's features are reduced to when its nodes are evaluated in groups
    (``TestCopy.integrate(..., materialised=True)``): each group's
    :class:`StepFeatures` is materialised and added here, and its node factors
    dropped, so that a step holds one group's factors at a time instead of every
    node's (a convolutional network with max-pooling: hundreds of nodes per row
    at a step, 1.3 MiB of factors each on MNIST). The sums are those of
    :meth:`StepFeatures.materialised` over all nodes, grouped differently
    (rounding).

    Offers what a caller of materialised features needs of :class:`StepFeatures`:
    :meth:`materialised`, :meth:`directional` (the certificate), :meth:`add_inner`
    (through ``rule.dense_inner``) and :meth:`row_factors` (None: no layer keeps
    factors of its own).

    Parameters
    ----------
    rules : list
        The network probe's layer rules.
    layers : list
        Per rule, (n_rows, K, W_layer), or ``0.0`` for a layer of no nodes.
    n_rows : int
    """

    def __init__(self, rules, layers, n_rows):
        self.rules, self.layers, self.n_rows = rules, list(layers), n_rows

    @classmethod
    def of(cls, features):
        """The materialised sums of a :class:`StepFeatures`."""
        return cls(features.rules, features.materialised(), features.n_rows)

    @classmethod
    def total(cls, parts, rules, n_rows):
        """The sum of ``parts`` (features of the same rows; none: every layer 0.0),
        new tensors (the parts are left as they are)."""
        layers = [0.0] * len(rules)
        for part in parts:
            layers = [
                b if isinstance(a, float) else (a if isinstance(b, float) else a + b)
                for a, b in zip(layers, part.layers, strict=True)
            ]
        return cls(rules, layers, n_rows)

    def add_(self, other):
        """``other``'s sums added into these, in place (tensors these own); returns self."""
        self.layers = [
            b if isinstance(a, float) else (a if isinstance(b, float) else a.add_(b))
            for a, b in zip(self.layers, other.layers, strict=True)
        ]
        return self

    def without_rows(self, rows):
        """These features with the rows ``rows`` (a tensor of positions) zeroed."""
        return MaterialisedFeatures(
            self.rules,
            [
                layer if isinstance(layer, float) else layer.index_fill(0, rows, 0.0)
                for layer in self.layers
            ],
            self.n_rows,
        )

    def materialised(self, keep=()):
        """Per rule, (n_rows, K, W_layer) (None for the indices in ``keep``)."""
        return [None if index in keep else layer for index, layer in enumerate(self.layers)]

    def row_factors(self, index):
        """None: the layers hold materialised sums, no factors (see
        :meth:`StepFeatures.row_factors`)."""
        return None

    def directional(self, direction):
        """``<phi_s(row), direction>`` per row and output: (n_rows, K)."""
        total = 0.0
        for rule, layer in zip(self.rules, self.layers, strict=True):
            if not isinstance(layer, float):
                total = total + layer @ rule.flatten(direction).to(layer.dtype)
        return total

    def add_inner(self, right, mode, out):
        """Add ``<phi_s(row), g(right row)>`` per pair to ``out`` and return it
        (``mode`` TRACE or PAIRS, shapes as in :meth:`StepFeatures.add_inner`)."""
        for rule, layer, right_factors in zip(self.rules, self.layers, right, strict=True):
            if not isinstance(layer, float):
                out += rule.dense_inner(layer, right_factors, mode)
        return out


class ScaledFeatures:
    """``P_s phi_s``: the test copy of one step under an elementwise metric.

    Adam's kernel weighs weight space by its preconditioner ``P_s``. A layer
    whose nodes were integrated into one set of factors per row keeps them, and
    its rule's ``metric_inner`` applies the metric (per output unit, for the
    rules that can). A layer that keeps its nodes is summed over them and scaled
    once (n_rows x K x W numbers), and meets the other rows through its rule's
    ``dense_inner``.

    Parameters
    ----------
    features : StepFeatures
    metric : list of torch.Tensor
        Per rule, the metric in the rule's ``flatten`` layout.
    """

    def __init__(self, features, metric):
        self.rules = features.rules
        self.layers = []  # per rule: (integrated factors, scale) or (dense, None)
        for rule, chunks, scale in zip(features.rules, features.layers, metric, strict=True):
            if len(chunks) == 1 and chunks[0].rows is None:
                self.layers.append((chunks[0].factors, scale))
            else:
                self.layers.append((_materialised(rule, chunks, features.n_rows) * scale, None))

    def add_inner(self, right, mode, out):
        """Add ``<P_s phi_s(row), g(right row)>`` per pair to ``out`` and return it
        (``mode`` and shapes as in :meth:`StepFeatures.add_inner`)."""
        for rule, (left, scale), right_factors in zip(self.rules, self.layers, right, strict=True):
            if scale is None:
                out += rule.dense_inner(left, right_factors, mode)
            else:
                out += rule.metric_inner(left, right_factors, scale, mode)
        return out


def _in_output_subspace(rule, chunks, right, n_rows):
    """A layer's chunks (of ``n_rows`` rows) and the other rows' factors, projected
    onto the other rows' output subspace (see ``in_output_subspace``)."""
    n_left = sum(n_rows if rows is None else rows.numel() for rows, _, _ in chunks)
    right, lefts = in_output_subspace(rule, right, [f for _, _, f in chunks], n_left)
    return [(rows, weights, f) for (rows, weights, _), f in zip(chunks, lefts, strict=True)], right


def _materialised(rule, chunks, n_rows):
    """A layer's features summed over each row's nodes: (n_rows, K, W_layer)."""
    total = None
    for rows, weights, factors in chunks:
        part = (
            rule.materialise(factors)
            if rows is None
            else rule.materialise_sums(rows, weights, factors, n_rows)
        )
        # (the first part as it is: ``0.0 + part`` copied it, a pass over n K W)
        total = part if total is None else total + part
    return 0.0 if total is None else total


def _product_chunks(chunks, out):
    """The node chunks cut so that one chunk's products with the other rows (and
    their temporaries) stay within the block budget."""
    node_bytes = 2 * 8 * out[0].numel()
    for rows, weights, factors in chunks:
        size = rows_per_tile(weights.numel() if rows is not None else 1, node_bytes)
        if rows is None or size >= rows.numel():
            yield NodeChunk(rows, weights, factors)
            continue
        for begin in range(0, rows.numel(), size):
            part = slice(begin, begin + size)
            yield NodeChunk(rows[part], weights[part], factors.take(part))


def _integrated_by_chunks(rule, chunks, n_rows):
    """Each row's integral of a layer whose rule sums materialised gradients
    (``rule.integrates_gradients``), chunk by chunk: a ``Gradients`` (n_rows, K,
    W_layer), or None (factored factors, or a single chunk: joined as before).

    Joining the chunks first would copy every node's factors of the layer while
    the chunks are held (for a convolutional network with max-pooling, hundreds of
    nodes per row at a step, each with its cotangents at every position).
    """
    chunks = [chunk for chunk in chunks if chunk.rows.numel()]
    if (
        len(chunks) < 2
        or not rule.integrates_gradients
        or not all(isinstance(chunk.factors, Gradients) for chunk in chunks)
    ):
        return None
    out = chunks[0].factors.zero_sums(n_rows)
    for rows, weights, factors in chunks:
        factors.add_row_sums(out, rows, weights)
    return Gradients(out)


def _joined(chunks):
    """The chunks as one ``(rows, weights, factors)``, or None without nodes."""
    chunks = [chunk for chunk in chunks if chunk.rows.numel()]
    if not chunks:
        return None
    if len(chunks) == 1:
        return chunks[0]
    rows = torch.cat([chunk.rows for chunk in chunks])
    weights = torch.cat([chunk.weights for chunk in chunks])
    factors = [chunk.factors for chunk in chunks]
    return NodeChunk(rows, weights, type(factors[0]).cat(factors))
