"""export repairs a failed throughput check before it refuses: the verify cells behind the failing buckets are
measured again, the plan is searched again with its own settings, and the check runs again.

The device is simulated: its true speed is the recorded demo profile, decode tokens/s are the cost model's figures
on it, and the profile the plan is searched on carries one verify cell that caught a slow spell (twice its time).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.autotune.plan_schema import Plan, load_plan
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.cli import main
from specdec_tune.exporters import bundle as bundle_module
from specdec_tune.exporters.bundle import read_manifest
from specdec_tune.pipeline import lossless
from specdec_tune.pipeline import throughput_check as validate
from specdec_tune.pipeline.export import export
from specdec_tune.pipeline.repair import prediction_cells, search_settings_of
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file, write_json
from specdec_tune.settings import ExportSettings, MeasureSettings

DEMO_PROFILE = Path(__file__).parent / "data" / "demo_profile.json"
CTX = 128
SLOW_CELL = (
    2,
    1,
    CTX,
)  # batch 2, one token: the baseline, and the width of every batch-2 round in which no row drafted
SLOW_BATCH = SLOW_CELL[0]
SLOW_FACTOR = 2.0
TIMED_FIELDS = ("median_ms", "raw_median_ms", "ci_low_ms", "ci_high_ms", "p10_ms", "p90_ms")
SETTINGS = SearchSettings(seed=0, trials=10, mechanisms=("ngram",))


def _cell(point: dict) -> tuple[int, int, int]:
    return point["batch"], point["tokens"], point["ctx"]


def _with_slow_cell(profile: dict) -> dict:
    slow = json.loads(json.dumps(profile))
    for point in slow["verify"]:
        if _cell(point) == SLOW_CELL:
            point.update({k: point[k] * SLOW_FACTOR for k in TIMED_FIELDS if point.get(k) is not None})
    return slow


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A profile with the slow cell and the plan searched on it (once per module; each test works on copies)."""
    folder = tmp_path_factory.mktemp("searched")
    write_json(folder / "profile.json", _with_slow_cell(json.loads(DEMO_PROFILE.read_text())))
    search(
        load_profile(folder / "profile.json"),
        sha256_file(folder / "profile.json"),
        dataclasses.replace(SETTINGS, out_dir=folder),
    )
    return folder


@pytest.fixture
def inputs(searched, tmp_path):
    """(plan.json, profile/profile.json) in this test's folder."""
    (tmp_path / "profile").mkdir()
    shutil.copyfile(searched / "profile.json", tmp_path / "profile" / "profile.json")
    shutil.copyfile(searched / "plan.json", tmp_path / "plan.json")
    return tmp_path / "plan.json", tmp_path / "profile" / "profile.json"


@pytest.fixture
def true_speed():
    """The device's true verify cells and decode tokens/s (the demo profile, without the slow spell)."""
    cost = CostModel(load_profile(DEMO_PROFILE), ctx=CTX)
    cells = {_cell(p): p for p in json.loads(DEMO_PROFILE.read_text())["verify"]}

    def tokens_per_s(batch: int, draft_len: int, mechanism: str, quant: str) -> float:
        return cost.predict(batch, draft_len, mechanism, quant).tokens_per_s.value

    return cells, tokens_per_s


@pytest.fixture
def simulated_device(monkeypatch, fixed_speed, true_speed):
    """Everything the lossless gate and the throughput check would run on the demo model, answered by `true_speed`."""
    _, tokens_per_s = true_speed
    monkeypatch.setattr(validate, "DeviceSpeed", fixed_speed(1.0))
    monkeypatch.setattr(validate, "another_device", lambda profiled: "")
    monkeypatch.setattr(validate, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(validate, "plan_drafter", lambda plan, profile, target: (plan.mechanism, plan.quant))
    monkeypatch.setattr(validate, "context_prompts", lambda *a: [[1, 2, 3]])
    monkeypatch.setattr(
        validate,
        "measure_decode",
        lambda target, drafter, ids, D, *a, batch_size, **k: {"tokens_per_s": tokens_per_s(batch_size, D, *drafter)},
    )
    monkeypatch.setattr(
        lossless,
        "lossless_gate",
        lambda plan, profile, s: {
            "applicable": True,
            "passed": True,
            "dtype": "float32",
            "split": "held_back",
            "runs": [
                {"draft_len": D, "prompts": 2, "identical": 2} for D in sorted({d for _, d in plan.schedule if d})
            ],
        },
    )
    monkeypatch.setattr(bundle_module, "ship_kernels", lambda *a: {"skipped": "kernels are not what this test checks"})


@pytest.fixture
def remeasured(monkeypatch, true_speed):
    """A stand-in for profiles.verify_curve.remeasure: remeasured(lowers=True) makes each named cell take its true time
    (the slow spell is gone); lowers=False finds each cell as slow as before. Returns the list of calls it got."""
    true_cells, _ = true_speed

    def install(lowers: bool) -> list[list[tuple[int, int, int]]]:
        calls = []

        def remeasure(profile_path: Path, verify_cells: list[tuple[int, int, int]], visits: int = 2):
            calls.append(list(verify_cells))
            data = json.loads(Path(profile_path).read_text())
            changes = []
            for point in data["verify"]:
                if _cell(point) in verify_cells:
                    before = point["median_ms"]
                    if lowers:
                        point.update({k: true_cells[_cell(point)].get(k) for k in TIMED_FIELDS})
                    changes.append(
                        {
                            "batch": point["batch"],
                            "tokens": point["tokens"],
                            "ctx": point["ctx"],
                            "before_ms": before,
                            "after_ms": point["median_ms"],
                            "source": point["source"],
                        }
                    )
            write_json(profile_path, data)
            return load_profile(profile_path), changes

        monkeypatch.setattr("specdec_tune.pipeline.repair.remeasure", remeasure)
        return calls

    return install


def _bucket(plan: dict, batch: int) -> dict:
    return next(b for b in plan["buckets"] if b["batch"] == batch)


def _schedule(plan: dict) -> list[list[int]]:
    return [[b["batch"], b["draft_len"]] for b in plan["buckets"]]


def checked_rows(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "bundle" / "validation.json").read_text())["throughput"]["buckets"]


