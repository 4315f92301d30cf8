"""A learned head in the speculators layout, rewritten as the folder SGLang 0.5.23 loads as
`--speculative-draft-model-path`.

SGLang has no speculators reader: it reads the draft's config.json with transformers' AutoConfig (so it needs a
`model_type`), picks the model class by `architectures`, and hands the safetensors tensors to that class's
`load_weights`, which drops a name it does not know without a word (a parameter then stays at its initial values).
So every field is written flat where the class reads it, and every tensor is renamed to a parameter the class has; a
tensor this module cannot place stops the conversion. Citations are files of SGLang 0.5.23's `sglang/srt/`.

  layer ids   speculators (and vLLM) id i is the residual stream entering target layer i (hidden_states[i]); SGLang
              captures before layer `id + 1` for an explicit id (models/llama.py:929-953, models/qwen3.py:778-805),
              so SGLang's id is i - 1. DFlash / DSpark ids must lie in [0, N) (speculative/dflash_utils.py:579-584).
  EAGLE-3     `LlamaForCausalLMEagle3` (models/llama_eagle3.py:272), model_type llama; `draft_vocab_size`,
              `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids` (llama_eagle3.py:151-161, 306;
              model_runner_components/spec_aux_hidden_state.py:185-194); weights under `model.` but `lm_head`, `d2t`
              as offsets, `t2d` skipped (llama_eagle3.py:325-378); the embedding is the target's
              (speculative/eagle_worker_v2.py:361-363). Layer 0's residual is the raw hidden state
              (llama_eagle3.py:97-102): norm_before_residual false.
  DFlash      `DFlashDraftModel` (models/dflash.py:671), model_type qwen3 (q/k norms always built, dflash.py:247-250);
              `block_size`, `num_target_layers`, `dflash_config` {`target_layer_ids`, `mask_token_id`}
              (dflash_utils.py:588-702); weights by their own names (dflash.py:886-985); no LM head of its own: the
              target's (speculative/dflash_worker_v2.py:136-138), so the full vocabulary only.
  DSpark      `DSparkDraftModel` (models/dspark.py:967; configs/model_config.py:255) on the DFlash backbone, plus
              top-level `markov_rank`, `markov_head_type` (dspark.py:385-405), `sample_from_anchor` (default true,
              speculative/dspark_components/dspark_config.py:29-31), `enable_confidence_head`,
              `confidence_head_with_markov` (dspark.py:487-507); block_size is gamma, the drafts per round
              (dspark_config.py:295-297; dspark_worker_v2.py:266-269); `markov_head.*`, `confidence_head.*`, `lm_head.*`
              skipped (dspark.py:510, 627-665).
  MTP         not a separate draft in SGLang: NEXTN runs the target checkpoint's own MTP layers, remapped by
              architecture (configs/model_config.py:1010-1215); nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_tune import SpecdecError

if TYPE_CHECKING:
    import torch

SGLANG_VERSION = "0.5.23"

# speculators weight names -> SGLang's, per kind (a name no rule matches stops the conversion)
_EAGLE3_NAMES = (
    (r"fc\.weight|norm\.weight|embed_tokens\.weight", "model.{}"),
    (r"layers\.0\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|input_layernorm|post_attention_layernorm|hidden_norm)"
     r"\.weight", "model.{}"),
    (r"lm_head\.weight|d2t", "{}"),
)  # fmt: skip
_BLOCK_NAMES = (
    (r"fc\.weight|hidden_norm\.weight|norm\.weight", "{}"),
    (r"layers\.\d+\.(self_attn\.[qkvo]_proj\.(weight|bias)|self_attn\.[qk]_norm\.weight|mlp\.(gate|up|down)_proj\.weight"
     r"|input_layernorm\.weight|post_attention_layernorm\.weight)", "{}"),
)  # fmt: skip
_DSPARK_NAMES = (
    *_BLOCK_NAMES,
    (r"markov_head\.(markov_w1\.weight|markov_w2\.weight|gate_proj\.(weight|bias)|joint_proj\.(weight|bias))", "{}"),
    (r"confidence_head\.proj\.(weight|bias)", "{}"),
)


@dataclasses.dataclass(frozen=True)
class SglangHeadLayout:
    """One learned head kind as SGLang's draft class reads its folder (the module docstring cites each)."""

    speculators_model_type: str  # the head folder's own speculators_model_type this layout converts
    architecture: str  # `architectures[0]`: the draft class SGLang's registry picks
    model_type: str  # the transformers config type SGLang's AutoConfig load builds
    weight_names: tuple[tuple[str, str], ...]  # (speculators name pattern, SGLang's name format); none matching: stop
    # the kind's own config fields: (layout, head config, its transformer_layer_config, the target's text config,
    # the head's tensors (a tensor SGLang skips is popped), decisions (appended to)) -> fields; it refuses a head
    # SGLang's class cannot run
    fields: Callable[[SglangHeadLayout, dict, dict, dict, dict, list[str]], dict]
    target_embedding: bool = False  # SGLang gives the draft the target's embedding where their widths match


