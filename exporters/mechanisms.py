"""The export side's mechanism registry: one record per mechanism with every engine's spelling and rules.

The engine modules look a mechanism up here and never compare its name; adding a mechanism is one record. Field
names and rules follow the engines' released sources (exporters/versions.py holds the citations):

    vLLM          `speculative_config.method` and the method's own fields: the table in vllm_spelling.py, which the
                  vllm measurement backend runs too
    TensorRT-LLM  `decoding_type` per release line (versions.py): 1.3rc's discriminator literal, 1.2's class string
                  (EAGLE-3 is Eagle with eagle3_one_model; no SA, DFlash, DSpark); whether the mode honours
                  `draft_len_schedule` in each line (1.2: modes with a drafter object, NGram and two-model
                  Draft_Target; 1.3rc: `support_dynamic_draft_len()`, not NGram nor DSpark); DSpark's
                  `max_draft_len` must equal the checkpoint's block_size
    SGLang        `--speculative-algorithm`; whether `--speculative-adaptive` runs it (EAGLE / EAGLE3 with topk 1,
                  speculative/adaptive_spec_params.py); DFLASH and DSPARK draft the checkpoint's whole block in one
                  step (arg_groups/speculative_hook.py at 0.5.23: both force steps and topk to 1; DFLASH's draft tokens
                  are the block, DSPARK's must be block + 1)
    speculators   whether the drafter is a learned head with a speculators `config.json`, and the head config
                  fields each engine reads (vLLM's speculators reader indexes DFlash/DSpark's layer ids and mask token)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specdec_tune import SpecdecError
from specdec_tune.vllm_spelling import VLLM, Vllm


def _no_fields(options: dict) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Trtllm:
    decoding_type: str  # the 1.3rc line's literal
    fields: Callable[[dict], dict] = _no_fields
    honours_schedule: tuple[str, ...] = (
        "1.3rc",
    )  # the release lines (versions.py) where the mode follows draft_len_schedule
    legacy: tuple[str, tuple[tuple[str, object], ...]] | None = (
        None  # the 1.2 line's decoding_type and fixed fields; None: absent
    )
    legacy_draft_len_field: str = (
        "max_draft_len"  # 1.2's MTP takes K as num_nextn_predict_layers (its __init__ overwrites max_draft_len)
    )
    fixed_block: bool = False  # max_draft_len must equal the checkpoint's block_size (DSpark)
    disable_overlap_scheduler: bool = False  # as TensorRT-LLM's own examples of the mode run
    note: str = ""  # a decision the bundle records whenever the mode is exported

    def spelling(self, line: str) -> tuple[str, dict, str] | None:
        """(decoding_type, fixed fields, the field that takes K) in a release line, None where the line has no such
        mode."""
        if line == "1.2":
            return (self.legacy[0], dict(self.legacy[1]), self.legacy_draft_len_field) if self.legacy else None
        return self.decoding_type, {}, "max_draft_len"


@dataclasses.dataclass(frozen=True)
class Sglang:
    algorithm: str
    adaptive: bool = False  # --speculative-adaptive runs it (EAGLE family with topk 1)
    lookup: bool = False  # a model-free lookup: draft tokens and BFS breadth, no steps and no draft model
    gated: bool = False  # needs an SGLang version the tool checks (versions.py)
    fixed_block: bool = False  # drafts the checkpoint's whole block in one step: a band runs the block's D or none, and
    #                            takes only --speculative-num-draft-tokens (DFLASH and DSPARK force steps and topk to 1)


@dataclasses.dataclass(frozen=True)
class ExportMechanism:
    name: str
    vllm: Vllm
    trtllm: Trtllm
    sglang: Sglang | None  # None: SGLang has no such algorithm
    learned_head: bool = False  # a speculators config.json goes with it
    checkpoint: bool = (
        True  # runs a checkpoint: the engines get its path (vLLM `model`, TensorRT-LLM `speculative_model`)
    )
    needs: tuple[tuple[str, str], ...] = ()  # (head config field, the engine that refuses the head without it)
    block_drafts: Callable[[int], int] | None = None  # drafts one pass of a block of block_size tokens yields

    def drafts_per_block(self, head: dict) -> int:
        """The draft length a fixed-block engine runs for this head (its config's block_size)."""
        assert self.block_drafts is not None, f"{self.name} drafts no fixed block: only fixed-block modes ask"
        return self.block_drafts(int(head["block_size"]))


def _ngram_trtllm(o: dict) -> dict:
    return {
        "max_matching_ngram_size": int(o.get("prompt_lookup_max", 5)),
        "is_keep_all": True,
        "is_use_oldest": True,
        "is_public_pool": True,
    }


def _dflash_trtllm(o: dict) -> dict:
    return {"mask_token_id": o["mask_token_id"], "target_layer_ids": list(o["aux_hidden_state_layer_ids"])}


def _dspark_trtllm(o: dict) -> dict:
    return {
        "mask_token_id": o["mask_token_id"],
        "target_layer_ids": list(o["aux_hidden_state_layer_ids"]),
        "block_size": o["block_size"],
        **{k: o[k] for k in ("markov_rank", "markov_head_type") if o.get(k) is not None},
    }


# the head config fields an engine cannot load a head without
_LAYER = (("transformer_layer_config", "speculators (an empty one loads as a default Qwen layer)"),)
_BLOCK = _LAYER + (
    ("aux_hidden_state_layer_ids", "vLLM (its speculators reader)"),
    ("mask_token_id", "vLLM (its speculators reader)"),
)

MECHANISMS: dict[str, ExportMechanism] = {
    m.name: m
    for m in (
        ExportMechanism(
            "ngram",
            VLLM["ngram"],
            Trtllm(
                "NGram", _ngram_trtllm, honours_schedule=("1.2",), legacy=("NGram", ()), disable_overlap_scheduler=True
            ),
            Sglang("NGRAM", lookup=True),
            checkpoint=False,
        ),
        ExportMechanism(
            "suffix",
            VLLM["suffix"],
            Trtllm(
                "SA",
                lambda o: {"max_matching_ngram_size": -1},
                note=(
                    "suffix decoding maps to SA (TensorRT-LLM's suffix-automaton drafter): same idea, its acceptance "
                    "was not profiled"
                ),
            ),
            None,
            checkpoint=False,
        ),
        ExportMechanism(
            "draft_model",
            VLLM["draft_model"],
            Trtllm(
                "Draft_Target",
                honours_schedule=("1.2", "1.3rc"),
                legacy=("Draft_Target", ()),
                disable_overlap_scheduler=True,
            ),
            Sglang("STANDALONE"),
        ),
        ExportMechanism(
            "eagle3",
            VLLM["eagle3"],
            Trtllm("Eagle3", legacy=("Eagle", (("eagle3_one_model", True),))),
            Sglang("EAGLE3", adaptive=True),
            learned_head=True,
            needs=_LAYER,
        ),
        ExportMechanism(
            "mtp",
            VLLM["mtp"],
            Trtllm("MTP", legacy=("MTP", ()), legacy_draft_len_field="num_nextn_predict_layers"),
            Sglang("NEXTN", adaptive=True),
            learned_head=True,
            needs=_LAYER,
        ),
        ExportMechanism(
            "dflash",
            VLLM["dflash"],
            Trtllm("DFlash", _dflash_trtllm),
            Sglang("DFLASH", gated=True, fixed_block=True),
            learned_head=True,
            needs=_BLOCK + (("block_size", "SGLang (DFLASH drafts the whole block)"),),
            block_drafts=lambda block: block - 1,
        ),  # slot 0 is the anchor
        ExportMechanism(
            "dspark",
            VLLM["dspark"],
            Trtllm("DSpark", _dspark_trtllm, honours_schedule=(), fixed_block=True),
            Sglang("DSPARK", gated=True, fixed_block=True),
            learned_head=True,
            needs=_BLOCK + (("block_size", "TensorRT-LLM (max_draft_len = block_size)"),),
            block_drafts=lambda block: block,
        ),  # sample_from_anchor: every slot drafts
    )
}


def mechanism(name: str) -> ExportMechanism:
    if name not in MECHANISMS:
        raise SpecdecError(
            f"no engine spelling is known for mechanism {name!r}", f"export one of {', '.join(MECHANISMS)}"
        )
    return MECHANISMS[name]
