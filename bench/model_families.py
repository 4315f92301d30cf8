"""Coverage of transformers' causal-LM families: every model type in the installed transformers' causal-LM auto mapping,
built tiny and random, loaded by this tool and decoded greedily against transformers' own `generate`.

Per family (one worker process handles a family at a time, under a per-family time limit):

  build     a tiny random model from the family's config class: the defaults with every size field the config has
            (found through its attribute_map: hidden_size, n_embd, num_attention_heads, n_head, ...) shrunk to
            hidden 64, 4 layers, 4 heads (2 KV heads), head_dim 16, small MoE / MLA / state-space sizes; per-layer
            lists (layer_types, mlp_layer_types, layers_block_type, ...) cut to 4 layers that keep every kind of the
            default's pattern; sub-configs (text / vision / audio, attn_config, ...) shrunk alike; the demo target's
            vocabulary (49152 tokens) where the family takes it, else 512 tokens; token ids outside the vocabulary
            moved inside it; FAMILY_OVERRIDES only where a family needs more. Seeded; the weights are re-drawn at a
            trained model's scale (as tests/conftest.py `build_hf_model` does), saved as safetensors.
  classify  from the config alone (KIND_RULES below): encoder-decoder, multimodal / composite wrapper, encoder family
            run as a decoder, state-space / recurrent / hybrid, else attention decoder.
  load      `load_model(folder, dtype="float32")`: the path taken (built-in or generic), or the one-line refusal (a
            SpecdecError), or a traceback (any other exception: a failure of the tool).
  decode    greedy, NEW_TOKENS new tokens, two prompts of different lengths (the demo tokenizer's tokens, or random
            tokens with the small vocabulary), at batch 1 (each prompt alone) and batch 2 (both at once), with no
            drafter, the n-gram drafter and the draft-model drafter twice (the target's first layer, as the tool cuts
            it by default; and the target's own folder as its draft model, whose drafts are all accepted), each
            against transformers' own `model.generate(do_sample=False)` on each prompt alone.

    python bench/model_families.py                         # every family (about 200), 2 workers
    python bench/model_families.py --families gpt2,gemma2,mamba --workers 1

Writes bench/results/model_families.json and a table beside it (.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import multiprocessing
import os
import platform
import re
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it: before torch starts its threads
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common import ROOT, run_and_write, write_table  # noqa: E402

NEW_TOKENS = 24
DRAFT_LEN = 3
SEED = 0
TIMEOUT_S = 60
SMALL_VOCAB = 512
PROMPT_TEXTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The capital of France is",
)
MODES = ("plain", "ngram", "draft_model", "self_draft")
BATCHES = (1, 2)

# ---------------------------------------------------------------------------- tiny configs

LAYERS = 4
# Size fields by their canonical name (a config's attribute_map maps each to the family's own name) -> the tiny value.
# Applied where the family's default config has the field: a positive value is replaced, and so is None (unset: some
# families derive it, others need it and have no default) except for the KEEP_NONE fields; 0 (feature off) stays.
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "n_inner": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "ffn_hidden_size": 128,
    "d_model": 64,
    "decoder_layers": LAYERS,
    "encoder_layers": 2,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "num_layers": LAYERS,
    "num_heads": 4,
    "depth": 2,
    "embed_dim": 64,
    "out_hidden_size": 64,
    "projection_dim": 64,
    "adapter_in_dim": 64,
    "adapter_input_size": 64,
    # mixture of experts
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention and its indexer
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    # windows (shorter than the prompts plus new tokens, so that the window's mask is exercised)
    "sliding_window": 8,
    "sliding_window_size": 8,
    "window_size": 8,
    "attention_window_size": 8,
    "attention_chunk_size": 8,
    "local_attention_window_len": 8,
    # state-space and linear-attention layers (expand 2 x hidden 64 = 8 heads x 16)
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "n_mamba_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "mamba_d_ssm": 128,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "mamba_chunk_size": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "lru_width": 64,
    "rotary_dim": 8,  # codegen, gptj: the rotated part of a head (the default 64 is beyond a 16-wide head)
    # per-layer input embeddings (gemma3n, gemma4) and hashed byte-group embeddings (blt)
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    "encoder_hash_byte_group_vocab": 1024,
    # the lightning indexer of a sparse-attention layer
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}
# Fields where None (or 0) means the feature is off (no window, no query compression, the family's own default): kept.
KEEP_NONE = {
    "sliding_window",
    "sliding_window_size",
    "window_size",
    "attention_window_size",
    "attention_chunk_size",
    "local_attention_window_len",
    "q_lora_rank",
    "n_inner",
    "ffn_dim",
}
# Per-layer numeric lists whose values are sizes: cut to the tiny layers and set to the tiny size.
SIZE_LISTS = {"intermediate_size": 128, "num_attention_heads_per_layer": 4, "num_key_value_heads_per_layer": 2}
# Fields that are not per-layer although a list or string of the layer count's length may be.
NOT_PER_LAYER = {"model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"}
# Index lists (layer ids): kept to the ids below the tiny layer count.
INDEX_LIST = re.compile(r"(idxs|_ids|_indices|_layers)$")

# What a family needs beyond the generic shrinking: the config fields to set (applied last), with the reason.
_SHORT_CONV_HYBRID = ["conv", "full_attention", "conv", "full_attention"]
FAMILY_OVERRIDES: dict[str, dict] = {
    # hybrids whose defaults put attention in every layer (lfm2) or leave the pattern unset (lfm2_moe): two
    # short-convolution layers, two attention layers
    "lfm2": {"full_attn_idxs": [1, 3], "layer_types": _SHORT_CONV_HYBRID},
    "lfm2_moe": {"layer_types": _SHORT_CONV_HYBRID},
    # rope parameters keyed by attention kind, which the default leaves empty
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    },
    # KV sharing: the unshared first layers must include every attention kind
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2,
    },
    # state-space heads: expand 2 x hidden 64 = 8 heads x 16
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "zaya": {"num_experts_per_tok": 1},  # "ZAYA currently supports num_experts_per_tok=1 only"
    # two hybrid layers (the shared attention block is tied across them; one alone breaks transformers' tying)
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    # axial position embeddings: their dims sum to the hidden size, their shape multiplies to the positions
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 32]},
    # transformers' DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no longer defines
    # and clamps q/k/v with clip_qkv unconditionally
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0}},
    "zamba2": {
        "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
        "hybrid_layer_ids": [1, 3],
    },
}
# Families whose own default config does not validate: the fields that make it.
FAMILY_DEFAULTS: dict[str, dict] = {
    "gemma4_assistant": {
        "text_config": {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    },
}

# ---------------------------------------------------------------------------- classification

KINDS = ("attention decoder", "ssm-recurrent-hybrid", "other")
# Per-layer kind lists: a value outside these names is a state-space, linear-attention, convolution or recurrent layer.
ATTENTION_LAYER_KINDS = re.compile(
    r"^(full|sliding|chunked|indexed|global|local|compressed_sparse|heavily_compressed)?_?(attention)?$|"
    r"^(full|sliding|global|local|attention|self_attention)$"
)
LAYER_KIND_FIELDS = (
    "layer_types",
    "layers_block_type",
    "block_types",
    "layer_block_types",
    "attention_layers",
    "attn_layers",
    "hybrid_override_pattern",
)
# Config fields that only a state-space / recurrent / linear-attention / convolution layer reads.
RECURRENT_FIELDS = re.compile(
    r"^(ssm_|mamba_|state_size$|conv_kernel$|conv_L_cache$|conv1d_width$|lru_width$|time_step_|linear_num_|"
    r"linear_key_|linear_value_|linear_head_dim$|linear_conv_|short_conv_|conv_kernel_size$|number_of_conv_states$|"
    r"n_mamba_heads$|attn_layer_period$|rescale_every$|attention_hidden_size$)"
)
# Families the generic rules cannot tell apart, with the reason (model_type -> (kind, why)).
KIND_TABLE = {
    "rwkv": ("ssm-recurrent-hybrid", "RWKV: time-mixing recurrence, no attention (model_type table)"),
    "xlstm": ("ssm-recurrent-hybrid", "xLSTM: mLSTM recurrent blocks, no attention (model_type table)"),
    "bert-generation": ("other", "encoder family run as a decoder: a BERT encoder with is_decoder=True"),
    "reformer": ("other", "Reformer: LSH / chunked local attention with its own cache, causal only as is_decoder"),
    "xlnet": ("other", "XLNet: a permutation language model (two-stream attention, mems)"),
    "xlm": ("other", "XLM: a cross-lingual masked-LM encoder with an LM head"),
    "trocr": ("other", "encoder-decoder: the decoder half of a vision encoder-decoder (TrOCR)"),
}
KIND_RULES = (
    "in order: a model_type in KIND_TABLE (rwkv, xlstm: recurrent; bert-generation, reformer, xlnet, xlm, trocr: "
    "other); config.is_encoder_decoder -> other (encoder-decoder: the causal LM is a seq2seq decoder half); a "
    "sub-config other than attn_config / ffn_config (text_config, vision_config, audio_config, ...) -> other "
    "(multimodal / composite wrapper); a token-type vocabulary (type_vocab_size: the BERT lineage) -> other (encoder "
    "family run as a decoder with is_decoder=True); a per-layer kind list (layer_types, layers_block_type, "
    "block_types, attention_layers, hybrid_override_pattern, ...) naming a kind other than full / sliding / chunked / "
    "indexed / global / local / compressed attention, or a field only a state-space, linear-attention, convolution "
    "or recurrent layer reads (ssm_*, mamba_*, state_size, conv_kernel, conv_L_cache, lru_width, time_step_*, "
    "linear_num_*_heads, short_conv_*, ...) -> ssm-recurrent-hybrid; else attention decoder"
)
COMPOSITE_OK = {"attn_config", "ffn_config"}  # sub-configs of a plain decoder (mpt, dbrx)


def classify(model_type: str, config) -> tuple[str, str]:
    """(kind, why) from the family's config (its defaults or the tiny one)."""
    if model_type in KIND_TABLE:
        return KIND_TABLE[model_type]
    if getattr(config, "is_encoder_decoder", False):
        return "other", "encoder-decoder: config.is_encoder_decoder (the causal LM is a seq2seq model's decoder half)"
    subs = sorted(set(getattr(type(config), "sub_configs", {}) or {}) - COMPOSITE_OK)
    if subs:
        return "other", f"multimodal / composite wrapper: sub-configs {', '.join(subs)}"
    if getattr(config, "type_vocab_size", None) is not None:
        return "other", "encoder family run as a decoder: BERT lineage (type_vocab_size), is_decoder=True"
    for name in LAYER_KIND_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple, str)) and value:
            kinds = sorted({str(k) for k in value}) if not isinstance(value, str) else sorted(set(value))
            odd = [k for k in kinds if not ATTENTION_LAYER_KINDS.match(k)]
            if odd and not isinstance(value, str):
                return "ssm-recurrent-hybrid", f"{name} has layers of kind {', '.join(odd)}"
            if isinstance(value, str) and set(value) - {"*", "-"}:  # nemotron-style pattern: M mamba, * attention
                return "ssm-recurrent-hybrid", f"{name} {value!r} has non-attention layers"
    fields = sorted(k for k in config.to_dict() if RECURRENT_FIELDS.match(k))
    if fields:
        return "ssm-recurrent-hybrid", f"state-space / recurrent fields: {', '.join(fields[:4])}"
    return "attention decoder", "decoder-only, attention layers only"


