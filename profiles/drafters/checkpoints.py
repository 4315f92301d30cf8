"""Reading and writing learned draft heads: the speculators layout and Model-Optimizer's EAGLE-3 export.

Formats, told apart by `config.json` alone (JSON is parsed; nothing in the folder is executed; weights are read
only from safetensors, pickle files are refused):

  speculators   `speculators_model_type` "eagle3" | "mtp" | "dflash" | "dspark", `transformer_layer_config`, algorithm
                fields (`draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`;
                `num_nextn_predict_layers`; `block_size`, `aux_hidden_state_layer_ids`, `mask_token_id`,
                `sample_from_anchor`, `markov_rank`, `markov_head_type`, `enable_confidence_head`), `speculators_config`.
  Model-Optimizer  a flat Llama config with `eagle_config` {`eagle_aux_hidden_state_layer_ids`,
                `use_aux_hidden_state`} and `draft_vocab_size`; the decoder layer's weights under `midlayer.`.
  z-lab DFlash  a flat Qwen3 config with `architectures` ["DFlashDraftModel"], `block_size`, `num_target_layers` and
                `dflash_config` {`mask_token_id`, `target_layer_ids`}; its layer ids count decoder layers, so target
                layer t is the state entering layer t+1 here; the target's LM head.

A head is checked against the target it will run on (the verifier): hidden size, vocabulary and layer ids.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.dflash import MARKOV_TYPES, DFlashHead, new_dflash_head
from specdec_tune.profiles.drafters.eagle3 import Eagle3Head, new_eagle3_head
from specdec_tune.profiles.drafters.heads import DraftHead, default_aux_layers
from specdec_tune.profiles.drafters.mtp import MtpHead, new_mtp_head
from specdec_tune.profiles.drafters.speculators_layout import DEFAULT_VERSION, config_json
from specdec_tune.profiles.models.llama import CausalLM, ModelConfig
from specdec_tune.profiles.models.loading import LoadedModel, weights_hash

DSPARK_DEMO_RANK = 64  # the demo DSpark's Markov rank (speculators' default, 256, would outgrow the demo backbone)
NEW_HEADS: dict[str, Callable[[CausalLM], DraftHead]] = {
    "eagle3": new_eagle3_head, "mtp": new_mtp_head, "dflash": new_dflash_head,
    "dspark": lambda target: new_dflash_head(target, markov_rank=DSPARK_DEMO_RANK)}


@dataclasses.dataclass
class LoadedHead:
    head: DraftHead
    mechanism: str  # "eagle3" | "mtp" | "dflash" | "dspark"
    format: str  # "speculators" | "modelopt" | "z-lab"
    weights_hash: str
    config: dict


def resolve_head(mechanism: str, target: LoadedModel, options, *, demo_head: Callable[[str, LoadedModel], Path]
                 ) -> tuple[DraftHead, str | None, object]:
    """The head a drafter's options name: random weights, a checkpoint folder, or this target's cached demo head
    (`demo_head`: its folder, trained on first use). Returns (head, weights hash or None, the options with `model`
    resolved to the folder)."""
    if options.random:
        if options.model:
            raise SpecdecError(f"{mechanism} options model= and random= exclude each other", "give one of them")
        return NEW_HEADS[mechanism](target.model), None, options
    if options.model:
        folder = Path(options.model).expanduser()
    else:
        folder = demo_head(mechanism, target)
    loaded = load_head(folder, target, expect=mechanism)
    return loaded.head, loaded.weights_hash, dataclasses.replace(options, model=str(folder))


# ---------------------------------------------------------------------------- reading


def load_head(folder: Path | str, target: LoadedModel, expect: str | None = None) -> LoadedHead:
    """Load a head from `folder` for `target`, checking it was made for this target's shapes."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = _read_config(folder)
    if config.get("auto_map"):
        raise SpecdecError(f"{folder} asks for custom model code (auto_map in config.json)", "use a speculators or Model-Optimizer head")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for p in [*folder.glob("*.bin"), *folder.glob("*.pt"), *folder.glob("*.pth")])
        if pickled:
            raise SpecdecError(f"{folder} holds weights only as pickle files ({pickled[0]}), which can execute code when loaded",
                               "convert them to safetensors first")
        raise SpecdecError(f"{folder} has no *.safetensors weights", "give a head folder with config.json and safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard)))
        except Exception as e:  # safetensors raises its own error types on corrupt headers
            raise SpecdecError(f"cannot read weights {shard}: {e}", "re-create or re-download the head") from None
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind not in _SPECULATORS_READERS:
            raise SpecdecError(f"{folder} is a speculators {kind!r} checkpoint", f"this tool runs {', '.join(sorted(_SPECULATORS_READERS))}")
        mechanism, fmt, head = kind, "speculators", _SPECULATORS_READERS[kind](config, state, target.model, folder)
    elif isinstance(config.get("eagle_config"), dict):
        mechanism, fmt, head = "eagle3", "modelopt", _modelopt_eagle3(config, state, target.model, folder)
    elif isinstance(config.get("dflash_config"), dict):
        mechanism, fmt, head = "dflash", "z-lab", _zlab_dflash(config, state, target.model, folder)
    else:
        raise SpecdecError(f"{folder}/config.json is neither a speculators config (speculators_model_type), a Model-Optimizer "
                           "EAGLE-3 export (eagle_config) nor a z-lab DFlash config (dflash_config)",
                           "give a speculators, Model-Optimizer or z-lab head folder")
    if expect is not None and mechanism != expect:
        raise SpecdecError(f"{folder} holds a {mechanism} head, not {expect}", f"use it as --drafter {mechanism}:model={folder}")
    return LoadedHead(head.eval().requires_grad_(False), mechanism, fmt, weights_hash(shards), config)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise SpecdecError(f"{folder} has no config.json", "give a head folder written by speculators, Model-Optimizer or train-drafter")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecdecError(f"cannot read {path}: {e}", "re-create the head folder") from None
    if not isinstance(config, dict):
        raise SpecdecError(f"{path} is not a JSON object", "re-create the head folder")
    return config


def _layer_config(hf: dict, where: str) -> ModelConfig:
    try:
        return ModelConfig.from_hf({"model_type": "llama", **hf})
    except KeyError as e:
        raise SpecdecError(f"{where} lacks {e.args[0]}", "the head's transformer layer config must give the layer's shape") from None


def _check_verifier(folder: Path, what: str, target: CausalLM, *, hidden: int, vocab: int, layer_ids: tuple[int, ...] = ()) -> None:
    t = target.config
    if hidden != t.hidden_size:
        raise SpecdecError(f"the {what} in {folder} reads target states of width {hidden}, but the target's hidden size is {t.hidden_size}",
                           "use a head trained for this target (its verifier)")
    if vocab != t.vocab_size:
        raise SpecdecError(f"the {what} in {folder} has a {vocab}-token vocabulary, the target {t.vocab_size}",
                           "use a head trained with the target's tokenizer")
    bad = [i for i in layer_ids if not 0 <= i <= t.num_layers]
    if bad:
        raise SpecdecError(f"the {what} in {folder} reads target layers {list(layer_ids)}; {bad} do not exist in the {t.num_layers}-layer target",
                           "use a head trained for this target (eagle_aux_hidden_state_layer_ids)")


def _load_into(head: DraftHead, state: dict[str, torch.Tensor], folder: Path, shared: set[str], target: CausalLM) -> DraftHead:
    """Copy `state` into `head` strictly: every weight but the target's shared ones, with matching shapes."""
    expected = {k: v for k, v in head.state_dict().items() if k not in shared}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        name = missing[0] if missing else unexpected[0]
        raise SpecdecError(f"weights in {folder} {'lack' if missing else 'hold an unknown tensor'} {name}",
                           "check the checkpoint matches its config.json")
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise SpecdecError(f"{k} in {folder} has shape {list(v.shape)}, the config implies {list(expected[k].shape)}",
                               "check the checkpoint matches its config.json and the target")
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=False)
    return head.to(device=target.device, dtype=target.dtype)


