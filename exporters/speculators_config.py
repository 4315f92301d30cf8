"""speculators: `config.json` for learned drafters (EAGLE-3, MTP, DFlash, DSpark), so that
`vllm serve <drafter folder>` finds the algorithm, the default K and the verifier."""

from __future__ import annotations

import json
from pathlib import Path

from specdec_tune.exporters.engines import Engine, EngineFiles, ExportContext, register

MODEL_TYPES = {"eagle3": ("eagle3", "Eagle3Speculator"), "mtp": ("mtp", "MTPDraftModel"),
               "dflash": ("dflash", "DFlashSpeculator"), "dspark": ("dspark", "DSparkSpeculator")}
ALGORITHM_FIELDS = ("draft_vocab_size", "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "block_size",
                    "aux_hidden_state_layer_ids", "mask_token_id", "sample_from_anchor", "markov_rank", "markov_head_type",
                    "enable_confidence_head", "confidence_head_with_markov",
                    "num_nextn_predict_layers", "transformer_layer_config")


def head_fields(options: dict) -> dict:
    """The algorithm fields of the head a drafter's options name: the options themselves, completed from the head
    folder's own config.json (`model=`; JSON only) for what they do not give (draft vocabulary, layer ids, block)."""
    folder = options.get("model")
    try:
        own = json.loads((Path(folder) / "config.json").read_text()) if folder else {}
    except (OSError, ValueError):
        own = {}
    own = own if isinstance(own, dict) else {}
    return {k: options.get(k, own.get(k)) for k in ALGORITHM_FIELDS if k in options or k in own}


def config_for(ctx: ExportContext) -> dict:
    model_type, architecture = MODEL_TYPES[ctx.mechanism]
    options = head_fields(ctx.drafter.get("options", {}))
    return {
        "speculators_model_type": model_type, "architectures": [architecture], "speculators_version": ctx.versions["speculators"],
        **{k: options[k] for k in ALGORITHM_FIELDS if k in options},
        "transformer_layer_config": options.get("transformer_layer_config", {}),
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": max(ctx.max_draft_len, 1), "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": ctx.target_model, "architectures": [ctx.plan["profile"]["target"].get("arch", "llama").capitalize() + "ForCausalLM"]},
        },
    }


def render(ctx: ExportContext) -> EngineFiles:
    if ctx.mechanism not in MODEL_TYPES:
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
