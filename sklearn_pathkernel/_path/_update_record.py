"""The per-step linear form of a recorded run's updates, and its accumulations.

Every supported optimiser is, once the run's own preconditioner is taken as given,

.. math::

    g_s &= G_s + \\lambda_c w_s, \\qquad b_s = \\beta b_{s-1} + \\gamma g_s
    \\quad (b_{-1} = 0), \\\\
    w_{s+1} - w_s &= -P_s \\odot (\\alpha_s b_s + \\zeta_s g_s) + d_s w_s,

with :math:`G_s` the gradient of step :math:`s`'s batch loss at :math:`w_s`,
:math:`\\lambda_c` coupled weight decay (an L2 term in the gradient), :math:`b_s` the
momentum buffer, :math:`P_s` an elementwise preconditioner (ones for SGD), and
:math:`d_s` decoupled weight decay. :class:`UpdateRecord` holds the coefficients of
a run (read from the optimiser by the training side, see
``sklearn_pathkernel._training``); :class:`BackwardAccumulation` and
:class:`ForwardAccumulation` sum the form over the steps for the engine.

With several parameter groups the coefficients are per parameter
(:class:`~._blockwise.Blockwise`) and the form holds elementwise.
"""

from dataclasses import dataclass

import numpy as np
import torch

from ._blockwise import Blockwise, on_layers


class Deferred:
    """A value computed when it is first read (see :class:`DeferredField`).

    Parameters
    ----------
    compute : callable
        Called once, without arguments, at the first read; returns the value.
    """

    def __init__(self, compute):
        self.compute = compute


class DeferredField:
    """A dataclass field that may be given as a :class:`Deferred`: the first read
    computes the value and keeps it (and releases the computation). Set values and
    reads of other values are as a plain field's."""

    def __set_name__(self, owner, name):
        self._key = "_" + name

    def __get__(self, instance, owner=None):
        if instance is None:
            return None  # (the dataclass's default)
        value = instance.__dict__.get(self._key)
        if isinstance(value, Deferred):
            value = instance.__dict__[self._key] = value.compute()
        return value

    def __set__(self, instance, value):
        instance.__dict__[self._key] = value


