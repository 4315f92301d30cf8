"""The engine registry: each engine module renders the plan into that engine's files and names its schema.

An engine writes text files relative to its folder in the bundle, the config document that its JSON
Schema checks, and a list of decisions (what it emitted, what it could not express and why).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from pathlib import Path

from specdec_tune.exporters.mechanisms import ExportMechanism, mechanism
from specdec_tune.exporters.native_checks import Facts

SCHEMA_DIR = Path(__file__).parent / "schemas"

# how each engine is named in the bundle's sentences
ENGINE_NAMES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "sglang": "SGLang", "speculators": "speculators"}
# The Hugging Face ids of the embedded demo models, for engines that load by id.
ENGINE_MODEL_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


@dataclasses.dataclass(frozen=True)
class ExportContext:
    """What every engine renders from (exporters/bundle.py `export_context` builds it from a plan)."""

    mechanism: str
    quant: str
    schedule: list[tuple[int, int]]  # (batch bucket, D)
    max_batch: int
    drafter: dict  # the profile's DrafterInfo for the mechanism
    target_model: str  # the target as the engines load it (a path or a hub id)
    drafter_model: str | None  # the drafter checkpoint as the engines load it, where it has one
    versions: dict[str, str]
    single_draft_len: int = 0  # the plan's best single D (for an engine without a per-batch table)
    memory: dict | None = None  # the plan's memory budget as each engine spells it (memory_limits.engine_memory)
    head: dict = dataclasses.field(
        default_factory=dict
    )  # a learned head's own config fields (speculators_layout.head_fields)
    target_architectures: tuple[str, ...] = ()  # the target's config.json `architectures`
    target_config: dict = dataclasses.field(default_factory=dict)  # the target's config.json
    target_folder: Path | None = None  # the target as a Hugging Face folder on this machine
    predict: Callable[[int, int], dict] | None = (
        None  # tokens/s at (batch, D) under the plan's cost model, as plan.json holds a figure
    )
    # the plan's per-batch table as vLLM runs it (autotune/engine_pricing.py), with `buckets`: batch -> engine_costs
    schedule_pricing: dict | None = None
    data_parallel: int = 1  # the engines' data-parallel size
    profile_engine: str | None = None  # the serving engine the profile measured in; None: this tool's own loop
    head_folders: dict[str, str] = dataclasses.field(default_factory=dict)  # engine -> its head folder in the bundle
    head_refused: dict[str, str] = dataclasses.field(default_factory=dict)  # engine -> why it cannot load the head

    def checkpoint_for(self, engine: str) -> str | None:
        """The drafter checkpoint `engine` loads: its own layout of the head where the bundle ships one."""
        return self.head_folders.get(engine, self.drafter_model)

    @property
    def max_draft_len(self) -> int:
        return max(d for _, d in self.schedule)

    @property
    def speculates(self) -> bool:
        return self.max_draft_len > 0

    @property
    def spelling(self) -> ExportMechanism:
        """How every engine spells this mechanism (exporters/mechanisms.py)."""
        return mechanism(self.mechanism)


@dataclasses.dataclass
class EngineFiles:
    files: dict[str, str]  # path relative to the engine's folder -> text
    document: dict | None  # the config the schema (and the engine's own classes) check
    decisions: list[str]
    gates: list[dict]
    deviation: dict | None = None  # where the engine cannot run the plan's schedule: what it runs instead (`deviation`)


def deviation(ctx: ExportContext, runs: list[tuple[int, int]], why: str) -> dict:
    """What an engine runs where it cannot follow the plan's schedule, bucket by bucket beside the plan, with the
    predicted tokens/s under each (the plan's cost model: same sources and intervals as plan.json's figures)."""
    rows = []
    for (batch, planned), (_, ran) in zip(ctx.schedule, runs):
        row: dict = {"batch": batch, "plan_draft_len": planned, "draft_len": ran}
        if ctx.predict is not None:
            mine, plan = ctx.predict(batch, ran), ctx.predict(batch, planned)
            row |= {
                "tokens_per_s": mine,
                "plan_tokens_per_s": plan,
                "change_pct": round(100 * (mine["value"] / plan["value"] - 1), 1),
            }
        rows.append(row)
    return {"why": why, "schedule": [[b, d] for b, d in runs], "buckets": rows}


def without_head(ctx: ExportContext, engine: str) -> dict | None:
    """Plain serving, recorded as a deviation, where `engine` cannot load the plan's learned head: no engine loads a
    separately trained head of the kind (MTP: the words every engine uses), or this head's conversion was refused
    (exporters/head_folders.py); None where it loads it."""
    if not ctx.speculates:
        return None
    if ctx.spelling.no_separate_head:
        why = ctx.spelling.no_separate_head
    elif engine in ctx.head_refused:
        why = f"{ENGINE_NAMES[engine]} cannot load this head ({ctx.head_refused[engine]}): plain serving"
    else:
        return None
    return deviation(ctx, [(b, 0) for b, _ in ctx.schedule], why)


def deviation_text(record: dict) -> str:
    """One line: the schedule an engine runs instead of the plan's, and the predicted change where the plan's
    differs."""
    changed = [r for r in record["buckets"] if r["draft_len"] != r["plan_draft_len"]]
    parts = [
        f"B≤{r['batch']}: D={r['draft_len']} (plan {r['plan_draft_len']}"
        + (
            f", predicted {r['change_pct']:+.1f}% tokens/s, {r['tokens_per_s']['source']})"
            if "change_pct" in r
            else ")"
        )
        for r in changed
    ]
    return f"{record['why']}: " + ("; ".join(parts) if parts else "the plan's draft lengths at every bucket")


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str
    folder: str
    document: str  # the file in its folder that holds the checked config
    schema: str  # file name under schemas/
    render: Callable[[ExportContext], EngineFiles]
    rules: Callable[
        [dict, str], list[str]
    ]  # (config, engine version) -> the cross-field rules a schema cannot state it breaks
    native_check: Callable[[dict, Path, Facts], dict] | None = (
        None  # the engine's own code on the written files (native_checks.py)
    )


SERVING_ENGINES: dict[str, Engine] = {}  # name -> engine, filled by each engine module as it is imported


def register(engine: Engine) -> Engine:
    SERVING_ENGINES[engine.name] = engine
    return engine


ENGINE_MODULES = {
    "vllm": "vllm_config",
    "trtllm": "trtllm_config",
    "sglang": "sglang_config",
    "speculators": "speculators_config",
}


def serving_engines() -> dict[str, Engine]:
    """Every engine a bundle carries files for, in the bundle's order (whichever module was imported first)."""
    for module in ENGINE_MODULES.values():
        importlib.import_module(f"specdec_tune.exporters.{module}")
    return {name: SERVING_ENGINES[name] for name in ENGINE_MODULES}


def load_schema_file(name: str) -> dict:
    return json.loads((SCHEMA_DIR / name).read_text())


def load_schema(engine: Engine) -> dict:
    return load_schema_file(engine.schema)
