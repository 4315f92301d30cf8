"""MT-Bench's second turns as further calibration prompts.

MT-Bench asks each question in two turns. A second turn's prompt is the question, the target's own answer to it and
the follow-up question, rendered by the chat template as a served two-turn chat is (profiles/prompts.py). The answer
is the target's greedy continuation of the first turn, at most `ANSWER_TOKENS` tokens or to its end of sequence, so
the text a lookup drafter copies from is what the target itself wrote. Only questions of the profiling split get a
second turn (the held-back split stays unseen), and only where the acceptance phase has used every first turn of a
domain whose interval is still too wide (profiles/torch_acceptance.py, "more prompts"), with `profile --second-turns`.

Off by default: with the target's own answer in the context a lookup drafter copies far more, so such a profile
describes multi-turn chat, while the export's checks decode held-back first turns and read the difference as a wrong
prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec_tune.profiles.calibration import CalibrationPrompt, CalibrationSet, mtbench_follow_ups
from specdec_tune.profiles.prompts import encode_fitting
from specdec_tune.profiles.specdec import generate

ANSWER_TOKENS = 64  # of the target's first answer: context a lookup drafter can copy from, at a bounded cost
SUFFIX = "/turn2"  # a second turn's id: its question's id and this
MTBENCH = "mtbench/"  # the ids of MT-Bench's questions (profiles/calibration.py)


def second_turns(
    target, prompts: Sequence[CalibrationPrompt], *, context_tokens: int, stop_ids: Sequence[int], batch: int
) -> list[CalibrationPrompt]:
    """The second turns of the MT-Bench questions among `prompts` (module docstring), their answers decoded `batch`
    prompts at a time, similar lengths together."""
    firsts = [p for p in prompts if p.id.startswith(MTBENCH) and not p.turns]
    if not firsts:  # no MT-Bench question among them: the follow-ups are not even read
        return []
    follow = mtbench_follow_ups()
    firsts = [p for p in firsts if p.id in follow]
    encoded = encode_fitting(
        target.tokenizer,
        CalibrationSet("first turns", tuple(firsts)),
        context_tokens=context_tokens,
        max_new_tokens=ANSWER_TOKENS,
        max_draft_tokens=0,
    )
    fitting = sorted((p for p in firsts if p.id in encoded), key=lambda p: (len(encoded[p.id]), p.id))
    out = []
    for start in range(0, len(fitting), batch):
        chunk = fitting[start : start + batch]
        result = generate(
            target.model, [encoded[p.id] for p in chunk], max_new_tokens=ANSWER_TOKENS, stop_token_ids=stop_ids
        )
        for p, tokens in zip(chunk, result.tokens):
            answer = target.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            if answer:
                turns = (("user", p.text), ("assistant", answer))
                out.append(CalibrationPrompt(p.id + SUFFIX, p.domain, follow[p.id], turns))
    return out
