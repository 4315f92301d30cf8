"""vLLM: `speculative_config` for `vllm serve --speculative-config` / `LLM(speculative_config=...)`."""

from __future__ import annotations

import json
import shlex

from specdec_tune.exporters.engines import (
    Engine,
    EngineFiles,
    ExportContext,
    deviation,
    deviation_text,
    register,
    without_head,
)
from specdec_tune.exporters.native_checks import check_vllm
from specdec_tune.exporters.schedule import to_vllm
from specdec_tune.exporters.versions import gate


def _mechanism_fields(ctx: ExportContext) -> dict:
    v = ctx.spelling.vllm
    fields = v.fields(ctx.drafter.get("options", {}) | ctx.head)
    if not ctx.spelling.checkpoint:
        return fields
    model = ctx.checkpoint_for("vllm")
    fields |= {"model": model} if model else {}
    fields |= dict(v.extra)
    if ctx.quant == "fp8":
        fields["quantization"] = "fp8"
    return fields


def render(ctx: ExportContext) -> EngineFiles:
    version = ctx.versions["vllm"]
    decisions: list[str] = []
    gates: list[dict] = []
    serve = ["vllm", "serve", ctx.target_model, "--max-num-seqs", str(ctx.max_batch)]
    memory = ctx.memory
    if memory:
        serve += ["--gpu-memory-utilization", f"{memory['gpu_memory_utilization']:g}"]
        if memory["kv_cache_pool_bytes"]:  # vLLM on a CPU: the KV cache is the pool the plan was sized for
            serve = ["env", f"VLLM_CPU_KVCACHE_SPACE={memory['kv_cache_pool_bytes'] / 2**30:g}", *serve]
        decisions.append(
            f"--gpu-memory-utilization {memory['gpu_memory_utilization']:g} and --max-num-seqs {ctx.max_batch}: the "
            "plan's memory budget and the largest batch that fits in it at its D"
            + (
                " (on a CPU vLLM keeps the KV cache in VLLM_CPU_KVCACHE_SPACE, "
                f"{memory['kv_cache_pool_bytes'] / 2**30:g} GiB as profiled)"
                if memory["kv_cache_pool_bytes"]
                else ""
            )
        )
    if not ctx.speculates:
        decisions.append("the plan speculates at no batch size: no speculative_config")
        return EngineFiles({"serve.sh": _script(serve)}, None, decisions, gates)
    v = ctx.spelling.vllm
    record = without_head(ctx, "vllm")
    if record:
        decisions.append(deviation_text(record))
        return EngineFiles({"serve.sh": _script(serve)}, None, decisions, gates, record)
    schedule, block_record = _block_schedule(ctx)
    if block_record:
        decisions.append(deviation_text(block_record))
    top = max(d for _, d in schedule)
    g = gate("vllm", f"method:{v.method}", version)
    gates.append(g)
    config = {"method": v.method, "num_speculative_tokens": top, **_mechanism_fields(ctx)}
    if not g["emitted"]:
        decisions.append(
            f"vLLM {version} predates method {v.method!r} (since {g['since']}): the config needs a newer vLLM"
        )
    ranges = to_vllm(schedule)
    g = gate("vllm", "num_speculative_tokens_per_batch_size", version)
    gates.append(g)
    record = block_record
    static_why = _static_instead(ctx, version, g)
    if len(ranges) > 1 and static_why is None:
        config["num_speculative_tokens_per_batch_size"] = ranges
        decisions.append(f"per-batch K as ranges {ranges}; num_speculative_tokens {top} is the maximum")
        if ctx.schedule_pricing:
            decisions.append(ctx.schedule_pricing["why"])
    elif len(ranges) > 1:
        single = top if block_record and ctx.single_draft_len else ctx.single_draft_len
        runs = f"static K = {single}" if single else "plain serving (the best single D is 0)"
        record = deviation(ctx, [(b, single) for b, _ in ctx.schedule], f"{static_why}: {runs}")
        decisions.append(deviation_text(record))
        if not single:
            return EngineFiles({"serve.sh": _script(serve)}, None, decisions, gates, record)
        config["num_speculative_tokens"] = single
    else:
        decisions.append(f"one K ({top}) for every batch size: no per-batch table needed")
    serve += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    files = {"speculative_config.json": json.dumps(config, indent=2) + "\n", "serve.sh": _script(serve)}
    return EngineFiles(files, config, decisions, gates, record)


def _block_schedule(ctx: ExportContext) -> tuple[list[tuple[int, int]], dict | None]:
    """The schedule vLLM runs, and its deviation record where it differs: vLLM drafts a DFlash block of 1 + K queries,
    so a K shorter than the head's block drafts from a shorter block than this tool's loop measured (the whole block,
    as SGLang and TensorRT-LLM run it); where the profile was measured in the loop, a speculating bucket runs the
    block's K."""
    if not ctx.spelling.vllm.block_of_k or ctx.profile_engine == "vllm":
        return list(ctx.schedule), None
    block = ctx.spelling.drafts_per_block(ctx.head)
    runs = [(b, block if d else 0) for b, d in ctx.schedule]
    if runs == list(ctx.schedule):
        return runs, None
    why = (
        f"vLLM drafts a {ctx.mechanism} block of 1 + K queries (v1/spec_decode/dflash.py), and the profile measured "
        f"the head's whole block: a speculating bucket runs K = {block}, the block's drafts"
    )
    return runs, deviation(ctx, runs, why)


def _static_instead(ctx: ExportContext, version: str, table_gate: dict) -> str | None:
    """Why vLLM gets the plan's best static K instead of its per-batch table, or None where it gets the table."""
    if not table_gate["emitted"]:
        return f"vLLM {version} has no per-batch table (since {table_gate['since']}), so the plan's best single D"
    if ctx.data_parallel > 1:
        return (
            f"vLLM drops a per-batch table with data parallel {ctx.data_parallel} > 1 "
            "(config/vllm.py `_maybe_disable_dynamic_sd_for_data_parallel`), so the plan's best single D"
        )
    if ctx.schedule_pricing and ctx.schedule_pricing["choice"] == "static":
        return ctx.schedule_pricing["why"]
    return None


def _script(argv: list[str]) -> str:
    return (
        "#!/usr/bin/env sh\n# vLLM serve command for this plan; paths in it are relative to the bundle folder;\n"
        "# arguments given to this script follow the plan's (e.g. --port 8001)\n"
        'cd "$(dirname "$0")/.." || exit 1\nexec ' + " ".join(shlex.quote(a) for a in argv) + ' "$@"\n'
    )


def rules(config: dict, version: str) -> list[str]:
    """SpeculativeConfig's own validation of the fields this exporter writes."""
    out = []
    if config.get("prompt_lookup_min", 0) > config.get("prompt_lookup_max", 1 << 30):
        out.append("prompt_lookup_min exceeds prompt_lookup_max")
    ranges = config.get("num_speculative_tokens_per_batch_size")
    if ranges:
        if ranges[0][0] != 1:
            out.append("the first batch-size range must start at 1")
        for (_, hi1, _), (lo2, _, _) in zip(ranges, ranges[1:]):
            if lo2 <= hi1:
                out.append(f"ranges overlap at batch {lo2}")
        out += [f"range [{lo}, {hi}] is empty" for lo, hi, _ in ranges if hi < lo]
        if max(k for *_, k in ranges) > config["num_speculative_tokens"]:
            out.append("a range's K exceeds num_speculative_tokens (vLLM would cap it)")
    return out


register(
    Engine("vllm", "vllm", "speculative_config.json", "vllm-speculative-config.schema.json", render, rules, check_vllm)
)
