"""export / validate / check: engine configs for every mechanism, schedule translations, the bundle's
integrity checks, staleness factors, and the losslessness gate against a deliberately lossy drafter."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from specdec_tune import SpecdecError, __version__
from specdec_tune.cli import main
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.exporters import schedule as sched
from specdec_tune.exporters.bundle import STALE_EXIT_CODE, ExportSettings, export, read_manifest
from specdec_tune.exporters.engines import ExportContext, load_engines
from specdec_tune.exporters.validate import check_document
from specdec_tune.exporters.versions import DEFAULT_VERSIONS
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file, write_json

PROFILE_PATH = Path(__file__).parent / "data" / "demo_profile.json"
MECHANISMS = ("ngram", "suffix", "draft_model", "eagle3", "mtp", "dflash", "dspark")


# ---------------------------------------------------------------------------- schedules


@st.composite
def schedules(draw):
    buckets = sorted(draw(st.sets(st.integers(1, 512), min_size=1, max_size=8)))
    ds = draw(st.lists(st.integers(0, 15), min_size=len(buckets), max_size=len(buckets)))
    ds[0] = max(ds)  # the plan's rule: the smallest bucket carries the maximum
    return list(zip(buckets, ds))


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_engine_schedules_give_the_same_draft_length_at_every_batch_size(schedule):
    vllm, trt, bands = sched.to_vllm(schedule), sched.to_trtllm(schedule), sched.to_sglang(schedule)
    want = {}
    for B in range(1, schedule[-1][0] + 1):
        want[B] = next(d for b, d in schedule if b >= B)
        assert sched.k_at(vllm, B) == want[B] == sched.k_at(trt, B)
        assert next(k for lo, hi, k in bands if lo <= B <= hi) == want[B]
    assert vllm[0][0] == 1 and all(r2[0] == r1[1] + 1 for r1, r2 in zip(vllm, vllm[1:]))
    assert trt[min(trt)] == max(trt.values())
    # and back: the engine forms convert to the same per-batch-size K
    top = schedule[-1][0]
    for form in (sched.from_vllm(vllm), sched.from_trtllm(trt, top)):
        assert all(next(d for b, d in form if b >= B) == want[B] for B in range(1, top + 1))


def test_a_schedule_that_breaks_the_tensorrt_rule_is_refused():
    with pytest.raises(SpecdecError, match="smallest batch"):
        sched.to_trtllm([(1, 1), (4, 3)])


# ---------------------------------------------------------------------------- engine configs


def _context(mechanism: str, schedule, versions=None, quant="none") -> ExportContext:
    options = {"ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 5}, "suffix": {"max_tree_depth": 24}}.get(mechanism, {})
    if mechanism == "dspark":
        options = {"markov_rank": 8, "markov_head_type": "gated", "block_size": 8}
    learned = mechanism not in ("ngram", "suffix")
    plan = {"single_draft_len": {"draft_len": 2}, "profile": {"target": {"arch": "llama"}}}
    return ExportContext(plan=plan, mechanism=mechanism, quant=quant, schedule=list(schedule), max_batch=schedule[-1][0],
                         drafter={"name": mechanism, "options": options}, target_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                         drafter_model="/models/draft" if learned else None, versions=dict(DEFAULT_VERSIONS, **(versions or {})))


def test_speculators_config_takes_the_heads_own_fields(tmp_path):
    """A learned head named by `model=`: the bundle's speculators config carries the head's draft vocabulary, layer ids
    and layer config from the head folder's config.json (read as JSON), not just what the drafter options give."""
    own = {"speculators_model_type": "eagle3", "draft_vocab_size": 8192, "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
           "target_hidden_size": 576, "norm_before_residual": False, "transformer_layer_config": {"hidden_size": 576}, "auto_map": {"x": "y"}}
    (tmp_path / "config.json").write_text(json.dumps(own))
    ctx = dataclasses.replace(_context("eagle3", [(1, 3)]), drafter={"name": "eagle3", "options": {"model": str(tmp_path), "random": False}})
    config = load_engines()["speculators"].render(ctx).document
    assert config["draft_vocab_size"] == 8192 and config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["transformer_layer_config"] == {"hidden_size": 576} and "auto_map" not in config
    bare = load_engines()["speculators"].render(_context("eagle3", [(1, 3)])).document
    assert "draft_vocab_size" not in bare


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("schedule", [[(1, 4), (4, 2), (16, 1), (64, 0)], [(1, 3), (8, 3)], [(1, 0), (8, 0)]])
def test_every_engine_config_validates_for_every_mechanism(mechanism, schedule):
    for name, engine in load_engines().items():
        files = engine.render(_context(mechanism, schedule))
        result = check_document(engine, files.document)
        assert result["errors"] == [], (name, mechanism, result)
        assert files.decisions, "every engine says what it emitted"
        if name == "vllm" and files.document:
            assert files.document["method"] == mechanism and files.document["num_speculative_tokens"] == max(d for _, d in schedule)
        if name == "trtllm" and files.document.get("speculative_config"):
            spec = files.document["speculative_config"]
            assert spec["decoding_type"] in ("NGram", "SA", "Draft_Target", "Eagle3", "MTP", "DFlash", "DSpark")
            if "draft_len_schedule" in spec:
                assert set(spec["draft_len_schedule"]) <= set(files.document["cuda_graph_config"]["batch_sizes"])
        if name == "sglang" and files.document["supported"]:
            for band in files.document["bands"]:
                argv = band["argv"]
                if band["draft_len"]:
                    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == str(band["draft_len"] + 1)


