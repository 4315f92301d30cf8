"""The speculative loop on tiny random models: counters by hand, greedy losslessness, and the
distribution that rejection sampling produces (with tests that the check can fail)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec_tune import SpecdecError
from specdec_tune.profiles import specdec
from specdec_tune.profiles.drafters.base import Draft, Drafter, DraftRequest
from specdec_tune.profiles.drafters.dflash import DFlashDrafter, DSparkDrafter, new_dflash_head
from specdec_tune.profiles.drafters.draft_model import DraftModelDrafter
from specdec_tune.profiles.drafters.eagle3 import Eagle3Drafter, new_eagle3_head
from specdec_tune.profiles.drafters.mtp import MtpDrafter
from specdec_tune.profiles.drafters.ngram import NgramDrafter
from specdec_tune.profiles.drafters.suffix import SuffixDrafter
from specdec_tune.profiles.models.folders import ModelRef
from specdec_tune.profiles.models.llama import CausalLM, ModelConfig, init_random
from specdec_tune.profiles.models.loading import LoadedModel
from specdec_tune.profiles.specdec import SpecCounters, generate, verify_greedy


def tiny_model(vocab: int = 32, layers: int = 2, seed: int = 0, head_scale: float = 1.0) -> CausalLM:
    c = ModelConfig(
        model_type="llama",
        vocab_size=vocab,
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
    torch.manual_seed(seed)
    model = init_random(CausalLM(c), seed=seed).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def loaded(model: CausalLM) -> LoadedModel:
    ref = ModelRef("tiny", "hf", "llama", "float32", "c", "w", model.config.num_layers)
    return LoadedModel(model=model, tokenizer=None, ref=ref)


class ScriptedDrafter(Drafter):
    """Proposes the reference continuation (or a wrong token in its place): known acceptance."""

    name, kind = "scripted", "model_free"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong: bool, vocab: int) -> None:
        self.reference, self.wrong, self.vocab = reference, wrong, vocab

    def start(self, prompts):
        self.prompts = [tuple(p) for p in prompts]

    def keep_rows(self, indices):
        self.prompts = [self.prompts[i] for i in indices]

    def propose(self, request: DraftRequest) -> Draft:
        out = []
        for prompt, seq, k in zip(self.prompts, request.token_ids, request.max_tokens):
            done = len(seq) - len(prompt)
            true = self.reference[prompt][done : done + k]
            out.append([(t + 1) % self.vocab for t in true] if self.wrong else true)
        return Draft(tokens=out)


PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [9, 3, 9, 3, 9, 3, 9], [4]]


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return tiny_model()


@pytest.fixture(scope="module")
def reference(target) -> dict[tuple[int, ...], list[int]]:
    out = generate(target, PROMPTS, max_new_tokens=64)
    return {tuple(p): t for p, t in zip(PROMPTS, out.tokens)}


def test_perfect_draft_gives_al_one_plus_d(target, reference):
    out = generate(
        target, PROMPTS, drafter=ScriptedDrafter(reference, False, 32), num_draft_tokens=3, max_new_tokens=64
    )
    c = out.counters
    # 64 = 16 rounds x (3 accepted + 1 bonus) per prompt
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (64, 192, 192)
    assert c.num_accepted_tokens_per_pos == [64, 64, 64]
    assert c.mean_acceptance_length == 4.0 and c.tokens_per_target_forward == 4.0
    assert c.conditional_acceptance() == [1.0, 1.0, 1.0]
    assert out.target_forwards == 16
    assert [tuple(t) for t in out.tokens] == [tuple(reference[tuple(p)]) for p in PROMPTS]


def test_perfect_draft_near_the_end(target, reference):
    # max_new 10, D 3: rounds draft 3, 3, then 1 (room for one draft plus the bonus) -> 7 drafted, 7 accepted.
    out = generate(
        target, PROMPTS[:1], drafter=ScriptedDrafter(reference, False, 32), num_draft_tokens=3, max_new_tokens=10
    )
    c = out.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.num_rounds) == (3, 7, 7, 3)
    assert c.mean_acceptance_length == pytest.approx(1 + 7 / 3)
    assert out.tokens[0] == reference[tuple(PROMPTS[0])][:10]


def test_always_wrong_draft_gives_al_one(target, reference):
    out = generate(target, PROMPTS, drafter=ScriptedDrafter(reference, True, 32), num_draft_tokens=3, max_new_tokens=64)
    c = out.counters
    # per prompt: 61 rounds with 3 drafts, then 2, then 1, then a round with no room for a draft
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.num_rounds) == (4 * 63, 4 * 186, 0, 4 * 64)
    assert c.mean_acceptance_length == 1.0 and c.tokens_per_target_forward == 1.0
    assert c.num_accepted_tokens_per_pos == [0, 0, 0]
    assert [tuple(t) for t in out.tokens] == [tuple(reference[tuple(p)]) for p in PROMPTS]


def test_counters_by_hand():
    c = SpecCounters(max_draft_len=3)
    c.record(draft_len=3, num_accepted=1, num_emitted=2)
    c.record(draft_len=2, num_accepted=2, num_emitted=3)
    c.record(draft_len=0, num_accepted=0, num_emitted=1)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.num_rounds, c.num_emitted_tokens) == (
        2,
        5,
        3,
        3,
        6,
    )
    assert c.num_accepted_tokens_per_pos == [2, 1, 0]
    # d3 is reached only when d1 and d2 were accepted and a third draft existed: never here
    assert c.num_reached_per_pos == [2, 2, 0]
    assert c.mean_acceptance_length == 1 + 3 / 2  # vLLM: over rounds with a draft
    assert c.tokens_per_target_forward == 2.0  # over all rounds
    assert c.conditional_acceptance() == [1.0, 0.5, None]
    assert c.rounds[3][1] == c.rounds[2][2] == c.rounds[0][0] == 1 and sum(map(sum, c.rounds)) == 3
    # at D=1 the 2-token and 3-token rounds take 1 and 2 forwards; the undrafted round 1: 6 tokens in 4 forwards
    assert c.derived_at(1) == (1.5, pytest.approx(1 + 2 / 3))
    assert c.derived_at(3) == (2.0, 2.5)
    assert c.merge(c).derived_at(3) == (2.0, 2.5)


def test_verify_greedy_rule():
    V = 5
    # target argmax per position: [2, 3, 4, 0]
    logits = torch.full((2, 4, V), -1.0)
    for i, t in enumerate([2, 3, 4, 0]):
        logits[:, i, t] = 1.0
    drafts = torch.tensor([[2, 3, 1], [2, 3, 4]])
    n, nxt = verify_greedy(logits, drafts, torch.tensor([3, 2]))
    assert n.tolist() == [2, 2]  # row 0 rejects d3; row 1 offered only 2
    assert nxt.tolist() == [4, 4]


@pytest.mark.parametrize(
    "make", ["ngram", "suffix", "draft_model", "eagle3", "eagle3-small-vocab", "mtp", "dflash", "dspark"]
)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_lossless_tiny(target, reference, make, batch):
    drafter = {
        "ngram": lambda: NgramDrafter(None, NgramDrafter.Options(prompt_lookup_min=1, prompt_lookup_max=3)),
        "suffix": lambda: SuffixDrafter(None, SuffixDrafter.Options()),
        "draft_model": lambda: DraftModelDrafter(loaded(target), DraftModelDrafter.Options(layers=1)),
        "eagle3": lambda: Eagle3Drafter(loaded(target), Eagle3Drafter.Options(random=True)),
        "eagle3-small-vocab": lambda: Eagle3Drafter.from_head(
            new_eagle3_head(target, draft_vocab=list(range(0, 32, 2)))
        ),
        "mtp": lambda: MtpDrafter(loaded(target), MtpDrafter.Options(random=True)),
        "dflash": lambda: DFlashDrafter.from_head(
            new_dflash_head(target, draft_vocab=list(range(0, 32, 2)), block_size=5)
        ),
        "dspark": lambda: DSparkDrafter.from_head(
            new_dflash_head(target, markov_rank=4, markov_head_type="gated", block_size=4)
        ),
    }[make]()
    outs = []
    for i in range(0, len(PROMPTS), batch):
        outs += generate(target, PROMPTS[i : i + batch], drafter=drafter, num_draft_tokens=4, max_new_tokens=64).tokens
    assert outs == [reference[tuple(p)] for p in PROMPTS]


@pytest.mark.parametrize("make", ["ngram", "draft_model", "eagle3"])
def test_a_draft_length_per_row_gives_each_row_what_it_gives_alone(target, reference, make):
    """Rows of one batch at different D: each row's tokens and counters are its own run's at that D."""
    drafter = {
        "ngram": lambda: NgramDrafter(None, NgramDrafter.Options(prompt_lookup_min=1, prompt_lookup_max=3)),
        "draft_model": lambda: DraftModelDrafter(loaded(target), DraftModelDrafter.Options(layers=1)),
        "eagle3": lambda: Eagle3Drafter(loaded(target), Eagle3Drafter.Options(random=True)),
    }[make]()  # one instance: every generate starts it afresh
    lens = [1, 5, 3, 2][: len(PROMPTS)]
    together = generate(target, PROMPTS, drafter=drafter, num_draft_tokens=lens, max_new_tokens=40)
    for p, D, toks, counters in zip(PROMPTS, lens, together.tokens, together.per_prompt):
        alone = generate(target, [p], drafter=drafter, num_draft_tokens=D, max_new_tokens=40)
        assert toks == alone.tokens[0] == reference[tuple(p)][:40]
        assert counters == alone.per_prompt[0] and counters.max_draft_len == D
    with pytest.raises(SpecdecError, match="draft lengths for"):
        generate(target, PROMPTS, drafter=drafter, num_draft_tokens=[2, 3])
    with pytest.raises(SpecdecError, match="draft length D = 0"):
        generate(target, PROMPTS, drafter=drafter, num_draft_tokens=[2, 0] + [1] * (len(PROMPTS) - 2))


def test_full_batch_rounds_end_when_the_first_row_finishes(target, reference):
    """Throughput at batch B counts only rounds with all B rows decoding (a continuously batched server's
    steady state), not a static batch's tail running fewer rows."""

    class HalfWrong(ScriptedDrafter):
        def propose(self, request):
            right = super().propose(request).tokens
            return Draft(
                tokens=[[(t + 1) % self.vocab for t in d] if p in WRONG else d for p, d in zip(self.prompts, right)]
            )

    WRONG = {tuple(PROMPTS[2]), tuple(PROMPTS[3])}
    out = generate(target, PROMPTS, drafter=HalfWrong(reference, False, 32), num_draft_tokens=3, max_new_tokens=64)
    # rows 0, 1 emit 4 tokens a round and finish after 16 rounds; rows 2, 3 emit 1 a round meanwhile
    assert out.full_batch_tokens == 2 * 64 + 2 * 16
    assert 0 < out.full_batch_s < out.total_s
    # until_first_done: the same full-batch rounds, and no tail (rows 2, 3 are cut short at 16 tokens)
    cut = generate(
        target, PROMPTS, drafter=HalfWrong(reference, False, 32), num_draft_tokens=3, max_new_tokens=64,
        until_first_done=True,
    )  # fmt: skip
    assert cut.full_batch_tokens == out.full_batch_tokens and cut.target_forwards == 16 < out.target_forwards
    assert [len(t) for t in cut.tokens] == [64, 64, 16, 16]
    assert cut.tokens[2] == out.tokens[2][:16] and cut.tokens[0] == out.tokens[0]
    plain = generate(target, PROMPTS, max_new_tokens=64)
    assert plain.full_batch_tokens == 4 * 64 and plain.full_batch_s <= plain.total_s


