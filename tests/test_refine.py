"""The measured refinement (pipeline/refine.py): which contenders it decodes, how it prunes and decides, that a study
resumes without decoding again, and where it does not run. The decoder is a stand-in whose tokens/s per draft length
is known (seeded noise), so that each verdict can be checked against the truth."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.autotune.plan import cost_model_of
from specdec_tune.autotune.plan_schema import Plan, load_plan
from specdec_tune.autotune.search import search
from specdec_tune.pipeline import refine as refine_module
from specdec_tune.pipeline.refine import contenders, refine, refinement_lines, skipped, uncertain
from specdec_tune.profiles.schema import PromptSums, load_profile
from specdec_tune.records import sha256_file
from specdec_tune.settings import RefineSettings, SearchSettings

PROFILE_PATH = Path(__file__).parent / "data" / "demo_profile.json"


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> tuple[Plan, object]:
    folder = tmp_path_factory.mktemp("plan")
    profile = load_profile(PROFILE_PATH)
    plan = search(profile, sha256_file(PROFILE_PATH), SearchSettings(seed=0, trials=40, out_dir=folder))
    return plan, profile


class FakeDecoder:
    """generate() at a known tokens/s per (batch, D), times a seeded lognormal noise of `noise`; counts its calls."""

    def __init__(self, rates: dict[tuple[int, int], float], noise: float = 0.02, seed: int = 0) -> None:
        self.rates, self.rng, self.noise, self.calls = rates, random.Random(seed), noise, 0
        self.seen: list[tuple[list, int]] = []  # (prompt ids of the batch, D) per call

    def __call__(self, model, ids, *, num_draft_tokens, max_new_tokens, **_):
        self.calls += 1
        self.seen.append((ids, num_draft_tokens))
        rate = self.rates[(len(ids), num_draft_tokens)] * self.rng.lognormvariate(0, self.noise)
        tokens = len(ids) * max_new_tokens
        return type("Out", (), {"full_batch_tokens": tokens, "full_batch_s": tokens / rate})()


def _fake(monkeypatch, decoder: FakeDecoder, domain: str = "unlabelled") -> None:
    """The loop's groups decode with `decoder`, four prompts of `domain` (by default one the profile has no acceptance
    for: the measured ratios are read as they are)."""
    target = type("Target", (), {"model": None})()
    monkeypatch.setattr(refine_module, "load_model", lambda *a, **k: target)
    monkeypatch.setattr(refine_module, "plan_drafter", lambda *a: object())
    monkeypatch.setattr(refine_module, "context_prompts_by_domain", lambda *a, **k: [([1, 2, 3], domain)] * 4)
    monkeypatch.setattr(refine_module, "generate", decoder)


def _truth(plan: Plan, best: dict[int, int]) -> dict[tuple[int, int], float]:
    """tokens/s per (batch, D): 100 x batch, 10% more at the bucket's `best` D, 3% less per step of D away from it."""
    return {
        (b.batch, D): 100.0 * b.batch * (1.10 if D == best[b.batch] else 1.0 - 0.03 * abs(D - best[b.batch]))
        for b in plan.buckets
        for D in range(64)
    }


def test_the_uncertain_buckets_measure_the_runner_up_the_single_d_the_default_and_no_speculation(searched):
    plan, profile = searched
    batches = uncertain(plan)
    assert batches, "the demo plan has buckets its draws do not settle"
    for B in batches:
        bucket = next(b for b in plan.buckets if b.batch == B)
        roles = contenders(plan, B, profile.workload.max_draft_len, cost_model_of(profile, plan))
        assert roles[bucket.draft_len] == "the model's choice"
        no_spec_chance = (
            cost_model_of(profile, plan).draws.speedup(B, bucket.draft_len, plan.mechanism, plan.quant) <= 1
        ).mean()
        assert (0 in roles) == (bucket.draft_len == 0 or no_spec_chance >= refine_module.NO_SPEC_CHANCE)
        assert plan.single_draft_len.draft_len in roles
        if bucket.rationale.decision is not None:
            assert bucket.rationale.decision.runner_up_draft_len in roles
    certain = [b for b in plan.buckets if b.batch not in batches]
    assert all(b.rationale.decision.p_beats_runner_up >= refine_module.CERTAIN for b in certain if b.rationale.decision)


