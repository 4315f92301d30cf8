"""MT-Bench's second turns (profiles/second_turns.py): the question, the target's own greedy answer and the follow-up,
only for questions of the profiling split, and added by the acceptance growth (with --second-turns) only where a
domain's first turns ran out."""

from __future__ import annotations

import pytest

from specdec_tune.profiles import torch_acceptance
from specdec_tune.profiles.calibration import CalibrationPrompt, CalibrationSet, load_calibration, mtbench_follow_ups
from specdec_tune.profiles.profile_run import Budget
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.second_turns import ANSWER_TOKENS, SUFFIX, second_turns
from specdec_tune.profiles.torch_acceptance import AcceptancePhases
from specdec_tune.settings import ProfileSettings


def test_every_mtbench_question_has_its_follow_up():
    follow = mtbench_follow_ups()
    firsts = [p for p in load_calibration("mtbench").prompts]
    assert len(follow) == len(firsts) == 80 and all(p.id in follow and follow[p.id] != p.text for p in firsts)


@pytest.mark.demo
def test_a_second_turn_holds_the_targets_own_greedy_answer():
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.specdec import generate

    target = load_model(dtype="float32")
    pool, held = load_calibration("mtbench").split()
    firsts = list(pool.by_domain("writing").prompts[:2]) + [CalibrationPrompt("user/x", "writing", "not mtbench")]
    stop = list(target.model.config.eos_token_ids)
    made = second_turns(target, firsts, context_tokens=2048, stop_ids=stop, batch=1)
    follow = mtbench_follow_ups()
    assert [p.id for p in made] == [p.id + SUFFIX for p in firsts[:2]]
    for first, turn in zip(firsts, made):
        assert turn.domain == first.domain and turn.text == follow[first.id] and turn.turns[0] == ("user", first.text)
        [ids] = encode_prompts(target.tokenizer, CalibrationSet("q", (first,)), context_tokens=2048, max_new_tokens=1)
        answer = generate(target.model, [ids], max_new_tokens=ANSWER_TOKENS, stop_token_ids=stop).tokens[0]
        assert turn.turns[1] == ("assistant", target.tokenizer.decode(answer, skip_special_tokens=True).strip())
    assert not {p.id for p in held} & {p.id.removesuffix(SUFFIX) for p in made}


class Growth(AcceptancePhases):
    """The growth loop alone: one domain stays wider than the target until it has used `needed` prompts."""

    def __init__(self, pool: CalibrationSet, needed: int, on: bool = True) -> None:
        self.s = ProfileSettings(acceptance_half_width=0.05, drafters=("ngram",), second_turns=on)
        self.pool, self.used, self.second_turn_domains = pool, [], set()
        self.encoded = {p.id: [1] for p in pool}
        self.replay_units = [("ngram", "none")]
        self.trajectory_s_per_prompt, self.unit_s_per_prompt, self.needed = 0.0, {}, needed
        self.model = type("M", (), {"config": type("C", (), {"max_position_embeddings": 2048})()})()
        self.target = type("T", (), {"tokenizer": None})()
        self.stop_ids = []

    def _tick(self, *a) -> None:
        pass

    def _relevant_draft_lens(self, verify):
        return {1}

    def _half_widths(self, relevant):
        return {"writing": 0.5 if len(self.used) < self.needed else 0.01}

    def _replay_prompts(self, log, added, units):
        self.used += added


@pytest.mark.parametrize("needed, on, added", [(3, True, False), (6, True, True), (6, False, False)])
def test_the_growth_adds_second_turns_only_where_the_first_ones_ran_out(monkeypatch, needed, on, added):
    firsts = tuple(CalibrationPrompt(f"mtbench/{i}", "writing", f"q{i}") for i in range(4))
    made = []

    def fake_second_turns(target, prompts, **_):
        made.append([p.id for p in prompts])
        return [
            CalibrationPrompt(p.id + SUFFIX, p.domain, "f", (("user", p.text), ("assistant", "a"))) for p in prompts
        ]

    monkeypatch.setattr(torch_acceptance, "second_turns", fake_second_turns)
    monkeypatch.setattr(torch_acceptance, "encode_fitting", lambda tok, prompts, **_: {p.id: [1] for p in prompts})
    growth = Growth(CalibrationSet("pool", firsts), needed, on)
    notes = growth._grow_acceptance(None, Budget(10.0), [])
    assert ("within" if added or needed <= len(firsts) else "no more prompts") in notes[0]
    assert made == ([[p.id for p in firsts]] if added else [])
    assert sum(p.id.endswith(SUFFIX) for p in growth.used) == (len(firsts) if added else 0)  # a round takes them all
