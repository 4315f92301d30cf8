"""The `plan.json` record: what `search` decided and why, each predicted figure with its source and interval.

Pydantic models, as `profiles/schema.py` is for `profile.json`: `search` writes a plan through `Plan`, `export`
reads one through it (a foreign or edited file is refused with one line naming the field), and the JSON Schema is
generated from it (`plan_json_schema`). Parts only people read (the rationale's figures, the study's summary, the
per-domain split) are plain objects. `PLAN_SCHEMA_VERSION` changes whenever a field's meaning does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import Figure as CostFigure
from specdec_tune.autotune.cost_model import Prediction
from specdec_tune.autotune.hardware import get_device_spec
from specdec_tune.formats import WEIGHT_FORMATS
from specdec_tune.profiles.schema import ModelRefRecord, Source
from specdec_tune.records import read_json
from specdec_tune.settings import MEASUREMENT_BACKENDS, OBJECTIVES

PLAN_SCHEMA_VERSION = 2
READABLE_PLAN_VERSIONS = (2,)


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Figure(Record):
    """A predicted figure (tokens/s, ms, a speedup, tokens per forward: none is negative) with its source."""

    value: float = Field(ge=0)
    source: Source
    low: float | None = Field(default=None, ge=0)  # 95% interval, where the inputs have one
    high: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Figure:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError("the interval's low end is above its high end")
        return self


# a bucket's predicted figures: each figure of the cost model's Prediction
# (verify, draft and host are None where the engine timed whole rounds; a plan searched before round_ms existed
# lacks it)
PREDICTED_FIGURES = tuple(
    f.name for f in dataclasses.fields(Prediction) if f.type in ("Figure", "Figure | None", CostFigure)
)
_OPTIONAL_FIGURES = tuple(f.name for f in dataclasses.fields(Prediction) if f.type == "Figure | None") + ("round_ms",)
if TYPE_CHECKING:
    # what create_model below builds from Prediction, spelled out for the type checker (which cannot follow it)

    class Predicted(Record):
        tokens_per_s: Figure
        per_user_tokens_per_s: Figure
        speedup: Figure
        tokens_per_forward: Figure
        round_ms: Figure | None = None
        verify_ms: Figure | None = None
        draft_ms: Figure | None = None
        host_ms: Figure | None = None

else:
    Predicted = create_model(
        "Predicted",
        __base__=Record,
        **{name: (Figure | None, None) if name in _OPTIONAL_FIGURES else (Figure, ...) for name in PREDICTED_FIGURES},
    )


class Decision(Record):
    """A bucket's choice under the profile's uncertainty (autotune/space.py, "Deciding"), against its runner-up."""

    expected_speedup: float = Field(ge=0)  # the mean over the cost model's draws
    runner_up_draft_len: int = Field(ge=0)
    runner_up_expected_speedup: float = Field(ge=0)
    expected_gain_pct: float  # the choice's expected speedup over the runner-up's, - 1
    p_beats_runner_up: float = Field(ge=0, le=1)  # the share of draws in which the choice is faster
    draws: int = Field(ge=1)


class DrafterDecision(Record):
    """The plan's drafter against the best other one (autotune/plan.py `drafter_decision`), as the search scored them,
    before any measured refinement."""

    expected_speedup: float = Field(ge=0)  # the choice's mean speedup over the buckets, its mean over the draws
    runner_up: str
    runner_up_quant: str
    runner_up_schedule: list[tuple[int, int]]
    runner_up_expected_speedup: float = Field(ge=0)
    runner_up_vs_choice: Figure  # per draw, the runner-up's mean speedup over the choice's: mean, 2.5-97.5% points
    p_beats_runner_up: float = Field(ge=0, le=1)  # the share of draws in which the choice is faster
    draws: int = Field(ge=1)


class Rationale(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")  # the figures behind the decision, for people
    text: str = Field(min_length=1)
    decision: Decision | None = None


class BucketMemory(Record):
    needed_bytes: float = Field(
        ge=0
    )  # weights + KV + activations at this batch, the plan's context and D (autotune/memory.py)
    weights_bytes: float = Field(ge=0)
    kv_bytes: float = Field(ge=0)
    activation_bytes: float = Field(ge=0)
    max_concurrency: int = Field(ge=0)  # the largest batch that fits at this D


class PlanMemory(BaseModel):
    """plan.json's memory budget (autotune/memory.py `summary`): the fields export computes the engines' limits from are
    typed; the concurrency table, the formula and the sources are for people."""

    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)
    fraction: float = Field(gt=0, le=1)
    device_bytes: float = Field(gt=0)
    device_source: str = Field(min_length=1)
    tensor_parallel: int = Field(ge=1)
    ctx: int = Field(ge=1)
    kv_cache_pool_bytes: float | None = Field(default=None, gt=0)
    target_weights_bytes: float = Field(ge=0)
    target_kv_bytes_per_token: float = Field(ge=0)


class Contender(Record):
    """One draft length a bucket's refinement decoded (pipeline/refine.py)."""

    draft_len: int = Field(ge=0)
    # "plain": vLLM's engine without a speculative config, beside D = 0 as a K = 0 band of a speculative engine
    engine: Literal["plain"] | None = None
    role: str = Field(min_length=1)  # why it was measured: the model's choice, the runner-up, the best single D, ...
    predicted_tokens_per_s: float = Field(ge=0)  # the cost model's (modeled), for the measured figures beside
    # measured, over the groups it decoded (a pruned one's too), each the geometric mean with its 95% interval: its
    # tokens/s, and its tokens/s over the model's D's group by group on the same prompts (1 for the model's D)
    measured_tokens_per_s: Figure | None = None
    vs_model: Figure | None = None
    # what the bucket decides on: the expected ratio over the model's D, the model's draws and the groups combined
    # (pipeline/refine.py `expected_vs_model`, source "fitted")
    expected_vs_model: Figure | None = None
    groups: int = Field(ge=0)
    # not measured: the budget left it out (less likely to beat the model's D than those measured), or another
    # worker still has it
    outcome: Literal["measured", "pruned", "not measured"]


