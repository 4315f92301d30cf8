"""search on version-2 profiles: intervals through the cost model, true labels, out-of-memory buckets, ties on
evidence, domain mixes, and what `search` prints. Version-2 profiles are built in memory from the recorded
version-1 demo profile (intervals, fitted and infeasible cells, replayed acceptance, host points at several D)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import SOURCES, CostModel, Figure, weakest
from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.autotune.space import Candidate, Space
from specdec_tune.cli import _plan_findings, _print_plan_table, main
from specdec_tune.profiles.intervals import isotonic_line
from specdec_tune.profiles.schema import Profile, load_profile

PROFILE_PATH = Path(__file__).parent / "data" / "demo_profile.json"
MIX = {"writing": 0.5, "coding": 0.3, "humaneval": 0.2}


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE_PATH)


def version2(
    profile: Profile,
    *,
    verify_rel: float = 0.03,
    draft_rel: float = 0.05,
    tpf_rel: float = 0.03,
    method: str = "replay",
    infeasible: tuple = (),
    absent: tuple = (),
    fitted: dict | None = None,
    host: dict | None = None,
    update_acceptance=None,
    fp8_draft: bool = False,
) -> Profile:
    """The demo profile as a version-2 profile would hold it.

    verify_rel, draft_rel: relative half-width of the 95% interval of every measured cell's median;
    tpf_rel: of tokens per forward (every record, every D > 0); infeasible / absent: verify cells (B, 1+D, ctx)
    out of memory / never timed; fitted: {(B, 1+D, ctx): (raw_ms, fitted_ms)}; host: {mechanism: {D: ms per
    round at every batch}} replacing that mechanism's host points; update_acceptance(record) -> fields to change;
    fp8_draft: FP8 draft times as if measured (the full-precision times).
    """
    data = profile.model_dump(mode="json")
    data["schema_version"] = 2
    data["workload"]["prompts_by_domain"] = {d: profile.workload.prompts_per_domain for d in profile.workload.domains}
    verify = []
    for v in data["verify"]:
        key = (v["batch"], v["tokens"], v["ctx"])
        if key in absent:
            continue
        if key in infeasible:
            v |= {"median_ms": None, "p10_ms": None, "p90_ms": None, "source": "infeasible"}
        elif fitted and key in fitted:
            raw, fit = fitted[key]
            v |= {
                "median_ms": fit,
                "raw_median_ms": raw,
                "fit_moved": True,
                "source": "fitted",
                "ci_low_ms": raw * (1 - verify_rel),
                "ci_high_ms": raw * (1 + verify_rel),
            }
        elif v["source"] == "measured":
            v |= {
                "raw_median_ms": v["median_ms"],
                "ci_low_ms": v["median_ms"] * (1 - verify_rel),
                "ci_high_ms": v["median_ms"] * (1 + verify_rel),
            }
        verify.append(v)
    data["verify"] = verify
    for d in data["draft"]:
        d |= {"ci_low_ms": d["median_ms"] * (1 - draft_rel), "ci_high_ms": d["median_ms"] * (1 + draft_rel)}
    if fp8_draft:
        data["draft"] += [d | {"quant": "fp8"} for d in data["draft"] if d["mechanism"] == "draft_model"]
    for a in data["acceptance"]:
        a["method"] = method
        a["tokens_per_forward_ci"] = [
            [max(1.0, t * (1 - tpf_rel)) if D else 1.0, t * (1 + tpf_rel) if D else 1.0]
            for D, t in enumerate(a["tokens_per_forward"])
        ]
        a["mean_al_vllm_ci"] = [[t, t] for t in a["mean_al_vllm"]]
        if update_acceptance:
            a |= update_acceptance(a)
    for mechanism, by_len in (host or {}).items():
        data["host"] = [h for h in data["host"] if h["mechanism"] != mechanism]
        data["host"] += [
            {
                "mechanism": mechanism,
                "batch": B,
                "draft_len": D,
                "host_ms_per_round": ms,
                "round_ms": 0.0,
                "rounds": 16,
                "source": "measured",
            }
            for D, ms in by_len.items()
            for B in profile.workload.batch_buckets
        ]
    return Profile.model_validate(data)


def cell(profile: Profile, batch: int, tokens: int, ctx: int = 128):
    return next(v for v in profile.verify if (v.batch, v.tokens, v.ctx) == (batch, tokens, ctx))


def record(profile: Profile, mechanism: str, quant: str = "none", domain: str = "all"):
    return next(
        a
        for a in profile.acceptance
        if (a.mechanism, a.quant, a.domain, a.temperature) == (mechanism, quant, domain, 0.0)
    )


@pytest.fixture(scope="module")
def v2(profile) -> Profile:
    return version2(profile)


# ---------------------------------------------------------------------------- 1. intervals through the cost model


def test_components_carry_the_profile_intervals(v2):
    cost = CostModel(v2)
    c = cell(v2, 4, 1)
    one = cost.verify_ms(4, 1)
    assert (one.value, one.source, one.low, one.high) == (c.median_ms, "measured", c.ci_low_ms, c.ci_high_ms)
    # between the buckets 2 and 4: the value and both bounds on their lines
    a, b, mid = cell(v2, 2, 1), cell(v2, 4, 1), cost.verify_ms(3, 1)
    assert mid.source == "interpolated"
    assert (mid.value, mid.low, mid.high) == pytest.approx(
        ((a.median_ms + b.median_ms) / 2, (a.ci_low_ms + b.ci_low_ms) / 2, (a.ci_high_ms + b.ci_high_ms) / 2)
    )
    assert (
        cost.verify_ms(64, 1).source == "modeled" and not cost.verify_ms(64, 1).has_interval
    )  # extrapolated: no interval
    d = next(p for p in v2.draft if (p.mechanism, p.quant, p.batch, p.draft_len) == ("ngram", "none", 4, 3))
    assert (cost.draft_ms("ngram", "none", 4, 3).low, cost.draft_ms("ngram", "none", 4, 3).high) == (
        d.ci_low_ms,
        d.ci_high_ms,
    )
    tpf = cost.tokens_per_forward("ngram", "none", 3)
    assert [tpf.low, tpf.high] == record(v2, "ngram").tokens_per_forward_ci[3]


def shares_at(rec, D: int) -> list[float]:
    """P(L), L = 0..D, of a record's rounds at draft length D: D_max's rounds capped at D, the share of rounds that
    draft from D's own figures (tokens per forward = 1 + q (AL - 1))."""
    p = [sum(r) / sum(map(sum, rec.rounds)) for r in rec.rounds]
    capped = p[:D] + [sum(p[D:])]
    q = (rec.tokens_per_forward[D] - 1) / (rec.mean_al_vllm[D] - 1)
    return [1 - q] + [q * x / (1 - capped[0]) for x in capped[1:]]


