"""`specdec-tune profile`: measure the target, its drafters and the device into `profile.json`.

Phases, in order (the budget counts from the command's start, imports and model loading included; a short --budget-minutes drops what is left and says so in `notes`):
  verify      T_verif(B, 1+D, ctx): every cell visited in shuffled rounds (seeds, bisection where a line misses by
              > tol, repeats until the median's 95% interval is tight), the device's drift taken out of every visit
              (profiles/drift.py), then fitted non-decreasing in 1+D, B and ctx
  draft       T_draft(B, D) per mechanism, one propose() as it runs (serial steps / one pass / lookups), on real text
  acceptance  greedy: replayed exactly at every D from the target's trajectories (profiles/replay.py), for every
              drafter in every weight format (FP8 / NVFP4 as fake-quantized weights: emulated)
  check       the loop against the replay on a sample: equal counters in fp32 (else the profile fails), the
              difference in the profile's dtype recorded
  host        loop time per round outside drafter and target, at the smallest and largest batch and the shortest
              and longest draft (interpolated between)
  micro       attention vs G*(1+D) rows per KV head; linear layers vs M = B*(1+D)
  loop        the speculative loop at D_max for temperatures > 0 (1 prompt per domain; with --acceptance loop, for
              everything), smaller D derived from its rounds
  refinement  the decision cells (per batch bucket: 1 and 1+D for the 3 D with the best speedup bound by the
              acceptance so far) get more visits until tight: a tenth of the budget left, and again whatever growth leaves
  more prompts  greedy acceptance grows per domain until tokens per forward is within ±half-width (95% bootstrap
              interval over prompts) at the D a plan could take, the split runs out, or the budget ends: it fills
              what the other phases left of the budget, adding only the prompts the replay's cost says fit

Every measurement is appended to a log as soon as it finishes (`store.MeasurementLog`): a killed
run resumes where it stopped, and a finished profile with the same fingerprint is reused.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from specdec_tune import SpecdecError, __version__
from specdec_tune.profiles import drift, intervals, micro, replay
from specdec_tune.profiles.calibration import CalibrationPrompt, load_calibration
from specdec_tune.profiles.drafters import Drafter, DraftRequest, create
from specdec_tune.profiles.fingerprint import device_factors, device_fingerprint, resolve_device
from specdec_tune.profiles.memory import allocator_peak_bytes, memory_record
from specdec_tune.profiles.intervals import (design_effect, median_interval, monotone_fit, moved_beyond_interval, pooled_half_width,
                                              pooled_rel_sd)
from specdec_tune.profiles.models.loading import load_model, model_folder, weights_hash
from specdec_tune.profiles.prompts import encode_fitting, encode_prompts
from specdec_tune.profiles.schema import SCHEMA_VERSION, Profile, finished_profile, load_profile
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.profiles.train_drafter import cached_demo_head  # noqa: F401  (registers it: head drafters without model= load it)
from specdec_tune.profiles.store import MeasurementLog
from specdec_tune.profiles.timing import SpeedGuard, Timing, is_out_of_memory, time_call
from specdec_tune.records import sha256_json, write_json
from specdec_tune.settings import ProfileSettings

BOOTSTRAP_RESAMPLES = 1000
# Prompts a round of growth adds, dealt round-robin over the domains whose interval is still wide (widest first): a
# round's trajectories decode together, and a prompt's trajectory costs 2.7x as much in a batch of 4 as in one of 32
# and 12% less again in one of 64 (demo target, 2-core CPU: 1.64-1.78, 0.61-0.71 and 0.62 s on 124- to 167-token
# prompts), so a round stays this large when few domains are left.
GROWTH_ROUND_PROMPTS = 64
FINISH_RESERVE_S = 5.0  # growth leaves this much of the budget to the acceptance records (bootstrap intervals) and the writing
FLAG_REL_DIFF = 0.05  # replay vs the loop in the profile's dtype: flag differences above this
DRAFT_CALLS_PER_POINT = 5 * 10  # time_call's repeats (at most 10x when they are short); the catch-up call warms up
HOST_NEW_TOKENS = 6  # the decode a host-overhead cell runs
HOST_PROMPT_TOKENS = 32  # of each prompt, its last: the host's work per round does not depend on the context (nor is the prefill timed)
# The target's greedy trajectories are generated this many prompts at a time: a decode step's cost grows little
# with rows until compute saturates (demo target, 2-core CPU, ctx 256: 34 ms per row at 8 rows, 8.6 at 64). Rows
# are sorted by prompt length so that a batch holds similar lengths; within it the prefill runs in length groups
# (`specdec.prefill_groups`): on a CPU the prefill is where the time goes.
TRAJECTORY_BATCH = 64
# The check of the replay against the loop decodes this many tokens per prompt: a loop round costs nearly the same
# for 2 rows as for 4 on a CPU (the forwards read the weights once per step), so 4 prompts x 16 tokens check as many
# tokens as 2 x 32 in half the time (demo pair, fp32: 3.4 against 5.7 s with n-gram, 10.2 against 20.2 s with the
# draft model).
CHECK_NEW_TOKENS = 16
DRAFT_POINT_MAX_MS = 500.0  # a draft-cost point stops repeating (after 3) once its calls span this: a serial draft of 7 steps at batch 8 takes half a second on a CPU




def workload_record(s: ProfileSettings, calibration, pool, domains: list[str], acceptance_batch: int, half_width: float) -> dict:
    """The profile's `workload`: what was measured, on which prompts (both backends)."""
    return {
        "calibration": calibration.name, "calibration_fingerprint": pool.fingerprint(), "split": "profile",
        "domains": domains, "prompts_per_domain": s.prompts_per_domain, "new_tokens": s.new_tokens,
        "temperatures": list(s.temperatures), "batch_buckets": list(s.batch_buckets), "ctx_buckets": list(s.ctx_buckets),
        "max_draft_len": s.max_draft_len, "acceptance_batch": acceptance_batch, "acceptance_half_width": half_width,
    }


