"""The statistics behind timing figures: median confidence intervals, the monotone fit of a timing table,
and the check that a fit moved a cell beyond its interval."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from scipy import optimize, stats

from specdec_tune.profiles.intervals import (
    median_interval,
    median_ranks,
    monotone_fit,
    moved_beyond_interval,
)


def timing_table(shape: tuple[int, ...] = (16, 5, 2)) -> np.ndarray:
    """A smooth table non-decreasing along every axis, shaped like (1 + D, batch, context) step times."""
    grids = np.meshgrid(*[np.arange(n) for n in shape], indexing="ij")
    slopes = [0.05, 0.2, 0.1, 0.3][: len(shape)]
    return 1.0 + sum(slope * grid for slope, grid in zip(slopes, grids))


def assert_monotone(array: np.ndarray) -> None:
    for axis in range(array.ndim):
        assert np.all(np.diff(array, axis=axis) >= 0), f"decreases along axis {axis}"


def weighted_sse(fit: np.ndarray, values: np.ndarray, weights: np.ndarray) -> float:
    keep = weights > 0
    return float(np.sum(weights[keep] * (fit[keep] - values[keep]) ** 2))


def brute_force_fit(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted isotonic fit on the weighted cells by a general constrained solver (SLSQP), with one
    constraint per comparable pair of weighted cells in the product order."""
    cells = [c for c in np.ndindex(values.shape) if weights[c] > 0]
    y = np.array([values[c] for c in cells])
    w = np.array([weights[c] for c in cells])
    pairs = [
        (i, j) for (i, a), (j, b) in itertools.permutations(enumerate(cells), 2) if all(x <= z for x, z in zip(a, b))
    ]
    rows = np.zeros((len(pairs), len(cells)))
    for r, (i, j) in enumerate(pairs):
        rows[r, j], rows[r, i] = 1.0, -1.0
    result = optimize.minimize(
        lambda f: np.sum(w * (f - y) ** 2),
        np.full(len(cells), np.average(y, weights=w)),
        jac=lambda f: 2 * w * (f - y),
        constraints=[{"type": "ineq", "fun": lambda f: rows @ f, "jac": lambda f: rows}],
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 500},
    )
    fitted = np.full(values.shape, np.nan)
    for c, v in zip(cells, result.x):
        fitted[c] = v
    return fitted


# --- median_interval --------------------------------------------------------------------------------


def test_median_ranks_n10_by_hand():
    # P(2 <= B <= 8), B ~ Binom(10, 1/2): 1 - 2 (C(10,0) + C(10,1)) / 1024 = 1 - 22/1024 = 0.9785 >= 0.95,
    # while the next narrower pair (3, 8) covers 1 - 2 (1 + 10 + 45) / 1024 = 0.8906 < 0.95.
    assert median_ranks(10, 0.95) == (2, 9, 1 - 22 / 1024)
    samples = [7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 4.0, 6.0]
    assert median_interval(samples) == (2.0, 9.0)


@pytest.mark.parametrize("confidence", [0.5, 0.9, 0.95, 0.99])
def test_median_ranks_are_the_narrowest_symmetric_pair(confidence):
    for n in range(2, 301):
        j, k, coverage = median_ranks(n, confidence)
        assert k == n + 1 - j
        exact = stats.binom.cdf(k - 1, n, 0.5) - stats.binom.cdf(j - 1, n, 0.5)  # P(j <= B < k)
        assert coverage == pytest.approx(exact, abs=1e-12)
        if 1 - 2.0 ** (1 - n) < confidence:  # too few samples for any pair: (min, max)
            assert (j, k) == (1, n)
            continue
        assert coverage >= confidence
        if j + 1 < k - 1:  # the next pair inward exists and must fall short
            narrower = stats.binom.cdf(k - 2, n, 0.5) - stats.binom.cdf(j, n, 0.5)
            assert narrower < confidence, (n, j, k)


def test_median_interval_coverage_by_simulation():
    rng = np.random.default_rng(20240617)
    true_median = math.log(2.0)  # of the unit exponential
    draws, n = 2000, 15
    covered = 0
    for _ in range(draws):
        low, high = median_interval(rng.exponential(1.0, size=n), 0.95)
        assert low <= high
        covered += low <= true_median <= high
    # Exact coverage for n = 15 is P(4 <= B <= 11) = 0.965; 2000 draws have a standard error of 0.004.
    assert covered / draws >= 0.94