def default_config(model_type: str):
    """The family's default config (FAMILY_DEFAULTS where transformers' own defaults do not validate)."""
    from transformers import CONFIG_MAPPING

    with _quiet():
        return CONFIG_MAPPING[model_type](**FAMILY_DEFAULTS.get(model_type, {}))


def classify_family(model_type: str) -> tuple[str, str]:
    """(kind, why) from the family's default config: the family's own layer pattern, before the tiny cut."""
    try:
        return classify(model_type, default_config(model_type))
    except Exception as e:
        return "other", f"its default config does not validate ({_line(e, 200)})"


# ---------------------------------------------------------------------------- building


def _real_name(config, name: str) -> str:
    return getattr(config, "attribute_map", {}).get(name, name)


def _is_index_list(key: str, value, n_layers: int) -> bool:
    """A list of layer ids (full_attn_idxs, moe_layers, ...), not a per-layer list."""
    return (
        bool(INDEX_LIST.search(key))
        and isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in value)
        and value == sorted(set(value))
    )


def _kept_layers(default_lists: dict[str, list], n_default: int, n: int) -> list[int]:
    """Layer ids of the default pattern (sorted, at least n) that keep every kind each categorical list has."""
    keep: list[int] = []
    for values in default_lists.values():
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue  # numeric lists follow the categorical ones
        for kind in dict.fromkeys(map(str, values)):
            if not any(str(values[i]) == kind for i in keep):
                keep.append(next(i for i, v in enumerate(values) if str(v) == kind))
    keep = sorted(set(keep))
    for i in range(n_default):
        if len(keep) >= n:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _token_fields(default, vocab: int) -> dict:
    """Token ids outside the vocabulary, moved inside it (distinct ids from the top down)."""
    out, next_free = {}, vocab - 1
    for key, value in default.to_dict().items():
        if not re.search(r"token_(id|ids|index)$", key) or value is None:
            continue
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and value >= vocab:
            out[key], next_free = next_free, next_free - 1
        elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
            fixed = [v for v in value if isinstance(v, int) and v < vocab]
            out[key], next_free = fixed or [next_free], next_free - (0 if fixed else 1)
    return out


