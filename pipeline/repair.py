"""Repairing a failed throughput check before refusing: on a shared machine a profile cell that caught a slow spell
makes a right plan look wrong.

Each round re-measures the verify cells the failing buckets' predictions rest on (`prediction_cells`; the profile stage
rewrites profile.json: `verify_curve.remeasure`), searches the plan again with its own settings (the search stage
rewrites plan.json; a refined plan is refined again from its own study), and checks again the buckets that failed or
whose D or prediction the re-plan changed, for at most `MeasureSettings.repair_rounds` rounds; each round is recorded
(`repair_record`). Export refuses only when the disagreement survives, naming the buckets, their cells and the figures
(`throughput_refusal`). A plan modeled for another device, or a profile whose backend cannot re-measure its cells here,
is not repaired.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.autotune.plan_schema import Plan, Refinement
from specdec_tune.autotune.search import search
from specdec_tune.autotune.study import IN_MEMORY
from specdec_tune.exporters.validation_text import describe_throughput_row, ms_text, schedule_of, schedule_text
from specdec_tune.pipeline import refine
from specdec_tune.pipeline.throughput_check import throughput_check
from specdec_tune.profiles.backends import backend_of
from specdec_tune.profiles.schema import Profile, load_profile
from specdec_tune.profiles.verify_curve import remeasure
from specdec_tune.records import sha256_file, write_json
from specdec_tune.settings import ExportSettings, SearchSettings


def failing_rows(tp: dict) -> list[dict]:
    """The timed buckets a throughput check failed (pipeline/throughput_check.py, "Verdicts"; an inconclusive bucket is
    not one), none where the check did not run."""
    if not tp.get("checked"):
        return []
    return [r for r in tp["buckets"] if r.get("verdict") == "failed"]


def round_widths(cost, mechanism: str, quant: str, batch: int, draft_len: int) -> list[int]:
    """The round widths w (the batch verifies 1+w tokens) whose verify time the cost model weighs at this draft
    length: every w the batch's longest proposal takes with a share of the rounds (cost_model.py,
    `round_verify_ms`), or D alone where every round drafts D."""
    if draft_len == 0:
        return [0]
    shares = cost.acceptance(mechanism, quant).round_shares(draft_len)
    if shares is None or shares[-1] >= 1 - 1e-12:
        return [draft_len]
    widths, below = [], 0.0
    for w in range(draft_len + 1):
        at_most = sum(shares[: min(w, len(shares) - 1) + 1]) ** batch if w < draft_len else 1.0
        if at_most - below > 1e-12:
            widths.append(w)
        below = at_most
    return widths


def prediction_cells(plan: Plan, profile: Profile, batch: int, draft_len: int) -> list[tuple[int, int, int]]:
    """The profile's verify cells (batch, tokens, ctx) a bucket's predicted tokens/s rests on, at the plan's context:
    one token (no speculation), 1+D, and 1+w for every round width w the prediction weighed. Cells that ran out of
    memory when profiled are left out (there is nothing to re-measure)."""
    ctx = plan.ctx
    tokens = {1, 1 + draft_len}
    if draft_len:
        cost = CostModel(profile, ctx=ctx, mix=plan.mix)
        tokens |= {1 + w for w in round_widths(cost, plan.mechanism, plan.quant, batch, draft_len)}
    timed = {(p.batch, p.tokens) for p in profile.verify if p.ctx == ctx and p.median_ms is not None}
    return [(batch, t, ctx) for t in sorted(tokens) if (batch, t) in timed]


def cell_ms(profile: Profile, cell: tuple[int, int, int]) -> float | None:
    """A verify cell's time in the profile (its fitted median), None where it has none."""
    return next((p.median_ms for p in profile.verify if (p.batch, p.tokens, p.ctx) == cell), None)


def _worst_error_pct(tp: dict) -> float | None:
    return tp.get("worst", {}).get("error_pct") if tp.get("checked") else None


