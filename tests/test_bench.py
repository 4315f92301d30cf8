"""Each benchmark script runs end to end in its reduced mode, so that none of them rots; the bounds the benchmarks
report are shown to hold on planted good results and to fail on planted bad ones."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec_tune import SpecdecError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import decision_quality  # noqa: E402
import tuning_cost  # noqa: E402

import common  # noqa: E402  (bench/ is a folder of scripts)


def _run(script: str, out: Path, *extra: str, ok: bool = True) -> dict | subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if not ok:
        return done
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------- decision quality


@pytest.mark.demo
def test_decision_quality_quick(tmp_path):
    r = _run("decision_quality.py", tmp_path / "dq.json")
    mechanisms = r["mechanisms_swept"]
    assert r["source"] == "measured" and r["oracle_kind"] == "every profiled mechanism x D"
    assert r["mechanism"] in mechanisms and len(mechanisms) == 2  # --quick: the plan's and the best other
    # D = 0 once per bucket, every mechanism's D = 1 .. its limit
    assert len(r["sweep"]) == len(r["buckets"]) * (1 + sum(m["max_draft_len"] for m in mechanisms.values()))
    assert sum(p["draft_len"] == 0 for p in r["sweep"]) == len(r["buckets"])
    for row in r["buckets"]:
        here = [p for p in r["sweep"] if p["batch"] == row["batch"]]
        assert row["tokens_per_s"]["oracle"] == max(p["measured_tokens_per_s"] for p in here)
        assert row["scaled"]["tokens_per_s"]["oracle"] == max(p["scaled_measured_tokens_per_s"] for p in here)
    assert "probe ms now / probe ms at profile time" in r["scaling"]["method"]
    assert r["mix"] and sum(r["mix"].values()) == pytest.approx(
        1.0
    )  # the plan's and the predictions' mix: the decoded prompts'
    assert r["cost"]["oracle_sweep_target_forwards"] > 0 and set(r["cost"]["oracle_sweep_drafter_forwards"]) <= set(
        mechanisms
    )
    assert (
        len(r["sweep_settings_hash"]) == 64
        and r["settings"]["held_back_prompts_sha256"]
        and r["sweep_reused_from"] is None
    )
    again = r["confirmation"]  # --quick: one more run of each bucket's plan and oracle where they differ
    assert again["repeats"] == 1 and [b["batch"] for b in again["buckets"]] == [b["batch"] for b in r["buckets"]]
    assert all(
        b["same_config"] or len(b["plan_runs_tokens_per_s"]) == len(b["oracle_runs_tokens_per_s"]) == 1
        for b in again["buckets"]
    )
    md = (tmp_path / "dq.md").read_text()
    assert (
        md.startswith("decision quality, oracle over every profiled mechanism x D")
        and "| plan tok/s | oracle tok/s |" in md
    )

    # the reuse of a sweep made with other settings is refused, naming the setting, before anything is measured
    refused = _run(
        "decision_quality.py",
        tmp_path / "other.json",
        "--reuse-sweep",
        str(tmp_path / "dq.json"),
        "--seed",
        "1",
        ok=False,
    )
    assert refused.returncode == 1 and refused.stderr.strip().count("\n") == 0 and "seed" in refused.stderr
    assert not (tmp_path / "other.json").exists()

    # the bounds are the full bench's claim (measured throughput depends on the machine's load, which a test cannot
    # hold still); here each verdict line the quick run gives is one line naming a bucket or the cost model
    for figures in ("raw", "scaled"):
        for line in decision_quality.check_bounds(r, min_vs_oracle=0.8, max_median_err_pct=25, figures=figures):
            assert "\n" not in line and line.startswith(("batch ", "cost model: ")), line


def test_decision_quality_sweeps_every_profiled_mechanism_once_per_d():
    """On the demo profile (plan: suffix): every drafter the cost model has acceptance for, each up to its own D limit
    and the cap; --quick's two are the plan's and the cost model's best other; --mechanisms plan keeps the plan's; D = 0
    once per bucket."""
    from specdec_tune.autotune.cost_model import CostModel
    from specdec_tune.profiles.schema import load_profile

    profile = load_profile(ROOT / "tests" / "data" / "demo_profile.json")
    cost = CostModel(profile, ctx=128)
    plan = {"mechanism": "suffix", "quant": "none"}
    every = decision_quality.swept_mechanisms(profile, cost, plan, [1, 2], "all", 99, 4)
    assert list(every)[0] == "suffix" and set(every) == {"suffix", "ngram", "draft_model"}
    assert all(m["max_draft_len"] == min(4, cost.draft_len_limit(name)) for name, m in every.items())
    two = decision_quality.swept_mechanisms(profile, cost, plan, [1, 2], "all", 2, 4)
    rated = lambda m: sum(max(cost.predict(B, D, m).tokens_per_s.value for D in range(1, 5)) for B in (1, 2))  # noqa: E731
    assert list(two) == ["suffix", max(["ngram", "draft_model"], key=rated)]
    assert list(decision_quality.swept_mechanisms(profile, cost, plan, [1, 2], "plan", 99, 4)) == ["suffix"]
    points = decision_quality.sweep_points([1, 2], every)
    assert len(points) == 2 * (1 + 3 * 4) and [p for p in points if p[3] == 0] == [
        (1, "none", "none", 0),
        (2, "none", "none", 0),
    ]
    assert len(set(points)) == len(points)
    # the timed runs: every point `repeats` times, a bucket's points interleaved round by round, bucket after bucket
    order = decision_quality.interleaved_runs(points, 3, seed=0)
    assert sorted(order) == sorted(points * 3)
    first = order[: len(points) // 2]  # batch 1's 13 points, once each, before any of them runs again
    assert sorted(first) == sorted(p for p in points if p[0] == 1) and all(p[0] == 1 for p in order[: 3 * len(first)])
    assert order[: len(first)] != order[len(first) : 2 * len(first)]  # shuffled afresh each round


def test_decision_quality_measures_again_in_runs_of_about_the_same_length_at_every_batch():
    # whole batches, at least --rows prompts, and enough to last the run length at the bucket's no-spec speed
    rows = {
        B: decision_quality.run_rows(B, 8, tps, 32, 8.0) for B, tps in ((1, 25.0), (2, 50.0), (4, 90.0), (8, 135.0))
    }
    assert rows == {1: 8, 2: 14, 4: 24, 8: 40}
    assert all(n % B == 0 for B, n in rows.items())
    seconds = [n * 32 / tps for n, tps in zip(rows.values(), (25.0, 50.0, 90.0, 135.0))]
    assert max(seconds) / min(seconds) < 1.25  # was 8 prompts at each batch: 10.2 s at batch 1, 1.9 s at batch 8
    assert decision_quality.run_rows(8, 8, 135.0, 32, 0.0) == 8  # 0: the sweep's own rows
    assert decision_quality.cycled([[1], [2], [3]], 7) == [[1], [2], [3], [1], [2], [3], [1]]


def _point(B: int, mech: str, D: int, tps: float, predicted: float | None = None, ratio: float = 1.0) -> dict:
    return {
        "batch": B,
        "mechanism": mech,
        "quant": "none",
        "draft_len": D,
        "measured_tokens_per_s": tps,
        "measured_tokens_per_forward": 1 + 0.2 * D,
        "device_speed_ratio": ratio,
        "scaled_measured_tokens_per_s": tps * ratio,
        "predicted_tokens_per_s": predicted or tps,
        "predicted_tokens_per_forward": 1 + 0.2 * D,
        "predicted_source": "measured",
    }


# measured tokens/s per (batch, mechanism, D): at batch 1 ngram D=2 is best and D=1 worst, at batch 2 suffix D=1 is best
SWEEP = {
    (1, "none", 0): 50.0,
    (1, "ngram", 1): 40.0,
    (1, "ngram", 2): 70.0,
    (1, "suffix", 1): 60.0,
    (1, "suffix", 2): 65.0,
    (2, "none", 0): 100.0,
    (2, "ngram", 1): 110.0,
    (2, "ngram", 2): 60.0,
    (2, "suffix", 1): 120.0,
    (2, "suffix", 2): 115.0,
}


def _result(schedule: list[list[int]], plan_mech: str, predicted_x: float = 1.0) -> dict:
    points = [_point(B, m, D, tps, predicted=predicted_x * tps) for (B, m, D), tps in SWEEP.items()]
    return decision_quality.summarize(points, schedule, plan_mech, default_k=2) | {"sweep": points}


def test_decision_quality_decisions_and_bounds_on_a_known_sweep():
    r = _result([[1, 2], [2, 2]], "ngram")
    b1, b2 = r["buckets"]
    assert (b1["oracle_mechanism"], b1["oracle_draft_len"], b2["oracle_mechanism"], b2["oracle_draft_len"]) == (
        "ngram",
        2,
        "suffix",
        1,
    )
    assert b2["d_only_oracle_draft_len"] == 1 and b2["vs_oracle"]["plan"] == pytest.approx(60 / 120)
    # the best single config over both buckets, by mean speedup: suffix D=2 (1.3, 1.15) over suffix D=1 (1.2, 1.2),
    # ngram D=2 (1.4, 0.6)
    assert (b1["single_mechanism"], b1["single_draft_len"], b2["tokens_per_s"]["single_d"]) == ("suffix", 2, 115.0)
    assert (
        r["fidelity"]["by_mechanism"]["none"]["tokens_per_forward_median_err_pct"] is None
    )  # D = 0 is 1 by construction
    good = _result(
        [[1, 2], [2, 1]], "suffix"
    )  # suffix D=2 at batch 1 is 65/70 of the oracle, D=1 at batch 2 the oracle
    assert decision_quality.check_bounds(good) == []


def test_decision_quality_measures_the_untied_schedule_where_it_was_swept():
    r = _result([[1, 1], [2, 1]], "ngram")
    plan = {"mechanism": "ngram", "study": {"untied_schedule": [[1, 2], [2, 3]]}}
    one, two = decision_quality.untied_measured(plan, r["sweep"], r["buckets"])
    assert one == {
        "batch": 1,
        "mechanism": "ngram",
        "draft_len": 2,
        "measured_tokens_per_s": 70.0,
        "vs_oracle": pytest.approx(1.0),
    }
    assert (
        two["draft_len"] == 3 and two["measured_tokens_per_s"] is None and two["vs_oracle"] is None
    )  # D = 3 was not swept
    plan["study"]["untied_drafter"] = {"mechanism": "suffix", "quant": "none"}  # a drafter tie: the one passed over
    again = decision_quality.untied_measured(plan, r["sweep"], r["buckets"])
    assert [(u["mechanism"], u["measured_tokens_per_s"]) for u in again] == [("suffix", 65.0), ("suffix", None)]


def test_decision_quality_states_the_sweeps_own_noise_around_plan_over_oracle():
    """Runs spread ±10% (log sd 0.1 about each point's median): plan / oracle carries the interval two medians of 3
    runs at that noise allow; the bucket whose plan is the oracle has none; a sweep without runs states nothing."""
    spread = [
        math.exp(-0.1),
        1.0,
        math.exp(0.1),
    ]  # |ln| deviations 0.1 (the median's 0 left out): pooled sd 1.4826 x 0.1
    points = [
        _point(B, m, D, tps) | {"runs_tokens_per_s": [tps * f for f in spread]} for (B, m, D), tps in SWEEP.items()
    ]
    noise = decision_quality.summarize(points, [[1, 1], [2, 1]], "suffix", default_k=1)["sweep_noise"]
    assert noise["run_rel_sd"] == pytest.approx(0.14826)
    one, two = noise["buckets"]
    h = math.sqrt(2) * 1.96 * math.sqrt(math.pi / 2) * 0.14826 / math.sqrt(3)
    assert one["plan_vs_oracle"] == pytest.approx(60 / 70) and one["low"] == pytest.approx(60 / 70 * math.exp(-h))
    assert one["high"] == pytest.approx(60 / 70 * math.exp(h)) and one["high"] > 1  # inside the sweep's noise
    assert two == {"batch": 2, "plan_vs_oracle": 1.0, "low": 1.0, "high": 1.0}
    assert (
        decision_quality.summarize(points[:1] + [_point(1, "ngram", 1, 40.0)], [[1, 1]], "ngram", default_k=1)[
            "sweep_noise"
        ]
        is None
    )


def test_decision_quality_measures_plan_and_oracle_again_and_judges_the_bounds_on_that():
    """The sweep's oracle at batch 1 (ngram D=2, 70) is measured again with the plan (suffix D=1, 60): the re-measure's
    medians decide the ratio, with the interval the runs' spread gives; batch 2's plan is its oracle (no runs)."""
    r = _result([[1, 1], [2, 1]], "suffix")
    points = decision_quality.headline_points(r["buckets"], "suffix", {"ngram": "none", "suffix": "none"})
    # batch 1: the plan, no speculation, the default K (suffix D=2, also the best single), the oracle; batch 2: the
    # plan (its oracle), no speculation, the default K and best single
    assert points == [
        (1, "suffix", "none", 1),
        (1, "none", "none", 0),
        (1, "suffix", "none", 2),
        (1, "ngram", "none", 2),
        (2, "suffix", "none", 1),
        (2, "none", "none", 0),
        (2, "suffix", "none", 2),
    ]
    spread = [math.exp(-0.1), 1.0, math.exp(0.1)]
    again = decision_quality.confirmed(
        r["buckets"], {(1, "suffix", 1): [66 * f for f in spread], (1, "ngram", 2): [67 * f for f in spread]}, 3
    )
    one, two = again["buckets"]
    h = math.sqrt(2) * 1.96 * math.sqrt(math.pi / 2) * 0.14826 / math.sqrt(3)
    assert one["plan_vs_oracle"] == pytest.approx(66 / 67) and one["low"] == pytest.approx(66 / 67 * math.exp(-h))
    assert two["same_config"] and two["plan_vs_oracle"] == 1.0 and again["plan_min_vs_oracle"] == pytest.approx(66 / 67)
    # the sweep alone puts batch 1 at 60/70 = 86%: below a 90% bound, which the re-measure (98.5%) keeps
    assert len(decision_quality.check_bounds(r, min_vs_oracle=0.9)) == 1
    assert decision_quality.check_bounds(r | {"confirmation": again}, min_vs_oracle=0.9) == []
    planted = decision_quality.confirmed(r["buckets"], {(1, "suffix", 1): [50.0] * 3, (1, "ngram", 2): [70.0] * 3}, 3)
    violations = decision_quality.check_bounds(r | {"confirmation": planted}, min_vs_oracle=0.9)
    assert (
        len(violations) == 1
        and "batch 1" in violations[0]
        and "71.4%" in violations[0]
        and "measured again" in violations[0]
    )
    assert "71.4% in every bucket" in decision_quality.confirmation_line(planted)


def test_decision_quality_bounds_fail_on_a_planted_bad_plan():
    worst = _result([[1, 1], [2, 2]], "ngram")  # the plan picks the worst measured D in both buckets
    violations = decision_quality.check_bounds(worst, min_vs_oracle=0.8, max_median_err_pct=25)
    assert len(violations) == 2
    assert "batch 1" in violations[0] and "ngram D=1" in violations[0] and "ngram D=2" in violations[0]
    assert "batch 2" in violations[1] and "ngram D=2" in violations[1] and "suffix D=1" in violations[1]


def test_decision_quality_bounds_fail_on_predictions_off_by_2x():
    off = _result([[1, 2], [2, 1]], "suffix", predicted_x=2.0)
    assert off["fidelity"]["tokens_per_s_median_err_pct"] == pytest.approx(100.0)
    violations = decision_quality.check_bounds(off)
    assert len(violations) == 1 and "cost model" in violations[0] and "100.0%" in violations[0]


def test_decision_quality_scaled_figures_sit_beside_the_raw_ones():
    """A point measured while the device ran 2x slower: raw, it loses the bucket; scaled to profile-time speed, it
    wins."""
    points = [_point(1, "none", 0, 50.0), _point(1, "ngram", 1, 40.0, ratio=2.0), _point(1, "ngram", 2, 60.0)]
    r = decision_quality.summarize(points, [[1, 1]], "ngram", default_k=1)
    row = r["buckets"][0]
    assert (row["oracle_draft_len"], row["scaled"]["oracle_draft_len"]) == (2, 1)
    assert row["vs_oracle"]["plan"] == pytest.approx(40 / 60) and row["scaled"]["vs_oracle"]["plan"] == 1.0
    assert decision_quality.check_bounds(r) != [] and decision_quality.check_bounds(r, figures="scaled") == []


def test_decision_quality_reuse_refuses_other_settings():
    settings = {
        "profile_sha256": "a" * 64,
        "new_tokens": 8,
        "repeats": 1,
        "seed": 0,
        "mechanisms": {"ngram": {"quant": "none", "max_draft_len": 2}},
    }
    decision_quality.check_reuse({"settings": dict(settings)}, settings, "old.json")  # the same: taken
    changed = settings | {"repeats": 2, "mechanisms": {"suffix": {"quant": "none", "max_draft_len": 2}}}
    with pytest.raises(SpecdecError, match="old.json was swept with repeats = 1, this run has 2"):
        decision_quality.check_reuse({"settings": settings}, changed, "old.json")
    with pytest.raises(SpecdecError, match="records no sweep settings"):
        decision_quality.check_reuse({"sweep": []}, settings, "old.json")


# ---------------------------------------------------------------------------- the other scripts


@pytest.mark.demo
def test_al_derivation_quick(tmp_path):
    r = _run("al_derivation.py", tmp_path / "al.json")
    rows = r["drafters"]["ngram"]["rows"]
    assert [x["draft_len"] for x in rows] == [1, 2] and all(x["direct"] >= 1.0 and x["derived"] >= 1.0 for x in rows)


@pytest.mark.demo
def test_learned_heads_extrapolation_and_draft_curves(tmp_path):
    """The learned-heads summary: the learning-curve fit recovers a known log-linear curve, and the draft-time curves
    come out of a profile per mechanism and batch with their last-to-first ratio."""
    import learned_heads

    curve = [
        {"training_tokens": n, "tokens_per_forward": 1.0 + 0.1 * __import__("math").log(n / 1000)}
        for n in (1000, 10_000, 100_000)
    ]
    e = learned_heads.extrapolate(curve, 1.5, tokens_per_s=1000.0)
    assert e["source"] == "modeled" and abs(e["tokens_needed"] / (1000 * 2.718281828**5) - 1) < 1e-6
    assert abs(e["train_hours_at_run_throughput"] - e["tokens_needed"] / 1000 / 3600) < 1e-9
    falling = [dict(p, tokens_per_forward=2 - p["tokens_per_forward"]) for p in curve]
    assert "does not grow" in learned_heads.extrapolate(falling, 1.5, 1.0)["note"]
    profile = {
        "draft": [
            {
                "mechanism": "dflash",
                "quant": "none",
                "batch": 1,
                "draft_len": d,
                "median_ms": 10.0 + 0.1 * d,
                "source": "measured",
            }
            for d in (1, 7)
        ]
        + [{"mechanism": "ngram", "quant": "none", "batch": 1, "draft_len": 1, "median_ms": 1.0, "source": "measured"}]
    }
    (tmp_path / "p.json").write_text(json.dumps(profile))
    curves = learned_heads.draft_curves(tmp_path / "p.json")
    assert set(curves) == {"dflash"} and abs(curves["dflash"]["1"]["ratio_last_to_first"] - 10.7 / 10.1) < 1e-9


# ---------------------------------------------------------------------------- tuning cost


@pytest.mark.demo
def test_tuning_cost_quick(tmp_path):
    r = _run("tuning_cost.py", tmp_path / "tc.json")
    assert r["target_forwards"] > 0 and r["profile_s"] > 0 and r["search_s"] > 0
    assert (
        r["drafters"] == ["ngram"] and r["drafter_forwards"] == {}
    )  # the quick profile's n-gram drafter runs no network
    assert set(r["forwards_counted"]) >= {"target", "draft_model"}
    assert tuning_cost.check_bounds(r) == []


def test_tuning_cost_bounds_fail_on_planted_results():
    good = {
        "target_forwards": 4444,
        "drafters": ["ngram", "draft_model"],
        "drafter_forwards": {"draft_model": 18636},
        "oracle": {"target_forwards": 20436, "from": "bench/results/decision_quality.json"},
    }
    assert tuning_cost.check_bounds(good) == []
    swapped = good | {"target_forwards": 20436, "oracle": good["oracle"] | {"target_forwards": 4444}}
    (v,) = tuning_cost.check_bounds(swapped)
    assert "20436 target forwards, not below the oracle sweep's 4444" in v
    uncounted = good | {"drafter_forwards": {}}
    (v,) = tuning_cost.check_bounds(uncounted)
    assert v.startswith("drafter draft_model: no forward counted")


def test_tuning_cost_reads_an_oracle_result_from_before_every_mechanism_was_swept():
    old = json.loads((ROOT / "bench" / "results" / "decision_quality.json").read_text())
    o = tuning_cost.oracle_cost(old, ROOT / "bench" / "results" / "decision_quality.json")
    assert o["target_forwards"] == old["cost"]["oracle_sweep_target_forwards"] and o["points"] == len(old["sweep"])
    assert o["oracle_kind"] == old.get("oracle_kind", "D-only (plan's mechanism)") and o["mechanisms"]


def test_the_committed_tuning_cost_quotes_the_committed_oracle_sweep():
    """tuning_cost.json copies the oracle sweep's cost from decision_quality.json when it is written: a sweep committed
    after it leaves the docs quoting an oracle no committed file has."""
    path = ROOT / "bench" / "results" / "decision_quality.json"
    committed = json.loads((ROOT / "bench" / "results" / "tuning_cost.json").read_text())["oracle"]
    assert committed == tuning_cost.oracle_cost(json.loads(path.read_text()), path) | {"from": committed["from"]}


# ---------------------------------------------------------------------------- counting forwards


def _tiny_target(layers: int = 6):
    from specdec_tune.profiles.models.folders import ModelRef
    from specdec_tune.profiles.models.llama import CausalLM, ModelConfig, init_random
    from specdec_tune.profiles.models.loading import LoadedModel

    c = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = init_random(CausalLM(c), seed=0).eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=None, ref=ModelRef("tiny", "hf", "llama", "float32", "c", "w", layers))


@pytest.mark.parametrize("mechanism", ["draft_model", "eagle3", "mtp", "dflash", "dspark"])
def test_forward_counter_counts_the_target_and_each_drafter_apart(mechanism):
    """One decode of one prompt: the target runs its prefill and one verify per round; a serial drafter (draft model,
    EAGLE-3, MTP) one pass per drafted token (the catch-up gives the first), a block head one pass per round that
    drafted."""
    from specdec_tune.profiles.drafters import create
    from specdec_tune.profiles.specdec import generate

    target = _tiny_target()
    drafter = create(mechanism, target, {"layers": "2"} if mechanism == "draft_model" else {"random": "true"})
    out, counter, _ = common.counted(
        lambda: generate(target.model, [[1, 2, 3, 4, 5]], drafter=drafter, num_draft_tokens=3, max_new_tokens=9)
    )
    c = out.counters
    assert c.num_drafts > 1
    expected = c.num_drafts if mechanism in ("dflash", "dspark") else c.num_draft_tokens
    assert counter.summary(6) == {"target_forwards": out.target_forwards + 1, "drafter_forwards": {mechanism: expected}}


def test_forward_counter_counts_a_generic_path_target_and_its_cut_draft(hf_variant_dir, tmp_path, monkeypatch):
    from specdec_tune.profiles.drafters import create
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.specdec import generate

    monkeypatch.setenv("SPECDEC_TUNE_CACHE", str(tmp_path / "cache"))
    target = load_model(str(hf_variant_dir("gemma2")), dtype="float32")
    drafter = create("draft_model", target, {"layers": "1"})
    out, counter, _ = common.counted(
        lambda: generate(target.model, [[1, 2, 3, 4, 5]], drafter=drafter, num_draft_tokens=3, max_new_tokens=9)
    )
    assert counter.summary(3) == {
        "target_forwards": out.target_forwards + 1,
        "drafter_forwards": {"draft_model": out.counters.num_draft_tokens},
    }


def test_forward_counter_leaves_out_what_runs_paused():
    """The decision-quality sweep probes the device's speed between its timed runs: those forwards are not the
    sweep's."""
    from specdec_tune.profiles.specdec import generate

    target = _tiny_target()
    counter = common.ForwardCounter()
    with counter.active():
        generate(target.model, [[1, 2, 3]], max_new_tokens=3)
        counted = counter.summary(6)
        counter.paused(lambda: generate(target.model, [[1, 2, 3]], max_new_tokens=3))()
    assert counted["target_forwards"] > 0 and counter.summary(6) == counted


def test_acceptance_coverage_states_what_a_calibrated_interval_would_cover():
    """A held-back mean of m prompts against a 95% interval of the mean of n: inside with chance
    erf(1.96 / sqrt(2 (1 + n/m))), 95% only when the held-back set is much larger than the profile's; checked against
    a simulation."""
    import acceptance_coverage

    assert acceptance_coverage.calibrated_coverage(7, 3) == pytest.approx(0.715, abs=0.002)
    assert acceptance_coverage.calibrated_coverage(7, 10**9) == pytest.approx(0.95, abs=1e-4)
    gen = torch.Generator().manual_seed(0)
    n, m, trials = 7, 3, 20000
    profile, held = torch.randn(trials, n, generator=gen), torch.randn(trials, m, generator=gen)
    half = 1.96 / n**0.5  # the known per-prompt spread: the interval's width is not what is simulated
    inside = ((held.mean(1) - profile.mean(1)).abs() <= half).float().mean().item()
    assert inside == pytest.approx(acceptance_coverage.calibrated_coverage(n, m), abs=0.01)


def test_acceptance_coverage_subsamples_a_large_domain_and_widening_restores_coverage():
    """A domain of 200 prompts with skewed per-prompt acceptance stands in for the population: intervals over 7 of them
    cover its tokens per forward near 95% when widened, clearly less as plain percentiles."""
    import types

    import acceptance_coverage

    rng = np.random.default_rng(3)
    n, D = 200, 3
    tpf = 1 + rng.gamma(1.5, 0.25, n)  # per prompt, at every D >= 1
    emitted = np.full((n, D + 1), 60.0)
    rounds = np.concatenate([emitted[:, :1], 60.0 / tpf[:, None].repeat(D, 1)], axis=1)
    drafts = rounds.copy()
    drafts[:, 0] = 0
    per_prompt = types.SimpleNamespace(
        domains=["big"] * n + ["small"] * 3,
        **{
            k: np.concatenate([v, v[:3]]).tolist()
            for k, v in {"emitted": emitted, "rounds": rounds, "accepted": emitted - rounds, "drafts": drafts}.items()
        },
    )
    record = types.SimpleNamespace(
        domain="all", quant="none", temperature=0.0, per_prompt=per_prompt, max_draft_len=D, mechanism="m"
    )
    [seven, twenty] = acceptance_coverage.subsample_coverage(
        types.SimpleNamespace(acceptance=[record]), D, seed=0, draws=400
    )
    assert seven["domain"] == "big" and seven["prompts"] == 7 and twenty["prompts"] == 20
    assert 0.88 <= seven["coverage_widened"] <= 0.99 and seven["coverage_plain"] < seven["coverage_widened"] - 0.03


@pytest.mark.demo
def test_prompt_cut_replays_the_same_prompts_cut_and_whole(tmp_path):
    r = _run("prompt_cut.py", tmp_path / "cut.json")
    assert [x["domain"] for x in r["prompts"]] and len(r["prompts"]) == 2 and r["draft_len"] == 3
    assert all(x["prompt_tokens"] >= x["cut_to"] == r["prompts"][0]["cut_to"] for x in r["prompts"])
    assert all(
        1.0 <= x[f"{k}_tokens_per_forward"] <= 1 + r["draft_len"] for x in r["prompts"] for k in ("cut", "whole")
    )
    assert set(r["pooled_tokens_per_forward"]) == {"cut", "whole"} and (tmp_path / "cut.md").read_text().startswith(
        "ngram tokens per forward"
    )


def test_the_benches_prompts_cut_to_the_context_or_whole_where_they_fit():
    from specdec_tune.profiles.prompts import cut_to_context

    prompts = [(list(range(n)), f"d{n}") for n in (10, 40, 60, 100, 200)]
    cut = cut_to_context(prompts, ctx=64, new_tokens=16)  # 56 tokens each: the long ones' last 56
    assert [(len(ids), d) for ids, d in cut] == [(56, "d60"), (56, "d100"), (56, "d200")] and cut[-1][0] == list(
        range(144, 200)
    )
    whole = cut_to_context(prompts, ctx=64, new_tokens=16, whole=True)  # between 28 and 56 tokens, as they are
    assert whole == [(list(range(40)), "d40")]


# tokens/s per configuration measured again at batches 1 and 2 of `_result([[1, 1], [2, 1]], "suffix")`
HEADLINE_LEVEL = {
    (1, "suffix", 1): 67.0,
    (1, "none", 0): 50.0,
    (1, "suffix", 2): 66.0,
    (1, "ngram", 2): 67.0,
    (2, "suffix", 1): 120.0,
    (2, "none", 0): 100.0,
    (2, "suffix", 2): 115.0,
}


def test_the_headline_corrects_each_run_by_its_device_speed_beside_the_raw_figures():
    """Planted runs (8 rounds) on a device whose speed moves run by run (a probe factor of sd 15%), each run's tokens/s
    showing 60% of its factor's slowdown: the fitted elasticity recovers 0.6, the speed-corrected plan / oracle is the
    planted 0.99 with an interval a fraction of the raw one's, and the scaled bounds judge the corrected figures."""
    rng = np.random.default_rng(0)
    r = _result([[1, 1], [2, 1]], "suffix")
    # at batch 1 the plan (suffix D=1) 1% under the oracle (n-gram D=2) and above the default K (suffix D=2)
    level = HEADLINE_LEVEL | {(1, "suffix", 1): 66.0, (1, "suffix", 2): 64.0, (1, "ngram", 2): 66.67}
    factors = {key: list(np.exp(rng.normal(0.0, 0.15, 8))) for key in level}
    runs = {key: [tps * f**-0.6 * math.exp(rng.normal(0.0, 0.002)) for f in factors[key]] for key, tps in level.items()}
    h = decision_quality.headline(r["buckets"], runs, "suffix", factors)
    sc = h["speed_corrected"]
    assert sc["elasticity"] == pytest.approx(0.6, abs=0.02)
    raw, fixed = h["buckets"][0]["plan_vs"]["oracle"], sc["buckets"][0]["plan_vs"]["oracle"]
    assert fixed["value"] == pytest.approx(66 / 66.67, rel=0.005) and fixed["low"] > 0.97
    assert (fixed["high"] - fixed["low"]) < (raw["high"] - raw["low"]) / 5
    assert common.speed_elasticity(runs, {k: [1.0] * 8 for k in runs}) == 0.0  # no spread: no correction
    result = {
        "buckets": [b | {"scaled": b} for b in r["buckets"]],
        "fidelity": {"points": 7, "tokens_per_s_median_err_pct": 0.0, "scaled": {"tokens_per_s_median_err_pct": 0.0}},
        "headline": h,
        "cost": {"tuning_vs_oracle": 0.2},
    }
    assert decision_quality.check_bounds(result, figures="scaled") == []
    lines = decision_quality.headline_lines(
        result
        | {"refinement": None, "refine_skipped": "--no-refine", "targets_stated": decision_quality.TARGETS}
        | {"cost": {"profile_s": 1.0, "search_s": 1.0, "tuning_vs_oracle": 0.2, "oracle_sweep_s": 10.0}}
    )
    assert any(x.startswith("speed-corrected beside them (elasticity 0.60") for x in lines)


def test_decision_quality_headline_pairs_every_baseline_round_by_round_and_holds_the_targets():
    """Planted runs measured again (3 rounds, the device 10% slower in round 2 for every configuration alike): the
    paired ratios cancel the slow round; a plan 3% below the best single configuration and 4% below the oracle at
    batch 1 breaks the targets, a plan level with them keeps them."""
    r = _result([[1, 1], [2, 1]], "suffix")
    drift = [1.0, 0.9, 1.0]

    def runs(level: dict) -> dict:
        return {key: [tps * f * (1 + 0.001 * i) for i, f in enumerate(drift)] for key, tps in level.items()}

    level = HEADLINE_LEVEL
    good = decision_quality.headline(r["buckets"], runs(level), "suffix")
    one, two = good["buckets"]
    assert (
        one["plan_vs"]["oracle"]["value"] == pytest.approx(1.0, abs=1e-3)
        and not one["plan_vs"]["oracle"]["same_config"]
    )
    assert one["plan_vs"]["oracle"]["high"] - one["plan_vs"]["oracle"]["low"] < 0.01  # the slow round cancels
    assert two["plan_vs"]["oracle"] == {"value": 1.0, "low": 1.0, "high": 1.0, "same_config": True}
    plan_speedup = (67 / 50 + 120 / 100) / 2
    assert good["mean_speedup"]["plan"]["value"] == pytest.approx(plan_speedup, rel=1e-3)
    assert good["plan_vs_mean_speedup"]["single_d"]["value"] == pytest.approx(
        plan_speedup / ((66 / 50 + 115 / 100) / 2), rel=1e-3
    )
    assert decision_quality.headline_bounds(good, tuning_vs_oracle=0.2) == []

    worse = level | {(1, "suffix", 1): 64.0}  # 4.5% below the oracle, and below the default K there
    bad = decision_quality.headline(r["buckets"], runs(worse), "suffix")
    violations = decision_quality.headline_bounds(bad, tuning_vs_oracle=0.5)
    assert any("batch 1" in v and "of the oracle (ngram D=2)" in v for v in violations)
    assert any("of the engine's default (suffix D=2)" in v for v in violations)
    assert any("tuning cost 0.50" in v for v in violations)
    lines = decision_quality.headline_lines(
        {
            "headline": bad,
            "refinement": None,
            "refine_skipped": "--no-refine",
            "cost": {
                "profile_s": 200.0,
                "search_s": 5.0,
                "refine_s": 0.0,
                "tuning_vs_oracle": 0.5,
                "oracle_sweep_s": 410.0,
            },
            "targets_stated": decision_quality.TARGETS,
        }
    )
    assert lines[0].startswith("headline: the plan (not refined (--no-refine))") and "| 1 | suffix D=1 |" in lines[3]


def test_fresh_profiles_plans_agree_only_where_each_prediction_is_inside_the_others_interval():
    import fresh_clone

    def run(index: int, draft_lens: list[int], speedups: list[tuple[float, float, float]]) -> dict:
        buckets = [
            {"batch": B, "draft_len": D, "speedup": {"value": v, "low": lo, "high": hi}}
            for B, D, (v, lo, hi) in zip((1, 2), draft_lens, speedups)
        ]
        return {"run": index, "plan": {"mechanism": "suffix", "buckets": buckets}}

    a = run(1, [5, 4], [(1.25, 1.17, 1.34), (1.19, 1.12, 1.27)])
    b = run(2, [7, 4], [(1.27, 1.19, 1.36), (1.20, 1.13, 1.28)])  # another D at batch 1, inside the noise
    c = run(3, [5, 4], [(1.40, 1.35, 1.45), (1.19, 1.12, 1.27)])  # batch 1 outside a's interval
    agree = fresh_clone.agreement([a, b])
    assert agree["all_agree"] and agree["pairs"][0]["buckets"][0]["draft_len"] == [5, 7]
    apart = fresh_clone.agreement([a, b, c])
    assert not apart["all_agree"]
    assert [p["agree"] for p in apart["pairs"]] == [True, False, False]
    assert fresh_clone.agreement([a, {"run": 2, "rc": 1}]) is None


def test_fresh_profiles_plans_of_two_drafters_agree_only_where_each_states_the_other_inside_its_noise():
    """Two plans that took different drafters agree where each names the other's as its runner-up with their ratio's
    interval reaching 1.0 (the profile could not separate them), and not where either separates them or names
    another."""
    import fresh_clone

    def run(index: int, mechanism: str, runner_up: str, low: float, high: float) -> dict:
        buckets = [{"batch": 1, "draft_len": 5, "speedup": {"value": 1.25, "low": 1.17, "high": 1.34}}]
        ratio = {"value": (low + high) / 2, "low": low, "high": high, "source": "modeled"}
        return {
            "run": index,
            "plan": {
                "mechanism": mechanism,
                "buckets": buckets,
                "drafter_runner_up": {"runner_up": runner_up, "runner_up_vs_choice": ratio, "p_beats_runner_up": 0.6},
            },
        }

    ngram, suffix = run(1, "ngram", "suffix", 0.98, 1.03), run(2, "suffix", "ngram", 0.97, 1.02)
    pair = fresh_clone.agreement([ngram, suffix])["pairs"][0]
    assert pair["agree"] and pair["drafters_inseparable"] and not pair["same_mechanism"]
    shown = {
        "commit": "0" * 12,
        "machine": {"cpu_model": "cpu", "cores": 2},
        "runs": [],
        "plans_agree": {"pairs": [pair]},
    }
    assert "names the other's drafter as its runner-up" in fresh_clone.table(shown)
    separated = run(2, "suffix", "ngram", 0.90, 0.99)  # suffix's profile puts n-gram measurably below it
    assert not fresh_clone.agreement([ngram, separated])["all_agree"]
    another = run(2, "suffix", "draft_model", 0.97, 1.02)
    assert not fresh_clone.agreement([ngram, another])["all_agree"]


@pytest.mark.demo
def test_refine_price_decodes_each_contender_through_the_refinements_own_groups(tmp_path):
    """--quick: the plan's first bucket, no speculation, the plan's D and D_max, two groups of one prompt each."""
    r = _run("refine_price.py", tmp_path / "price.json")
    rows = r["contenders"]
    assert len({x["batch"] for x in rows}) == 1 and {x["draft_len"] for x in rows} >= {0}
    assert all(len(x["measured_group_runs_s"]) == r["groups"] - 1 == 1 for x in rows)
    assert all(x["priced_first_s"] > x["priced_group_s"] > 0 and x["measured_group_s"] > 0 for x in rows)  # warm-ups
    assert r["total_priced_s"] == pytest.approx(sum(x["priced_first_s"] + x["priced_group_s"] for x in rows))
    assert r["total_measured_s"] == pytest.approx(sum(x["measured_first_s"] + x["measured_group_s"] for x in rows))
    assert (tmp_path / "price.md").read_text().startswith("The refinement's price")