def test_stop_token_ends_row_and_others_continue(target, reference):
    stop = reference[tuple(PROMPTS[0])][5]
    out = generate(
        target,
        PROMPTS,
        drafter=ScriptedDrafter(reference, False, 32),
        num_draft_tokens=3,
        max_new_tokens=64,
        stop_token_ids=[stop],
    )
    for p, toks in zip(PROMPTS, out.tokens):
        ref = reference[tuple(p)]
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert toks == ref[:cut]


def test_bad_arguments(target):
    with pytest.raises(SpecdecError, match="draft length"):
        generate(target, PROMPTS, drafter=NgramDrafter(None, NgramDrafter.Options()), num_draft_tokens=0)
    with pytest.raises(SpecdecError, match="at least one token"):
        generate(target, [[]])
    with pytest.raises(SpecdecError, match="temperature"):
        generate(target, PROMPTS, temperature=-1.0)


class OverlongDrafter(ScriptedDrafter):
    def propose(self, request):
        return Draft(tokens=[[1] * (m + 1) for m in request.max_tokens])


def test_drafter_breaking_its_contract_is_reported(target, reference):
    with pytest.raises(SpecdecError, match="more than the"):
        generate(target, PROMPTS, drafter=OverlongDrafter(reference, False, 32), num_draft_tokens=2)


