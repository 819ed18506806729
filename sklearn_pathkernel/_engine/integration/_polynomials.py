"""Switching values sampled at ``u = 0, 1/3, 2/3, 1`` of an interval, as polynomials.

A first layer's pre-activations are linear in ``t`` along a step, values one more
moving layer down (or a first distance layer's squared distances) quadratic; four
samples tell which entries are, and give their coefficients, so that their roots
(:mod:`._kinks`) and crossings (:mod:`._pool_switches`) follow in closed form.

Cost: a few elementwise operations per sampled entry.
"""

from typing import NamedTuple

import torch


class SampledPolynomials(NamedTuple):
    """Entries of four samples taken as ``z(u) = a + b u + c u^2`` on ``[0, 1]``.

    Attributes
    ----------
    linear, quadratic : torch.Tensor of bool
        Entries that are linear (``c`` is then exactly 0), and those quadratic
        but not linear. Other entries' coefficients are meaningless.
    a, b, c : torch.Tensor
        The coefficients, through both ends: ``a = z_0``, ``a + b + c = z_3``.
    """

    linear: torch.Tensor
    quadratic: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor

    @property
    def solved(self):
        """Entries that are polynomials of degree at most 2."""
        return self.linear | self.quadratic


def fit_samples(z0, z1, z2, z3, rtol, floor=0.0):
    """The entries of the samples ``z_0 .. z_3`` that are polynomials of degree <= 2.

    An entry is linear when both interior values lie on the chord,
    ``|z_1 - (2 z_0 + z_3) / 3|`` and ``|z_2 - (z_0 + 2 z_3) / 3|`` at most
    ``rtol (|z_0| + |z_3|)``; quadratic when the third difference, zero for every
    quadratic, vanishes: ``|z_3 - 3 z_2 + 3 z_1 - z_0| <= rtol (|z_0| + 3 |z_1| +
    3 |z_2| + |z_3|)``, each bound at least ``rtol * floor`` (values computed
    from terms of that size are only known to a few eps of it). A quadratic's
    curvature is the mean of the two second differences (each ``2 c / 9``),
    ``c = 9 (z_3 - z_2 - z_1 + z_0) / 4``, and ``b = z_3 - z_0 - c`` (so that a
    sign change between the ends always has a root in between).

    Returns
    -------
    SampledPolynomials
    """
    # (the same operations as the formulas above, in the same order, in place
    # where a temporary would be new: a level of the kink search fits pieces x
    # switching units entries, a few MB per tensor on a 28x28 CNN)
    ends = z0.abs()
    ends += z3.abs()
    ends += floor
    tol = ends * rtol
    chord = torch.mul(z0, 2)
    chord += z3
    chord /= 3
    torch.sub(z1, chord, out=chord).abs_()
    linear = chord <= tol
    torch.mul(z3, 2, out=chord)
    chord += z0
    chord /= 3
    torch.sub(z2, chord, out=chord).abs_()
    linear &= chord <= tol
    scale = z1.abs()
    scale += z2.abs()
    scale *= 3
    torch.add(ends, scale, out=scale)
    scale *= rtol
    third = chord  # z_3 - 3 z_2 + 3 z_1 - z_0
    torch.mul(z2, 3, out=third)
    torch.sub(z3, third, out=third)
    third += torch.mul(z1, 3)
    third -= z0
    quadratic = third.abs_() <= scale
    quadratic &= ~linear
    c = z3 - z2
    c -= z1
    c += z0
    c *= 2.25
    c.masked_fill_(linear, 0.0)
    b = z3 - z0
    b -= c
    return SampledPolynomials(linear, quadratic, z0, b, c)


def quadratic_roots(a, b, c):
    """Both real roots of ``a + b u + c u^2`` per entry, cancellation-free.

    ``q = -(b + sign(b) sqrt(b^2 - 4 a c)) / 2`` and the roots ``q / c``, ``a / q``;
    nan where the roots are complex, inf or nan for a missing root (``c = 0``: the
    linear root is ``a / q = -a / b``).
    """
    discriminant = b * b - 4 * a * c
    root = torch.sqrt(discriminant)  # nan below 0: no real root
    q = -0.5 * (b + torch.where(b >= 0, root, -root))
    return q / c, a / q
