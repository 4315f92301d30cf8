"""The device's drift taken out of interleaved verify visits (profiles/drift.py), on a simulated shared machine:
cells with known times, visited in shuffled rounds while the device's level wanders (an AR(1) process on log-time)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from specdec_tune.profiles import drift
from specdec_tune.profiles.intervals import design_effect, pooled_rel_sd
from specdec_tune.profiles.verify_curve import Noise, _cell_interval, fit_verify_visits

CELLS = [(B, 128, t) for B in (1, 2, 4, 8) for t in range(1, 5)]
DECISION = [(1, 128, 1), (1, 128, 3), (4, 128, 1), (4, 128, 2)]
SLOW_SHAPE = (2, 128, 3)  # twice its neighbours in every visit: a slow kernel shape, not drift


def truth() -> dict:
    ms = {c: 10.0 * c[0] ** 0.5 * (1 + 0.1 * c[2]) for c in CELLS}
    ms[SLOW_SHAPE] *= 2
    return ms


def simulate(seed: int, rounds: int = 6, extra: int = 10, slow: float = 1.3) -> list:
    """`rounds` shuffled rounds over every cell, then `extra` rounds over the decision cells alone while the device runs
    `slow`x slower (a profile's refinement, minutes after the rest): ((B, ctx, t), [3 samples ms]) per visit."""
    rng, ms, level, timed = random.Random(seed), truth(), 0.0, []

    def visit(cell, extra_level=0.0):
        nonlocal level
        level = 0.85 * level + math.sqrt(1 - 0.85**2) * rng.gauss(0, 0.12)
        timed.append((cell, [ms[cell] * math.exp(level + extra_level + rng.gauss(0, 0.03)) for _ in range(3)]))

    for _ in range(rounds):
        for cell in rng.sample(CELLS, len(CELLS)):
            visit(cell)
    for _ in range(extra):
        for cell in rng.sample(DECISION, len(DECISION)):
            visit(cell, math.log(slow))
    return timed


def pooled(timed) -> dict:
    out: dict = {}
    for cell, ms in timed:
        out.setdefault(cell, []).extend(ms)
    return out


def worst_cell_error(samples: dict) -> float:
    """The largest |ln(estimate / truth)| over the cells, after the common level (which no decision reads) is
    removed."""
    ms = truth()
    errors = {c: math.log(statistics.median(s) / ms[c]) for c, s in samples.items()}
    common = statistics.median(errors.values())
    return max(abs(e - common) for e in errors.values())


def test_a_slow_spell_during_the_refinement_is_taken_out_of_the_cells_it_landed_on():
    for seed in range(5):
        timed = simulate(seed)
        raw, corrected = pooled(timed), drift.corrected(timed)
        assert corrected.applied and max(corrected.levels) > 1.15  # the slow spell was seen
        assert worst_cell_error(corrected.samples) < 0.6 * worst_cell_error(raw)
        assert worst_cell_error(corrected.samples) < 0.1
        assert pooled_rel_sd(corrected.samples.values()) < 0.8 * pooled_rel_sd(raw.values())


def test_a_cell_slow_in_every_visit_stays_slow():
    for seed in range(5):
        samples = drift.corrected(simulate(seed)).samples
        neighbour = statistics.median(samples[(2, 128, 2)])
        assert (
            1.8 < statistics.median(samples[SLOW_SHAPE]) / neighbour * (1.2 / 1.3) < 2.2
        )  # 2 in truth; 1.08 if taken out


def test_too_few_visits_leave_the_samples_as_timed():
    timed = simulate(0)[:6]
    corrected = drift.corrected(timed)
    assert not corrected.applied and corrected.levels == [1.0] * 6
    assert corrected.samples == pooled(timed)


def test_a_cells_interval_counts_a_visits_samples_as_less_than_three_and_covers_the_truth():
    """Over 30 simulated profiles, a cell's 95% interval (drift-corrected samples, the shared noise at n / design
    effect samples) holds the cell's true time at the measurement's typical speed at least 93% of the time (96.7%,
    median half-width 6%, design effect 2.7). Counting
    each sample as one (the three of a visit share its level) it held it 88% of the time; uncorrected, 73% (the slow
    spell biases the decision cells)."""
    ms, hits, total = truth(), 0, 0
    for seed in range(30):
        corrected = drift.corrected(simulate(seed))
        noise = Noise(pooled_rel_sd(corrected.samples.values()), design_effect(corrected.visits.values()))
        assert 1.5 < noise.design_effect < 3  # the drift left after correction is shared by a visit's three samples
        common = statistics.median(math.log(statistics.median(s) / ms[c]) for c, s in corrected.samples.items())
        for c in CELLS:
            low, high = _cell_interval(corrected.samples[c], noise)
            hits += low <= ms[c] * math.exp(common) <= high
            total += 1
    assert hits / total >= 0.93


def test_the_design_effect_of_independent_samples_is_one_and_of_copies_their_count():
    rng = random.Random(0)
    independent = [[[math.exp(rng.gauss(0, 0.05)) for _ in range(3)] for _ in range(8)] for _ in range(20)]
    assert design_effect(independent) == pytest.approx(1.0, abs=0.25)
    copies = [[[x] * 3 for x in (math.exp(rng.gauss(0, 0.05)) for _ in range(8))] for _ in range(20)]
    assert design_effect([[[y * (1 + 1e-9 * i) for i, y in enumerate(v)] for v in c] for c in copies]) == pytest.approx(
        3.0, abs=1e-3
    )
    assert design_effect([[[1.0, 1.1, 0.9]]]) == 1.0  # one visit: nothing says


def test_the_fit_records_the_cells_as_timed_and_the_correction():
    timed = simulate(1)
    points, fit = fit_verify_visits(timed, {}, [1, 2, 4, 8], [128], 4)
    raw = pooled(timed)
    by = {(p["batch"], p["ctx"], p["tokens"]): p for p in points}
    assert all(by[c]["uncorrected_median_ms"] == statistics.median(raw[c]) for c in CELLS)
    assert fit["drift"]["applied"] and fit["drift"]["window_visits"] == drift.WINDOW
    assert fit["pooled_rel_sd"] < fit["pooled_rel_sd_uncorrected"]
    assert fit["visits"] == len(timed)