def test_the_refinement_takes_the_fastest_contender_and_keeps_d_from_rising(searched, tmp_path, monkeypatch):
    plan, profile = searched
    batches = uncertain(plan)
    # at every uncertain bucket the truth favours the shortest speculating contender, and at the first the longest
    # (longer than any D of the model's plan: the first bucket is not held under it)
    best = {b.batch: b.draft_len for b in plan.buckets}
    for B in batches:
        roles = contenders(plan, B, profile.workload.max_draft_len, cost_model_of(profile, plan))
        best[B] = (max if B == plan.buckets[0].batch else min)(D for D in roles if D > 0)
    decoder = FakeDecoder(_truth(plan, best))
    _fake(monkeypatch, decoder)
    refined = refine(plan, profile, RefineSettings(budget_s=1e9), tmp_path, on_line=lambda line: None)
    Plan.model_validate(refined.to_json())
    ceiling = profile.workload.max_draft_len
    for b, model in zip(refined.buckets, plan.buckets):
        assert b.draft_len <= ceiling  # D never rises with batch
        if b.batch not in batches:
            assert b.refinement is None and b.draft_len == model.draft_len
            ceiling = b.draft_len
            continue
        r = b.refinement
        measured = {c.draft_len: c for c in r.contenders if c.measured_tokens_per_s is not None}
        assert r.chosen_draft_len == b.draft_len and r.model_draft_len == model.draft_len
        floor = max((x.draft_len for x in plan.buckets if x.batch > b.batch and x.batch not in batches), default=0)
        allowed = [D for D, c in measured.items() if c.outcome == "measured" and floor <= D <= ceiling]
        if allowed:
            assert b.draft_len == max(allowed, key=lambda D: decoder.rates[(b.batch, D)])
        else:
            assert b.draft_len == min(max(model.draft_len, floor), ceiling)
        ceiling = b.draft_len
        assert all(c.vs_model is not None for c in measured.values())  # paired with the model's D, pruned or not
        if b.draft_len != r.model_draft_len:
            assert b.rationale.text.startswith("measured (refinement)")
            assert measured[b.draft_len].vs_model.low > 1.0  # 10% against 2% noise: apart
    assert refined.refinement.trials == sum(
        len(contenders(plan, B, profile.workload.max_draft_len, cost_model_of(profile, plan))) for B in batches
    )
    assert refined.refinement.pruned > 0  # successive halving dropped the slow ones
    if plan.buckets[0].batch in batches:
        assert refined.buckets[0].draft_len == best[plan.buckets[0].batch] > plan.max_draft_len
    lines = refinement_lines(refined)  # each measured contender's paired ratio over the model's D, with its interval
    assert len(lines) == len(batches) and all(re.search(r"D=\d+ [\d.]+ x[\d.]+ \[[\d.]+–[\d.]+\]", x) for x in lines)


def test_a_bucket_the_refinement_takes_states_the_models_throughput_fitted_to_what_it_measured(
    searched, tmp_path, monkeypatch
):
    """Where the refinement overrules the model, the bucket's tokens/s, per-user tokens/s and speedup are the model's
    D's times the expected ratio the refinement measured ("fitted"), not the cost model's figure at the new D (which
    can read slower than the model's D, even below plain, for a bucket that measured faster); the vLLM schedule's
    pricing and the throughput check price that same figure."""
    plan, profile = searched
    best = {b.batch: b.draft_len for b in plan.buckets}
    for B in uncertain(plan):  # the truth favours the longest contender (D never rises past the first bucket's)
        best[B] = max(contenders(plan, B, profile.workload.max_draft_len, cost_model_of(profile, plan)))
    _fake(monkeypatch, FakeDecoder(_truth(plan, best)))
    refined = refine(plan, profile, RefineSettings(budget_s=1e9), tmp_path, on_line=lambda line: None)
    overruled = [(b, m) for b, m in zip(refined.buckets, plan.buckets) if b.draft_len != m.draft_len]
    assert overruled, "the truth makes the refinement overrule the model somewhere"
    for b, model in overruled:
        chosen = next(c for c in b.refinement.contenders if c.draft_len == b.draft_len and c.engine is None)
        ratio = chosen.expected_vs_model
        assert ratio.value > 1.0  # it measured faster than the model's D
        for name in ("tokens_per_s", "per_user_tokens_per_s", "speedup"):
            fitted, was = getattr(b.predicted, name), getattr(model.predicted, name)
            assert fitted.source == "fitted" and fitted.value == pytest.approx(was.value * ratio.value)
            assert fitted.low <= fitted.value <= fitted.high and fitted.value > was.value
        assert b.predicted.tokens_per_forward.source != "fitted"  # the draft's own figures stay the model's at its D
    assert refined.schedule_pricing is not None  # D differs across buckets: the vLLM table is priced
    for b in refined.buckets:  # on a CPU a table costs nothing: as run is the stated speedup
        assert b.engine_costs.speedup_as_run.value == pytest.approx(b.predicted.speedup.value)
    mean = sum(b.predicted.speedup.value for b in refined.buckets) / len(refined.buckets)
    assert refined.schedule_pricing.schedule_mean_speedup_as_run == pytest.approx(mean)
    from specdec_tune.pipeline.throughput_check import bucket_row

    b = overruled[0][0]
    row = bucket_row(b, {"tokens_per_s": 100.0}, [1.0], tolerance_pct=5.0)
    assert row["predicted_source"] == "fitted" and row["predicted_tokens_per_s"] == b.predicted.tokens_per_s.value


