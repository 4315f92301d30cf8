"""From the vLLM profile's engine runs to the profile's records: what a run's steps keep (`summarise`), a unit's
engines pooled (`merged`), steps brought to the reference speed, the between-engine term, the drafting slope, the round
points fitted monotone, and acceptance counters from vLLM's per-step lists. profiles/vllm_profile.py's docstring gives
the method; these are its pure parts, also read by the export's engine check."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from specdec_tune.profiles import intervals, replay
from specdec_tune.profiles.acceptance_records import BOOTSTRAP_RESAMPLES
from specdec_tune.profiles.intervals import between_group_sd, monotone_fit, moved_beyond_interval, widened_by
from specdec_tune.profiles.specdec import SpecCounters
from specdec_tune.profiles.timing import Timing

FIT_MAX_SWEEPS = 3000


def speed_probe_record(units: dict, probe: dict) -> dict | None:
    """The profile's reference speed: the median (and its 95% interval) of every probe sample every engine timed,
    and the elasticity of a step's time in the probe's (profiles/vllm_profile.py docstring, "Speed")."""
    samples = [ms for u in units.values() if u["ok"] for ms in u.get("probe_ms", [])]
    if not samples:
        return None
    tm = Timing.of(samples)
    cells = [(c["step_ms"], c["step_probe_ms"]) for u in units.values() if u["ok"] for c in u["cells"].values()]
    return {
        "spec": probe,
        "median_ms": tm.median_ms,
        "ci_ms": [tm.ci_low_ms, tm.ci_high_ms],
        "samples": len(samples),
        "elasticity": speed_elasticity(cells),
        "what": "the target's linear layers of one decode forward at the probe's rows, "
        "timed in the engine's process around "
        "and within every run (profiles/vllm_runner.py Probe); the rounds are brought to this median's speed",
    }


def round_points(
    units: dict, batches: list[int], ctxs: list[int], speed: dict | None, between: dict
) -> tuple[list[dict], list[str]]:
    """Round points per mechanism (plain as "none"): medians at the reference speed (`speed`; profiles/vllm_profile.py
    docstring, "Speed") with intervals holding the between-engine term (`between`), fitted monotone."""
    points, moved = [], []
    groups: dict[str, dict[int, dict]] = {}
    for (name, D), u in units.items():
        if u["ok"]:
            groups.setdefault(name, {})[D] = u
    for name, by_len in groups.items():
        lens = sorted(by_len)
        grid = np.full((len(lens), len(batches), len(ctxs)), np.nan)
        weight = np.zeros_like(grid)
        timings: dict[tuple[int, int, int], Timing] = {}
        for di, D in enumerate(lens):
            for bi, B in enumerate(batches):
                for ci, ctx in enumerate(ctxs):
                    cell = by_len[D]["cells"].get(f"{B}/{ctx}")
                    samples = at_reference(cell, speed) if cell else None
                    if samples:
                        timings[(D, B, ctx)] = timing = with_engines(
                            Timing.of(samples), between, len(set(cell["step_pass"]))
                        )
                        grid[di, bi, ci] = timing.median_ms
                        weight[di, bi, ci] = (
                            1.0 / max((timing.ci_high_ms - timing.ci_low_ms) / 2, 0.005 * timing.median_ms) ** 2
                        )
        if not timings:
            continue
        slopes = {
            (B, ctx): drafting_slope(
                [
                    (at_reference(c, speed), c.get("step_draft_tokens", []))
                    for u in by_len.values()
                    if (c := u["cells"].get(f"{B}/{ctx}"))
                ]
            )
            for B in batches
            for ctx in ctxs
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fitted = monotone_fit(grid, weight, max_iter=FIT_MAX_SWEEPS)
        for di, D in enumerate(lens):
            for bi, B in enumerate(batches):
                for ci, ctx in enumerate(ctxs):
                    cell = by_len[D]["cells"].get(f"{B}/{ctx}", {})
                    point = {
                        "mechanism": name,
                        "batch": B,
                        "draft_len": D,
                        "ctx": ctx,
                        "median_ms": None,
                        "source": "infeasible",
                    }
                    tm = timings.get((D, B, ctx))
                    if tm is not None:
                        y = float(fitted[di, bi, ci])
                        is_moved = moved_beyond_interval(tm.median_ms, y, tm.ci_low_ms, tm.ci_high_ms)
                        point |= {
                            "median_ms": y,
                            "raw_median_ms": float(np.median(cell["step_ms"])),
                            "p10_ms": tm.p10_ms,
                            "p90_ms": tm.p90_ms,
                            "repeats": tm.repeats,
                            "ci_low_ms": min(tm.ci_low_ms, y),
                            "ci_high_ms": max(tm.ci_high_ms, y),
                            "source": "fitted" if is_moved else "measured",
                            "tokens_per_round": cell.get("tokens_per_round"),
                            **_drafting(cell, slopes.get((B, ctx), 0.0)),
                        }
                        if is_moved:
                            moved.append(f"{name} D={D} B={B} ctx={ctx} {tm.median_ms:.1f}->{y:.1f} ms")
                    points.append(point)
    return points, moved


def at_reference(cell: dict, speed: dict | None) -> list[float]:
    """A merged cell's steps brought to the profile's reference speed (profiles/vllm_profile.py docstring, "Speed")."""
    if not speed:
        return cell["step_ms"]
    return [
        ms * (speed["median_ms"] / pr) ** speed["elasticity"] if pr else ms
        for ms, pr in zip(cell["step_ms"], cell["step_probe_ms"])
    ]


def between_engines_sd(cells: list[tuple[list[float], list[int]]]) -> dict:
    """The sd of log step time between the engines of one unit beyond their steps' own noise, pooled over
    every cell timed by at least two engines (intervals.between_group_sd; profiles/vllm_profile.py docstring,
    "Engines"). `cells`: each cell's steps (at reference speed) and the engine each came from."""
    groups = []
    for samples, passes in cells:
        by_pass: dict[int, list[float]] = {}
        for ms, p in zip(samples, passes):
            by_pass.setdefault(p, []).append(ms)
        groups.append(list(by_pass.values()))
    sd, used = between_group_sd(groups)
    return {
        "sd": sd,
        "cells": used,
        "what": "sd of ln(step ms) between the engines of one unit beyond their steps' noise, estimated "
        "from the units timed by several engines, at reference speed; each round's 95% interval is widened by "
        "1.96·sd/√(its engines) on the log scale",
    }