@dataclass
class UpdateRecord:
    """The linear form of a recorded run's updates (see the module docstring).

    Attributes
    ----------
    buffer_decay : float or Blockwise
        :math:`\\beta`, the momentum buffer's decay (0 without a buffer).
    gradient_scale : float or Blockwise
        :math:`\\gamma`, the weight of a new gradient in the buffer.
    coupled_decay : float or Blockwise
        :math:`\\lambda_c`, weight decay added to every gradient.
    gradient_rates, direct_rates, decoupled_decays : ndarray of shape (n_steps,)
        :math:`\\alpha_s`, :math:`\\zeta_s` and :math:`d_s`: float64, or, where
        parameter groups differ, an object array whose steps are numbers or
        :class:`~._blockwise.Blockwise` (see :func:`~._blockwise.per_step`).
    preconditioners : torch.Tensor of shape (n_steps, n_weights) or None
        :math:`P_s` on the host (RAM or a memory-mapped file, like the weights);
        None for ones. May be given as a :class:`Deferred`, computed at its
        first read (a recorded Adam run's :math:`P_s`: not in the training loop's
        ``finish``).
    """

    buffer_decay: float = 0.0
    gradient_scale: float = 1.0
    coupled_decay: float = 0.0
    gradient_rates: np.ndarray = None
    direct_rates: np.ndarray = None
    decoupled_decays: np.ndarray = None
    preconditioners: torch.Tensor = DeferredField()

    @property
    def scalar_mixing(self):
        """Whether the steps mix by one number per step for every weight (SGD,
        momentum, Nesterov: no preconditioner, coefficients shared by all
        parameter groups): then :math:`\\psi_r = \\sum_{s \\ge r} c_{s,r} \\phi_s`
        with scalar :math:`c_{s,r}`, and a layer whose test features are
        :math:`\\delta_s a^T` with the same :math:`a` at every step keeps that form,
        :math:`(\\sum_s c_{s,r} \\delta_s) a^T`. The decay coefficients enter
        separately (the decay terms) and may differ per group."""
        return (
            self.preconditioners is None
            and not isinstance(self.buffer_decay, Blockwise)
            and not isinstance(self.gradient_scale, Blockwise)
            and self.gradient_rates.dtype != object
            and self.direct_rates.dtype != object
        )

    @property
    def per_step(self):
        """Whether each step moves along its own gradient only, unpreconditioned:
        then step ``s``'s training gradients meet ``step_scale(s) * phi_s`` alone."""
        return self.buffer_decay == 0 and self.scalar_mixing

    def step_scale(self, step):
        """:math:`\\gamma \\alpha_s + \\zeta_s`: with no buffer, the factor of
        :math:`-P_s \\odot g_s` in step ``step``'s update."""
        return self.gradient_scale * self.gradient_rates[step] + self.direct_rates[step]

    def decay_rate(self, step):
        """The factor of ``<phi_s, w_s>`` in the decay term of a step that moves along
        its own gradient only (:attr:`per_step`): :math:`d_s - \\lambda_c
        \\,\\mathrm{step\\_scale}(s)`."""
        return self.decoupled_decays[step] - self.coupled_decay * self.step_scale(step)

    def mixing(self, step, earlier):
        """:math:`c_{s,r}`, the weight of step ``earlier``'s gradient in step ``step``'s
        update, :math:`w_{s+1} - w_s = -P_s \\odot \\sum_{r \\le s} c_{s,r} g_r + d_s w_s`,
        in closed form from the buffer :math:`b_s = \\sum_{r \\le s} \\gamma
        \\beta^{s-r} g_r` (no recursion; :class:`BackwardAccumulation` sums the same
        weights backward)."""
        c = self.gradient_scale * self.gradient_rates[step] * self.buffer_decay ** (step - earlier)
        return c + (self.direct_rates[step] if earlier == step else 0.0)

    def backward(self, layout=None, carry=None, stop=None):
        """A fresh :class:`BackwardAccumulation` of this record's steps; ``layout``
        lays a :class:`~._blockwise.Blockwise` coefficient out as per-layer tensors
        (needed only where parameter groups differ, see :func:`~._blockwise.on_layers`).
        ``carry`` (with ``stop``): the buffer :math:`B_{stop}` that the later steps
        ``>= stop`` hand to this accumulation of the steps before ``stop`` (a chunk
        of the steps, see :meth:`BackwardAccumulation.carried`)."""
        return BackwardAccumulation(self, layout, carry, stop)

    def carry_decay(self, n_steps):
        """:math:`\\beta^{n}`: what a buffer carried into the last of ``n_steps``
        steps weighs at the first of them, with no new features (a number, or a
        :class:`~._blockwise.Blockwise`)."""
        return self.buffer_decay**n_steps

    def forward(self):
        """A fresh :class:`ForwardAccumulation` of this record's steps."""
        return ForwardAccumulation(self)

    def truncated(self, n_steps):
        """The record of the first ``n_steps`` steps (early stopping)."""
        return UpdateRecord(
            self.buffer_decay,
            self.gradient_scale,
            self.coupled_decay,
            self.gradient_rates[:n_steps],
            self.direct_rates[:n_steps],
            self.decoupled_decays[:n_steps],
            None if self.preconditioners is None else self.preconditioners[:n_steps],
        )

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_preconditioners"] = self.preconditioners  # (computed, if deferred)
        if isinstance(state["_preconditioners"], torch.Tensor):
            # A memory-mapped record pickles its values, like WeightPath.
            state["_preconditioners"] = state["_preconditioners"].clone()
        return state

    def __setstate__(self, state):
        if "preconditioners" in state:  # (pickled before the field could be deferred)
            state = dict(state)
            state["_preconditioners"] = state.pop("preconditioners")
        self.__dict__.update(state)