def test_prediction_interval_by_hand(v2):
    """TPS low = B·AL_low / (T_verif_high + T_draft_high + T_host), high the other way; speedup over the baseline's
    value."""
    cost = CostModel(v2)
    B, D = 4, 3
    rec = record(v2, "ngram")
    F = [sum(shares_at(rec, D)[: w + 1]) for w in range(D)] + [1.0]
    p_max = [F[w] ** B - (F[w - 1] ** B if w else 0.0) for w in range(D + 1)]
    bound = lambda attr: sum(p * getattr(cell(v2, B, 1 + w), attr) for w, p in enumerate(p_max))  # noqa: E731
    verify_low, verify_high = bound("ci_low_ms"), bound("ci_high_ms")
    draft = next(p for p in v2.draft if (p.mechanism, p.quant, p.batch, p.draft_len) == ("ngram", "none", B, D))
    host = next(h.host_ms_per_round for h in v2.host if (h.mechanism, h.batch, h.draft_len) == ("ngram", B, D))
    tpf_low, tpf_high = rec.tokens_per_forward_ci[D]
    pred = cost.predict(B, D, "ngram")
    low = 1e3 * B * tpf_low / (verify_high + draft.ci_high_ms + host)
    high = 1e3 * B * tpf_high / (verify_low + draft.ci_low_ms + host)
    assert (pred.tokens_per_s.low, pred.tokens_per_s.high) == pytest.approx((low, high))
    assert pred.tokens_per_s.low < pred.tokens_per_s.value < pred.tokens_per_s.high
    assert (pred.per_user_tokens_per_s.low, pred.per_user_tokens_per_s.high) == pytest.approx((low / B, high / B))
    base = cost.baseline_tokens_per_s(B).value
    assert (pred.speedup.low, pred.speedup.high) == pytest.approx((low / base, high / base))
    # no speculation: the interval of the one-token verify step
    one = cell(v2, B, 1)
    plain = cost.predict(B, 0, "ngram").tokens_per_s
    h0 = next(h.host_ms_per_round for h in v2.host if (h.mechanism, h.batch) == ("plain", B))
    assert (plain.low, plain.high) == pytest.approx((1e3 * B / (one.ci_high_ms + h0), 1e3 * B / (one.ci_low_ms + h0)))


def test_a_version_1_profile_has_no_intervals(profile):
    pred = CostModel(profile).predict(4, 3, "ngram")
    assert all(
        not f.has_interval
        for f in (pred.tokens_per_s, pred.speedup, pred.tokens_per_forward, pred.verify_ms, pred.draft_ms)
    )


# ---------------------------------------------------------------------------- 2. labels that are true


def test_a_loop_run_derives_every_shorter_draft_and_a_replay_counts_every_one(profile, v2):
    loop = CostModel(profile)
    assert {c.draft_len for c in record(profile, "ngram").checks} == {3, 7} and record(
        profile, "ngram"
    ).method == "loop"
    assert [loop.tokens_per_forward("ngram", "none", D).source for D in (0, 3, 5, 7, 15)] == [
        "measured",
        "modeled",
        "modeled",
        "modeled",
        "measured",
    ]  # a direct check does not make the derived value measured
    replay = CostModel(v2)
    assert {replay.tokens_per_forward("ngram", "none", D).source for D in range(16)} == {"measured"}


def test_emulated_acceptance_is_labelled_emulated_and_ranks_below_fitted(profile, v2):
    assert list(SOURCES[:5]) == ["measured", "interpolated", "fitted", "emulated", "modeled"]
    assert weakest("emulated", "fitted", "interpolated") == "emulated" and weakest("emulated", "modeled") == "modeled"
    assert CostModel(profile).tokens_per_forward("draft_model", "fp8", 15).source == "emulated"
    assert CostModel(profile).tokens_per_forward("draft_model", "fp8", 3).source == "modeled"  # loop: derived
    assert CostModel(v2).tokens_per_forward("draft_model", "fp8", 3).source == "emulated"  # replay


