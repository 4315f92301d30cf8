"""Acceptance by replay against the speculative loop, for every registered drafter: equal counters at every D
(greedy, fp32), including rounds cut by the end of generation and by a stop token; and the intervals over prompts."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec_tune.profiles import intervals, replay
from specdec_tune.profiles.drafters.base import _REGISTRY, available
from specdec_tune.profiles.drafters.dflash import DFlashDrafter, DSparkDrafter, new_dflash_head
from specdec_tune.profiles.drafters.draft_model import DraftModelDrafter
from specdec_tune.profiles.drafters.eagle3 import Eagle3Drafter, new_eagle3_head
from specdec_tune.profiles.drafters.mtp import MtpDrafter, new_mtp_head
from specdec_tune.profiles.drafters.ngram import NgramDrafter
from specdec_tune.profiles.drafters.suffix import SuffixDrafter
from specdec_tune.profiles.specdec import SpecCounters, generate

sys.path.insert(0, str(Path(__file__).parent))
from test_specdec import loaded, tiny_model  # noqa: E402  (the tiny models the loop's own tests use)

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [9, 3, 9, 3, 9, 3, 9], [4], [5, 6, 5, 6, 5, 6]]
NEW_TOKENS = 40
D_MAX = 6


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=32, layers=2, seed=3)


def _drafters(target):
    full = DraftModelDrafter(loaded(target), DraftModelDrafter.Options(layers=1))
    full.model = target  # a draft equal to the target: every draft accepted, rounds cut only by the end
    return {
        "ngram": lambda: NgramDrafter(None, NgramDrafter.Options(prompt_lookup_min=1, prompt_lookup_max=3)),
        "suffix": lambda: SuffixDrafter(None, SuffixDrafter.Options()),
        "draft_model": lambda: DraftModelDrafter(loaded(target), DraftModelDrafter.Options(layers=1)),
        "draft_model_exact": lambda: full,
    }


def _as_dict(c: SpecCounters) -> dict:
    return dataclasses.asdict(c)


def _replay_against_the_loop(target, make, d_max: int, with_stop: bool) -> int:
    """Replayed counters equal the loop's at D = 1, 3 and d_max, prompt by prompt; returns the tokens accepted."""
    trajectories = replay.trajectories(target, PROMPTS, NEW_TOKENS, batch=2)
    assert all(len(t) == NEW_TOKENS for t in trajectories)
    # a stop token that occurs early in one row and late (or never) in others: rounds cut by it
    stop = {trajectories[0][7]} if with_stop else set()
    replayed = [
        replay.replay(
            t, replay.proposer(make(), p, t, target, d_max), list(range(1, d_max + 1)), NEW_TOKENS, stop, d_max
        )
        for p, t in zip(PROMPTS, trajectories)
    ]
    accepted = 0
    for D in sorted({1, 3, d_max}):
        loop = generate(
            target, PROMPTS, drafter=make(), num_draft_tokens=D, max_new_tokens=NEW_TOKENS, stop_token_ids=sorted(stop)
        )
        for p, (by_d, looped) in enumerate(zip(replayed, loop.per_prompt)):
            mine = by_d[D - 1]
            looped = SpecCounters.merge(looped, SpecCounters(max_draft_len=d_max))  # same histogram size
            assert _as_dict(mine) == _as_dict(looped), f"D={D} prompt {p}"
            accepted += mine.num_accepted_tokens
    return accepted


@pytest.mark.parametrize("name", ["ngram", "suffix", "draft_model", "draft_model_exact"])
@pytest.mark.parametrize("with_stop", [False, True])
def test_replay_equals_the_loop_at_every_draft_length(target, name, with_stop):
    assert _replay_against_the_loop(target, _drafters(target)[name], D_MAX, with_stop) > 0  # the accepted paths ran


# A target with a 10-token vocabulary: random heads agree with it often enough that rounds accept none, some and all
# of their drafts. Every registered head mechanism, with a reduced draft vocabulary where the head has one.
HEADS = {
    "eagle3": lambda m: Eagle3Drafter.from_head(new_eagle3_head(m, draft_vocab=[0, 1, 3, 4, 6, 7, 9], seed=1)),
    "mtp": lambda m: MtpDrafter.from_head(new_mtp_head(m, seed=1)),
    "dflash": lambda m: DFlashDrafter.from_head(
        new_dflash_head(m, draft_vocab=[0, 2, 3, 5, 6, 7, 8], block_size=5, seed=1)
    ),
    "dspark": lambda m: DSparkDrafter.from_head(
        new_dflash_head(m, markov_rank=4, markov_head_type="rnn", block_size=4, seed=1)
    ),
}


