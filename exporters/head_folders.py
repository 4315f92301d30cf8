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
from specdec_tune.exporters.native_checks import EngineMissing
from specdec_tune.exporters.sglang_head_check import check_sglang_head
from specdec_tune.exporters.sglang_heads import write_sglang_head
from specdec_tune.exporters.speculators_config import config_for
from specdec_tune.exporters.speculators_head_check import check_speculators_head
from specdec_tune.exporters.vllm_head_check import check_head

SPECULATORS_FOLDER = "speculators"
SGLANG_FOLDER = "sglang/head"
TRTLLM_FOLDER = "trtllm/head"
TRTLLM_UNVERIFIED = (
    "unverified (no TensorRT-LLM here): the folder follows its released loaders' config and weight names"
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
    refused = {engine: why for engine, check in spelling.engine_refusals if (why := check(ctx.head))}
    decisions = ["the head ships in speculators/ (vLLM's `model`), converted for SGLang and TensorRT-LLM"]
    layout = spelling.sglang.head_layout if spelling.sglang else None
    try:
        sglang = write_sglang_head(layout, speculators, ctx.target_config, staging / SGLANG_FOLDER)
    except SpecdecError as e:
        sglang, refused["sglang"] = None, e.message
    if sglang is not None and sglang.folder is None:
        refused["sglang"] = sglang.reason or "SGLang cannot load this head"
    if "sglang" in refused:  # TensorRT-LLM's folder is SGLang's, renamed
        refused["trtllm"] = f"its folder is converted from SGLang's layout, which refused the head: {refused['sglang']}"
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


def head_loads(ctx: ExportContext, bundle: Path, target: Path | None, target_config: dict) -> dict:
    """Each engine's own loader on the head folder the bundle ships for it: vLLM's reader, draft class and
    load_weights (vllm_head_check.py), SGLang's (sglang_head_check.py), speculators' from_pretrained
    (speculators_head_check.py); TensorRT-LLM's loader is not on this machine. Where an engine's interpreter is not
    set, that it did not run."""
    if not ctx.head_folders and not ctx.head_refused:
        return {}
    loads: dict = {engine: {"refused_at_export": why} for engine, why in ctx.head_refused.items()}
    checks = {
        "vllm": lambda f: check_head(f, target),
        "sglang": lambda f: check_sglang_head(f, target_config),
        **({"speculators": lambda f: check_speculators_head(f, target)} if target else {}),
    }
    for engine, check in checks.items():
        if engine not in ctx.head_folders or engine in ctx.head_refused:
            continue
        try:
            record = check(bundle / ctx.head_folders[engine])
        except EngineMissing as e:
            loads[engine] = {"not_run": str(e)}
            continue
        loads[engine] = {
            k: record.get(k)
            for k in ("ok", "steps_run", "steps_not_run", "unloaded", "dropped", "error", "version")
            if k in record
        }
    if "trtllm" in ctx.head_folders:
        loads["trtllm"] = {"not_run": TRTLLM_UNVERIFIED}
    return loads


def head_errors(load: dict | None, deviation: dict | None) -> list[str]:
    """A head an engine's own loader did not load whole, where the engine's files do not already serve without it."""
    if not load or "ok" not in load or load["ok"]:
        return []
    if deviation and all(d == 0 for _, d in deviation["schedule"]):
        return []
    what = load["error"] or f"unloaded {load.get('unloaded', [])[:3]}, dropped {load.get('dropped', [])[:3]}"
    return [f"the engine's own loader did not load the shipped head: {what}"[:300]]