def strong_fp8_drafter(profile: Profile) -> Profile:
    """A draft model whose FP8 weights (emulated) accept 80% per position, with FP8 draft times and host time at
    every D."""

    def fp8(a):
        if (a["mechanism"], a["quant"]) != ("draft_model", "fp8"):
            return {}
        al = [1 + sum(0.8**k for k in range(1, D + 1)) for D in range(16)]
        return {"tokens_per_forward": al, "tokens_per_forward_ci": [[x, x] for x in al], "rounds": []}

    host = {"draft_model": {D: 0.06 for D in range(1, 16)}}
    return version2(profile, update_acceptance=fp8, fp8_draft=True, host=host)


def test_plan_and_table_print_emulated_and_fitted(profile, tmp_path, capsys):
    plan = search(
        strong_fp8_drafter(profile),
        "h",
        SearchSettings(mechanisms=("draft_model",), quant_formats=("fp8",), trials=40, out_dir=tmp_path / "fp8"),
    ).to_json()
    speculating = [b for b in plan["buckets"] if b["draft_len"]]
    assert speculating and {b["predicted"]["tokens_per_forward"]["source"] for b in speculating} == {"emulated"}
    assert {b["predicted"]["speedup"]["source"] for b in speculating} == {"emulated"}
    _print_plan_table(Plan.model_validate(plan))
    assert "emulated" in capsys.readouterr().out
    moved = version2(profile, fitted={(16, 1, 128): (26.0, 29.52)})
    plan = search(moved, "h", SearchSettings(mechanisms=("suffix",), trials=40, out_dir=tmp_path / "fitted")).to_json()
    last = plan["buckets"][-1]
    assert (last["batch"], last["draft_len"], last["predicted"]["speedup"]["source"]) == (16, 0, "fitted")
    _print_plan_table(Plan.model_validate(plan))
    assert re.search(r"│\s+16 │ 0 │.*fitted", capsys.readouterr().out)


def test_device_times_tell_the_weakest_source_of_the_predictions(profile, tmp_path):
    plan = search(profile, "h", SearchSettings(trials=40, out_dir=tmp_path / "cpu")).to_json()
    sources = [b["predicted"]["speedup"]["source"] for b in plan["buckets"]]
    assert plan["device"]["times"] == weakest(*sources) == "modeled"  # D > 0 below D_max: derived from the D_max run
    assert plan["device"]["sources"] == {s: sources.count(s) for s in SOURCES if s in sources}
    assert plan["device"]["projected_from"] is None
    h200 = search(profile, "h", SearchSettings(trials=40, out_dir=tmp_path / "h200", device="h200")).to_json()
    assert (
        h200["device"]["times"] == "modeled (hardware table)"
        and h200["device"]["projected_from"] == profile.device["name"]
    )


def test_host_time_follows_the_measured_draft_lengths(profile):
    cost = CostModel(version2(profile, host={"ngram": {1: 0.1, 7: 0.4}}))
    assert cost.host_ms("ngram", 4, 1) == Figure(0.1, "measured")
    at3 = cost.host_ms("ngram", 4, 3)
    assert at3.source == "interpolated" and at3.value == pytest.approx(0.1 + (0.4 - 0.1) * 2 / 6)
    assert (cost.host_ms("ngram", 4, 12).value, cost.host_ms("ngram", 4, 12).source) == (
        0.4,
        "modeled",
    )  # beyond: the nearest
    assert cost.host_ms("plain", 4, 0).source == "measured"
    old = CostModel(profile)  # version 1: D = 3 only
    at3_old = next(h.host_ms_per_round for h in profile.host if (h.mechanism, h.batch) == ("ngram", 4))
    assert (old.host_ms("ngram", 4, 3).value, old.host_ms("ngram", 4, 3).source) == (at3_old, "measured")
    assert (old.host_ms("ngram", 4, 5).value, old.host_ms("ngram", 4, 5).source) == (at3_old, "modeled")


# ---------------------------------------------------------------------------- 3. out-of-memory buckets


def test_a_bucket_out_of_memory_is_not_planned(profile, tmp_path):
    oom = version2(profile, infeasible=tuple((16, t, ctx) for t in range(1, 17) for ctx in (128, 512)))
    space = Space(CostModel(oom), SearchSettings())
    assert space.buckets == [1, 2, 4, 8] and "ran out of memory" in space.excluded[16]
    plan = search(oom, "h", SearchSettings(trials=40, out_dir=tmp_path)).to_json()
    assert [b["batch"] for b in plan["buckets"]] == [1, 2, 4, 8] and plan["max_batch"] == 8
    assert any("[16] are not planned" in n and "ran out of memory" in n for n in plan["notes"])
    assert plan["excluded_buckets"] == [{"batch": 16, "why": space.excluded[16]}]
    # a bucket with no one-token verify step at the plan's context is not planned either
    gap = version2(profile, absent=((8, 1, 128),))
    assert Space(CostModel(gap), SearchSettings()).buckets == [1, 2, 4, 16]


