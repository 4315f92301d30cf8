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
    every engine  where none loads a separately trained head of the kind (MTP), one sentence all of them record
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specdec_tune import SpecdecError
from specdec_tune.exporters.sglang_heads import DFLASH_LAYOUT, DSPARK_LAYOUT, EAGLE3_LAYOUT, SglangHeadLayout
from specdec_tune.vllm_spelling import VLLM, Vllm, number_option


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
    unverified: tuple[tuple[str, str], ...] = ()  # (release line, what the bundle could not confirm in its code)
    # a learned head's tensor name in TensorRT-LLM's folder, from SGLang's layout (exporters/head_folders.py)
    head_weight_name: Callable[[str], str] = lambda name: name

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
    # the learned head's folder as SGLang's draft class reads it (sglang_heads.py); None: no separately trained head
    head_layout: SglangHeadLayout | None = None


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
    # (head config field, value, whose default it is): written where a head's config leaves the field out, so that
    # every engine reads what the profile ran, not its own default
    head_defaults: tuple[tuple[str, object, str], ...] = ()
    # (the engine's reader, the transformer_layer_config model types it builds a layer for): a head of another
    # layer type is refused at export
    layer_types: tuple[tuple[str, tuple[str, ...]], ...] = ()
    block_drafts: Callable[[dict], int] | None = None  # drafts one pass of the head's block yields (its config fields)
    # where no engine loads a separately trained head of this kind: why, in the words every engine's config records
    no_separate_head: str = ""
    # (engine, head config fields -> why that engine cannot load this head, or None): it serves without the head
    engine_refusals: tuple[tuple[str, Callable[[dict], str | None]], ...] = ()

    def drafts_per_block(self, head: dict) -> int:
        """The draft length a fixed-block engine runs for this head (its config's block_size and anchor)."""
        assert self.block_drafts is not None, f"{self.name} drafts no fixed block: only fixed-block modes ask"
        return self.block_drafts(head)


def _ngram_trtllm(o: dict) -> dict:
    return {
        "max_matching_ngram_size": number_option(o, "prompt_lookup_max", 5),
        "is_keep_all": True,
        "is_use_oldest": True,
        "is_public_pool": True,
    }


def trtllm_layer_ids(aux_ids: list[int], field: str) -> list[int]:
    """TensorRT-LLM's capture ids for a speculators head's aux layer ids. speculators (and vLLM's reader) count the
    state entering layer i as i, 0 being the embeddings; TensorRT-LLM captures layer i's output as i
    (`maybe_capture_hidden_states` at the end of each decoder layer): the same states are the ids less one. TensorRT-LLM
    cannot capture the embeddings and checks no range (an id past the last layer is left unset)."""
    if min(aux_ids) < 1:
        raise SpecdecError(
            f"the head's {field} {list(aux_ids)} reads the embeddings (id 0), which TensorRT-LLM cannot capture",
            "use a head whose aux layer ids are decoder layers (1 and up)",
        )
    return [int(i) - 1 for i in aux_ids]


def _eagle3_trtllm(o: dict) -> dict:
    ids = o.get("eagle_aux_hidden_state_layer_ids")
    return {"eagle3_layers_to_capture": trtllm_layer_ids(ids, "eagle_aux_hidden_state_layer_ids")} if ids else {}


def _dflash_trtllm(o: dict) -> dict:
    return {
        "mask_token_id": o["mask_token_id"],
        "target_layer_ids": trtllm_layer_ids(o["aux_hidden_state_layer_ids"], "aux_hidden_state_layer_ids"),
    }


def _dspark_trtllm(o: dict) -> dict:
    return {
        "mask_token_id": o["mask_token_id"],
        "target_layer_ids": trtllm_layer_ids(o["aux_hidden_state_layer_ids"], "aux_hidden_state_layer_ids"),
        "block_size": o["block_size"],
        **{k: o[k] for k in ("markov_rank", "markov_head_type") if o.get(k) is not None},
    }


