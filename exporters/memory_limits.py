"""The plan's memory budget as each engine spells it, from plan.json's `memory` and its buckets' (autotune/memory.py).

With M the device's memory, f the plan's fraction, W the weights (target and drafter, per device) and A the largest
bucket's activations, the plan fills f·M:

    vLLM           gpu_memory_utilization = f               (a share of the whole device: weights, activations, KV)
    TensorRT-LLM   kv_cache_config.free_gpu_memory_fraction
                   = (f·M − W − A) / (M − W − A)            (a share of what is free once weights and activations are
                                                            in)
    SGLang         --mem-fraction-static = (f·M − A) / M    (a share of the whole device for weights and the KV pool)

and each engine's concurrency cap is the plan's largest batch (vLLM max_num_seqs, TensorRT-LLM max_batch_size, SGLang
--max-running-requests per band), which fits at its D by the search's construction. Where the KV cache is a pool of
the engine's own (vLLM on a CPU), the fractions do not apply and the pool's size is what the plan assumed.
"""

from __future__ import annotations

from specdec_tune.autotune.plan_schema import Plan


def engine_memory(plan: Plan) -> dict | None:
    """The three engines' memory fields for `plan`, with the figures they come from; None for a plan without memory."""
    memory = plan.memory
    if memory is None:
        return None
    M, f = memory.device_bytes, memory.fraction
    rows = [b.memory for b in plan.buckets if b.memory is not None]
    W = max(r.weights_bytes for r in rows)
    A = max(r.activation_bytes for r in rows)
    free = M - W - A
    return {
        "gpu_memory_utilization": f,
        "free_gpu_memory_fraction": round(min(1.0, max(0.01, (f * M - W - A) / free)), 3) if free > 0 else 0.01,
        "mem_fraction_static": round(min(1.0, max(0.01, (f * M - A) / M)), 3),
        "device_bytes": M,
        "weights_bytes": W,
        "activation_bytes": A,
        "kv_cache_pool_bytes": memory.kv_cache_pool_bytes,
    }


def limits_lines(plan: Plan) -> list[str]:
    """The bundle README's concurrency limit per band (each bucket up to the next), at the plan's context."""
    memory = plan.memory
    if memory is None:
        return []
    out = [
        f"Memory (modeled from the models' configs; device memory: {memory.device_source}): the plan fills "
        f"{memory.fraction:g} of {memory.device_bytes / 1e9:.2f} GB"
        + (f" per device over {memory.tensor_parallel} devices" if memory.tensor_parallel > 1 else "")
        + f" at context {memory.ctx}. Concurrency that fits, per band:",
        "",
    ]
    lower = 1
    for b in plan.buckets:
        m = b.memory
        if m is not None:
            band = f"batch {lower}–{b.batch}" if lower < b.batch else f"batch {lower}"
            out.append(
                f"- {band} (D={b.draft_len}): up to {m.max_concurrency} requests fit; at batch {b.batch} "
                f"the bucket holds {m.needed_bytes / 1e9:.2f} GB (weights {m.weights_bytes / 1e9:.2f}, "
                f"KV {m.kv_bytes / 1e9:.2f}, "
                f"activations {m.activation_bytes / 1e9:.2f})"
            )
        lower = b.batch + 1
    return out + [""]