def _bucket_figures(r: dict) -> dict:
    return {
        "batch": r["batch"],
        "draft_len": r["draft_len"],
        "predicted_tokens_per_s": r["predicted_tokens_per_s"],
        "predicted_at_current_speed_tokens_per_s": r["predicted_at_current_speed_tokens_per_s"],
        "measured_tokens_per_s": r["measured_tokens_per_s"],
        "error_pct": r["error_pct"],
    }


def repair_record(
    round_number: int, plan_before: Plan, tp_before: dict, cells: list[dict], plan_after: Plan, tp_after: dict
) -> dict:
    """One round of repair as validation.json keeps it: the buckets that failed, the cells re-measured (ms before and
    after), the schedule before and after the re-plan, and the worst error before and after."""
    return {
        "round": round_number,
        "failing": [_bucket_figures(r) for r in failing_rows(tp_before)],
        "cells": cells,
        "before": schedule_of(plan_before),
        "after": schedule_of(plan_after),
        "worst_error_pct_before": _worst_error_pct(tp_before),
        "worst_error_pct_after": _worst_error_pct(tp_after),
        "passed": bool(tp_after.get("checked") and tp_after.get("passed")),
        "failed": _check_failed(tp_after),
    }


def _first_before_ms(repairs: list[dict]) -> dict[tuple[int, int, int], float | None]:
    """Each re-measured cell's time before its first re-measurement."""
    first: dict[tuple[int, int, int], float | None] = {}
    for record in repairs:
        for c in record["cells"]:
            first.setdefault((c["batch"], c["tokens"], c["ctx"]), c["before_ms"])
    return first


def _cells_text(plan: Plan, profile: Profile, r: dict, first_ms: dict) -> str:
    if plan.projected:
        return f"its verify times modeled for {plan.device.name}"
    cells = prediction_cells(plan, profile, r["batch"], r["draft_len"])
    parts = []
    for cell in cells:
        now = ms_text(cell_ms(profile, cell))
        parts.append(
            f"1+D={cell[1]} {ms_text(first_ms[cell])} -> {now} ms" if cell in first_ms else f"1+D={cell[1]} {now} ms"
        )
    return f"verify cells at B={r['batch']}, ctx {plan.ctx}: " + ", ".join(parts)


def throughput_refusal(
    plan: Plan, profile: Profile, tp: dict, repairs: list[dict], not_repaired: str | None = None
) -> SpecdecError:
    """The one-line error of a throughput check that still fails: each failing bucket with its predicted and measured
    tokens/s and the verify cells (ms) its prediction rests on, after how many rounds of re-measuring."""
    first_ms = _first_before_ms(repairs)
    buckets = "; ".join(
        f"batch {r['batch']}, D={r['draft_len']}: predicted {r['predicted_at_current_speed_tokens_per_s']:.1f} "
        f"tokens/s, measured {r['measured_tokens_per_s']:.1f} ({r['error_pct']:+.1f}%), "
        f"{_cells_text(plan, profile, r, first_ms)}"
        for r in failing_rows(tp)
    )
    if repairs:
        when = f"after {len(repairs)} round(s) of re-measuring the cells and re-planning"
        fix = (
            "the disagreement is not a slow spell in those cells: re-profile on a quiet machine "
            "(specdec-tune profile --force), or raise --tolerance; profile.json and plan.json keep the re-measured "
            "cells and the re-plan"
        )
    else:
        when = f"not repaired: {not_repaired}" if not_repaired else "not repaired"
        fix = "re-profile on this machine, or raise --tolerance"
    return SpecdecError(f"throughput check failed (tolerance {tp['tolerance_pct']:g}%, {when}): {buckets}", fix)


@dataclasses.dataclass(frozen=True)
class Checked:
    """A throughput check after any repair: the plan and profile it ran on, its result, and each round of repair."""

    plan: Plan
    profile: Profile
    throughput: dict
    repairs: list[dict]
    not_repaired: str | None = None  # why a failed check was refused without re-measuring

    @property
    def failed(self) -> bool:
        return _check_failed(self.throughput)


def _check_failed(tp: dict) -> bool:
    return bool(tp.get("checked")) and bool(tp.get("failed"))


def repair_throughput(
    s: ExportSettings,
    plan: Plan,
    profile: Profile,
    tp: dict,
    on_repair: Callable[[dict], None] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> Checked:
    """Up to `repair_rounds` rounds while the check fails: re-measure the verify cells the failing buckets' predictions
    rest on (profile.json is rewritten), re-plan with the plan's own search settings (plan.json is rewritten), check
    again the buckets that failed or whose D or prediction the re-plan changed (the others' rows stand). `on_step`
    receives a line as each part of a round ends.

    A check that did not run, or a plan modeled for another device (its cells were never measured here), is never
    repaired."""
    step = on_step or (lambda line: None)
    repairs: list[dict] = []
    while _check_failed(tp) and len(repairs) < s.measure.repair_rounds:
        settings = search_settings_of(plan)
        why = _not_repairable(plan, profile)
        if why:
            return Checked(plan, profile, tp, repairs, why)
        round_number = len(repairs) + 1
        cells = sorted(
            {cell for r in failing_rows(tp) for cell in prediction_cells(plan, profile, r["batch"], r["draft_len"])}
        )
        _, changes = remeasure(s.profile, cells)
        step(
            f"repair round {round_number}: re-measured {len(cells)} verify cell(s) at batch "
            + ", ".join(str(B) for B in sorted({c[0] for c in cells}))
        )
        profile = load_profile(s.profile)
        replanned = replan(s.plan, s.profile, profile, settings, plan.refinement)
        step(f"repair round {round_number}: re-planned, {schedule_text(schedule_of(replanned))}")
        standing = {r["batch"]: r for r in tp["buckets"] if r.get("within")}

        def on_row(row: dict, round_number: int = round_number) -> None:
            step(f"repair round {round_number}: throughput {describe_throughput_row(row)}")

        checked = throughput_check(
            replanned,
            profile,
            s.measure,
            keep=standing,
            on_row=on_row,
        )
        record = repair_record(round_number, plan, tp, changes, replanned, checked)
        repairs.append(record)
        if on_repair:
            on_repair(record)
        plan, tp = replanned, checked
    why = "--repair-rounds is 0" if _check_failed(tp) and not repairs else None
    return Checked(plan, profile, tp, repairs, why)


def _not_repairable(plan: Plan, profile: Profile) -> str | None:
    if plan.projected:
        return f"the plan is for {plan.device.name} (modeled), whose cells were not measured on this device"
    if not backend_of(profile).remeasurable_cells:
        return f"a profile measured with --engine {profile.backend} has no verify cells to measure again here"
    return None


def replan(
    plan_path: Path,
    profile_path: Path,
    profile: Profile,
    settings: SearchSettings,
    refinement: Refinement | None = None,
) -> Plan:
    """Search again on the re-measured profile with the plan's own settings, in a fresh study (the plan's own scored its
    trials on the cells before they were re-measured), and where the plan was refined, refine the new one from the same
    refinement study (pipeline/refine.py: the contenders decoded before are not decoded again); the search stage
    writes the plan over plan_path."""
    with tempfile.TemporaryDirectory(prefix="specdec-replan-", dir=plan_path.parent) as folder:
        plan = search(
            profile, sha256_file(profile_path), dataclasses.replace(settings, out_dir=Path(folder), storage=IN_MEMORY)
        )
        if refinement is not None and not refine.skipped(plan, profile):
            plan = refine.refine(
                plan, profile, refine.settings_of(refinement, plan_path.parent), plan_path.parent, lambda line: None
            )
            write_json(Path(folder) / "plan.json", plan.to_json())
        (Path(folder) / "plan.json").replace(plan_path)  # a rename: plan_path holds the old plan or the new one
    return plan


def search_settings_of(plan: Plan) -> SearchSettings:
    """The SearchSettings `search` made this plan with (recorded in plan.json)."""
    return SearchSettings(**plan.search_settings.model_dump())