def test_checks_catch_broken_configs():
    engines = load_engines()
    bad_vllm = {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 3]]}
    errors = check_document(engines["vllm"], bad_vllm)["errors"]
    assert any("start at 1" in e for e in errors) and any("exceeds num_speculative_tokens" in e for e in errors)
    assert check_document(engines["vllm"], {"method": "medusa2", "num_speculative_tokens": 0})["errors"]
    bad_trt = {"max_batch_size": 8, "speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 3,
                                                             "draft_len_schedule": {"1": 2, "8": 3}}, "cuda_graph_config": {"batch_sizes": [1]}}
    errors = check_document(engines["trtllm"], bad_trt)["errors"]
    assert any("decoding_type" in e for e in errors) and any("smallest draft_len_schedule key" in e for e in errors)
    assert any("miss schedule keys" in e for e in errors)


def test_engine_versions_decide_what_is_emitted():
    ctx = _context("ngram", [(1, 3), (4, 1), (16, 0)], versions={"vllm": "0.31.0", "trtllm": "1.2.0"})
    engines = load_engines()
    vllm = engines["vllm"].render(ctx)
    assert "num_speculative_tokens_per_batch_size" not in vllm.document and vllm.document["num_speculative_tokens"] == 2
    assert any("no per-batch table" in d for d in vllm.decisions)
    trt = engines["trtllm"].render(ctx)
    assert "draft_len_schedule" not in trt.document["speculative_config"]
    assert any(g["feature"] == "draft_len_schedule" and not g["emitted"] for g in trt.gates)


def test_sglang_adaptive_alternative_only_for_eagle_family():
    engines = load_engines()
    eagle = engines["sglang"].render(_context("eagle3", [(1, 7), (8, 3), (32, 1)]))
    assert eagle.document["adaptive"]["config"]["candidate_steps"] == [1, 3, 7] and len(eagle.document["bands"]) == 3
    ngram = engines["sglang"].render(_context("ngram", [(1, 7), (8, 3), (32, 1)]))
    assert "adaptive" not in ngram.document and any("adaptive controller" in d for d in ngram.decisions)


# ---------------------------------------------------------------------------- bundles


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    search(load_profile(PROFILE_PATH), sha256_file(PROFILE_PATH), SearchSettings(seed=0, trials=100, out_dir=out))
    return out / "plan.json"


@pytest.fixture()
def bundle(plan_path, tmp_path):
    out = tmp_path / "bundle"
    export(ExportSettings(plan=plan_path, profile=PROFILE_PATH, out=out, skip_measure=True))
    return out


