"""speculators: `config.json` for learned drafters (EAGLE-3, MTP, DFlash, DSpark), so that
`vllm serve <drafter folder>` finds the algorithm, the default K and the verifier."""

from __future__ import annotations

import json

from specdec_tune.exporters.engines import Engine, EngineFiles, ExportContext, register
from specdec_tune.exporters.mechanisms import MECHANISMS
from specdec_tune.exporters.native_checks import check_speculators
from specdec_tune.profiles.drafters.speculators_layout import config_json


def config_for(ctx: ExportContext) -> dict:
    """The head's own fields (its layer config included) and the target's own `architectures` as the verifier's."""
    return config_json(
        ctx.mechanism,
        ctx.head,
        speculative_tokens=ctx.max_draft_len,
        verifier=ctx.target_model,
        verifier_architectures=list(ctx.target_architectures),
        version=ctx.versions["speculators"],
    )


def render(ctx: ExportContext) -> EngineFiles:
    if not ctx.spelling.learned_head:
        return EngineFiles({}, None, [f"{ctx.mechanism} is not a learned drafter: no speculators config"], [])
    if not ctx.speculates:
        return EngineFiles({}, None, ["the plan speculates at no batch size: no speculators config"], [])
    config = config_for(ctx)
    return EngineFiles(
        {"config.json": json.dumps(config, indent=2) + "\n"},
        config,
        [
            "speculators carries one default K (the plan's maximum) and the verifier; the schedule lives in the engine "
            "configs",
            *(
                f"{field} = {json.dumps(ctx.head[field])} written explicitly (default in {whose})"
                for field, _, whose in ctx.spelling.head_defaults
                if field in ctx.head
            ),
        ],
        [],
    )


def rules(config: dict, version: str) -> list[str]:
    sc, out = config["speculators_config"], []
    if sc["default_proposal_method"] not in {m["proposal_type"] for m in sc["proposal_methods"]}:
        out.append("default_proposal_method matches no proposal method")
    if not sc["verifier"].get("architectures"):
        out.append("verifier.architectures is empty")
    spelling = MECHANISMS.get(config["speculators_model_type"])
    needs = spelling.needs if spelling else ()
    return out + [
        f"{field} is missing or empty ({engine} needs it)"
        for field, engine in needs
        if config.get(field) in (None, {}, [])
    ]


register(
    Engine(
        "speculators", "speculators", "config.json", "speculators-config.schema.json", render, rules, check_speculators
    )
)
