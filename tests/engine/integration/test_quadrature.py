"""Quadrature rules: the fixed nodes integrate polynomials to their degree, the
kink-splitting rule integrates piecewise polynomials exactly, the reference uses
the same table, and the fixed rules converge to the exact one."""

import numpy as np
import pytest
from _reference import quadrature_rule

from sklearn_pathkernel._engine.integration._quadrature import (
    FixedRule,
    KinkSplittingRule,
    Quadrature,
    piecewise_nodes,
)


def test_prior_schemes_converge_to_exact(relu_case, engine_cases):
    module, path, X, y, A = relu_case
    exact = engine_cases.engine_for(module, path, X, y).decompose(A).contributions
    errors = []
    for quadrature, n_points in [("dpk", 1), ("riemann", 10), ("riemann", 100)]:
        approx = engine_cases.engine_for(
            module, path, X, y, quadrature=quadrature, n_points=n_points
        )
        errors.append(np.abs(approx.decompose(A).contributions - exact).max())
    assert errors[0] > errors[1] > errors[2] > 0
    assert errors[2] < errors[0] / 20  # first order: 100 points gain > 20x on one


# -- the table of rules ------------------------------------------------------------------

# Each fixed rule of T points and the highest degree it integrates exactly.
EXACT_DEGREE = {
    Quadrature.DPK: lambda T: 0,
    Quadrature.RIEMANN: lambda T: 0,
    Quadrature.MIDPOINT: lambda T: 1,
    Quadrature.GAUSS: lambda T: 2 * T - 1,
}


@pytest.mark.parametrize("quadrature", list(EXACT_DEGREE), ids=lambda q: q.value)
@pytest.mark.parametrize("n_points", [1, 3, 6])
def test_fixed_rules_integrate_polynomials_to_their_degree(quadrature, n_points):
    t, weights = quadrature.fixed_nodes(n_points)
    assert np.all((t >= 0) & (t < 1))
    degree = EXACT_DEGREE[quadrature](n_points)
    for power in range(degree + 1):
        np.testing.assert_allclose((weights * t**power).sum(), 1 / (power + 1), rtol=1e-14)
    # ... and not one degree more (each rule's degree is its own, not a bound)
    assert not np.isclose((weights * t ** (degree + 1)).sum(), 1 / (degree + 2), rtol=1e-12)


def test_the_reference_uses_the_package_table():
    for name in ("riemann", "dpk", "midpoint", "gauss"):
        expected = Quadrature(name).fixed_nodes(5)
        for ours, theirs in zip(quadrature_rule(name, 5), expected, strict=True):
            np.testing.assert_array_equal(ours, theirs)
    assert isinstance(Quadrature.EXACT.rule(5), KinkSplittingRule)
    rule = Quadrature.RIEMANN.rule(5)
    assert isinstance(rule, FixedRule) and not rule.adaptive
    np.testing.assert_array_equal(rule.t, Quadrature.RIEMANN.fixed_nodes(5).t)


def test_unknown_and_non_fixed_rules_are_rejected():
    with pytest.raises(ValueError, match="Unknown quadrature 'simpson'"):
        Quadrature.of("simpson")
    with pytest.raises(ValueError, match="not a fixed rule"):
        Quadrature.EXACT.fixed_nodes(4)
    with pytest.raises(ValueError, match="n_points"):
        Quadrature.GAUSS.fixed_nodes(0)


def test_kink_split_rule_is_exact_for_a_piecewise_polynomial():
    """Gauss-Legendre on the pieces between the kinks integrates a function that is
    a different polynomial of degree ``2 n - 1`` on each piece exactly, where one
    rule over the whole step does not."""
    rng = np.random.RandomState(0)
    n_nodes = 3
    kinks = [np.array([0.3, 0.55]), np.array([]), np.array([0.1, 0.5, 0.9])]
    coefficients = [rng.randn(len(k) + 1, 2 * n_nodes) for k in kinks]

    def f(row, t):
        piece = np.searchsorted(kinks[row], t)
        return np.polynomial.polynomial.polyval(t, coefficients[row][piece].T, tensor=False)

    def exact(row):
        edges = np.concatenate([[0.0], kinks[row], [1.0]])
        total = 0.0
        for piece, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
            antiderivative = np.polynomial.polynomial.polyint(coefficients[row][piece])
            total += np.polynomial.polynomial.polyval(
                b, antiderivative
            ) - np.polynomial.polynomial.polyval(a, antiderivative)
        return total

    nodes = piecewise_nodes(np.arange(3), kinks, n_nodes)
    values = np.array([f(row, t) for row, t in zip(nodes.rows, nodes.t, strict=True)])
    integrals = np.bincount(nodes.rows, weights=nodes.weights * values, minlength=3)
    expected = np.array([exact(row) for row in range(3)])
    np.testing.assert_allclose(integrals, expected, rtol=1e-13, atol=1e-14)
    # one Gauss rule over the whole step misses the rows that have kinks
    t, weights = Quadrature.GAUSS.fixed_nodes(n_nodes)
    whole = np.array([(weights * f(row, t)).sum() for row in range(3)])
    assert np.abs(whole - expected)[[0, 2]].min() > 1e-6
    np.testing.assert_allclose(whole[1], expected[1], rtol=1e-13)
