"""Loading target and draft models for the loop, from the folders `folders.model_folder` finds (safetensors only).

The built-in forward (llama.py) takes the model where it covers it, its weights read onto meta-initialised modules in
well under a second; any other causal LM the installed transformers implements loads into transformers' own classes
and runs through generic.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.fingerprint import pick_dtype
from specdec_tune.profiles.models.folders import (
    DEFAULT_TARGET,
    ModelRef,
    builtin_covers,
    model_folder,
    read_safetensors,
    weights_hash,
)
from specdec_tune.profiles.models.generic import GenericCausalLM, LogitHead, head_modules
from specdec_tune.profiles.models.llama import SUPPORTED_ARCHITECTURES, CausalLM, ModelConfig
from specdec_tune.records import sha256_json

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

IMPLEMENTATIONS = ("auto", "builtin", "transformers")  # auto: the built-in forward where it covers the model


@dataclasses.dataclass
class LoadedModel:
    model: CausalLM | GenericCausalLM
    tokenizer: PreTrainedTokenizerBase | None  # a transformers tokenizer, or None when the folder has none
    ref: ModelRef


def _hf_to_local_names(name: str) -> str:
    return name.removeprefix("model.")


def load_model(
    path: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
    num_layers: int | None = None,
    implementation: str = "auto",
) -> LoadedModel:
    """Load a causal LM for the loop. `num_layers` keeps only the first N layers. `implementation`: "builtin" (llama.py:
    llama, mistral, qwen2, qwen3), "transformers" (generic.py: any causal LM transformers implements) or "auto" (the
    built-in forward where it covers the model, else transformers')."""
    fmt, folder, hf_config, shards = model_folder(path, trust_remote_code)
    dev = torch.device(device)
    torch_dtype = pick_dtype(dtype, dev)
    if dev.type == "cpu":
        # Flush denormals to zero, as GPU kernels do: x86 computes on denormal floats up to 30x slower,
        # which once made a demo verify step take 4 s instead of 0.1 s. Process-wide, set once.
        torch.set_flush_denormal(True)
    if implementation not in IMPLEMENTATIONS:
        raise SpecdecError(
            f"unknown model implementation {implementation!r}", f"use one of {', '.join(IMPLEMENTATIONS)}"
        )
    model: CausalLM | GenericCausalLM
    if implementation == "builtin" or (implementation == "auto" and builtin_covers(hf_config)):
        model = _load_builtin(folder, hf_config, shards, torch_dtype, dev)
    else:
        model = _load_transformers(folder, hf_config, torch_dtype, dev)
    model.eval().requires_grad_(False)
    if num_layers is not None:
        model = model.truncated(num_layers)

    tokenizer = _load_tokenizer(folder, trust_remote_code)
    ref = ModelRef(
        path=str(path or DEFAULT_TARGET),
        format=fmt,
        arch=model.config.model_type,
        dtype=str(torch_dtype).removeprefix("torch."),
        config_hash=sha256_json(hf_config),
        weights_hash=weights_hash(shards),
        num_layers=len(model.layers),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, ref=ref)


def _load_builtin(
    folder: Path, hf_config: dict, shards: list[Path], torch_dtype: torch.dtype, dev: torch.device
) -> CausalLM:
    config = ModelConfig.from_hf(hf_config)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = read_safetensors(shard, "re-download or re-convert the model")
        state.update({_hf_to_local_names(k): v for k, v in tensors.items()})
    with torch.device("meta"):
        model = CausalLM(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise SpecdecError(
            f"weights in {folder} lack {len(missing)} tensors, e.g. {missing[0]}",
            "check the checkpoint matches its config.json",
        )
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
    return model


def _load_transformers(folder: Path, hf_config: dict, torch_dtype: torch.dtype, dev: torch.device) -> GenericCausalLM:
    """Any causal LM the installed transformers implements, from safetensors only, with no remote code."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = hf_config.get("model_type")
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        known = ", ".join(
            f
            for f in ("gemma3_text", "gemma2", "phi3", "olmo2", "granite", "mixtral", "qwen3_moe")
            if f in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        )
        raise SpecdecError(
            f"model family {family!r} has no causal LM in the installed transformers {transformers.__version__}",
            f"supported: the built-in {', '.join(SUPPORTED_ARCHITECTURES)} and transformers' causal LMs ({known}, ...)",
        )

    def load(attention: str):
        # with output_loading_info the call returns (model, loading info), which transformers' annotation leaves out
        return cast(
            "tuple[PreTrainedModel, dict[str, list[str]]]",
            AutoModelForCausalLM.from_pretrained(
                str(folder),
                config=config,
                dtype=torch_dtype,
                use_safetensors=True,
                trust_remote_code=False,
                attn_implementation=attention,
                output_loading_info=True,
            ),
        )

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        # eager where a family soft-caps attention scores (transformers' SDPA cannot) or has no SDPA, SDPA elsewhere
        try:
            hf, info = load("eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa")
        except ValueError as e:
            if "does not support an attention implementation" not in str(e):
                raise
            hf, info = load("eager")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SpecdecError(
            f"transformers cannot load {folder} as a {family} model ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]})",
            "check the folder's config.json and safetensors weights",
        ) from None
    missing = sorted(
        k for k in info.get("missing_keys", ()) if not (k.endswith("lm_head.weight") and config.tie_word_embeddings)
    )
    if missing:
        raise SpecdecError(
            f"weights in {folder} lack {len(missing)} tensors, e.g. {missing[0]}",
            "check the checkpoint matches its config.json",
        )
    # the decoder: get_decoder's answer, else (a family whose get_decoder gives itself or a layer) its base model
    decoder = next(
        (
            d
            for d in (
                hf.get_decoder() if hasattr(hf, "get_decoder") else None,
                hf.base_model,
                getattr(hf, "model", None),
            )
            if isinstance(d, PreTrainedModel) and d is not hf
        ),
        hf,
    )
    try:
        output = hf.get_output_embeddings()
        head = LogitHead(output, config, head_modules(hf, decoder, output))
        return GenericCausalLM(decoder, head).to(dev)
    except (AttributeError, KeyError, NotImplementedError, RuntimeError, TypeError, ValueError) as e:
        # the family's config or modules are not what the generic path reads (per-layer shapes, another decoder
        # layout): one line naming it, the cause in transformers' words
        raise SpecdecError(
            f"the generic path cannot run the {family} model in {folder} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else 'no message'})",
            "profile a family the generic path runs (bench/results/model_families.md lists them)",
        ) from None


def describe_model(
    path: str | None, dtype: str, device: torch.device, trust_remote_code: bool = False
) -> tuple[ModelRef, object | None, dict]:
    """A model's reference, tokenizer and Hugging Face config without loading its weights into this package's forward:
    for a serving engine that runs the model itself (any architecture it supports)."""
    fmt, folder, hf_config, shards = model_folder(path, trust_remote_code)
    ref = ModelRef(
        path=str(path or DEFAULT_TARGET),
        format=fmt,
        arch=str(hf_config.get("model_type", "unknown")),
        dtype=str(pick_dtype(dtype, device)).removeprefix("torch."),
        config_hash=sha256_json(hf_config),
        weights_hash=weights_hash(shards),
        num_layers=int(hf_config.get("num_hidden_layers", 0)),
    )
    return ref, _load_tokenizer(folder, trust_remote_code), hf_config


def _load_tokenizer(folder: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase | None:
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
    if (
        target.tokenizer is not None
        and draft.tokenizer is not None
        and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab()
    ):
        raise SpecdecError(
            "draft tokenizer maps tokens to different ids than the target's",
            "use a drafter that shares the target's tokenizer",
        )


__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedModel", "load_model", "describe_model", "check_same_vocabulary"]