def shrink(default, vocab: int, per_layer_mode: str, full_kv: bool = False) -> dict:
    """Keyword arguments that make `default` (a config instance) tiny. per_layer_mode: "derive" (per-layer lists set to
    None: the family derives them from the layer count) or "cut" (the default's lists cut to layers that keep every
    kind). full_kv: as many KV heads as query heads (for families that check it)."""
    kw: dict = {}
    values = default.to_dict()
    for name, small in SIZES.items():
        real = _real_name(default, name)
        if real in kw or real not in values or isinstance(values[real], bool):
            continue
        value = values[real]
        if value is None and name not in KEEP_NONE:  # unset: the family derives it, or needs it and has no default
            kw[real] = small
        elif isinstance(value, (int, float)) and value > 0:  # 0 (or less): the feature is off
            kw[real] = small
    heads, kv_heads = _real_name(default, "num_attention_heads"), _real_name(default, "num_key_value_heads")
    mla_mha = values.get("kv_lora_rank") and values.get(kv_heads) == values.get(heads)
    if (full_kv or mla_mha) and heads in kw and kv_heads in kw:
        # latent attention expands its keys to every query head: its defaults (and checkpoints) keep as many KV heads
        kw[kv_heads] = kw[heads]
    # multi-head latent attention: the head_dim the rotary embedding reads is the rotated part's, and the query/key
    # head is the unrotated part plus the rotated part, as in the default
    rope, nope = values.get("qk_rope_head_dim"), values.get("qk_nope_head_dim")
    if rope and "head_dim" in kw and values.get("head_dim") == rope:
        kw["head_dim"] = kw["qk_rope_head_dim"]
    if rope and nope and values.get("qk_head_dim") == rope + nope:
        kw["qk_head_dim"] = kw["qk_rope_head_dim"] + kw["qk_nope_head_dim"]
    n_default = values.get(_real_name(default, "num_hidden_layers"))
    if isinstance(n_default, int) and n_default > 0:
        n = kw.get(_real_name(default, "num_hidden_layers"), n_default)
        lists = {
            k: v
            for k, v in values.items()
            if k not in NOT_PER_LAYER
            and isinstance(v, (list, str))
            and len(v) == n_default
            and n_default != n
            and (isinstance(v, list) or "pattern" in k or "block_type" in k)
        }
        index_lists = {k: v for k, v in values.items() if _is_index_list(k, v, n_default)}
        lists = {k: v for k, v in lists.items() if k not in index_lists}
        for k, v in index_lists.items():
            kw[k] = [i for i in v if i < n]
        if lists:
            if per_layer_mode == "derive":
                kw.update({k: None for k in lists if k not in SIZE_LISTS})
            else:
                keep = _kept_layers({k: list(v) for k, v in lists.items()}, n_default, n)
                for k, v in lists.items():
                    cut = [v[i] for i in keep]
                    kw[k] = "".join(cut) if isinstance(v, str) else cut
                kw[_real_name(default, "num_hidden_layers")] = len(keep)
                n = len(keep)
        for k, small in SIZE_LISTS.items():
            if isinstance(values.get(k), list):
                kw[k] = [small] * n
    if "vocab_size" in values and isinstance(values["vocab_size"], int):
        kw["vocab_size"] = vocab
        if isinstance(values.get("vocab_size_per_layer_input"), int) and values["vocab_size_per_layer_input"] > 0:
            kw["vocab_size_per_layer_input"] = vocab
        kw.update(_token_fields(default, vocab))
    if values.get("is_decoder") is False and not values.get("is_encoder_decoder"):
        kw["is_decoder"] = True  # an encoder family's causal LM attends causally only as a decoder
    for name in getattr(type(default), "sub_configs", {}) or {}:
        sub = getattr(default, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        kw[name] = {"model_type": getattr(sub, "model_type", "")} | shrink(sub, vocab, per_layer_mode, full_kv)
        if not kw[name]["model_type"]:
            kw[name].pop("model_type")
    return kw


def _redraw(model, seed: int) -> None:
    """Weights at a trained model's scale (tests/conftest.py): linear weights ~ 1/sqrt(fan-in), norm gains near 1,
    biases and other vectors around 0, so that a forward that skips a bias, a norm or a rotation shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def build(model_type: str, vocab: int, seed: int = SEED, folder: Path | None = None):
    """(model, config, attempts, vocabulary size): a tiny random transformers model of the family, float32, eval mode,
    saved to `folder` (safetensors) when given; `attempts` says what was tried. Tries the demo vocabulary, then
    SMALL_VOCAB; per-layer lists cut from the default keeping every kind, then derived by the family; grouped KV heads,
    then as many KV heads as query heads. An attempt holds when transformers' own forward runs on a few tokens. Raises
    BuildError with every attempt's error when none holds."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config_cls = CONFIG_MAPPING[model_type]
    try:
        default = default_config(model_type)
    except Exception as e:
        raise BuildError([f"default config: {type(e).__name__}: {_line(e)}"]) from None
    tried: list[str] = []
    for v in dict.fromkeys((vocab, SMALL_VOCAB)):
        for mode in ("cut", "derive"):
            for kv in ("grouped", "full"):
                kw = _merged(
                    FAMILY_DEFAULTS.get(model_type, {}),
                    shrink(default, v, mode, full_kv=kv == "full"),
                    FAMILY_OVERRIDES.get(model_type, {}),
                )
                label = f"vocab {v}, per-layer lists {mode}, {kv} KV heads"
                stage = "config"
                try:
                    with _quiet():
                        config = config_cls(**kw)
                        _check_layer_lists(default, config)
                        stage = "model"
                        torch.manual_seed(seed)
                        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                        _redraw(model, seed)
                        model.eval()
                        stage = "transformers' own forward"  # a tiny config transformers itself cannot run is no test
                        with torch.no_grad():
                            model(input_ids=torch.arange(1, 9)[None], use_cache=False)
                        if folder is not None:
                            stage = "save_pretrained"
                            model.save_pretrained(folder)
                except Exception as e:
                    tried.append(f"{label}: {stage}: {type(e).__name__}: {_line(e)}")
                    continue
                tried.append(f"{label}: built")
                return model, config, tried, v
    raise BuildError(tried)


def _merged(*layers: dict) -> dict:
    """Keyword arguments merged left to right, sub-config dicts key by key."""
    out: dict = {}
    for layer in layers:
        for k, v in layer.items():
            out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _check_layer_lists(default, config) -> None:
    """Every per-layer list of the default has the tiny layer count in the tiny config (a family that keeps its
    default list when given None would otherwise build a model the list does not describe)."""
    n_default = getattr(default, "num_hidden_layers", None)
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n_default, int) or not isinstance(n, int) or n == n_default:
        return
    for k, v in default.to_dict().items():
        if k in NOT_PER_LAYER or not isinstance(v, list) or len(v) != n_default or _is_index_list(k, v, n_default):
            continue
        got = getattr(config, k, None)
        if isinstance(got, list) and len(got) != n:
            raise ValueError(f"{k} has {len(got)} entries for {n} layers")