def test_a_refinement_resumes_its_study_without_decoding_again(searched, tmp_path, monkeypatch):
    plan, profile = searched
    decoder = FakeDecoder({(b.batch, D): 50.0 * b.batch + D for b in plan.buckets for D in range(64)})
    _fake(monkeypatch, decoder)
    first = refine(plan, profile, RefineSettings(budget_s=1e9), tmp_path, on_line=lambda line: None)
    calls = decoder.calls
    assert calls > 0 and (tmp_path / "refine.journal").exists()
    again = refine(plan, profile, RefineSettings(budget_s=1e9), tmp_path, on_line=lambda line: None)
    assert decoder.calls == calls
    assert [b.draft_len for b in again.buckets] == [b.draft_len for b in first.buckets]


class TickingDecoder(FakeDecoder):
    """A FakeDecoder whose every decode takes `s_per_decode` of a fake clock (a warm-up, a few tokens: `warmup_s`)."""

    def __init__(self, rates: dict[tuple[int, int], float], s_per_decode: float = 1.0, warmup_s: float = 0.0) -> None:
        super().__init__(rates, noise=0.0)
        self.now_s, self.s_per_decode, self.warmup_s = 0.0, s_per_decode, warmup_s

    def __call__(self, model, ids, **kwargs):
        self.now_s += self.s_per_decode if kwargs["max_new_tokens"] == RefineSettings.new_tokens else self.warmup_s
        return super().__call__(model, ids, **kwargs)


def _one_second_each(monkeypatch) -> None:
    """Price a group at one second per contender (TickingDecoder's clock with one prompt a group)."""
    monkeypatch.setattr(
        refine_module._LoopGroups, "group_cost_s", staticmethod(lambda *a, first=False: float(len(a[-1])))
    )


def _measured(refined: Plan) -> dict[int, set[int]]:
    """{batch: the D's decoded} of each bucket the refinement looked at."""
    return {
        b.batch: {c.draft_len for c in b.refinement.contenders if c.outcome != "not measured"}
        for b in refined.buckets
        if b.refinement
    }


def test_a_spent_budget_stops_every_contender_after_the_same_groups(searched, tmp_path, monkeypatch):
    plan, profile = searched
    decoder = TickingDecoder({(b.batch, D): 50.0 * b.batch for b in plan.buckets for D in range(64)})
    _fake(monkeypatch, decoder)
    _one_second_each(monkeypatch)
    monkeypatch.setattr(refine_module.time, "monotonic", lambda: decoder.now_s)
    pairs = 2 * len(uncertain(plan))  # the budget fits every bucket's pair for MIN_GROUPS groups, and no more
    budget_s = refine_module.MIN_GROUPS * pairs + 0.5
    settings = RefineSettings(budget_s=budget_s, groups=6, group_prompts=1)
    refined = refine(plan, profile, settings, tmp_path, on_line=lambda line: None)
    groups = {
        c.groups
        for b in refined.buckets
        if b.refinement
        for c in b.refinement.contenders
        if c.outcome != "not measured"
    }
    assert groups == {refine_module.MIN_GROUPS}


def _pairs(plan: Plan, profile) -> tuple[dict, dict, dict, dict]:
    """Per uncertain bucket: the model's D, its contenders, its challenger (the engine's default K where it contends,
    else the likeliest to beat the model's D), what measuring the pair gains."""
    cost = cost_model_of(profile, plan)
    model = {b.batch: b.draft_len for b in plan.buckets}
    speedup = lambda B, D: cost.draws.speedup(B, D, plan.mechanism, plan.quant)  # noqa: E731
    roles = {B: contenders(plan, B, profile.workload.max_draft_len, cost) for B in uncertain(plan)}
    default = refine_module.engine_default(plan, profile.workload.max_draft_len)
    by_chance = {
        B: max((D for D in r if D != model[B]), key=lambda D: (speedup(B, D) > speedup(B, model[B])).mean())
        for B, r in roles.items()
    }
    likeliest = {B: default if default in r and default != model[B] else by_chance[B] for B, r in roles.items()}
    assert likeliest != by_chance  # the default is not where the draws alone would look first: the rule decides
    gain = {B: float(np.maximum(speedup(B, D) / speedup(B, model[B]) - 1, 0).mean()) for B, D in likeliest.items()}
    assert len(roles) >= 2 and len(set(gain.values())) == len(gain)
    return model, roles, likeliest, gain


def test_the_budget_chooses_the_pairs_worth_most_then_the_contenders_likeliest_to_win(searched, tmp_path, monkeypatch):
    plan, profile = searched
    _fake(monkeypatch, FakeDecoder({(b.batch, D): 50.0 * b.batch + D for b in plan.buckets for D in range(64)}))
    _one_second_each(monkeypatch)
    model, roles, likeliest, gain = _pairs(plan, profile)

    def run(budget_s: float, name: str) -> dict[int, set[int]]:
        (tmp_path / name).mkdir()
        settings = RefineSettings(budget_s=budget_s, groups=2, group_prompts=1)
        refined = refine(plan, profile, settings, tmp_path / name, on_line=lambda line: None)
        measured = {B: D for B, D in _measured(refined).items() if D}
        assert all(b.draft_len == m.draft_len for b, m in zip(refined.buckets, plan.buckets) if b.batch not in measured)
        return measured

    assert run(1.0, "none") == {}  # no pair fits: nothing decoded, every bucket keeps the model's D
    first = max(gain, key=gain.__getitem__)  # one pair fits: the bucket whose measuring is worth the most
    assert run(2 * 2.0, "one") == {first: {model[first], likeliest[first]}}
    pairs = {B: {model[B], likeliest[B]} for B in roles}
    assert run(2 * 2.0 * len(roles), "pairs") == pairs  # every pair, the other contenders not
    assert run(1e9, "all") == {B: set(r) for B, r in roles.items()}