class BucketRefinement(Record):
    model_draft_len: int = Field(ge=0)  # the cost model's choice
    chosen_draft_len: int = Field(ge=0)  # the fastest contender measured to the end (the model's where none was)
    chosen_engine: Literal["plain"] | None = None  # vLLM's plain engine took the bucket (its D is 0)
    # the domain shares of the prompts the groups decoded; their ratios carried to the plan's mix (pipeline/refine.py)
    decoded_mix: dict[str, float] | None = None
    contenders: list[Contender] = Field(min_length=1)


class Refinement(Record):
    """What the measured refinement did (pipeline/refine.py): its budget, what it spent and where its study lives."""

    source: Literal["measured (refinement)"]
    split: Literal["profile"]
    groups: int = Field(ge=1)
    new_tokens: int = Field(ge=1)
    budget_s: float = Field(ge=0)
    spent_s: float = Field(ge=0)
    uncertain_batches: list[int]
    certain_when: str
    trials: int = Field(ge=0)
    pruned: int = Field(ge=0)
    storage: str | None = None


class BucketEngineCosts(Record):
    """What the bucket pays in vLLM for running the plan's per-batch table (autotune/engine_pricing.py)."""

    graph_mode_ms: float = Field(ge=0)  # per round: PIECEWISE graphs where a static K runs full ones (modeled)
    k0_drafter_ms: Figure | None = None  # per round: a K = 0 bucket's drafter forward; None where none runs
    speedup_as_run: Figure  # the predicted speedup with both costs added to the round


class SchedulePricing(Record):
    """The per-batch schedule as vLLM runs it against the best static K (autotune/engine_pricing.py)."""

    engine: Literal["vllm"]
    graph_mode: str = Field(min_length=1)
    graph_mode_ms: float = Field(ge=0)
    schedule_mean_speedup_as_run: float = Field(ge=0)
    static_draft_len: int = Field(ge=0)
    static_mean_speedup: float = Field(ge=0)
    choice: Literal["schedule", "static"]
    why: str = Field(min_length=1)


class Bucket(Record):
    batch: int = Field(ge=1)
    draft_len: int = Field(ge=0)
    predicted: Predicted
    rationale: Rationale
    flags: list[str] = []
    memory: BucketMemory | None = None
    refinement: BucketRefinement | None = None
    engine_costs: BucketEngineCosts | None = None  # where the plan needs a per-batch table


HEX64 = r"^[0-9a-f]{64}$"
Backend = Literal[MEASUREMENT_BACKENDS]  # type: ignore[valid-type]  # the profile's measurement backend
Quant = Literal[WEIGHT_FORMATS]  # type: ignore[valid-type]


class ProfileRef(Record):
    fingerprint: str = Field(pattern=HEX64)  # the profile's fingerprint: a plan from another profile is refused
    sha256: str = Field(min_length=1)  # the profile file's sha256: export refuses a plan whose profile file differs
    device: str | None
    target: ModelRefRecord


class DeviceTimes(Record):
    name: str | None
    engine: Backend = (
        "torch"  # the engine the figures were measured in: the profile's backend (torch: this tool's own loop)
    )
    projected_from: str | None = None
    times: str = Field(min_length=1)  # the weakest source among the bucket predictions, or "modeled (hardware table)"
    sources: dict[str, int] = {}


class ExcludedBucket(Record):
    batch: int = Field(ge=1)
    why: str


class Objective(Record):
    kind: Literal[OBJECTIVES]  # type: ignore[valid-type]
    min_user_tokens_per_s: float | None = Field(default=None, ge=0)
    min_tokens_per_s: float | None = Field(default=None, ge=0)


class Tile(Record):
    policy: str = Field(min_length=1)
    rows: int = Field(ge=1)
    group: int = Field(ge=1)
    policies_searched: list[str] = []


class SingleDraftLen(Record):
    draft_len: int = Field(ge=0)
    mean_speedup: float = Field(ge=0)
    schedule_mean_speedup: float = Field(ge=0)


class Point(Record):
    mechanism: str
    quant: Quant
    max_batch: int = Field(ge=1)
    draft_len: int = Field(ge=0)
    tile_policy: str
    tokens_per_s: Figure
    per_user_tokens_per_s: Figure