class BuildError(Exception):
    def __init__(self, tried: list[str]) -> None:
        super().__init__("; ".join(tried))
        self.tried = tried


def _line(e: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (a multi-line message's lines joined)."""
    return " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())[:limit]


@contextlib.contextmanager
def _quiet():
    """transformers' warnings and logs off while building and loading (the result records what matters)."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


# ---------------------------------------------------------------------------- decoding


def reference_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` on one prompt (no padding), EOS ignored. The model's generation config is
    replaced by a neutral one first: a family's defaults (BART's forced EOS at the last position, a repetition
    penalty, suppressed tokens) are not greedy decoding."""
    import torch
    from transformers import GenerationConfig

    pad = getattr(model.config, "pad_token_id", None)
    model.generation_config = GenerationConfig(
        do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=pad if isinstance(pad, int) else 0
    )
    ids = torch.tensor([prompt])
    with torch.no_grad(), _quiet():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=0
        )
    return out[0, len(prompt) :].tolist()


def nocache_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy by full forwards over the sequence so far (transformers' own masks, no cache)."""
    import torch

    ids = list(prompt)
    with torch.no_grad(), _quiet():
        for _ in range(new_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _margin(model, prefix: list[int]) -> float:
    """transformers' top-1 minus top-2 logit after `prefix` (a small margin: a near tie that rounding can flip)."""
    import torch

    with torch.no_grad(), _quiet():
        logits = model(input_ids=torch.tensor([prefix]), use_cache=False).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def _tb(e: BaseException) -> dict:
    """A traceback's type, message, last frames, and the last frames in this repository's own code (site-packages
    files by their path under it)."""
    frames = traceback.extract_tb(e.__traceback__)

    def where(f) -> str:
        p = Path(f.filename)
        parts = p.parts
        if "site-packages" in parts:
            shown_path = "/".join(parts[parts.index("site-packages") + 1 :])
        else:
            shown_path = str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else "/".join(parts[-3:])
        return f"{shown_path}:{f.lineno} {f.name}"

    own = [f for f in frames if "site-packages" not in Path(f.filename).parts and Path(f.filename).is_relative_to(ROOT)]
    own = [f for f in own if Path(f.filename).name != Path(__file__).name]
    return {
        "type": type(e).__name__,
        "message": _line(e, 400),
        "frames": [where(f) for f in frames[-4:]],
        "tool_frames": [where(f) for f in own[-3:]],
    }


class FamilyTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise FamilyTimeout


def run_family(
    model_type: str,
    prompts: list[list[int]] | None,
    vocab: int,
    new_tokens: int = NEW_TOKENS,
    timeout_s: int | None = None,
    workdir: Path | None = None,
) -> dict:
    """One family's record (see the module docstring). `prompts`: the demo tokenizer's prompts for `vocab` tokens (None:
    random prompts). Never raises: every failure is recorded."""
    t_start = time.perf_counter()
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    old = signal.signal(signal.SIGALRM, _alarm) if timeout_s else None
    if timeout_s:
        signal.alarm(timeout_s)
    rec: dict = {"model_type": model_type}
    cache_env = os.environ.get("SPECDEC_TUNE_CACHE")
    try:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            _run_family(rec, model_type, prompts, vocab, new_tokens, Path(tmp))
    except FamilyTimeout:
        rec["status"] = "timeout"
        rec["why"] = f"over the per-family limit of {timeout_s} s (at stage {rec.get('stage')})"
    except Exception as e:  # a bench-side failure (not the tool's): recorded, the walk goes on
        rec["status"] = "bench error"
        rec["why"] = f"{type(e).__name__}: {_line(e)}"
        rec["traceback"] = _tb(e)
    finally:
        if timeout_s:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        if cache_env is None:
            os.environ.pop("SPECDEC_TUNE_CACHE", None)
        else:
            os.environ["SPECDEC_TUNE_CACHE"] = cache_env
    rec.pop("stage", None)
    rec["seconds"] = {k: round(v, 2) for k, v in (rec.get("seconds") or {}).items()} | {
        "total": round(time.perf_counter() - t_start, 2)
    }
    return rec


def _run_family(rec: dict, model_type: str, prompts, vocab: int, new_tokens: int, tmp: Path) -> None:
    import torch
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from specdec_tune import SpecdecError
    from specdec_tune.profiles.drafters.draft_model import DraftModelDrafter
    from specdec_tune.profiles.drafters.ngram import NgramDrafter
    from specdec_tune.profiles.models.generic import GenericCausalLM
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.specdec import generate

    os.environ["SPECDEC_TUNE_CACHE"] = str(tmp / "cache")  # the tiny models' digests stay out of the shared cache
    seconds = rec["seconds"] = {}
    config_cls = CONFIG_MAPPING[model_type]
    rec["config_class"] = config_cls.__name__
    rec["causal_lm_class"] = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    rec["kind"], rec["kind_why"] = classify_family(model_type)

    # build and save
    rec["stage"] = "build"
    t0 = time.perf_counter()
    folder = tmp / "model"
    try:
        hf, config, tried, used_vocab = build(model_type, vocab, folder=folder)
    except BuildError as e:
        seconds["build"] = time.perf_counter() - t0
        rec["built"], rec["status"] = False, "not built"
        rec["why"] = "cannot build tiny: " + (e.tried[-1] if e.tried else "")
        rec["build_attempts"] = e.tried
        return
    seconds["build"] = time.perf_counter() - t0
    rec["built"], rec["build_attempts"] = True, tried
    rec["vocab_size"] = used_vocab
    rec["layers"] = getattr(config, "num_hidden_layers", None)
    kinds = getattr(config, "layer_types", None)
    rec["layer_types"] = sorted(set(map(str, kinds))) if isinstance(kinds, (list, tuple)) else None
    if prompts is None or used_vocab != vocab:
        g = torch.Generator().manual_seed(SEED)
        prompts = [torch.randint(3, min(used_vocab, SMALL_VOCAB) - 8, (n,), generator=g).tolist() for n in (23, 7)]
        rec["prompts"] = "random tokens"
    else:
        rec["prompts"] = "demo tokenizer"
    rec["prompt_lengths"] = [len(p) for p in prompts]

    # transformers' own greedy output on each prompt alone
    rec["stage"] = "reference"
    t0 = time.perf_counter()
    want, no_reference = None, None
    try:
        want = [reference_greedy(hf, p, new_tokens) for p in prompts]
        rec["reference"] = "generate"
    except Exception as e:
        rec["reference"] = f"transformers' generate failed ({type(e).__name__}: {_line(e, 160)}): no-cache argmax loop"
        try:
            want = [nocache_greedy(hf, p, new_tokens) for p in prompts]
        except Exception as e2:
            rec["reference"] = None
            no_reference = f"transformers itself cannot run the tiny model ({type(e2).__name__}: {_line(e2, 200)})"
    seconds["reference"] = time.perf_counter() - t0

    # this tool's load
    rec["stage"] = "load"
    t0 = time.perf_counter()
    try:
        with _quiet():
            loaded = load_model(str(folder), dtype="float32")
    except SpecdecError as e:
        seconds["load"] = time.perf_counter() - t0
        rec["status"], rec["load"], rec["why"] = "refused", "refused", e.message.replace(str(folder), "<folder>")
        return
    except Exception as e:
        seconds["load"] = time.perf_counter() - t0
        rec["status"], rec["load"], rec["traceback"] = "traceback", "traceback", _tb(e)
        rec["why"] = f"load: {type(e).__name__}: {_line(e)}"
        return
    seconds["load"] = time.perf_counter() - t0
    rec["load"] = "ok"
    rec["path"] = "generic" if isinstance(loaded.model, GenericCausalLM) else "builtin"
    if want is None:
        rec["status"], rec["why"] = "no reference", no_reference
        return

    # this tool's greedy decoding, three ways, at batch 1 and 2
    rec["stage"] = "decode"
    t0 = time.perf_counter()
    drafters = {
        "plain": lambda: None,
        "ngram": lambda: NgramDrafter(None, NgramDrafter.Options(prompt_lookup_min=1, prompt_lookup_max=3)),
        "draft_model": lambda: DraftModelDrafter(loaded, DraftModelDrafter.Options()),
        "self_draft": lambda: DraftModelDrafter(loaded, DraftModelDrafter.Options(model=str(folder))),
    }
    modes: dict = {}
    failure: tuple[str, str, dict | None] | None = None  # (status, why, traceback) of the first cell that failed
    for mode in MODES:
        modes[mode] = {}
        for batch in BATCHES:
            cell: dict = {}
            modes[mode][f"b{batch}"] = cell
            try:
                drafter = drafters[mode]()
                got, accepted = [], 0
                for i in range(0, len(prompts), batch):
                    with torch.no_grad(), _quiet():
                        out = generate(
                            loaded.model,
                            prompts[i : i + batch],
                            drafter=drafter,
                            num_draft_tokens=DRAFT_LEN if drafter is not None else 0,
                            max_new_tokens=new_tokens,
                        )
                    got += out.tokens
                    accepted += sum(c.num_accepted_tokens for c in out.per_prompt)
            except SpecdecError as e:
                cell.update(identical=False, refused=e.message)
                failure = failure or ("refused", f"{mode} b{batch}: {e.message}", None)
                continue
            except FamilyTimeout:
                raise
            except Exception as e:
                cell.update(identical=False, traceback=_tb(e))
                failure = failure or ("traceback", f"{mode} b{batch}: {type(e).__name__}: {_line(e)}", _tb(e))
                continue
            cell["identical"] = got == want
            if mode != "plain":
                cell["accepted"] = accepted
            if got != want:
                cell["first_divergence"] = _divergence(hf, prompts, got, want, new_tokens)
    seconds["decode"] = time.perf_counter() - t0
    rec["modes"] = modes
    rec["identical_all"] = all(c.get("identical") for m in modes.values() for c in m.values())
    if failure:
        rec["status"], rec["why"] = failure[0], failure[1]
        if failure[2]:
            rec["traceback"] = failure[2]
    elif rec["identical_all"]:
        rec["status"] = "identical"
    else:
        rec["status"] = "diverges"
        rec["why"] = next(
            f"{m} {b}: {c['first_divergence']['text']}"
            for m, cells in modes.items()
            for b, c in cells.items()
            if not c["identical"]
        )


def _divergence(hf, prompts, got, want, new_tokens) -> dict:
    """The first (prompt, token) where the tool's output leaves transformers', with transformers' logit margin there
    and whether transformers' own no-cache forward agrees with its generate on that prompt."""
    for p, (g, w) in enumerate(zip(got, want)):
        if g != w:
            t = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            d = {"prompt": p, "token": t, "got": g[t] if t < len(g) else None, "want": w[t] if t < len(w) else None}
            try:
                d["hf_margin"] = round(_margin(hf, prompts[p] + w[:t]), 4)
                nocache = nocache_greedy(hf, prompts[p], new_tokens)
                d["hf_nocache_agrees"] = nocache == w  # transformers' generate against its own no-cache forward
                d["tool_equals_hf_nocache"] = nocache == g
            except Exception as e:  # the diagnosis is optional
                d["hf_margin_error"] = _line(e, 120)
            note = ""
            if d.get("hf_nocache_agrees") is False:
                note = "; transformers' no-cache forward disagrees with its own generate" + (
                    " and equals the tool's output" if d.get("tool_equals_hf_nocache") else ""
                )
            d["text"] = (
                f"prompt {p} token {t}: got {d['got']}, transformers {d['want']}"
                + (f" (transformers' top-2 margin {d['hf_margin']})" if "hf_margin" in d else "")
                + note
            )
            return d
    return {"text": "lengths differ"}


# ---------------------------------------------------------------------------- the walk (worker processes)


def _worker(conn, prompts, vocab, new_tokens, timeout_s, threads) -> None:
    import torch

    torch.set_num_threads(threads)
    with _quiet():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    while True:
        model_type = conn.recv()
        if model_type is None:
            return
        conn.send(run_family(model_type, prompts, vocab, new_tokens, timeout_s))


def demo_prompts() -> tuple[list[list[int]] | None, int, str]:
    """(prompts, vocabulary size, source): the demo target's tokenizer on PROMPT_TEXTS, or random prompts with a small
    vocabulary where the demo is not installed."""
    import torch

    from specdec_tune import SpecdecError
    from specdec_tune.profiles.models.loading import describe_model

    try:
        with _quiet():
            _, tok, _ = describe_model(None, "float32", torch.device("cpu"))
    except SpecdecError as e:
        return None, SMALL_VOCAB, f"random tokens (the demo tokenizer is unavailable: {e.message})"
    return [tok(t)["input_ids"] for t in PROMPT_TEXTS], len(tok), "the demo target's tokenizer (SmolLM2-135M)"


def walk(families: list[str], workers: int, new_tokens: int, timeout_s: int, on_record) -> tuple[list[dict], str, int]:
    """Every family through `run_family` in `workers` worker processes (spawned: each imports torch and transformers
    once); a worker stuck past the limit (in native code, where the alarm cannot reach) is killed and replaced.
    Returns (records in the order given, prompt source, vocabulary size)."""
    prompts, vocab, source = demo_prompts()
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    pending = list(families)
    records: dict[str, dict] = {}
    live: dict = {}  # connection -> [process, family, started]

    def start():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, prompts, vocab, new_tokens, timeout_s, threads), daemon=True)
        proc.start()
        child.close()
        return parent, proc

    idle = [start() for _ in range(min(workers, len(pending)))]
    while pending or live:
        while idle and pending:
            conn, proc = idle.pop()
            family = pending.pop(0)
            conn.send(family)
            live[conn] = [proc, family, time.monotonic()]
        ready = wait(list(live), timeout=2.0)
        for conn in ready:
            proc, family, started = live.pop(conn)
            try:
                rec = conn.recv()
            except (EOFError, OSError):  # the worker died (a crash in native code): record it, start another
                rec = {"model_type": family, "status": "bench error", "why": f"worker died (exit {proc.exitcode})"}
                proc.join(1)
                conn, proc = start()
            records[family] = rec
            on_record(rec)
            idle.append((conn, proc))
        now = time.monotonic()
        for conn, (proc, family, started) in list(live.items()):
            if now - started > timeout_s + 30:  # stuck where the alarm cannot reach (native code): kill, replace
                proc.kill()
                proc.join(5)
                del live[conn]
                rec = {
                    "model_type": family,
                    "status": "timeout",
                    "why": f"over the per-family limit of {timeout_s} s (worker killed)",
                    "seconds": {"total": round(now - started, 1)},
                }
                records[family] = rec
                on_record(rec)
                idle.append(start())
    for conn, proc in idle:
        with contextlib.suppress(OSError):
            conn.send(None)
        proc.join(10)
    for rec in records.values():
        rec.setdefault("kind", _kind_of(rec["model_type"]))
    return [records[f] for f in families], source, vocab


def _kind_of(model_type: str) -> str:
    return classify_family(model_type)[0]


# ---------------------------------------------------------------------------- result and table


def summary(records: list[dict]) -> dict:
    def count(kind: str) -> dict:
        rs = [r for r in records if r.get("kind") == kind]
        by: dict[str, int] = {}
        for r in rs:
            by[r.get("status", "?")] = by.get(r.get("status", "?"), 0) + 1
        return {"families": len(rs), "by_status": dict(sorted(by.items()))}

    attention = [r for r in records if r.get("kind") == "attention decoder"]
    ok = [r for r in attention if r.get("status") == "identical"]
    return {
        "families": len(records),
        "attention_decoders": len(attention),
        "attention_identical_all_modes": len(ok),
        "attention_identical_pct": round(100 * len(ok) / len(attention), 1) if attention else None,
        "attention_refused": sum(r.get("status") == "refused" for r in attention),
        "attention_tracebacks": sum(r.get("status") == "traceback" for r in attention),
        "attention_diverging": sum(r.get("status") == "diverges" for r in attention),
        "tracebacks_all_kinds": sum(r.get("status") == "traceback" for r in records),
        "refused_all_kinds": sum(r.get("status") == "refused" for r in records),
        "identical_with_accepted_drafts": {
            m: sum(bool(r["modes"][m]["b1"].get("accepted")) for r in ok) for m in MODES if m != "plain"
        },
        "by_kind": {k: count(k) for k in KINDS},
        "attention_not_identical": [
            {"model_type": r["model_type"], "status": r.get("status"), "why": r.get("why")}
            for r in attention
            if r.get("status") != "identical"
        ],
        "other_by_reason": dict(
            sorted(
                collections.Counter(
                    r.get("kind_why", "?").split(":")[0] for r in records if r.get("kind") == "other"
                ).items()
            )
        ),
    }


def run(args) -> dict:
    import torch
    from transformers import __version__ as tf_version
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    everything = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    families = everything if not args.families else args.families
    unknown = [f for f in families if f not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        from specdec_tune import SpecdecError

        raise SpecdecError(f"not in transformers' causal-LM mapping: {', '.join(unknown)}", "see --help")
    started = time.perf_counter()
    done = [0]

    def progress(rec: dict) -> None:
        done[0] += 1
        print(
            f"[{done[0]}/{len(families)}] {rec['model_type']}: {rec.get('kind', '?')}, {rec.get('status')}"
            + (f" ({rec['why'][:140]})" if rec.get("why") else "")
            + f" {rec.get('seconds', {}).get('total', '')}s",
            file=sys.stderr,
            flush=True,
        )

    records, source, vocab = walk(families, args.workers, args.new_tokens, args.timeout, progress)
    wall = time.perf_counter() - started
    return {
        "what": "transformers' causal-LM families, tiny and random, loaded by this tool and decoded greedily against "
        "transformers' own generate",
        "source": "measured",
        "transformers": tf_version,
        "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "workers": args.workers,
        "per_family_timeout_s": args.timeout,
        "wall_s": round(wall, 1),
        "all_families_in_mapping": len(everything),
        "families_run": len(families),
        "method": {
            "build": "defaults of the family's config class with its size fields shrunk (bench/model_families.py "
            "SIZES via the config's attribute_map), per-layer lists cut keeping every kind, sub-configs shrunk alike, "
            f"FAMILY_OVERRIDES {sorted(FAMILY_OVERRIDES)}; seed {SEED}; weights re-drawn at a trained model's scale",
            "classification": KIND_RULES,
            "prompts": source,
            "vocab_size": vocab,
            "new_tokens": args.new_tokens,
            "draft_len": DRAFT_LEN,
            "modes": {
                "plain": "no drafter",
                "ngram": "n-gram drafter (prompt_lookup_min 1, max 3)",
                "draft_model": "draft-model drafter cut from the target (its default: a third of the layers, >= 1)",
                "self_draft": "draft-model drafter loading the target's own folder as its draft model: every draft "
                "is accepted (full acceptance, bonus tokens, the draft's catch-up), which the cut, with random "
                "weights, rarely reaches",
            },
            "batches": "b1: each prompt alone; b2: both prompts in one batch (different lengths)",
            "reference": "transformers' model.generate(do_sample=False), each prompt alone, EOS ignored",
        },
        "summary": summary(records),
        "families": records,
    }


def table(result: dict) -> str:
    s = result["summary"]
    att = s["by_kind"]["attention decoder"]
    lines = [
        f"# transformers' causal-LM families through this tool (transformers {result['transformers']}, "
        f"{result['families_run']} of {result['all_families_in_mapping']} families, {result['wall_s']} s on "
        f"{result['machine']}, {result['workers']} workers)",
        "",
        f"- attention-based decoder-only families: **{s['attention_decoders']}**",
        f"- of them token-identical to transformers' greedy generate in plain, n-gram and draft-model decoding (the "
        f"cut draft and the target as its own draft) at batch 1 and 2: **{s['attention_identical_all_modes']}** "
        f"({s['attention_identical_pct']}%)",
        f"- refused with a one-line reason: {s['attention_refused']}; diverging: {s['attention_diverging']}; ending in "
        f"a traceback: {s['attention_tracebacks']}"
        + "".join(
            f"; {k}: {v}"
            for k, v in att["by_status"].items()
            if k not in ("identical", "refused", "diverges", "traceback")
        ),
        "- drafts accepted (batch 1) in the identical attention decoders: "
        + ", ".join(f"{m} in {n}" for m, n in s["identical_with_accepted_drafts"].items()),
        f"- tracebacks over every kind: {s['tracebacks_all_kinds']}",
    ]
    for kind in KINDS[1:]:
        k = s["by_kind"][kind]
        lines.append(
            f"- {kind}: {k['families']} families (" + ", ".join(f"{st} {n}" for st, n in k["by_status"].items()) + ")"
        )
    lines.append("  - other, by reason: " + ", ".join(f"{why} {n}" for why, n in s["other_by_reason"].items()))
    lines += [
        "",
        f"Prompts: {result['method']['prompts']}; {result['method']['new_tokens']} new tokens, D = "
        f"{result['method']['draft_len']}. Cells: each mode at b1 and b2 (= identical, x differs, R refused, T "
        "traceback); draft: the draft model cut from the target, self-draft: the target as its own draft model.",
        "",
        "| family | kind | path | status | plain b1 b2 | ngram b1 b2 | draft b1 b2 | self-draft b1 b2 | s | why |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def mark(cell: dict | None) -> str:
        if cell is None:
            return "·"
        if cell.get("identical"):
            return "="
        return "R" if "refused" in cell else "T" if "traceback" in cell else "x"

    order = {k: i for i, k in enumerate(KINDS)}
    for r in sorted(result["families"], key=lambda r: (order.get(r.get("kind"), 9), r["model_type"])):
        modes = r.get("modes") or {}
        cells = [" ".join(mark((modes.get(m) or {}).get(f"b{b}")) for b in BATCHES) if modes else "" for m in MODES]
        why = (r.get("why") or ("" if r.get("status") == "identical" else r.get("kind_why", ""))).replace("|", "/")
        lines.append(
            f"| {r['model_type']} | {r.get('kind', '?')} | {r.get('path') or ''} | {r.get('status')} | "
            f"{' | '.join(cells)} | {r.get('seconds', {}).get('total', '')} | {why[:200]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--families",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=None,
        help="a comma-separated subset of model types (default: every causal-LM family)",
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per family")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "model_families.json")
    args = parser.parse_args()
    result = run_and_write(run, args)
    if result is not None:
        write_table(args, table(result))


if __name__ == "__main__":
    main()
