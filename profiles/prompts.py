"""Turning calibration prompts into the token ids a served model would see."""

from __future__ import annotations

from specdec_tune import SpecdecError
from specdec_tune.profiles.calibration import CalibrationSet, select_prompts


def encode_fitting(
    tokenizer, prompts: CalibrationSet, *, context_tokens: int, max_new_tokens: int, max_draft_tokens: int
) -> dict[str, list[int]]:
    """Token ids of the prompts that fit the context with the generation, by prompt id (the others are left out)."""
    out = {}
    for p in prompts:
        try:
            [ids] = encode_prompts(
                tokenizer,
                CalibrationSet("one", (p,)),
                context_tokens=context_tokens,
                max_new_tokens=max_new_tokens,
                max_draft_tokens=max_draft_tokens,
            )
        except SpecdecError:
            continue
        out[p.id] = ids
    return out


def encode_prompts(
    tokenizer,
    prompts: CalibrationSet,
    *,
    chat: bool = True,
    context_tokens: int,
    max_new_tokens: int,
    max_draft_tokens: int = 0,
) -> list[list[int]]:
    """Token ids per prompt: the chat template over the prompt's turns and its user turn when the tokenizer has one
    (as the serving engine renders a chat request), else the turns' texts and the prompt's, one paragraph each.

    A prompt that leaves no room for `max_new_tokens` plus one round's draft within `context_tokens` is refused.
    """
    if tokenizer is None:
        raise SpecdecError("the target has no tokenizer", "give a model folder that includes its tokenizer files")
    use_chat = chat and getattr(tokenizer, "chat_template", None)
    out = []
    for p in prompts:
        if use_chat:
            messages = [{"role": role, "content": text} for role, text in p.turns]
            ids = tokenizer.apply_chat_template(
                messages + [{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer("\n\n".join([text for _, text in p.turns] + [p.text]))["input_ids"]
        ids = list(ids)
        if not ids:
            raise SpecdecError(f"prompt {p.id} encodes to no tokens", "drop it from the calibration file")
        if len(ids) + max_new_tokens + max_draft_tokens + 1 > context_tokens:
            raise SpecdecError(
                f"prompt {p.id} has {len(ids)} tokens; with {max_new_tokens} new ones it exceeds the "
                f"{context_tokens}-token context",
                "shorten the prompt or generate fewer new tokens (--new-tokens, --max-new-tokens)",
            )
        out.append(ids)
    return out


def prompts_by_domain(
    tokenizer, context_tokens: int, n: int, new_tokens: int, max_draft: int, split: str, spec: str = "default"
) -> list[tuple[list[int], str]]:
    """(token ids, domain) of the first n prompts of a calibration set's split (`spec`, as `--prompts` takes it)."""
    chosen = select_prompts(spec, split, n)
    ids = encode_prompts(
        tokenizer, chosen, context_tokens=context_tokens, max_new_tokens=new_tokens, max_draft_tokens=max_draft
    )
    return list(zip(ids, [p.domain for p in chosen.prompts]))


def cut_length(ctx: int, new_tokens: int) -> int:
    """Tokens a prompt keeps when cut to context `ctx` for a decode of `new_tokens` (`cut_to_context`): the KV cache
    then averages `ctx` over the decode."""
    return max(1, ctx - new_tokens // 2)


def cut_to_context(
    prompts: list[tuple[list[int], str]], ctx: int, new_tokens: int, whole: bool = False
) -> list[tuple[list[int], str]]:
    """The prompts of a decode at context `ctx`: each long enough cut to its last ctx − new_tokens/2 tokens, or
    (`whole`) only those between half that length and all of it, as they are. A cut drops text a lookup drafter would
    copy from (the document an extraction prompt asks about), while the profile measures acceptance on whole prompts;
    whole prompts keep that, at a KV cache a little shorter than `ctx`."""
    length = cut_length(ctx, new_tokens)
    if whole:
        return [(ids, domain) for ids, domain in prompts if length // 2 <= len(ids) <= length]
    return [(ids[-length:], domain) for ids, domain in prompts if len(ids) >= length]