def test_a_draft_that_does_not_fit_is_never_taken(profile, tmp_path):
    """Batch 8 fits one token but not 1+D ≥ 3 tokens: D ≥ 2 predicts nothing there (out of memory)."""
    tight = version2(profile, infeasible=tuple((8, t, 128) for t in range(3, 17)))
    space = Space(CostModel(tight), SearchSettings(mechanisms=("ngram",)))
    assert space.cost.predict(8, 5, "ngram", "none").tokens_per_s.value == 0.0
    assert space.cost.predict(8, 5, "ngram", "none").verify_ms.source == "infeasible"
    best = space.fill("ngram", "none", "free", 16)
    assert best.schedule[space.buckets.index(8)] <= 1
    plan = search(tight, "h", SearchSettings(mechanisms=("ngram",), trials=40, out_dir=tmp_path)).to_json()
    at8 = next(b for b in plan["buckets"] if b["batch"] == 8)
    assert at8["draft_len"] <= 1
    if at8["draft_len"] == 1:
        assert (
            at8["rationale"]["guideline"] == "memory"
            and "D=2 does not fit in memory at batch 8" in at8["rationale"]["text"]
        )
    text = (tmp_path / "plan.json").read_text()
    assert "Infinity" not in text and "NaN" not in text  # strict JSON


def test_no_bucket_left_is_one_line(profile, tmp_path, capsys):
    none_fit = version2(profile, infeasible=tuple((B, 1, 128) for B in profile.workload.batch_buckets))
    with pytest.raises(SpecdecError, match="no batch bucket can be planned"):
        Space(CostModel(none_fit), SearchSettings())
    path = tmp_path / "profile.json"
    path.write_text(none_fit.model_dump_json())
    assert main(["search", "--profile", str(path), "--out", str(tmp_path / "out"), "--trials", "10"]) == 1
    err = capsys.readouterr().err
    assert (
        "no batch bucket can be planned" in err
        and err.count("\n") == 1
        and not (tmp_path / "out" / "plan.json").exists()
    )


# ---------------------------------------------------------------------------- 4. decisions on expected value


def test_each_bucket_takes_the_highest_expected_speedup(profile, tmp_path):
    """Per bucket, the plan takes the draft length with the highest mean speedup over the draws of the profile's
    uncertainty, a shorter one only within the tie tolerance of it; the decision record holds the expected figures, the
    runner-up and the share of draws in which the choice beats it."""
    wide = version2(profile, tpf_rel=0.08, update_acceptance=per_prompt_counts(spread=0.7))
    settings = SearchSettings(mechanisms=("suffix",), trials=40, out_dir=tmp_path)
    space = Space(CostModel(wide), settings)
    plan = search(wide, "h", settings).to_json()
    top = plan["max_draft_len"]
    for b in plan["buckets"][1:]:  # the smallest bucket carries the schedule's maximum
        B, D = b["batch"], b["draft_len"]
        allowed = [d for d in space.allowed("suffix", "free") if d <= top]
        expected = {d: float(space.cost.draws.speedup(B, d, "suffix").mean()) for d in allowed}
        best = max(expected.values())
        if b["rationale"]["guideline"] != "schedule":
            assert D == min(d for d in allowed if expected[d] >= best * (1 - settings.tie_tolerance))
        decision = b["rationale"]["decision"]
        rival = decision["runner_up_draft_len"]
        assert decision["expected_speedup"] == pytest.approx(expected[D])
        assert decision["runner_up_expected_speedup"] == pytest.approx(expected[rival])
        assert decision["expected_gain_pct"] == pytest.approx(100 * (expected[D] / expected[rival] - 1))
        mine, theirs = space.cost.draws.speedup(B, D, "suffix"), space.cost.draws.speedup(B, rival, "suffix")
        assert decision["p_beats_runner_up"] == pytest.approx(np.mean(mine > theirs) + 0.5 * np.mean(mine == theirs))
        assert decision["draws"] == len(space.cost.draws.models) >= 100
    # the point prediction is not the decision: somewhere the mean over the draws ranks two draft lengths otherwise
    # than their point speedups would, or the table's "vs next D" says so in the plan
    Plan.model_validate(plan)


def test_a_shorter_draft_within_the_tolerance_is_taken_and_the_plan_says_what_it_gives_up(profile, tmp_path):
    wide = version2(profile, tpf_rel=0.08)
    settings = SearchSettings(mechanisms=("suffix",), trials=40, out_dir=tmp_path, tie_tolerance=0.05)
    space = Space(CostModel(wide), settings)
    plan = search(wide, "h", settings).to_json()
    ties = [b for b in plan["buckets"] if b["rationale"]["tie"]]
    assert ties
    for b in ties:
        B, D, tie = b["batch"], b["draft_len"], b["rationale"]["tie"]
        longer = tie["with_draft_len"]
        loss = 100 * (1 - space.bucket_score(B, D, "suffix", "none") / space.bucket_score(B, longer, "suffix", "none"))
        assert tie["rule"] == "expected" and longer > D and tie["expected_loss_pct"] == pytest.approx(loss)
        assert 0 <= loss <= 5
        assert f"D={D} is expected {loss:.1f}% below D={longer}" in b["rationale"]["text"]
        assert "within the 5.0% a shorter draft may give up: the shorter draft is taken" in b["rationale"]["text"]
        assert b["rationale"]["decision"]["runner_up_draft_len"] == longer
    # strict, every expected difference decides: the tolerance costs something, and the plan says how much
    assert plan["study"]["strict_optimum_value"] >= plan["study"]["exhaustive_value"]
    untied = dict(plan["study"]["untied_schedule"])
    assert list(untied) == [b["batch"] for b in plan["buckets"]] and list(untied.values()) == sorted(
        untied.values(), reverse=True
    )
    assert any(untied[b["batch"]] > b["draft_len"] for b in ties)
    assert plan["study"]["untied_gain_pct"] > 0
    assert any(line.startswith("without the ties") for line in _plan_findings(Plan.model_validate(plan)))
    # at the default tolerance the same profile keeps every draft the tolerance above gave up more than 0.5% for
    default = search(wide, "h", SearchSettings(mechanisms=("suffix",), trials=40, out_dir=tmp_path / "d")).to_json()
    for b in ties:
        if b["rationale"]["tie"]["expected_loss_pct"] > 0.5 and b["rationale"]["guideline"] != "schedule":
            assert next(x for x in default["buckets"] if x["batch"] == b["batch"])["draft_len"] > b["draft_len"]


