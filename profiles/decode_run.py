"""One measured decoding run over calibration prompts: what `specdec-tune decode` reports."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.calibration import select_prompts
from specdec_tune.profiles.drafters import available, create
from specdec_tune.profiles.models.loading import LoadedModel, load_model
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.profiles.train_drafter import cached_demo_head  # noqa: F401  (registers it: head drafters without model= load it)
from specdec_tune.progress import Progress
from specdec_tune.settings import DecodeSettings


def decode_prompts(
    target: LoadedModel, token_ids: list[list[int]], batch_size: int, progress: Progress | None = None, **kwargs
):
    """`generate` over consecutive batches; returns (tokens per prompt, counters per prompt, decode seconds). Each
    batch is a unit of `progress`'s "decode" phase."""
    tokens, counters, seconds = [], [], 0.0
    for start in range(0, len(token_ids), batch_size):
        out = generate(target.model, token_ids[start : start + batch_size], **kwargs)
        tokens += out.tokens
        counters += out.per_prompt
        seconds += out.total_s
        if progress is not None:
            done = min(start + batch_size, len(token_ids))
            progress.tick("decode", done, len(token_ids), f"{done} of {len(token_ids)} prompts")
    return tokens, counters, seconds


def run(settings: DecodeSettings, progress: Progress | None = None) -> dict:
    settings.validate()
    if settings.drafter is not None and settings.drafter not in available():  # before the target loads
        raise SpecdecError(
            f"unknown drafter mechanism {settings.drafter!r}", f"choose one of: {', '.join(available())}"
        )
    torch.manual_seed(settings.seed)
    dtype = (
        "float32" if settings.check_lossless else settings.dtype
    )  # losslessness is a property of the algorithm: check it in fp32
    target = load_model(settings.target, dtype=dtype, trust_remote_code=settings.trust_remote_code)
    drafter = create(settings.drafter, target, settings.drafter_options) if settings.drafter else None
    chosen = select_prompts(settings.prompts, settings.split, settings.num_prompts)
    D = settings.num_draft_tokens if drafter else 0
    ids = encode_prompts(
        target.tokenizer,
        chosen,
        context_tokens=target.model.config.max_position_embeddings,
        max_new_tokens=settings.max_new_tokens,
        max_draft_tokens=D,
    )
    assert target.tokenizer is not None  # encode_prompts raised otherwise
    stop = list(target.model.config.eos_token_ids) or (
        [target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []
    )
    kwargs: dict[str, Any] = dict(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        seed=settings.seed,
        stop_token_ids=stop,
    )
    tokens, counters, seconds = decode_prompts(
        target, ids, settings.batch_size, progress, drafter=drafter, num_draft_tokens=D, **kwargs
    )

    by_domain: dict[str, list[int]] = {}
    for i, p in enumerate(chosen.prompts):
        by_domain.setdefault(p.domain, []).append(i)
    result = {
        "source": "measured",
        "target": dataclasses.asdict(target.ref),
        "drafter": settings.drafter,
        "drafter_settings": drafter.describe() if drafter else None,
        "num_draft_tokens": D,
        "batch_size": settings.batch_size,
        "temperature": settings.temperature,
        "prompts": chosen.name,
        "all": summarize(counters, len(chosen), sum(len(t) for t in tokens), seconds),
        "per_domain": {
            d: summarize([counters[i] for i in idx], len(idx), sum(len(tokens[i]) for i in idx), None)
            for d, idx in by_domain.items()
        },
    }
    if settings.check_lossless:
        plain, _, _ = decode_prompts(target, ids, settings.batch_size, **kwargs)
        same = sum(a == b for a, b in zip(tokens, plain))
        result["lossless"] = {"prompts": len(ids), "identical_prompts": same}
        if same != len(ids):
            first = next(chosen.prompts[i].id for i, (a, b) in enumerate(zip(tokens, plain)) if a != b)
            raise SpecdecError(
                f"speculative output differs from plain greedy output on {len(ids) - same} prompts (first: {first})",
                "this is a bug in the drafter or the loop; rerun with --debug and report it",
            )
    return result


def summarize(counters: list[SpecCounters], prompts: int, tokens: int, seconds: float | None) -> dict:
    c = SpecCounters.total(counters)
    return {
        "prompts": prompts,
        "num_drafts": c.num_drafts,
        "num_draft_tokens": c.num_draft_tokens,
        "num_accepted_tokens": c.num_accepted_tokens,
        "num_accepted_tokens_per_pos": c.num_accepted_tokens_per_pos,
        "num_rounds": c.num_rounds,
        "num_emitted_tokens": c.num_emitted_tokens,
        "mean_acceptance_length": c.mean_acceptance_length,
        "tokens_per_target_forward": c.tokens_per_target_forward,
        "acceptance_rate": c.num_accepted_tokens / c.num_draft_tokens if c.num_draft_tokens else 0.0,
        "conditional_acceptance": c.conditional_acceptance(),
        "tokens_per_s": tokens / seconds if seconds else None,
    }