# ---------------------------------------------------------------------------- rejection sampling

V_SMALL, N_SAMPLES, T = 8, 6000, 1.0
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def peaked_target() -> CausalLM:
    return tiny_model(vocab=V_SMALL, layers=2, seed=1, head_scale=3.0)


@pytest.fixture(scope="module")
def exact_marginals(peaked_target) -> tuple[np.ndarray, np.ndarray]:
    """P(x1) and P(x2) = sum_x1 P(x1) P(x2 | x1) from the target's own softmax."""
    m = peaked_target
    with torch.no_grad():
        p1 = torch.softmax(
            m(torch.tensor([PROMPT]), m.new_cache(1, 16), torch.zeros(1, dtype=torch.long))[0, -1] / T, -1
        )
        rows = torch.tensor([PROMPT + [x] for x in range(V_SMALL)])
        p2_given = torch.softmax(
            m(rows, m.new_cache(V_SMALL, 16), torch.zeros(V_SMALL, dtype=torch.long))[:, -1] / T, -1
        )
    return p1.double().numpy(), (p1[:, None] * p2_given).sum(0).double().numpy()


class FixedDrafter(ScriptedDrafter):
    """Deterministic proposals (q is one-hot): always [2, 5, ...]."""

    def __init__(self):
        pass

    def start(self, prompts):
        pass

    def keep_rows(self, indices):
        pass

    def propose(self, request):
        return Draft(tokens=[[2, 5, 2, 5][:m] for m in request.max_tokens])