def _vllm_markov_head(head: dict) -> str | None:
    """vLLM 0.32's DSpark builds the vanilla Markov head only (models/qwen3_dspark.py: markov_w1, markov_w2; its
    reader copies markov_head_type and nothing reads it)."""
    kind = head.get("markov_head_type") or "vanilla"
    return None if kind == "vanilla" else f"its DSpark builds the vanilla Markov head only, not markov_head_type {kind}"


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
                unverified=(
                    (
                        "1.3rc",
                        "unverified: draft_len_schedule keys are written as upper bounds, the lookup of the "
                        "one-model Draft_Target (its default in 1.3 release candidates, PR #10860); the two-model "
                        "drafter (Drafter.get_draft_len_for_batch_size) still looks keys up as lower bounds, and which "
                        "path the targeted release candidate runs was not confirmed in its code",
                    ),
                ),
            ),
            Sglang("STANDALONE"),
        ),
        ExportMechanism(
            "eagle3",
            VLLM["eagle3"],
            Trtllm(
                "Eagle3",
                _eagle3_trtllm,
                legacy=("Eagle", (("eagle3_one_model", True),)),
                # its loader prefixes `model.` itself and names the decoder layer `midlayer.`
                head_weight_name=lambda name: name.removeprefix("model.").replace("layers.0.", "midlayer.", 1),
            ),
            Sglang("EAGLE3", adaptive=True, head_layout=EAGLE3_LAYOUT),
            learned_head=True,
            needs=_LAYER,
            head_defaults=(
                (
                    "norm_before_residual",
                    False,
                    "speculators 0.9.0's Eagle3SpeculatorConfig, as this tool's loop reads the head; vLLM 0.32's "
                    "reader takes a missing field as true",
                ),
            ),
            layer_types=(("vLLM 0.32 (its speculators reader's eagle3 architectures)", ("llama", "qwen3")),),
        ),
        ExportMechanism(
            "mtp",
            VLLM["mtp"],
            Trtllm("MTP", legacy=("MTP", ()), legacy_draft_len_field="num_nextn_predict_layers"),
            Sglang("NEXTN", adaptive=True),
            learned_head=True,
            needs=_LAYER,
            no_separate_head=(
                "MTP runs the MTP layers inside the target checkpoint: vLLM 0.32 (its speculators reader has no mtp "
                "type), SGLang 0.5.23 (NEXTN reuses the target's layers) and TensorRT-LLM 1.2 (MTPForCausalLM builds "
                "them from the target) load no separately trained MTP head, and TensorRT-LLM's replacement MTP heads "
                "(PR #17378, 1.3 release candidates) are unverified at the targeted release: plain serving"
            ),
        ),
        ExportMechanism(
            "dflash",
            VLLM["dflash"],
            Trtllm("DFlash", _dflash_trtllm),
            Sglang("DFLASH", gated=True, fixed_block=True, head_layout=DFLASH_LAYOUT),
            learned_head=True,
            needs=_BLOCK + (("block_size", "SGLang (DFLASH drafts the whole block)"),),
            block_drafts=lambda head: int(head["block_size"]) - 1,
        ),  # slot 0 is the anchor (vLLM 0.32 refuses sample_from_anchor for DFlash)
        ExportMechanism(
            "dspark",
            VLLM["dspark"],
            Trtllm("DSpark", _dspark_trtllm, honours_schedule=(), fixed_block=True),
            Sglang("DSPARK", gated=True, fixed_block=True, head_layout=DSPARK_LAYOUT),
            learned_head=True,
            needs=_BLOCK + (("block_size", "TensorRT-LLM (max_draft_len = block_size)"),),
            head_defaults=(
                (
                    "sample_from_anchor",
                    True,
                    "speculators 0.9.0's DSparkConfig, as this tool's loop reads the head; vLLM 0.32's reader "
                    "takes a missing field as false",
                ),
            ),
            # anchor sampling: every slot of the block drafts; without it slot 0 is the anchor
            block_drafts=lambda head: int(head["block_size"]) - (0 if head["sample_from_anchor"] else 1),
            engine_refusals=(("vllm", _vllm_markov_head),),
        ),
    )
}


def mechanism(name: str) -> ExportMechanism:
    if name not in MECHANISMS:
        raise SpecdecError(
            f"no engine spelling is known for mechanism {name!r}", f"export one of {', '.join(MECHANISMS)}"
        )
    return MECHANISMS[name]