def test_bundle_tree_and_manifest(bundle, plan_path):
    manifest = read_manifest(bundle)
    for rel in ("vllm/speculative_config.json", "vllm/serve.sh", "trtllm/config.yaml", "sglang/bands.json", "report/report.md",
                "report/verify_curve.png", "report/pareto_front.png", "validation.json", "inputs/plan.json", "inputs/profile.json"):
        assert rel in manifest["files"], rel
    assert manifest["plan"]["sha256"] == sha256_file(plan_path) and manifest["factors"]["tool_version"] == __version__
    assert manifest["figures"]["predicted_figures_by_source"] and manifest["engines"]["vllm"]["gates"]
    trt = yaml.safe_load((bundle / "trtllm" / "config.yaml").read_text())
    vllm = json.loads((bundle / "vllm" / "speculative_config.json").read_text())
    plan = json.loads(plan_path.read_text())
    for b in plan["buckets"]:
        assert sched.k_at(vllm["num_speculative_tokens_per_batch_size"], b["batch"]) == b["draft_len"]
        assert sched.k_at(trt["speculative_config"]["draft_len_schedule"], b["batch"]) == b["draft_len"]
    assert main(["validate", str(bundle), "--configs-only"]) == 0


def test_edited_file_fails_its_hash(bundle, capsys):
    path = bundle / "vllm" / "speculative_config.json"
    config = json.loads(path.read_text())
    config["num_speculative_tokens"] += 1
    path.write_text(json.dumps(config, indent=2) + "\n")
    assert main(["validate", str(bundle), "--configs-only"]) == 1
    assert "does not match its hash" in capsys.readouterr().err


@pytest.mark.parametrize("evil", ["../outside.json", "/etc/passwd", "vllm/../../x"])
def test_manifest_path_escaping_the_bundle_is_rejected(bundle, evil):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"][evil] = "0" * 64
    write_json(bundle / "manifest.json", manifest)
    with pytest.raises(SpecdecError, match="escapes the bundle"):
        read_manifest(bundle)


def test_symlinked_or_extra_files_are_rejected(bundle, tmp_path):
    (tmp_path / "secret").write_text("x")
    target = bundle / "vllm" / "serve.sh"
    target.unlink()
    os.symlink(tmp_path / "secret", target)
    with pytest.raises(SpecdecError, match="symlink"):
        read_manifest(bundle)
    target.unlink()
    (bundle / "extra.py").write_text("import os")
    with pytest.raises(SpecdecError):
        read_manifest(bundle)


def test_reexport_replaces_the_bundle_whole(plan_path, bundle):
    (bundle / "report" / "stale.txt").write_text("left over")
    with pytest.raises(SpecdecError, match="not list"):
        read_manifest(bundle)
    export(ExportSettings(plan=plan_path, profile=PROFILE_PATH, out=bundle, skip_measure=True))
    read_manifest(bundle)
    assert not (bundle / "report" / "stale.txt").exists() and not list(bundle.parent.glob(".bundle.staging-*"))


def test_export_refuses_a_plan_from_another_profile(plan_path, tmp_path, capsys):
    other = tmp_path / "profile.json"
    other.write_text(PROFILE_PATH.read_text() + "\n")
    code = main(["export", "--plan", str(plan_path), "--profile", str(other), "--out", str(tmp_path / "b"), "--configs-only"])
    assert code == 1 and "another profile" in capsys.readouterr().err and not (tmp_path / "b").exists()


def _make_fresh_here(bundle: Path) -> None:
    """Point the manifest's device factors at this machine (the recorded profile comes from another run)."""
    from specdec_tune.profiles.fingerprint import device_factors, device_fingerprint

    import torch

    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["factors"]["device"] = device_factors(device_fingerprint(torch.device("cpu"), torch.bfloat16))
    write_json(bundle / "manifest.json", manifest)


def test_check_is_fresh_then_names_each_changed_factor(bundle, capsys):
    _make_fresh_here(bundle)
    versions = ["--vllm-version", DEFAULT_VERSIONS["vllm"], "--trtllm-version", DEFAULT_VERSIONS["trtllm"],
                "--sglang-version", DEFAULT_VERSIONS["sglang"]]
    assert main(["check", str(bundle), *versions]) == 0
    capsys.readouterr()
    manifest = json.loads((bundle / "manifest.json").read_text())
    changes = {"target_weights": "0" * 64, "tool_version": "0.0.1"}
    for key, value in changes.items():
        manifest["factors"][key] = value
    manifest["factors"]["device"]["name"] = "NVIDIA H100 80GB HBM3"
    manifest["factors"]["device"]["torch"] = "2.9.0"
    write_json(bundle / "manifest.json", manifest)
    assert main(["check", str(bundle), "--json", *versions[:2], "--trtllm-version", "1.4.0", "--sglang-version", DEFAULT_VERSIONS["sglang"]]) == STALE_EXIT_CODE
    result = json.loads(capsys.readouterr().out)
    named = {c["factor"] for c in result["changed"]}
    assert named == {"target_weights", "tool_version", "device.name", "device.torch", "engine.trtllm"}
    assert not result["fresh"]


