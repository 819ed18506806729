"""The layer rule protocol: what the engine needs of one parameterised layer.

A rule turns what the probe captured of its layer in one forward and one
backward pass (the layer's inputs ``a`` and the back-propagated cotangents
``delta_k = d f_k / d(layer output)``, one per kept output ``k``) into a
*factor object*, and computes inner products of per-example gradients from two
factor objects without forming the gradients where it can. Every rule is
registered for its module type next to its class
(:func:`~sklearn_pathkernel._engine.rules._registry.register_rule`).
"""

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .._modes import OutputMode
from ._contract import contract


class RowEvaluation(enum.Enum):
    """How the probe evaluates a layer with every row at its own point ``t_i`` of a step.

    A batch of quadrature nodes or kink-search points holds rows at different
    points ``w + t_i dw`` of the step; evaluating them in one pass needs every
    layer to support per-row weights, in one of these ways:

    ``MOVED_OUTPUT``
        The layer is linear in its weights: its output at ``w + t dw`` is its
        output at ``w`` plus ``t`` times its "moved" output, the layer applied
        with ``dw`` (:meth:`LinearInWeights.moved_output`). Cost: one more
        application of the layer.
    ``OUTPUT_AT``
        The rule computes the layer's output at per-row weights itself
        (:meth:`PerRowWeights.output_at`), in place of the layer's forward, and
        its factors refer to the step's start, its direction and the rows' ``t``.
    ``NONE``
        No per-row form: the probe evaluates one scalar ``t`` per pass (one
        forward and backward pass per distinct ``t``).
    """

    MOVED_OUTPUT = "moved_output"
    OUTPUT_AT = "output_at"
    NONE = "none"


@dataclass(frozen=True)
class RowWeights:
    """Where the rows of a batch sit on the weight path: row ``i`` at ``params + t_i steps``.

    Parameters
    ----------
    params : dict of str to torch.Tensor
        Weights by path name (at the step's start when ``t`` is given).
    steps : dict of str to torch.Tensor or None, default=None
        The step's direction by path name; None when every row is at ``params``.
    t : torch.Tensor of shape (n,) or None, default=None
        Each row's point along the step; None when every row is at ``params``.
    """

    params: dict
    steps: dict | None = None
    t: torch.Tensor | None = None

    @property
    def moving(self):
        """Whether the rows sit at their own points of a step (``steps`` and ``t`` given)."""
        return self.steps is not None and self.t is not None

    def rows(self, index):
        """The same weights for a subset of the rows."""
        return self if self.t is None else RowWeights(self.params, self.steps, self.t[index])


@dataclass(frozen=True)
class PooledCotangent:
    """The cotangents of a max-pool's (or min-pool's) input: zero but at each
    window's winner.

    A pool's backward pass puts each window's cotangent at the window's saved
    winner and zeros everywhere else; this keeps the winners' values and
    positions instead of the full-resolution tensor (a 2x2 pool: a quarter of
    the numbers, no zero fill). The folded backward pass
    (``_engine/_folded_backward.py``) gives it to the rules that take it
    (:attr:`LayerRule.takes_pooled_cotangents`); :meth:`dense` is the tensor
    the pool's backward pass forms.

    Parameters
    ----------
    values : torch.Tensor of shape (n, K, C, *pooled)
        Per row, cotangent ``k``, channel and window: the cotangent at the
        window's winner.
    indices : torch.Tensor of shape (n, C, *pooled)
        Each window's winner, a flat index into the input's ``spatial``
        positions (the pool's saved indices, as ``max_pool2d_with_indices``
        returns them); the same for every cotangent.
    spatial : tuple of int
        The input's spatial shape (``(H, W)`` for a 2-d pool).
    """

    values: torch.Tensor
    indices: torch.Tensor
    spatial: tuple

    @property
    def shape(self):
        """The shape of :meth:`dense`: ``(n, K, C, *spatial)``."""
        return torch.Size((*self.values.shape[:3], *self.spatial))

    def with_values(self, values):
        """The same winners with other values (``values`` (n, K', C, *pooled))."""
        return PooledCotangent(values, self.indices, self.spatial)

    def rows(self, index):
        """A subset of the rows."""
        return PooledCotangent(self.values[index], self.indices[index], self.spatial)

    def flat(self):
        """``values`` (n, K, C, P) and ``indices`` (n, C, P), the windows flat."""
        return self.values.flatten(3), self.indices.flatten(2)

    def dense(self):
        """The full-resolution cotangents (n, K, C, *spatial): zeros, each value
        added at its winner (overlapping windows add), laid out output first (a
        view of a (K, n, ...) tensor, as the probe's other cotangents): the
        tensor of the pool's own backward pass."""
        values, indices = self.flat()
        n, n_outputs, channels = values.shape[:3]
        size = 1
        for extent in self.spatial:
            size *= int(extent)
        out = values.new_zeros((n_outputs, n, channels, size))
        out.scatter_add_(3, indices.expand(n_outputs, *indices.shape), values.transpose(0, 1))
        return out.view(n_outputs, n, channels, *self.spatial).transpose(0, 1)


