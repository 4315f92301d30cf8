"""The speculators checkpoint layout's `config.json`: how a learned head (EAGLE-3, MTP, DFlash, DSpark) names its
algorithm, its own fields, its default K and its verifier, so that `vllm serve <head folder>` and speculators'
own classes load it. The trainer writes it beside the weights; the bundle exporter writes it for the plan."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_VERSION = (
    "0.9.0"  # the speculators release the layout follows (and its configs are checked with) where none is installed
)

MODEL_TYPES = {
    "eagle3": ("eagle3", "Eagle3Speculator"),
    "mtp": ("mtp", "MTPDraftModel"),
    "dflash": ("dflash", "DFlashSpeculator"),
    "dspark": ("dspark", "DSparkSpeculator"),
}
ALGORITHM_FIELDS = (
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "block_size",
    "aux_hidden_state_layer_ids",
    "mask_token_id",
    "sample_from_anchor",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "num_nextn_predict_layers",
    "transformer_layer_config",
)


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


def config_json(
    mechanism: str,
    fields: dict,
    *,
    speculative_tokens: int,
    verifier: str,
    verifier_architectures: list[str],
    version: str,
) -> dict:
    """config.json for a head with these algorithm fields (see `head_fields`), proposing `speculative_tokens` greedily.
    `verifier_architectures` is the target's own config.json `architectures` (never derived from its model type)."""
    model_type, architecture = MODEL_TYPES[mechanism]
    return {
        "speculators_model_type": model_type,
        "architectures": [architecture],
        "speculators_version": version,
        **{k: fields[k] for k in ALGORITHM_FIELDS if k in fields},
        "transformer_layer_config": fields.get("transformer_layer_config", {}),
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": max(speculative_tokens, 1),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