@dataclasses.dataclass(frozen=True)
class SGLangHead:
    """What `write_sglang_head` did: the folder written and its decisions, or no folder and the reason."""

    folder: Path | None
    decisions: tuple[str, ...]
    reason: str | None = None  # set where SGLang cannot run the head as a separate draft (then folder is None)


def write_sglang_head(
    layout: SglangHeadLayout | None, head_folder: Path | str, target_config: dict, out_folder: Path | str
) -> SGLangHead:
    """Rewrite the speculators head in `head_folder` (as `save_head` writes it) for a target with `target_config`
    (its config.json) into `out_folder`: config.json and model.safetensors. `layout` is the head kind's (the
    registry's `Sglang.head_layout`); None: SGLang runs no separately trained head of the kind (MTP), nothing is
    written and the answer says why."""
    if layout is None:
        return SGLangHead(
            None,
            (),
            f"SGLang {SGLANG_VERSION} has no draft class for a separately trained MTP head: its NEXTN runs the "
            "target checkpoint's own MTP layers (configs/model_config.py:1010-1215)",
        )
    from safetensors.torch import load_file, save_file

    head_folder, out_folder = Path(head_folder), Path(out_folder)
    config = json.loads((head_folder / "config.json").read_text())
    kind = config.get("speculators_model_type")
    if kind != layout.speculators_model_type:
        raise SpecdecError(
            f"{head_folder}/config.json is not a speculators {layout.speculators_model_type} head "
            f"(speculators_model_type {kind!r})",
            "give a head folder written by train-drafter or speculators",
        )
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(head_folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    target = target_config.get("text_config") or target_config
    layer = config.get("transformer_layer_config") or {}
    decisions: list[str] = []
    fields = {
        "architectures": [layout.architecture],
        "model_type": layout.model_type,
        **_layer_fields(layer, layout),
        **layout.fields(layout, config, layer, target, state, decisions),
    }
    weights = _renamed(state, layout, head_folder)

    tmp = out_folder.with_name(out_folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    if out_folder.exists():
        shutil.rmtree(out_folder)
    tmp.rename(out_folder)
    return SGLangHead(out_folder, tuple(decisions))


def _layer_fields(layer: dict, layout: SglangHeadLayout) -> dict:
    """The decoder layers' settings, flat, as transformers' Llama / Qwen3 configs name them."""
    try:
        heads = int(layer["num_attention_heads"])
        out = {
            "vocab_size": int(layer["vocab_size"]),
            "hidden_size": int(layer["hidden_size"]),
            "intermediate_size": int(layer["intermediate_size"]),
            "num_hidden_layers": int(layer.get("num_hidden_layers", 1)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(layer.get("num_key_value_heads", heads)),
            "head_dim": int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise SpecdecError(
            f"the head's transformer_layer_config lacks a usable {e}", "re-create the head folder with train-drafter"
        ) from None
    theta = float(layer.get("rope_theta", 10000.0))
    if layer.get("hidden_act", "silu") != "silu":
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION}'s {layout.architecture} runs silu layers: transformer_layer_config.hidden_act is "
            f"{layer.get('hidden_act')!r}",
            "use a head with silu MLPs",
        )
    return {
        **out,
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(layer.get("max_position_embeddings", 2048)),
        "hidden_act": "silu",
        "attention_bias": bool(layer.get("attention_bias", False)),
        "tie_word_embeddings": False,
    }


def _sglang_layer_ids(ids: list[int], target: dict, kind: str, field: str, allow_embedding: bool) -> list[int]:
    """speculators ids (the stream entering layer i) -> SGLang's (the output of layer i - 1)."""
    n = int(target["num_hidden_layers"])
    low = 0 if allow_embedding else 1
    bad = [i for i in ids if not low <= int(i) <= n - 1]
    if bad:
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION} cannot feed the {kind} head target layer ids {bad} ({field}): it captures the "
            f"stream entering layers 1..{n - 1} of this {n}-layer target"
            + (" or the embedding" if allow_embedding else ""),
            f"train the head on layer ids in {low}..{n - 1}",
        )
    if any(int(a) >= int(b) for a, b in zip(ids, ids[1:])):
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION} captures each target layer once, in layer order (models/llama.py:486-493): the "
            f"{kind} head's {field} {list(ids)} repeat or go down",
            "train the head on increasing, distinct layer ids",
        )
    return [int(i) - 1 for i in ids]


