"""What a deployment holds in device memory: the profile's `memory` record, computed from the models' configs.

    weights     embeddings (V·H) + L layers (q, k, v, o: H·(q + 2kv) + q·H; gate, up, down: 3·H·I, or E experts' 3·H·I
                and an E·H router in a mixture of experts; two norms) + final norm + LM head (V·H, none where tied).
                Linear layers in each weight format at its bits per weight (formats.py, scales included, large-tensor
                limit); embeddings, norms and the LM head stay in the dtype (the engines keep them unquantized)
    KV / token  2 · L · H_kv · hd · dtype bytes: K and V of every layer (the engines' default cache dtype is the
                model's)
    lookahead   every running request holds its context plus 1 + D slots: the tokens a round verifies
    activation  the live set of one forward over B·T rows, modeled per row as 4·V (fp32 logits) + dtype bytes ·
                (2·H + q + 2·kv + 2·I·k) (the residual and a normed copy, qkv, gate and up in the k experts a token
                routes to; k = 1 for a dense MLP); on a GPU the allocator's peak over a verify step replaces it
                (`measured`)
    drafters    a draft model loads its own copy of its layers, embeddings and head and keeps its own KV cache; a
                learned head (EAGLE-3, MTP, DFlash, DSpark) adds its layers at the target's layer shapes, the fc that
                fuses the target's states, and its own LM head where its draft vocabulary is reduced, and keeps its
                layers' KV; embeddings are shared. A lookup (n-gram, suffix) holds nothing on the device.
    device      the memory the device has: a GPU's total (torch), the host's MemTotal for a CPU; vLLM on a CPU keeps
                its KV cache in a fixed pool (VLLM_CPU_KVCACHE_SPACE), recorded as `kv_cache_bytes`

Every figure is computed from config.json (`source` says so) except a measured activation peak.
"""

from __future__ import annotations

from specdec_tune.formats import WEIGHT_FORMATS, bits_per_weight

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _first(config: dict, *keys: str):
    """A config value under the first of its names that is set (families name them differently: n_embd, n_head, ...)."""
    return next((config[k] for k in keys if config.get(k) is not None), None)


def shape_of(config: dict, layers: int | None = None) -> dict:
    """The sizes the formulas need, from a Hugging Face config (`layers`: a truncated copy's count). A
    mixture-of-experts config adds `experts` MLPs of `intermediate` each (moe_intermediate_size where the family names
    one) and a router."""
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model"))
    heads = int(_first(config, "num_attention_heads", "n_head"))
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    experts = int(_first(config, "num_local_experts", "num_experts", "n_routed_experts") or 0)
    intermediate = (
        _first(config, "moe_intermediate_size", "intermediate_size")
        if experts
        else _first(config, "intermediate_size", "n_inner")
    )
    return {
        "layers": int(layers if layers is not None else _first(config, "num_hidden_layers", "n_layer")),
        "hidden": hidden,
        "q_width": heads * head_dim,
        "kv_width": kv_heads * head_dim,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate": int(intermediate or 4 * hidden),
        "vocab": int(config["vocab_size"]),
        "tied": bool(config.get("tie_word_embeddings", False)),
        "experts": experts,
        "experts_per_token": int(config.get("num_experts_per_tok") or 1) if experts else 1,
    }