def _draft_map(state: dict, draft_vocab: int, layer: ModelConfig, target: CausalLM, folder: Path, what: str) -> dict:
    """`state` with t2d dropped and d2t checked (or zeros added for the full vocabulary in order)."""
    state = {k: v for k, v in state.items() if k != "t2d"}
    if "d2t" in state:
        d2t = state["d2t"].long()
        mapped = torch.arange(d2t.numel()) + d2t
        if d2t.numel() != draft_vocab or int(mapped.min()) < 0 or int(mapped.max()) >= target.config.vocab_size:
            raise SpecdecError(f"d2t in {folder} does not map {draft_vocab} draft ids into the target's {target.config.vocab_size}",
                               "check draft_vocab_size and the d2t tensor")
    elif draft_vocab != layer.vocab_size:
        raise SpecdecError(f"the {what} in {folder} has a {draft_vocab}-token draft vocabulary but no d2t map", "add d2t to the weights")
    else:
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    return state


def _eagle3(layer: ModelConfig, state: dict, target: CausalLM, folder: Path, *, target_hidden: int, layer_ids, draft_vocab: int,
            norm_before_residual: bool) -> Eagle3Head:
    ids = tuple(int(i) for i in (layer_ids or default_aux_layers(target.config.num_layers)))
    _check_verifier(folder, "EAGLE-3 head", target, hidden=target_hidden, vocab=layer.vocab_size, layer_ids=ids)
    if layer.num_layers != 1:
        raise SpecdecError(f"the EAGLE-3 head in {folder} has {layer.num_layers} decoder layers", "this tool runs one-layer EAGLE-3 heads")
    own_embedding = "embed_tokens.weight" in state
    if not own_embedding and layer.hidden_size != target.config.hidden_size:
        raise SpecdecError(f"the EAGLE-3 head in {folder} is {layer.hidden_size} wide and has no embedding of its own",
                           f"it needs the target's hidden size {target.config.hidden_size}")
    state = _draft_map(state, draft_vocab, layer, target, folder, "EAGLE-3 head")
    embed = torch.nn.Embedding(layer.vocab_size, layer.hidden_size) if own_embedding else target.embed_tokens
    head = Eagle3Head(layer, target_hidden_size=target_hidden, aux_layers=ids, draft_vocab_size=draft_vocab,
                      norm_before_residual=norm_before_residual, embed_tokens=embed)
    return _load_into(head, state, folder, set() if own_embedding else {"embed_tokens.weight"}, target)