def test_of_two_drafters_within_the_tolerance_the_one_listed_first_is_taken(profile, tmp_path):
    """The demo profile's suffix beats n-gram by 0.66% of expected mean speedup: within a 1% tolerance n-gram, listed
    first, is taken, and the plan names what the tie passed over; at 0.5%, or with suffix listed first, suffix."""
    space = Space(CostModel(profile), SearchSettings(out_dir=tmp_path))
    score = {m: space.score(space.fill(m, "none", "free", space.buckets[-1])) for m in ("ngram", "suffix")}
    assert 0.005 < 1 - score["ngram"] / score["suffix"] < 0.01
    assert [d.name for d in profile.drafters][:2] == ["ngram", "suffix"]

    tied = search(profile, "h", SearchSettings(trials=60, out_dir=tmp_path / "tied", tie_tolerance=0.01))
    assert tied.mechanism == "ngram"
    assert tied.study.untied_drafter == {"mechanism": "suffix", "quant": "none"}
    strict = Space(CostModel(profile), SearchSettings(out_dir=tmp_path, tie_tolerance=0.01))
    with strict.strictly():
        best, _ = strict.exhaustive()
    assert best.mechanism == "suffix" and [D for _, D in tied.study.untied_schedule] == list(best.schedule)
    assert tied.study.untied_gain_pct > 0
    findings = _plan_findings(tied)
    assert any("ngram is taken over suffix" in line for line in findings)
    assert any(line.startswith("without the ties (every expected difference deciding) suffix") for line in findings)

    assert search(profile, "h", SearchSettings(trials=60, out_dir=tmp_path / "default")).mechanism == "suffix"
    suffix_first = profile.model_copy(
        update={"drafters": [profile.drafters[1], profile.drafters[0], *profile.drafters[2:]]}
    )
    listed = search(suffix_first, "h", SearchSettings(trials=60, out_dir=tmp_path / "listed", tie_tolerance=0.01))
    assert listed.mechanism == "suffix" and listed.study.untied_drafter is None


def test_the_plan_states_its_drafter_against_the_best_other_with_the_share_of_draws_it_wins(v2, tmp_path):
    """With intervals (version 2) the demo profile's suffix is expected about 1% above n-gram: the plan names n-gram,
    at its best schedule, as the runner-up drafter, their ratio over the same draws with an interval reaching 1.0 (the
    profile cannot separate them), and search prints it; a plan of one drafter states none."""
    plan = search(v2, "h", SearchSettings(trials=60, out_dir=tmp_path / "default"))
    d = plan.study.drafter_decision
    assert plan.mechanism == "suffix" and d is not None and d.runner_up == "ngram" and d.runner_up_quant == "none"
    space = Space(CostModel(v2), SearchSettings(out_dir=tmp_path))
    chosen = Candidate("suffix", "none", plan.tile.policy, plan.max_batch, tuple(D for _, D in plan.schedule))
    runner = space.fill("ngram", "none", plan.tile.policy, plan.max_batch)
    assert [D for _, D in d.runner_up_schedule] == list(runner.schedule)
    mine, theirs = space.schedule_draws(chosen), space.schedule_draws(runner)
    assert d.expected_speedup == pytest.approx(mine.mean()) and d.runner_up_expected_speedup == pytest.approx(
        theirs.mean()
    )
    assert d.draws == len(mine) and d.p_beats_runner_up == pytest.approx(float(np.mean(mine > theirs)))
    r = d.runner_up_vs_choice
    assert r.source == "modeled" and r.low < r.value < 1.0 < r.high
    assert r.value == pytest.approx(float(np.mean(theirs / mine)))
    assert 0.5 < d.p_beats_runner_up < 0.9  # ahead in expectation, short of certain
    line = next(x for x in _plan_findings(plan) if x.startswith("drafter: suffix over ngram"))
    assert f"{r.value:.3f}x" in line and line.endswith(
        "the profile cannot separate them, another profile may take either"
    )

    alone = search(v2, "h", SearchSettings(mechanisms=("suffix",), trials=40, out_dir=tmp_path / "alone"))
    assert alone.study.drafter_decision is None and not any(x.startswith("drafter:") for x in _plan_findings(alone))