def test_the_plan_records_enough_to_search_it_again(inputs, tmp_path):
    plan_path, _ = inputs
    settings = search_settings_of(load_plan(plan_path))
    assert settings.mechanisms == ("ngram",) and settings.trials == 10 and settings.seed == 0
    older = tmp_path / "older.json"
    older.write_text(json.dumps({k: v for k, v in json.loads(plan_path.read_text()).items() if k != "search_settings"}))
    with pytest.raises(SpecdecError, match="search_settings"):  # a plan that does not record them is refused at load
        load_plan(older)


def test_the_cells_behind_a_prediction_are_every_round_width_it_weighed(inputs):
    plan_path, profile_path = inputs
    plan, profile = load_plan(plan_path), load_profile(profile_path)
    bucket = plan.buckets[0]
    cells = prediction_cells(plan, profile, bucket.batch, bucket.draft_len)
    assert cells == [
        (bucket.batch, t, CTX) for t in range(1, bucket.draft_len + 2)
    ]  # n-gram rounds propose 0..D tokens
    assert prediction_cells(plan, profile, 16, 0) == [(16, 1, CTX)]


def test_a_slow_cell_is_re_measured_and_the_re_plan_ships(inputs, simulated_device, remeasured, true_speed, tmp_path):
    plan_path, profile_path = inputs
    calls = remeasured(lowers=True)
    planted = json.loads(plan_path.read_text())
    rounds: list[dict] = []
    manifest = export(
        ExportSettings(plan=plan_path, profile=profile_path, out=tmp_path / "bundle", onnx_drafter=False),
        on_repair=rounds.append,
    )

    assert (
        len(calls) == 1
        and SLOW_CELL in calls[0]
        and (SLOW_BATCH, 1 + _bucket(planted, SLOW_BATCH)["draft_len"], CTX) in calls[0]
    )
    record = rounds[0]
    assert len(rounds) == 1 and [r["batch"] for r in record["failing"]] == [SLOW_BATCH]
    assert record["worst_error_pct_before"] < -MeasureSettings().tolerance_pct and record[
        "worst_error_pct_after"
    ] == pytest.approx(0, abs=1e-9)
    slow = next(c for c in record["cells"] if (c["batch"], c["tokens"], c["ctx"]) == SLOW_CELL)
    true_ms = true_speed[0][SLOW_CELL]["median_ms"]
    assert slow["before_ms"] == pytest.approx(SLOW_FACTOR * true_ms) and slow["after_ms"] == pytest.approx(true_ms)
    assert record["before"]["schedule"] == _schedule(planted) != record["after"]["schedule"] and record["passed"]
    rechecked = {r["batch"] for r in checked_rows(tmp_path) if not r.get("kept_from_the_previous_check")}
    changed = {
        B for (B, D), (_, D_before) in zip(record["after"]["schedule"], record["before"]["schedule"]) if D != D_before
    }
    assert (
        SLOW_BATCH in rechecked and rechecked <= changed | {SLOW_BATCH} and len(rechecked) < len(planted["buckets"])
    )  # the rest stand

    replanned = json.loads(plan_path.read_text())
    assert _schedule(replanned) == record["after"]["schedule"] == manifest["plan"]["schedule"]
    assert replanned["profile"]["sha256"] == sha256_file(profile_path) == manifest["profile"]["sha256"]
    assert replanned["settings_hash"] == planted["settings_hash"]
    bundle = tmp_path / "bundle"
    read_manifest(bundle)
    assert json.loads((bundle / "inputs" / "plan.json").read_text()) == replanned
    validation = json.loads((bundle / "validation.json").read_text())
    assert validation["repairs"] == rounds == manifest["validation"]["repairs"]
    gated = sorted({b["draft_len"] for b in replanned["buckets"] if b["draft_len"]})
    assert (
        [r["draft_len"] for r in validation["lossless"]["runs"]]
        == gated
        != sorted({b["draft_len"] for b in planted["buckets"] if b["draft_len"]})
    )
    vllm = json.loads((bundle / "vllm" / "speculative_config.json").read_text())
    at_slow_batch = [k for lo, hi, k in vllm["num_speculative_tokens_per_batch_size"] if lo <= SLOW_BATCH <= hi]
    assert at_slow_batch == [_bucket(replanned, SLOW_BATCH)["draft_len"]] != [_bucket(planted, SLOW_BATCH)["draft_len"]]
    report = (bundle / "report" / "report.md").read_text()
    assert (
        "passed after 1 round(s) of re-measuring" in report
        and f"{SLOW_FACTOR * true_ms:.2f} -> {true_ms:.2f} ms" in report
    )