def test_no_speculation_joins_the_first_pair_where_the_draws_give_it_a_real_chance(searched, monkeypatch):
    """Where speculation may lose (no speculation beats the model's D in at least NO_SPEC_FIRST of the draws), a
    bucket is first measured as model D, challenger and D = 0 together: left to the pair, the bucket could only
    choose between two draft lengths; where the three do not fit, D = 0 is the challenger. The demo's draws never
    give D = 0 that chance (nor make it a contender): it is let in at every speculating bucket, and the threshold
    moved to where the draws reach it."""
    plan, profile = searched
    cost = cost_model_of(profile, plan)
    model, roles, likeliest, gain = _pairs(plan, profile)
    settings = RefineSettings(groups=2, group_prompts=1)
    _one_second_each(monkeypatch)
    no_spec = [B for B in roles if model[B] != 0 and likeliest[B] != 0]
    assert no_spec
    wanted = {(B, D, ""): why for B, r in roles.items() for D, why in (r | {0: "no speculation"}).items()}
    speedup = lambda B, D: cost.draws.speedup(B, D, plan.mechanism, plan.quant)  # noqa: E731
    chance = {B: float((speedup(B, 0) > speedup(B, model[B])).mean()) for B in no_spec}
    pairs_s = 2.0 * 2 * len(roles)  # every bucket's pair, two groups of a second each

    def first(threshold: float, budget_s: float) -> dict[int, set[int]]:
        monkeypatch.setattr(refine_module, "NO_SPEC_FIRST", threshold)
        chosen = refine_module.affordable(plan, profile, cost, settings, wanted, budget_s)
        return {B: {k[1] for k in chosen if k[0] == B} for B in roles}

    pairs = {B: {model[B], likeliest[B]} for B in roles}
    assert first(max(chance.values()) + 0.01, pairs_s) == pairs
    with_no_spec = {B: pairs[B] | ({0} if B in no_spec else set()) for B in roles}
    assert first(min(chance.values()), pairs_s + 2.0 * len(no_spec)) == with_no_spec
    # room for one pair only: the bucket worth the most is measured against no speculation, the three do not fit
    gain_no_spec = {B: float(np.maximum(speedup(B, 0) / speedup(B, model[B]) - 1, 0).mean()) for B in no_spec}
    top = max(no_spec, key=lambda B: max(gain[B], gain_no_spec[B]))
    assert first(min(chance.values()), 2.0 * 2) == {B: {model[B], 0} if B == top else set() for B in roles}


