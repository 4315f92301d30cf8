"""The `plan.json` record: what `search` decided and why, each predicted figure with its source and interval.

Pydantic models, as `profiles/schema.py` is for `profile.json`: `search` writes a plan through `Plan`, `export`
reads one through it (a foreign or edited file is refused with one line naming the field), and the JSON Schema is
generated from it (`plan_json_schema`). Parts only people read (the rationale's figures, the study's summary, the
per-domain split) are plain objects. `PLAN_SCHEMA_VERSION` changes whenever a field's meaning does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import Figure as CostFigure, Prediction
from specdec_tune.profiles.schema import Source
from specdec_tune.records import read_json

PLAN_SCHEMA_VERSION = 2
READABLE_PLAN_VERSIONS = (2,)


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Figure(Record):
    value: float
    source: Source
    low: Optional[float] = None  # 95% interval, where the inputs have one
    high: Optional[float] = None


# a bucket's predicted figures: each figure of the cost model's Prediction
# (verify, draft and host are None where the engine timed whole rounds; a plan searched before round_ms existed lacks it)
PREDICTED_FIGURES = tuple(f.name for f in dataclasses.fields(Prediction) if f.type in ("Figure", "Figure | None", CostFigure))
_OPTIONAL_FIGURES = tuple(f.name for f in dataclasses.fields(Prediction) if f.type == "Figure | None") + ("round_ms",)
Predicted = create_model("Predicted", __base__=Record, **{name: (Optional[Figure], None) if name in _OPTIONAL_FIGURES else (Figure, ...)
                                                           for name in PREDICTED_FIGURES})


class Rationale(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")  # the figures behind the decision, for people
    text: str


class BucketMemory(Record):
    needed_bytes: float  # weights + KV + activations at this batch, the plan's context and D (autotune/memory.py)
    weights_bytes: float
    kv_bytes: float
    activation_bytes: float
    max_concurrency: int  # the largest batch that fits at this D


class PlanMemory(BaseModel):
    """plan.json's memory budget (autotune/memory.py `summary`): the fields export computes the engines' limits from are
    typed; the concurrency table, the formula and the sources are for people."""

    model_config = ConfigDict(frozen=True, extra="allow")
    fraction: float = Field(gt=0, le=1)
    device_bytes: float = Field(gt=0)
    device_source: str
    tensor_parallel: int = Field(ge=1)
    ctx: int = Field(ge=1)
    kv_cache_pool_bytes: Optional[float] = Field(default=None, gt=0)
    target_weights_bytes: float = Field(ge=0)
    target_kv_bytes_per_token: float = Field(ge=0)


class Bucket(Record):
    batch: int = Field(ge=1)
    draft_len: int = Field(ge=0)
    predicted: Predicted
    rationale: Rationale
    flags: list[str] = []
    memory: Optional[BucketMemory] = None


class ProfileRef(Record):
    fingerprint: str  # the profile's fingerprint: a plan from another profile is refused
    sha256: str
    device: Optional[str]
    target: dict


class DeviceTimes(Record):
    name: Optional[str]
    engine: str = "torch"  # the engine the figures were measured in: the profile's backend (torch: this tool's own loop)
    projected_from: Optional[str] = None
    times: str  # the weakest source among the bucket predictions, or "modeled (hardware table)"
    sources: dict[str, int] = {}


class ExcludedBucket(Record):
    batch: int
    why: str


class Objective(Record):
    kind: str
    min_user_tokens_per_s: Optional[float] = None
    min_tokens_per_s: Optional[float] = None


class Tile(Record):
    policy: str
    rows: int = Field(ge=1)
    group: int = Field(ge=1)
    policies_searched: list[str] = []


class SingleDraftLen(Record):
    draft_len: int = Field(ge=0)
    mean_speedup: float
    schedule_mean_speedup: float


class Point(Record):
    mechanism: str
    quant: str
    max_batch: int = Field(ge=1)
    draft_len: int = Field(ge=0)
    tile_policy: str
    tokens_per_s: Figure
    per_user_tokens_per_s: Figure


class Pareto(Record):
    exact: list[Point]
    method: str
    study: Optional[list[Point]] = None
    study_found: Optional[int] = None
    study_worst_gap_pct: Optional[float] = None


class Plan(Record):
    schema_version: Literal[2]
    tool_version: str
    created_at: str
    profile: ProfileRef
    device: DeviceTimes
    notes: list[str]
    excluded_buckets: list[ExcludedBucket]
    mix: Optional[dict[str, float]]
    objective: Objective
    mechanism: str = Field(min_length=1)
    quant: str = Field(min_length=1)
    max_draft_len: int = Field(ge=0)
    max_batch: int = Field(ge=1)
    ctx: int = Field(ge=1)
    tile: Tile
    buckets: list[Bucket] = Field(min_length=1)
    per_domain: Optional[dict] = None  # each domain's own schedule, where the domains of the mix disagree on D
    memory: Optional[PlanMemory] = None  # the memory budget, its sources and the concurrency that fits per mechanism and D
    single_draft_len: SingleDraftLen
    pareto: Pareto
    study: dict
    settings_hash: str
    search_settings: dict

    @model_validator(mode="after")
    def _memory_in_every_bucket(self) -> Plan:
        if self.memory is not None and any(b.memory is None for b in self.buckets):
            raise ValueError("the plan has a memory budget but a bucket without its memory figures")
        return self

    def to_json(self) -> dict:
        """The JSON object plan.json holds (fields left unset, such as a missing per-domain split, stay out)."""
        return self.model_dump(mode="json", exclude_unset=True)


def plan_record(fields: dict) -> Plan:
    """A plan from the fields `search` assembled; a field that leaves the record is a bug, named here."""
    return Plan.model_validate(fields)


def load_plan(path: Path) -> Plan:
    """Read and validate a plan; every failure is one line naming the file and the fix."""
    raw = read_json(path, "plan")
    if not isinstance(raw, dict) or "schema_version" not in raw or "buckets" not in raw:
        raise SpecdecError(f"{path} is not a specdec-tune plan", "pass the plan.json that `specdec-tune search` wrote")
    if raw["schema_version"] not in READABLE_PLAN_VERSIONS:
        raise SpecdecError(f"{path} has plan schema {raw['schema_version']}, this tool reads {READABLE_PLAN_VERSIONS}",
                           "re-run `specdec-tune search` with this version")
    try:
        return Plan.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = "/".join(str(p) for p in err["loc"]) or "(top level)"
        raise SpecdecError(f"{path} is not a valid plan: at {where}, {err['msg'][:160]} ({e.error_count()} problems)",
                           "re-run `specdec-tune search`; plans are not edited by hand") from None


def plan_json_schema() -> dict:
    return Plan.model_json_schema()