@pytest.mark.demo
def test_lossless_gate_fails_on_a_drafter_that_corrupts_the_target(monkeypatch):
    """A drafter sharing the target's weights that edits them in place (the bug a careless in-place
    quantization makes): speculative output then differs from plain output, and the gate says so."""
    import types

    import torch

    from specdec_tune.exporters.validate import MeasureSettings, lossless_gate
    from specdec_tune.profiles.drafters import base
    from specdec_tune.profiles.drafters.ngram import NgramDrafter

    class CorruptingDrafter(NgramDrafter):
        def __init__(self, target, options):
            super().__init__(target, options)
            self.head = target.model.lm_head.weight

        def propose(self, request):
            with torch.no_grad():
                self.head.mul_(1.02).add_(torch.randn_like(self.head) * 0.05)
            return super().propose(request)

    monkeypatch.setitem(base._REGISTRY, "lossy", CorruptingDrafter)
    profile = types.SimpleNamespace(target={"path": "smollm2-135m"},
                                    drafters=[types.SimpleNamespace(name="lossy", options={"prompt_lookup_min": 1, "prompt_lookup_max": 3})])
    plan = {"mechanism": "lossy", "quant": "none", "buckets": [{"batch": 1, "draft_len": 3}]}
    gate = lossless_gate(plan, profile, MeasureSettings(prompts=2, new_tokens=16))
    assert not gate["passed"] and gate["runs"][0]["identical"] < gate["runs"][0]["prompts"]
    honest = {"mechanism": "ngram", "quant": "none", "buckets": [{"batch": 1, "draft_len": 3}]}
    profile.drafters = [types.SimpleNamespace(name="ngram", options={"prompt_lookup_min": 1, "prompt_lookup_max": 3})]
    assert lossless_gate(honest, profile, MeasureSettings(prompts=2, new_tokens=16))["passed"]