def test_a_profile_without_intervals_decides_on_its_point_predictions(profile):
    """Version 1 has no intervals: every draw is the point prediction, the expected speedup is the predicted one and the
    choice beats a slower runner-up in every draw."""
    cost = CostModel(profile)
    draws = cost.draws.speedup(4, 2, "suffix")
    assert np.all(draws == cost.predict(4, 2, "suffix").speedup.value)
    space = Space(cost, SearchSettings(mechanisms=("suffix",)))
    assert space.beats(4, 2, 1, "suffix", "none") in (0.0, 1.0)
    assert cost.ratio(4, 2, 1, "suffix").has_interval is False


def test_a_difference_is_judged_on_its_own_paired_interval(profile):
    """Figures whose own intervals overlap (±8%), their ratio drawn with acceptance paired over the same prompts and the
    timing cells they share moving together: the ratio's interval holds its value, is degenerate for a draft length
    against itself, is narrower than the two figures' intervals allow, and the same profile gives the same draws."""
    paired = version2(profile, tpf_rel=0.08, update_acceptance=per_prompt_counts(spread=0.7))
    cost = CostModel(paired)
    r = cost.ratio(16, 1, 3, "suffix")
    a, b = cost.predict(16, 1, "suffix").tokens_per_s, cost.predict(16, 3, "suffix").tokens_per_s
    assert r.value == pytest.approx(a.value / b.value) and r.low <= r.value <= r.high
    assert (r.high - r.low) < (a.high / b.low - a.low / b.high) / 2
    assert (cost.ratio(4, 2, 2, "suffix").low, cost.ratio(4, 2, 2, "suffix").high) == (1.0, 1.0)
    assert np.array_equal(CostModel(paired).draws.speedup(16, 3, "suffix"), cost.draws.speedup(16, 3, "suffix"))


def with_timing_error(truth: Profile, rng: np.random.Generator, sigma: float) -> Profile:
    """A profile the device could have measured when `truth` is what it runs at: every verify and draft median off by
    a lognormal error of `sigma`, its 95% interval the calibrated one about the measured value."""
    data = truth.model_dump(mode="json")
    for cell_ in data["verify"] + data["draft"]:
        if cell_["median_ms"]:
            ms = cell_["median_ms"] * math.exp(sigma * rng.standard_normal())
            cell_ |= {
                "median_ms": ms,
                "ci_low_ms": ms * math.exp(-1.96 * sigma),
                "ci_high_ms": ms * math.exp(1.96 * sigma),
            }
    return Profile.model_validate(data)


def increasing_in_tokens(profile: Profile) -> Profile:
    """The profile with each (batch, ctx) line of verify cells made non-decreasing in the tokens verified."""
    data = profile.model_dump(mode="json")
    lines: dict[tuple[int, int], list[dict]] = {}
    for cell_ in data["verify"]:
        if cell_["median_ms"]:
            lines.setdefault((cell_["batch"], cell_["ctx"]), []).append(cell_)
    for cells in lines.values():
        cells.sort(key=lambda c: c["tokens"])
        fitted = isotonic_line(np.array([c["median_ms"] for c in cells]), np.ones(len(cells)))
        for c, ms in zip(cells, fitted.tolist()):
            c["median_ms"] = ms
    return Profile.model_validate(data)


def test_the_ratio_interval_covers_the_truth_at_its_level(profile, monkeypatch):
    """Simulated profiles with known truth (the demo profile's timings, each cell measured with a 3% error and a
    calibrated interval; acceptance exact): the 95% interval of TPS(D) / TPS(D') holds the true ratio in about 95% of
    the profiles. Adding the two rounds' intervals as independent errors counts the cells they share twice and covers
    nearly always: an interval that wide calls real differences noise."""
    from specdec_tune.autotune import cost_model

    monkeypatch.setattr(cost_model, "DRAWS", 100)
    exact = lambda self, index, z: dataclasses.replace(  # noqa: E731
        self, drawn=np.array([self.tokens_per_forward(D).value for D in range(self.max_draft_len + 1)])
    )
    monkeypatch.setattr(cost_model.Acceptance, "at_draw", exact)
    pairs = [(1, 4, 2, "suffix"), (2, 3, 1, "suffix"), (4, 2, 1, "ngram"), (1, 6, 3, "ngram"), (8, 1, 0, "suffix")]
    profile = increasing_in_tokens(profile)  # a device's true step is never cheaper for verifying more tokens
    truth = CostModel(profile)
    true = {
        p: truth.predict(*p[:2], p[3]).tokens_per_s.value / truth.predict(p[0], p[2], p[3]).tokens_per_s.value
        for p in pairs
    }

    def independent_sum(cost: CostModel, B: int, D: int, other: int, m: str) -> tuple[float, float]:
        a, b = cost.predict(B, D, m), cost.predict(B, other, m)
        (a_low, a_high), (b_low, b_high) = a.round_ms.bounds(), b.round_ms.bounds()
        value = a.tokens_per_s.value / b.tokens_per_s.value
        down = math.hypot(math.log(a_high / a.round_ms.value), math.log(b.round_ms.value / b_low))
        up = math.hypot(math.log(a.round_ms.value / a_low), math.log(b_high / b.round_ms.value))
        return value * math.exp(-down), value * math.exp(up)

    rng = np.random.default_rng(1)
    drawn, summed, trials = 0, 0, 60
    for _ in range(trials):
        cost = CostModel(with_timing_error(profile, rng, 0.03))
        for p in pairs:
            r = cost.ratio(*p)
            drawn += r.low <= true[p] <= r.high
            low, high = independent_sum(cost, *p)
            summed += low <= true[p] <= high
    n = trials * len(pairs)
    assert 0.88 <= drawn / n <= 0.985, drawn / n
    assert summed / n > 0.985, summed / n