class Pareto(Record):
    exact: list[Point]
    method: str
    study: list[Point] | None = None
    study_found: int | None = Field(default=None, ge=0)
    study_worst_gap_pct: float | None = None


class Study(Record):
    """What the Optuna study did: where it lives, its size, and how close its plan came to the exhaustive optimum."""

    storage: str
    name: str
    seed: int
    space_size: int = Field(ge=1)
    trials: int = Field(ge=0)
    trial_budget: int = Field(ge=0)
    exhaustive_value: float
    strict_optimum_value: float
    tie_tolerance: float = Field(ge=0, lt=1)
    best_sampled_value: float | None = None  # single objectives
    best_value: float | None = None
    gap_pct: float | None = None
    gap_to_strict_optimum_pct: float | None = None
    # the speedup objective: every predicted difference deciding (the drafter a drafter tie passed over, if one did)
    untied_drafter: dict[str, str] | None = None
    untied_schedule: list[tuple[int, int]] | None = None
    untied_gain_pct: float | None = None
    drafter_decision: DrafterDecision | None = None  # the speedup objective with more than one drafter


class RecordedSearchSettings(Record):
    """The `SearchSettings` a plan was searched with (all but where the study and plan were written), so that a plan can
    be searched again alike; each field checked as the CLI checks its option."""

    objective: Literal[OBJECTIVES]  # type: ignore[valid-type]
    trials: int = Field(ge=0)
    seed: int
    min_user_tokens_per_s: float = Field(ge=0)
    min_tokens_per_s: float = Field(ge=0)
    mechanisms: tuple[str, ...]
    quant_formats: tuple[Quant, ...] = Field(min_length=1)
    tile_rows: int = Field(ge=0)
    tie_tolerance: float = Field(ge=0, lt=1)
    study_name: str
    device: str | None
    mix: tuple[tuple[str, float], ...]
    memory_fraction: float = Field(gt=0, le=1)
    tensor_parallel: int = Field(ge=0)

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str | None) -> str | None:
        if device is not None:
            try:
                get_device_spec(device)
            except SpecdecError as e:
                raise ValueError(e.message) from None
        return device


class Plan(Record):
    schema_version: Literal[2]
    tool_version: str
    created_at: str
    profile: ProfileRef
    device: DeviceTimes
    notes: list[str]
    excluded_buckets: list[ExcludedBucket]
    mix: dict[str, float] | None
    objective: Objective
    mechanism: str = Field(min_length=1)
    quant: Quant
    max_draft_len: int = Field(ge=0)
    max_batch: int = Field(ge=1)
    ctx: int = Field(ge=1)
    tile: Tile
    buckets: list[Bucket] = Field(min_length=1)
    per_domain: dict | None = None  # each domain's own schedule, where the domains of the mix disagree on D
    # the memory budget, its sources and the concurrency that fits per mechanism and D
    memory: PlanMemory | None = None
    single_draft_len: SingleDraftLen
    pareto: Pareto
    study: Study
    settings_hash: str = Field(pattern=HEX64)
    search_settings: RecordedSearchSettings
    refinement: Refinement | None = None  # the measured refinement; absent where it did not run
    schedule_pricing: SchedulePricing | None = None  # where the plan needs a per-batch table

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        """What the plan's parts say of each other: the schedule's batches rise to the cap, its longest draft is
        `max_draft_len`, a mix's shares are positive, and a memory budget has every bucket's figures."""
        batches = [b.batch for b in self.buckets]
        if batches != sorted(set(batches)) or batches[-1] != self.max_batch:
            raise ValueError(f"the buckets' batches {batches} do not rise strictly to max_batch {self.max_batch}")
        if max(b.draft_len for b in self.buckets) != self.max_draft_len:
            raise ValueError(f"max_draft_len {self.max_draft_len} is not the schedule's longest draft")
        if self.mix is not None and (not self.mix or any(not w > 0 for w in self.mix.values())):
            raise ValueError("the mix needs at least one domain, each with a positive share")
        if self.memory is not None and any(b.memory is None for b in self.buckets):
            raise ValueError("the plan has a memory budget but a bucket without its memory figures")
        return self

    @property
    def schedule(self) -> list[tuple[int, int]]:
        """(batch bucket, D) per bucket."""
        return [(b.batch, b.draft_len) for b in self.buckets]

    @property
    def projected(self) -> bool:
        """Whether the plan was made for another device than the profile's (every time modeled from the hardware
        table)."""
        return bool(self.device.projected_from)

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
        raise SpecdecError(
            f"{path} has plan schema {raw['schema_version']}, this tool reads {READABLE_PLAN_VERSIONS}",
            "re-run `specdec-tune search` with this version",
        )
    try:
        return Plan.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = "/".join(str(p) for p in err["loc"]) or "(top level)"
        raise SpecdecError(
            f"{path} is not a valid plan: at {where}, {err['msg'][:160]} ({e.error_count()} problems)",
            "re-run `specdec-tune search`; plans are not edited by hand",
        ) from None


def plan_json_schema() -> dict:
    return Plan.model_json_schema()