def _eagle3_fields(
    layout: SglangHeadLayout, config: dict, layer: dict, target: dict, state: dict, decisions: list[str]
) -> dict:
    if config.get("norm_before_residual", False):
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION}'s LlamaForCausalLMEagle3 keeps the raw hidden state as layer 0's residual: "
            "norm_before_residual true is not built (models/llama_eagle3.py:97-102)",
            "train the EAGLE-3 head with norm_before_residual false",
        )
    if layer.get("attention_bias", False) or int(layer.get("num_hidden_layers", 1)) != 1:
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION}'s LlamaForCausalLMEagle3 builds one bias-free layer over [embedding; hidden]: "
            "transformer_layer_config.attention_bias / num_hidden_layers differ",
            "use a one-layer EAGLE-3 head without attention biases",
        )
    hidden = int(layer["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)
    if "embed_tokens.weight" in state and target_hidden == hidden:
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION} replaces an EAGLE-3 head's own embedding with the target's when their widths "
            "match (models/llama.py:910-919): this head's embed_tokens.weight would not be used",
            "use an EAGLE-3 head that shares the target's embedding",
        )
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise SpecdecError(
            "the EAGLE-3 head names no eagle_aux_hidden_state_layer_ids", "re-create the head folder with train-drafter"
        )
    own = _sglang_layer_ids(
        ids, target, layout.speculators_model_type, "eagle_aux_hidden_state_layer_ids", allow_embedding=True
    )
    draft_vocab = int(config.get("draft_vocab_size") or layer["vocab_size"])
    decisions.append(f"eagle_aux_hidden_state_layer_ids {list(ids)} -> {own}: SGLang adds 1 (models/llama.py:941)")
    if 0 in [int(i) for i in ids]:
        decisions.append(
            "layer id 0 (the embedding output) written as -1: SGLang captures it before layer 0 (models/llama.py:491)"
        )
    decisions.append(f"draft_vocab_size {draft_vocab}" + (", d2t as offsets" if "d2t" in state else ", no d2t"))
    if "t2d" in state:
        decisions.append("t2d left out: SGLang skips it (models/llama_eagle3.py:355-356)")
    state.pop("t2d", None)
    return {
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": own, "use_aux_hidden_state": True},
    }


def _block_fields(
    layout: SglangHeadLayout, config: dict, layer: dict, target: dict, state: dict, decisions: list[str]
) -> dict:
    """DFlash's backbone, which DSpark shares: the fields and checks of both."""
    kind, arch = layout.speculators_model_type, layout.architecture
    vocab, hidden = int(layer["vocab_size"]), int(layer["hidden_size"])
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    d2t = state.pop("d2t", None)
    if draft_vocab != vocab or "lm_head.weight" in state or (d2t is not None and bool(d2t.any())):
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION}'s {arch} drafts through the target's LM head (speculative/dflash_worker_v2.py:"
            f"136-138): this {kind} head has its own (draft_vocab_size {draft_vocab} of {vocab})",
            "train the head over the target's full vocabulary",
        )
    if int(config.get("target_hidden_size") or hidden) != hidden:
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION}'s {arch} projects target states of its own width (models/dflash.py:772-774): "
            f"target_hidden_size {config.get('target_hidden_size')} differs from hidden_size {hidden}",
            "use a head as wide as its target",
        )
    if not any(k.endswith("self_attn.q_norm.weight") for k in state):
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION}'s {arch} always normalises q and k (models/dflash.py:247-250): this {kind} "
            "head's layers have no q_norm / k_norm",
            "use a head with Qwen3-style layers (transformer_layer_config.model_type qwen3)",
        )
    mask = config.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise SpecdecError(f"the {kind} head has no integer mask_token_id", "re-create the head folder")
    ids = config.get("aux_hidden_state_layer_ids") or []
    own = _sglang_layer_ids(ids, target, kind, "aux_hidden_state_layer_ids", allow_embedding=False)
    block = int(config.get("block_size", 8))
    n = int(target["num_hidden_layers"])
    decisions.append(f"aux_hidden_state_layer_ids {list(ids)} -> dflash_config.target_layer_ids {own}: SGLang adds 1 "
                     "(models/llama.py:953)")  # fmt: skip
    return {
        "block_size": block,
        "num_target_layers": n,
        "dflash_config": {"target_layer_ids": own, "mask_token_id": mask},
    }


