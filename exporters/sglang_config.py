"""SGLang: no per-batch table in one server, so one launch per concurrency band (and the adaptive
controller where the algorithm allows it). K is written as steps = K, draft tokens = K+1, topk 1."""

from __future__ import annotations

import json
import shlex

from specdec_tune.exporters.engines import Engine, EngineFiles, ExportContext, register
from specdec_tune.exporters.schedule import to_sglang
from specdec_tune.exporters.versions import gate

def _flags(ctx: ExportContext, k: int) -> list[str]:
    if k == 0:
        return []
    s = ctx.spelling.sglang
    flags = ["--speculative-algorithm", s.algorithm]
    if ctx.drafter_model and not s.lookup:
        flags += ["--speculative-draft-model-path", ctx.drafter_model]
    if s.lookup:
        return flags + ["--speculative-num-draft-tokens", str(k + 1), "--speculative-ngram-max-bfs-breadth", "1"]
    return flags + ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1)]


def render(ctx: ExportContext) -> EngineFiles:
    version = ctx.versions["sglang"]
    decisions, gates = [], []
    s = ctx.spelling.sglang
    if ctx.speculates and s is None:
        decisions.append(f"SGLang has no {ctx.mechanism} speculative algorithm: nothing to launch for this plan")
        doc = {"supported": False, "mechanism": ctx.mechanism, "bands": []}
        return EngineFiles({"bands.json": json.dumps(doc, indent=2) + "\n"}, doc, decisions, gates)
    if ctx.speculates and s.gated:
        gates.append(gate("sglang", f"algorithm:{s.algorithm}", version))
    bands = []
    for lo, hi, k in to_sglang(ctx.schedule):
        argv = ["python", "-m", "sglang.launch_server", "--model-path", ctx.target_model, "--max-running-requests", str(hi), *_flags(ctx, k)]
        bands.append({"min_concurrency": lo, "max_concurrency": hi, "draft_len": k, "argv": argv})
    doc: dict = {"supported": True, "mechanism": ctx.mechanism, "bands": bands}
    decisions.append(f"{len(bands)} concurrency band(s): route each band's traffic to its own server (SGLang has no per-batch table)")
    steps = sorted({k for _, k in ctx.schedule if k > 0})
    g = gate("sglang", "speculative_adaptive", version)
    if s is not None and s.adaptive and len(steps) > 1 and g["emitted"]:
        gates.append(g)
        adaptive = {"candidate_steps": steps}
        doc["adaptive"] = {"argv": ["python", "-m", "sglang.launch_server", "--model-path", ctx.target_model, *_flags(ctx, max(steps)),
                                    "--speculative-adaptive", "--speculative-adaptive-config", json.dumps(adaptive, separators=(",", ":"))],
                           "config": adaptive}
        decisions.append(f"one adaptive server alternative: steps chosen among {steps} by the acceptance EMA (not by batch size)")
    elif len(steps) > 1:
        decisions.append("no adaptive alternative: SGLang's adaptive controller runs EAGLE-family algorithms with topk 1 only")
    script = "#!/usr/bin/env sh\n# SGLang: one server per concurrency band; run the band that matches your load\n"
    for b in bands:
        script += f"# concurrency {b['min_concurrency']}-{b['max_concurrency']}: D = {b['draft_len']}\n# " + " ".join(shlex.quote(a) for a in b["argv"]) + "\n"
    if "adaptive" in doc:
        script += "# adaptive alternative (one server)\n# " + " ".join(shlex.quote(a) for a in doc["adaptive"]["argv"]) + "\n"
    return EngineFiles({"bands.json": json.dumps(doc, indent=2) + "\n", "launch.sh": script}, doc, decisions, gates)


def rules(doc: dict) -> list[str]:
    """Bands cover 1..N without gaps; the steps / draft-tokens / topk triple follows server_args.py."""
    out, expect = [], 1
    for band in doc.get("bands", []):
        if band["min_concurrency"] != expect:
            out.append(f"band starting at {band['min_concurrency']} leaves a gap after {expect - 1}")
        expect = band["max_concurrency"] + 1
        argv, k = band["argv"], band["draft_len"]
        flag = lambda name: argv[argv.index(name) + 1] if name in argv else None  # noqa: E731
        if k and flag("--speculative-num-draft-tokens") != str(k + 1):
            out.append(f"band {band['min_concurrency']}-{band['max_concurrency']}: draft tokens must be K+1 = {k + 1}")
        if k and flag("--speculative-num-steps") not in (None, str(k)):
            out.append(f"band {band['min_concurrency']}-{band['max_concurrency']}: steps must be K = {k}")
        if flag("--speculative-num-steps") is not None and flag("--speculative-eagle-topk") != "1":
            out.append("topk must be 1 for a linear draft")
    return out


register(Engine("sglang", "sglang", "bands.json", "sglang-bands.schema.json", render, rules))