def _speculators_eagle3(config: dict, state: dict, target: CausalLM, folder: Path) -> Eagle3Head:
    layer = _layer_config(config.get("transformer_layer_config") or {}, f"{folder}/config.json transformer_layer_config")
    return _eagle3(layer, state, target, folder, target_hidden=int(config.get("target_hidden_size") or layer.hidden_size),
                   layer_ids=config.get("eagle_aux_hidden_state_layer_ids"), draft_vocab=int(config.get("draft_vocab_size") or layer.vocab_size),
                   norm_before_residual=bool(config.get("norm_before_residual", False)))


def _modelopt_eagle3(config: dict, state: dict, target: CausalLM, folder: Path) -> Eagle3Head:
    eagle = config["eagle_config"]
    if not eagle.get("use_aux_hidden_state", True):
        raise SpecdecError(f"the head in {folder} does not read auxiliary target states (EAGLE-1 style)", "use an EAGLE-3 export")
    layer = _layer_config(config, f"{folder}/config.json")
    renamed = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v for k, v in state.items()}
    return _eagle3(layer, renamed, target, folder, target_hidden=int(config.get("target_hidden_size") or layer.hidden_size),
                   layer_ids=eagle.get("eagle_aux_hidden_state_layer_ids"), draft_vocab=int(config.get("draft_vocab_size") or layer.vocab_size),
                   norm_before_residual=bool(config.get("norm_before_residual", False)))


def _speculators_mtp(config: dict, state: dict, target: CausalLM, folder: Path) -> MtpHead:
    layer = _layer_config(config.get("transformer_layer_config") or {}, f"{folder}/config.json transformer_layer_config")
    layers = int(config.get("num_nextn_predict_layers", 1))
    if layers != 1:
        raise SpecdecError(f"the MTP checkpoint in {folder} has {layers} prediction layers", "this tool (like speculators) runs one-layer MTP")
    _check_verifier(folder, "MTP head", target, hidden=layer.hidden_size, vocab=layer.vocab_size)
    own = {k for k in ("embed_tokens.weight", "lm_head.weight") if k in state}
    embed = torch.nn.Embedding(layer.vocab_size, layer.hidden_size) if "embed_tokens.weight" in own else target.embed_tokens
    lm_head = torch.nn.Linear(layer.hidden_size, layer.vocab_size, bias=False) if "lm_head.weight" in own else target.lm_head
    head = MtpHead(dataclasses.replace(layer, num_layers=1), final_layer_id=target.config.num_layers, embed_tokens=embed, lm_head=lm_head)
    return _load_into(head, state, folder, {"embed_tokens.weight", "lm_head.weight"} - own, target)