def test_median_interval_small_samples_are_min_max():
    assert median_interval([4.0]) == (4.0, 4.0)
    assert median_interval([3.0, 1.0]) == (1.0, 3.0)
    five = [5.0, 1.5, 9.0, 2.0, 7.0]  # n = 5 reaches only 1 - 2/32 = 0.9375 < 0.95
    assert median_interval(five, 0.95) == (1.5, 9.0)
    six = [5.0, 1.5, 9.0, 2.0, 7.0, 3.0]  # n = 6 reaches 0.96875: still (min, max), now by the rule
    assert median_interval(six, 0.95) == (1.5, 9.0)
    assert median_interval(five, 0.5) == (2.0, 7.0)  # a lower confidence allows a narrower pair


def test_median_interval_rejects_bad_input():
    with pytest.raises(ValueError):
        median_interval([])
    with pytest.raises(ValueError):
        median_interval([1.0, float("nan"), 2.0])
    with pytest.raises(ValueError):
        median_interval([1.0, 2.0], confidence=1.0)


# --- monotone_fit -----------------------------------------------------------------------------------


def test_monotone_fit_1d_by_hand():
    np.testing.assert_allclose(monotone_fit(np.array([1.0, 3.0, 2.0, 4.0]), np.ones(4)), [1.0, 2.5, 2.5, 4.0])
    # weighted pooling: (1 * 3 + 3 * 1) / 4 = 1.5
    np.testing.assert_allclose(monotone_fit(np.array([0.0, 3.0, 1.0]), np.array([1.0, 1.0, 3.0])), [0.0, 1.5, 1.5])


def test_monotone_fit_1d_matches_scipy_isotonic_regression():
    if not hasattr(optimize, "isotonic_regression"):
        pytest.skip("scipy.optimize.isotonic_regression needs scipy >= 1.12")
    rng = np.random.default_rng(1)
    for _ in range(20):
        values = np.cumsum(rng.normal(0.1, 1.0, size=30))
        weights = rng.uniform(0.1, 5.0, size=30)
        expected = optimize.isotonic_regression(values, weights=weights).x
        np.testing.assert_allclose(monotone_fit(values, weights), expected, rtol=0, atol=1e-10)


def test_monotone_fit_keeps_a_monotone_table():
    table = timing_table()
    weights = np.random.default_rng(2).uniform(0.5, 3.0, size=table.shape)
    np.testing.assert_array_equal(monotone_fit(table, weights), table)


def test_monotone_fit_pulls_down_a_spike():
    table = timing_table()
    spike = (5, 2, 0)
    values = table.copy()
    values[spike] *= 3.0
    fit = monotone_fit(values, np.ones_like(values))
    assert_monotone(fit)
    assert table[spike] < fit[spike] < 0.5 * values[spike]
    # Only the spike and cells above it in the order can change; everything else stays where it was.
    above = np.zeros(table.shape, dtype=bool)
    above[spike[0] :, spike[1] :, spike[2] :] = True
    np.testing.assert_allclose(fit[~above], table[~above], rtol=0, atol=1e-8)
    assert weighted_sse(fit, values, np.ones_like(values)) < weighted_sse(table, values, np.ones_like(values))


def test_monotone_fit_heavy_cell_stays_light_violator_moves():
    values = np.array([1.0, 5.0, 3.0, 6.0])
    fit = monotone_fit(values, np.array([1.0, 1e6, 1.0, 1.0]))
    assert fit[1] == pytest.approx(5.0, abs=1e-5)
    assert fit[2] == pytest.approx(5.0, abs=1e-5)  # the light cell after it is pulled up to it
    fit = monotone_fit(values, np.array([1.0, 1.0, 1e6, 1.0]))
    assert fit[2] == pytest.approx(3.0, abs=1e-5)
    assert fit[1] == pytest.approx(3.0, abs=1e-5)  # now the light cell before it comes down

    # The same along a non-leading axis of a 3-D table.
    table = timing_table((3, 3, 2))
    values = table.copy()
    values[1, 1, 0] = 10.0  # heavy outlier, to be kept
    values[1, 2, 0] = table[1, 2, 0]  # light cell after it along the batch axis, must rise
    weights = np.ones_like(values)
    weights[1, 1, 0] = 1e8
    fit = monotone_fit(values, weights)
    assert_monotone(fit)
    assert fit[1, 1, 0] == pytest.approx(10.0, abs=1e-4)
    assert fit[1, 2, 0] >= fit[1, 1, 0]


@pytest.mark.parametrize("seed", range(5))
def test_monotone_fit_matches_brute_force_2x2x2(seed):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(2, 2, 2))
    weights = rng.uniform(0.2, 3.0, size=(2, 2, 2))
    fit = monotone_fit(values, weights)
    assert_monotone(fit)
    np.testing.assert_allclose(fit, brute_force_fit(values, weights), rtol=0, atol=1e-5)