def with_engines(tm: Timing, between: dict, engines: int) -> Timing:
    """A cell's pooled timing with the between-engine term (`between_engines_sd`) added to its median's interval."""
    if not between.get("sd"):
        return tm
    low, high = widened_by(tm.ci_low_ms, tm.median_ms, tm.ci_high_ms, between["sd"], engines)
    return dataclasses.replace(tm, ci_low_ms=low, ci_high_ms=high)


def speed_elasticity(cells: list[tuple[list[float], list[float | None]]]) -> float:
    """d log(step ms) / d log(probe ms): the least-squares slope over every cell's steps, each cell about its own means
    (one slope, an offset per cell), clamped to [0, 1]; 0 where no cell's engines differ in speed."""
    sxy = sxx = 0.0
    for step_ms, probe_ms in cells:
        pairs = [(np.log(ms), np.log(pr)) for ms, pr in zip(step_ms, probe_ms) if pr and ms > 0]
        if len(pairs) < 3:
            continue
        y, x = np.array(pairs).T
        sxy += float(((x - x.mean()) * (y - y.mean())).sum())
        sxx += float(((x - x.mean()) ** 2).sum())
    return float(min(max(sxy / sxx, 0.0), 1.0)) if sxx > 1e-12 else 0.0


def drafting_slope(cells: list[tuple[list[float], list[float]]]) -> float:
    """ms of a step per draft token per row at one (B, ctx), from every timed cell there: the least-squares slope of a
    step's ms on its draft tokens per row k, each cell centred on its own means (one slope, an offset per cell), floored
    at 0 (verifying more tokens never makes a step cheaper; 0 where k did not vary). Verifying one more drafted token
    per row costs the same whatever D allowed it, so the cells of every D share the slope: a single cell's few dozen
    steps leave it to the noise (a spell of slow steps that happen to draft more reads as a costly token)."""
    sxy = sxx = 0.0
    for step_ms, draft_tokens in cells:
        if len(draft_tokens) != len(step_ms) or len(step_ms) < 3:
            continue
        k, y = np.asarray(draft_tokens), np.asarray(step_ms)
        sxy += float(((k - k.mean()) * (y - y.mean())).sum())
        sxx += float(((k - k.mean()) ** 2).sum())
    return max(sxy / sxx, 0.0) if sxx > 1e-12 else 0.0


def _drafting(cell: dict, ms_per_draft_token: float) -> dict:
    """A cell's draft tokens per row over its timed steps and its (B, ctx)'s slope (`drafting_slope`); none where its
    steps kept no draft counts."""
    k = cell.get("step_draft_tokens", [])
    return (
        {"draft_tokens_per_row": float(np.mean(k)), "ms_per_draft_token": ms_per_draft_token}
        if len(k) == len(cell["step_ms"]) and len(k) >= 3
        else {}
    )


def steady_steps(run: dict, batch: int) -> list[dict]:
    """A run's steps with `batch` requests decoding, none prefilling: the rounds a continuously batched server runs at
    that batch. The first is dropped: a new batch shape warms its buffers in it."""
    return [s for s in run["steps"] if not s["prefill"] and s["decoding"] == s["running"] == batch][1:]


