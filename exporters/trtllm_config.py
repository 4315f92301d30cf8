"""TensorRT-LLM (PyTorch backend): the YAML for `trtllm-serve M --config cfg.yaml` (or `LLM(**yaml)`)."""

from __future__ import annotations

import yaml

from specdec_tune.exporters.engines import (
    Engine,
    EngineFiles,
    ExportContext,
    deviation,
    deviation_text,
    register,
    without_head,
)
from specdec_tune.exporters.schedule import bands, to_trtllm, to_trtllm_lower
from specdec_tune.exporters.versions import gate, rules_line


def _mechanism_fields(ctx: ExportContext) -> dict:
    t = ctx.spelling.trtllm
    fields = t.fields(ctx.drafter.get("options", {}) | ctx.head)
    model = ctx.checkpoint_for("trtllm")
    return fields | ({"speculative_model": model} if ctx.spelling.checkpoint and model else {})


# Above the largest draft_len_schedule key: in 1.3rc K = 0 (PR #16888, unreleased, would floor one-engine modes at 1,
# vanilla MTP opting out); in 1.2 the largest key's K carries upward. Bundles follow the line of the version targeted.
ABOVE_LAST_KEY = {
    "1.2": "keys are lower batch bounds (TensorRT-LLM 1.2: batch >= key); the last key's K holds up to max_batch_size",
    "1.3rc": "keys are inclusive batch upper bounds; above the last key K = 0 (1.3rc; PR #16888, unreleased, "
    "would floor one-engine modes at 1)",
}


def render(ctx: ExportContext) -> EngineFiles:
    version = ctx.versions["trtllm"]
    line = rules_line("trtllm", version).name
    decisions: list[str] = []
    gates: list[dict] = []
    config: dict = {"max_batch_size": ctx.max_batch}
    memory = ctx.memory
    if memory:
        config["kv_cache_config"] = {"free_gpu_memory_fraction": memory["free_gpu_memory_fraction"]}
        decisions.append(
            f"kv_cache_config.free_gpu_memory_fraction {memory['free_gpu_memory_fraction']:g}: the plan's "
            f"{memory['gpu_memory_utilization']:g} of the device as a share of the memory left after weights and "
            f"activations; max_batch_size {ctx.max_batch} fits at its D"
        )
    if not ctx.speculates:
        decisions.append("the plan speculates at no batch size: no speculative_config")
        return EngineFiles({"config.yaml": _dump(config)}, config, decisions, gates)
    plain = without_head(ctx, "trtllm")
    if plain:
        decisions += [deviation_text(plain), "no speculative_config: plain serving"]
        return EngineFiles({"config.yaml": _dump(config)}, config, decisions, gates, plain)
    t = ctx.spelling.trtllm
    gates.append(gate("trtllm", f"decoding_type:{t.decoding_type}", version))
    spelled = t.spelling(line)
    if t.note:
        decisions.append(t.note)
    decisions += [text for on, text in t.unverified if on == line]
    per_batch = len(bands(ctx.schedule)) > 1 or ctx.schedule[-1][0] < ctx.max_batch  # a real schedule
    static: int | None = None
    why: str | None = None
    if spelled is None:
        static, why = (
            0,
            f"TensorRT-LLM {version} has no {t.decoding_type} decoding (since {gates[-1]['since']}): plain serving",
        )
    elif t.fixed_block:
        static = int(ctx.head["block_size"])
        why = (
            f"{spelled[0]} drafts its checkpoint's block at every batch size (max_draft_len must equal block_size "
            f"{static})"
        )
    elif per_batch and line not in t.honours_schedule:
        static = ctx.single_draft_len
        why = (
            f"{spelled[0]} keeps one draft length in TensorRT-LLM {version}: static D = {static}, the plan's best "
            "single D"
        )
    graph_sizes = sorted({b for b, _ in ctx.schedule if b <= ctx.max_batch})
    deviation_record = None
    if static is not None:
        assert why is not None  # each branch that sets a static D says why
        runs = [(b, static) for b, _ in ctx.schedule]
        if runs != list(ctx.schedule):
            deviation_record = deviation(ctx, runs, why)
            decisions.append(deviation_text(deviation_record))
        if static == 0:
            decisions.append("no speculative_config: plain serving")
            return EngineFiles({"config.yaml": _dump(config)}, config, decisions, gates, deviation_record)
    assert spelled is not None  # a line without the mode serves plainly (static 0): returned above
    decoding_type, fixed, draft_len_field = spelled
    spec = {
        "decoding_type": decoding_type,
        draft_len_field: static or ctx.max_draft_len,
        **fixed,
        **_mechanism_fields(ctx),
    }
    if static is None and per_batch:
        table = to_trtllm_lower(ctx.schedule) if line == "1.2" else to_trtllm(ctx.schedule)
        spec["draft_len_schedule"] = table
        graph_sizes = sorted(set(graph_sizes) | set(table))
        decisions.append(f"draft_len_schedule {table} ({ABOVE_LAST_KEY[line]})")
    config["speculative_config"] = spec
    config["cuda_graph_config"] = {"enable_padding": True, "batch_sizes": graph_sizes}
    if t.disable_overlap_scheduler:
        config["disable_overlap_scheduler"] = True
    decisions.append(f"CUDA graphs captured at batch sizes {graph_sizes}")
    return EngineFiles({"config.yaml": _dump(config)}, config, decisions, gates, deviation_record)


def rules(config: dict, version: str) -> list[str]:
    """llm_args.py's validation of draft_len_schedule in the version's line, and the CUDA graphs the schedule needs."""
    spec = config.get("speculative_config")
    out: list[str] = []
    if not spec or "draft_len_schedule" not in spec:
        return out
    table = {int(k): v for k, v in spec["draft_len_schedule"].items()}
    first = 1 if rules_line("trtllm", version).name == "1.2" else min(table)
    max_draft_len = spec.get("max_draft_len", spec.get("num_nextn_predict_layers"))
    if first not in table:
        out.append("draft_len_schedule must include batch_size=1 (TensorRT-LLM 1.2)")
    elif table[first] != max_draft_len:
        out.append(f"the value at draft_len_schedule key {first} must equal max_draft_len")
    if any(v > max_draft_len for v in table.values()):
        out.append("a draft_len_schedule value exceeds max_draft_len")
    graphs = set(config.get("cuda_graph_config", {}).get("batch_sizes", []))
    if not set(table) <= graphs:
        out.append(f"CUDA-graph batch sizes {sorted(graphs)} miss schedule keys {sorted(set(table) - graphs)}")
    return out


def _dump(config: dict) -> str:
    return "# trtllm-serve <model> --config config.yaml\n" + yaml.safe_dump(config, sort_keys=False)


register(Engine("trtllm", "trtllm", "config.yaml", "trtllm-config.schema.json", render, rules))
