"""The cost model on a recorded demo profile (replay: no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.profiles.schema import load_profile

PROFILE = Path(__file__).parent / "data" / "demo_profile.json"


@pytest.fixture(scope="module")
def model() -> CostModel:
    return CostModel(load_profile(PROFILE))


def test_formula_by_hand(model):
    p = model.profile
    T = {v.tokens: v.median_ms for v in p.verify if v.batch == 4 and v.ctx == 128}
    rec = next(
        a
        for a in p.acceptance
        if a.mechanism == "ngram" and a.domain == "all" and a.temperature == 0 and a.quant == "none"
    )
    share = [sum(r) / sum(map(sum, rec.rounds)) for r in rec.rounds]  # D_max's rounds that proposed L tokens
    capped = share[:3] + [sum(share[3:])]  # proposals of min(L, 3) tokens
    q = (rec.tokens_per_forward[3] - 1) / (
        rec.mean_al_vllm[3] - 1
    )  # the share of rounds at D = 3 that draft: tpf = 1 + q (AL - 1)
    at_3 = [1 - q] + [q * x / (1 - capped[0]) for x in capped[1:]]
    F = [sum(at_3[: w + 1]) for w in range(3)] + [1.0]  # P(a row's proposal <= w) at D = 3
    # the batch verifies 1 + its longest proposal: E[T] over the max of 4 rows' widths
    verify = sum((F[w] ** 4 - (F[w - 1] ** 4 if w else 0.0)) * T[1 + w] for w in range(4))
    draft = next(d.median_ms for d in p.draft if d.mechanism == "ngram" and d.batch == 4 and d.draft_len == 3)
    host = next(h.host_ms_per_round for h in p.host if h.mechanism == "ngram" and h.batch == 4 and h.draft_len == 3)
    tpf = next(
        a.tokens_per_forward[3]
        for a in p.acceptance
        if a.mechanism == "ngram" and a.domain == "all" and a.temperature == 0 and a.quant == "none"
    )
    base = 4 / (
        next(v.median_ms for v in p.verify if v.batch == 4 and v.tokens == 1 and v.ctx == 128)
        + next(h.host_ms_per_round for h in p.host if h.mechanism == "plain" and h.batch == 4)
    )
    pred = model.predict(4, 3, "ngram")
    assert pred.tokens_per_s.value == pytest.approx(1e3 * 4 * tpf / (verify + draft + host))
    assert pred.speedup.value == pytest.approx(4 * tpf / (verify + draft + host) / base)
    assert pred.per_user_tokens_per_s.value == pytest.approx(pred.tokens_per_s.value / 4)


def test_no_speculation_is_the_baseline(model):
    for B in (1, 8):
        pred = model.predict(B, 0, "suffix")
        assert pred.mechanism == "none" and pred.speedup.value == pytest.approx(1.0)


def test_sources_follow_the_inputs(model):
    assert model.verify_ms(4, 1).source == "measured"
    assert model.verify_ms(3, 1).source == "interpolated"  # between the 2 and 4 buckets
    assert model.verify_ms(64, 1).source == "modeled"  # beyond the largest bucket
    assert model.tokens_per_forward("ngram", "none", 15).source == "measured"  # D_max was run
    assert (
        model.tokens_per_forward("ngram", "none", 3).source == "modeled"
    )  # derived from the D_max rounds (a direct check agreed)
    assert model.tokens_per_forward("ngram", "none", 5).source == "modeled"  # derived from the D_max rounds
    assert model.draft_ms("draft_model", "fp8", 1, 3).source == "modeled"  # FP8 not run on this CPU
    assert model.tokens_per_forward("draft_model", "fp8", 15).source == "emulated"  # fake-quantized weights
    assert (
        model.host_ms("ngram", 4, 3).source == "measured" and model.host_ms("ngram", 4, 5).source == "modeled"
    )  # host measured at D=3
    assert model.predict(3, 2, "ngram").speedup.source in ("interpolated", "modeled")


def test_the_optimum_is_a_schedule_not_one_draft_length(model):
    """On this CPU profile: speculate at batch 1, less as the batch grows, not at all at 16."""
    best = {B: model.best(B) for B in model.profile.workload.batch_buckets}
    assert best[1].draft_len >= 1 and best[1].speedup.value > 1.05
    assert best[16].draft_len == 0
    assert best[1].draft_len >= best[4].draft_len >= best[16].draft_len
    assert len({b.draft_len for b in best.values()}) > 1


def test_unknown_inputs_are_refused(model):
    with pytest.raises(SpecdecError, match="no acceptance"):
        model.tokens_per_forward("eagle3", "none", 3)
    with pytest.raises(SpecdecError, match="beyond the profiled"):
        model.verify_ms(1, 40)
    with pytest.raises(SpecdecError, match="not a profiled bucket"):
        CostModel(model.profile, ctx=999)
    with pytest.raises(SpecdecError, match="no acceptance for domain"):
        CostModel(model.profile, temperature=0.3)


def test_the_share_of_rounds_that_draft_is_the_draft_lengths_own(model):
    """At D < D_max the rounds that propose are a larger share than at D_max (a draft there emits more, so its rounds
    are fewer against the rounds that find nothing): the share comes from D's own tokens per forward and AL."""
    from specdec_tune.autotune.cost_model import Acceptance

    rec = next(
        a
        for a in model.profile.acceptance
        if a.mechanism == "ngram" and a.domain == "all" and a.temperature == 0 and a.quant == "none"
    )
    n = rec.max_draft_len
    rounds = (
        [[90] + [0] * n] + [[0] * (n + 1) for _ in range(n - 1)] + [[0, 0, 0, 10] + [0] * (n - 3)]
    )  # D_max: 10% draft n tokens
    tpf, al = list(rec.tokens_per_forward), list(rec.mean_al_vllm)
    tpf[1], al[1] = 1.2, 1.8  # at D = 1: a quarter of the rounds draft (1 + 0.25 x 0.8 = 1.2)
    shares = Acceptance(
        ((1.0, rec.model_copy(update={"rounds": rounds, "tokens_per_forward": tpf, "mean_al_vllm": al})),)
    ).round_shares(1)
    assert shares[:2] == pytest.approx([0.75, 0.25]) and sum(shares[2:]) == 0