class BackwardAccumulation:
    """The test side of every step's training gradients, accumulated backward.

    With :math:`u_s = P_s \\odot \\phi_s` (a query's test features scaled by the
    step's preconditioner), step :math:`r`'s training gradients meet

    .. math::

        \\psi_r = \\sum_{s \\ge r} c_{s,r} u_s = \\gamma B_r + \\zeta_r u_r, \\qquad
        B_r = \\alpha_r u_r + \\beta B_{r+1},

    (:meth:`UpdateRecord.mixing` gives :math:`c_{s,r}` in closed form). Feed the
    steps last to first: :meth:`psi` takes :math:`u_r` as a list of per-layer
    tensors and returns :math:`\\psi_r` in the same layout. With parameter groups
    that differ, the coefficients are per parameter (elementwise, laid out per
    layer by ``layout``), the same as the forward update's. Cost: two
    multiply-adds per number of ``u``; memory: the buffer and one scratch tensor of
    ``u``'s size (and :math:`\\psi`'s own, unless it is the buffer: see :meth:`psi`).
    """

    def __init__(self, record, layout=None, carry=None, stop=None):
        if (carry is None) != (stop is None):
            raise ValueError("A carried buffer needs the step it is carried from (stop).")
        self.record, self.layout = record, layout
        self._buffer = None if carry is None else list(carry)
        self._next_step = stop
        self._constants = None
        self._scratch = None  # per layer: a tensor for ``alpha u`` and ``zeta u``
        self._psi = None  # per layer: the tensor psi is written into (or None)

    @property
    def buffer(self):
        """:math:`B_r` of the last step ``r`` fed (the carry the steps fed hand to the
        steps before them; None before the first step)."""
        return self._buffer

    def _feed(self, step):
        if self._next_step is not None and step != self._next_step - 1:
            raise ValueError(
                f"Steps must be fed last to first: got {step} after {self._next_step}."
            )
        self._next_step = step

    def _betas_gammas(self, n):
        if self._constants is None:
            record = self.record
            self._constants = [
                self._layers(c, n) for c in (record.buffer_decay, record.gradient_scale)
            ]
        return self._constants

    def carried(self, step):
        """The carry's part of :math:`\\psi_{step}`: the accumulation of a carried
        buffer alone (no features of its own, :math:`u = 0`),
        :math:`B_r = \\beta B_{r+1}`, :math:`\\psi_r = \\gamma B_r`; steps in decreasing
        order, as :meth:`psi`.

        The accumulation is linear in its buffer, so :math:`\\psi_r` of the steps of a
        chunk ``[a, b)`` is their :meth:`psi` from no carry plus :meth:`carried` from
        the carry :math:`B_b` (the chunked scan, ``_engine._step_scan``)."""
        if self._buffer is None:
            raise ValueError("No buffer to carry: feed psi first, or give a carry.")
        self._feed(step)
        betas, gammas = self._betas_gammas(len(self._buffer))
        self._buffer = [beta * old for beta, old in zip(betas, self._buffer, strict=True)]
        return [gamma * b for gamma, b in zip(gammas, self._buffer, strict=True)]

    def _layers(self, coefficient, n_layers):
        return on_layers(coefficient, self.layout, n_layers)

    def psi(self, step, u):
        """:math:`\\psi_{step}` from :math:`u_{step}`; steps must come in decreasing order.

        The buffer, and the tensors returned, are updated in place by the next
        call (no new tensors of ``u``'s size per step: at a few MiB per layer and
        query tile, allocating them cost more than the arithmetic): use the
        returned :math:`\\psi` before feeding the next step. The values are those
        of the plain recursion, rounding included (each product rounded, then
        summed). Where :math:`\\zeta = 0` and :math:`\\gamma = 1` (SGD's momentum
        without Nesterov) :math:`\\psi` is the buffer itself.
        """
        record = self.record
        self._feed(step)
        n = len(u)
        betas, gammas = self._betas_gammas(n)
        alphas = self._layers(record.gradient_rates[step], n)
        zetas = self._layers(record.direct_rates[step], n)
        if self._buffer is None:
            self._buffer = [alpha * layer for alpha, layer in zip(alphas, u, strict=True)]
            self._scratch, self._psi = [None] * n, [None] * n
        else:
            for i, (alpha, layer, beta) in enumerate(zip(alphas, u, betas, strict=True)):
                self._buffer[i] = self._sum_of_products(i, alpha, layer, beta, self._buffer[i])
        psi = []
        for i, (gamma, zeta, layer) in enumerate(zip(gammas, zetas, u, strict=True)):
            buffer = self._buffer[i]
            if _number(gamma) and _number(zeta) and gamma == 1 and zeta == 0:
                psi.append(buffer)  # (1 * b + 0 * u, exactly, for finite u)
                continue
            out = self._psi[i]
            if _fits(out, buffer, gamma):
                out = torch.mul(buffer, gamma, out=out)
            else:
                out = self._psi[i] = gamma * buffer
            psi.append(self._plus_product(i, out, zeta, layer))
        return psi

    def _sum_of_products(self, i, alpha, layer, beta, old):
        """``alpha * layer + beta * old``, in ``old``'s memory where it has the
        result's shape and dtype (each product rounded, then summed, as written)."""
        if not _fits(old, layer, alpha) or not _fits(old, old, beta):
            return alpha * layer + beta * old
        return self._plus_product(i, old.mul_(beta), alpha, layer)

    def _plus_product(self, i, out, coefficient, layer):
        """``out += coefficient * layer`` through layer ``i``'s scratch tensor
        (the product rounded first: no fused multiply-add)."""
        if not _fits(out, layer, coefficient):
            return out + coefficient * layer
        scratch = self._scratch[i]
        if scratch is None or scratch.shape != out.shape or scratch.dtype != out.dtype:
            scratch = self._scratch[i] = torch.empty_like(out)
        return out.add_(torch.mul(layer, coefficient, out=scratch))


