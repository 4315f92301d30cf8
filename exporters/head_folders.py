"""A learned head shipped in the bundle in each engine's own layout, so that every engine config points inside the
bundle at a folder its loader reads:

    speculators/   config.json (speculators_config.py: the head's fields, its layer type and explicit defaults) and
                   the head's safetensors: vLLM's `model` (its speculators reader) and speculators' from_pretrained
    sglang/head/   SGLang 0.5.23's layout (sglang_heads.py), converted from speculators/; where SGLang cannot load the
                   head, the reason, and SGLang serves without it
    trtllm/head/   TensorRT-LLM's: SGLang's folder (a flat Hugging Face config with `model_type`, which TensorRT-LLM
                   reads through AutoConfig; DFlash's `dflash_config`) with the weights renamed where TensorRT-LLM's
                   loader names them otherwise (EAGLE-3: `midlayer.`, no `model.` prefix). TensorRT-LLM does not run on
                   this machine: the folder follows its released loaders and is marked unverified

Nothing is shipped for a plan that never speculates, a drafter that is not a learned head, a head with no folder
(random weights), or a kind no engine loads as a separate head (MTP: mechanisms.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.exporters.engines import ExportContext
from specdec_tune.exporters.sglang_heads import write_sglang_head
from specdec_tune.exporters.speculators_config import config_for

SPECULATORS_FOLDER = "speculators"
SGLANG_FOLDER = "sglang/head"
TRTLLM_FOLDER = "trtllm/head"
TRTLLM_UNVERIFIED = (
    "unverified: TensorRT-LLM's loader was not run on this head (no TensorRT-LLM here); its folder follows the "
    "released loaders' config and weight names"
)


@dataclasses.dataclass(frozen=True)
class ShippedHeads:
    folders: dict[str, str]  # engine -> the head folder relative to the bundle
    refused: dict[str, str]  # engine -> why it cannot load the head (it serves without it)
    decisions: tuple[str, ...] = ()


def ship_head_folders(ctx: ExportContext, staging: Path) -> ShippedHeads:
    """Write the plan's learned head into `staging` in every engine's layout (module docstring)."""
    spelling = ctx.spelling
    source = Path(ctx.drafter_model) if ctx.drafter_model else None
    if not (ctx.speculates and spelling.learned_head and source and source.is_dir()) or spelling.no_separate_head:
        return ShippedHeads({}, {})
    weights = sorted(source.glob("*.safetensors"))
    if not weights:
        raise SpecdecError(f"the head folder {source} holds no .safetensors weights", "give the head's own folder")
    speculators = staging / SPECULATORS_FOLDER
    speculators.mkdir(parents=True, exist_ok=True)
    (speculators / "config.json").write_text(json.dumps(config_for(ctx), indent=2) + "\n")
    for w in weights:
        shutil.copyfile(w, speculators / w.name)
    folders = {"vllm": SPECULATORS_FOLDER, "speculators": SPECULATORS_FOLDER}
    refused: dict[str, str] = {}
    decisions = ["the head ships in speculators/ (vLLM's `model`), converted for SGLang and TensorRT-LLM"]
    layout = spelling.sglang.head_layout if spelling.sglang else None
    try:
        sglang = write_sglang_head(layout, speculators, ctx.target_config, staging / SGLANG_FOLDER)
    except SpecdecError as e:
        sglang = None
        refused["sglang"] = refused["trtllm"] = e.message
    if sglang is not None and sglang.folder is None:
        refused["sglang"] = refused["trtllm"] = sglang.reason or "SGLang cannot load this head"
    elif sglang is not None:
        folders["sglang"] = SGLANG_FOLDER
        decisions += [f"SGLang head: {d}" for d in sglang.decisions]
        _trtllm_head(staging / SGLANG_FOLDER, staging / TRTLLM_FOLDER, spelling.trtllm.head_weight_name)
        folders["trtllm"] = TRTLLM_FOLDER
        decisions.append(f"TensorRT-LLM head in {TRTLLM_FOLDER}: {TRTLLM_UNVERIFIED}")
    return ShippedHeads(folders, refused, tuple(decisions))


def _trtllm_head(sglang: Path, out: Path, rename) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sglang / "config.json", out / "config.json")
    state = load_file(str(sglang / "model.safetensors"))
    save_file({rename(k): v for k, v in state.items()}, str(out / "model.safetensors"))
