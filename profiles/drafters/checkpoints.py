"""Reading and writing learned draft heads: the speculators layout, Model-Optimizer's EAGLE-3 and z-lab's DFlash
exports.

Formats, told apart by `config.json` alone (JSON is parsed; nothing in the folder is executed; weights are read
only from safetensors, pickle files are refused):

  speculators   `speculators_model_type` "eagle3" | "mtp" | "dflash" | "dspark", `transformer_layer_config`, algorithm
                fields (`draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`,
                `norm_before_residual`; `num_nextn_predict_layers`; `block_size`, `aux_hidden_state_layer_ids`,
                `mask_token_id`, `sample_from_anchor`, `markov_rank`, `markov_head_type`, `enable_confidence_head`),
                `speculators_config`.
  Model-Optimizer  a flat Llama config with `eagle_config` {`eagle_aux_hidden_state_layer_ids`,
                `use_aux_hidden_state`} and `draft_vocab_size`; the decoder layer's weights under `midlayer.`.
  z-lab DFlash  a flat Qwen3 config with `architectures` ["DFlashDraftModel"], `block_size`, `num_target_layers` and
                `dflash_config` {`mask_token_id`, `target_layer_ids`}; its layer ids count decoder layers, so target
                layer t is the state entering layer t+1 here; the target's LM head.

A head is checked against the target it will run on (the verifier): hidden size, vocabulary and layer ids. Each kind's
readers live with its head (eagle3.py, mtp.py, dflash.py) and are found through `heads.HEAD_KINDS`; this module
tells the layouts apart, reads the weights, and writes the speculators layout.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.heads import DraftHead, DraftVocabulary, head_kind, head_kinds
from specdec_tune.profiles.drafters.speculators_layout import DEFAULT_VERSION, config_json
from specdec_tune.profiles.models.folders import read_safetensors, weights_hash
from specdec_tune.profiles.models.llama import ModelConfig

if TYPE_CHECKING:
    from specdec_tune.profiles.models.loading import LoadedModel


@dataclasses.dataclass
class LoadedHead:
    head: DraftHead
    mechanism: str  # "eagle3" | "mtp" | "dflash" | "dspark"
    format: str  # "speculators" | "modelopt" | "z-lab"
    weights_hash: str
    config: dict


# This target's cached demo head folder (trained on first use), for a head drafter given neither model= nor random=:
# registered by profiles/train_drafter.py, the one module that can train a head. The modules that decode and profile
# import it; the drafters do not (the trainer runs the speculative loop, which runs the drafters).
_DEMO_HEAD: list[Callable[[str, LoadedModel], Path]] = []


def register_demo_head(find: Callable[[str, LoadedModel], Path]) -> None:
    _DEMO_HEAD[:] = [find]


def resolve_head(mechanism: str, target: LoadedModel, options) -> tuple[DraftHead, str | None, object]:
    """The head a drafter's options name: random weights, a checkpoint folder, or this target's cached demo head.
    Returns (head, weights hash or None, the options with `model` resolved to the folder)."""
    if options.random:
        if options.model:
            raise SpecdecError(f"{mechanism} options model= and random= exclude each other", "give one of them")
        return head_kind(mechanism).new(target.model), None, options
    if options.model:
        folder = Path(options.model).expanduser()
    elif _DEMO_HEAD:
        folder = _DEMO_HEAD[0](mechanism, target)
    else:
        raise SpecdecError(
            f"no {mechanism} head was given and no demo-head trainer is loaded",
            "give model=FOLDER (or random=1), or import specdec_tune.profiles.train_drafter, "
            "which trains the demo head",
        )
    loaded = load_head(folder, target, expect=mechanism)
    return loaded.head, loaded.weights_hash, dataclasses.replace(options, model=str(folder))


# ---------------------------------------------------------------------------- reading


def load_head(folder: Path | str, target: LoadedModel, expect: str | None = None) -> LoadedHead:
    """Load a head from `folder` for `target`, checking it was made for this target's shapes."""
    folder = Path(folder)
    config = _read_config(folder)
    if config.get("auto_map"):
        raise SpecdecError(
            f"{folder} asks for custom model code (auto_map in config.json)",
            "use a speculators or Model-Optimizer head",
        )
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for p in [*folder.glob("*.bin"), *folder.glob("*.pt"), *folder.glob("*.pth")])
        if pickled:
            raise SpecdecError(
                f"{folder} holds weights only as pickle files ({pickled[0]}), which can execute code when loaded",
                "convert them to safetensors first",
            )
        raise SpecdecError(
            f"{folder} has no *.safetensors weights", "give a head folder with config.json and safetensors weights"
        )
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(read_safetensors(shard, "re-create or re-download the head"))
    kinds = head_kinds()
    others = [(kind, layout) for kind in kinds.values() for layout in kind.layouts]
    if "speculators_model_type" in config:
        name = config["speculators_model_type"]
        if name not in kinds:
            raise SpecdecError(
                f"{folder} is a speculators {name!r} checkpoint", f"this tool runs {', '.join(sorted(kinds))}"
            )
        mechanism, fmt, head = name, "speculators", kinds[name].read(config, state, target.model, folder)
    else:
        kind, layout = next(((k, lay) for k, lay in others if isinstance(config.get(lay.marker), dict)), (None, None))
        if kind is None or layout is None:  # found together
            raise SpecdecError(
                f"{folder}/config.json is neither a speculators config (speculators_model_type) nor "
                + " nor ".join(f"a {lay.name} {k.name} export ({lay.marker})" for k, lay in others),
                "give a speculators, " + ", ".join(lay.name for _, lay in others) + " head folder",
            )
        mechanism, fmt, head = kind.name, layout.name, layout.read(config, state, target.model, folder)
    if expect is not None and mechanism != expect:
        raise SpecdecError(
            f"{folder} holds a {mechanism} head, not {expect}", f"use it as --drafter {mechanism}:model={folder}"
        )
    return LoadedHead(head.eval().requires_grad_(False), mechanism, fmt, weights_hash(shards), config)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise SpecdecError(
            f"{folder} has no config.json",
            "give a head folder written by speculators, Model-Optimizer or train-drafter",
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecdecError(f"cannot read {path}: {e}", "re-create the head folder") from None
    if not isinstance(config, dict):
        raise SpecdecError(f"{path} is not a JSON object", "re-create the head folder")
    return config


# ---------------------------------------------------------------------------- writing


def transformer_layer_config(c: ModelConfig) -> dict:
    """A head's layer settings as a Hugging Face config dict (speculators' `transformer_layer_config`)."""
    return {
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def speculators_config(
    head: DraftHead, mechanism: str, *, verifier: str, verifier_architectures: list[str], speculative_tokens: int
) -> dict:
    """config.json for `head`, in the speculators layout (speculators_layout.py; the bundle exporter writes the
    same)."""
    fields = {
        "transformer_layer_config": transformer_layer_config(head.config),
        **head_kind(mechanism).speculators_fields(head),
    }
    try:
        version = importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        version = DEFAULT_VERSION
    return config_json(
        mechanism,
        fields,
        speculative_tokens=speculative_tokens,
        verifier=verifier,
        verifier_architectures=verifier_architectures,
        version=version,
    )


def save_head(
    head: DraftHead,
    mechanism: str,
    folder: Path,
    *,
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    extra: dict | None = None,
) -> Path:
    """Write `head` in the speculators layout (config.json + model.safetensors; the target's shared embedding and LM
    head are left out, as speculators leaves them out), atomically. `extra` goes to training.json beside them."""
    from safetensors.torch import save_file

    shared = head_kind(mechanism).shared(head)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items() if k not in shared}
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    if (
        isinstance(head, DraftVocabulary)
        and head.draft_vocab_size == head.config.vocab_size
        and not bool(head.d2t.any())
    ):
        state.pop("d2t")  # the full vocabulary in order: no map, as speculators and vLLM expect then
    elif isinstance(head, DraftVocabulary):  # a draft vocabulary: its map, as speculators writes it
        t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
        t2d[head.to_target_ids(torch.arange(head.draft_vocab_size, device=head.d2t.device)).cpu()] = True
        state["t2d"] = t2d
    config = speculators_config(
        head,
        mechanism,
        verifier=verifier,
        verifier_architectures=verifier_architectures,
        speculative_tokens=speculative_tokens,
    )
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


__all__ = [
    "LoadedHead",
    "load_head",
    "register_demo_head",
    "resolve_head",
    "save_head",
    "speculators_config",
    "transformer_layer_config",
]