def _number(value):
    return not isinstance(value, torch.Tensor)


def _shape(value):
    return () if _number(value) else value.shape


def _fits(out, layer, coefficient):
    """Whether ``coefficient * layer`` can be written into ``out`` as is: the same
    shape and dtype, on the same device."""
    if out is None:
        return False
    shape = torch.broadcast_shapes(layer.shape, _shape(coefficient))
    dtype = layer.dtype if _number(coefficient) else torch.result_type(layer, coefficient)
    return out.shape == shape and out.dtype == dtype and out.device == layer.device


class ForwardAccumulation:
    """The weights' moves of the recorded linear form, step by step from the first:
    given :math:`w_s` and :math:`G_s`,

    .. math::

        g_s = G_s + \\lambda_c w_s, \\quad b_s = \\beta b_{s-1} + \\gamma g_s, \\quad
        w_{s+1} - w_s = -P_s \\odot (\\alpha_s b_s + \\zeta_s g_s) + d_s w_s,

    elementwise with per-parameter coefficients where parameter groups differ.
    Used to replay a recorded run at another precision (the run's rates and
    preconditioners as recorded, the gradients recomputed). Cost: a few
    multiply-adds per weight; memory: one buffer of the weights' size.
    """

    def __init__(self, record):
        self.record = record
        self._buffer = None
        self._next_step = 0

    def move(self, step, weights, gradient):
        """:math:`w_{s+1} - w_s` of step ``step`` from :math:`w_s` (``weights``) and
        :math:`G_s` (``gradient``), flat tensors; steps must come in order."""
        record = self.record
        if step != self._next_step:
            raise ValueError(
                f"Steps must be fed first to last: got {step}, expected {self._next_step}."
            )
        self._next_step = step + 1
        g = gradient + record.coupled_decay * weights if record.coupled_decay else gradient
        if self._buffer is None:
            self._buffer = record.gradient_scale * g
        else:
            self._buffer = record.buffer_decay * self._buffer + record.gradient_scale * g
        direction = record.gradient_rates[step] * self._buffer + record.direct_rates[step] * g
        if record.preconditioners is not None:
            direction = record.preconditioners[step].to(direction) * direction
        return record.decoupled_decays[step] * weights - direction