def sampled_pvalues(target, drafter) -> tuple[float, float]:
    out = generate(
        target, [PROMPT] * N_SAMPLES, drafter=drafter, num_draft_tokens=2, max_new_tokens=3, temperature=T, seed=7
    )
    firsts = np.bincount([t[0] for t in out.tokens], minlength=V_SMALL)
    seconds = np.bincount([t[1] for t in out.tokens], minlength=V_SMALL)
    return firsts, seconds


def chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs / probs.sum() * counts.sum()
    keep = expected >= 5  # pool rare cells: the chi-square approximation needs expected counts >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()  # exact totals despite float rounding
    return float(chisquare(obs, exp).pvalue)


def drafters_for(target):
    return {
        "draft_model": DraftModelDrafter(loaded(target), DraftModelDrafter.Options(layers=1)),
        "fixed": FixedDrafter(),
        # a reduced draft vocabulary: its probabilities are mapped into the target's through d2t
        "eagle3": Eagle3Drafter.from_head(new_eagle3_head(target, draft_vocab=[0, 2, 3, 5, 7])),
        # one parallel pass: every slot's distribution is fixed before any is sampled (DFlash) or biased by the
        # token sampled before it (DSpark's Markov step)
        "dflash": DFlashDrafter.from_head(new_dflash_head(target, draft_vocab=[0, 2, 3, 5, 7], block_size=3, seed=1)),
        "dspark": DSparkDrafter.from_head(_markov_active(new_dflash_head(target, markov_rank=4, block_size=2))),
    }


