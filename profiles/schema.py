"""The `profile.json` record: what `profile` measured, each figure with its source.

Pydantic models, frozen and strict about unknown fields, so a loader rejects a corrupt or foreign
file with a message naming the field. `SCHEMA_VERSION` changes whenever a field's meaning does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from specdec_tune import SpecdecError
from specdec_tune.profiles.records import read_json

SCHEMA_VERSION = 1
Source = Literal["measured", "interpolated", "modeled", "emulated", "infeasible"]


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Timed(Record):
    median_ms: Optional[float]  # None when infeasible (out of memory)
    p10_ms: Optional[float] = None
    p90_ms: Optional[float] = None
    repeats: int = 0
    source: Source


class TimingPoint(Timed):
    """T_verif(B, 1+D, ctx): one target forward over `batch` rows x `tokens` new tokens on a KV cache of `ctx`."""

    batch: int
    tokens: int  # 1 + D
    ctx: int


class DraftPoint(Timed):
    """T_draft(B, D): one propose() call as the mechanism runs it (serial steps, one pass, or lookups)."""

    mechanism: str
    quant: str = "none"
    batch: int
    draft_len: int
    ctx: int


class HostPoint(Record):
    """Per-round loop time outside the drafter and the target forward (bookkeeping, Python)."""

    mechanism: str
    batch: int
    draft_len: int
    host_ms_per_round: float
    round_ms: float  # whole round: draft + verify + host
    rounds: int
    source: Source = "measured"


class ALCheck(Record):
    """Derived tokens per target forward at a smaller D against a direct run at that D."""

    draft_len: int
    derived: float
    direct: float
    rel_diff: float
    flagged: bool  # |rel_diff| > 5%


class AcceptanceRecord(Record):
    mechanism: str
    quant: str = "none"  # weights format of the drafter while measured
    quant_source: Source = "measured"  # "emulated" when the format ran as fake-quantized weights
    domain: str  # a calibration domain, or "all"
    temperature: float
    max_draft_len: int
    prompts: int
    new_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    num_reached_per_pos: list[int]
    num_rounds: int
    rounds: list[list[int]]  # [L][n]: rounds that proposed L tokens with n accepted
    conditional_acceptance: list[Optional[float]]  # a_k; None where position k was never reached
    tokens_per_forward: list[float]  # [D] for D = 0..max_draft_len, derived from `rounds` (index 0 = 1.0)
    mean_al_vllm: list[float]  # [D] vLLM's mean acceptance length (rounds with a draft only), derived
    checks: list[ALCheck] = []


class MicroPoint(Record):
    kind: Literal["attention", "linear"]
    layer: str = ""  # linear: qkv, o, gate_up, down, lm_head
    batch: int = 1
    draft_len: int = 0
    rows_per_kv_head: int = 0  # attention: G * (1 + D)
    ctx: int = 0
    m: int = 0  # linear: GEMM rows = B * (1 + D)
    in_features: int = 0
    out_features: int = 0
    median_ms: float
    p10_ms: float
    p90_ms: float
    repeats: int
    source: Source


class DrafterInfo(Record):
    name: str
    kind: str
    options: dict
    model: Optional[dict] = None  # ModelRef of a draft model, when it has its own weights
    quant_formats: list[str] = ["none"]
    draft_len_multiple: int = 1  # D must be a multiple of this (MTP: the checkpoint's layer count)
    max_draft_len: Optional[int] = None  # the longest draft it makes (DFlash / DSpark: its block); None = the workload's D_max


class Workload(Record):
    calibration: str
    calibration_fingerprint: str
    split: str
    domains: list[str]
    prompts_per_domain: int
    new_tokens: int
    temperatures: list[float]
    batch_buckets: list[int]
    ctx_buckets: list[int]
    max_draft_len: int
    acceptance_batch: int


class Profile(Record):
    schema_version: int
    tool_version: str
    created_at: str  # the one timestamp; everything else is deterministic given the measurements
    fingerprint: str  # hash of what makes this profile reusable: device factors, models, drafters, workload
    backend: str
    device: dict
    target: dict  # ModelRef
    timing_shapes: str  # which model shapes the timings came from
    drafters: list[DrafterInfo]
    workload: Workload
    verify: list[TimingPoint]
    draft: list[DraftPoint]
    host: list[HostPoint]
    acceptance: list[AcceptanceRecord]
    micro: list[MicroPoint]
    notes: list[str] = []


def load_profile(path: Path) -> Profile:
    """Read and validate a profile; every failure is one line naming the file and the fix."""
    raw = read_json(path, "profile")
    if not isinstance(raw, dict) or "schema_version" not in raw:
        raise SpecdecError(f"{path} is not a specdec-tune profile (no schema_version)", "pass the profile.json that `specdec-tune profile` wrote")
    if raw["schema_version"] != SCHEMA_VERSION:
        raise SpecdecError(
            f"{path} has profile schema version {raw['schema_version']}, this tool reads version {SCHEMA_VERSION}",
            "re-run `specdec-tune profile` with this version",
        )
    try:
        return Profile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise SpecdecError(f"{path} is not a valid profile: {where}: {err['msg']} ({e.error_count()} problems)", "re-run `specdec-tune profile`") from None


def profile_json_schema() -> dict:
    return Profile.model_json_schema()
