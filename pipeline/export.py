"""`specdec-tune export`: stage the bundle, prove it on this machine, and swap it into place.

    1  render    exporters/bundle.py `stage`: every engine's files checked against its rules, the kernels, the drafter's
                 ONNX graph (its network loaded here, in fp32), in a staging folder beside OUT
    2  lossless  the plan's drafter reproduces plain greedy output at every D it runs (pipeline/lossless.py)
    3  measure   the profile's backend checks the plan's throughput: this tool's loop decodes each bucket
                 (pipeline/throughput_check.py); a profile measured in vLLM is checked in vLLM, on the staged
                 `vllm/speculative_config.json` (pipeline/engine_check.py)
    4  repair    a failed throughput check re-measures the cells behind it (profile stage), re-plans (search stage) and
                 checks again before it refuses (pipeline/repair.py); the plan that passed is staged and, where its
                 drafts changed, gated again
    5  write     validation.json, the report and the manifest (exporters/bundle.py `write_bundle`), then the swap

Each record is written by its own stage: profile.json by profile, plan.json by search, the bundle by export.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.plan_schema import Plan, load_plan
from specdec_tune.exporters.artifacts import needs_drafter_network
from specdec_tune.exporters.bundle import (
    Staged,
    recover_interrupted,
    refuse_foreign_folder,
    resolve_versions,
    stage,
    staging_folder,
    swap_into_place,
    write_bundle,
)
from specdec_tune.exporters.validation_text import describe_kv, describe_row, describe_throughput_row, lossless_text
from specdec_tune.pipeline.engine_check import engine_refusal, engine_throughput
from specdec_tune.pipeline.lossless import lossless_gate_or_refuse, plan_drafter
from specdec_tune.pipeline.repair import repair_throughput, throughput_refusal
from specdec_tune.pipeline.throughput_check import throughput_check
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.schema import Profile, load_profile
from specdec_tune.records import sha256_file
from specdec_tune.settings import ExportSettings, MeasureSettings


def _drafter_network(plan: Plan, profile: Profile, s: ExportSettings):
    """The plan's drafter loaded in fp32 where its network ships as ONNX (None for a lookup, or with --no-onnx)."""
    if not s.onnx_drafter or not needs_drafter_network(plan, profile):
        return None
    return plan_drafter(plan, profile, load_model(profile.target["path"], dtype="float32"))


def _stage(plan: Plan, profile: Profile, s: ExportSettings, versions: dict) -> Staged:
    return stage(plan, profile, s, versions, staging_folder(s.out), _drafter_network(plan, profile, s))


@dataclasses.dataclass(frozen=True)
class Check:
    """How a profile's backend checks a plan's throughput on this machine: `run(plan, profile, bundle folder, measure,
    step)` returns its record (each bucket's line sent to `step` as it ends); a failure is either repaired by
    re-measuring the profile's cells (pipeline/repair.py) or refused at once with `refusal`."""

    run: Callable[[Plan, Profile, Path, MeasureSettings, Callable[[str], None]], dict]
    repaired: bool
    refusal: Callable[[dict], SpecdecError] | None = None


def _loop_check(
    plan: Plan, profile: Profile, bundle: Path, measure: MeasureSettings, step: Callable[[str], None]
) -> dict:
    return throughput_check(
        plan, profile, measure, on_row=lambda row: step(f"throughput {describe_throughput_row(row)}")
    )


def _vllm_check(
    plan: Plan, profile: Profile, bundle: Path, measure: MeasureSettings, step: Callable[[str], None]
) -> dict:
    """The bundle's vLLM config in vLLM (pipeline/engine_check.py)."""
    tp = engine_throughput(plan, profile, bundle, measure)
    for row in tp.get("buckets", []):
        step(f"vLLM {describe_row(row)}")
    if tp.get("kv_capacity"):
        step(f"vLLM {describe_kv(tp['kv_capacity'])}")
    return tp


# by the profile's backend (profiles/backends.py): this tool's loop, or the serving engine the profile was measured in,
# where vLLM running another D than the plan's is refused (the bundle would not run the plan)
CHECKS: dict[str, Check] = {
    "torch": Check(_loop_check, repaired=True),
    "vllm": Check(_vllm_check, repaired=False, refusal=engine_refusal),
}


def _draft_lens(plan: Plan) -> tuple:
    """What the lossless gate's verdict depends on: the drafter, its weights and the draft lengths the plan runs."""
    return plan.mechanism, plan.quant, sorted({d for _, d in plan.schedule if d > 0})


def export(
    s: ExportSettings, on_repair: Callable[[dict], None] | None = None, on_step: Callable[[str], None] | None = None
) -> dict:
    """Stage, validate and swap the bundle into place (module docstring). `on_repair` receives each repair round's
    record as it ends, `on_step` a line for each check as it ends (the lossless gate, each bucket of the throughput
    check). Returns the manifest."""
    step = on_step or (lambda line: None)
    recover_interrupted(s.out)
    plan = load_plan(s.plan)
    profile = load_profile(s.profile)
    if sha256_file(s.profile) != plan.profile.sha256:
        raise SpecdecError(
            f"{s.plan} was searched on another profile than {s.profile}",
            "pass the profile the plan was made from, or re-run search",
        )
    versions = resolve_versions(s.versions)
    refuse_foreign_folder(s.out)
    staging = staging_folder(s.out)
    try:
        staged = _stage(plan, profile, s, versions)
        repairs: list[dict] = []
        if s.skip_measure:
            gate = tp = {"skipped": "--configs-only"}
        else:
            gate = lossless_gate_or_refuse(plan, profile, s.measure)
            step(f"lossless gate: {lossless_text(gate)}")
            check = CHECKS[profile.backend]
            tp = check.run(plan, profile, staging, s.measure, step)
            if check.refusal is not None and tp.get("checked") and not tp["passed"]:
                raise check.refusal(tp)
            if check.repaired:
                checked = repair_throughput(s, plan, profile, tp, on_repair, on_step=step)
                tp, repairs = checked.throughput, checked.repairs
                if checked.failed:
                    raise throughput_refusal(checked.plan, checked.profile, tp, repairs, checked.not_repaired)
                if repairs:  # re-planned: stage (and, where its drafts changed, gate) the plan that passed
                    if _draft_lens(checked.plan) != _draft_lens(plan):
                        gate = lossless_gate_or_refuse(checked.plan, checked.profile, s.measure)
                    plan, profile = checked.plan, checked.profile
                    staged = _stage(plan, profile, s, versions)
        validation: dict = {
            "configs": staged.configs,
            "schedule_safety": staged.safety,
            "lossless": gate,
            "throughput": tp,
            **({"repairs": repairs} if repairs else {}),
        }
        manifest = write_bundle(staging, s, plan, profile, versions, staged, validation)
        swap_into_place(staging, s.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest
