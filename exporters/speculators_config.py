"""speculators: `config.json` for learned drafters (EAGLE-3, MTP, DFlash, DSpark), so that
`vllm serve <drafter folder>` finds the algorithm, the default K and the verifier."""

from __future__ import annotations

import json

from specdec_tune.exporters.engines import Engine, EngineFiles, ExportContext, register
from specdec_tune.profiles.drafters.speculators_layout import config_json


def config_for(ctx: ExportContext) -> dict:
    return config_json(ctx.mechanism, ctx.drafter.get("options", {}), speculative_tokens=ctx.max_draft_len, verifier=ctx.target_model,
                       verifier_arch=ctx.plan["profile"]["target"].get("arch", "llama"), version=ctx.versions["speculators"])


def render(ctx: ExportContext) -> EngineFiles:
    if not ctx.spelling.learned_head:
        return EngineFiles({}, None, [f"{ctx.mechanism} is not a learned drafter: no speculators config"], [])
    config = config_for(ctx)
    return EngineFiles({"config.json": json.dumps(config, indent=2) + "\n"}, config,
                       ["speculators carries one default K (the plan's maximum) and the verifier; the schedule lives in the engine configs"], [])


def rules(config: dict) -> list[str]:
    sc = config["speculators_config"]
    if sc["default_proposal_method"] not in {m["proposal_type"] for m in sc["proposal_methods"]}:
        return ["default_proposal_method matches no proposal method"]
    return []


register(Engine("speculators", "speculators", "config.json", "speculators-config.schema.json", render, rules))
