"""Lossless on the real demo target: greedy speculative output equals plain greedy output, token for
token, for every drafter, on 40 held-back prompts x 64 new tokens at batch 8 and the first 16 of them at
batch 1 (16 and 8 for the untrained learned heads, which accept almost nothing), in fp32."""

from __future__ import annotations

import pytest

from specdec_tune.profiles.decode_run import decode_prompts, select_prompts
from specdec_tune.profiles.drafters import available, create
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.prompts import encode_prompts

pytestmark = pytest.mark.demo

NUM_PROMPTS, MAX_NEW, D = 40, 64, 3
# draft_model with 2 layers: the cheapest draft still exercises every rollback path. The learned heads run untrained
# (random=1): losslessness does not depend on their quality, and a trained head is not committed.
DRAFTER_OPTIONS = {"ngram": {}, "suffix": {}, "draft_model": {"layers": "2"}, "eagle3": {"random": "1"}, "mtp": {"random": "1"},
                   "dflash": {"random": "1"}, "dspark": {"random": "1"}}


@pytest.fixture(scope="module")
def demo():
    target = load_model(dtype="float32")
    prompts = select_prompts("default", "held_back", NUM_PROMPTS)
    ids = encode_prompts(target.tokenizer, prompts, context_tokens=target.model.config.max_position_embeddings,
                         max_new_tokens=MAX_NEW, max_draft_tokens=D)
    plain, _, _ = decode_prompts(target, ids, 8, max_new_tokens=MAX_NEW)
    return target, ids, plain


def test_every_registered_drafter_is_covered():
    assert set(DRAFTER_OPTIONS) == set(available())


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mechanism", sorted(DRAFTER_OPTIONS))
def test_greedy_speculative_equals_plain(demo, mechanism, batch):
    target, ids, plain = demo
    # batch 1 runs a target forward per round for each prompt alone; untrained heads accept almost nothing, so a round
    # costs a target forward per token for them: fewer prompts cover the same paths
    untrained = bool(DRAFTER_OPTIONS[mechanism].get("random"))
    n = (16 if untrained else NUM_PROMPTS) if batch > 1 else (8 if untrained else 16)
    drafter = create(mechanism, target, DRAFTER_OPTIONS[mechanism])
    tokens, counters, _ = decode_prompts(target, ids[:n], batch, drafter=drafter, num_draft_tokens=D, max_new_tokens=MAX_NEW)
    assert len(tokens) == n
    mismatched = [i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b]
    assert not mismatched, f"{mechanism} at batch {batch} differs from plain greedy on prompts {mismatched}"
    # The drafter really drafted (a loop that never speculates would pass trivially).
    assert sum(c.num_drafts for c in counters) > 0