def _markov_active(head):
    """A DSpark head whose Markov bias is not zero (a fresh head starts with W2 = 0)."""
    with torch.no_grad():
        head.markov_head.markov_w2.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
    return head


@pytest.mark.parametrize("which", ["draft_model", "fixed", "eagle3", "dflash", "dspark"])
def test_rejection_sampling_matches_target_distribution(peaked_target, exact_marginals, which):
    firsts, seconds = sampled_pvalues(peaked_target, drafters_for(peaked_target)[which])
    assert chi2_p(firsts, exact_marginals[0]) > 1e-3
    assert chi2_p(seconds, exact_marginals[1]) > 1e-3


def test_plain_sampling_matches_target_distribution(peaked_target, exact_marginals):
    out = generate(peaked_target, [PROMPT] * N_SAMPLES, max_new_tokens=2, temperature=T, seed=3)
    assert chi2_p(np.bincount([t[0] for t in out.tokens], minlength=V_SMALL), exact_marginals[0]) > 1e-3
    assert chi2_p(np.bincount([t[1] for t in out.tokens], minlength=V_SMALL), exact_marginals[1]) > 1e-3


@pytest.mark.parametrize(
    "perturbation",
    [
        lambda p_x, q_x: torch.ones_like(p_x),  # accept every draft
        lambda p_x, q_x: torch.clamp(1.5 * p_x / q_x.clamp_min(1e-30), max=1.0),  # accept too often
        lambda p_x, q_x: torch.clamp(p_x / q_x.clamp_min(1e-30), max=1.0) ** 2,  # accept too rarely
    ],
    ids=["accept-all", "too-often", "too-rarely"],
)
@pytest.mark.parametrize("which", ["draft_model", "fixed"])
def test_the_distribution_test_catches_a_perturbed_rule(
    peaked_target, exact_marginals, monkeypatch, perturbation, which
):
    """A test of the test: with a wrong acceptance rule, the same check must fail."""
    monkeypatch.setattr(specdec, "accept_probability", perturbation)
    firsts, seconds = sampled_pvalues(peaked_target, drafters_for(peaked_target)[which])
    assert min(chi2_p(firsts, exact_marginals[0]), chi2_p(seconds, exact_marginals[1])) < 1e-3


def test_prefill_groups_bound_the_padding_and_cover_every_row_once():
    lengths = [380, 30, 35, 200, 31, 120, 0, 60, 33, 210]
    groups = specdec.prefill_groups(lengths)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))
    for g in groups:  # a group pads to its longest row: at most 25% more tokens than its rows hold
        assert len(g) * max(lengths[b] for b in g) <= 1.25 * sum(lengths[b] for b in g) or len(g) == 1
    assert len(groups) < len(lengths)  # rows of similar length share one prefill
    # one padded prefill would run 10 x 380 = 3800 tokens for 1099
    assert sum(len(g) * max(lengths[b] for b in g) for g in groups) <= 1.25 * sum(lengths)


def test_generation_of_prompts_of_very_different_lengths_equals_each_alone():
    """The grouped prefill writes each row's keys where the batch's decode reads them, hidden states included."""
    model = tiny_model(layers=2, seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (1, 3, 40, 41, 90, 5)]
    together = generate(model, prompts, max_new_tokens=12).tokens
    assert together == [generate(model, [p], max_new_tokens=12).tokens[0] for p in prompts]
    head = Eagle3Drafter(loaded(model), Eagle3Drafter.Options(random=True))
    assert generate(model, prompts, drafter=head, num_draft_tokens=3, max_new_tokens=12).tokens == together
