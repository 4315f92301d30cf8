"""Turning calibration prompts into the token ids a served model would see."""

from __future__ import annotations

from specdec_tune import SpecdecError
from specdec_tune.profiles.calibration import CalibrationSet


def encode_fitting(tokenizer, prompts: CalibrationSet, *, context_tokens: int, max_new_tokens: int, max_draft_tokens: int) -> dict[str, list[int]]:
    """Token ids of the prompts that fit the context with the generation, by prompt id (the others are left out)."""
    out = {}
    for p in prompts:
        try:
            [ids] = encode_prompts(tokenizer, CalibrationSet("one", (p,)), context_tokens=context_tokens, max_new_tokens=max_new_tokens,
                                   max_draft_tokens=max_draft_tokens)
        except SpecdecError:
            continue
        out[p.id] = ids
    return out


def encode_prompts(tokenizer, prompts: CalibrationSet, *, chat: bool = True, context_tokens: int, max_new_tokens: int, max_draft_tokens: int = 0) -> list[list[int]]:
    """Token ids per prompt: the chat template's user turn when the tokenizer has one, else raw text.

    A prompt that leaves no room for `max_new_tokens` plus one round's draft within `context_tokens` is refused.
    """
    if tokenizer is None:
        raise SpecdecError("the target has no tokenizer", "give a model folder that includes its tokenizer files")
    use_chat = chat and getattr(tokenizer, "chat_template", None)
    out = []
    for p in prompts:
        if use_chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(p.text)["input_ids"]
        ids = list(ids)
        if not ids:
            raise SpecdecError(f"prompt {p.id} encodes to no tokens", "drop it from the calibration file")
        if len(ids) + max_new_tokens + max_draft_tokens + 1 > context_tokens:
            raise SpecdecError(
                f"prompt {p.id} has {len(ids)} tokens; with {max_new_tokens} new ones it exceeds the {context_tokens}-token context",
                "shorten the prompt or generate fewer new tokens (--new-tokens, --max-new-tokens)",
            )
        out.append(ids)
    return out