@pytest.fixture(scope="module")
def head_target():
    return tiny_model(vocab=10, layers=4, seed=5)


def test_every_registered_drafter_replays():
    covered = {"ngram", "suffix", "draft_model"} | set(HEADS)
    assert covered == set(available()) and all(_REGISTRY[name].replay for name in covered)


@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize("with_stop", [False, True])
def test_head_replay_equals_the_loop_at_every_draft_length(head_target, name, with_stop):
    make = lambda: HEADS[name](head_target)  # noqa: E731
    d_max = min(D_MAX, make().max_draft_len or D_MAX)
    assert _replay_against_the_loop(head_target, make, d_max, with_stop) > 0


def test_replay_cut_by_stop_token_and_end_of_generation(target):
    """A draft equal to the target: every round accepts its whole draft, so the end cuts the last round."""
    trajectory = replay.trajectories(target, [PROMPTS[0]], 10, batch=1)[0]
    exact = _drafters(target)["draft_model_exact"]()
    [c] = replay.replay(trajectory, replay.proposer(exact, PROMPTS[0], trajectory, target, 4), [4], 10, set(), 4)
    # rounds: 5 tokens, 5 tokens: the second round may draft only min(4, 10 - 5 - 1) = 4, so 5 + 5 = 10
    assert c.num_rounds == 2 and c.num_emitted_tokens == 10 and c.rounds[4][4] == 2
    [c] = replay.replay(
        trajectory, replay.proposer(exact, PROMPTS[0], trajectory, target, 4), [4], 10, {trajectory[2]}, 4
    )
    # the stop token at position 2 ends the row inside the first round: 3 tokens emitted, 4 accepted
    assert c.num_rounds == 1 and c.num_emitted_tokens == 3 and c.num_accepted_tokens == 4


def test_prefix_proposer_refuses_going_back(target):
    t = replay.trajectories(target, [PROMPTS[2]], 8, batch=1)[0]
    propose = replay.prefix_proposer(NgramDrafter(None, NgramDrafter.Options()), PROMPTS[2], t, target, 2)
    propose(3, 2)
    with pytest.raises(ValueError):
        propose(1, 2)


def _sums(tpf_by_prompt: list[float], tokens: int = 64) -> dict[str, np.ndarray]:
    emitted = np.array([[tokens, tokens] for _ in tpf_by_prompt], dtype=float)
    rounds = np.array([[tokens, tokens / t] for t in tpf_by_prompt])
    drafts = rounds.copy()
    drafts[:, 0] = 0
    accepted = emitted - rounds
    return {"emitted": emitted, "rounds": rounds, "accepted": accepted, "drafts": drafts}


def test_mixed_tokens_per_forward_is_the_weighted_harmonic_mean():
    sums = {k: np.concatenate([a, b]) for (k, a), b in zip(_sums([2.0, 2.0]).items(), _sums([1.25]).values())}
    tpf, al = intervals.figures(sums, ["a", "a", "b"], {"a": 0.5, "b": 0.5})
    assert tpf[0] == 1.0 and abs(tpf[1] - 1 / (0.5 / 2.0 + 0.5 / 1.25)) < 1e-12
    # every round drafted, so vLLM's AL equals tokens per forward here
    assert abs(al[1] - tpf[1]) < 1e-12


def test_bootstrap_interval_covers_and_narrows_with_prompts():
    rng = np.random.default_rng(0)
    few = list(1.3 + 0.3 * rng.random(5))
    many = list(1.3 + 0.3 * rng.random(80))
    _, _, lo_hi_few, _ = intervals.figures(_sums(few), ["a"] * 5, {"a": 1.0}, resamples=500)
    point, _, lo_hi_many, _ = intervals.figures(_sums(many), ["a"] * 80, {"a": 1.0}, resamples=500)
    assert lo_hi_many[1, 0] <= point[1] <= lo_hi_many[1, 1]
    assert (lo_hi_many[1, 1] - lo_hi_many[1, 0]) < (lo_hi_few[1, 1] - lo_hi_few[1, 0])
    assert lo_hi_few[0].tolist() == [1.0, 1.0]  # D = 0: no spread


