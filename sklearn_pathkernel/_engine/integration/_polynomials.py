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
    ends = z0.abs() + z3.abs() + floor
    linear = ((z1 - (2 * z0 + z3) / 3).abs() <= rtol * ends) & (
        (z2 - (z0 + 2 * z3) / 3).abs() <= rtol * ends
    )
    scale = ends + 3 * (z1.abs() + z2.abs())
    quadratic = ~linear & ((z3 - 3 * z2 + 3 * z1 - z0).abs() <= rtol * scale)
    c = torch.where(linear, 0.0, 2.25 * (z3 - z2 - z1 + z0))
    return SampledPolynomials(linear, quadratic, z0, z3 - z0 - c, c)


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