def _block_head(what: str, layer: ModelConfig, state: dict, target: CausalLM, folder: Path, *, layer_ids, block_size, mask_token_id,
                draft_vocab: int, target_hidden: int, sample_from_anchor: bool, markov_rank: int = 0, markov_type: str = "vanilla",
                confidence: bool = False) -> DFlashHead:
    ids = tuple(int(i) for i in (layer_ids or default_aux_layers(target.config.num_layers)))
    _check_verifier(folder, what, target, hidden=target_hidden, vocab=layer.vocab_size, layer_ids=ids)
    if layer.hidden_size != target.config.hidden_size:
        raise SpecdecError(f"the {what} in {folder} is {layer.hidden_size} wide", f"it reads the target's embedding: it needs width {target.config.hidden_size}")
    if not isinstance(block_size, int) or block_size < 2:
        raise SpecdecError(f"the {what} in {folder} has block_size {block_size!r}", "give an integer block_size of at least 2")
    if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < target.config.vocab_size:
        raise SpecdecError(f"the {what} in {folder} has mask_token_id {mask_token_id!r}",
                           f"set mask_token_id to the id its blocks were trained with (0..{target.config.vocab_size - 1})")
    if markov_type not in MARKOV_TYPES:
        raise SpecdecError(f"the {what} in {folder} has markov_head_type {markov_type!r}", f"use one of {', '.join(MARKOV_TYPES)}")
    state = _draft_map(state, draft_vocab, layer, target, folder, what)
    own_head = "lm_head.weight" in state
    head = DFlashHead(layer, target_hidden_size=target_hidden, layer_ids=ids, block_size=block_size, mask_token_id=mask_token_id,
                      draft_vocab_size=draft_vocab, embed_tokens=target.embed_tokens, lm_head=None if own_head else target.lm_head,
                      sample_from_anchor=sample_from_anchor, markov_rank=markov_rank, markov_head_type=markov_type, confidence_head=confidence)
    if not own_head and draft_vocab != target.config.vocab_size:
        raise SpecdecError(f"the {what} in {folder} has a {draft_vocab}-token draft vocabulary but no lm_head.weight", "add its LM head")
    state = {k: v for k, v in state.items() if not k.startswith("verifier_")}
    return _load_into(head, state, folder, {"embed_tokens.weight"} | (set() if own_head else {"lm_head.weight"}), target)


def _speculators_block(kind: str):
    def read(config: dict, state: dict, target: CausalLM, folder: Path) -> DFlashHead:
        layer = _layer_config(config.get("transformer_layer_config") or {}, f"{folder}/config.json transformer_layer_config")
        dspark = kind == "dspark"
        confidence = bool(config.get("enable_confidence_head", True)) if dspark else False
        if confidence and not config.get("confidence_head_with_markov", True):
            raise SpecdecError(f"the DSpark head in {folder} feeds its confidence head without the Markov state", "this tool reads confidence_head_with_markov heads")
        return _block_head("DSpark head" if dspark else "DFlash head", layer, state, target, folder,
                           layer_ids=config.get("aux_hidden_state_layer_ids"), block_size=config.get("block_size", 8),
                           mask_token_id=config.get("mask_token_id"), draft_vocab=int(config.get("draft_vocab_size") or layer.vocab_size),
                           target_hidden=int(config.get("target_hidden_size") or layer.hidden_size),
                           sample_from_anchor=bool(config.get("sample_from_anchor", dspark)),
                           markov_rank=int(config.get("markov_rank", 256)) if dspark else 0,
                           markov_type=config.get("markov_head_type", "vanilla"), confidence=confidence)
    return read