def per_prompt_counts(spread: float, per_domain: int = 6, seed: int = 0):
    """update_acceptance for version2: the "all" record gets per-prompt counts of prompts that differ in how well they
    accept (each prompt's tokens per forward is 1 + (AL(D) - 1) f_p, f_p uniform in 1 ± spread) but agree on the order
    of the draft lengths, as real prompts do: wide intervals for each figure, a tight one for their ratio."""

    def update(rec: dict) -> dict:
        if rec["domain"] != "all":
            return {}
        rng = np.random.default_rng(seed)
        domains = [d for d in ("writing", "coding", "humaneval") for _ in range(per_domain)]
        emitted = [[64] * len(rec["tokens_per_forward"]) for _ in domains]
        rounds = [
            [round(64 / (1 + (t - 1) * f)) for t in rec["tokens_per_forward"]]
            for f in 1 + spread * rng.uniform(-1, 1, len(domains))
        ]
        accepted = [[e - r for e, r in zip(es, rs)] for es, rs in zip(emitted, rounds)]
        return {
            "per_prompt": {
                "domains": domains,
                "emitted": emitted,
                "rounds": rounds,
                "accepted": accepted,
                "drafts": rounds,
            }
        }

    return update


def test_per_prompt_counts_are_one_row_per_prompt():
    from pydantic import ValidationError

    from specdec_tune.profiles.schema import PromptSums

    ok = {
        "domains": ["a", "b"],
        "emitted": [[1, 2], [1, 2]],
        "rounds": [[1, 1], [1, 2]],
        "accepted": [[0, 1], [0, 0]],
        "drafts": [[0, 1], [0, 1]],
    }
    assert PromptSums.model_validate(ok).domains == ["a", "b"]
    for broken in ({**ok, "domains": ["a"]}, {**ok, "rounds": [[1, 1], [1]]}):
        with pytest.raises(ValidationError, match="one row per prompt"):
            PromptSums.model_validate(broken)


def slower_to_verify_more(profile: Profile, batch: int, factor: float) -> Profile:
    """version2's profile with every verify cell of more than one token at `batch` `factor` times slower (noise)."""
    data = version2(profile).model_dump(mode="json")
    for v in data["verify"]:
        if v["batch"] == batch and v["tokens"] > 1 and v["median_ms"]:
            v |= {k: v[k] * factor for k in ("median_ms", "raw_median_ms", "ci_low_ms", "ci_high_ms") if v.get(k)}
    return Profile.model_validate(data)


def test_d_never_rises_with_batch(profile, tmp_path):
    """A slow spell over batch 2's multi-token cells makes that bucket alone turn speculation off between two buckets
    that keep it; the plan's schedule stays non-increasing, is the best such schedule, and says where the rule
    decided."""
    import itertools

    noisy = slower_to_verify_more(profile, 2, 1.6)
    space = Space(CostModel(noisy), SearchSettings(mechanisms=("ngram",)))
    allowed = space.allowed("ngram", "free")
    alone = [max(allowed, key=lambda d, B=B: (space.bucket_value(B, d, "ngram", "none"), -d)) for B in space.buckets]
    assert any(a < b for a, b in zip(alone, alone[1:]))  # bucket by bucket, D would rise from batch 2 to 4
    plan = search(noisy, "h", SearchSettings(mechanisms=("ngram",), trials=60, out_dir=tmp_path)).to_json()
    ds = [b["draft_len"] for b in plan["buckets"]]
    assert all(a >= b for a, b in zip(ds, ds[1:])), ds
    non_increasing = [
        s for s in itertools.product(allowed[:8], repeat=len(space.buckets)) if all(a >= b for a, b in zip(s, s[1:]))
    ]
    brute = max(space.score(Candidate("ngram", "none", "free", space.buckets[-1], s)) for s in non_increasing)
    assert plan["study"]["exhaustive_value"] == pytest.approx(brute)
    moved = [b for b, a in zip(plan["buckets"], alone) if b["draft_len"] != a]
    assert moved
    for b in moved:
        assert b["rationale"]["guideline"] == "schedule"
        assert (
            f"alone this bucket would take D={alone[space.buckets.index(b['batch'])]}; D never rises with batch"
            in b["rationale"]["text"]
        )
    # a sampled schedule is repaired into one the engines and the physics accept
    assert Space.repair([1, 0, 3, 2]) == (3, 0, 0, 0) and Space.repair([2, 2, 1, 1]) == (2, 2, 1, 1)


def test_a_decision_on_a_cell_the_fit_moved_is_flagged(profile, tmp_path):
    moved = version2(profile, fitted={(4, 1, 128): (17.0, 19.72)})
    plan = search(moved, "h", SearchSettings(mechanisms=("suffix",), trials=40, out_dir=tmp_path)).to_json()
    at4 = next(b for b in plan["buckets"] if b["batch"] == 4)
    assert (
        "rests on verify cell B=4, 1+D=1, ctx=128 which the monotone fit moved from 17.00 to 19.72 ms" in at4["flags"]
    )
    assert all(not b["flags"] for b in plan["buckets"] if b["batch"] != 4)
    assert CostModel(moved).verify_ms(4, 1).source == "fitted"


