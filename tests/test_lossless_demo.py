"""Lossless on the real demo target: greedy speculative output equals plain greedy output, token for
token, for every drafter, on 16 held-back prompts x 20 new tokens at batch 8 (two batches whose rows finish
at different rounds) and the first 4 of them at batch 1, in fp32.

The learned heads run untrained (a trained head is not committed), and an untrained head accepts almost nothing,
which would leave the paths that keep accepted drafts unexercised. So each head's proposals pass through an oracle:
the head runs its real step every round (its caches, catch-up and row bookkeeping all run), then its tokens are
replaced by the target's own greedy continuation, spoiled at every third position from the row's start so that
rounds end in full, partial and empty acceptance."""

from __future__ import annotations

import pytest

from specdec_tune.profiles.calibration import select_prompts
from specdec_tune.profiles.decode_run import decode_prompts
from specdec_tune.profiles.drafters import Draft, Drafter, DraftRequest, available, create
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.prompts import encode_prompts

pytestmark = pytest.mark.demo

NUM_PROMPTS, BATCH_1_PROMPTS, MAX_NEW, D = 16, 4, 20, 3
# draft_model with 2 layers: the cheapest draft still exercises every rollback path. The learned heads run untrained
# (random=1): losslessness does not depend on their quality, and a trained head is not committed.
DRAFTER_OPTIONS = {
    "ngram": {},
    "suffix": {},
    "draft_model": {"layers": "2"},
    "eagle3": {"random": "1"},
    "mtp": {"random": "1"},
    "dflash": {"random": "1"},
    "dspark": {"random": "1"},
}


@pytest.fixture(scope="module")
def demo():
    target = load_model(dtype="float32")
    prompts = select_prompts("default", "held_back", NUM_PROMPTS)
    ids = encode_prompts(
        target.tokenizer,
        prompts,
        context_tokens=target.model.config.max_position_embeddings,
        max_new_tokens=MAX_NEW,
        max_draft_tokens=D,
    )
    plain, _, _ = decode_prompts(target, ids, 8, max_new_tokens=MAX_NEW)
    return target, ids, plain


class OracleProposals(Drafter):
    """`inner`'s rounds, with its proposals replaced by the plain greedy continuation (spoiled every `spoil_every`-th
    generated position): drafts that are accepted, in part or not at all, from a head that never learned to draft."""

    def __init__(
        self,
        inner: Drafter,
        prompts: list[list[int]],
        continuations: list[list[int]],
        vocab_size: int,
        spoil_every: int = 3,
    ) -> None:
        self.inner, self.vocab_size, self.spoil_every = inner, vocab_size, spoil_every
        self.name, self.kind, self.hidden_layers = inner.name, inner.kind, inner.hidden_layers
        self.continuation = {tuple(p): c for p, c in zip(prompts, continuations)}
        self.rows: list[tuple[int, ...]] = []

    def start(self, prompts: list[list[int]]) -> None:
        self.inner.start(prompts)
        self.rows = [tuple(p) for p in prompts]

    def keep_rows(self, indices: list[int]) -> None:
        self.inner.keep_rows(indices)
        self.rows = [self.rows[i] for i in indices]

    def propose(self, request: DraftRequest) -> Draft:
        own = self.inner.propose(request)  # the head's real round
        tokens = []
        for prompt, ids, n in zip(self.rows, request.token_ids, request.max_tokens):
            done = len(ids) - len(prompt)  # generated so far, the last one included
            truth = self.continuation[prompt][done : done + n]
            tokens.append(
                [t if (done + i) % self.spoil_every else (t + 1) % self.vocab_size for i, t in enumerate(truth)]
            )
        assert len(own.tokens) == len(tokens)
        return Draft(tokens)


def test_every_registered_drafter_is_covered():
    assert set(DRAFTER_OPTIONS) == set(available())


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mechanism", sorted(DRAFTER_OPTIONS))
def test_greedy_speculative_equals_plain(demo, mechanism, batch):
    target, ids, plain = demo
    # batch 1 runs a target forward per round for each prompt alone: fewer prompts cover the same paths
    untrained = bool(DRAFTER_OPTIONS[mechanism].get("random"))
    n = NUM_PROMPTS if batch > 1 else BATCH_1_PROMPTS
    drafter = create(mechanism, target, DRAFTER_OPTIONS[mechanism])
    if untrained:
        drafter = OracleProposals(drafter, ids[:n], plain[:n], target.model.config.vocab_size)
    tokens, counters, _ = decode_prompts(
        target, ids[:n], batch, drafter=drafter, num_draft_tokens=D, max_new_tokens=MAX_NEW
    )
    assert len(tokens) == n
    mismatched = [i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b]
    assert not mismatched, f"{mechanism} at batch {batch} differs from plain greedy on prompts {mismatched}"
    # The drafter really drafted (a loop that never speculates would pass trivially), and drafts were accepted.
    assert sum(c.num_drafts for c in counters) > 0
    assert sum(c.num_accepted_tokens for c in counters) > 0
