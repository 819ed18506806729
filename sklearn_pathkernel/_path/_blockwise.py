"""Coefficients of the linear form with one value per parameter.

A ``torch.optim`` optimiser with several parameter groups applies each group's
momentum, betas, Nesterov flag and weight decay to its own parameters. In the
linear form of :mod:`._update_record` every such scalar coefficient (:math:`\\beta,
\\gamma, \\lambda_c, \\alpha_s, \\zeta_s, d_s`) then becomes a vector over the flat
weight vector that is constant on each parameter's slice (a *block*): the form
stays linear and elementwise, coordinate by coordinate,

.. math::

    g_s = G_s + \\lambda_c \\odot w_s, \\quad b_s = \\beta \\odot b_{s-1} + \\gamma
    \\odot g_s, \\quad w_{s+1} - w_s = -P_s \\odot (\\alpha_s \\odot b_s + \\zeta_s
    \\odot g_s) + d_s \\odot w_s,

and the backward accumulation :math:`\\psi_r = \\sum_{s \\ge r} c_{s,r} \\odot P_s
\\odot \\phi_s` holds with :math:`c_{s,r} = \\gamma \\alpha_s \\beta^{s-r} + [r = s]
\\zeta_s` taken elementwise.

:class:`Blockwise` is that vector, as one value per block. :func:`blockwise`
builds one and returns a plain number where every block has the same value (one
group, or groups that agree), so a run with one group is represented, and
computed, exactly as before. Arithmetic with numbers and other
:class:`Blockwise` stays blockwise; a product with a tensor whose last axis is
the flat weight vector (``W``) scales each block; :func:`on_layers` lays a
coefficient out as the engine's per-layer tensors.
"""

import numpy as np
import torch


class Blockwise:
    """A coefficient with one value per block (parameter) of the flat weight vector.

    Parameters
    ----------
    values : array-like of shape (n_blocks,)
        The value of each block, in the path's parameter order.
    numels : sequence of int
        The blocks' sizes (the parameters' numbers of weights).

    Notes
    -----
    Immutable. Expanding to a flat tensor costs ``W`` numbers at each call (not
    cached: a record holds one coefficient per step, and a cache per step would
    hold as many numbers as the weight path).
    """

    # numpy defers to the reflected operators (np.float64 * Blockwise).
    __array_ufunc__ = None

    def __init__(self, values, numels):
        self.values = np.array(values, dtype=float)
        self.values.setflags(write=False)
        self.numels = tuple(int(n) for n in numels)
        if self.values.shape != (len(self.numels),):
            raise ValueError(
                f"Blockwise needs one value per block: {self.values.shape} values "
                f"for {len(self.numels)} blocks."
            )

    def flat(self, dtype=torch.float64, device="cpu"):
        """The coefficient over the flat weight vector, (W,)."""
        return torch.repeat_interleave(
            torch.tensor(self.values.tolist(), dtype=dtype, device=device),
            torch.tensor(self.numels, device=device),
        )

    def times(self, tensor):
        """``tensor`` (last axis ``W``) scaled block by block."""
        return tensor * self.flat(tensor.dtype, tensor.device)

    def _combine(self, other, operation):
        if isinstance(other, Blockwise):
            if other.numels != self.numels:
                raise ValueError("Blockwise coefficients of different blocks.")
            return blockwise(operation(self.values, other.values), self.numels)
        if isinstance(other, int | float | np.floating | np.integer):
            return blockwise(operation(self.values, float(other)), self.numels)
        return NotImplemented

    def __mul__(self, other):
        if isinstance(other, torch.Tensor):
            return self.times(other)
        return self._combine(other, np.multiply)

    __rmul__ = __mul__

    def __add__(self, other):
        return self._combine(other, np.add)

    __radd__ = __add__

    def __sub__(self, other):
        return self._combine(other, np.subtract)

    def __rsub__(self, other):
        return self._combine(other, lambda a, b: b - a)

    def __neg__(self):
        return Blockwise(-self.values, self.numels)

    def __pow__(self, exponent):
        return blockwise(self.values**exponent, self.numels)

    def __bool__(self):
        return bool(np.any(self.values != 0))

    def __eq__(self, other):
        if isinstance(other, Blockwise):
            return self.numels == other.numels and np.array_equal(self.values, other.values)
        if isinstance(other, int | float | np.floating | np.integer):
            return bool(np.all(self.values == other))
        return NotImplemented

    def __hash__(self):
        return hash((tuple(self.values.tolist()), self.numels))

    def __repr__(self):
        return f"Blockwise({self.values.tolist()})"


def blockwise(values, numels):
    """A :class:`Blockwise` of ``values`` (one per block), or the plain number
    when every block has the same value."""
    # (a loop over the few blocks: cheaper than numpy's per-call cost, every step)
    if len(values) and all(value == values[0] for value in values):
        return float(values[0])
    return Blockwise(values, numels)


def per_step(values):
    """A per-step sequence of coefficients as an array: float64 when every step's
    value is a number (one group), else an object array of numbers and
    :class:`Blockwise` (indexing gives each step's coefficient)."""
    if all(not isinstance(v, Blockwise) for v in values):
        return np.asarray(values, dtype=float)
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def block_values(coefficient, n_blocks):
    """The coefficient's value per block, (n_blocks,) float64."""
    if isinstance(coefficient, Blockwise):
        return np.array(coefficient.values)
    return np.full(n_blocks, float(coefficient))


def on_layers(coefficient, layout, n_layers):
    """The coefficient for the engine's per-layer tensors: ``n_layers`` numbers
    for a number, else ``layout(coefficient)``: the coefficient expanded over the
    weights and cut into per-layer tensors in the rules' layout (see
    :func:`layout_by_rules`)."""
    if isinstance(coefficient, Blockwise):
        return layout(coefficient)
    return [coefficient] * n_layers


def weighted(coefficient, flat, unflatten):
    """``(factor, direction)`` with ``factor * <., direction>`` the inner product
    with ``coefficient * flat`` (a flat weight vector): a number times
    ``unflatten(flat)`` for a number, 1 and the blockwise-scaled vector for a
    :class:`Blockwise` (the engine's decay terms)."""
    if isinstance(coefficient, Blockwise):
        return 1.0, unflatten(coefficient.times(flat))
    return coefficient, unflatten(flat)


def layout_by_rules(rules, unflatten, dtype, device):
    """The ``layout`` of :func:`on_layers` for layer rules: a :class:`Blockwise`
    expanded over the flat weights (``dtype``, ``device``), cut into parameters
    by ``unflatten`` and laid out per rule by its ``flatten``."""

    def layout(coefficient):
        params = unflatten(coefficient.flat(dtype, device))
        return [rule.flatten(params) for rule in rules]

    return layout


def to_plain(coefficient):
    """A coefficient as JSON: the number, or its values per block (a list)."""
    if isinstance(coefficient, Blockwise):
        return coefficient.values.tolist()
    return float(coefficient)


def steps_to_plain(values, n_blocks):
    """A per-step array (:func:`per_step`) as float64: (n_steps,) when every step's
    value is a number, else (n_steps, n_blocks)."""
    if values.dtype != object:
        return np.asarray(values, dtype=float)
    return np.stack([block_values(value, n_blocks) for value in values])


def from_plain(value, numels):
    """The inverse of :func:`to_plain` and :func:`steps_to_plain`."""
    array = np.asarray(value, dtype=float)
    if array.ndim == 2:
        return per_step([blockwise(row, numels) for row in array])
    if isinstance(value, list):
        return blockwise(array, numels)
    return value