def test_a_disagreement_that_survives_re_measuring_is_refused(
    inputs, simulated_device, remeasured, true_speed, tmp_path, capsys
):
    plan_path, profile_path = inputs
    out = tmp_path / "bundle"
    export(ExportSettings(plan=plan_path, profile=profile_path, out=out, skip_measure=True, onnx_drafter=False))
    previous = (out / "manifest.json").read_bytes()
    calls = remeasured(lowers=False)
    planted = json.loads(plan_path.read_text())
    B, D = SLOW_BATCH, _bucket(planted, SLOW_BATCH)["draft_len"]

    code = main(
        [
            "export",
            "--plan",
            str(plan_path),
            "--profile",
            str(profile_path),
            "--out",
            str(out),
            "--no-onnx",
            "--repair-rounds",
            "2",
        ]
    )
    printed = capsys.readouterr()
    assert code == 1 and len(calls) == 2 and printed.out.count("re-measured the verify cells behind") == 2
    for n in (1, 2):  # each round says what it is doing as each part ends, not only when the round is over
        assert f"repair round {n}: re-measured " in printed.out and f"repair round {n}: re-planned, " in printed.out
        assert f"repair round {n}: throughput batch {B}" in printed.out
    error = printed.err.strip()
    assert "\n" not in error and error.startswith("error: throughput check failed") and "after 2 round(s)" in error
    measured = true_speed[1](B, D, planted["mechanism"], planted["quant"])
    assert (
        f"batch {B}, D={D}: predicted {_bucket(planted, B)['predicted']['tokens_per_s']['value']:.1f} tokens/s, "
        f"measured {measured:.1f}"
    ) in error
    slow_ms = next(p.median_ms for p in load_profile(profile_path).verify if (p.batch, p.tokens, p.ctx) == SLOW_CELL)
    assert (
        f"verify cells at B={B}, ctx {CTX}: 1+D=1 {slow_ms:.2f} -> {slow_ms:.2f} ms" in error
        and f"1+D={1 + D} " in error
    )
    assert (out / "manifest.json").read_bytes() == previous and not list(tmp_path.glob(".bundle.staging-*"))


@pytest.mark.parametrize("case", ["projected plan, failed check", "check that did not run"])
def test_no_repair_without_a_check_of_this_device(case, inputs, simulated_device, remeasured, monkeypatch, tmp_path):
    plan_path, profile_path = inputs
    calls = remeasured(lowers=True)
    out = tmp_path / "bundle"
    if case == "check that did not run":
        monkeypatch.setattr(
            "specdec_tune.pipeline.export.throughput_check",
            lambda *a, **k: {"checked": False, "why": "no prompt reaches the context"},
        )
        manifest = export(ExportSettings(plan=plan_path, profile=profile_path, out=out, onnx_drafter=False))
        assert manifest["validation"]["repairs"] == [] and "repairs" not in json.loads(
            (out / "validation.json").read_text()
        )
    else:
        search(
            load_profile(profile_path),
            sha256_file(profile_path),
            dataclasses.replace(SETTINGS, device="h200", out_dir=tmp_path),
        )
        plan = json.loads(plan_path.read_text())
        assert plan["device"]["projected_from"]
        here = Plan.model_validate(dict(plan, device={"name": "this device", "times": "measured"}))
        failed = validate.throughput_check(here, load_profile(profile_path), MeasureSettings())
        assert not failed["passed"]  # what this device measures disagrees with the plan at its first bucket
        monkeypatch.setattr("specdec_tune.pipeline.export.throughput_check", lambda *a, **k: failed)
        with pytest.raises(SpecdecError, match=r"not repaired: the plan is for .* \(modeled\)") as refused:
            export(ExportSettings(plan=plan_path, profile=profile_path, out=out, onnx_drafter=False))
        assert f"batch {failed['worst']['batch']}" in str(refused.value) and not out.exists()
    assert calls == []