def test_groups_slower_than_priced_leave_the_pairs_worth_least_after_the_first(searched, tmp_path, monkeypatch):
    plan, profile = searched
    model, roles, likeliest, gain = _pairs(plan, profile)
    rates = {(b.batch, D): 50.0 * b.batch + D for b in plan.buckets for D in range(64)}
    decoder = TickingDecoder(rates, s_per_decode=1.3)  # a device slower than at profile time
    _fake(monkeypatch, decoder)
    _one_second_each(monkeypatch)
    monkeypatch.setattr(refine_module.time, "monotonic", lambda: decoder.now_s)
    budget_s = 2 * 2.0 * len(roles) + 0.5  # every pair's two groups at their price, and nothing else
    lines: list[str] = []
    refined = refine(
        plan, profile, RefineSettings(budget_s=budget_s, groups=2, group_prompts=1), tmp_path, lines.append
    )
    assert decoder.now_s <= budget_s
    by_gain = sorted(roles, key=gain.__getitem__, reverse=True)
    kept = int((budget_s - 1.3 * 2 * len(roles)) // (1.3 * 2))  # pairs whose second group fits after the first
    assert 0 < kept < len(roles)
    for rank, B in enumerate(by_gain):
        b = next(x for x in refined.buckets if x.batch == B)
        decoded = {c.draft_len: c for c in b.refinement.contenders if c.outcome != "not measured"}
        assert set(decoded) == {model[B], likeliest[B]}
        if rank < kept:
            assert {c.groups for c in decoded.values()} == {2}
        else:  # left after one group: not eligible, no interval from one group, the model's D kept
            assert {(c.groups, c.outcome) for c in decoded.values()} == {(1, "pruned")}
            assert decoded[likeliest[B]].vs_model.low is None and b.draft_len == model[B]
            assert any(line.startswith(f"refine: batch {B} ") and "for the budget" in line for line in lines)
    assert all("(one group)" in line for line in refinement_lines(refined) if "pruned" in line)


def test_the_first_groups_warm_ups_are_not_charged_to_the_next_group(searched, tmp_path, monkeypatch):
    """Each contender's first decode warms up (a tenth of a group's second, once): the second group is projected at
    the first's time less its warm-ups, so every pair whose two groups and warm-ups fit the budget is measured whole
    (charged with them, the second group of every pair would look 10% dearer than the 0.05 s left over allows)."""
    plan, profile = searched
    _, roles, _, _ = _pairs(plan, profile)
    rates = {(b.batch, D): 50.0 * b.batch + D for b in plan.buckets for D in range(64)}
    decoder = TickingDecoder(rates, warmup_s=0.1)
    _fake(monkeypatch, decoder)
    _one_second_each(monkeypatch)
    monkeypatch.setattr(refine_module.time, "monotonic", lambda: decoder.now_s)
    pair_contenders = 2 * len(roles)  # every bucket's pair, two groups of a second and a warm-up each; one more
    budget_s = 2.1 * pair_contenders + 0.05  # contender's two groups would not fit the price
    lines: list[str] = []
    settings = RefineSettings(budget_s=budget_s, groups=2, group_prompts=1)
    refined = refine(plan, profile, settings, tmp_path, lines.append)
    assert not any("for the budget" in line for line in lines) and decoder.now_s <= budget_s
    assert {c.groups for b in refined.buckets if b.refinement for c in b.refinement.contenders if c.groups} == {2}


def test_a_group_that_would_overrun_the_budget_is_not_started(searched, tmp_path, monkeypatch):
    plan, profile = searched
    rates = {(b.batch, D): 50.0 * b.batch + D for b in plan.buckets for D in range(64)}
    settings = RefineSettings(budget_s=1e9, groups=6, group_prompts=1)  # one call per contender and group
    _one_second_each(monkeypatch)

    def run(budget_s: float, folder: Path) -> tuple[TickingDecoder, list[float], object]:
        decoder = TickingDecoder(rates)
        _fake(monkeypatch, decoder)
        monkeypatch.setattr(refine_module.time, "monotonic", lambda: decoder.now_s)
        folder.mkdir()
        done_at: list[float] = []  # the clock when each group ended
        refined = refine(
            plan,
            profile,
            dataclasses.replace(settings, budget_s=budget_s),
            folder,
            on_line=lambda line: done_at.append(decoder.now_s) if " done, " in line else None,
        )
        return decoder, done_at, refined

    _, unbounded, _ = run(1e9, tmp_path / "unbounded")
    assert len(unbounded) == settings.groups
    # a budget that ends halfway through the fourth group: the fourth is not started
    budget_s = unbounded[2] + (unbounded[3] - unbounded[2]) / 2
    decoder, done_at, refined = run(budget_s, tmp_path / "bounded")
    assert len(done_at) == 3 and decoder.now_s <= budget_s
    groups = {
        c.groups for b in refined.buckets if b.refinement for c in b.refinement.contenders if c.outcome == "measured"
    }
    assert groups == {3}


def test_a_projected_plan_or_an_engine_that_does_not_run_here_is_not_refined(searched, monkeypatch):
    from specdec_tune.profiles.vllm_engine import VARIABLE

    plan, profile = searched
    assert skipped(plan.model_copy(update={"device": plan.device.model_copy(update={"projected_from": "x"})}), profile)
    monkeypatch.setattr(refine_module, "another_device", lambda device: "")
    monkeypatch.setenv(VARIABLE, "/nowhere/python")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    why = skipped(plan, profile.model_copy(update={"backend": "vllm"}))
    assert why.startswith("the profile's engine does not run here") and VARIABLE in why


def test_search_without_refine_writes_the_models_plan(tmp_path):
    from specdec_tune.cli import main

    assert main(["search", "--profile", str(PROFILE_PATH), "--out", str(tmp_path), "--no-refine"]) == 0
    plan = load_plan(tmp_path / "plan.json")
    assert plan.refinement is None and not (tmp_path / "refine.journal").exists()
    assert "refinement" not in json.dumps(plan.to_json()["buckets"])
    assert dataclasses.asdict(RefineSettings())["budget_s"] == 0  # the default budget is derived, not fixed


def test_ratios_measured_on_the_groups_prompts_are_carried_to_the_plans_mix(searched, tmp_path, monkeypatch):
    """The groups decode the profiling prompts long enough for the plan's context (here HumanEval alone, which accepts
    far more than the plan's equal mix): each measured ratio is moved by the cost model's difference between the two
    mixes before it is weighed against the model, and the bucket records the mix it decoded."""
    plan, profile = searched
    best = {b.batch: b.draft_len for b in plan.buckets}
    for B in uncertain(plan):
        best[B] = max(contenders(plan, B, profile.workload.max_draft_len, cost_model_of(profile, plan)))
    runs = {}
    for domain in ("unlabelled", "humaneval"):
        _fake(monkeypatch, FakeDecoder(_truth(plan, best)), domain=domain)  # the same seeded rates in both runs
        (tmp_path / domain).mkdir()
        runs[domain] = refine(plan, profile, RefineSettings(budget_s=1e9), tmp_path / domain, on_line=lambda _: None)
    here, there = cost_model_of(profile, plan), cost_model_of(profile, plan, mix={"humaneval": 1.0})

    def log_ratio(cost, B: int, D: int, model: int) -> float:
        draws = cost.draws
        return float(
            np.log(draws.speedup(B, D, plan.mechanism, "none") / draws.speedup(B, model, plan.mechanism, "none")).mean()
        )

    moved = 0
    for raw, carried, model in zip(runs["unlabelled"].buckets, runs["humaneval"].buckets, plan.buckets):
        if not carried.refinement:
            continue
        assert carried.refinement.decoded_mix == {"humaneval": 1.0}
        for a, c in zip(raw.refinement.contenders, carried.refinement.contenders):
            if c.expected_vs_model is None or c.draft_len == model.draft_len:
                continue
            assert c.vs_model == a.vs_model  # the raw measured ratio stays as measured
            shift = log_ratio(here, model.batch, c.draft_len, model.draft_len) - log_ratio(
                there, model.batch, c.draft_len, model.draft_len
            )
            if abs(shift) > 1e-3:
                moved += 1
                assert np.sign(c.expected_vs_model.value - a.expected_vs_model.value) == np.sign(shift)
    assert moved


def test_the_refinement_decodes_the_profiles_own_prompts_or_says_why_not(searched, tmp_path, monkeypatch):
    plan, profile = searched
    user = tmp_path / "traffic.jsonl"
    user.write_text("".join(json.dumps({"domain": "chat", "prompt": f"question {i}"}) + "\n" for i in range(8)))
    mine = profile.model_copy(update={"workload": profile.workload.model_copy(update={"calibration": str(user)})})
    monkeypatch.setattr(refine_module, "another_device", lambda device: None)
    assert skipped(plan, mine) is None
    gone = mine.model_copy(update={"workload": mine.workload.model_copy(update={"calibration": str(user) + ".old"})})
    assert "calibration prompts do not load here" in skipped(plan, gone)

    best = {b.batch: b.draft_len for b in plan.buckets}
    _fake(monkeypatch, FakeDecoder(_truth(plan, best)))
    specs = []
    monkeypatch.setattr(
        refine_module, "context_prompts_by_domain", lambda *a, spec: specs.append(spec) or [([1, 2, 3], "chat")] * 4
    )
    refine(plan, mine, RefineSettings(groups=2), tmp_path, on_line=lambda line: None)
    assert specs == [str(user)]


def test_a_repair_re_plan_is_refined_again_from_the_same_study(searched, tmp_path, monkeypatch):
    from specdec_tune.pipeline.repair import replan, search_settings_of
    from specdec_tune.records import write_json

    plan, profile = searched
    decoder = FakeDecoder(_truth(plan, {b.batch: b.draft_len for b in plan.buckets}))
    _fake(monkeypatch, decoder)
    monkeypatch.setattr(refine_module, "skipped", lambda plan, profile: None)
    refined = refine(plan, profile, RefineSettings(groups=2), tmp_path, on_line=lambda line: None)
    decoded = decoder.calls
    write_json(tmp_path / "plan.json", refined.to_json())
    again = replan(tmp_path / "plan.json", PROFILE_PATH, profile, search_settings_of(plan), refined.refinement)
    assert decoder.calls == decoded  # every contender was decoded before: the study's trials stand
    assert again.refinement is not None and again.refinement.trials == refined.refinement.trials
    assert [b.draft_len for b in again.buckets] == [b.draft_len for b in refined.buckets]
    assert load_plan(tmp_path / "plan.json").refinement == again.refinement


def test_the_expected_ratio_weighs_the_model_against_the_groups():
    import math

    import numpy as np

    from specdec_tune.pipeline.refine import MODEL_RATIO_SD, expected_vs_model

    prior = {1: np.full(200, math.log(0.97)), 2: np.full(200, math.log(0.97))}
    noisy = [math.log(1.30), math.log(0.90)]  # 2 groups, far apart: mean +0.08
    steady = [math.log(1.11), math.log(1.09), math.log(1.10), math.log(1.12), math.log(1.08), math.log(1.10)]
    few = expected_vs_model(prior, {1: noisy})[1]
    many = expected_vs_model(prior, {1: steady})[1]
    # few noisy groups move the prediction a little toward them, many consistent ones decide
    assert 0.97 < few.value < math.exp(sum(noisy) / 2) and few.source == "fitted"
    assert abs(math.log(many.value) - math.log(1.10)) < 0.01 and many.low > 1.05
    # pooled: a noisy contender beside a steady one is judged by the bucket's noise, not by its own two groups
    both = expected_vs_model(prior, {1: noisy, 2: steady})
    assert both[1].value > few.value and both[2].value > 1.03
    # no groups: the model alone, its interval the draws' spread and the model's ratio error
    alone = expected_vs_model(prior, {})[1]
    assert math.isclose(math.log(alone.value), math.log(0.97) + MODEL_RATIO_SD**2 / 2)
    assert math.isclose(math.log(alone.high / alone.low), 2 * 1.96 * MODEL_RATIO_SD)


@pytest.mark.parametrize("groups", [2, 3, 4])
@pytest.mark.parametrize("noise", [0.03, 0.15])
def test_the_expected_ratios_interval_covers_the_truth_at_a_few_noisy_groups_without_outgrowing_the_model(
    groups, noise
):
    """Simulated buckets with a known true ratio: the model's draws off the truth by its own error, groups 3% or 15%
    noisy (a 2-core machine's batch-8 loop). The interval covers at least 90% of truths (1.96 on the pooled variance
    of a few groups: 70-85%), and is typically narrower than the model's alone (Student's t on the posterior sd at two
    groups, one degree of freedom: up to four times as wide)."""
    import math

    import numpy as np

    from specdec_tune.pipeline.refine import MODEL_RATIO_SD, expected_vs_model

    rng, truth, hits, widths, n = np.random.default_rng(7), 0.1, 0, [], 1000
    for _ in range(n):
        centre = truth + rng.normal(0, math.hypot(0.05, MODEL_RATIO_SD))
        prior = {1: rng.normal(centre, 0.05, 200)}
        f = expected_vs_model(prior, {1: list(truth + rng.normal(0, noise, groups))})[1]
        hits += f.low <= math.exp(truth) <= f.high
        widths.append(math.log(f.high / f.low))
    alone = expected_vs_model(prior, {})[1]
    assert 0.90 <= hits / n <= 0.98
    assert float(np.median(widths)) < math.log(alone.high / alone.low)


def test_noisy_groups_do_not_overturn_a_right_model(searched, tmp_path, monkeypatch):
    """The truth is the cost model's prediction at every D, the groups are noisy (25% per call): a rule that takes the
    best measured ratio loses throughput to noise; the expected ratio stays within the model's own tie tolerance."""
    plan, profile = searched
    cost = cost_model_of(profile, plan)
    batches = uncertain(plan)
    truth = {
        (b.batch, D): cost.predict(b.batch, D, plan.mechanism, plan.quant).tokens_per_s.value
        for b in plan.buckets
        for D in range(profile.workload.max_draft_len + 1)
    }
    lost, lost_by_best_measured = [], []
    for seed in range(6):
        _fake(monkeypatch, FakeDecoder(truth, noise=0.25, seed=seed))
        (tmp_path / str(seed)).mkdir()
        settings = RefineSettings(budget_s=1e9, groups=2)
        refined = refine(plan, profile, settings, tmp_path / str(seed), on_line=lambda line: None)
        for b in refined.buckets:
            if b.batch in batches:
                best_true = max(truth[(b.batch, c.draft_len)] for c in b.refinement.contenders)
                measured = [c for c in b.refinement.contenders if c.outcome == "measured"]
                noisy_pick = max(measured, key=lambda c: c.vs_model.value).draft_len
                lost.append(1 - truth[(b.batch, b.draft_len)] / best_true)
                lost_by_best_measured.append(1 - truth[(b.batch, noisy_pick)] / best_true)
    assert max(lost) < 0.01 and sum(lost) < sum(lost_by_best_measured)


def test_a_group_decodes_at_least_group_prompts_in_whole_batches():
    from specdec_tune.pipeline.refine import group_rows

    prompts = RefineSettings().group_prompts
    for B in (1, 2, 3, 4, 8, 16):
        rows = group_rows(B, prompts)
        assert rows % B == 0 and rows >= prompts and rows - B < prompts


def test_workers_sharing_a_storage_each_decode_the_contenders_no_other_has_started(searched, tmp_path, monkeypatch):
    import optuna

    plan, profile = searched
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    B = uncertain(plan)[0]
    model = next(b.draft_len for b in plan.buckets if b.batch == B)
    roles = contenders(plan, B, profile.workload.max_draft_len, cost_model_of(profile, plan))
    other = next(D for D in roles if D != model)
    # another worker has started (B, other) in the shared study
    study = optuna.create_study(
        storage=url,
        study_name=f"refine-{plan.settings_hash[:12]}-{profile.fingerprint[:12]}",
        direction="maximize",
        load_if_exists=True,
    )
    theirs = study.ask()
    theirs.set_user_attr("batch", B)
    theirs.set_user_attr("draft_len", other)
    decoder = FakeDecoder(_truth(plan, {b.batch: b.draft_len for b in plan.buckets}))
    _fake(monkeypatch, decoder)
    settings = RefineSettings(groups=2, budget_s=1e9, storage=url)
    first = refine(plan, profile, settings, tmp_path, on_line=lambda line: None)
    row = next(c for c in first.buckets if c.batch == B).refinement
    assert next(c for c in row.contenders if c.draft_len == other).outcome == "not measured"
    assert all(c.outcome != "not measured" for c in row.contenders if c.draft_len != other)
    assert (B, other) not in {(len(ids), D) for ids, D in decoder.seen}  # the other worker decodes it
    # the other worker finishes: a later run reads its groups and decodes nothing again
    theirs.set_user_attr("rates", [100.0 * B, 100.0 * B])
    study.tell(theirs, 100.0 * B)
    calls = decoder.calls
    again = refine(plan, profile, settings, tmp_path, on_line=lambda line: None)
    assert decoder.calls == calls
    row = next(c for c in again.buckets if c.batch == B).refinement
    assert next(c for c in row.contenders if c.draft_len == other).groups == 2


def _with_rounds(profile, mechanism: str, rounds_at: dict[int, list[int]], new_tokens: int):
    """The profile with its greedy "all" record of `mechanism` holding per-prompt rounds: prompt i needs
    `rounds_at[D][i]` rounds for `new_tokens` tokens at D (1 token a round at D = 0)."""
    record = next(
        a
        for a in profile.acceptance
        if (a.mechanism, a.domain, a.temperature, a.quant) == (mechanism, "all", 0.0, "none")
    )
    n = len(next(iter(rounds_at.values())))
    columns = [rounds_at.get(D, [new_tokens] * n) for D in range(record.max_draft_len + 1)]
    table = [[col[i] for col in columns] for i in range(n)]
    sums = PromptSums(
        domains=["writing"] * n,
        emitted=[[new_tokens] * len(row) for row in table],
        rounds=table,
        accepted=[[0] * len(row) for row in table],
        drafts=[[0] * len(row) for row in table],
    )
    planted = record.model_copy(update={"per_prompt": sums, "new_tokens": new_tokens})
    return profile.model_copy(update={"acceptance": [planted if a is record else a for a in profile.acceptance]})


def test_a_batch_is_priced_at_the_rounds_until_its_first_row_is_done():
    """The loop stops a batch when its first row is done: E[least of B prompts' rounds], drawn with replacement from
    the profile's per-prompt counts, scaled to the refinement's tokens; checked against enumerating every draw."""
    profile = load_profile(PROFILE_PATH)
    plan = type("P", (), {"mechanism": "suffix", "quant": "none"})()
    rounds = [8, 12, 20, 30, 32]
    planted = _with_rounds(profile, "suffix", {3: rounds}, new_tokens=32)
    cost = CostModel(planted, ctx=128)
    for B in (1, 2, 3):
        exact = np.mean([min(draw) for draw in itertools.product(rounds, repeat=B)])
        assert refine_module.rounds_to_first_done(planted, cost, plan, B, 3, 32) == pytest.approx(exact)
        assert refine_module.rounds_to_first_done(planted, cost, plan, B, 3, 16) == pytest.approx(exact / 2)
    assert refine_module.rounds_to_first_done(planted, cost, plan, 4, 0, 32) == 32  # plain: a token a round
    # no per-prompt counts: the tokens over the predicted tokens per round
    tokens_per_round = cost.predict(2, 3, "suffix").tokens_per_forward.value
    assert refine_module.rounds_to_first_done(profile, cost, plan, 2, 3, 32) == pytest.approx(32 / tokens_per_round)


def test_a_groups_price_holds_its_prefills_and_the_first_group_its_warm_ups(searched):
    """A group's price is, per batch, the prefill of B prompts cut to the context and the rounds until the first row
    is done at the predicted round time; the first group adds one warm-up batch per contender (WARMUP_TOKENS)."""
    plan, profile = searched
    cost = cost_model_of(profile, plan)
    s = RefineSettings(group_prompts=4, new_tokens=32)
    price = refine_module._LoopGroups.group_cost_s
    B, D = plan.buckets[0].batch, 2
    prompt = plan.ctx - s.new_tokens // 2

    def batch_s(tokens: int) -> float:
        round_s = cost.predict(B, D, plan.mechanism, plan.quant).round_ms.value / 1e3
        rounds = refine_module.rounds_to_first_done(profile, cost, plan, B, D, tokens)
        return refine_module.prefill_s(cost, B, prompt) + rounds * round_s

    batches = refine_module.group_rows(B, s.group_prompts) // B
    assert price(plan, profile, cost, s, [(B, D, "")]) == pytest.approx(batches * batch_s(s.new_tokens))
    warm = price(plan, profile, cost, s, [(B, D, "")], first=True) - price(plan, profile, cost, s, [(B, D, "")])
    assert warm == pytest.approx(batch_s(refine_module.WARMUP_TOKENS)) and warm > 0
    # the prefill: batch 1's verify slope per token, for each of B rows, on top of the one-token step at B
    slope_ms = (cost.verify_ms(1, cost.max_draft_len + 1).value - cost.verify_ms(1, 1).value) / cost.max_draft_len
    expected_s = (cost.verify_ms(B, 1).value + B * (prompt - 1) * slope_ms) / 1e3
    assert refine_module.prefill_s(cost, B, prompt) == pytest.approx(expected_s) and expected_s > 0.01
    # the budget's two groups: the first's warm-ups once, not twice
    two = refine_module.groups_cost_s(plan, profile, cost, s, [(B, D, "")], 2)
    assert two == pytest.approx(2 * price(plan, profile, cost, s, [(B, D, "")]) + warm)