def parse_drafter_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'draft_model:layers=6,model=/x' -> ('draft_model', {'layers': '6', 'model': '/x'})."""
    name, _, rest = spec.partition(":")
    options = {}
    for pair in filter(None, rest.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SpecdecError(f"drafter option {pair!r} in {spec!r} is not KEY=VALUE", "write --drafter draft_model:layers=6")
        options[key] = value
    return name, options


class Budget:
    """Wall-clock budget; phases past the deadline are skipped and named in the profile's notes."""

    def __init__(self, minutes: float, started: float | None = None) -> None:
        self.deadline = (time.monotonic() if started is None else started) + 60 * minutes
        self.skipped: list[str] = []

    def allows(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.skipped.append(what)
        return False


# ---------------------------------------------------------------------------- verify curve


def adaptive_sample(measure, lo: int, hi: int, tolerance: float, seeds: list[int], noise=lambda x: 0.0) -> dict[int, float | None]:
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
        ys[m] = measure(m)
        if ys[m] is None:
            continue
        line = ys[a] + (ys[b] - ys[a]) * (m - a) / (b - a)
        if abs(ys[m] - line) > max(tolerance * ys[m], noise(m) + (noise(a) + noise(b)) / 2):
            stack += [(a, m), (m, b)]
    return ys


def fill_curve(measured: dict[int, float | None], xs: range) -> list[tuple[int, float | None, str]]:
    """(x, y, source) for every x: measured where measured, linear between measured neighbours, else infeasible."""
    ok = sorted(x for x, y in measured.items() if y is not None)
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
            y = measured[left] + (measured[right] - measured[left]) * (x - left) / (right - left)
            out.append((x, y, "interpolated"))
    return out


def _timing_unless_oom(fn, device: torch.device, warmup: int = 2, repeats: int = 5, max_total_ms: float = float("inf")) -> Timing | None:
    """time_call's figures, or None when the call runs out of memory (recorded as infeasible)."""
    try:
        return time_call(fn, device=device, warmup=warmup, repeats=repeats, max_total_ms=max_total_ms)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def _time_unless_oom(fn, device: torch.device, warmup: int = 2, max_total_ms: float = float("inf")) -> dict | None:
    timing = _timing_unless_oom(fn, device, warmup, max_total_ms=max_total_ms)
    return timing.as_dict() if timing else None


class VerifyStep:
    """One target forward of B rows × t new tokens on a static KV cache already holding `ctx` random tokens,
    as a serving engine runs it: the verify curve's unit of measurement."""

    @torch.inference_mode()
    def __init__(self, model, batch: int, ctx: int, max_tokens: int, seed: int = 0, device: torch.device | None = None) -> None:
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
        ids = torch.randint(0, self.model.config.vocab_size, (self.batch, tokens), generator=self.generator).to(self.device)
        return _timing_unless_oom(lambda: self.model(ids, self.cache, self.start), self.device, warmup, repeats)

    def time(self, tokens: int) -> dict | None:
        timing = self.timing(tokens)
        return timing.as_dict() if timing else None


def time_verify_step(model, batch: int, ctx: int, tokens: int, seed: int = 0) -> dict | None:
    """time_call's figures for one verify step (None when it does not fit in memory)."""
    step = VerifyStep(model, batch, ctx, tokens, seed)
    return step.time(tokens) if step.ready else None


VERIFY_BUDGET_SHARE = 0.18  # of the budget left when the verify phase starts
VERIFY_TARGET_REL_HALF_WIDTH = 0.03  # a cell is repeated until its median's 95% interval is this tight (or the share ends)
VERIFY_SAMPLES_PER_VISIT = 3
# Decision cells: once acceptance is known, the verify cells that each batch bucket's choice of D rests on (1+D for the
# `REFINE_CANDIDATES` best D by the speedup bound, and 1) get more visits, in shuffled rounds, until each median's 95%
# interval is `REFINE_TARGET_REL_HALF_WIDTH` tight or it has `REFINE_VISITS_FACTOR` x --verify-visits visits. Two draft lengths tie when
# their difference is inside the noise (autotune/space.py): a few samples per cell on a drifting machine made most
# real differences ties.
REFINE_CANDIDATES = 3
REFINE_TARGET_REL_HALF_WIDTH = 0.015
REFINE_VISITS_FACTOR = 4  # a decision cell's visits may reach this many times --verify-visits (default 6: 24)
REFINE_BUDGET_SHARE = 0.1  # of the budget left when acceptance growth starts (it takes prompts from growth); what growth leaves goes to the same cells
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

    def __init__(self, profiler: Profiler, log: MeasurementLog, seeds: list[int], t_max: int) -> None:
        self.p, self.log, self.t_max = profiler, log, t_max
        self.seeds = sorted({1, t_max, *(x for x in seeds if x <= t_max)})
        self.timed: list[tuple[tuple[int, int, int], list[float]]] = []  # ((B, ctx, t), ms as timed) per visit, in visit order
        self._corrected: tuple[int, drift.Corrected] | None = None  # (visits it covers, the correction)
        self.infeasible: dict[tuple[int, int], int] = {}  # (B, ctx) -> smallest t that ran out of memory
        self.visits = 0
        self.steps: dict[tuple[int, int], VerifyStep] = {}
        self.rng = random.Random(profiler.s.seed)

    def _step(self, B: int, ctx: int) -> VerifyStep | None:
        if (B, ctx) not in self.steps:
            step = VerifyStep(self.p.model, B, ctx, self.t_max, self.p.s.seed, self.p.device)
            if not step.ready and self.steps:  # the other cells' caches may be what does not fit: free them, try once more
                self.steps.clear()
                if self.p.device.type == "cuda":
                    torch.cuda.empty_cache()
                step = VerifyStep(self.p.model, B, ctx, self.t_max, self.p.s.seed, self.p.device)
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
    def corrected(self) -> drift.Corrected:
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
        return fit_verify_visits(self.timed, self.infeasible, self.p.s.batch_buckets, self.p.s.ctx_buckets, self.t_max)

    def _round(self, visits: list[tuple[int, int, int]], deadline: float | None = None) -> None:
        self.rng.shuffle(visits)
        for i, (B, ctx, t) in enumerate(visits):
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
        cells = [(B, ctx) for ctx in self.p.s.ctx_buckets for B in self.p.s.batch_buckets]
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
                    if None in (ya, ym, yb):
                        continue
                    spread = self.half_width(B, ctx, m, noise) + (self.half_width(B, ctx, a, noise) + self.half_width(B, ctx, b, noise)) / 2
                    if abs(ym - (ya + (yb - ya) * (m - a) / (b - a))) > max(self.p.s.interp_tolerance * ym, spread):
                        nxt += [(a, m), (m, b)]
                gaps[(B, ctx)] = nxt
        while time.monotonic() < deadline:  # repeats where the interval is still wide
            noise = self.noise()
            wide = [key for key, visits in self.corrected.visits.items()
                    if len(visits) < self.p.s.verify_visits and _rel_half_width(self.samples[key], noise) > VERIFY_TARGET_REL_HALF_WIDTH]
            if not wide:
                break
            self._round(wide, deadline)
        self.steps.clear()

    def refine(self, cells: list[tuple[int, int, int]], deadline: float) -> None:
        """More visits to `cells` (B, ctx, t), measured or not yet, in shuffled rounds until each is tight
        (`REFINE_TARGET_REL_HALF_WIDTH`), has `REFINE_VISITS_FACTOR` x --verify-visits visits, runs out of memory, or the deadline passes."""
        most = REFINE_VISITS_FACTOR * self.p.s.verify_visits
        def open_(cell, noise):
            visits = self.corrected.visits.get(cell, [])
            return cell[2] < self.infeasible.get(cell[:2], cell[2] + 1) and (not visits or (
                len(visits) < most and _rel_half_width(self.samples[cell], noise) > REFINE_TARGET_REL_HALF_WIDTH))
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


def fit_verify_visits(timed: list[tuple[tuple[int, int, int], list[float]]], infeasible: dict[tuple[int, int], int], batches, ctxs,
                      t_max: int) -> tuple[list[dict], dict]:
    """`fit_verify` over visits in the order they were timed ((B, ctx, t), ms): the device's drift taken out first
    (`drift.corrected`), each cell's median as timed kept beside (`uncorrected_median_ms`)."""
    corrected = drift.corrected(timed)
    uncorrected: dict[tuple[int, int, int], list[float]] = {}
    for cell, ms in timed:
        uncorrected.setdefault(cell, []).extend(ms)
    points, fit = fit_verify(corrected.samples, infeasible, batches, ctxs, t_max, len(timed),
                             visit_design_effect=design_effect(corrected.visits.values()))
    for p in points:
        if (cell := (p["batch"], p["ctx"], p["tokens"])) in uncorrected and p.get("raw_median_ms") is not None:
            p["uncorrected_median_ms"] = statistics.median(uncorrected[cell])
    return points, fit | {"drift": corrected.summary(), "pooled_rel_sd_uncorrected": pooled_rel_sd(uncorrected.values())}


def fit_verify(samples: dict[tuple[int, int, int], list[float]], infeasible: dict[tuple[int, int], int], batches, ctxs, t_max: int,
               visits: int, visit_design_effect: float = 1.0) -> tuple[list[dict], dict]:
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
            measured = {t: statistics.median(samples[(B, ctx, t)]) for t in range(1, t_max + 1) if (B, ctx, t) in samples}
            limit = infeasible.get((B, ctx), t_max + 1)
            for t, y, source in fill_curve(measured, range(1, limit)):
                if y is None:
                    continue
                grid[t - 1, bi, ci] = y
                if source == "measured":
                    tm = Timing.of(samples[(B, ctx, t)])
                    low, high = _cell_interval(samples[(B, ctx, t)], noise)
                    timings[(B, ctx, t)] = tm = dataclasses.replace(tm, ci_low_ms=low, ci_high_ms=high)
                    weight[t - 1, bi, ci] = 1.0 / max((tm.ci_high_ms - tm.ci_low_ms) / 2, 0.005 * tm.median_ms) ** 2
    with warnings.catch_warnings(record=True) as unconverged:  # still monotone, within tol of optimal: recorded below
        warnings.simplefilter("always")
        fitted = monotone_fit(grid, weight, max_iter=FIT_MAX_SWEEPS) if np.isfinite(grid).any() else grid
    points, moved = [], []
    for bi, B in enumerate(batches):
        for ci, ctx in enumerate(ctxs):
            limit = infeasible.get((B, ctx), t_max + 1)
            rel = {t: (tm.ci_high_ms - tm.ci_low_ms) / 2 / tm.median_ms for (b, c, t), tm in timings.items() if (b, c) == (B, ctx)}
            for t in range(1, t_max + 1):
                y = float(fitted[t - 1, bi, ci]) if t < limit and np.isfinite(grid[t - 1, bi, ci]) else None
                point = {"batch": B, "tokens": t, "ctx": ctx, "median_ms": y, "source": "infeasible" if y is None else "interpolated"}
                tm = timings.get((B, ctx, t))
                if tm is not None:
                    is_moved = moved_beyond_interval(tm.median_ms, y, tm.ci_low_ms, tm.ci_high_ms)
                    point |= {"raw_median_ms": tm.median_ms, "p10_ms": tm.p10_ms, "p90_ms": tm.p90_ms, "repeats": tm.repeats,
                              "ci_low_ms": min(tm.ci_low_ms, y), "ci_high_ms": max(tm.ci_high_ms, y), "fit_moved": is_moved,
                              "source": "fitted" if is_moved else "measured"}
                    if is_moved:
                        moved.append({"batch": B, "tokens": t, "ctx": ctx, "raw_ms": tm.median_ms, "fitted_ms": y,
                                      "interval_ms": [tm.ci_low_ms, tm.ci_high_ms]})
                elif y is not None and rel:  # between measured 1+D: the neighbours' relative half-width, interpolated
                    lo = max((x for x in rel if x < t), default=None)
                    hi = min((x for x in rel if x > t), default=None)
                    h = rel[lo] if hi is None else rel[hi] if lo is None else rel[lo] + (rel[hi] - rel[lo]) * (t - lo) / (hi - lo)
                    point |= {"ci_low_ms": y * (1 - h), "ci_high_ms": y * (1 + h)}
                points.append(point)
    measured_cells = len(timings)
    widths = [(tm.ci_high_ms - tm.ci_low_ms) / 2 / tm.median_ms for tm in timings.values()]
    summary = {
        "method": "weighted isotonic regression, non-decreasing in 1+D, batch and context (Dykstra's projections over PAVA); "
                  "weights 1 / half-width^2 of each median's 95% interval (the order statistics' interval of its samples, "
                  "drift-corrected where the visits' order is known, widened to the half-width the noise all cells share "
                  "gives at the cell's sample count over the design effect of samples timed in visits)",
        "pooled_rel_sd": noise.rel_sd, "design_effect": visit_design_effect,
        "visits": visits, "samples_per_visit": VERIFY_SAMPLES_PER_VISIT, "cells_measured": measured_cells,
        "target_rel_half_width": VERIFY_TARGET_REL_HALF_WIDTH,
        "cells_above_target": sum(w > VERIFY_TARGET_REL_HALF_WIDTH for w in widths),
        "median_rel_half_width": statistics.median(widths) if widths else None,
        "moved_beyond_interval": moved,
        "converged": not unconverged,
    }
    return points, summary


class Profiler:
    def __init__(self, settings: ProfileSettings, progress=None, started: float | None = None) -> None:
        # the budget counts from `started` (time.monotonic(); default: now): loading the models is part of the profile's time
        self.started = time.monotonic() if started is None else started
        settings.validate()
        self.device = resolve_device(settings.device)
        self.s = settings = settings.for_device(self.device.type)
        self.progress = progress  # callable(phase: str, done: int, total: int) or None
        self.target = load_model(settings.target, dtype=settings.dtype, device=str(self.device), trust_remote_code=settings.trust_remote_code)
        self.model = self.target.model
        self.drafters: dict[str, Drafter] = {}
        for spec in settings.drafters:
            name, options = parse_drafter_spec(spec)
            if name in self.drafters:
                raise SpecdecError(f"drafter {name!r} is given twice", "profile each mechanism once")
            self.drafters[name] = create(name, self.target, options)
        self.calibration = load_calibration(settings.prompts)
        self.pool, _ = self.calibration.split()  # the profiling split: acceptance grows into it, never the held-back part
        self.prompt_set = self.pool.per_domain(settings.prompts_per_domain)
        self.prompt_ids = encode_prompts(self.target.tokenizer, self.prompt_set, context_tokens=self.model.config.max_position_embeddings,
                                         max_new_tokens=settings.new_tokens, max_draft_tokens=settings.max_draft_len)
        self.encoded = {p.id: ids for p, ids in zip(self.prompt_set, self.prompt_ids)} | encode_fitting(
            self.target.tokenizer, self.pool, context_tokens=self.model.config.max_position_embeddings, max_new_tokens=settings.new_tokens,
            max_draft_tokens=settings.max_draft_len)
        self.sampled_prompts = list(self.prompt_set.per_domain(settings.sampled_prompts_per_domain).prompts)
        self.stop_ids = list(self.model.config.eos_token_ids)
        # greedy acceptance by replay (profiles/replay.py) for the drafters that declare how, in every weight format
        self.replay_units = [] if settings.acceptance == "loop" else [
            (name, fmt) for name, d in self.drafters.items() if d.replay for fmt in ("none", *(settings.quant_formats if d.kind != "model_free" else ()))]
        self.used: list[CalibrationPrompt] = []  # prompts replayed so far, in order
        # wall seconds per prompt so far (the slowest call): a trajectory, and each unit's replay; growth's cost per prompt
        self.trajectory_s_per_prompt = 0.0
        self.unit_s_per_prompt: dict[tuple[str, str], float] = {}
        self.trajectory: dict[str, list[int]] = {}
        self.replayed: dict[tuple[str, str], dict[str, list[SpecCounters]]] = {}  # (name, fmt) -> prompt id -> counters at D = 1..D_max
        self.looped: dict[tuple[str, str, float], tuple] = {}
        self.replay_checks: dict[str, list[dict]] = {}
        self.replay_exact: dict[str, dict] = {}
        self._quantized: dict[tuple[str, str], Drafter] = {}
        self.device_fp = device_fingerprint(self.device, self.model.dtype)
        self.fingerprint = sha256_json({
            "schema": SCHEMA_VERSION, "tool": __version__, "device": device_factors(self.device_fp),
            "target": dataclasses.asdict(self.target.ref), "drafters": self._drafter_infos(), "workload": self._workload(),
        })

    # ------------------------------------------------------------------ records

    def _workload(self) -> dict:
        return workload_record(self.s, self.calibration, self.pool, self.prompt_set.domains(), self.s.acceptance_batch, self.s.acceptance_half_width)

    def _drafter_infos(self) -> list[dict]:
        infos = []
        for name, d in self.drafters.items():
            desc = d.describe()
            model = getattr(d, "model", None)
            ref = None
            if model is not None:
                ref = {"layers": len(model.layers), "shares_target_weights": model.embed_tokens is self.model.embed_tokens}
                if desc["options"].get("model"):  # its own checkpoint: its hash makes a bundle stale when it changes
                    ref["weights_hash"] = weights_hash(model_folder(desc["options"]["model"])[3])
            head = getattr(d, "head", None)
            if head is not None:  # a learned head over the target's hidden states (EAGLE-3, MTP, DFlash, DSpark)
                layers = len(getattr(head, "layers", None) or getattr(head, "mtp_layers", None) or [head])
                ref = {"layers": layers, "hidden_layers": list(d.hidden_layers), "shares_target_weights": head.embed_tokens is self.model.embed_tokens,
                       "weights_hash": getattr(d, "weights_hash", None), "draft_vocab_size": head.lm_head.out_features}
            infos.append({
                "name": name, "kind": desc["kind"], "options": desc["options"], "model": ref,
                "quant_formats": ["none", *self.s.quant_formats] if d.kind != "model_free" else ["none"],
                "draft_len_multiple": d.draft_len_multiple, "max_draft_len": d.max_draft_len,
            })
        return infos

    def d_max(self, drafter: Drafter) -> int:
        """The longest draft profiled for this drafter: the workload's D_max, or less where its block is shorter."""
        limit = drafter.max_draft_len
        return self.s.max_draft_len if limit is None else min(self.s.max_draft_len, limit)

    def _guarded(self, measure):
        """A timing cell measured at the device's quiet speed (SpeedGuard), re-run after a passing load."""
        return self.guard.run(measure)[0]

    # ------------------------------------------------------------------ run

    def run(self) -> Profile:
        out = self.s.out_dir / "profile.json"
        old = None if self.s.force else finished_profile(out, self.fingerprint)
        if old is not None:
            return old
        log = MeasurementLog(self.s.out_dir, self.fingerprint)
        budget = Budget(self.s.budget_minutes, self.started)
        probe = VerifyStep(self.model, 1, self.s.ctx_buckets[0], 1, self.s.seed, self.device)
        self.guard = SpeedGuard(probe=lambda: probe.timing(1, warmup=1, repeats=3).median_ms)
        phase_s = {"load": time.monotonic() - self.started}  # measured wall seconds per phase (profile.json sorts the keys)

        def timed(phase: str, fn, *args):
            t0 = time.monotonic()
            out = fn(*args)
            phase_s[phase] = phase_s.get(phase, 0.0) + time.monotonic() - t0
            return out

        verify, verify_fit = timed("verify", self._verify_curve, log, budget)
        draft = timed("draft", self._draft_costs, log, budget)
        timed("acceptance replay", self._acceptance, log)
        timed("replay check", self._check_replay, log, budget)
        host = timed("host", self._host, log, budget)
        micro_points = timed("micro", self._micro, log, budget)
        timed("acceptance loop", self._acceptance_loops, log, budget)
        verify, verify_fit = timed("verify refinement", self._refine_verify, budget, verify, verify_fit, REFINE_BUDGET_SHARE)
        growth_notes = timed("acceptance growth", self._grow_acceptance, log, budget, verify)
        verify, verify_fit = timed("verify refinement", self._refine_verify, budget, verify, verify_fit, 1.0)  # what growth left
        acceptance = timed("acceptance records", self._acceptance_records)
        drafter_infos = self._drafter_infos()
        memory = timed("memory", self._memory, drafter_infos)
        moe = timed("moe", self._experts_woken)
        skipped: dict[str, list[str]] = {}  # "host overhead" -> ["ngram B=1 D=1", ...]
        for what in budget.skipped:
            phase, _, cell = what.partition(" B=") if " B=" in what else (what, "", "")
            skipped.setdefault(phase, []).append(f"B={cell}" if cell else "")
        notes = [f"phase skipped for the time budget: {phase}" + (f" ({len(cells)} cells: {', '.join(cells[:4])}{', ...' if len(cells) > 4 else ''})"
                                                                   if any(cells) else "") for phase, cells in skipped.items()] + growth_notes
        notes += [f"{'replayed' if a['method'] == 'replay' else 'derived'} tokens per forward differs from a loop run in "
                  f"{self.model.dtype} by more than {FLAG_REL_DIFF:.0%}: {a['mechanism']} D={c['draft_len']} "
                  f"({c['derived']:.3f} against {c['direct']:.3f})" for a in acceptance for c in a["checks"] if c["flagged"]]
        if self.replay_exact:
            notes.append("acceptance replayed from the target's greedy trajectories for " + ", ".join(sorted(self.replay_exact)) +
                         "; the loop gave equal counters in fp32 on " + "; ".join(
                             f"{r['prompts']} prompts dealt over D = {r['draft_lens']}" for r in list(self.replay_exact.values())[:1]))
        if verify_fit.get("moved_beyond_interval"):
            notes.append(f"{len(verify_fit['moved_beyond_interval'])} verify cells disagreed with their neighbours beyond their 95% "
                         "interval; the monotone fit moved them (source 'fitted'): " + ", ".join(
                             f"B={m['batch']} 1+D={m['tokens']} ctx={m['ctx']} {m['raw_ms']:.1f}->{m['fitted_ms']:.1f} ms"
                             for m in verify_fit["moved_beyond_interval"][:6]))
        if self.guard.repeated:
            notes.append(f"{self.guard.repeated} timing cells were measured again: the device ran more than "
                         f"{self.guard.slack - 1:.0%} slower than its quiet speed around them (a shared machine)")
        if self.guard.unsettled:
            notes.append(f"{self.guard.unsettled} timing cells were kept although the device never settled: their times may be inflated")
        if self.device.type == "cpu":
            load = os.getloadavg()[0]
            if load > 1.5 * os.cpu_count():
                notes.append(f"the CPU was busy while profiling (load {load:.1f} on {os.cpu_count()} cores): timings may be inflated")
        profile = Profile.model_validate({
            "schema_version": SCHEMA_VERSION, "tool_version": __version__,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": self.fingerprint, "backend": "torch", "device": self.device_fp,
            "target": dataclasses.asdict(self.target.ref),
            "timing_shapes": f"{self.target.ref.path} ({self.model.config.model_type}, {len(self.model.layers)} layers, hidden {self.model.config.hidden_size}, {self.target.ref.dtype}; real weights)",
            "drafters": drafter_infos, "memory": memory, "moe": moe,
            "workload": self._workload() | {"prompts_by_domain": self._prompts_by_domain()},
            "verify": verify, "draft": draft, "host": host, "acceptance": acceptance, "micro": micro_points, "notes": notes,
            "verify_fit": verify_fit, "phase_s": {k: round(v, 1) for k, v in phase_s.items()},
        })
        write_json(out, profile.model_dump(mode="json"))
        return profile

    def _memory(self, drafter_infos: list[dict]) -> dict:
        """The memory record (profiles/memory.py); on a GPU each (B, 1+D) verify step's activation peak is measured."""
        measured = {}
        if self.device.type == "cuda":
            ctx = max(self.s.ctx_buckets)
            for B in self.s.batch_buckets:
                step = VerifyStep(self.model, B, ctx, self.s.max_draft_len + 1, self.s.seed, self.device)
                for T in range(1, self.s.max_draft_len + 2):
                    if step.ready:
                        measured[(B, T)] = allocator_peak_bytes(lambda: step.timing(T, warmup=0, repeats=1), self.device)
                del step
        own = {i["name"]: model_folder(i["options"]["model"])[2] for i in drafter_infos
               if i["options"].get("model") and i["model"] and "hidden_layers" not in i["model"]}
        return memory_record(model_folder(self.s.target, self.s.trust_remote_code)[2], self.target.ref.dtype, drafter_infos, self.device_fp,
                             list(self.s.batch_buckets), self.s.max_draft_len, own, measured_activation=measured)

    @torch.inference_mode()
    def _experts_woken(self) -> dict:
        """For a mixture-of-experts target: per batch bucket and 1+D, the distinct experts a verify step's tokens wake,
        averaged over the MoE layers. Real calibration text (routing depends on it): `ctx` tokens of context, then the
        1+D tokens that follow. Counted once per cell (routing is deterministic); {} for a dense target."""
        moe = getattr(self.model, "moe", None)
        if moe is None:
            return {}
        ctx, t_max = self.s.ctx_buckets[0], self.s.max_draft_len + 1
        points = []
        for B in self.s.batch_buckets:
            rows = torch.tensor(self._context_rows(B, ctx, t_max), device=self.device)  # [B, ctx + t_max]
            cache = self.model.new_cache(B, ctx + t_max)
            self.model(rows[:, :ctx], cache, torch.zeros(B, dtype=torch.long, device=self.device), logits="none")
            start = torch.full((B,), ctx, dtype=torch.long, device=self.device)
            for T in range(1, t_max + 1):  # each step writes slots ctx..ctx+T-1 over the last one's: the context stays
                with self.model.count_experts() as woke:
                    self.model(rows[:, ctx : ctx + T], cache, start, logits="none")
                points.append({"batch": B, "tokens": T, "experts_woken": sum(woke) / len(woke), "source": "measured"})
        return {"num_experts": moe.num_experts, "experts_per_token": moe.experts_per_token, "ctx": ctx,
                "moe_layers": len(woke), "points": points}

    def _prompts_by_domain(self) -> dict[str, int]:
        prompts = self.used or list(self.prompt_set.prompts)
        return {d: sum(p.domain == d for p in prompts) for d in dict.fromkeys(p.domain for p in prompts)}

    def _tick(self, phase: str, done: int, total: int) -> None:
        if self.progress:
            self.progress(phase, done, total)

    # ------------------------------------------------------------------ verify

    def _verify_curve(self, log: MeasurementLog, budget: Budget) -> tuple[list[dict], dict]:
        """T_verif(B, 1+D, ctx) over every cell, interleaved (`VerifySampler`), then fitted monotone (`fit_verify`)."""
        s = self.s
        sampler = VerifySampler(self, log, seeds=[1, 2, 4, 8, 16, 32, 64], t_max=s.max_draft_len + 1)
        deadline = time.monotonic() + VERIFY_BUDGET_SHARE * max(0.0, budget.deadline - time.monotonic())
        sampler.run(deadline)
        self.verify_sampler = sampler  # the decision cells get more visits once acceptance is known (`_refine_verify`)
        self._tick("verify", sampler.visits, sampler.visits)
        return sampler.fit()

    # ------------------------------------------------------------------ draft cost

    def _draft_costs(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        s, points = self.s, []
        ctx = s.ctx_buckets[0]
        cells = [(name, B) for name in self.drafters for B in s.batch_buckets]
        for i, (name, B) in enumerate(cells):
            self._tick("draft", i, len(cells))
            if not budget.allows(f"draft cost {name} B={B}"):
                continue
            drafter = self.drafters[name]
            cell = lambda: {str(d): t for d, t in self._draft_cell(drafter, B, ctx).items()}  # noqa: E731
            # a lookup's draft costs a fraction of a millisecond, thousands of times less than a verify step: a slow
            # spell cannot move a decision through it, and guarding it would cost two probes per cell
            timings = log.measure(f"draft/{name}/{B}/{ctx}", cell if drafter.kind == "model_free" else lambda: self._guarded(cell))
            measured = {int(d): (t["median_ms"] if t else None) for d, t in timings.items()}
            for d, y, source in fill_curve(measured, range(1, self.d_max(self.drafters[name]) + 1)):
                t = timings.get(str(d)) or {}
                points.append({"mechanism": name, "batch": B, "draft_len": d, "ctx": ctx, "median_ms": y, "p10_ms": t.get("p10_ms"),
                               "p90_ms": t.get("p90_ms"), "repeats": t.get("repeats", 0), "source": source,
                               "ci_low_ms": t.get("ci_low_ms"), "ci_high_ms": t.get("ci_high_ms")})
        self._tick("draft", len(cells), len(cells))
        return points

    def _context_rows(self, B: int, ctx: int, extra: int = 0) -> list[list[int]]:
        """B rows of real calibration tokens, each `ctx + extra` long (prompts concatenated, rotated per row): the
        first `ctx` are the context, the rest the text that really follows it."""
        flat = [t for ids in self.prompt_ids for t in ids]
        while len(flat) < ctx + extra + B * 97:
            flat = flat + flat
        return [flat[b * 97 : b * 97 + ctx + extra] for b in range(B)]

    @torch.inference_mode()
    def _context_states(self, drafter: Drafter, B: int, ctx: int) -> torch.Tensor | None:
        """The target's hidden states at the drafter's layers over `_context_rows` [B, ctx, W], or None when it reads none."""
        if not drafter.hidden_layers:
            return None
        rows = torch.tensor(self._context_rows(B, ctx), device=self.device)
        cache = self.model.new_cache(B, ctx)
        _, hidden = self.model.forward_capture(rows, cache, torch.zeros(B, dtype=torch.long, device=self.device),
                                               tuple(drafter.hidden_layers), logits="none")
        return hidden

    def _draft_cell(self, drafter: Drafter, B: int, ctx: int) -> dict[int, dict | None]:
        """Steady state of a fully rejected round: each call appends one token, then drafts D.

        The appended tokens are the calibration text that really follows each row's context, so lookups
        (n-gram, suffix) find the matches real text offers, not the near-none of random tokens.

        A drafter that reads target hidden states gets them as the loop passes them: the context's (ctx - 1
        positions) with the untimed first call, then one verified position per call. Their values are the
        target's real states of the context (the timing does not depend on them; the shapes are the loop's)."""
        timings: dict[int, dict | None] = {}
        states = self._context_states(drafter, B, ctx)  # [B, ctx, W] or None

        def request(rows: list[list[int]], D: int, first: bool) -> DraftRequest:
            if states is None:
                return DraftRequest(rows, [D] * B, 0.0)
            hidden = states[:, : ctx - 1] if first else states[:, -1:]  # [B, n, W]
            return DraftRequest(rows, [D] * B, 0.0, hidden_states=hidden, num_hidden=[hidden.shape[1]] * B)

        def measure(D: int) -> float | None:
            text = self._context_rows(B, ctx, extra=DRAFT_CALLS_PER_POINT)
            rows = [r[:ctx] for r in text]
            drafter.start([list(r) for r in rows])
            drafter.propose(request(rows, D, first=True))  # catch up on the context, untimed: the point's warm-up

            def step():
                for r, t in zip(rows, text):
                    r.append(t[len(r)])
                drafter.propose(request(rows, D, first=False))

            timings[D] = _time_unless_oom(step, self.device, warmup=0, max_total_ms=DRAFT_POINT_MAX_MS)
            return timings[D]["median_ms"] if timings[D] else None

        def noise(D: int) -> float:
            t = timings.get(D)
            return (t["ci_high_ms"] - t["ci_low_ms"]) / 2 if t else 0.0

        adaptive_sample(measure, 1, self.d_max(drafter), self.s.interp_tolerance, [d for d in (1, 2, 4, 8) if d <= self.d_max(drafter)], noise)
        return timings

    # ------------------------------------------------------------------ acceptance

    def _drafter(self, name: str, fmt: str) -> Drafter:
        """The drafter with its weights in `fmt` (fake-quantized copies are made once)."""
        if fmt == "none":
            return self.drafters[name]
        if (name, fmt) not in self._quantized:
            self._quantized[(name, fmt)] = self.drafters[name].with_quantized_weights(fmt)
        return self._quantized[(name, fmt)]

    def run_counters(self, drafter: Drafter, D: int, temperature: float, log: MeasurementLog, key: str,
                     prompts: list[CalibrationPrompt] | None = None) -> list[SpecCounters]:
        """Per-prompt counters of the speculative loop over `prompts` (default: the starting set), one logged unit per batch."""
        prompts = list(self.prompt_set.prompts) if prompts is None else prompts
        out: list[SpecCounters] = []
        B = self.s.acceptance_batch
        for start in range(0, len(prompts), B):
            ids = [self.encoded[p.id] for p in prompts[start : start + B]]

            def run_batch():
                res = generate(self.model, ids, drafter=drafter, num_draft_tokens=D, max_new_tokens=self.s.new_tokens,
                               temperature=temperature, seed=self.s.seed + start, stop_token_ids=self.stop_ids)
                return {"counters": [dataclasses.asdict(c) for c in res.per_prompt],
                        "draft_s": res.draft_s, "verify_s": res.verify_s, "total_s": res.total_s, "forwards": res.target_forwards}
            done = log.measure(f"{key}/batch{start}", run_batch)
            out += [SpecCounters(**c) for c in done["counters"]]
        return out

    def _trajectories(self, log: MeasurementLog, prompts: list[CalibrationPrompt]) -> None:
        """The target's greedy continuations, generated once per prompt, `TRAJECTORY_BATCH` at a time, and logged."""
        batch = TRAJECTORY_BATCH
        ordered = sorted(prompts, key=lambda p: (len(self.encoded[p.id]), p.id))  # similar lengths share a batch
        for start in range(0, len(ordered), batch):  # fixed batches: a resumed run decodes the same rows together
            chunk = ordered[start : start + batch]
            if any(f"trajectory/{p.id}" not in log for p in chunk):
                for p, t in zip(chunk, replay.trajectories(self.model, [self.encoded[p.id] for p in chunk], self.s.new_tokens, batch)):
                    log.measure(f"trajectory/{p.id}", lambda t=t: t)
        for p in prompts:
            self.trajectory[p.id] = log.get(f"trajectory/{p.id}")

    def _replay_prompts(self, log: MeasurementLog, prompts: list[CalibrationPrompt], units: list[tuple[str, str]] | None = None) -> None:
        """The counters of every replayed unit (drafter, weight format) in `units` (default: all) at every D on these
        prompts, the trajectories shared by all."""
        units = self.replay_units if units is None else units
        started = time.monotonic()
        self._trajectories(log, prompts)
        self.trajectory_s_per_prompt = max(self.trajectory_s_per_prompt, (time.monotonic() - started) / max(1, len(prompts)))
        stop = set(self.stop_ids)
        spent = dict.fromkeys(units, 0.0)
        for p in prompts:  # prompt by prompt: a head's formats share the target's teacher-forced pass
            for name, fmt in units:
                def run(p=p, name=name, fmt=fmt):
                    drafter, D_max = self._drafter(name, fmt), self.d_max(self.drafters[name])
                    propose = replay.proposer(drafter, self.encoded[p.id], self.trajectory[p.id], self.model, D_max)
                    counters = replay.replay(self.trajectory[p.id], propose, range(1, D_max + 1), self.s.new_tokens, stop, D_max)
                    return [dataclasses.asdict(c) for c in counters]
                t0 = time.monotonic()
                self.replayed.setdefault((name, fmt), {})[p.id] = [SpecCounters(**c) for c in log.measure(f"replay/{name}/{fmt}/{p.id}", run)]
                spent[(name, fmt)] += time.monotonic() - t0
        replay.target_states.cache_clear()
        for p in prompts:
            if p not in self.used:
                self.used.append(p)
        for unit, s in spent.items():
            self.unit_s_per_prompt[unit] = max(self.unit_s_per_prompt.get(unit, 0.0), s / max(1, len(prompts)))

    def _acceptance(self, log: MeasurementLog) -> None:
        """Greedy acceptance by replay, for every drafter and weight format (with --acceptance loop: none)."""
        if self.replay_units:
            self._tick("acceptance", 0, 1)
            self._replay_prompts(log, list(self.prompt_set.prompts))
            self._tick("acceptance", 1, 1)

    def _acceptance_loops(self, log: MeasurementLog, budget: Budget) -> None:
        """The speculative loop at D_max where replay does not apply: temperatures > 0 (and everything with
        --acceptance loop), smaller D derived from its rounds. Run after the cheaper phases: it is the costliest."""
        s = self.s
        units = [(name, "none", t) for t in s.temperatures for name in self.drafters if t > 0 or (name, "none") not in self.replay_units]
        units += [(name, fmt, 0.0) for fmt in s.quant_formats for name, d in self.drafters.items()
                  if d.kind != "model_free" and (name, fmt) not in self.replay_units]
        for i, (name, fmt, temp) in enumerate(units):
            self._tick("loop acceptance", i, len(units))
            label = f"acceptance {name} quant={fmt} T={temp}"
            if not budget.allows(label):
                continue
            drafter = self._drafter(name, fmt)
            prompts = self.sampled_prompts if temp > 0 else list(self.prompt_set.prompts)
            key = f"acceptance/{name}/{fmt}/{temp}"
            per_prompt = self.run_counters(drafter, self.d_max(self.drafters[name]), temp, log, key, prompts)
            checks = []
            if fmt == "none" and temp == 0.0:
                for D in [D for D in s.checks if D < self.d_max(self.drafters[name])]:
                    if not budget.allows(f"AL check {name} D={D}"):
                        continue
                    direct = SpecCounters.total(self.run_counters(drafter, D, 0.0, log, f"check/{name}/{D}", prompts)).tokens_per_target_forward
                    derived = SpecCounters.total(per_prompt).derived_at(D)[0]
                    rel = (derived - direct) / direct
                    checks.append({"draft_len": D, "derived": derived, "direct": direct, "rel_diff": rel, "flagged": abs(rel) > FLAG_REL_DIFF})
            self.looped[(name, fmt, temp)] = (prompts, per_prompt, checks)
        self._tick("loop acceptance", len(units), len(units))

    def _acceptance_records(self) -> list[dict]:
        records = []
        for (name, fmt), by_prompt in self.replayed.items():
            prompts = [p for p in self.used if p.id in by_prompt]
            rows = [by_prompt[p.id] for p in prompts]
            records += self._records(name, fmt, 0.0, prompts, [r[-1] for r in rows], replay.per_prompt_rates(rows), "replay",
                                     self.replay_checks.get(name, []))
        for (name, fmt, temp), (prompts, per_prompt, checks) in self.looped.items():
            sums = replay.derived_rates(per_prompt, self.d_max(self.drafters[name]))
            records += self._records(name, fmt, temp, prompts, per_prompt, sums, "loop", checks)
        order = {name: i for i, name in enumerate(self.drafters)}
        return sorted(records, key=lambda r: (r["temperature"], r["quant"] != "none", r["quant"], order[r["mechanism"]]))

    def _records(self, name: str, fmt: str, temp: float, prompts: list[CalibrationPrompt], at_max: list[SpecCounters],
                 sums: dict[str, np.ndarray], method: str, checks: list[dict]) -> list[dict]:
        return acceptance_records(name, fmt, temp, [p.domain for p in prompts], at_max, sums, method, checks,
                                  max_draft_len=self.d_max(self.drafters[name]), new_tokens=self.s.new_tokens, seed=self.s.seed)

    def _check_replay(self, log: MeasurementLog, budget: Budget) -> None:
        """The loop checks the replay on a sample of `check_prompts` prompts, `CHECK_NEW_TOKENS` each: in fp32 the
        counters must be equal, prompt by prompt and D by D (a difference fails the profile); in the profile's dtype
        the tokens per forward at D_max are compared and the difference recorded (batch-shape numerics: the loop
        verifies 1+D tokens per forward, the trajectory one)."""
        names = [name for name, fmt in self.replay_units if fmt == "none"]
        if not names or not budget.allows("replay check against the loop"):
            return
        prompts = list(self.prompt_set.prompts)
        sample = prompts[:: max(1, len(prompts) // self.s.check_prompts)][: self.s.check_prompts]
        N = min(CHECK_NEW_TOKENS, self.s.new_tokens)
        ids = [self.encoded[p.id] for p in sample]
        exact, trajs = None, None
        for i, name in enumerate(names):
            self._tick("replay check", i, len(names))
            D_max = self.d_max(self.drafters[name])
            lens = sorted({min(3, D_max), D_max})

            def fp32_check():
                nonlocal exact, trajs
                if exact is None:  # the profile's own target and trajectories where it already runs in fp32
                    exact = self.target if self.model.dtype == torch.float32 else load_model(
                        self.s.target, dtype="float32", device=str(self.device), trust_remote_code=self.s.trust_remote_code)
                    trajs = ([self.trajectory[p.id] for p in sample] if exact is self.target
                             else replay.trajectories(exact.model, ids, N, len(ids)))
                spec = next(x for x in self.s.drafters if parse_drafter_spec(x)[0] == name)
                drafter = self.drafters[name] if exact is self.target else create(name, exact, parse_drafter_spec(spec)[1])
                # the sample's prompts dealt over the checked D, D_max first, in one batch (each row its own D)
                row_d = [lens[-1 - j % len(lens)] for j in range(len(sample))]
                looped, replayed = self._loop_and_replay(exact.model, drafter, ids, trajs, row_d, N)
                for j, (a, b) in enumerate(zip(replayed, looped)):
                    if dataclasses.asdict(a) != dataclasses.asdict(b):
                        return {"equal": False, "draft_len": row_d[j], "prompt": sample[j].id,
                                "replay": [a.num_rounds, a.num_accepted_tokens], "loop": [b.num_rounds, b.num_accepted_tokens]}
                return {"equal": True, "prompts": len(sample), "new_tokens": N, "draft_lens": lens,
                        "prompts_at": {str(D): [p.id for p, d in zip(sample, row_d) if d == D] for D in lens},
                        "tokens_per_forward_at_d_max": SpecCounters.total([c for c, d in zip(looped, row_d) if d == D_max]).tokens_per_target_forward}

            result = log.measure(f"replay-check/{name}/fp32/{len(sample)}x{N}", fp32_check)
            if not result["equal"]:
                raise SpecdecError(
                    f"replayed acceptance of {name} differs from the speculative loop in fp32 on prompt {result['prompt']} at "
                    f"D={result['draft_len']} (rounds, accepted: replay {result['replay']}, loop {result['loop']})",
                    "profile with --acceptance loop, and report the drafter: its proposals must depend only on the prefix")

            def in_dtype():  # D_max on every row of the sample, in the profile's own dtype
                looped, replayed = self._loop_and_replay(self.model, self.drafters[name], ids, [self.trajectory[p.id] for p in sample],
                                                         [D_max] * len(sample), N)
                return [SpecCounters.total(c).tokens_per_target_forward for c in (replayed, looped)]

            if self.model.dtype == torch.float32:  # the check above ran in the profile's dtype: equal counters
                replayed_tpf = direct = result["tokens_per_forward_at_d_max"]
            else:
                replayed_tpf, direct = log.measure(f"replay-check/{name}/{self.model.dtype}/{len(sample)}x{N}", in_dtype)
            rel = (replayed_tpf - direct) / direct
            self.replay_checks[name] = [{"draft_len": D_max, "derived": replayed_tpf, "direct": direct, "rel_diff": rel,
                                         "flagged": abs(rel) > FLAG_REL_DIFF}]
            self.replay_exact[name] = result
        self._tick("replay check", len(names), len(names))

    def _loop_and_replay(self, model, drafter: Drafter, ids: list[list[int]], trajs: list[list[int]], row_d: list[int],
                         new_tokens: int) -> tuple[list[SpecCounters], list[SpecCounters]]:
        """Per row, the loop's counters (one batch, row b at D = row_d[b]) and the replay's over the row's trajectory."""
        looped = generate(model, ids, drafter=drafter, num_draft_tokens=row_d, max_new_tokens=new_tokens, stop_token_ids=self.stop_ids).per_prompt
        stop = set(self.stop_ids)
        replayed = [replay.replay(g, replay.proposer(drafter, x, g, model, D), [D], new_tokens, stop, D)[0]
                    for x, g, D in zip(ids, trajs, row_d)]
        return looped, replayed

    def _speedup_bounds(self, verify: list[dict]) -> dict[tuple[str, int], dict[int, float]]:
        """Per replayed drafter and batch bucket, the speedup bound of every D at the cost model's default context,
        tokens_per_forward(D) x T_verif(B, 1) / T_verif(B, 1+D) (draft and host cost left out; domains weighed alike)."""
        ctx = self.s.ctx_buckets[0]
        t_verif = {(p["batch"], p["tokens"]): p["median_ms"] for p in verify if p["ctx"] == ctx and p["median_ms"]}
        bounds = {}
        for (name, fmt), by_prompt in self.replayed.items():
            if fmt != "none":
                continue
            rows = [by_prompt[p.id] for p in self.used if p.id in by_prompt]
            tpf, _ = intervals.figures(replay.per_prompt_rates(rows), [p.domain for p in self.used if p.id in by_prompt],
                                       dict.fromkeys(self.pool.domains(), 1.0))
            for B in self.s.batch_buckets:
                if (B, 1) in t_verif:
                    bounds[(name, B)] = {D: tpf[D] * t_verif[(B, 1)] / t_verif[(B, D + 1)] for D in range(1, len(tpf)) if (B, D + 1) in t_verif}
        return bounds

    def _relevant_draft_lens(self, verify: list[dict]) -> set[int]:
        """The D a plan could take: per batch bucket and replayed drafter, the D with the best speedup bound."""
        return {max(b, key=b.get) for b in self._speedup_bounds(verify).values() if b} or {1}

    def decision_cells(self, verify: list[dict]) -> list[tuple[int, int, int]]:
        """The verify cells (B, ctx, 1+D) each bucket's choice of D rests on: 1 and 1+D for the `REFINE_CANDIDATES`
        draft lengths with the best speedup bound, per replayed drafter, at the cost model's default context."""
        ctx = self.s.ctx_buckets[0]
        cells = {(B, ctx, 1) for B in self.s.batch_buckets}
        for (_, B), bound in self._speedup_bounds(verify).items():
            cells |= {(B, ctx, D + 1) for D in sorted(bound, key=bound.get, reverse=True)[:REFINE_CANDIDATES]}
        return sorted(cells)

    def _refine_verify(self, budget: Budget, verify: list[dict], fit: dict, share: float) -> tuple[list[dict], dict]:
        """`share` of the budget left (less the finishing reserve) for more visits to the decision cells, then the
        curve fitted again over every sample."""
        sampler = self.verify_sampler
        left_s = budget.deadline - FINISH_RESERVE_S - time.monotonic()
        if left_s <= 0 or not self.replayed:
            return verify, fit
        cells = self.decision_cells(verify)
        self._tick("verify refinement", 0, len(cells))
        sampler.refine(cells, time.monotonic() + share * left_s)
        self._tick("verify refinement", len(cells), len(cells))
        points, fit = sampler.fit()
        per_cell = {c: visits_of(sampler.timed, c) for c in cells}
        return points, fit | {"decision_cells": [{"batch": B, "ctx": ctx, "tokens": t, "visits": n} for (B, ctx, t), n in per_cell.items()],
                              "decision_cells_target_rel_half_width": REFINE_TARGET_REL_HALF_WIDTH}

    def _grow_acceptance(self, log: MeasurementLog, budget: Budget, verify: list[dict]) -> list[str]:
        """Add prompts to every domain whose tokens per forward is not yet within ±half-width at the relevant D
        (95% bootstrap interval, every replayed drafter), until all are, the domain runs out of prompts, or the
        budget ends. This phase fills what is left of the budget: each round adds only as many prompts as the
        replay so far says fit in it (widest domains first), so it ends near the deadline, not a round past it.
        Returns the notes that say where it stopped."""
        target = self.s.acceptance_half_width
        units = [(name, fmt) for name, fmt in self.replay_units if fmt == "none"]  # the FP8 / NVFP4 twins keep the starting set
        if not units or target <= 0:
            return []
        relevant = sorted(self._relevant_draft_lens(verify))
        s_per_prompt = self.trajectory_s_per_prompt + sum(self.unit_s_per_prompt.get(u, 0.0) for u in units)
        while True:
            widths = self._half_widths(relevant)
            wide = {d: w for d, w in widths.items() if w > target}
            self._tick("more prompts", len(widths) - len(wide), len(widths))
            if not wide:
                return [f"acceptance: tokens per forward within ±{target:.0%} (95%) in every domain at D = {relevant}"]
            unused = {d: [q for q in self.pool.prompts if q.domain == d and q.id in self.encoded and q not in self.used] for d in wide}
            by_width = sorted(wide, key=wide.get, reverse=True)
            dealt = [unused[d][k] for k in range(max(map(len, unused.values()))) for d in by_width if k < len(unused[d])]  # round-robin, widest first
            added = dealt[:GROWTH_ROUND_PROMPTS]
            left_s = budget.deadline - FINISH_RESERVE_S - time.monotonic()
            if s_per_prompt > 0:
                added = added[: int(left_s / s_per_prompt)]
            if not added or left_s <= 0:
                why = {d: "the time budget ended" if unused[d] else "the profiling split has no more prompts for it" for d in wide}
                return [f"acceptance: {why[d]}; tokens per forward at D = {relevant} is {intervals.half_width_text(w)} for {d} "
                        f"({sum(p.domain == d for p in self.used)} prompts), above the ±{target:.0%} target" for d, w in sorted(wide.items())]
            self._replay_prompts(log, added, units)

    def _half_widths(self, relevant: list[int]) -> dict[str, float]:
        """Per domain, the largest relative half-width of tokens per forward over the relevant D and replayed drafters."""
        out: dict[str, float] = {}
        for (name, fmt), by_prompt in self.replayed.items():
            if fmt != "none":
                continue
            prompts = [p for p in self.used if p.id in by_prompt]
            sums = replay.per_prompt_rates([by_prompt[p.id] for p in prompts])
            domains = [p.domain for p in prompts]
            for d in dict.fromkeys(domains):
                tpf, _, ci, _ = intervals.figures(sums, domains, {d: 1.0}, resamples=BOOTSTRAP_RESAMPLES, seed=self.s.seed)
                out[d] = max(out.get(d, 0.0), *((ci[D, 1] - ci[D, 0]) / 2 / tpf[D] for D in relevant if D < len(tpf)))
        return out

    # ------------------------------------------------------------------ host overhead

    def _host(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        """Per drafter, at the smallest and the largest batch bucket and the shortest and the longest draft: a short
        real decode; host = round - draft - verify. The host's work is per-row bookkeeping, linear in B: the cost
        model interpolates between the two batches (labelled so) and between the two draft lengths, and the
        decodes at the middle batches, which cost as much as a verify curve on a CPU, are not run."""
        points = []
        batches = sorted({min(self.s.batch_buckets), max(self.s.batch_buckets)})
        cells = [(name, B, D) for name in ("plain", *self.drafters) for B in batches
                 for D in ([0] if name == "plain" else sorted({1, self.d_max(self.drafters[name])}))]
        for i, (name, B, D) in enumerate(cells):
            self._tick("host", i, len(cells))
            if not budget.allows(f"host overhead {name} B={B} D={D}"):
                continue

            def run():
                ids = [row[-HOST_PROMPT_TOKENS:] for row in (self.prompt_ids * B)[:B]]  # short: the prefill is not what is timed
                res = generate(self.model, ids, drafter=self.drafters.get(name), num_draft_tokens=D, max_new_tokens=HOST_NEW_TOKENS)
                return {"draft_s": res.draft_s, "verify_s": res.verify_s, "total_s": res.total_s, "forwards": res.target_forwards}

            r = log.measure(f"host/{name}/{B}/{D}", lambda: self._guarded(run))
            points.append({"mechanism": name, "batch": B, "draft_len": D, "rounds": r["forwards"],
                           "host_ms_per_round": 1e3 * (r["total_s"] - r["draft_s"] - r["verify_s"]) / r["forwards"],
                           "round_ms": 1e3 * r["total_s"] / r["forwards"], "source": "measured"})
        self._tick("host", len(cells), len(cells))
        return points

    # ------------------------------------------------------------------ micro-curves

    def _micro(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        s, c = self.s, self.model.config
        points: list[dict] = []
        self._tick("micro", 0, 2)
        if budget.allows("attention micro-curve"):
            for ctx in s.ctx_buckets:
                points += log.measure(f"micro/attention/{ctx}", lambda: micro.attention_curve(
                    c, self.device, self.model.dtype, ctx_tokens=ctx, draft_lens=list(range(s.max_draft_len + 1))))
        if budget.allows("linear micro-curve"):
            m_values = micro.default_m_values(list(s.batch_buckets), s.max_draft_len + 1)
            points += log.measure("micro/linear", lambda: micro.linear_curve(c, self.device, self.model.dtype, m_values=m_values))
        self._tick("micro", 2, 2)
        return [{k: v for k, v in p.items() if k not in ("tokens", "gflop", "achieved_gflops")} for p in points]


def acceptance_records(name: str, fmt: str, temp: float, domains: list[str], at_max: list[SpecCounters], sums: dict[str, np.ndarray],
                       method: str, checks: list[dict], *, max_draft_len: int, new_tokens: int, seed: int) -> list[dict]:
    """One acceptance record for every domain and one for "all" (domains weighted equally: `replay.figures`), from
    per-prompt counters at D_max (`at_max`) and the per-prompt sums at every D (`sums`)."""
    out = []
    for domain in ["all", *dict.fromkeys(domains)]:
        weights = dict.fromkeys(domains, 1.0) if domain == "all" else {domain: 1.0}
        tpf, al, tpf_ci, al_ci = intervals.figures(sums, domains, weights, resamples=BOOTSTRAP_RESAMPLES, seed=seed)
        c = SpecCounters.total([x for x, d in zip(at_max, domains) if domain in ("all", d)])
        out.append({
            "mechanism": name, "quant": fmt, "quant_source": "measured" if fmt == "none" else "emulated", "domain": domain,
            "temperature": temp, "max_draft_len": max_draft_len, "prompts": sum(domain in ("all", d) for d in domains),
            "new_tokens": new_tokens, "num_drafts": c.num_drafts, "num_draft_tokens": c.num_draft_tokens,
            "num_accepted_tokens": c.num_accepted_tokens, "num_accepted_tokens_per_pos": c.num_accepted_tokens_per_pos,
            "num_reached_per_pos": c.num_reached_per_pos, "num_rounds": c.num_rounds, "rounds": c.rounds,
            "conditional_acceptance": c.conditional_acceptance(), "tokens_per_forward": tpf.tolist(), "mean_al_vllm": al.tolist(),
            "tokens_per_forward_ci": _bounded_or_none(tpf_ci), "mean_al_vllm_ci": _bounded_or_none(al_ci), "method": method,
            "checks": checks if domain == "all" and fmt == "none" else [],
            **({"per_prompt": {"domains": list(domains), **{k: np.rint(sums[k]).astype(int).tolist() for k in ("emitted", "rounds", "accepted", "drafts")}}}
               if domain == "all" else {}),
        })
    return out


def _bounded_or_none(ci: np.ndarray) -> list:
    """An interval table as written: none ([]) where a domain of one prompt leaves it unbounded."""
    return ci.tolist() if np.isfinite(ci).all() else []


def remeasure(profile_path: Path, verify_cells: list[tuple[int, int, int]], visits: int = 2) -> tuple[Profile, list[dict]]:
    """Measure verify cells of a written profile again and refit its curve; profile.json is rewritten atomically.

    `verify_cells` are (batch, tokens, ctx). Each gets `visits` more visits (appended to the profile's measurement log
    under the next visit numbers, so the log keeps every sample); its figures then pool old and new samples, and the
    whole curve is fitted again (`fit_verify`). Returns the new profile and, per cell, its value before and after.
    """
    profile = load_profile(profile_path)
    if profile.device.get("projected_from"):
        raise SpecdecError(f"{profile_path} is projected onto {profile.device.get('name')}: its cells were never measured here",
                           "re-measure the profile it was projected from")
    log = MeasurementLog(profile_path.parent, profile.fingerprint)
    timed: list[tuple[tuple[int, int, int], list[float]]] = []  # in the order the visits were logged
    for key, value in log.items("verify/"):
        _, B, ctx, t, _visit = key.split("/")
        if value is not None:
            timed.append(((int(B), int(ctx), int(t)), value))
    w = profile.workload
    t_max = w.max_draft_len + 1
    infeasible = {}
    for p in profile.verify:
        if p.source == "infeasible":
            infeasible[(p.batch, p.ctx)] = min(p.tokens, infeasible.get((p.batch, p.ctx), p.tokens))
    device = resolve_device("cuda" if profile.device.get("kind") == "cuda" else "cpu")
    target = load_model(profile.target["path"], dtype=profile.device.get("dtype", "auto"), device=str(device))
    before = {(p.batch, p.tokens, p.ctx): p.median_ms for p in profile.verify}
    steps: dict[tuple[int, int], VerifyStep] = {}
    for B, t, ctx in verify_cells:
        if (B, ctx) not in steps:
            steps[(B, ctx)] = VerifyStep(target.model, B, ctx, t_max, 0, device)
    for B, t, ctx in [cell for _ in range(visits) for cell in verify_cells]:  # interleaved: the drift is told from the cells
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
    changes = [{"batch": B, "tokens": t, "ctx": ctx, "before_ms": before.get((B, t, ctx)), "after_ms": after[(B, t, ctx)].median_ms,
                "source": after[(B, t, ctx)].source} for B, t, ctx in verify_cells if (B, t, ctx) in after]
    return updated, changes


def summary(profile: Profile) -> dict:
    """The end-of-run facts: AL per mechanism x domain, the verify knee, the measured speedup bound per bucket."""
    D_max = profile.workload.max_draft_len
    ctx = profile.workload.ctx_buckets[0]
    verify = {(p.batch, p.tokens): p.median_ms for p in profile.verify if p.ctx == ctx}
    greedy = [a for a in profile.acceptance if a.temperature == 0.0 and a.quant == "none"]
    al = {(a.mechanism, a.domain): a.tokens_per_forward[-1] for a in greedy}  # at each drafter's longest D (a block caps it)
    al_ci = {(a.mechanism, a.domain): a.tokens_per_forward_ci[-1] for a in greedy if a.tokens_per_forward_ci}
    bounds = {}
    if profile.rounds:  # engine rounds: tokens per forward x T_round(B, 0) / T_round(B, D), draft and host included
        rounds = {(r.mechanism, r.batch, r.draft_len): r.median_ms for r in profile.rounds if r.ctx == ctx and r.median_ms}
        cost = {B: {(m, D): rounds[("none", B, 0)] / t for (m, b, D), t in rounds.items() if b == B and D} for B in profile.workload.batch_buckets
                if ("none", B, 0) in rounds}
    else:  # T_verif(B, 1) / T_verif(B, 1+D): draft and host cost left out, an upper bound
        cost = {B: {(a.mechanism, D): verify[(B, 1)] / verify[(B, D + 1)] for a in greedy for D in range(1, a.max_draft_len + 1)
                    if verify.get((B, D + 1))} for B in profile.workload.batch_buckets if verify.get((B, 1)) is not None}
    for B, ratios in cost.items():
        bounds[B] = max([(1.0, 0, "-")] + [(a.tokens_per_forward[D] * ratios[(a.mechanism, D)], D, a.mechanism)
                                          for a in greedy if a.domain == "all" for D in range(1, a.max_draft_len + 1) if (a.mechanism, D) in ratios])
    gemm = micro.linear_forward_curve([p.model_dump() for p in profile.micro if p.kind == "linear"], profile.target["num_layers"]) \
        if any(p.kind == "linear" for p in profile.micro) else []
    gemm_ms = {p["m"]: p["median_ms"] for p in gemm}
    gemm_share = {B: gemm_ms[B] / verify[(B, 1)] for B in profile.workload.batch_buckets if B in gemm_ms and verify.get((B, 1))}
    knees = {B: micro.knee([{"t": t, "ms": verify[(B, t)]} for t in range(1, D_max + 2) if verify.get((B, t))], "t", "ms")
             for B in profile.workload.batch_buckets if not profile.rounds}
    return {"al": al, "al_ci": al_ci, "bounds": bounds, "knees": knees, "ctx": ctx, "gemm_share": gemm_share,
            "prompts": dict(profile.workload.prompts_by_domain), "engine_rounds": bool(profile.rounds)}
