"""Hugging Face folders written for a serving engine: a view of a model it accepts, and a draft model cut from the
target. The vllm measurement backend runs them; `export` ships the cut draft model in the bundle."""

from __future__ import annotations

import json
import re
from pathlib import Path

from specdec_tune.profiles.models.folders import architectures, model_folder

_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def engine_model_view(folder: Path, dest: Path) -> Path:
    """A view of a Hugging Face folder that vLLM accepts: files linked, config.json with `architectures` set and a
    GGUF `quantization_config` dropped (the cached weights are already dequantized safetensors)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and f.name != "config.json" and not (dest / f.name).exists():
            (dest / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "gguf":
        config.pop("quantization_config")
    config["architectures"] = architectures(config, str(folder / "config.json"))
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


def write_cut_draft(target_path: str | None, layers: int, out: Path, dtype: str) -> Path:
    """A draft model cut from the target as a folder of its own (every engine loads a draft model from one): the
    target's config with num_hidden_layers cut (and `architectures` named), the embedding, its first `layers` layers,
    the final norm and the LM head, in `dtype` ("float32", "bfloat16", "float16")."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, folder, config, shards = model_folder(target_path)
    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                index = _LAYER_TENSOR.search(name)
                if index is None or int(index.group(1)) < layers:
                    t = f.get_tensor(name)
                    tensors[name] = (t.to(torch_dtype) if t.is_floating_point() else t).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    own = {
        k: v for k, v in config.items() if k != "quantization_config"
    }  # a converted GGUF's; the tensors are dequantized
    own |= {
        "num_hidden_layers": layers,
        "architectures": architectures(config, f"{folder}/config.json"),
        "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(own, indent=2) + "\n")
    return out
