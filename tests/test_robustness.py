"""Bad input to every command, as one matrix: each case must give one line naming the problem (and the
fix), a non-zero exit, and leave no output behind. The README's robustness table counts these cases."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.cli import main
from specdec_tune.pipeline.export import export
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file
from specdec_tune.settings import ExportSettings

PROFILE = Path(__file__).parent / "data" / "demo_profile.json"
# Ctrl-C: the CLI's own exit code, or the signal itself when it lands while the interpreter is exiting
INTERRUPTED = (130, -signal.SIGINT)


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
    (d / "badplan.json").write_text(json.dumps(plan | {"buckets": [{"batch": 0, "draft_len": 2}]}))
    export(ExportSettings(plan=d / "plan" / "plan.json", profile=PROFILE, out=d / "bundle", skip_measure=True))
    (d / "oddmanifest").mkdir()
    manifest = json.loads((d / "bundle" / "manifest.json").read_text())
    (d / "oddmanifest" / "manifest.json").write_text(json.dumps(manifest | {"files": {}, "engines": {"vllm": "vllm"}}))
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
    (
        f"search --profile {P} --out {{o}} --storage postgresql+psycopg2://u@127.0.0.1:1/x",
        "cannot open the study storage",
    ),
    (f"export --plan {{d}}/missing.json --profile {P} --out {{o}}", "not found"),
    (f"export --plan {{d}}/corrupt.json --profile {P} --out {{o}}", "not valid JSON"),
    (f"export --plan {P} --profile {P} --out {{o}}", "not a specdec-tune plan"),
    (f"export --plan {{d}}/oldplan.json --profile {P} --out {{o}}", "plan schema"),
    (f"export --plan {{d}}/badplan.json --profile {P} --out {{o}}", "is not a valid plan: at buckets/0"),
    ("export --plan {d}/plan/plan.json --profile {d}/future.json --out {o}", "schema"),
    (
        f"export --plan {{d}}/plan/plan.json --profile {P} --out {{o}} --vllm-version banana --configs-only",
        "not a version",
    ),
    (f"export --plan {{d}}/plan/plan.json --profile {P} --out {{o}} --tolerance 0", "--tolerance"),
    (f"export --plan {{d}}/plan/plan.json --profile {P} --out {{d}}/busy --configs-only", "is not a bundle"),
    ("validate {d}/missing", "not found"),
    ("validate {d}/nomanifest --configs-only", "manifest"),
    ("validate {d}/badmanifest --configs-only", "not valid JSON"),
    ("validate {d}/oddmanifest --configs-only", "is not a valid bundle manifest: at engines/vllm"),
    ("check {d}/oddmanifest", "is not a valid bundle manifest"),
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
    assert (
        main(
            [
                "export",
                "--plan",
                str(files / "plan" / "plan.json"),
                "--profile",
                str(PROFILE),
                "--out",
                str(out),
                "--configs-only",
            ]
        )
        == 0
    )
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(args[0]) if args else None)

    monkeypatch.setattr("specdec_tune.exporters.report.write_report", full)
    monkeypatch.setattr("specdec_tune.exporters.bundle.write_report", full)
    code = main(
        [
            "export",
            "--plan",
            str(files / "plan" / "plan.json"),
            "--profile",
            str(PROFILE),
            "--out",
            str(out),
            "--configs-only",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "No space left on device" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # the previous bundle is untouched
    assert not list(tmp_path.glob(".bundle.staging-*")) + list(tmp_path.glob(".bundle.old-*"))  # nothing left behind


def test_two_exports_into_one_folder(files, tmp_path):
    out = tmp_path / "bundle"
    cmd = [
        sys.executable,
        "-m",
        "specdec_tune.cli",
        "export",
        "--plan",
        str(files / "plan" / "plan.json"),
        "--profile",
        str(PROFILE),
        "--out",
        str(out),
        "--configs-only",
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    codes = [p.wait(300) for p in procs]
    assert 0 in codes  # at least one lands; the other lands too or fails with one line
    for p, code in zip(procs, codes):
        if code:
            assert p.stderr.read().count("\n") == 1
    assert main(["validate", str(out), "--configs-only"]) == 0
    assert not list(tmp_path.glob(".bundle.staging-*")) + list(tmp_path.glob(".bundle.old-*"))


SEARCH_CMD = [
    sys.executable,
    "-m",
    "specdec_tune.cli",
    "search",
    "--profile",
    str(PROFILE),
    "--trials",
    "400",
    "--seed",
    "5",
    "--no-refine",  # the plan of the search alone: a subprocess is not under tests/conftest.py's stand-in
]


@pytest.fixture(scope="module")
def whole_search(tmp_path_factory) -> Path:
    """The search run once without interruption: what a resumed one must reproduce."""
    whole = tmp_path_factory.mktemp("whole")
    assert subprocess.run([*SEARCH_CMD, "--out", str(whole)], capture_output=True, timeout=600).returncode == 0
    return whole


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_search_killed_midway_resumes_to_the_same_plan(tmp_path, sig, whole_search):
    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        [*SEARCH_CMD, "--out", str(cut)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as a terminal's foreground job
    journal, deadline = cut / "study.journal", time.monotonic() + 120
    # some trials in (a trial is about ten journal lines), the study not finished
    while (
        time.monotonic() < deadline
        and proc.poll() is None
        and (not journal.exists() or journal.read_bytes().count(b"\n") < 500)
    ):
        time.sleep(0.02)
    assert proc.poll() is None, "the search ended before it could be interrupted"
    proc.send_signal(sig)
    assert proc.wait() in (INTERRUPTED if sig == signal.SIGINT else (-signal.SIGKILL,))
    assert not (cut / "plan.json").exists()
    assert subprocess.run([*SEARCH_CMD, "--out", str(cut)], capture_output=True, timeout=600).returncode == 0
    strip = lambda p: {k: v for k, v in json.loads(p.read_text()).items() if k not in ("created_at", "study")}  # noqa: E731
    assert strip(cut / "plan.json") == strip(whole_search / "plan.json")
    study = json.loads((cut / "plan.json").read_text())["study"]
    assert study["trials"] >= 400 and study["gap_pct"] <= 1.0


def test_a_journal_torn_by_a_kill_mid_line_reopens(tmp_path):
    """SIGKILL inside a write leaves a line without its newline; Optuna refuses every line appended after it."""
    import optuna

    from specdec_tune.autotune.study import open_storage

    url = f"journal:{tmp_path / 'study.journal'}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    with open(tmp_path / "study.journal", "ab") as f:
        f.write(b'{"op_code": 4, "worker_id": "w", "stu')  # a record cut mid-write
    again = optuna.load_study(study_name="s", storage=open_storage(url))
    again.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert len(optuna.load_study(study_name="s", storage=open_storage(url)).trials) == 5


# ---------------------------------------------------------------------------- export interrupted; determinism


def _bundle_bytes(out: Path) -> dict[str, bytes]:
    """Every file of a bundle, the manifest without its one timestamp field."""
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = json.loads(files.pop("manifest.json"))
    manifest.pop("created_at")
    return files | {"manifest.json": json.dumps(manifest, sort_keys=True).encode()}


def _leftovers(folder: Path) -> list[Path]:
    return list(folder.glob(".bundle.staging-*")) + list(folder.glob(".bundle.old-*"))


@pytest.mark.demo
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_export_interrupted_keeps_the_previous_bundle_and_reexports_identically(files, tmp_path, sig):
    out = tmp_path / "bundle"
    cmd = [
        sys.executable,
        "-m",
        "specdec_tune.cli",
        "export",
        "--plan",
        str(files / "plan" / "plan.json"),
        "--profile",
        str(PROFILE),
        "--out",
        str(out),
    ]
    assert subprocess.run([*cmd, "--configs-only"], capture_output=True, timeout=300).returncode == 0
    first = _bundle_bytes(out)
    proc = subprocess.Popen(
        [*cmd, "--lossless-prompts", "2", "--new-tokens", "8"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as a terminal's foreground job
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".bundle.staging-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # inside the measurements (the demo model is loading or decoding)
    assert proc.poll() is None, "the export ended before it could be interrupted"
    proc.send_signal(sig)
    code = proc.wait(120)
    if sig == signal.SIGINT:
        assert code in INTERRUPTED and proc.stderr.read() == "interrupted\n"
        assert not _leftovers(tmp_path)  # Ctrl-C cleans up on the way out
    else:
        assert code == -signal.SIGKILL and _leftovers(tmp_path)  # SIGKILL cannot: the next export does
    assert _bundle_bytes(out) == first  # the previous bundle, whole
    assert main(["validate", str(out), "--configs-only"]) == 0
    assert subprocess.run([*cmd, "--configs-only"], capture_output=True, timeout=300).returncode == 0
    assert not _leftovers(tmp_path)
    assert _bundle_bytes(out) == first  # the same inputs give the same bytes


def test_an_export_killed_between_its_renames_is_put_back(files, tmp_path):
    """SIGKILL between moving the old bundle aside and moving the new one in leaves only `.old-PID`: the next
    export restores it before anything else."""
    out = tmp_path / "bundle"
    export(ExportSettings(plan=files / "plan" / "plan.json", profile=PROFILE, out=out, skip_measure=True))
    first = _bundle_bytes(out)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    out.rename(tmp_path / f".bundle.old-{dead}")
    (tmp_path / f".bundle.staging-{dead}").mkdir()
    with pytest.raises(Exception, match="unknown engine"):  # fails after recovery, before writing anything
        export(
            ExportSettings(
                plan=files / "plan" / "plan.json",
                profile=PROFILE,
                out=out,
                versions=(("nope", "1"),),
                skip_measure=True,
            )
        )
    assert _bundle_bytes(out) == first and not _leftovers(tmp_path)


def test_same_profile_and_seed_give_byte_identical_plan_and_bundle(tmp_path):
    """Timestamps aside (one field each: plan `created_at`, manifest `created_at`), nothing depends on the run
    or on where it was written."""
    texts = []
    for name in ("a", "b"):
        search(load_profile(PROFILE), sha256_file(PROFILE), SearchSettings(seed=3, trials=80, out_dir=tmp_path / name))
        text = (tmp_path / name / "plan.json").read_text()
        stamp = json.loads(text)["created_at"]
        assert text.count(stamp) == 1
        texts.append(text.replace(stamp, "T"))
    assert texts[0] == texts[1]
    # two searches can finish within one second: give the second plan a stamp of its own
    (tmp_path / "b" / "plan.json").write_text(texts[1].replace('"T"', '"2000-01-01T00:00:00+00:00"'))
    bundles = {}
    for name, plan in (("a1", "a"), ("a2", "a"), ("b", "b")):
        export(
            ExportSettings(
                plan=tmp_path / plan / "plan.json", profile=PROFILE, out=tmp_path / f"bundle_{name}", skip_measure=True
            )
        )
        bundles[name] = _bundle_bytes(tmp_path / f"bundle_{name}")
    assert bundles["a1"] == bundles["a2"]
    # from the second plan: only the copied plan (its timestamp) and the manifest's hash of it differ
    assert {k for k in bundles["a1"] if bundles["a1"][k] != bundles["b"][k]} == {"inputs/plan.json", "manifest.json"}


def test_an_out_of_memory_bucket_is_recorded_as_infeasible(monkeypatch, fixed_speed, make_plan):
    import types

    import torch

    from specdec_tune.exporters.validation_text import describe_throughput_row
    from specdec_tune.pipeline import throughput_check as validate

    def decode(t, d, ids, D, *a, batch_size, **k):
        if batch_size >= 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return {"tokens_per_s": 100.0 * batch_size}

    monkeypatch.setattr(validate, "measure_decode", decode)
    monkeypatch.setattr(validate, "DeviceSpeed", fixed_speed(1.0))
    monkeypatch.setattr(validate, "plan_drafter", lambda *a: None)
    monkeypatch.setattr(validate, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(validate, "context_prompts", lambda *a: [[1, 2, 3]])
    bucket = lambda B: {"batch": B, "draft_len": 0, "tokens_per_s": {"value": 100.0 * B, "source": "measured"}}  # noqa: E731
    plan = make_plan([bucket(1), bucket(16)])
    result = validate.throughput_check(
        plan, types.SimpleNamespace(target={"path": "x"}, device={}), validate.MeasureSettings()
    )
    assert result["passed"] and result["infeasible_batches"] == [16]
    assert result["buckets"][1] == {"batch": 16, "draft_len": 0, "infeasible": "out of memory on this device now"}
    assert "infeasible" in describe_throughput_row(result["buckets"][1])


# ---------------------------------------------------------------------------- bundles crafted to run code


def _forge(bundle: Path, rel: str, payload: bytes) -> None:
    """Write a file into a bundle and re-sign the manifest, as an attacker who controls the folder would."""
    (bundle / rel).write_bytes(payload)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"][rel] = sha256_file(bundle / rel)
    (bundle / "manifest.json").write_text(json.dumps(manifest))


PAYLOADS = {
    "yaml python tag": (
        "trtllm/config.yaml",
        b'speculative_config: !!python/object/apply:os.system ["touch {marker}"]\n',
    ),
    "yaml new object": ("trtllm/config.yaml", b"x: !!python/object/new:subprocess.Popen [[touch, {marker}]]\n"),
    "pickle as json": ("vllm/speculative_config.json", None),
    "pickle as profile": ("inputs/profile.json", None),
}


@pytest.mark.parametrize("name", PAYLOADS)
def test_a_bundle_crafted_to_run_code_is_refused(files, tmp_path, capsys, name):
    import os
    import pickle

    marker = tmp_path / "pwned"
    bundle = tmp_path / "bundle"
    export(ExportSettings(plan=files / "plan" / "plan.json", profile=PROFILE, out=bundle, skip_measure=True))
    rel, payload = PAYLOADS[name]
    if payload is None:

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        payload = pickle.dumps(Evil())
    _forge(bundle, rel, payload.replace(b"{marker}", str(marker).encode()))
    argv = ["validate", str(bundle)] + (
        ["--configs-only"] if rel != "inputs/profile.json" else ["--lossless-prompts", "1"]
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert not marker.exists()