def test_check_names_a_changed_drafter_checkpoint(bundle, tiny_hf_dir, capsys):
    _make_fresh_here(bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["drafter"] = {"name": "draft_model", "options": {"model": str(tiny_hf_dir)}, "model": {"weights_hash": "0" * 64}}
    write_json(bundle / "manifest.json", manifest)
    assert main(["check", str(bundle), "--json"]) == STALE_EXIT_CODE
    changed = {c["factor"] for c in json.loads(capsys.readouterr().out)["changed"]}
    assert "drafter_weights" in changed


def test_throughput_gate_scales_by_device_speed_and_names_the_bucket(monkeypatch, fixed_speed):
    """The gate compares each bucket's measurement with the prediction at the device's current speed: a
    uniformly slower machine passes with its drift reported; a wrong prediction fails at its bucket."""
    import types

    from specdec_tune.exporters import validate

    measured = {(1, 3): 100.0, (4, 0): 300.0}
    monkeypatch.setattr(validate, "measure_decode", lambda t, d, ids, D, *a, batch_size, **k: {"tokens_per_s": measured[(batch_size, D)]})
    monkeypatch.setattr(validate, "DeviceSpeed", fixed_speed(1.25))
    monkeypatch.setattr(validate, "plan_drafter", lambda *a: None)
    monkeypatch.setattr(validate, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(validate, "context_prompts", lambda *a: [[1, 2, 3]])
    profile = types.SimpleNamespace(target={"path": "x"}, device={"dtype": "float32"})

    def plan(tps_1, tps_4):
        def bucket(B, D, tps):
            return {"batch": B, "draft_len": D, "predicted": {"tokens_per_s": {"value": tps, "source": "measured"}}}
        return {"device": {}, "ctx": 128, "max_draft_len": 3, "buckets": [bucket(1, 3, tps_1), bucket(4, 0, tps_4)]}

    ok = validate.throughput_check(plan(125.0, 375.0), profile, validate.MeasureSettings())
    assert ok["passed"] and [round(b["error_pct"], 6) for b in ok["buckets"]] == [0, 0]
    assert [round(b["raw_error_pct"], 6) for b in ok["buckets"]] == [25, 25]
    assert ok["device_drift_pct"] == pytest.approx(25) and "re-profile" in ok["warning"]
    bad = validate.throughput_check(plan(125.0, 500.0), profile, validate.MeasureSettings())
    assert not bad["passed"] and bad["worst"]["batch"] == 4 and bad["worst"]["error_pct"] == pytest.approx(100 * (400 - 300) / 300)


def test_throughput_gate_passes_a_difference_inside_the_noise_and_refuses_one_outside(monkeypatch, fixed_speed):
    """20% off with the prediction's interval overlapping the repeats' spread passes (inside the noise, said so);
    20% off with both intervals apart fails at its bucket."""
    import types

    from specdec_tune.exporters import validate

    spread = {1: [90.0, 110.0], 4: [290.0, 310.0]}
    monkeypatch.setattr(validate, "measure_decode", lambda t, d, ids, D, *a, batch_size, **k: {
        "tokens_per_s": sum(spread[batch_size]) / 2, "tokens_per_s_range": spread[batch_size]})
    monkeypatch.setattr(validate, "DeviceSpeed", fixed_speed(1.0))
    monkeypatch.setattr(validate, "plan_drafter", lambda *a: None)
    monkeypatch.setattr(validate, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(validate, "context_prompts", lambda *a: [[1, 2, 3]])
    profile = types.SimpleNamespace(target={"path": "x"}, device={"dtype": "float32"})

    def plan(low_4):
        return {"device": {}, "ctx": 128, "max_draft_len": 3, "buckets": [
            {"batch": 1, "draft_len": 3, "predicted": {"tokens_per_s": {"value": 100.0, "source": "modeled", "low": 95.0, "high": 105.0}}},
            {"batch": 4, "draft_len": 0, "predicted": {"tokens_per_s": {"value": 360.0, "source": "modeled", "low": low_4, "high": 380.0}}}]}

    noisy = validate.throughput_check(plan(305.0), profile, validate.MeasureSettings())
    assert noisy["passed"] and noisy["buckets"][1]["inside_noise"] and noisy["buckets"][1]["error_pct"] == pytest.approx(20)
    assert "inside the noise" in validate.describe_throughput_row(noisy["buckets"][1]) and validate.failing_rows(noisy) == []
    apart = validate.throughput_check(plan(340.0), profile, validate.MeasureSettings())
    assert not apart["passed"] and [r["batch"] for r in validate.failing_rows(apart)] == [4]


def test_device_speed_probes_each_batch_at_its_own_profiled_step(tiny_hf_dir):
    import types

    from specdec_tune.exporters.validate import DeviceSpeed
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.profiler import time_verify_step

    target = load_model(str(tiny_hf_dir), dtype="float32")
    now = {B: time_verify_step(target.model, B, 32, 1)["median_ms"] for B in (1, 4)}

    def point(B, factor, **kw):
        return types.SimpleNamespace(batch=B, tokens=1, ctx=32, median_ms=now[B] * factor, source="measured", **kw)

    # batch 1 "profiled" 1000x slower than now, batch 4 1000x faster: each bucket's ratio comes from its own batch
    two_tokens = types.SimpleNamespace(batch=4, tokens=2, ctx=32, median_ms=1.0, source="measured", raw_median_ms=None)  # not a probe's step
    profile = types.SimpleNamespace(verify=[point(1, 1000, raw_median_ms=None), point(4, 1e-3, raw_median_ms=None), two_tokens])
    speed = DeviceSpeed(target, profile, 32)
    result, (ratio_1,) = speed.measure(lambda between: "done", batch=1)
    _, (ratio_4,) = speed.measure(lambda between: "done", batch=4)
    _, (ratio_8,) = speed.measure(lambda between: "done", batch=8)  # not profiled: the nearest profiled batch stands for it
    assert result == "done" and 0 < ratio_1 < 0.01 and ratio_4 > 100 and ratio_8 > 100 and speed.probed_batch(2) == 1
    # the fitted figure (the one the prediction was built from) is what the probe compares with, not the raw median
    fitted = DeviceSpeed(target, types.SimpleNamespace(verify=[point(1, 1000, raw_median_ms=now[1])]), 32)
    assert 0 < fitted.measure(lambda between: None)[1][0] < 0.01
    unprobed = DeviceSpeed(target, types.SimpleNamespace(verify=[]), 32)
    assert unprobed.measure(lambda between: 1, batch=4) == (1, [1.0]) and unprobed.why == "the profile has no measured verify step with one token at ctx 32"


def test_device_speed_pairs_each_timed_run_with_the_probes_on_either_side():
    """measure_decode calls `between` before its first run and after each; each run's ratio is the mean of its two probes."""
    import types

    from specdec_tune.exporters.validate import DeviceSpeed

    profile = types.SimpleNamespace(verify=[types.SimpleNamespace(batch=1, tokens=1, ctx=32, median_ms=10.0, source="fitted")])
    speed = DeviceSpeed(None, profile, 32)
    speed.probes[1] = iter([10.0, 20.0, 30.0, 40.0]).__next__

    def runs(between):
        for _ in range(2):
            between()
        between()
        return "runs"

    assert speed.measure(runs) == ("runs", [1.5, 2.5])
    speed.probes[1] = iter([10.0, 30.0]).__next__
    assert speed.measure(lambda between: "no probes of its own") == ("no probes of its own", [2.0])  # probed around it instead


def test_a_bucket_is_judged_on_its_runs_each_at_the_speed_probed_beside_it():
    """Runs of 100, 50, 50 tokens/s, with the probes beside them reading the device at profile speed for the first and
    half as fast for the next two, are 100 tokens/s at profile speed: a prediction of 100 is right. Runs that all fell
    in a slow spell which the probes before the first and after the last missed (one ratio, 1.0) fail it."""
    from specdec_tune.exporters.validate import bucket_row

    bucket = {"batch": 1, "draft_len": 2, "predicted": {"tokens_per_s": {"value": 100.0, "source": "modeled", "low": 99.0, "high": 101.0}}}
    runs = {"tokens_per_s": 50.0, "tokens_per_s_range": [50.0, 100.0], "tokens_per_s_runs": [100.0, 50.0, 50.0]}
    row = bucket_row(bucket, runs, [1.0, 2.0, 2.0], tolerance_pct=15)
    assert row["within"] and row["error_pct"] == pytest.approx(0) and row["device_speed_ratio"] == pytest.approx(2.0)
    assert row["predicted_at_current_speed_tokens_per_s"] == pytest.approx(50.0) and row["measured_at_profile_speed_range_tokens_per_s"] == [100.0, 100.0]
    slow = {"tokens_per_s": 50.0, "tokens_per_s_range": [49.0, 51.0], "tokens_per_s_runs": [49.0, 50.0, 51.0]}
    assert bucket_row(bucket, slow, [2.0, 2.0, 2.0], tolerance_pct=15)["within"]
    missed = bucket_row(bucket, slow, [1.0], tolerance_pct=15)
    assert not missed["within"] and missed["error_pct"] == pytest.approx(100)


def test_throughput_is_not_checked_against_a_profile_from_another_device():
    import types

    from specdec_tune.exporters.validate import MeasureSettings, throughput_check

    profile = types.SimpleNamespace(target={"path": "x"}, device={"kind": "cpu", "name": "Another CPU 9000", "dtype": "float32"})
    result = throughput_check({"device": {}, "ctx": 128, "max_draft_len": 3, "buckets": []}, profile, MeasureSettings())
    assert result["checked"] is False and "'Another CPU 9000' there" in result["why"]


def test_engine_modules_compare_no_mechanism_name_outside_the_registry():
    """Every engine's spelling of a mechanism lives in exporters/mechanisms.py; the engine modules look it up."""
    import re

    from specdec_tune.exporters.mechanisms import MECHANISMS

    names = "|".join(MECHANISMS)
    pattern = re.compile(rf"""(==|!=|\bin)\s*\(?["']({names})["']|["']({names})["']\s*(==|!=|\bin\b)|\{{\s*["']({names})["']\s*:""")
    folder = Path(__file__).resolve().parents[1] / "exporters"
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(folder.glob("*.py")) if p.name != "mechanisms.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
    assert pattern.search('if ctx.mechanism == "ngram":') and pattern.search('STATIC = {"dspark": 1}')
