"""Statistics for figures taken on a noisy machine: timings, and acceptance counted over a few hundred prompts.

- `median_interval`: a distribution-free confidence interval for the median of repeated timings.
- `pooled_rel_sd` / `pooled_half_width`: the noise all cells share, for a cell with too few samples to say.
- `design_effect`: how many samples count as one where they come in visits that share a level.
- `between_group_sd` / `widened_by`: the spread between groups (engines) beyond their medians' own noise, and a
  median's interval widened by such a term.
- `monotone_fit`: the weighted least-squares fit of a timing table that never decreases along any axis
  (more tokens verified, a larger batch or a longer context never makes a step cheaper).
- `moved_beyond_interval`: whether the fit pulled a cell outside the interval its own samples allow.
- `draws` / `figures`: acceptance figures of a mix of domains from per-prompt counts, bootstrapped over prompts;
  `widening` / `widened`: the small-sample correction of a percentile interval over a few prompts per domain.

Pure functions over numpy and the standard library.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

# A zero-weight cell takes part in the fit with this weight relative to the largest weight: small enough
# that it moves the other cells by a negligible amount (its pull on a pooled block is at most this fraction
# of its distance from the block's mean), large enough that every pooled block has a defined mean.
_ZERO_WEIGHT_RELATIVE = 1e-12
Z95 = 1.96  # a normal's 95% two-sided quantile


def median_ranks(n: int, confidence: float = 0.95) -> tuple[int, int, float]:
    """The 1-based ranks (j, k) of the order statistics bounding the median, and their exact coverage.

    Let x_(1) <= ... <= x_(n) be the sorted samples of a continuous distribution with median m, and let
    B = #{i : x_i < m}, so B ~ Binomial(n, 1/2) whatever the distribution. x_(j) < m holds exactly when at
    least j samples lie below m (B >= j), and m < x_(k) exactly when fewer than k do (B < k), hence

        P(x_(j) < m < x_(k)) = P(j <= B < k) = 2^-n * sum_{i=j}^{k-1} C(n, i).

    The ranks are taken symmetric, k = n + 1 - j, so the coverage is 1 - 2 * 2^-n * sum_{i<j} C(n, i), and
    j is the largest rank (narrowest interval) whose coverage is still >= `confidence`. The sums are exact
    integers, so a hand computation matches: n = 10 gives (2, 9) with coverage 1 - 22/1024 = 0.9785.

    When even (1, n) falls short (coverage 1 - 2^(1-n) < confidence, e.g. n < 6 at 95%), (1, n) is returned
    anyway with its lower coverage: the widest interval the data allow.
    """
    if n < 1:
        raise ValueError(f"need at least one sample, got n={n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    total = 2**n
    allowed_tails = (1.0 - confidence) * total  # 2 * sum_{i<j} C(n, i) may not exceed this
    j, below_j, comb_j = 1, 1, n  # below_j = sum_{i<j} C(n, i); comb_j = C(n, j)
    # Step j up while the next interval (j + 1, n - j) still has j + 1 < n - j and enough coverage.
    while j + 1 < n - j and 2 * (below_j + comb_j) <= allowed_tails:
        below_j += comb_j
        comb_j = comb_j * (n - j) // (j + 1)
        j += 1
    coverage = 1.0 - (2 * below_j) / total if n > 1 else 1.0  # n == 1: the one sample is the median
    return j, n + 1 - j, coverage


def median_interval(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free `confidence` interval (low, high) for the median of `samples`.

    The bounds are the order statistics x_(j) and x_(k) chosen by `median_ranks` (the binomial method):
    for any continuous distribution the true median lies in [x_(j), x_(k)] with probability
    P(j <= Binomial(n, 1/2) < k) >= confidence. Nothing about the timing distribution is assumed, which
    suits the skewed, heavy-right-tailed timings of a shared machine.

    Small samples: when n is too small to reach `confidence` at all (n < 6 at 95%), the result is
    (min, max) of the samples, whose coverage 1 - 2^(1-n) is below the one asked for; n == 1 gives (x, x).
    """
    values_sorted = np.sort(np.asarray(samples, dtype=np.float64).ravel())
    if values_sorted.size == 0:
        raise ValueError("median_interval needs at least one sample")
    if not np.all(np.isfinite(values_sorted)):
        raise ValueError("median_interval needs finite samples")
    j, k, _ = median_ranks(values_sorted.size, confidence)
    return float(values_sorted[j - 1]), float(values_sorted[k - 1])


