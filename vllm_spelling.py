"""How vLLM names each mechanism: `speculative_config.method` and the method's own fields.

Read by two stages: the vllm measurement backend (profiles/), which runs each mechanism inside vLLM, and the vLLM
exporter (exporters/), which writes the bundle's config; one table, so that what was measured is what is shipped.
Field names follow vllm/config/speculative.py at 0.32 (exporters/versions.py cites the engines' sources).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specdec_tune import SpecdecError


def _no_fields(options: dict) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Vllm:
    method: str
    fields: Callable[[dict], dict] = (
        _no_fields  # the method's own fields, from the drafter's options and its head's config
    )
    extra: tuple[tuple[str, object], ...] = ()  # fixed fields
    # KV slots per request vLLM reserves for num_speculative_tokens k, given the head's config fields (0.32's
    # VllmConfig.num_lookahead_tokens)
    lookahead: Callable[[int, dict], int] = lambda k, head: 0
    needs_head: bool = False  # runs a trained head's checkpoint, which `model` must name
    # runs a drafter forward at K = 0 before it returns an empty draft (0.32's SpecDecodeBaseProposer.propose)
    forward_at_k0: bool = False
    # drafts one block of 1 + K queries (v1/spec_decode/dflash.py set_inputs_first_pass): K sets the block's length,
    # where this tool's loop and the other engines run the head's whole block
    block_of_k: bool = False
    # runs on the V2 model runner only (config/vllm.py: "DSpark is implemented only by the V2 GPU model runner"),
    # which keeps full CUDA graphs with a per-batch table
    v2_runner: bool = False


def number_option(o: dict, key: str, default: float, kind: type = int) -> float:
    """A drafter's numeric option as `kind`, `default` where it has none; a value that is not one is refused."""
    value = o.get(key, default)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise SpecdecError(
            f"drafter option {key}={value!r} is not a {kind.__name__}",
            "fix the drafter's options in profile.json, or profile again",
        ) from None


def _ngram(o: dict) -> dict:
    return {
        "prompt_lookup_min": number_option(o, "prompt_lookup_min", 5),
        "prompt_lookup_max": number_option(o, "prompt_lookup_max", 5),
    }


def _suffix(o: dict) -> dict:
    return {
        "suffix_decoding_max_tree_depth": number_option(o, "max_tree_depth", 24),
        "suffix_decoding_max_spec_factor": number_option(o, "max_spec_factor", 1.0, float),
        "suffix_decoding_min_token_prob": number_option(o, "min_token_prob", 0.1, float),
    }


VLLM: dict[str, Vllm] = {
    "ngram": Vllm("ngram", _ngram),
    "suffix": Vllm("suffix", _suffix),
    "draft_model": Vllm(
        "draft_model", extra=(("draft_tensor_parallel_size", 1),), lookahead=lambda k, head: k, forward_at_k0=True
    ),
    "eagle3": Vllm("eagle3", lookahead=lambda k, head: k, needs_head=True, forward_at_k0=True),
    "mtp": Vllm("mtp", lookahead=lambda k, head: k, needs_head=True, forward_at_k0=True),
    "dflash": Vllm(  # a bonus query plus one per draft
        "dflash", lookahead=lambda k, head: k + 1, needs_head=True, forward_at_k0=True, block_of_k=True
    ),
    # anchor sampling drafts from the anchor, no bonus query; without it DSpark fills in as DFlash does
    "dspark": Vllm(
        "dspark",
        lookahead=lambda k, head: k if head["sample_from_anchor"] else k + 1,
        needs_head=True,
        forward_at_k0=True,
        v2_runner=True,
    ),
}


def speculative_config(
    mechanism: str, draft_len: int, options: dict, model: str | None = None, quantization: str | None = None
) -> dict:
    """vLLM's `speculative_config` running `mechanism` at one draft length (a checkpoint's folder as `model`)."""
    v = VLLM[mechanism]
    config = {"method": v.method, "num_speculative_tokens": draft_len, **v.fields(options)}
    if model:
        config |= {"model": model, **dict(v.extra)}
        if quantization:
            config["quantization"] = quantization
    return config