# ---------------------------------------------------------------------------- 5. --mix


def test_mixed_acceptance_is_the_weighted_harmonic_mean(v2):
    mixed = CostModel(v2, mix={"writing": 5, "coding": 3, "humaneval": 2})  # normalised to 0.5, 0.3, 0.2
    assert mixed.mix == pytest.approx(MIX)
    recs = {d: record(v2, "ngram", domain=d) for d in MIX}
    for D in (1, 3, 15):
        tpf = mixed.tokens_per_forward("ngram", "none", D)
        assert tpf.value == pytest.approx(1 / sum(w / recs[d].tokens_per_forward[D] for d, w in MIX.items()))
        assert tpf.low == pytest.approx(1 / sum(w / recs[d].tokens_per_forward_ci[D][0] for d, w in MIX.items()))
        assert tpf.high == pytest.approx(1 / sum(w / recs[d].tokens_per_forward_ci[D][1] for d, w in MIX.items()))
    # the round histogram: each domain's histogram at D (D_max's capped at D, the drafting share q from D's own
    # tokens per forward and AL), weighted by its share of rounds w_d / AL_d(D)
    B, D = 4, 3
    rounds = {d: w / recs[d].tokens_per_forward[D] for d, w in MIX.items()}
    share = [sum(rounds[d] / sum(rounds.values()) * shares_at(recs[d], D)[L] for d in MIX) for L in range(D + 1)]
    F = [sum(share[: w + 1]) for w in range(D)] + [1.0]
    expected = sum((F[w] ** B - (F[w - 1] ** B if w else 0.0)) * cell(v2, B, 1 + w).median_ms for w in range(D + 1))
    assert mixed.round_verify_ms("ngram", "none", B, D).value == pytest.approx(expected)


@pytest.mark.parametrize(
    "mix, message",
    [
        ({"poetry": 1.0}, "use the profile's domains: writing, roleplay"),
        ({"writing": 0.0, "coding": 1.0}, "must be positive"),
    ],
)
def test_a_bad_mix_is_refused(v2, mix, message):
    with pytest.raises(SpecdecError, match=message):
        CostModel(v2, mix=mix)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--mix", "poetry=1"],
            "'poetry', which the profile has no acceptance for (use the profile's domains: writing, roleplay, "
            "reasoning",
        ),
        (["--mix", "writing"], "is not DOMAIN=WEIGHT"),
        (["--mix", "writing=-1"], "must be positive"),
    ],
)
def test_a_bad_mix_is_one_line_and_writes_nothing(capsys, tmp_path, argv, message):
    code = main(["search", "--profile", str(PROFILE_PATH), "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert code == 1 and message in err and err.count("\n") == 1
    assert not (tmp_path / "plan.json").exists()


def test_the_plan_records_the_mix_and_where_the_domains_disagree(profile, tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(version2(profile).model_dump_json())
    argv = [
        "search",
        "--profile",
        str(path),
        "--mechanism",
        "ngram",
        "--trials",
        "40",
        "--mix",
        "writing=1,extraction=1",
    ]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["mix"] == {"writing": 0.5, "extraction": 0.5}
    split = plan["per_domain"]
    assert set(split["domains"]) == {"writing", "extraction"} and split["disagreeing_buckets"]
    for row in split["disagreeing_buckets"]:
        assert row["by_domain"]["writing"] != row["by_domain"]["extraction"]
        line = f"batch {row['batch']}: the domains disagree on D beyond the 0.5% tie tolerance"
        assert line in out and any(n.startswith(line) for n in plan["notes"])
    assert all(len(d["schedule"]) == len(plan["buckets"]) for d in split["domains"].values())
    # the same profile, seed and mix: the same plan
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "plan.json").read_text())
    strip = lambda p: {k: v for k, v in p.items() if k not in ("created_at", "study")}  # noqa: E731
    assert strip(again) == strip(plan)
    # no --mix: today's "all" domain, no per-domain split
    assert (
        main(["search", "--profile", str(path), "--mechanism", "ngram", "--trials", "40", "--out", str(tmp_path / "c")])
        == 0
    )
    plain = json.loads((tmp_path / "c" / "plan.json").read_text())
    assert plain["mix"] is None and "per_domain" not in plain


# ---------------------------------------------------------------------------- 6. what search prints


def test_search_prints_the_intervals(profile, tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(version2(profile).model_dump_json())
    assert main(["search", "--profile", str(path), "--out", str(tmp_path / "v2"), "--trials", "40"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\d\.\d\dx \[\d\.\d\d–\d\.\d\d\]", out) and re.search(r"│\s+\d+ \[\d+–\d+\] │", out)
    words = " ".join(out.split())
    assert (
        "95% interval" in words
        and "acceptance bootstrap over prompts" in words
        and "timing interval of the median" in words
    )
    plan = json.loads((tmp_path / "v2" / "plan.json").read_text())
    for b in plan["buckets"]:
        for f in b["predicted"].values():
            assert {"value", "source", "low", "high"} <= set(f)
        s = b["predicted"]["speedup"]
        assert s["low"] <= s["value"] <= s["high"]
    assert main(["search", "--profile", str(PROFILE_PATH), "--out", str(tmp_path / "v1"), "--trials", "40"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\d\.\d\dx \[-\]", out) and not re.search(r"\d\.\d\dx \[\d", out)