def summarise(raw: dict, accept_ids: dict[str, list[str]]) -> dict:
    """What the profile keeps of one engine run: per (B, ctx) the steady steps' times and what they drafted and
    accepted, per temperature each request's counters (with its prompt's id, from `accept_ids`: temperature -> ids) and
    the run's engine seconds; the engine's error where it did not start or stopped part-way."""
    out: dict[str, Any] = {
        "ok": bool(raw.get("ok")),
        "error": raw.get("error"),
        "init_s": raw.get("init_s"),
        "cells": {},
        "accept": {},
        "accept_ids": {},
        "accept_s": {},
        "probe_ms": [],
    }
    for run in raw.get("runs", []):
        name = run.get("name") or ""
        out["probe_ms"] += [ms for ms in run.get("probe_ms") or [] if ms]
        if run.get("error"):
            out["error"], out["failed_cells"] = run["error"], True
            continue
        if name.startswith("time/"):
            _, B, ctx = name.split("/")
            steady = steady_steps(run, int(B))
            out["cells"][f"{B}/{ctx}"] = {
                "step_ms": [s["ms"] for s in steady],
                "step_draft_tokens": [s["num_draft_tokens"] / int(B) for s in steady],
                "rows": int(B) * len(steady),
                "accepted": sum(s["num_accepted_tokens"] for s in steady),
            }
        elif name.startswith("accept/"):
            temp = name.split("/")[1]
            out["accept"].setdefault(temp, []).extend(
                {
                    "output_tokens": len(r["output_ids"]),
                    "rounds": r["rounds"],
                    "drafted": (r.get("spec") or {}).get("per_step_drafted", []),
                    "accepted": (r.get("spec") or {}).get("per_step_accepted", []),
                }
                for r in run["requests"]
            )
            out["accept_ids"].setdefault(temp, []).extend(accept_ids[temp][: len(run["requests"])])
            out["accept_s"][temp] = out["accept_s"].get(temp, 0.0) + sum(s["ms"] for s in run.get("steps", [])) / 1e3
    return out


def merged(engines: list[dict]) -> dict:
    """A unit's engines (in the order they ran) as one: each cell's steps pooled (tokens per round over all of
    them), the acceptance runs in the order they ran; not ok where the first engine was not (a later one's failure
    marks the unit's cells as `failed_cells`)."""
    out = {
        "ok": engines[0]["ok"],
        "error": next((p["error"] for p in engines if p["error"]), None),
        "init_s": [p["init_s"] for p in engines],
        "passes": len(engines),
        "cells": {},
        "accept": {},
        "accept_ids": {},
        "accept_s": {},
        "probe_ms": [ms for p in engines for ms in p.get("probe_ms", [])],  # a unit logged before probes has none
        "engine_s": None if any(p.get("engine_s") is None for p in engines) else sum(p["engine_s"] for p in engines),
    }
    if any(p.get("failed_cells") for p in engines):
        out["failed_cells"] = True
    for index, p in enumerate(engines):
        pass_probe_ms = float(np.median(p["probe_ms"])) if p.get("probe_ms") else None  # the pass's speed
        for key, cell in p["cells"].items():
            into = out["cells"].setdefault(
                key,
                {
                    "step_ms": [],
                    "step_draft_tokens": [],
                    "rows": 0,
                    "accepted": 0,
                    "step_probe_ms": [],
                    "step_pass": [],
                },
            )
            for k in ("step_ms", "step_draft_tokens", "rows", "accepted"):
                into[k] += cell[k]
            into["step_probe_ms"] += [pass_probe_ms] * len(cell["step_ms"])
            into["step_pass"] += [index] * len(cell["step_ms"])
        for temp, rows in p["accept"].items():
            out["accept"].setdefault(temp, []).extend(rows)
            out["accept_ids"].setdefault(temp, []).extend(p["accept_ids"][temp])
            out["accept_s"][temp] = out["accept_s"].get(temp, 0.0) + p["accept_s"][temp]
    for cell in out["cells"].values():
        cell["tokens_per_round"] = (cell["rows"] + cell["accepted"]) / cell["rows"] if cell["rows"] else None
    return out


def half_widths(counters: list[SpecCounters], domains: list[str], draft_len: int, seed: int) -> dict[str, float]:
    """Per domain, the relative 95% half-width of tokens per forward at `draft_len`, bootstrapped over its prompts."""
    sums = replay.derived_rates(counters, draft_len)
    out = {}
    for d in dict.fromkeys(domains):
        figures = intervals.figures(sums, domains, {d: 1.0}, resamples=BOOTSTRAP_RESAMPLES, seed=seed)
        assert len(figures) == 4  # resampled: the figures and their intervals
        tpf, _, ci, _ = figures
        out[d] = float((ci[draft_len, 1] - ci[draft_len, 0]) / 2 / tpf[draft_len])
    return out


def counters_of(row: dict, max_draft_len: int) -> SpecCounters:
    """One request's counters from vLLM's per-step drafted / accepted lists: each verify step a round of L drafted and n
    accepted (n + 1 tokens); the request's other rounds (its prefill's and the ones with no draft) one token each."""
    c = SpecCounters(max_draft_len=max_draft_len)
    for L, n in zip(row["drafted"], row["accepted"]):
        c.record(min(L, max_draft_len), n, n + 1)
    for _ in range(max(row["rounds"] + 1 - len(row["drafted"]), 0)):
        c.record(0, 0, 1)
    c.num_emitted_tokens = row["output_tokens"]  # the last round may have accepted past max_tokens: vLLM cut them
    return c
