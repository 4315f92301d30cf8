"""The `profile.json` record: what `profile` measured, each figure with its source.

Pydantic models, frozen and strict about unknown fields, so a loader rejects a corrupt or foreign
file with a message naming the field. `SCHEMA_VERSION` changes whenever a field's meaning does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec_tune import SpecdecError
from specdec_tune.formats import WEIGHT_FORMATS
from specdec_tune.records import read_json
from specdec_tune.settings import MEASUREMENT_BACKENDS

SCHEMA_VERSION = 3
# version 1: no intervals, no monotone fit (its figures load as they were recorded); version 2: no engine rounds
READABLE_VERSIONS = (1, 2, 3)
# fitted: a measured cell the monotone fit moved by more than its interval (its measurement disagreed with
# its neighbours)
Source = Literal["measured", "interpolated", "modeled", "emulated", "fitted", "infeasible"]


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Described(BaseModel):
    """A record whose typed fields later stages read; further fields are kept for people (and future readers)."""

    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)


# ---------------------------------------------------------------------------- what was measured on what


class ModelRefRecord(Record):
    """profile.json's `target` (profiles/models/folders.ModelRef): what identifies the model; any change makes it stale."""  # noqa: E501 - pydantic's description of the record in the JSON schema: it stays one line

    path: str = Field(min_length=1)
    format: Literal["hf", "gguf"]
    arch: str = Field(min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"]
    config_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    weights_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    num_layers: int = Field(ge=1)


class DeviceRecord(Described):
    """profile.json's `device` (profiles/fingerprint.py): what sets the device's speed; a serving engine's version where
    the profile was measured in one (`engine`)."""

    kind: Literal["cpu", "cuda"]
    name: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    threads: int | None = Field(default=None, ge=1)
    memory_bytes: int | None = Field(default=None, ge=1)
    capability: list[int] | None = None
    engine: str | None = None
    projected_from: str | None = None  # a profile projected onto a hardware-table device (autotune/projection.py)


class SpeedProbe(Described):
    """The serving engine's speed probe: the profile's reference speed and how a step's time follows it."""

    median_ms: float = Field(gt=0)
    elasticity: float = Field(ge=0, le=1)
    spec: dict


class BetweenEngines(Described):
    sd: float | None = Field(
        default=None, ge=0
    )  # of ln(step ms) between engines of one unit, beyond their steps' noise


class EngineRecord(Described):
    """profile.json's `engine`: the serving engine the profile was measured in (empty for the torch backend)."""

    name: str = Field(min_length=1)
    version: str = Field(min_length=1)
    options: dict = {}
    max_model_len: int | None = Field(default=None, ge=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    mechanisms: dict[str, dict] = {}
    speed_probe: SpeedProbe | None = None
    between_engines: BetweenEngines | None = None


class ModelShape(Described):
    """The sizes the memory formulas read (profiles/memory.py `shape_of`)."""

    layers: Count
    hidden: Positive
    q_width: Positive
    kv_width: Positive
    kv_heads: Positive
    head_dim: Positive
    intermediate: Positive
    vocab: Positive
    tied: bool
    experts: Count = 0
    experts_per_token: Positive = 1


class ModelMemory(Described):
    """The memory one model holds (profiles/memory.py): parameters, weights per format, KV bytes per token."""

    shape: ModelShape | None = None  # the target's (a drafter's where it has layers of its own)
    params: int = Field(ge=0)
    dense_params: int = Field(ge=0)
    linear_params: int = Field(ge=0)
    kv_bytes_per_token: float = Field(ge=0)
    weights_bytes: dict[str, float]
    source: str = Field(min_length=1)

    @field_validator("weights_bytes")
    @classmethod
    def _non_negative(cls, value: dict[str, float]) -> dict[str, float]:
        if "none" not in value or any(v < 0 for v in value.values()):
            raise ValueError('weights_bytes needs a non-negative figure per format, "none" among them')
        return value


class TargetMemory(ModelMemory):
    shape: ModelShape


class ActivationPoint(Record):
    batch: int = Field(ge=1)
    tokens: int = Field(ge=1)
    bytes: float = Field(ge=0)
    source: Source


class DeviceMemory(Described):
    usable_bytes: float = Field(gt=0)
    kv_cache_bytes: float | None = Field(default=None, gt=0)  # a serving engine's own KV pool (vLLM on a CPU)
    source: str = Field(min_length=1)


class MemoryRecord(Described):
    """profile.json's `memory` (profiles/memory.py): what the deployment holds in device memory."""

    dtype: Literal["float32", "bfloat16", "float16"]
    dtype_bytes: int = Field(ge=1)
    target: TargetMemory
    drafters: dict[str, ModelMemory]
    activation: list[ActivationPoint]
    activation_bytes_per_row: float = Field(ge=0)
    device: DeviceMemory


Ms = Annotated[float, Field(ge=0)] | None
Rate = Annotated[float, Field(ge=0, le=1 + 1e-9)]  # a share of whole counts, up to rounding
AtLeastOne = Annotated[float, Field(ge=1 - 1e-9)]  # a ratio of whole counts that is at least 1, up to rounding
Positive = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]


class Timed(Record):
    median_ms: Ms  # None when infeasible (out of memory); the verify curve: the monotone fit's value
    p10_ms: Ms = None
    p90_ms: Ms = None
    repeats: Count = 0
    source: Source
    # 95% interval of the median (order statistics over the repeats); None where not measured (interpolated, projected)
    ci_low_ms: Ms = None
    ci_high_ms: Ms = None


class TimingPoint(Timed):
    """T_verif(B, 1+D, ctx): one target forward over `batch` rows x `tokens` new tokens on a KV cache of `ctx`."""

    batch: Positive
    tokens: Positive  # 1 + D
    ctx: Positive
    raw_median_ms: Ms = None  # the measured median before the monotone fit, drift-corrected (None where not measured)
    uncorrected_median_ms: Ms = None  # the same as timed, before the device's drift was taken out (profiles/drift.py)
    fit_moved: bool = False  # the fit moved this cell by more than its interval: source "fitted", flagged in plans


class DraftPoint(Timed):
    """T_draft(B, D): one propose() call as the mechanism runs it (serial steps, one pass, or lookups)."""

    mechanism: str = Field(min_length=1)
    quant: str = "none"
    batch: Positive
    draft_len: Count
    ctx: Positive


class HostPoint(Record):
    """Per-round loop time outside the drafter and the target forward (bookkeeping, Python)."""

    mechanism: str = Field(min_length=1)
    batch: Positive
    draft_len: Count
    host_ms_per_round: float = Field(ge=0)
    round_ms: float = Field(ge=0)  # whole round: draft + verify + host
    rounds: Count
    source: Source = "measured"


class RoundPoint(Timed):
    """T_round(B, D): one decode round as the serving engine runs it (draft + verify + host in one engine step), timed
    with `batch` requests decoding on prompts of `ctx` tokens. D = 0 (mechanism "none") is plain decoding's step."""

    mechanism: str = Field(min_length=1)
    quant: str = "none"
    batch: Positive
    draft_len: Count
    ctx: Positive
    tokens_per_round: float | None = Field(
        default=None, ge=1
    )  # tokens a row emitted per timed round (the timing prompts' own acceptance)
    # A lookup drafter proposes in some rounds and not in others, and a round costs more the more tokens it verifies:
    # the draft tokens per row of the timed rounds, and the least-squares slope of a step's ms on them, one per (batch,
    # context) over the mechanism's cells (>= 0; 0 where every round drafted alike), so that the cost model can move
    # the time to the workload's own drafting rate
    draft_tokens_per_row: float | None = Field(default=None, ge=0)
    ms_per_draft_token: float | None = Field(default=None, ge=0)
    # the median of the steps as timed, before they were brought to the profile's reference speed (engine.speed_probe)
    raw_median_ms: Ms = None


class ALCheck(Record):
    """Derived tokens per target forward at a smaller D against a direct run at that D."""

    draft_len: Positive
    derived: AtLeastOne
    direct: AtLeastOne
    rel_diff: float
    flagged: bool  # |rel_diff| > 5%


class PromptSums(Record):
    """Per prompt (rows) and D = 0..D_max (columns), the counts the acceptance figures are ratios of
    (`replay.per_prompt_rates`), and each prompt's domain: what a paired bootstrap over prompts resamples."""

    domains: list[str]
    emitted: list[list[int]]
    rounds: list[list[int]]
    accepted: list[list[int]]
    drafts: list[list[int]]

    @model_validator(mode="after")
    def _one_row_per_prompt(self) -> PromptSums:
        tables = (self.emitted, self.rounds, self.accepted, self.drafts)
        if any(len(t) != len(self.domains) for t in tables) or len({len(row) for t in tables for row in t}) > 1:
            raise ValueError("per-prompt sums need one row per prompt and one column per draft length in every table")
        return self


class AcceptanceRecord(Record):
    mechanism: str = Field(min_length=1)
    quant: Literal[WEIGHT_FORMATS] = "none"  # type: ignore[valid-type]  # weights format of the drafter while measured
    quant_source: Source = "measured"  # "emulated" when the format ran as fake-quantized weights
    domain: str = Field(min_length=1)  # a calibration domain, or "all"
    temperature: float = Field(ge=0)
    max_draft_len: Positive
    prompts: Positive
    new_tokens: Positive
    num_drafts: Count
    num_draft_tokens: Count
    num_accepted_tokens: Count
    num_accepted_tokens_per_pos: list[Count]
    num_reached_per_pos: list[Count]
    num_rounds: Count
    rounds: list[list[Count]]  # [L][n]: rounds that proposed L tokens with n accepted
    conditional_acceptance: list[Rate | None]  # a_k; None where position k was never reached
    tokens_per_forward: list[AtLeastOne]  # [D] for D = 0..max_draft_len (index 0 = 1.0)
    mean_al_vllm: list[AtLeastOne]  # [D] vLLM's mean acceptance length (rounds with a draft only)
    checks: list[ALCheck] = []
    # "replay": exact counters at every D from the target's greedy trajectory (profiles/replay.py);
    # "loop": the speculative loop at D_max, smaller D derived from its rounds (modeled)
    method: Literal["loop", "replay"] = "loop"
    # [D] 95% interval over prompts (bootstrap; the prompt is the unit that varies); [] in version-1 profiles
    tokens_per_forward_ci: list[list[float]] = []
    mean_al_vllm_ci: list[list[float]] = []
    per_prompt: PromptSums | None = None  # the "all" record's prompts, for comparisons between draft lengths (paired)

    @model_validator(mode="after")
    def _one_figure_per_draft_length(self) -> AcceptanceRecord:
        D = self.max_draft_len
        cis = tuple(t for t in (self.tokens_per_forward_ci, self.mean_al_vllm_ci) if t)
        per_d = (self.tokens_per_forward, self.mean_al_vllm) + cis
        if any(len(t) != D + 1 for t in per_d) or any(len(pair) != 2 or pair[0] > pair[1] for t in cis for pair in t):
            raise ValueError(f"tokens_per_forward, mean_al_vllm and their intervals need one figure per D = 0..{D}")
        if any(
            len(t) != D
            for t in (self.num_accepted_tokens_per_pos, self.num_reached_per_pos, self.conditional_acceptance)
        ):
            raise ValueError(f"the per-position counts need one figure per position 1..{D}")
        if any(tpf > 1 + d + 1e-9 for d, tpf in enumerate(self.tokens_per_forward)):
            raise ValueError("tokens per forward at D is at most 1 + D")
        if self.per_prompt is not None and len(self.per_prompt.emitted[0] if self.per_prompt.emitted else []) not in (
            0,
            D + 1,
        ):
            raise ValueError(f"per-prompt sums need one column per D = 0..{D}")
        return self


class MicroPoint(Record):
    kind: Literal["attention", "linear"]
    layer: str = ""  # linear: qkv, o, gate_up, down, lm_head
    batch: Positive = 1
    draft_len: Count = 0
    rows_per_kv_head: Count = 0  # attention: G * (1 + D)
    ctx: Count = 0
    m: Count = 0  # linear: GEMM rows = B * (1 + D)
    in_features: Count = 0
    out_features: Count = 0
    median_ms: float = Field(ge=0)
    p10_ms: float = Field(ge=0)
    p90_ms: float = Field(ge=0)
    repeats: Count
    source: Source
    ci_low_ms: Ms = None
    ci_high_ms: Ms = None


class DrafterInfo(Record):
    name: str = Field(min_length=1)
    kind: Literal[
        "model_free", "serial", "parallel"
    ]  # how it costs: lookups, D serial model steps, or one parallel pass
    options: dict
    model: dict | None = None  # ModelRef of a draft model, when it has its own weights
    quant_formats: list[Literal[WEIGHT_FORMATS]] = ["none"]  # type: ignore[valid-type]
    draft_len_multiple: Positive = 1  # D must be a multiple of this (MTP: the checkpoint's layer count)
    max_draft_len: Positive | None = (
        None  # the longest draft it makes (DFlash / DSpark: its block); None = the workload's D_max
    )


class Workload(Record):
    calibration: str
    calibration_fingerprint: str
    split: str
    domains: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    prompts_per_domain: Positive
    new_tokens: Positive
    temperatures: list[Annotated[float, Field(ge=0)]] = Field(min_length=1)
    batch_buckets: list[Positive] = Field(min_length=1)
    ctx_buckets: list[Positive] = Field(min_length=1)
    max_draft_len: Positive
    acceptance_batch: Positive
    prompts_by_domain: dict[str, Count] = {}  # greedy acceptance prompts per domain (grown until the interval is tight)
    second_turns: Count = 0  # of those, MT-Bench second turns after the target's own answer (profiles/second_turns.py)
    acceptance_half_width: float = Field(
        default=0.0, ge=0, lt=1
    )  # target relative half-width of tokens per forward (95%); 0 in version-1 profiles

    @model_validator(mode="after")
    def _increasing_buckets(self) -> Workload:
        for name, values in (("batch_buckets", self.batch_buckets), ("ctx_buckets", self.ctx_buckets)):
            if values != sorted(set(values)):
                raise ValueError(f"{name} {values} must be distinct and increasing")
        return self


class ExpertsPoint(Record):
    batch: int = Field(ge=1)
    tokens: int = Field(ge=1)  # 1 + D per row
    experts_woken: float = Field(ge=0)  # distinct experts per MoE layer, averaged over the layers
    source: str


class ExpertsRecord(Record):
    num_experts: int = Field(ge=1)
    experts_per_token: int = Field(ge=1)
    ctx: int = Field(ge=1)
    moe_layers: int = Field(ge=1)
    points: list[ExpertsPoint]


class Profile(Record):
    schema_version: int
    tool_version: str
    created_at: str  # the one timestamp; everything else is deterministic given the measurements
    fingerprint: str = Field(
        pattern=r"^[0-9a-f]{64}$"
    )  # hash of what makes this profile reusable: device, models, drafters, workload
    backend: Literal[MEASUREMENT_BACKENDS]  # type: ignore[valid-type]  # profiles/backends.py
    device: dict  # DeviceRecord
    target: dict  # ModelRefRecord
    timing_shapes: str  # which model shapes the timings came from
    drafters: list[DrafterInfo]
    workload: Workload
    verify: list[TimingPoint]
    draft: list[DraftPoint]
    host: list[HostPoint]
    acceptance: list[AcceptanceRecord]
    micro: list[MicroPoint]
    notes: list[str] = []
    verify_fit: dict = {}  # how the verify curve was fitted: method, cells moved beyond their interval
    phase_s: dict[str, float] = {}  # wall seconds per profiling phase (a resumed run counts only what it re-ran)
    # the serving engine's whole decode rounds (backend "vllm"); where a mechanism has them, the cost model reads them
    # instead of verify + draft + host
    rounds: list[RoundPoint] = []
    # the measuring engine: name, version, options, and per mechanism whether it ran there and why not
    engine: dict = {}
    memory: dict = {}  # what the deployment holds in device memory (profiles/memory.py); empty in profiles before it
    # a mixture-of-experts target: the distinct experts one verify step wakes per MoE layer, against batch and 1+D
    # (the cause of its verify curve's shape); empty for a dense target
    moe: dict = {}

    @model_validator(mode="after")
    def _whole(self) -> Profile:
        """What every profile holds, whatever its budget skipped: the times its backend measures (verify steps, or the
        engine's rounds), greedy acceptance over all domains, and a memory figure for each drafter it records."""
        if not (self.rounds if self.backend == "vllm" else self.verify):
            raise ValueError(
                f"a {self.backend} profile needs its {'rounds' if self.backend == 'vllm' else 'verify'} times"
            )
        if not any(a.domain == "all" and a.temperature == 0.0 for a in self.acceptance):
            raise ValueError("the profile has no greedy acceptance over all domains")
        missing = [d.name for d in self.drafters if self.memory and d.name not in self.memory.get("drafters", {})]
        if missing:
            raise ValueError(f"the memory record has no figures for drafter {missing[0]!r}")
        return self

    # the free-form parts are checked against their records at load and kept as the JSON objects they are
    @field_validator("moe")
    @classmethod
    def _experts_record(cls, value: dict) -> dict:
        return ExpertsRecord.model_validate(value).model_dump() if value else value

    @field_validator("device")
    @classmethod
    def _device_record(cls, value: dict) -> dict:
        DeviceRecord.model_validate(value)
        return value

    @field_validator("target")
    @classmethod
    def _target_record(cls, value: dict) -> dict:
        ModelRefRecord.model_validate(value)
        return value

    @field_validator("engine")
    @classmethod
    def _engine_record(cls, value: dict) -> dict:
        if value:
            EngineRecord.model_validate(value)
        return value

    @field_validator("memory")
    @classmethod
    def _memory_record(cls, value: dict) -> dict:
        if value:
            MemoryRecord.model_validate(value)
        return value


def load_profile(path: Path) -> Profile:
    """Read and validate a profile; every failure is one line naming the file and the fix."""
    raw = read_json(path, "profile")
    if not isinstance(raw, dict) or "schema_version" not in raw:
        raise SpecdecError(
            f"{path} is not a specdec-tune profile (no schema_version)",
            "pass the profile.json that `specdec-tune profile` wrote",
        )
    if raw["schema_version"] not in READABLE_VERSIONS:
        raise SpecdecError(
            f"{path} has profile schema version {raw['schema_version']}, this tool reads versions "
            f"{list(READABLE_VERSIONS)}",
            "re-run `specdec-tune profile` with this version",
        )
    try:
        return Profile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise SpecdecError(
            f"{path} is not a valid profile: {where}: {err['msg']} ({e.error_count()} problems)",
            "re-run `specdec-tune profile`",
        ) from None


def finished_profile(path: Path, fingerprint: str) -> Profile | None:
    """The profile at `path` where it was measured with this fingerprint (a run with the same settings reuses it)."""
    if not path.exists():
        return None
    try:
        old = load_profile(path)
    except SpecdecError:
        return None
    return old if old.fingerprint == fingerprint else None


def profile_json_schema() -> dict:
    return Profile.model_json_schema()
