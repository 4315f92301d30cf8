"""The engine registry: each engine module renders the plan into that engine's files and names its schema.

An engine writes text files relative to its folder in the bundle, the config document that its JSON
Schema checks, and a list of decisions (what it emitted, what it could not express and why).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Callable

from specdec_tune.exporters.mechanisms import ExportMechanism, mechanism

SCHEMA_DIR = Path(__file__).parent / "schemas"

# The Hugging Face ids of the embedded demo models, for engines that load by id.
ENGINE_MODEL_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


@dataclasses.dataclass(frozen=True)
class ExportContext:
    plan: dict
    mechanism: str
    quant: str
    schedule: list[tuple[int, int]]  # (batch bucket, D)
    max_batch: int
    drafter: dict  # the profile's DrafterInfo for the mechanism
    target_model: str  # the target as the engines load it (a path or a hub id)
    drafter_model: str | None  # the drafter checkpoint as the engines load it, where it has one
    versions: dict[str, str]

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


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str
    folder: str
    document: str  # the file in its folder that holds the checked config
    schema: str  # file name under schemas/
    render: Callable[[ExportContext], EngineFiles]
    rules: Callable[[dict], list[str]]  # the engine's cross-field rules a schema cannot state; returns violations
    native_check: Callable[[dict], str] | None = None  # the engine's own config classes, where importable


ENGINES: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    ENGINES[engine.name] = engine
    return engine


def load_engines() -> dict[str, Engine]:
    for module in ("vllm_config", "trtllm_config", "sglang_config", "speculators_config"):
        importlib.import_module(f"specdec_tune.exporters.{module}")
    return ENGINES


def load_schema_file(name: str) -> dict:
    return json.loads((SCHEMA_DIR / name).read_text())


def load_schema(engine: Engine) -> dict:
    return load_schema_file(engine.schema)
