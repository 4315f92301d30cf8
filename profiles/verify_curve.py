"""The verify curve T_verif(B, 1+D, ctx): how it is measured on a shared machine, and how it is fitted.

VerifyStep     one target forward of B rows x t new tokens on a static KV cache holding `ctx` tokens: the unit
VerifySampler  every (B, ctx, 1+D) cell visited in shuffled rounds (seeds, bisection where a line misses by more
               than the tolerance and the noise, repeats until the median's 95% interval is tight), the device's
               drift taken out of every visit (profiles/drift.py); `refine` gives the decision cells more visits
fit_verify     the monotone fit (non-decreasing in 1+D, batch and context) the cost model reads, raw values kept
remeasure      more visits to cells of a written profile, the curve fitted again and profile.json rewritten: the
               profile stage's API for a later stage that finds a cell suspect
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles import drift
from specdec_tune.profiles.fingerprint import resolve_device
from specdec_tune.profiles.intervals import (
    design_effect,
    median_interval,
    monotone_fit,
    moved_beyond_interval,
    pooled_half_width,
    pooled_rel_sd,
)
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.schema import Profile, load_profile
from specdec_tune.profiles.store import MeasurementLog
from specdec_tune.profiles.timing import Timing, is_out_of_memory, time_call
from specdec_tune.records import write_json
from specdec_tune.settings import ProfileSettings


def adaptive_sample(
    measure, lo: int, hi: int, tolerance: float, seeds: list[int], noise=lambda x: 0.0
) -> dict[int, float | None]:
    """Measure y(x) at `seeds`, then bisect each gap whose midpoint differs from the straight line by more than the
    tolerance and more than the noise: the midpoint's 95% half-width `noise(m)` (ms) plus the line's there (the mean of
    its ends'). A miss inside the noise is not a bend, and on a noisy machine would bisect every gap.

    `measure(x)` returns milliseconds or None (infeasible: nothing larger is tried). Returns {x: y}.
    """
    ys: dict[int, float | None] = {}
    for x in sorted({lo, hi, *(s for s in seeds if lo <= s <= hi)}):
        ys[x] = measure(x)
        if ys[x] is None:
            return ys
    stack = [(a, b) for a, b in zip(sorted(ys), sorted(ys)[1:])]
    while stack:
        a, b = stack.pop()
        if b - a < 2:
            continue
        m = (a + b) // 2
        ys[m] = ym = measure(m)
        if ym is None:
            continue
        ya, yb = ys[a], ys[b]
        assert ya is not None and yb is not None  # a gap lies between measured points (None ends the seeds, or no gap)
        line = ya + (yb - ya) * (m - a) / (b - a)
        if abs(ym - line) > max(tolerance * ym, noise(m) + (noise(a) + noise(b)) / 2):
            stack += [(a, m), (m, b)]
    return ys


def fill_curve(measured: Mapping[int, float | None], xs: range) -> list[tuple[int, float | None, str]]:
    """(x, y, source) for every x: measured where measured, linear between measured neighbours, else infeasible."""
    known = {x: y for x, y in measured.items() if y is not None}
    ok = sorted(known)
    out = []
    for x in xs:
        if x in measured:
            out.append((x, measured[x], "measured" if measured[x] is not None else "infeasible"))
            continue
        left = max((p for p in ok if p < x), default=None)
        right = min((p for p in ok if p > x), default=None)
        if left is None or right is None:
            out.append((x, None, "infeasible"))
        else:
            y = known[left] + (known[right] - known[left]) * (x - left) / (right - left)
            out.append((x, y, "interpolated"))
    return out


def _timing_unless_oom(
    fn, device: torch.device, warmup: int = 2, repeats: int = 5, max_total_ms: float = float("inf")
) -> Timing | None:
    """time_call's figures, or None when the call runs out of memory (recorded as infeasible)."""
    try:
        return time_call(fn, device=device, warmup=warmup, repeats=repeats, max_total_ms=max_total_ms)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def time_unless_oom(fn, device: torch.device, warmup: int = 2, max_total_ms: float = float("inf")) -> dict | None:
    timing = _timing_unless_oom(fn, device, warmup, max_total_ms=max_total_ms)
    return timing.as_dict() if timing else None


class VerifyStep:
    """One target forward of B rows × t new tokens on a static KV cache already holding `ctx` random tokens,
    as a serving engine runs it: the verify curve's unit of measurement."""

    @torch.inference_mode()
    def __init__(
        self, model, batch: int, ctx: int, max_tokens: int, seed: int = 0, device: torch.device | None = None
    ) -> None:
        self.model, self.batch = model, batch
        self.device = device or next(model.parameters()).device
        self.generator = torch.Generator().manual_seed(seed)
        self.start = torch.full((batch,), ctx, dtype=torch.long, device=self.device)
        try:
            self.cache = model.new_cache(batch, ctx + max_tokens + 1)
            prompt = torch.randint(0, model.config.vocab_size, (batch, ctx), generator=self.generator).to(self.device)
            model(prompt, self.cache, torch.zeros(batch, dtype=torch.long, device=self.device), logits="none")
            self.ready = True
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            self.ready = False  # infeasible at this batch and context

    @torch.inference_mode()
    def timing(self, tokens: int, warmup: int = 2, repeats: int = 5) -> Timing | None:
        ids = torch.randint(0, self.model.config.vocab_size, (self.batch, tokens), generator=self.generator).to(
            self.device
        )
        return _timing_unless_oom(lambda: self.model(ids, self.cache, self.start), self.device, warmup, repeats)

    def time(self, tokens: int) -> dict | None:
        timing = self.timing(tokens)
        return timing.as_dict() if timing else None


def time_verify_step(model, batch: int, ctx: int, tokens: int, seed: int = 0) -> dict | None:
    """time_call's figures for one verify step (None when it does not fit in memory)."""
    step = VerifyStep(model, batch, ctx, tokens, seed)
    return step.time(tokens) if step.ready else None


VERIFY_BUDGET_SHARE = 0.18  # of the budget left when the verify phase starts
VERIFY_TARGET_REL_HALF_WIDTH = (
    0.03  # a cell is repeated until its median's 95% interval is this tight (or the share ends)
)
VERIFY_SAMPLES_PER_VISIT = 3
# Decision cells: once acceptance is known, the verify cells that each batch bucket's choice of D rests on (1+D for the
# `REFINE_CANDIDATES` best D by the speedup bound, and 1) get more visits, in shuffled rounds, until each median's 95%
# interval is `REFINE_TARGET_REL_HALF_WIDTH` tight or it has `REFINE_VISITS_FACTOR` x --verify-visits visits. Two draft
# lengths tie when their difference is inside the noise (autotune/space.py): a few samples per cell on a drifting
# machine made most real differences ties.
REFINE_CANDIDATES = 3
REFINE_TARGET_REL_HALF_WIDTH = 0.015
REFINE_VISITS_FACTOR = 4  # a decision cell's visits may reach this many times --verify-visits (default 6: 24)
# of the budget left when acceptance growth starts (it takes prompts from growth); what growth leaves goes to the
# same cells
REFINE_BUDGET_SHARE = 0.1
FIT_MAX_SWEEPS = 3000  # of Dykstra's projections (a 16 x 5 x 2 grid: ~2 ms each; noisy grids need a few hundred)


class VerifySampler:
    """Measures the verify curve the way a shared machine allows: interleaved, shuffled, repeated.

    A visit times one cell (B, ctx, 1+D): one warm-up call, then `VERIFY_SAMPLES_PER_VISIT` timed calls, logged
    under its own key so that a killed run resumes. Rounds of visits run in a shuffled order over every cell
    (a slow spell then lands on random cells of every batch and context, not on one curve's neighbours), and the
    device's drift, what the visits around one share, is taken out of every visit (`drift.corrected`):
      1. the seeds in 1+D (and 1, 1+D_max) for every (B, ctx);
      2. bisection: the midpoint of each gap whose straight line misses the midpoint by more than the tolerance and
         more than the noise (the midpoint's interval and the line's);
      3. repeats: another visit for every cell whose median's 95% interval is wider than the target,
         until all are tight, a cell has `verify_visits` visits, or the phase's share of the budget ends.
    Each cell's figures pool the (drift-corrected) samples of all its visits. A cell that runs out of memory is
    infeasible, with every larger 1+D of its (B, ctx).
    """

    def __init__(
        self, model, settings: ProfileSettings, device: torch.device, log: MeasurementLog, seeds: list[int], t_max: int
    ) -> None:
        self.model, self.s, self.device, self.log, self.t_max = model, settings, device, log, t_max
        self.seeds = sorted({1, t_max, *(x for x in seeds if x <= t_max)})
        self.timed: list[
            tuple[tuple[int, int, int], list[float]]
        ] = []  # ((B, ctx, t), ms as timed) per visit, in visit order
        self._corrected: tuple[int, drift.Corrected[tuple[int, int, int]]] | None = (
            None  # (visits it covers, the correction)
        )
        self.infeasible: dict[tuple[int, int], int] = {}  # (B, ctx) -> smallest t that ran out of memory
        self.visits = 0
        self.steps: dict[tuple[int, int], VerifyStep] = {}
        self.rng = random.Random(settings.seed)

    def _step(self, B: int, ctx: int) -> VerifyStep | None:
        if (B, ctx) not in self.steps:
            step = VerifyStep(self.model, B, ctx, self.t_max, self.s.seed, self.device)
            if (
                not step.ready and self.steps
            ):  # the other cells' caches may be what does not fit: free them, try once more
                self.steps.clear()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                step = VerifyStep(self.model, B, ctx, self.t_max, self.s.seed, self.device)
            if not step.ready:
                return None
            self.steps[(B, ctx)] = step
        return self.steps[(B, ctx)]

    def _visit(self, B: int, ctx: int, t: int) -> None:
        if t >= self.infeasible.get((B, ctx), t + 1):
            return
        n = visits_of(self.timed, (B, ctx, t))  # visits so far: the log key of this one

        def measure():
            step = self._step(B, ctx)
            timing = step.timing(t, warmup=1, repeats=VERIFY_SAMPLES_PER_VISIT) if step else None
            return list(timing.samples_ms) if timing else None

        samples = self.log.measure(f"verify/{B}/{ctx}/{t}/visit{n}", measure)
        self.visits += 1
        if samples is None:
            self.infeasible[(B, ctx)] = min(t, self.infeasible.get((B, ctx), t))
        else:
            self.timed.append(((B, ctx, t), samples))

    @property
    def corrected(self) -> drift.Corrected[tuple[int, int, int]]:
        """`drift.corrected` over every visit so far (computed again once a visit was added)."""
        if self._corrected is None or self._corrected[0] != len(self.timed):
            self._corrected = (len(self.timed), drift.corrected(self.timed))
        return self._corrected[1]

    @property
    def samples(self) -> dict[tuple[int, int, int], list[float]]:
        """(B, ctx, t) -> ms at the device's typical speed over the measurement, every visit pooled."""
        return self.corrected.samples

    def fit(self) -> tuple[list[dict], dict]:
        """The verify curve over every visit so far (`fit_verify`)."""
        return fit_verify_visits(self.timed, self.infeasible, self.s.batch_buckets, self.s.ctx_buckets, self.t_max)

    def _round(self, visits: list[tuple[int, int, int]], deadline: float | None = None) -> None:
        self.rng.shuffle(visits)
        for B, ctx, t in visits:
            if deadline is not None and time.monotonic() > deadline:
                return
            self._visit(B, ctx, t)

    def median(self, B: int, ctx: int, t: int) -> float | None:
        samples = self.samples.get((B, ctx, t))
        return statistics.median(samples) if samples else None

    def noise(self) -> Noise:
        """The noise all cells share, now."""
        return Noise(pooled_rel_sd(self.samples.values()), design_effect(self.corrected.visits.values()))

    def half_width(self, B: int, ctx: int, t: int, noise: Noise) -> float:
        """Half the width of the cell's median's 95% interval (ms)."""
        low, high = _cell_interval(self.samples[(B, ctx, t)], noise)
        return (high - low) / 2

    def run(self, deadline: float) -> None:
        cells = [(B, ctx) for ctx in self.s.ctx_buckets for B in self.s.batch_buckets]
        self._round([(B, ctx, t) for B, ctx in cells for t in self.seeds])
        gaps = {cell: list(zip(self.seeds, self.seeds[1:])) for cell in cells}
        while any(gaps.values()):  # bisection, one level per round
            todo = [(B, ctx, (a + b) // 2) for (B, ctx), pairs in gaps.items() for a, b in pairs if b - a >= 2]
            self._round(todo)
            noise = self.noise()  # once a round: every gap's noise test reads it
            for (B, ctx), pairs in gaps.items():
                nxt = []
                for a, b in (p for p in pairs if p[1] - p[0] >= 2):
                    m = (a + b) // 2
                    ya, ym, yb = self.median(B, ctx, a), self.median(B, ctx, m), self.median(B, ctx, b)
                    if ya is None or ym is None or yb is None:
                        continue
                    spread = (
                        self.half_width(B, ctx, m, noise)
                        + (self.half_width(B, ctx, a, noise) + self.half_width(B, ctx, b, noise)) / 2
                    )
                    if abs(ym - (ya + (yb - ya) * (m - a) / (b - a))) > max(self.s.interp_tolerance * ym, spread):
                        nxt += [(a, m), (m, b)]
                gaps[(B, ctx)] = nxt
        while time.monotonic() < deadline:  # repeats where the interval is still wide
            noise = self.noise()
            wide = [
                key
                for key, visits in self.corrected.visits.items()
                if len(visits) < self.s.verify_visits
                and _rel_half_width(self.samples[key], noise) > VERIFY_TARGET_REL_HALF_WIDTH
            ]
            if not wide:
                break
            self._round(wide, deadline)
        self.steps.clear()

    def refine(self, cells: list[tuple[int, int, int]], deadline: float) -> None:
        """More visits to `cells` (B, ctx, t), measured or not yet, in shuffled rounds until each is tight
        (`REFINE_TARGET_REL_HALF_WIDTH`), has `REFINE_VISITS_FACTOR` x --verify-visits visits, runs out of memory, or
        the deadline passes."""
        most = REFINE_VISITS_FACTOR * self.s.verify_visits

        def open_(cell, noise):
            visits = self.corrected.visits.get(cell, [])
            return cell[2] < self.infeasible.get(cell[:2], cell[2] + 1) and (
                not visits
                or (len(visits) < most and _rel_half_width(self.samples[cell], noise) > REFINE_TARGET_REL_HALF_WIDTH)
            )

        while time.monotonic() < deadline:
            noise = self.noise()  # once a round
            todo = [c for c in cells if open_(c, noise)]
            if not todo:
                break
            self._round(todo, deadline)
        self.steps.clear()


def visits_of(timed: list[tuple[tuple[int, int, int], list[float]]], cell: tuple[int, int, int]) -> int:
    """How many of the logged visits `timed` ((B, ctx, t), ms) are of `cell`."""
    return sum(c == cell for c, _ in timed)


@dataclasses.dataclass(frozen=True)
class Noise:
    """What all verify cells share: the relative sd of one sample (`pooled_rel_sd`; None where no cell says) and how
    many samples count as one (`design_effect`: a visit's calls run back to back and share its level)."""

    rel_sd: float | None
    design_effect: float = 1.0


def _rel_half_width(samples: list[float], noise: Noise) -> float:
    """Relative half-width of a cell's median (`_cell_interval`)."""
    low, high = _cell_interval(samples, noise)
    return (high - low) / 2 / statistics.median(samples)


def _cell_interval(samples: list[float], noise: Noise) -> tuple[float, float]:
    """A cell's 95% interval of its median: the order statistics' (`median_interval`), widened to the shared noise's
    (`pooled_half_width` at n / design effect samples): three close samples, one visit, are not a tight cell."""
    low, high = median_interval(samples)
    if noise.rel_sd:
        median = statistics.median(samples)
        h = pooled_half_width(len(samples) / noise.design_effect, noise.rel_sd, median)
        low, high = min(low, median - h), max(high, median + h)
    return low, high


def fit_verify_visits(
    timed: list[tuple[tuple[int, int, int], list[float]]],
    infeasible: dict[tuple[int, int], int],
    batches,
    ctxs,
    t_max: int,
) -> tuple[list[dict], dict]:
    """`fit_verify` over visits in the order they were timed ((B, ctx, t), ms): the device's drift taken out first
    (`drift.corrected`), each cell's median as timed kept beside (`uncorrected_median_ms`)."""
    corrected = drift.corrected(timed)
    uncorrected: dict[tuple[int, int, int], list[float]] = {}
    for cell, ms in timed:
        uncorrected.setdefault(cell, []).extend(ms)
    points, fit = fit_verify(
        corrected.samples,
        infeasible,
        batches,
        ctxs,
        t_max,
        len(timed),
        visit_design_effect=design_effect(corrected.visits.values()),
    )
    for p in points:
        if (cell := (p["batch"], p["ctx"], p["tokens"])) in uncorrected and p.get("raw_median_ms") is not None:
            p["uncorrected_median_ms"] = statistics.median(uncorrected[cell])
    return points, fit | {
        "drift": corrected.summary(),
        "pooled_rel_sd_uncorrected": pooled_rel_sd(uncorrected.values()),
    }


def fit_verify(
    samples: dict[tuple[int, int, int], list[float]],
    infeasible: dict[tuple[int, int], int],
    batches,
    ctxs,
    t_max: int,
    visits: int,
    visit_design_effect: float = 1.0,
) -> tuple[list[dict], dict]:
    """The verify curve's points: raw medians with their intervals, and the monotone fit the cost model reads.

    More tokens, more rows or a longer cache never make a forward cheaper: the fit is the weighted least-squares
    projection onto arrays non-decreasing in 1+D, batch and context (`intervals.monotone_fit`), each measured
    cell weighted by 1 / (half-width of its interval)^2, the cells between measured 1+D weightless (they take the
    line between their neighbours, then whatever keeps the order). A measured cell whose fitted value leaves its
    interval disagreed with its neighbours: its source becomes `fitted` and it is listed in `verify_fit`.
    """
    grid = np.full((t_max, len(batches), len(ctxs)), np.nan)
    weight = np.zeros_like(grid)
    timings: dict[tuple[int, int, int], Timing] = {}
    noise = Noise(pooled_rel_sd(samples.values()), visit_design_effect)
    for bi, B in enumerate(batches):
        for ci, ctx in enumerate(ctxs):
            measured = {
                t: statistics.median(samples[(B, ctx, t)]) for t in range(1, t_max + 1) if (B, ctx, t) in samples
            }
            limit = infeasible.get((B, ctx), t_max + 1)
            for t, y, source in fill_curve(measured, range(1, limit)):
                if y is None:
                    continue
                grid[t - 1, bi, ci] = y
                if source == "measured":
                    timing = Timing.of(samples[(B, ctx, t)])
                    low, high = _cell_interval(samples[(B, ctx, t)], noise)
                    timings[(B, ctx, t)] = timing = dataclasses.replace(timing, ci_low_ms=low, ci_high_ms=high)
                    weight[t - 1, bi, ci] = (
                        1.0 / max((timing.ci_high_ms - timing.ci_low_ms) / 2, 0.005 * timing.median_ms) ** 2
                    )
    with warnings.catch_warnings(record=True) as unconverged:  # still monotone, within tol of optimal: recorded below
        warnings.simplefilter("always")
        fitted = monotone_fit(grid, weight, max_iter=FIT_MAX_SWEEPS) if np.isfinite(grid).any() else grid
    points, moved = [], []
    for bi, B in enumerate(batches):
        for ci, ctx in enumerate(ctxs):
            limit = infeasible.get((B, ctx), t_max + 1)
            rel = {
                t: (tm.ci_high_ms - tm.ci_low_ms) / 2 / tm.median_ms
                for (b, c, t), tm in timings.items()
                if (b, c) == (B, ctx)
            }
            for t in range(1, t_max + 1):
                y = float(fitted[t - 1, bi, ci]) if t < limit and np.isfinite(grid[t - 1, bi, ci]) else None
                point = {
                    "batch": B,
                    "tokens": t,
                    "ctx": ctx,
                    "median_ms": y,
                    "source": "infeasible" if y is None else "interpolated",
                }
                tm = timings.get((B, ctx, t))
                if tm is not None:
                    assert y is not None  # a measured cell is on the grid, below the infeasible limit
                    is_moved = moved_beyond_interval(tm.median_ms, y, tm.ci_low_ms, tm.ci_high_ms)
                    point |= {
                        "raw_median_ms": tm.median_ms,
                        "p10_ms": tm.p10_ms,
                        "p90_ms": tm.p90_ms,
                        "repeats": tm.repeats,
                        "ci_low_ms": min(tm.ci_low_ms, y),
                        "ci_high_ms": max(tm.ci_high_ms, y),
                        "fit_moved": is_moved,
                        "source": "fitted" if is_moved else "measured",
                    }
                    if is_moved:
                        moved.append(
                            {
                                "batch": B,
                                "tokens": t,
                                "ctx": ctx,
                                "raw_ms": tm.median_ms,
                                "fitted_ms": y,
                                "interval_ms": [tm.ci_low_ms, tm.ci_high_ms],
                            }
                        )
                elif y is not None and rel:  # between measured 1+D: the neighbours' relative half-width, interpolated
                    lo = max((x for x in rel if x < t), default=None)
                    hi = min((x for x in rel if x > t), default=None)
                    if lo is None or hi is None:  # measured 1+D on one side only: the nearest one's
                        nearest = lo if hi is None else hi
                        assert nearest is not None  # rel is not empty
                        h = rel[nearest]
                    else:
                        h = rel[lo] + (rel[hi] - rel[lo]) * (t - lo) / (hi - lo)
                    point |= {"ci_low_ms": y * (1 - h), "ci_high_ms": y * (1 + h)}
                points.append(point)
    measured_cells = len(timings)
    widths = [(tm.ci_high_ms - tm.ci_low_ms) / 2 / tm.median_ms for tm in timings.values()]
    summary = {
        "method": "weighted isotonic regression, non-decreasing in 1+D, batch and context "
        "(Dykstra's projections over PAVA); "
        "weights 1 / half-width^2 of each median's 95% interval (the order statistics' interval of its samples, "
        "drift-corrected where the visits' order is known, widened to the half-width the noise all cells share "
        "gives at the cell's sample count over the design effect of samples timed in visits)",
        "pooled_rel_sd": noise.rel_sd,
        "design_effect": visit_design_effect,
        "visits": visits,
        "samples_per_visit": VERIFY_SAMPLES_PER_VISIT,
        "cells_measured": measured_cells,
        "target_rel_half_width": VERIFY_TARGET_REL_HALF_WIDTH,
        "cells_above_target": sum(w > VERIFY_TARGET_REL_HALF_WIDTH for w in widths),
        "median_rel_half_width": statistics.median(widths) if widths else None,
        "moved_beyond_interval": moved,
        "converged": not unconverged,
    }
    return points, summary


def remeasure(
    profile_path: Path, verify_cells: list[tuple[int, int, int]], visits: int = 2
) -> tuple[Profile, list[dict]]:
    """Measure verify cells of a written profile again and refit its curve; profile.json is rewritten atomically.

    `verify_cells` are (batch, tokens, ctx). Each gets `visits` more visits (appended to the profile's measurement log
    under the next visit numbers, so the log keeps every sample); its figures then pool old and new samples, and the
    whole curve is fitted again (`fit_verify`). Returns the new profile and, per cell, its value before and after.
    """
    profile = load_profile(profile_path)
    if profile.device.get("projected_from"):
        raise SpecdecError(
            f"{profile_path} is projected onto {profile.device.get('name')}: its cells were never measured here",
            "re-measure the profile it was projected from",
        )
    log = MeasurementLog(profile_path.parent, profile.fingerprint)
    timed: list[tuple[tuple[int, int, int], list[float]]] = []  # in the order the visits were logged
    for key, value in log.items("verify/"):
        _, batch, context, tokens, _visit = key.split("/")
        if value is not None:
            timed.append(((int(batch), int(context), int(tokens)), value))
    w = profile.workload
    t_max = w.max_draft_len + 1
    infeasible: dict[tuple[int, int], int] = {}
    for p in profile.verify:
        if p.source == "infeasible":
            infeasible[(p.batch, p.ctx)] = min(p.tokens, infeasible.get((p.batch, p.ctx), p.tokens))
    device = resolve_device("cuda" if profile.device.get("kind") == "cuda" else "cpu")
    target = load_model(profile.target["path"], dtype=profile.device.get("dtype", "auto"), device=str(device))
    before = {(p.batch, p.tokens, p.ctx): p.median_ms for p in profile.verify}
    steps: dict[tuple[int, int], VerifyStep] = {}
    for B, _t, ctx in verify_cells:
        if (B, ctx) not in steps:
            steps[(B, ctx)] = VerifyStep(target.model, B, ctx, t_max, 0, device)
    for B, t, ctx in [
        cell for _ in range(visits) for cell in verify_cells
    ]:  # interleaved: the drift is told from the cells
        n = visits_of(timed, (B, ctx, t))

        def measure(step=steps[(B, ctx)], t=t):
            timing = step.timing(t, warmup=1, repeats=VERIFY_SAMPLES_PER_VISIT) if step.ready else None
            return list(timing.samples_ms) if timing else None

        value = log.measure(f"verify/{B}/{ctx}/{t}/visit{n}", measure)
        if value is not None:
            timed.append(((B, ctx, t), value))
    points, fit = fit_verify_visits(timed, infeasible, w.batch_buckets, w.ctx_buckets, t_max)
    data = profile.model_dump(mode="json") | {"verify": points, "verify_fit": fit}
    updated = Profile.model_validate(data)
    write_json(profile_path, updated.model_dump(mode="json"))
    after = {(p.batch, p.tokens, p.ctx): p for p in updated.verify}
    changes = [
        {
            "batch": B,
            "tokens": t,
            "ctx": ctx,
            "before_ms": before.get((B, t, ctx)),
            "after_ms": after[(B, t, ctx)].median_ms,
            "source": after[(B, t, ctx)].source,
        }
        for B, t, ctx in verify_cells
        if (B, t, ctx) in after
    ]
    return updated, changes
