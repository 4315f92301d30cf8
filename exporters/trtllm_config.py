"""TensorRT-LLM (PyTorch backend): the YAML for `trtllm-serve M --config cfg.yaml` (or `LLM(**yaml)`)."""

from __future__ import annotations

import yaml

from specdec_tune.exporters.engines import Engine, EngineFiles, ExportContext, register
from specdec_tune.exporters.schedule import to_trtllm
from specdec_tune.exporters.versions import gate

def _mechanism_fields(ctx: ExportContext) -> dict:
    t = ctx.spelling.trtllm
    fields = t.fields(ctx.drafter.get("options", {}))
    return fields | ({"speculative_model": ctx.drafter_model} if ctx.spelling.checkpoint and ctx.drafter_model else {})


def render(ctx: ExportContext) -> EngineFiles:
    version = ctx.versions["trtllm"]
    decisions, gates = [], []
    config: dict = {"max_batch_size": ctx.max_batch}
    if not ctx.speculates:
        decisions.append("the plan speculates at no batch size: no speculative_config")
        return EngineFiles({"config.yaml": _dump(config)}, config, decisions, gates)
    t = ctx.spelling.trtllm
    decoding_type = t.decoding_type  # llm_args.py's discriminator literal (the docs' "DraftTarget" is not one)
    gates.append(gate("trtllm", f"decoding_type:{decoding_type}", version))
    spec = {"decoding_type": decoding_type, "max_draft_len": ctx.max_draft_len, **_mechanism_fields(ctx)}
    if t.note:
        decisions.append(t.note)
    table = to_trtllm(ctx.schedule)
    g = gate("trtllm", "draft_len_schedule", version)
    gates.append(g)
    graph_sizes = sorted({b for b, _ in ctx.schedule if b <= ctx.max_batch})
    if len(table) > 1 or max(table) < ctx.max_batch:  # a real schedule (or speculation off above some batch)
        if not t.honours_schedule:
            decisions.append(f"{decoding_type} cannot change its draft length at run time: static max_draft_len {ctx.max_draft_len}")
        elif g["emitted"]:
            spec["draft_len_schedule"] = table
            graph_sizes = sorted(set(graph_sizes) | set(table))
            decisions.append(f"draft_len_schedule {table} (keys are inclusive batch upper bounds; above {max(table)} speculation is off)")
        else:
            spec["max_draft_len"] = max(ctx.plan["single_draft_len"]["draft_len"], 1)
            decisions.append(f"TensorRT-LLM {version} has no draft_len_schedule (since {g['since']}): static max_draft_len = the plan's best single D")
    config["speculative_config"] = spec
    config["cuda_graph_config"] = {"enable_padding": True, "batch_sizes": graph_sizes}
    if t.disable_overlap_scheduler:
        config["disable_overlap_scheduler"] = True
    decisions.append(f"CUDA graphs captured at batch sizes {graph_sizes}")
    return EngineFiles({"config.yaml": _dump(config)}, config, decisions, gates)


def rules(config: dict) -> list[str]:
    """llm_args.py's validation of draft_len_schedule, and the CUDA graphs the schedule needs."""
    spec, out = config.get("speculative_config"), []
    if not spec or "draft_len_schedule" not in spec:
        return out
    table = {int(k): v for k, v in spec["draft_len_schedule"].items()}
    if table[min(table)] != spec["max_draft_len"]:
        out.append("the value at the smallest draft_len_schedule key must equal max_draft_len")
    if any(v > spec["max_draft_len"] for v in table.values()):
        out.append("a draft_len_schedule value exceeds max_draft_len")
    graphs = set(config.get("cuda_graph_config", {}).get("batch_sizes", []))
    if not set(table) <= graphs:
        out.append(f"CUDA-graph batch sizes {sorted(graphs)} miss schedule keys {sorted(set(table) - graphs)}")
    return out


def _dump(config: dict) -> str:
    return "# trtllm-serve <model> --config config.yaml\n" + yaml.safe_dump(config, sort_keys=False)


register(Engine("trtllm", "trtllm", "config.yaml", "trtllm-config.schema.json", render, rules))
