"""Four samples of switching values taken as polynomials (``_polynomials.fit_samples``).

References: the formulas of its docstring written out as plain expressions (the
function computes them in place, in the same order: the results must be the same
bit for bit), and polynomials whose coefficients are known.
"""

import pytest
import torch

from sklearn_pathkernel._engine.integration._polynomials import SampledPolynomials, fit_samples


def _formulas(z0, z1, z2, z3, rtol, floor=0.0):
    """The docstring's tests and coefficients, one expression each."""
    ends = z0.abs() + z3.abs() + floor
    linear = ((z1 - (2 * z0 + z3) / 3).abs() <= rtol * ends) & (
        (z2 - (z0 + 2 * z3) / 3).abs() <= rtol * ends
    )
    scale = ends + 3 * (z1.abs() + z2.abs())
    quadratic = ~linear & ((z3 - 3 * z2 + 3 * z1 - z0).abs() <= rtol * scale)
    c = torch.where(linear, 0.0, 2.25 * (z3 - z2 - z1 + z0))
    return SampledPolynomials(linear, quadratic, z0, z3 - z0 - c, c)


def _samples(dtype, shape=(5, 3, 40), seed=0):
    """Samples at u = 0, 1/3, 2/3, 1 of lines, quadratics and cubics, and ReLU-like
    zeros, mixed entry by entry."""
    g = torch.Generator().manual_seed(seed)
    a, b, c, d = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    kind = torch.randint(0, 4, shape, generator=g)
    c = torch.where(kind >= 1, c, 0.0)  # 0: lines
    d = torch.where(kind == 2, d, 0.0)  # 2: cubics
    zero = kind == 3  # 3: quadratics, half of them switched off
    off = zero & (torch.rand(shape, generator=g) < 0.5)
    samples = []
    for u in (0.0, 1 / 3, 2 / 3, 1.0):
        z = a + b * u + c * u**2 + d * u**3
        samples.append(torch.where(off, 0.0, z).to(dtype))
    return samples, kind, off, (a, b, c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("floor", ["none", "per_row"])
def test_fit_samples_is_its_formulas_bit_for_bit(dtype, floor):
    samples, _, _, _ = _samples(dtype)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    floor = 0.0 if floor == "none" else samples[0].flatten(1).abs().amax(1)[:, None, None]
    found, expected = fit_samples(*samples, rtol, floor), _formulas(*samples, rtol, floor)
    for mine, theirs in zip(found, expected, strict=True):
        assert mine.dtype == theirs.dtype
        assert torch.equal(mine, theirs)
    before = [s.clone() for s in samples]
    fit_samples(*samples, rtol, floor)
    for s, b in zip(samples, before, strict=True):  # (in place on its own tensors only)
        assert torch.equal(s, b)


def test_fit_samples_finds_lines_and_quadratics_and_their_coefficients():
    samples, kind, off, (a, b, c) = _samples(torch.float64)
    fit = fit_samples(*samples, 1e-12)
    lines = (kind == 0) | off
    assert torch.equal(fit.linear, lines)
    assert torch.equal(fit.quadratic, (kind == 3) & ~off | (kind == 1))
    assert not fit.solved[kind == 2].any()  # cubics are left to the search
    assert torch.equal(fit.c[fit.linear], torch.zeros_like(fit.c[fit.linear]))
    on = fit.solved & ~off
    scale = a.abs() + b.abs() + c.abs()
    for mine, theirs in ((fit.a, a), (fit.b, b), (fit.c, c)):
        assert ((mine - theirs).abs()[on] <= 1e-12 * scale[on]).all()