def runs_interval(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A `confidence` interval (low, high) for the typical value of a few repeated runs (a rate measured 3-9 times):
    the geometric mean exp(m) with m ± t(n - 1) · s / sqrt(n) on the log scale (m, s the logs' mean and sd). Unlike
    `median_interval` it narrows with every run from the second on; one run gives (x, x)."""
    logs = np.log(np.asarray(samples, dtype=np.float64).ravel())
    if logs.size == 0 or not np.all(np.isfinite(logs)):
        raise ValueError("runs_interval needs positive finite samples")
    if logs.size == 1:
        return float(np.exp(logs[0])), float(np.exp(logs[0]))
    half = t_quantile((1 + confidence) / 2, logs.size - 1) * float(np.std(logs, ddof=1)) / math.sqrt(logs.size)
    mean = float(np.mean(logs))
    return math.exp(mean - half), math.exp(mean + half)


def pooled_rel_sd(groups: Iterable[Sequence[float]]) -> float | None:
    """The per-sample relative spread several cells' timings share, robustly: 1.4826 x the median of
    |ln(x / m)| over the samples x of every cell with at least 3 samples, m the cell's median (for odd n the
    sample that is the median, always 0, is left out). On log-timings this is the sd of a normal for the same
    spread, i.e. the relative sd. None without such a cell.

    A cell of 3 samples cannot say how noisy the machine is (its (min, max) holds the median only 75% of the
    time); the noise of all cells together can."""
    deviations: list[float] = []
    for g in groups:
        logs = np.log(np.asarray(g, dtype=np.float64))
        if logs.size >= 3:
            d = np.sort(np.abs(logs - np.median(logs)))
            deviations += list(d[1:] if logs.size % 2 else d)
    return 1.4826 * float(np.median(deviations)) if deviations else None


def design_effect(cells: Iterable[Sequence[Sequence[float]]]) -> float:
    """How many samples count as one where samples come in visits (a visit's calls run back to back and share its
    level): 1 + (m - 1) rho, m the samples per visit and rho the intra-visit correlation of log-timings,
        rho = s_b^2 / (s_b^2 + s_w^2),   s_w^2 = mean within-visit variance,
        s_b^2 = max(0, variance of the visits' means within a cell - s_w^2 / m),
    pooled over every cell with at least 2 visits (one-way ANOVA estimates). 1 where nothing says (no such cell):
    n samples then count as n."""
    within, between, sizes = [], [], []
    for visits in cells:
        logs = [np.log(np.asarray(v, dtype=np.float64)) for v in visits if len(v) >= 2]
        if len(logs) < 2:
            continue
        within += [float(np.var(x, ddof=1)) for x in logs]
        between.append(float(np.var([x.mean() for x in logs], ddof=1)))
        sizes += [x.size for x in logs]
    if not between:
        return 1.0
    m, s_w = float(np.mean(sizes)), float(np.mean(within))
    s_b = max(0.0, float(np.mean(between)) - s_w / m)
    return 1.0 + (m - 1.0) * (s_b / (s_b + s_w) if s_b + s_w > 0 else 0.0)


def between_group_sd(cells: Iterable[Sequence[Sequence[float]]], min_samples: int = 6) -> tuple[float | None, int]:
    """(sd of ln(median) between the groups of one cell beyond their medians' own noise, cells used): the median-based
    analogue of `design_effect`'s between-visit variance. For each cell with at least 2 groups of `min_samples` (enough
    for a 95% interval of a median), the variance of the groups' log medians less the mean squared standard error of
    those medians (each from its `median_interval`, half-width / 1.96 on the log scale); averaged over the cells,
    floored at 0. None where no cell has two such groups."""
    terms = []
    for groups in cells:
        runs = [sorted(g) for g in groups if len(g) >= min_samples]
        if len(runs) < 2:
            continue
        logs = [math.log(statistics.median(r)) for r in runs]
        se2 = [((math.log(hi) - math.log(lo)) / (2 * Z95)) ** 2 for lo, hi in map(median_interval, runs)]
        terms.append(statistics.variance(logs) - statistics.fmean(se2))
    return (math.sqrt(max(0.0, statistics.fmean(terms))) if terms else None), len(terms)


def widened_by(low: float, median: float, high: float, sd: float, groups: int) -> tuple[float, float]:
    """A median's 95% interval (low, high) with a between-group term of `sd` (log scale) over `groups` groups added:
    each side's log distance from the median and 1.96·sd/√groups taken together as independent errors."""
    extra = Z95 * sd / math.sqrt(max(groups, 1))
    return (
        median * math.exp(-math.hypot(math.log(median / low), extra)),
        median * math.exp(math.hypot(math.log(high / median), extra)),
    )


def pooled_half_width(n: float, rel_sd: float, median: float) -> float:
    """The 95% half-width of the median of n samples whose relative sd is `rel_sd`: the median's standard error is
    sqrt(pi / 2) sigma / sqrt(n) for a normal (1.2533 x that of the mean), so 1.96 x 1.2533 x rel_sd x median /
    sqrt(n)."""
    return Z95 * math.sqrt(math.pi / 2) * rel_sd * median / math.sqrt(n)


def isotonic_line(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted isotonic regression of one line: argmin_f sum w_i (f_i - y_i)^2 s.t. f_1 <= ... <= f_L.

    Pool adjacent violators: scan left to right keeping blocks of pooled cells, each fitted by its weighted
    mean sum(w y) / sum(w); whenever the newest block's mean is below the previous block's, merge the two
    (mean = (W1 m1 + W2 m2) / (W1 + W2)) and check again. The block means of the final partition are
    non-decreasing and solve the problem; a cell never pooled keeps its value exactly.
    All weights must be positive.
    """
    block_mean: list[float] = []
    block_weight: list[float] = []
    block_len: list[int] = []
    for y, w in zip(values.tolist(), weights.tolist()):
        block_mean.append(y)
        block_weight.append(w)
        block_len.append(1)
        while len(block_mean) > 1 and block_mean[-2] > block_mean[-1]:
            mean, weight, length = block_mean.pop(), block_weight.pop(), block_len.pop()
            pooled_weight = block_weight[-1] + weight
            block_mean[-1] = (block_weight[-1] * block_mean[-1] + weight * mean) / pooled_weight
            block_weight[-1] = pooled_weight
            block_len[-1] += length
    return np.repeat(np.asarray(block_mean, dtype=np.float64), block_len)


def _project_axis(values: np.ndarray, weights: np.ndarray, axis: int) -> np.ndarray:
    """The weighted projection onto arrays non-decreasing along `axis`: `isotonic_line` on every 1-D line."""
    line_values = np.moveaxis(values, axis, -1)
    line_weights = np.moveaxis(weights, axis, -1)
    flat_values = line_values.reshape(-1, line_values.shape[-1])
    flat_weights = line_weights.reshape(-1, line_weights.shape[-1])
    fitted = np.empty_like(flat_values)
    for line in range(flat_values.shape[0]):
        fitted[line] = isotonic_line(flat_values[line], flat_weights[line])
    return np.moveaxis(fitted.reshape(line_values.shape), -1, axis)


def _max_violation(array: np.ndarray) -> float:
    """The largest decrease between neighbours along any axis (0.0 for a monotone array)."""
    drops = [np.max(-np.diff(array, axis=axis), initial=0.0) for axis in range(array.ndim)]
    return float(max(drops, default=0.0))


def _dykstra(
    values: np.ndarray, weights: np.ndarray, counted: np.ndarray, max_iter: int, tol: float
) -> tuple[np.ndarray, int]:
    """`monotone_fit`'s solve; also returns the number of sweeps taken (max_iter + 1 if not converged).

    Dykstra's alternating projections: the feasible set is C = C_0 ∩ ... ∩ C_{d-1}, where C_a holds the
    arrays non-decreasing along axis a, and projecting onto one C_a in the norm ||v||_w^2 = sum w v^2 is a
    weighted PAVA on each line along a (the lines are independent). Plain alternation would only reach
    some point of C; Dykstra keeps one correction p_a per set and converges to the projection of y itself:

        for a = 0 .. d-1:   z = x + p_a;   x = P_a(z);   p_a = z - x.

    The loop ends after the first sweep in which no `counted` cell of x or of any p_a moved by more than
    tol * scale, scale being the largest |y| among counted cells. Cells left out are the zero-weight ones:
    with their tiny internal weight they converge far more slowly, and `monotone_fit` resets them anyway.
    """
    scale = max(float(np.max(np.abs(values[counted]))), np.finfo(np.float64).tiny)
    fit = values.copy()
    corrections = [np.zeros_like(values) for _ in range(values.ndim)]
    for sweep in range(1, max_iter + 1):
        largest_step = 0.0
        for axis in range(values.ndim):
            shifted = fit + corrections[axis]
            projected = _project_axis(shifted, weights, axis)
            new_correction = shifted - projected
            largest_step = max(
                largest_step,
                float(np.max(np.abs(projected - fit)[counted])),
                float(np.max(np.abs(new_correction - corrections[axis])[counted])),
            )
            fit, corrections[axis] = projected, new_correction
        if largest_step <= tol * scale:
            return fit, sweep
    return fit, max_iter + 1


def _running_extreme(array: np.ndarray, largest: bool) -> np.ndarray:
    """Over every cell c, the max (largest=True) of `array` over cells <= c in the product order, or the
    min over cells >= c: a running max forward (running min backward) along each axis in turn."""
    for axis in range(array.ndim):
        if largest:
            array = np.maximum.accumulate(array, axis=axis)
        else:
            flipped = np.flip(array, axis=axis)
            array = np.flip(np.minimum.accumulate(flipped, axis=axis), axis=axis)
    return array


def _prepare(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Checked float64 copies of values and weights, with every zero weight made tiny and positive and
    its value replaced by the weighted mean; also the mask of originally weighted cells and that mean."""
    values = np.array(values, dtype=np.float64)
    weights = np.array(weights, dtype=np.float64)
    if values.shape != weights.shape:
        raise ValueError(f"values {values.shape} and weights {weights.shape} differ in shape")
    if values.ndim == 0:
        raise ValueError("monotone_fit needs an array with at least one axis")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError("weights must be finite and >= 0")
    weighted = weights > 0
    if not np.any(weighted):
        raise ValueError("monotone_fit needs at least one cell with a positive weight")
    if not np.all(np.isfinite(values[weighted])):
        raise ValueError("values may be NaN (or infinite) only where the weight is 0")
    # A zero-weight cell has no say in the fit, so its own value (NaN or not) is replaced by the weighted
    # mean, which lies within the range of the weighted values: with its tiny weight it then shifts any
    # pooled block by at most 1e-12 of that range.
    weighted_mean = float(np.sum(weights[weighted] * values[weighted]) / np.sum(weights[weighted]))
    values[~weighted] = weighted_mean
    weights[~weighted] = _ZERO_WEIGHT_RELATIVE * float(np.max(weights))
    return values, weights, weighted, weighted_mean


def monotone_fit(values: np.ndarray, weights: np.ndarray, max_iter: int = 500, tol: float = 1e-9) -> np.ndarray:
    """The weighted least-squares fit of `values` that is non-decreasing along every axis.

    Solves   minimise  sum_c w_c (f_c - y_c)^2   over arrays f with f_c <= f_c' whenever c <= c'
    coordinate-wise (isotonic regression on the product order; for a timing table with axes
    (tokens verified 1 + D, batch, context) it says no step gets cheaper when any of the three grows).
    Because the product order is generated by the neighbour relations along each axis, the feasible set is
    the intersection of "non-decreasing along axis a" over the axes, and the fit is found by Dykstra's
    alternating projections (`_dykstra`), each projection being a weighted PAVA on the lines of one axis.

    Weights: a cell with weight 0 does not count in the objective and its value is ignored (it may be NaN,
    and only such a cell may be). It receives a value that keeps the order: with L_c the largest fitted
    weighted cell below it and U_c the smallest above, f_c = clamp(m, L_c, U_c), m being the weighted
    mean of the values (so a cell between two fitted neighbours takes a value between them).

    Convergence: stops after the first sweep in which no weighted cell moved by more than
    tol * max|values|, which leaves the fit within a few times that of the optimum. If `max_iter` sweeps
    do not get there, a RuntimeWarning says so and the last iterate is used. The result is exactly
    non-decreasing along every axis either way.
    """
    values_checked, weights_checked, weighted, weighted_mean = _prepare(values, weights)
    fit, sweeps = _dykstra(values_checked, weights_checked, weighted, max_iter, tol)
    if sweeps > max_iter:
        warnings.warn(
            f"monotone_fit did not converge in {max_iter} sweeps (largest order violation "
            f"{_max_violation(fit):.3g}); the result is monotone but may be short of optimal",
            RuntimeWarning,
            stacklevel=2,
        )
    # Final assembly, by running maxima / minima along each axis (exact float operations):
    #   L_c = max of the fit over weighted cells <= c (-inf if none), U_c = min over weighted cells >= c
    #   (+inf if none), f_c = min(max(m, L_c), U_c) with m the weighted mean.
    # L and U are non-decreasing along every axis, and so is f, exactly. At a weighted cell of a converged
    # fit L_c = U_c = fit_c, so it only removes the floating residue (of order tol) that the projections
    # leave along the axes other than the last; at a zero-weight cell it places the value within the order.
    lower = _running_extreme(np.where(weighted, fit, -np.inf), largest=True)
    upper = _running_extreme(np.where(weighted, fit, np.inf), largest=False)
    return np.minimum(np.maximum(weighted_mean, lower), upper)


def moved_beyond_interval(raw: float, fitted: float, low: float, high: float) -> bool:
    """Whether `fitted` lies outside [low, high], the confidence interval of the measured value `raw`.

    The comparison allows a slack of 1e-9 relative to the largest of |raw|, |low|, |high|, so floating
    residue from the fit never counts as a move.
    """
    if not all(math.isfinite(x) for x in (raw, fitted, low, high)):
        raise ValueError(f"moved_beyond_interval needs finite numbers, got {(raw, fitted, low, high)}")
    if low > high:
        raise ValueError(f"interval bounds out of order: low={low} > high={high}")
    slack = 1e-9 * max(abs(raw), abs(low), abs(high))
    return fitted < low - slack or fitted > high + slack


# ---------------------------------------------------------------------------- acceptance over prompts


def draws(
    sums: dict[str, np.ndarray], domains: Sequence[str], weights: dict[str, float], *, resamples: int = 0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens per forward and vLLM's mean AL per D for a mix of domains: [1, D_max + 1] each on the prompts as they are
    (resamples = 0), else [resamples, D_max + 1], one row per bootstrap resample of the prompts.

    Each domain d contributes in proportion to its request share w_d: with every request generating the same
    number of tokens, its rows spend rounds in proportion to w_d / tpf_d, so
        tpf_mix = Σ_d w_d / Σ_d (w_d / tpf_d)    (a weighted harmonic mean; one domain: its own ratio).
    vLLM's AL mixes the same way over rounds that drafted. A resample draws prompts with replacement within each
    domain (the prompt is the unit that varies; domains are fixed by the mix), one draw for every D at once: a
    row's figures at two draft lengths come from the same prompts, so their ratio is a paired comparison.
    """
    domain_of = np.asarray(domains)  # per prompt
    names = [d for d in dict.fromkeys(domain_of.tolist()) if weights.get(d, 0) > 0]
    rng = np.random.default_rng(seed)
    R = max(resamples, 1)
    tpf_inv = np.zeros((R, sums["emitted"].shape[1]))
    al_num = np.zeros_like(tpf_inv)
    al_den = np.zeros_like(tpf_inv)
    total_w = sum(weights[d] for d in names)
    for d in names:
        idx = np.flatnonzero(domain_of == d)
        counts = (
            rng.multinomial(len(idx), np.full(len(idx), 1 / len(idx)), size=R) if resamples else np.ones((1, len(idx)))
        )
        e, r = counts @ sums["emitted"][idx], counts @ sums["rounds"][idx]  # [R, D+1]
        a, q = counts @ sums["accepted"][idx], counts @ sums["drafts"][idx]
        w = weights[d] / total_w
        tpf_d = e / np.maximum(r, 1)
        tpf_inv += w / tpf_d
        drafted_rounds_share = w / tpf_d * q / np.maximum(r, 1)  # rounds of d per unit of its tokens, that drafted
        al_num += drafted_rounds_share * a / np.maximum(q, 1)
        al_den += drafted_rounds_share
    tpf = 1 / tpf_inv
    al = 1 + al_num / np.where(al_den > 0, al_den, 1)
    tpf[:, 0] = al[:, 0] = 1.0  # D = 0: one token per forward, exactly
    return tpf, al


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile: exact for 1 and 2 degrees of freedom, else the Cornish-Fisher expansion in 1/df
    (Abramowitz & Stegun 26.7.5; at the 97.5% point within 0.004 of the exact value at 3 degrees of freedom, 1e-3 at 4,
    1e-4 from 6 on)."""
    if df <= 1:
        return math.tan(math.pi * (p - 0.5))
    if df <= 2:
        return (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))
    z = statistics.NormalDist().inv_cdf(p)
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4)
    )


def widening(domains: Sequence[str], weights: dict[str, float], confidence: float = 0.95) -> float:
    """How much wider than its percentile interval a bootstrap over few prompts must be to hold its confidence.

    The percentile interval of a mean over n prompts is too narrow twice over: a resample's variance is (n-1)/n of the
    sampling variance, and it takes the normal's quantile where the spread itself is estimated (Student's t with n-1
    degrees of freedom). Hesterberg's expanded percentile interval widens it by
        f = t_{n-1} · sqrt(n / (n-1)) / z                  (1.35 at n = 7, 1.01 at n = 120).
    A mix of domains is a stratified mean, sum_d c_d · x_d with c_d the domains' shares of `weights`; with the same
    per-prompt spread in every domain its variance bias is sum c_d^2 (n_d-1)/n_d^2 against sum c_d^2 / n_d, and its
    degrees of freedom are Welch-Satterthwaite's: (sum c_d^2/n_d)^2 / sum c_d^4 / (n_d^2 (n_d-1)). A domain of one
    prompt has no spread to estimate: the factor is infinite."""
    counts = {d: n for d, n in Counter(domains).items() if weights.get(d, 0) > 0}
    if not counts:
        return 1.0
    if min(counts.values()) < 2:
        return math.inf
    total = sum(weights[d] for d in counts)
    c2 = {d: (weights[d] / total) ** 2 for d in counts}
    variance = sum(c2[d] / n for d, n in counts.items())
    resampled = sum(c2[d] * (n - 1) / n**2 for d, n in counts.items())
    df = variance**2 / sum(c2[d] ** 2 / (n**2 * (n - 1)) for d, n in counts.items())
    p = 0.5 + confidence / 2
    return t_quantile(p, df) * math.sqrt(variance / resampled) / statistics.NormalDist().inv_cdf(p)


def half_width_text(rel_half_width: float) -> str:
    """A relative 95% half-width as the notes say it; a domain of one prompt has none."""
    return (
        f"within ±{rel_half_width:.1%} (95%)"
        if math.isfinite(rel_half_width)
        else "without an interval (one prompt: no spread to bootstrap)"
    )


def widened(center: np.ndarray, resampled: np.ndarray, factor: float, confidence: float = 0.95, cap=None) -> np.ndarray:
    """[..., 2]: the percentile interval of `resampled` ([R, ...], one row per resample) widened about `center` by
    `factor` (`widening`), never narrower than the percentiles, and with `cap` kept inside [1, cap] (a figure's range);
    unbounded where the factor is (one prompt)."""
    if math.isinf(factor):
        return np.stack([np.full_like(center, -math.inf), np.full_like(center, math.inf)], axis=-1)
    tail = 50 * (1 - confidence)
    low, high = np.percentile(resampled, [tail, 100 - tail], axis=0)
    low, high = np.minimum(low, center), np.maximum(high, center)
    out = np.stack([center - factor * (center - low), center + factor * (high - center)], axis=-1)
    return out if cap is None else np.clip(out, 1.0, cap)


def figures(
    sums: dict[str, np.ndarray], domains: Sequence[str], weights: dict[str, float], *, resamples: int = 0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens per forward and vLLM's mean AL per D for a mix of domains (`draws` on the prompts as they are), and with
    `resamples` their 95% bootstrap intervals (the 2.5 / 97.5 percentiles of `draws`' resamples, `widened` for the
    prompts' count)."""
    point_tpf, point_al = (x[0] for x in draws(sums, domains, weights))
    if not resamples:
        return point_tpf, point_al
    tpf, al = draws(sums, domains, weights, resamples=resamples, seed=seed)
    factor = widening(domains, weights)
    cap = 1.0 + np.arange(len(point_tpf), dtype=float)[:, None]  # both figures lie in [1, 1 + D] by definition
    return point_tpf, point_al, widened(point_tpf, tpf, factor, cap=cap), widened(point_al, al, factor, cap=cap)
