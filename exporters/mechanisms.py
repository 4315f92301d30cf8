"""The export side's mechanism registry: one record per mechanism with every engine's spelling and rules.

The engine modules look a mechanism up here and never compare its name; adding a mechanism is one record. Field
names and rules follow the engines' released sources (../shared/reference/engines.md §7 holds the citations):

    vLLM          `speculative_config.method` and the method's own fields (vllm/config/speculative.py)
    TensorRT-LLM  `decoding_type` as llm_args.py's discriminator literal; whether the mode honours
                  `draft_len_schedule` (`support_dynamic_draft_len()` in _torch/speculative/interface.py)
    SGLang        `--speculative-algorithm`; whether `--speculative-adaptive` runs it (EAGLE family, topk 1)
    speculators   whether the drafter is a learned head with a speculators `config.json`
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specdec_tune import SpecdecError


def _no_fields(options: dict) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Vllm:
    method: str
    fields: Callable[[dict], dict] = _no_fields  # the method's own fields, from the drafter's profiled options
    extra: tuple[tuple[str, object], ...] = ()  # fixed fields
    builds_here: bool = False  # SpeculativeConfig builds without a checkpoint or an extra package (the native check)


@dataclasses.dataclass(frozen=True)
class Trtllm:
    decoding_type: str
    fields: Callable[[dict], dict] = _no_fields
    honours_schedule: bool = True  # support_dynamic_draft_len(): else the mode keeps one draft length
    disable_overlap_scheduler: bool = False  # as TensorRT-LLM's own examples of the mode run
    note: str = ""  # a decision the bundle records whenever the mode is exported


@dataclasses.dataclass(frozen=True)
class Sglang:
    algorithm: str
    adaptive: bool = False  # --speculative-adaptive runs it (EAGLE family with topk 1)
    lookup: bool = False  # a model-free lookup: draft tokens and BFS breadth, no steps and no draft model
    gated: bool = False  # needs an SGLang version the tool checks (versions.py)


@dataclasses.dataclass(frozen=True)
class ExportMechanism:
    name: str
    vllm: Vllm
    trtllm: Trtllm
    sglang: Sglang | None  # None: SGLang has no such algorithm
    learned_head: bool = False  # a speculators config.json goes with it
    checkpoint: bool = True  # runs a checkpoint: the engines get its path (vLLM `model`, TensorRT-LLM `speculative_model`)


def _ngram_vllm(o: dict) -> dict:
    return {"prompt_lookup_min": int(o.get("prompt_lookup_min", 5)), "prompt_lookup_max": int(o.get("prompt_lookup_max", 5))}


def _ngram_trtllm(o: dict) -> dict:
    return {"max_matching_ngram_size": int(o.get("prompt_lookup_max", 5)), "is_keep_all": True, "is_use_oldest": True, "is_public_pool": True}


def _suffix_vllm(o: dict) -> dict:
    return {"suffix_decoding_max_tree_depth": int(o.get("max_tree_depth", 24)),
            "suffix_decoding_max_spec_factor": float(o.get("max_spec_factor", 1.0)),
            "suffix_decoding_min_token_prob": float(o.get("min_token_prob", 0.1))}


MECHANISMS: dict[str, ExportMechanism] = {m.name: m for m in (
    ExportMechanism("ngram", Vllm("ngram", _ngram_vllm, builds_here=True),
                    Trtllm("NGram", _ngram_trtllm, disable_overlap_scheduler=True), Sglang("NGRAM", lookup=True), checkpoint=False),
    ExportMechanism("suffix", Vllm("suffix", _suffix_vllm),
                    Trtllm("SA", lambda o: {"max_matching_ngram_size": -1},
                           note="suffix decoding maps to SA (TensorRT-LLM's suffix-automaton drafter): same idea, its acceptance was not profiled"),
                    None, checkpoint=False),
    ExportMechanism("draft_model", Vllm("draft_model", extra=(("draft_tensor_parallel_size", 1),)),
                    Trtllm("Draft_Target", disable_overlap_scheduler=True), Sglang("STANDALONE")),
    ExportMechanism("eagle3", Vllm("eagle3"), Trtllm("Eagle3"), Sglang("EAGLE3", adaptive=True), learned_head=True),
    ExportMechanism("mtp", Vllm("mtp"), Trtllm("MTP"), Sglang("NEXTN", adaptive=True), learned_head=True),
    ExportMechanism("dflash", Vllm("dflash"), Trtllm("DFlash"), Sglang("DFLASH", gated=True), learned_head=True),
    ExportMechanism("dspark", Vllm("dspark"), Trtllm("DSpark", honours_schedule=False), Sglang("DSPARK", gated=True), learned_head=True),
)}


def by_vllm_method(method: str) -> ExportMechanism | None:
    return next((m for m in MECHANISMS.values() if m.vllm.method == method), None)


def mechanism(name: str) -> ExportMechanism:
    if name not in MECHANISMS:
        raise SpecdecError(f"no engine spelling is known for mechanism {name!r}", f"export one of {', '.join(MECHANISMS)}")
    return MECHANISMS[name]