class LayerRule(ABC):
    """What the engine needs of one parameterised layer (the rule protocol).

    A rule knows its layer's parameters in the weight path (``path_names``) and
    turns the layer's captured input and back-propagated gradient into
    *factors* (:meth:`factors`), from which it computes inner products of
    per-example gradients without forming them. Every rule can also form them
    (:meth:`materialise`), in its own layout of the layer's weights
    (:meth:`flatten` gives any weight-space vector, e.g. a preconditioner, in
    that layout): elementwise weightings of the gradients (Adam's
    preconditioner) work on that form.

    Factor objects have ``take(rows)`` (a subset of the rows), a static
    ``cat(parts)`` (rows stacked) and ``nbytes``.

    New layer types get a rule by subclassing this (or :class:`LinearInWeights`,
    :class:`PerRowWeights`) and registering it for their module type with
    :func:`~sklearn_pathkernel._engine.rules._registry.register_rule`.
    """

    path_names: list
    #: How a row is evaluated at its own ``t`` (see :class:`RowEvaluation`). The
    #: default is the one that is always correct.
    row_evaluation: RowEvaluation = RowEvaluation.NONE
    #: Whether :meth:`integrate` of materialised factors (a ``Gradients``) is each
    #: row's weighted sum of its nodes' gradients, ``sum_e w_e g_e``: then the
    #: sums are taken chunk by chunk of nodes (``Gradients.add_row_sums``), not
    #: over a copy of every node's factors joined first. False (the default):
    #: the nodes are joined and :meth:`integrate` decides.
    integrates_gradients: bool = False
    #: Whether the probe evaluates the layer with every row at the same weights
    #: by :meth:`own_output` in place of its forward: the layer's own values, with
    #: a backward pass of the rule's (cheaper where the layer's is not batched
    #: over cotangents). False (the default): the layer's forward.
    replaces_own_forward: bool = False
    #: Whether :meth:`factors` takes a :class:`PooledCotangent` as ``delta`` (the
    #: layer's output feeds a max-pool or min-pool directly: its cotangents are
    #: zero but at the windows' winners). False (the default): ``delta`` is
    #: always a tensor.
    takes_pooled_cotangents: bool = False

    @classmethod
    def for_module(cls, module, names):
        """This rule for ``module``, or None when the module's configuration has no
        rule of this kind (the registry then falls back to the generic rule).

        ``names`` maps the module's local parameter names that are in the path to
        their path names."""
        return None

    @abstractmethod
    def factors(self, inputs, delta, weights):
        """The factors of a batch of rows.

        Parameters
        ----------
        inputs : tuple of torch.Tensor
            The layer's positional tensor inputs, rows first.
        delta : torch.Tensor of shape (n, K, ...)
            Per row and kept output ``k``, the cotangent of the layer's output
            (``d f_k / d(layer output)``); a :class:`PooledCotangent` for rules
            with :attr:`takes_pooled_cotangents`.
        weights : RowWeights
            The weights the rows sit at (the layer's own parameters among them).
        """

    @abstractmethod
    def inner(self, left, right, mode):
        """Inner products of the per-example gradients of two factor batches.

        ``mode`` (:class:`~sklearn_pathkernel._engine._modes.OutputMode`): TRACE
        (n, m), PAIRS (n, m, K, K') or DIAG (n,).
        """

    def add_inner(self, left, right, mode, out):
        """``out += inner(left, right, mode)``, and ``out`` returned.

        An accumulator, as torch's ``out=``: the engine adds the products of
        every layer and step into one Gram block in place (on a GPU, where the
        passes over the (n, m) temporaries bound the training Gram). Rules that
        can add their product with fewer such passes override this.
        """
        out += self.inner(left, right, mode)
        return out

    def node_inner(self, nodes, weights, right, mode):
        """``weights[e] * inner(node e, right row)``: the weighted inner products of
        quadrature nodes with other rows, ``mode`` TRACE or PAIRS (see
        :meth:`inner`). Rules whose products end in an elementwise pass fold the
        weights into it."""
        values = self.inner(nodes, right, mode)
        return values * weights.view(-1, *([1] * (values.ndim - 1)))

    def dense_inner(self, dense, factors, mode):
        """Inner products of weight-space vectors with the per-example gradients of
        ``factors``: ``dense`` (n, K, W_layer), in the layout of
        :meth:`materialise` (e.g. Adam's preconditioned features), ``mode`` TRACE
        or PAIRS. Cost ``O(n m K K' W)`` (and the m K' W gradients formed); rules
        that can do it without forming the gradients override this."""
        return contract(dense, self.materialise(factors), mode)

    def metric_inner(self, left, right, scale, mode):
        """Inner products under an elementwise metric of weight space,
        ``<g(left row), scale * g(right row)>``; ``scale`` (W_layer,) is in the
        layout of :meth:`flatten` (Adam's preconditioner ``P_s``, positive), and
        ``mode`` as in :meth:`inner`.

        The metric breaks the factored form of :meth:`inner`: by default the left
        gradients are materialised and scaled, and meet the right ones through
        :meth:`dense_inner`, ``O(n m K W)``. Rules whose gradients factor per
        output unit override this with a contraction per unit.
        """
        if mode == OutputMode.DIAG:
            return contract(self.materialise(left) * scale, self.materialise(right), mode)
        return self.dense_inner(self.materialise(left) * scale, right, mode)

    def output_subspace(self, factors, n_left):
        """For trace products: an
        :class:`~sklearn_pathkernel._engine._output_subspace.OutputSubspace` that the
        per-unit output vectors of these rows' gradients lie in, or None (the
        default: no reduction). ``n_left``: rows on the other side of the
        products, to weigh the cost of finding it."""
        return None

    def project_outputs(self, factors, subspace):
        """``factors`` with their outputs projected onto ``subspace`` (one this
        rule's :meth:`output_subspace` returned): their trace products with the
        rows the subspace was found for are those of the unprojected factors.
        Rules that return a subspace implement this."""
        raise NotImplementedError(f"{type(self).__name__} has no output subspaces.")

    @abstractmethod
    def directional(self, factors, direction):
        """``<g_k(x), direction>`` per row and output, (n, K); ``direction`` is a
        ``{path name: tensor}`` weight change."""

    @abstractmethod
    def materialise(self, factors):
        """The per-example gradients themselves, (n, K, W_layer), in this rule's layout."""

    def materialise_sums(self, rows, weights, factors, n_rows):
        """Each row's weighted sum of its nodes' per-example gradients,
        (n_rows, K, W_layer): node ``e`` belongs to row ``rows[e]`` with weight
        ``weights[e]``. By default the node gradients are materialised first
        (E x K x W numbers); rules that can sum their factors directly override it."""
        grads = self.materialise(factors)
        scaled = weights.view(-1, *([1] * (grads.ndim - 1))) * grads
        return grads.new_zeros((n_rows, *grads.shape[1:])).index_add_(0, rows, scaled)

    def flatten(self, weights):
        """The layer's part of a ``{path name: tensor}`` weight-space vector, (W_layer,),
        in the layout of :meth:`materialise`: by default its path parameters,
        flattened and concatenated in ``path_names`` order."""
        return torch.cat([weights[name].reshape(-1) for name in self.path_names])

    def outer_factors(self, factors):
        """``factors`` as a ``FactoredGradients`` ``(a, delta)`` when the gradients
        they hold are ``delta [a, 1]^T`` with one input ``a`` per row (a layer
        linear in its weights on 2-D input), else None (the default).

        In that form, sums of a row's gradients that share its input ``a`` with
        one number per term (momentum's accumulation over steps of a first
        layer's test features, see ``Decomposition``) are sums of the deltas
        alone, ``(a, sum_s c_s delta_s)``, and meet other rows through
        :meth:`inner` without forming the gradients."""
        return None

    def input_vjp(self, inputs, weights):
        """For rows at their own points of a step (``weights.moving``): a function
        from ``K`` cotangents of the layer's output at once, ``(K, n, *output)``, to
        those of its first input, ``(K, n, *input)``, row ``i`` at ``params + t_i
        steps``; or None (the default): the probe's backward pass then
        differentiates the layer's own operations (for a layer linear in its
        weights, its output at ``params`` and ``t_i`` times its moved output: two
        backward operations where one at the row's own weights would do). Used by
        the folded backward pass (``_folded_backward.LayerShortcut``)."""
        return None

    def own_output(self, inputs):
        """The layer's output with every row at the layer's own weights, its values
        bit for bit, differentiable with respect to ``inputs`` (not the weights),
        for rules with :attr:`replaces_own_forward`."""
        raise NotImplementedError(f"{type(self).__name__} keeps the layer's own forward.")

    def integrate(self, rows, weights, factors, n_rows, outputs_per_pair=1):
        """Factors of each row's weighted sum over its quadrature nodes, or None
        (keep one inner product per node). See ``StepFeatures``."""
        return None

    def integrate_chunks(self, chunks, n_rows, outputs_per_pair=1):
        """:meth:`integrate` of the nodes of several ``(rows, weights, factors)``
        chunks (one per pass), or None: the chunks are then joined into one and
        :meth:`integrate` decides. Rules whose node factors are large override it
        to sum chunk by chunk, without the joined copy."""
        return None