def layer_linear_shapes(s: dict) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linear weights: attention, then one MLP (or each expert's and the router)."""
    h, q, kv, i = s["hidden"], s["q_width"], s["kv_width"], s["intermediate"]
    mlp = [(i, h), (i, h), (h, i)]
    experts = s.get("experts", 0)
    return [(q, h), (kv, h), (kv, h), (h, q)] + (mlp * experts + [(experts, h)] if experts else mlp)


def param_counts(
    s: dict, *, embeddings: bool = True, head_rows: int | None = None, extra_linear: list | None = None
) -> dict:
    """Linear (quantizable) and dense parameters of `s`'s layers, + embeddings, + an LM head of `head_rows` rows
    (default: the vocabulary, none where tied)."""
    linear = layer_linear_shapes(s) * s["layers"] + list(extra_linear or [])
    rows = (0 if s["tied"] else s["vocab"]) if head_rows is None else head_rows
    dense = (s["vocab"] * s["hidden"] if embeddings else 0) + rows * s["hidden"] + (2 * s["layers"] + 1) * s["hidden"]
    return {"linear_params": sum(o * i for o, i in linear), "dense_params": dense}


def weight_bytes(counts: dict, fmt: str, dtype_bytes: float) -> float:
    """Bytes of `counts` with the linear weights in `fmt` (its bits per weight, scales included) and the rest in the
    dtype."""
    per = dtype_bytes if fmt == "none" else bits_per_weight(fmt) / 8
    return counts["linear_params"] * per + counts["dense_params"] * dtype_bytes


def weights_record(counts: dict, dtype_bytes: int) -> dict:
    return counts | {
        "params": counts["linear_params"] + counts["dense_params"],
        "weights_bytes": {fmt: int(weight_bytes(counts, fmt, dtype_bytes)) for fmt in WEIGHT_FORMATS},
    }


def kv_bytes_per_token(s: dict, dtype_bytes: int) -> int:
    return 2 * s["layers"] * s["kv_width"] * dtype_bytes


def activation_bytes_per_row(s: dict, dtype_bytes: int) -> int:
    gate_up = (
        2 * s["intermediate"] * s.get("experts_per_token", 1)
    )  # a token's gate and up outputs, in each expert it routes to
    return 4 * s["vocab"] + dtype_bytes * (2 * s["hidden"] + s["q_width"] + 2 * s["kv_width"] + gate_up)


def drafter_memory(info: dict, target: dict, target_config: dict, dtype_bytes: int, own_config: dict | None) -> dict:
    """A drafter's weights per format and KV bytes per token (module docstring); `info` is the profile's DrafterInfo."""
    model = info.get("model")
    if info["kind"] == "model_free" or not model:
        return weights_record({"linear_params": 0, "dense_params": 0}, dtype_bytes) | {
            "kv_bytes_per_token": 0,
            "source": "a lookup: nothing on the device",
        }
    layers = int(model.get("layers") or 1)
    if "hidden_layers" not in model:  # a draft model: its own checkpoint's config, or the target's first layers
        s = shape_of(own_config, layers) if own_config else shape_of(target_config, layers)
        source = (
            "its config.json"
            if own_config
            else f"the target's config cut to {layers} layers (a separate copy in the engine)"
        )
        return weights_record(param_counts(s), dtype_bytes) | {
            "kv_bytes_per_token": kv_bytes_per_token(s, dtype_bytes),
            "source": f"computed from {source}",
        }
    s = dict(target, layers=layers)
    fuse = (
        [(target["hidden"], target["hidden"] * len(model["hidden_layers"]))] if len(model["hidden_layers"]) > 1 else []
    )
    vocab = int(model.get("draft_vocab_size") or target["vocab"])
    head_rows = vocab if vocab != target["vocab"] else 0  # a full-vocabulary head reads the target's
    return weights_record(param_counts(s, embeddings=False, head_rows=head_rows, extra_linear=fuse), dtype_bytes) | {
        "kv_bytes_per_token": kv_bytes_per_token(s, dtype_bytes),
        "source": f"computed from {layers} layer(s) at the target's layer shapes, "
        f"the fc over {len(model['hidden_layers'])} target layer(s) and "
        f"{'its own ' + str(vocab) + '-row LM head' if head_rows else 'the target LM head (shared)'}",
    }


def memory_record(
    config: dict,
    dtype: str,
    drafters: list[dict],
    device_fp: dict,
    batches: list[int],
    max_draft_len: int,
    drafter_configs: dict[str, dict] | None = None,
    kv_cache_bytes: int | None = None,
    measured_activation: dict[tuple[int, int], int] | None = None,
) -> dict:
    """The profile's `memory` record (module docstring). `measured_activation`: (B, T) -> allocator peak bytes."""
    b = DTYPE_BYTES.get(dtype, 2)
    s = shape_of(config)
    per_row = activation_bytes_per_row(s, b)
    measured = measured_activation or {}
    activation = [
        {
            "batch": B,
            "tokens": T,
            "bytes": measured.get((B, T), B * T * per_row),
            "source": "measured" if (B, T) in measured else "modeled",
        }
        for B in batches
        for T in range(1, max_draft_len + 2)
    ]
    gpu = device_fp.get("kind") == "cuda"
    return {
        "dtype": dtype,
        "dtype_bytes": b,
        "target": {
            "shape": s,
            **weights_record(param_counts(s), b),
            "kv_bytes_per_token": kv_bytes_per_token(s, b),
            "source": "computed from config.json",
        },
        "drafters": {
            d["name"]: drafter_memory(d, s, config, b, (drafter_configs or {}).get(d["name"])) for d in drafters
        },
        "activation_bytes_per_row": per_row,
        "activation": activation,
        "lookahead_slots_per_request": "1 + D",
        "device": {
            "usable_bytes": int(device_fp.get("memory_bytes") or 0),
            "kv_cache_bytes": kv_cache_bytes,
            "source": ("torch.cuda total memory" if gpu else "the host's MemTotal")
            + (
                f"; vLLM's KV cache pool on this CPU: {kv_cache_bytes} bytes (VLLM_CPU_KVCACHE_SPACE)"
                if kv_cache_bytes
                else ""
            ),
        },
    }


def allocator_peak_bytes(run, device) -> int:
    """The CUDA allocator's peak above what was allocated before `run()`: a forward's activations, measured."""
    import torch

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)