def test_monotone_fit_matches_brute_force_with_zero_weights():
    rng = np.random.default_rng(7)
    shape = (6, 3, 2)
    values = timing_table(shape) + 0.3 * rng.normal(size=shape)
    weights = rng.uniform(0.5, 2.0, size=shape)
    weights[rng.random(shape) < 0.25] = 0.0
    values[weights == 0] = np.nan
    fit = monotone_fit(values, weights)
    expected = brute_force_fit(values, weights)
    keep = weights > 0
    np.testing.assert_allclose(fit[keep], expected[keep], rtol=0, atol=1e-5)


def test_monotone_fit_fills_zero_weight_nan_cells_within_the_order():
    fit = monotone_fit(np.array([3.0, np.nan, 1.0]), np.array([1.0, 0.0, 1.0]))
    np.testing.assert_allclose(fit, [2.0, 2.0, 2.0])
    fit = monotone_fit(np.array([1.0, np.nan, np.nan, 3.0]), np.array([1.0, 0.0, 0.0, 1.0]))
    assert fit[0] == 1.0 and fit[3] == 3.0 and 1.0 <= fit[1] <= fit[2] <= 3.0

    rng = np.random.default_rng(11)
    table = timing_table()
    values = table + 0.1 * rng.normal(size=table.shape)
    weights = np.ones_like(values)
    holes = rng.random(table.shape) < 0.3
    holes[0, 0, 0] = holes[-1, -1, -1] = True  # the corners, with nothing below / above them
    weights[holes] = 0.0
    values[holes] = np.nan
    fit = monotone_fit(values, weights)
    assert np.all(np.isfinite(fit))
    assert_monotone(fit)
    # A zero-weight cell's own value plays no part: a wild one gives the same fit as NaN.
    values[holes] = 1e6
    np.testing.assert_allclose(monotone_fit(values, weights), fit, rtol=0, atol=1e-9)


def test_monotone_fit_converges_on_a_noisy_table():
    rng = np.random.default_rng(5)
    table = timing_table()
    values = table + 0.2 * rng.normal(size=table.shape)
    weights = rng.uniform(0.5, 2.0, size=table.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "did not converge" warning
        fit = monotone_fit(values, weights)
    assert_monotone(fit)
    assert weighted_sse(fit, values, weights) <= weighted_sse(table, values, weights)
    # Optimality (projection onto a convex cone): <values - fit, fit> = 0 and <values - fit, g> <= 0
    # for every monotone g; constants and the monotone table itself are such g.
    residual = weights * (values - fit)
    assert abs(np.sum(residual * fit)) < 1e-6
    assert abs(np.sum(residual)) < 1e-6
    assert np.sum(residual * table) <= 1e-6


def test_monotone_fit_warns_when_out_of_sweeps_but_stays_monotone():
    rng = np.random.default_rng(6)
    values = rng.normal(size=(16, 5, 2))
    with pytest.warns(RuntimeWarning, match="did not converge"):
        fit = monotone_fit(values, np.ones_like(values), max_iter=1)
    assert_monotone(fit)


def test_monotone_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        monotone_fit(np.array([1.0, np.nan]), np.array([1.0, 1.0]))  # NaN with a weight
    with pytest.raises(ValueError):
        monotone_fit(np.array([1.0, 2.0]), np.array([1.0, -1.0]))
    with pytest.raises(ValueError):
        monotone_fit(np.array([1.0, 2.0]), np.array([1.0]))
    with pytest.raises(ValueError):
        monotone_fit(np.array([1.0, 2.0]), np.zeros(2))


# --- moved_beyond_interval --------------------------------------------------------------------------


def test_moved_beyond_interval():
    assert not moved_beyond_interval(raw=10.0, fitted=10.5, low=9.0, high=11.0)
    assert not moved_beyond_interval(raw=10.0, fitted=11.0, low=9.0, high=11.0)  # on the bound
    assert moved_beyond_interval(raw=10.0, fitted=11.01, low=9.0, high=11.0)
    assert moved_beyond_interval(raw=10.0, fitted=8.99, low=9.0, high=11.0)
    assert not moved_beyond_interval(raw=10.0, fitted=11.0 * (1 + 1e-11), low=9.0, high=11.0)  # residue
    assert moved_beyond_interval(raw=10.0, fitted=11.0 * (1 + 1e-7), low=9.0, high=11.0)
    with pytest.raises(ValueError):
        moved_beyond_interval(raw=10.0, fitted=10.0, low=11.0, high=9.0)