def test_t_quantile_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 6, 10, 30, 200):
        for p in (0.9, 0.975):
            assert intervals.t_quantile(p, df) == pytest.approx(
                stats.t.ppf(p, df), abs={3: 0.004, 4: 0.001}.get(df, 2e-4)
            )


def test_widening_is_hesterbergs_factor_and_pools_a_mix():
    stats = pytest.importorskip("scipy.stats")
    assert intervals.widening(["a"] * 7, {"a": 1.0}) == pytest.approx(
        stats.t.ppf(0.975, 6) * (7 / 6) ** 0.5 / 1.959964, abs=1e-3
    )
    assert 1.0 < intervals.widening(["a"] * 120, {"a": 1.0}) < 1.02
    # a mix of a small and a large domain: between the two domains' own factors; a domain of weight 0 plays no part
    mixed = intervals.widening(["a"] * 7 + ["b"] * 120, {"a": 1.0, "b": 1.0})
    assert intervals.widening(["a"] * 120, {"a": 1.0}) < mixed < intervals.widening(["a"] * 7, {"a": 1.0})
    assert intervals.widening(["a"] * 7 + ["b"] * 2, {"a": 1.0}) == intervals.widening(["a"] * 7, {"a": 1.0})
    assert intervals.widening(["a"] * 7 + ["b"], {"a": 1.0, "b": 1.0}) == float("inf")
    assert intervals.half_width_text(0.02) == "within ±2.0% (95%)" and "one prompt" in intervals.half_width_text(
        float("inf")
    )


def test_interval_over_few_prompts_holds_its_confidence():
    """Seven prompts per interval, 400 intervals: the widened interval covers the true tokens per forward about 95% of
    the time; the plain percentile interval (factor 1) covers clearly less."""
    rng = np.random.default_rng(1)
    true_mean, n, trials = 1.5, 7, 400
    covered = {1.0: 0, "widened": 0}
    for t in range(trials):
        per_prompt = list(true_mean + 0.3 * rng.standard_normal(n))
        sums = _sums(per_prompt, tokens=600)
        # the mix's harmonic mean of equal-token prompts; the truth of a population whose prompts all emit as many
        # tokens
        truth = 1 / np.mean(1 / (true_mean + 0.3 * rng.standard_normal(20000)))
        point, _ = intervals.figures(sums, ["a"] * n, {"a": 1.0})
        resampled, _ = intervals.draws(sums, ["a"] * n, {"a": 1.0}, resamples=400, seed=t)
        for factor in covered:
            f = intervals.widening(["a"] * n, {"a": 1.0}) if factor == "widened" else factor
            lo, hi = intervals.widened(point, resampled, f)[1]
            covered[factor] += lo <= truth <= hi
    assert 0.91 <= covered["widened"] / trials <= 0.99
    assert covered[1.0] / trials < 0.9


def test_widened_interval_stays_within_one_and_one_plus_d():
    """Seven prompts that rarely accept: the widened lower bound would fall below one token per forward; it
    stops at 1."""
    per_prompt = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.9]
    _, _, tpf_ci, al_ci = intervals.figures(_sums(per_prompt), ["a"] * 7, {"a": 1.0}, resamples=500)
    assert tpf_ci[1, 0] == 1.0 and al_ci[1, 0] >= 1.0 and tpf_ci[1, 1] <= 2.0
    _, _, one_prompt, _ = intervals.figures(_sums([1.4]), ["a"], {"a": 1.0}, resamples=50)
    assert np.isinf(one_prompt[1]).all()  # one prompt: no interval (the profile writes none), not the clipped range
    point, _ = intervals.figures(_sums(per_prompt), ["a"] * 7, {"a": 1.0})
    resampled, _ = intervals.draws(_sums(per_prompt), ["a"] * 7, {"a": 1.0}, resamples=500)
    assert (
        intervals.widened(point, resampled, intervals.widening(["a"] * 7, {"a": 1.0}))[1, 0] < 1.0
    )  # unclipped, it would