class LinearInWeights(LayerRule):
    """A rule for a layer linear in its weights (``RowEvaluation.MOVED_OUTPUT``)."""

    row_evaluation = RowEvaluation.MOVED_OUTPUT

    @abstractmethod
    def moved_output(self, inputs, steps):
        """The layer applied with the weight change ``steps`` (``{path name: tensor}``):
        its output at ``w + t dw`` is its output at ``w`` plus ``t`` times this."""

    def row_output(self, inputs, weights):
        """The layer's output with row ``i`` at its own weights ``params + t_i
        steps`` (``weights.moving``) in one operation, differentiable with respect
        to ``inputs``, rows with ``t_i = 0`` at the layer's own values bit for bit;
        or None (the default): the probe takes the layer's output at ``params``
        plus ``t_i`` times its :meth:`moved_output` (two applications of the layer
        where one at the rows' own weights would do). The values agree to
        rounding; the rows at ``t = 0`` must be the layer's own, or a max-pool after
        it could pick another winner than training did."""
        return None


class PerRowWeights(LayerRule):
    """A rule that evaluates its layer at per-row weights (``RowEvaluation.OUTPUT_AT``)."""

    row_evaluation = RowEvaluation.OUTPUT_AT

    @abstractmethod
    def output_at(self, inputs, weights):
        """The layer's output with row ``i`` at its own weights (a :class:`RowWeights`),
        in place of the layer's forward; differentiable with respect to the inputs."""