def _zlab_dflash(config: dict, state: dict, target: CausalLM, folder: Path) -> DFlashHead:
    dflash = config["dflash_config"]
    layer = _layer_config(config, f"{folder}/config.json")
    ids = dflash.get("target_layer_ids")
    if ids is None:  # z-lab's default: draft-layer-many target layers spread over [1, L-3] (L/2 for one draft layer)
        L, n = int(config.get("num_target_layers", target.config.num_layers)), layer.num_layers
        ids = [L // 2] if n == 1 else [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
    return _block_head("DFlash head", layer, state, target, folder, layer_ids=[int(i) + 1 for i in ids],
                       block_size=config.get("block_size", dflash.get("block_size")), mask_token_id=dflash.get("mask_token_id"),
                       draft_vocab=layer.vocab_size, target_hidden=layer.hidden_size, sample_from_anchor=False)


_SPECULATORS_READERS: dict[str, Callable[[dict, dict, CausalLM, Path], DraftHead]] = {
    "eagle3": _speculators_eagle3, "mtp": _speculators_mtp, "dflash": _speculators_block("dflash"), "dspark": _speculators_block("dspark")}


# ---------------------------------------------------------------------------- writing


def transformer_layer_config(c: ModelConfig) -> dict:
    """A head's layer settings as a Hugging Face config dict (speculators' `transformer_layer_config`)."""
    return {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False}


def speculators_config(head: DraftHead, mechanism: str, *, verifier: str, verifier_arch: str, speculative_tokens: int) -> dict:
    """config.json for `head`, in the speculators layout (speculators_layout.py; the bundle exporter writes the same)."""
    fields: dict[str, object] = {"transformer_layer_config": transformer_layer_config(head.config)}
    if isinstance(head, Eagle3Head):
        fields.update(draft_vocab_size=head.draft_vocab_size, norm_before_residual=head.norm_before_residual,
                      target_hidden_size=head.target_hidden_size, eagle_aux_hidden_state_layer_ids=list(head.hidden_layers))
    elif isinstance(head, DFlashHead):
        fields.update(draft_vocab_size=head.draft_vocab_size, block_size=head.block_size, target_hidden_size=head.target_hidden_size,
                      aux_hidden_state_layer_ids=list(head.hidden_layers), mask_token_id=head.mask_token_id,
                      sample_from_anchor=head.sample_from_anchor)
        if head.markov_head is not None:
            fields.update(markov_rank=head.markov_head.rank, markov_head_type=head.markov_head.head_type,
                          enable_confidence_head=head.confidence_head is not None, confidence_head_with_markov=True)
    else:
        fields.update(num_nextn_predict_layers=1)
    try:
        version = importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        version = DEFAULT_VERSION
    return config_json(mechanism, fields, speculative_tokens=speculative_tokens, verifier=verifier, verifier_arch=verifier_arch,
                       version=version)


def save_head(head: DraftHead, mechanism: str, folder: Path, *, verifier: str, verifier_arch: str, speculative_tokens: int,
              extra: dict | None = None) -> Path:
    """Write `head` in the speculators layout (config.json + model.safetensors; the target's shared embedding and LM head
    are left out, as speculators leaves them out), atomically. `extra` goes to training.json beside them."""
    from safetensors.torch import save_file

    shared = {"embed_tokens.weight", "lm_head.weight"} if isinstance(head, MtpHead) else {"embed_tokens.weight"}
    if isinstance(head, DFlashHead) and head.draft_vocab_size == head.config.vocab_size:
        shared.add("lm_head.weight")  # a full-vocabulary block head drafts with the target's head (speculators' rule)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items() if k not in shared}
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    mapped = isinstance(head, Eagle3Head | DFlashHead)
    if mapped and head.draft_vocab_size == head.config.vocab_size and not bool(head.d2t.any()):
        state.pop("d2t")  # the full vocabulary in order: no map, as speculators and vLLM expect then
    elif mapped:
        t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
        t2d[head.to_target_ids(torch.arange(head.draft_vocab_size, device=head.d2t.device)).cpu()] = True
        state["t2d"] = t2d
    config = speculators_config(head, mechanism, verifier=verifier, verifier_arch=verifier_arch, speculative_tokens=speculative_tokens)
    folder = Path(folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if extra is not None:
        (tmp / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


__all__ = ["NEW_HEADS", "LoadedHead", "load_head", "resolve_head", "save_head", "speculators_config", "transformer_layer_config"]
