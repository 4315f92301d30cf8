"""Bad input to every command, as one matrix: each case must give one line naming the problem (and the
fix), a non-zero exit, and leave no output behind. The README's robustness table counts these cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec_tune.autotune.cli import main
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.exporters.bundle import ExportSettings, export
from specdec_tune.profiles.records import sha256_file
from specdec_tune.profiles.schema import load_profile

PROFILE = Path(__file__).parent / "data" / "demo_profile.json"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    profile = json.loads(PROFILE.read_text())
    (d / "corrupt.json").write_text('{"schema_version": 1, "verify": [')
    (d / "empty.json").write_text("")
    (d / "list.json").write_text("[1, 2]")
    (d / "future.json").write_text(json.dumps(profile | {"schema_version": 99}))
    (d / "wrongtype.json").write_text(json.dumps(profile | {"verify": "fast"}))
    (d / "notes.txt").write_text("hello")
    (d / "empty.jsonl").write_text("")
    (d / "malformed.jsonl").write_text('{"domain": "x", "prompt": "hi"}\n{not json\n')
    (d / "nodomain.jsonl").write_text('{"prompt": "hi"}\n')
    (d / "huge.jsonl").write_text(json.dumps({"domain": "x", "prompt": "word " * 20000}) + "\n")
    (d / "dir").mkdir()
    search(load_profile(PROFILE), sha256_file(PROFILE), SearchSettings(seed=0, trials=60, out_dir=d / "plan"))
    plan = json.loads((d / "plan" / "plan.json").read_text())
    (d / "oldplan.json").write_text(json.dumps(plan | {"schema_version": 1}))
    export(ExportSettings(plan=d / "plan" / "plan.json", profile=PROFILE, out=d / "bundle", skip_measure=True))
    (d / "nomanifest").mkdir()
    (d / "badmanifest").mkdir()
    (d / "badmanifest" / "manifest.json").write_text("{")
    (d / "busy").mkdir()
    (d / "busy" / "mine.txt").write_text("user data")
    return d


P, S = str(PROFILE), "search"
CASES = [
    # (command line, with {d} for the inputs folder and {o} for a fresh output folder; expected text)
    ("profile --target {d}/missing --out {o}", "model path not found"),
    ("profile --target {d}/notes.txt --out {o}", "not a .gguf"),
    ("profile --target {d}/dir --out {o}", "no config.json"),
    ("profile --prompts {d}/empty.jsonl --out {o}", "no prompts"),
    ("profile --prompts {d}/malformed.jsonl --out {o}", "line 2"),
    ("profile --prompts {d}/nodomain.jsonl --out {o}", "domain"),
    ("profile --prompts {d}/missing.jsonl --out {o}", "not found"),
    ("profile --drafter eagle9 --out {o}", "unknown drafter"),
    ("profile --drafter ngram:prompt_lookup_min=x --out {o}", "not a int"),
    ("profile --batch 4,2 --out {o}", "increasing"),
    ("profile --ctx 0 --out {o}", "positive"),
    ("profile --max-draft-len 0 --out {o}", "at least 1"),
    ("profile --temperatures -1 --out {o}", "≥ 0"),
    ("profile --device cuda:7 --out {o}", "CUDA is not available"),
    ("profile --dtype float8 --out {o}", "unknown dtype"),
    ("profile --prompts {d}/huge.jsonl --out {o}", "exceeds the 8192-token context"),
    ("decode --split nowhere", "unknown split"),
    ("decode --drafter ngram -D 0", "invalid"),
    ("decode --temperature 0.5 --check-lossless", "greedy"),
    ("search --profile {d}/missing.json --out {o}", "not found"),
    ("search --profile {d}/corrupt.json --out {o}", "not valid JSON"),
    ("search --profile {d}/empty.json --out {o}", "not valid JSON"),
    ("search --profile {d}/list.json --out {o}", "not a specdec-tune profile"),
    ("search --profile {d}/future.json --out {o}", "schema"),
    ("search --profile {d}/wrongtype.json --out {o}", "profile"),
    ("search --profile {d}/dir --out {o}", "profile"),
    (f"search --profile {P} --out {{o}} --device h900", "unknown device"),
    (f"search --profile {P} --out {{o}} --mechanism eagle3", "not in the profile"),
    (f"search --profile {P} --out {{o}} --min-user-tps 1e6", "no setting reaches"),
    (f"search --profile {P} --out {{o}} --objective latency", "unknown objective"),
    (f"search --profile {P} --out {{o}} --min-tps 5", "--min-tps is a floor"),
    (f"search --profile {P} --out {{o}} --trials -3", "must not be negative"),
    (f"search --profile {P} --out {{o}} --storage postgresql+psycopg2://u@127.0.0.1:1/x", "cannot open the study storage"),
    (f"export --plan {{d}}/missing.json --profile {P} --out {{o}}", "not found"),
    (f"export --plan {{d}}/corrupt.json --profile {P} --out {{o}}", "not valid JSON"),
    (f"export --plan {P} --profile {P} --out {{o}}", "not a specdec-tune plan"),
    (f"export --plan {{d}}/oldplan.json --profile {P} --out {{o}}", "plan schema"),
    ("export --plan {d}/plan/plan.json --profile {d}/future.json --out {o}", "schema"),
    (f"export --plan {{d}}/plan/plan.json --profile {P} --out {{o}} --vllm-version banana --configs-only", "not a version"),
    (f"export --plan {{d}}/plan/plan.json --profile {P} --out {{o}} --tolerance 0", "--tolerance"),
    (f"export --plan {{d}}/plan/plan.json --profile {P} --out {{d}}/busy --configs-only", "is not a bundle"),
    ("validate {d}/missing", "not found"),
    ("validate {d}/nomanifest --configs-only", "manifest"),
    ("validate {d}/badmanifest --configs-only", "not valid JSON"),
    ("check {d}/missing", "not found"),
    ("check {d}/badmanifest", "not valid JSON"),
]


@pytest.mark.parametrize("argv, expected", CASES, ids=[c[0].split(" {")[0][:60] + f"#{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_nonzero_and_leaves_nothing(files, tmp_path, capsys, argv, expected):
    out = tmp_path / "out"
    before = sorted(p.relative_to(files) for p in files.rglob("*"))
    code = main(argv.format(d=files, o=out).split())
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert not out.exists() or not any(out.iterdir())
    assert sorted(p.relative_to(files) for p in files.rglob("*")) == before  # nothing written beside the inputs


def test_case_count_matches_the_readme():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"| bad input to every command | {len(CASES)} |" in readme


def test_a_full_disk_is_one_line_and_keeps_the_old_bundle(files, tmp_path, capsys, monkeypatch):
    import errno

    out = tmp_path / "bundle"
    assert main(["export", "--plan", str(files / "plan" / "plan.json"), "--profile", str(PROFILE), "--out", str(out), "--configs-only"]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(args[0]) if args else None)

    monkeypatch.setattr("specdec_tune.exporters.report.write_report", full)
    monkeypatch.setattr("specdec_tune.exporters.bundle.write_report", full)
    code = main(["export", "--plan", str(files / "plan" / "plan.json"), "--profile", str(PROFILE), "--out", str(out), "--configs-only"])
    err = capsys.readouterr().err
    assert code == 1 and "No space left on device" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # the previous bundle is untouched
    assert not list(tmp_path.glob(".bundle.staging-*")) + list(tmp_path.glob(".bundle.old-*"))  # nothing left behind


def test_two_exports_into_one_folder(files, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bundle"
    cmd = [sys.executable, "-m", "specdec_tune.autotune.cli", "export", "--plan", str(files / "plan" / "plan.json"), "--profile", str(PROFILE),
           "--out", str(out), "--configs-only"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    codes = [p.wait(300) for p in procs]
    assert 0 in codes  # at least one lands; the other lands too or fails with one line
    for p, code in zip(procs, codes):
        if code:
            assert p.stderr.read().count("\n") == 1
    assert main(["validate", str(out), "--configs-only"]) == 0
    assert not list(tmp_path.glob(".bundle.staging-*")) + list(tmp_path.glob(".bundle.old-*"))


def test_search_killed_midway_resumes_to_the_same_plan(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "specdec_tune.autotune.cli", "search", "--profile", str(PROFILE), "--trials", "400", "--seed", "5"]
    whole = tmp_path / "whole"
    assert subprocess.run([*cmd, "--out", str(whole)], capture_output=True, timeout=600).returncode == 0
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*cmd, "--out", str(cut)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (cut / "study.db").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # some trials in, the study not finished
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "plan.json").exists()
    assert subprocess.run([*cmd, "--out", str(cut)], capture_output=True, timeout=600).returncode == 0
    strip = lambda p: {k: v for k, v in json.loads(p.read_text()).items() if k not in ("created_at", "study")}  # noqa: E731
    assert strip(cut / "plan.json") == strip(whole / "plan.json")
    study = json.loads((cut / "plan.json").read_text())["study"]
    assert study["trials"] >= 400 and study["gap_pct"] <= 1.0