def _dflash_fields(
    layout: SglangHeadLayout, config: dict, layer: dict, target: dict, state: dict, decisions: list[str]
) -> dict:
    fields = _block_fields(layout, config, layer, target, state, decisions)
    block = fields["block_size"]
    decisions.append(f"block_size {block}: {block - 1} drafts per round, the target's LM head")
    return fields


def _dspark_fields(
    layout: SglangHeadLayout, config: dict, layer: dict, target: dict, state: dict, decisions: list[str]
) -> dict:
    fields = _block_fields(layout, config, layer, target, state, decisions)
    block = fields["block_size"]
    if not config.get("sample_from_anchor", True):
        raise SpecdecError(
            f"SGLang {SGLANG_VERSION} reads a DSpark block without its anchor slot only in the Nemotron 3.5 layout "
            "(speculative/dflash_utils.py:461-498): sample_from_anchor is false",
            "train the DSpark head with sample_from_anchor true",
        )
    rank = int(config.get("markov_rank", 0))
    if rank <= 0:
        raise SpecdecError(
            "SGLang's DSpark needs markov_rank > 0 (models/dspark.py:385-391)", "train the head with a Markov head"
        )
    confidence = bool(config.get("enable_confidence_head", True)) and "confidence_head.proj.weight" in state
    fields.update(
        sample_from_anchor=True,
        markov_rank=rank,
        markov_head_type=str(config.get("markov_head_type", "vanilla")),
        enable_confidence_head=confidence,
        confidence_head_with_markov=bool(config.get("confidence_head_with_markov", True)),
    )
    decisions.append(f"block_size {block} = gamma: {block} drafts per round, sample_from_anchor true written "
                     "explicitly (SGLang's default)")  # fmt: skip
    decisions.append(
        "confidence head carried: SGLang builds it unless SGLANG_RAGGED_VERIFY_MODE=static, its default, which skips "
        "the weights (models/dspark.py:487-489, 642-644)"
        if confidence
        else "no confidence head: SGLang requires one outside SGLANG_RAGGED_VERIFY_MODE=static, its default "
        "(models/dspark.py:487-507, 687-696)"
    )
    return fields


def _renamed(state: dict, layout: SglangHeadLayout, folder: Path) -> dict:
    out = {}
    for name, tensor in state.items():
        if name.startswith("verifier_"):
            continue  # speculators' copies of the target's tensors: SGLang uses the target's own
        new = next((fmt.format(name) for pattern, fmt in layout.weight_names if re.fullmatch(pattern, name)), None)
        if new is None:
            raise SpecdecError(
                f"SGLang {SGLANG_VERSION}'s {layout.architecture} has no parameter for {name} in {folder} (it would "
                "drop the tensor unread)",
                f"use a {layout.speculators_model_type} head of the layout train-drafter writes",
            )
        out[new] = tensor.float() if tensor.is_floating_point() else tensor
    return out


# one layout per learned head kind SGLang runs as a separate draft; the registry (mechanisms.py) names each its own
EAGLE3_LAYOUT = SglangHeadLayout(
    "eagle3", "LlamaForCausalLMEagle3", "llama", _EAGLE3_NAMES, _eagle3_fields, target_embedding=True
)
DFLASH_LAYOUT = SglangHeadLayout("dflash", "DFlashDraftModel", "qwen3", _BLOCK_NAMES, _dflash_fields)
DSPARK_LAYOUT = SglangHeadLayout("dspark", "DSparkDraftModel", "qwen3", _DSPARK_NAMES, _dspark_fields)


__all__ = [
    "DFLASH_LAYOUT",
    "DSPARK_LAYOUT",
    "EAGLE3_LAYOUT",
    "SGLANG_VERSION",
    "SGLangHead",
    "SglangHeadLayout",
    "write_sglang_head",
]
