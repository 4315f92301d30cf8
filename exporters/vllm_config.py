"""vLLM: `speculative_config` for `vllm serve --speculative-config` / `LLM(speculative_config=...)`."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys

from specdec_tune.exporters.engines import Engine, EngineFiles, ExportContext, register
from specdec_tune.exporters.mechanisms import by_vllm_method
from specdec_tune.exporters.schedule import to_vllm
from specdec_tune.exporters.versions import gate

def _mechanism_fields(ctx: ExportContext) -> dict:
    v = ctx.spelling.vllm
    fields = v.fields(ctx.drafter.get("options", {}))
    if not ctx.spelling.checkpoint:
        return fields
    fields |= {"model": ctx.drafter_model} if ctx.drafter_model else {}
    fields |= dict(v.extra)
    if ctx.quant == "fp8":
        fields["quantization"] = "fp8"
    return fields


def render(ctx: ExportContext) -> EngineFiles:
    version = ctx.versions["vllm"]
    decisions, gates = [], []
    serve = ["vllm", "serve", ctx.target_model, "--max-num-seqs", str(ctx.max_batch)]
    if not ctx.speculates:
        decisions.append("the plan speculates at no batch size: no speculative_config")
        return EngineFiles({"serve.sh": _script(serve)}, None, decisions, gates)
    method = ctx.spelling.vllm.method
    g = gate("vllm", f"method:{method}", version)
    gates.append(g)
    config = {"method": method, "num_speculative_tokens": ctx.max_draft_len, **_mechanism_fields(ctx)}
    if not g["emitted"]:
        decisions.append(f"vLLM {version} predates method {config['method']!r} (since {g['since']}): the config needs a newer vLLM")
    ranges = to_vllm(ctx.schedule)
    g = gate("vllm", "num_speculative_tokens_per_batch_size", version)
    gates.append(g)
    if len(ranges) > 1 and g["emitted"]:
        config["num_speculative_tokens_per_batch_size"] = ranges
        decisions.append(f"per-batch K as ranges {ranges}; num_speculative_tokens {ctx.max_draft_len} is the maximum")
    elif len(ranges) > 1:
        single = ctx.plan["single_draft_len"]["draft_len"]
        config["num_speculative_tokens"] = max(single, 1)
        decisions.append(f"vLLM {version} has no per-batch table (since {g['since']}): static K = {max(single, 1)}, the plan's best single D")
    else:
        decisions.append(f"one K ({ctx.max_draft_len}) for every batch size: no per-batch table needed")
    serve += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    files = {"speculative_config.json": json.dumps(config, indent=2) + "\n", "serve.sh": _script(serve)}
    return EngineFiles(files, config, decisions, gates)


def _script(argv: list[str]) -> str:
    return "#!/usr/bin/env sh\n# vLLM serve command for this plan\nexec " + " ".join(shlex.quote(a) for a in argv) + "\n"


def rules(config: dict) -> list[str]:
    """SpeculativeConfig's own validation of the fields this exporter writes."""
    out = []
    if config.get("prompt_lookup_min", 0) > config.get("prompt_lookup_max", 1 << 30):
        out.append("prompt_lookup_min exceeds prompt_lookup_max")
    ranges = config.get("num_speculative_tokens_per_batch_size")
    if ranges:
        if ranges[0][0] != 1:
            out.append("the first batch-size range must start at 1")
        for (lo1, hi1, _), (lo2, _, _) in zip(ranges, ranges[1:]):
            if lo2 <= hi1:
                out.append(f"ranges overlap at batch {lo2}")
        out += [f"range [{lo}, {hi}] is empty" for lo, hi, _ in ranges if hi < lo]
        if max(k for *_, k in ranges) > config["num_speculative_tokens"]:
            out.append("a range's K exceeds num_speculative_tokens (vLLM would cap it)")
    return out


# Run with the vLLM interpreter: build SpeculativeConfig where it needs no model, else check the field names.
_NATIVE_CHECK = """
import json, sys
from vllm.config import SpeculativeConfig
config = json.loads(sys.argv[1])
fields = set(getattr(SpeculativeConfig, "__pydantic_fields__", None) or getattr(SpeculativeConfig, "__dataclass_fields__", {}))
unknown = sorted(set(config) - fields)
if unknown:
    sys.exit(f"fields vLLM does not know: {unknown}")
if sys.argv[2] == "build":  # suffix needs arctic-inference, the others their checkpoints
    SpeculativeConfig(**config)
"""


def native_check(config: dict) -> str:
    """vLLM's own SpeculativeConfig: in this interpreter where vLLM imports, else in the one named by
    SPECDEC_TUNE_VLLM_PYTHON (vLLM's CPU build lives in its own virtualenv). Methods that need their
    draft checkpoint are checked by field name only."""
    python = sys.executable if importlib.util.find_spec("vllm") else os.environ.get("SPECDEC_TUNE_VLLM_PYTHON")
    if not python:
        raise ImportError("vllm")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    spelling = by_vllm_method(config.get("method"))
    build = spelling is not None and spelling.vllm.builds_here
    done = subprocess.run([python, "-c", _NATIVE_CHECK, json.dumps(config), "build" if build else "names"], capture_output=True, text=True,
                          timeout=600, env=env)
    if done.returncode:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ValueError(lines[-1] if lines else f"exit {done.returncode}")
    built = "built" if build else "field names checked"
    return f"vLLM's SpeculativeConfig ({built}, {python})"


register(Engine("vllm", "vllm", "speculative_config.json", "vllm-speculative-config.schema.json", render, rules, native_check))
