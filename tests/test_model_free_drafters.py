"""Model-free drafters (ngram prompt lookup, suffix decoding): known answers and brute-force references."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.base import DraftRequest, create, parse_options
from specdec_tune.profiles.drafters.ngram import NgramDrafter
from specdec_tune.profiles.drafters.suffix import SuffixDrafter


def ngram(min_n: int = 2, max_n: int = 5) -> NgramDrafter:
    return NgramDrafter(None, NgramDrafter.Options(prompt_lookup_min=min_n, prompt_lookup_max=max_n))


def suffix(depth: int = 24, factor: float = 1.0, min_prob: float = 0.1) -> SuffixDrafter:
    options = SuffixDrafter.Options(max_tree_depth=depth, max_spec_factor=factor, min_token_prob=min_prob)
    return SuffixDrafter(None, options)


def ask(drafter, rows: list[list[int]], k: int | list[int]) -> list[list[int]]:
    ks = k if isinstance(k, list) else [k] * len(rows)
    draft = drafter.propose(DraftRequest(token_ids=rows, max_tokens=ks, temperature=0.0))
    assert draft.probs is None
    return draft.tokens


def ask_one(drafter, ids: list[int], k: int) -> list[int]:
    return ask(drafter, [ids], k)[0]


def fresh_suffix(ids: list[int], k: int, **kw) -> list[int]:
    drafter = suffix(**kw)
    drafter.start([ids])
    return ask_one(drafter, ids, k)


def test_registered_and_described():
    drafter = create("ngram", None, {"prompt_lookup_max": "4"})
    assert drafter.describe() == {
        "name": "ngram",
        "kind": "model_free",
        "options": {"prompt_lookup_min": 2, "prompt_lookup_max": 4},
    }
    drafter = create("suffix", None, {"min_token_prob": "0.2"})
    assert drafter.describe() == {
        "name": "suffix",
        "kind": "model_free",
        "options": {"max_tree_depth": 24, "max_spec_factor": 1.0, "min_token_prob": 0.2},
    }


# ---- ngram ----------------------------------------------------------------------------------------


def ngram_reference(t: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule, by brute force: longest suffix n-gram in [min, max] with an earlier occurrence
    that has a token after it; its earliest occurrence; the up-to-k tokens that follow."""
    n_tokens = len(t)
    for n in range(max_n, min_n - 1, -1):
        for p in range(0, n_tokens - n):  # the occurrence t[p:p+n] ends at or before index N-2
            if t[p : p + n] == t[n_tokens - n :]:
                return t[p + n : p + n + k]
    return []


def test_ngram_longest_match_wins_over_shorter_earlier_one():
    #      "2 3" first at 1..2 (then 90)      "1 2 3" at 5..7 (then 70 71 8)
    ids = [5, 2, 3, 90, 91, 1, 2, 3, 70, 71, 8, 1, 2, 3]
    assert ask_one(ngram(2, 5), ids, 3) == [70, 71, 8]
    assert ask_one(ngram(2, 2), ids, 3) == [90, 91, 1]  # the window caps n at 2: earliest "2 3" wins


def test_ngram_takes_the_earliest_occurrence():
    ids = [1, 2, 10, 1, 2, 20, 1, 2]
    assert ask_one(ngram(2, 5), ids, 1) == [10]


def test_ngram_truncates_near_the_end_and_overlaps():
    assert ask_one(ngram(2, 5), [7, 8, 9, 7, 8], 5) == [9, 7, 8]
    assert ask_one(ngram(2, 3), [4, 4, 4, 4], 5) == [4]  # "4 4 4" at 0..2, overlapping the suffix


def test_ngram_no_match_proposes_nothing():
    assert ask_one(ngram(1, 5), [1, 2, 3, 4, 5], 4) == []
    assert ask_one(ngram(1, 5), [], 4) == []
    assert ask_one(ngram(1, 5), [3], 4) == []


def test_ngram_min_window_is_respected():
    ids = [1, 2, 3, 9, 3]  # only the 1-gram "3" repeats
    assert ask_one(ngram(2, 5), ids, 2) == []
    assert ask_one(ngram(1, 5), ids, 2) == [9, 3]


def test_ngram_max_tokens_caps_and_zero():
    ids = [1, 2, 3, 4, 5, 6, 1, 2]
    drafter = ngram(2, 5)
    assert ask(drafter, [ids, ids, ids], [0, 1, 10]) == [[], [3], [3, 4, 5, 6, 1, 2]]


def test_ngram_options_are_checked():
    with pytest.raises(SpecdecError):
        NgramDrafter.Options(prompt_lookup_min=0, prompt_lookup_max=3)
    with pytest.raises(SpecdecError):
        NgramDrafter.Options(prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(SpecdecError):
        parse_options(NgramDrafter.Options, {"prompt_lookup_min": "6"})  # 6 > default max 5
    with pytest.raises(SpecdecError):
        parse_options(NgramDrafter.Options, {"prompt_lookup": "3"})
    assert parse_options(NgramDrafter.Options, {"prompt_lookup_max": "3"}) == NgramDrafter.Options(2, 3)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), max_size=40),
    window=st.tuples(st.integers(1, 6), st.integers(0, 4)),
    k=st.integers(0, 7),
)
def test_ngram_matches_brute_force(ids, window, k):
    min_n, max_n = window[0], window[0] + window[1]
    assert ask_one(ngram(min_n, max_n), ids, k) == ngram_reference(ids, min_n, max_n, k)


# ---- suffix ---------------------------------------------------------------------------------------


def suffix_reference(t: list[int], depth: int, factor: float, min_prob: float, k: int) -> list[int]:
    """The suffix-decoding rule by direct occurrence counting, no trie.

    count(w) = occurrences of w in t; a child w+c exists when |w+c| <= depth; the greedy child has
    the highest count, ties broken by the latest occurrence; probabilities multiply count ratios.
    """

    def occurrence_ends(w: list[int]) -> list[int]:
        return [e for e in range(len(w) - 1, len(t)) if t[e - len(w) + 1 : e + 1] == w]

    n = len(t)
    best, best_score = [], 0.0
    for m in range(1, min(n, depth)):
        cap = min(k, int(m * factor + 1e-6))
        w = t[n - m :]
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < cap and len(w) < depth:
            stats: dict[int, tuple[int, int]] = {}  # next token -> (count, latest end)
            for e in occurrence_ends(w):
                if e + 1 < n:
                    count, _ = stats.get(t[e + 1], (0, -1))
                    stats[t[e + 1]] = (count + 1, e + 1)
            if not stats:
                break
            c = max(stats, key=lambda tok: stats[tok])
            prob *= stats[c][0] / len(occurrence_ends(w))
            if prob < min_prob:
                break
            draft.append(c)
            score += prob
            w = w + [c]
        if score >= best_score:
            best, best_score = draft, score
    return best


def test_suffix_repeated_pattern_proposes_its_continuation():
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    # Best match "1 2 3" (m=3): each token has p = 1/2, draft capped at floor(1.0 * 3) = 3 tokens.
    assert fresh_suffix(ids, 8) == [4, 5, 1]
    # factor 2 allows 6, but the earlier occurrence's path ends with the sequence.
    assert fresh_suffix(ids, 8, factor=2.0) == [4, 5, 1, 2, 3]
    assert fresh_suffix(ids, 2) == [4, 5]


def test_suffix_most_frequent_branch_wins_over_most_recent():
    ids = [1, 2, 7, 1, 2, 7, 1, 2, 8, 1, 2]  # "1 2" -> 7 twice, 8 once
    assert fresh_suffix(ids, 4) == [7, 1]


def test_suffix_min_token_prob_stops():
    ids = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]  # "1 2" has 4 continuations, p = 1/5 each
    assert fresh_suffix(ids, 4, min_prob=0.25) == []
    assert fresh_suffix(ids, 4, min_prob=0.1) == [6, 1]  # tie: the most recent continuation
    ids = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]  # p(7 | 5 6) = 2/3, then p(8 or 9 | 5 6 7) = 1/2 -> 1/3
    assert fresh_suffix(ids, 4, min_prob=0.5) == [7]
    assert fresh_suffix(ids, 4, min_prob=0.3) == [7, 9]


def test_suffix_depth_bounds_match_plus_draft():
    ids = [1, 2, 3, 4, 1, 2]
    assert fresh_suffix(ids, 4, depth=24) == [3, 4]  # match "1 2", draft capped at 2
    assert fresh_suffix(ids, 4, depth=3) == [3]  # match 2 + draft 1 = depth 3


def test_suffix_max_tokens_caps_and_zero():
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    drafter = suffix()
    drafter.start([ids, ids, ids])
    assert ask(drafter, [ids, ids, ids], [0, 1, 8]) == [[], [4], [4, 5, 1]]


def test_suffix_incremental_rounds_and_keep_rows():
    prompts = [[1, 2, 3, 4], [9, 8, 9, 8, 7], [5, 5, 6, 5, 5]]
    drafter = suffix()
    drafter.start(prompts)
    rows = [list(p) for p in prompts]
    for new in ([1], [2, 3], [9, 8]):
        rows = [r + new for r in rows]
        assert ask(drafter, rows, 5) == [fresh_suffix(r, 5) for r in rows]
    drafter.keep_rows([2, 0])
    rows = [rows[2] + [6], rows[0] + [4]]
    assert ask(drafter, rows, 5) == [fresh_suffix(r, 5) for r in rows]
    with pytest.raises(SpecdecError):
        ask(drafter, rows + [[1, 2]], 5)


def test_suffix_rebuilds_when_the_list_does_not_extend_the_old_one():
    drafter = suffix()
    drafter.start([[1, 2, 3, 1, 2]])
    ids = [4, 5, 6, 4, 5]
    assert ask_one(drafter, ids, 3) == fresh_suffix(ids, 3) == [6, 4]


def test_suffix_options_are_checked():
    bad_options = [
        {"max_tree_depth": 1},
        {"max_spec_factor": -1.0},
        {"max_spec_factor": float("inf")},
        {"min_token_prob": 1.5},
    ]
    for bad in bad_options:
        with pytest.raises(SpecdecError):
            SuffixDrafter.Options(**bad)
    with pytest.raises(SpecdecError):
        parse_options(SuffixDrafter.Options, {"min_token_prob": "nan"})
    assert parse_options(SuffixDrafter.Options, {"max_tree_depth": "8"}).max_tree_depth == 8


suffix_settings = st.fixed_dictionaries(
    {
        "depth": st.integers(2, 7),
        "factor": st.sampled_from([0.5, 1.0, 2.0, 3.0]),
        "min_prob": st.sampled_from([0.0, 0.1, 0.3, 0.5]),
    }
)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 3), max_size=30), k=st.integers(0, 6), kw=suffix_settings)
def test_suffix_matches_brute_force(ids, k, kw):
    assert fresh_suffix(ids, k, **kw) == suffix_reference(ids, k=k, **kw)


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2), max_size=12),
    rounds=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), max_size=8),
    k=st.integers(1, 5),
    kw=suffix_settings,
)
def test_suffix_incremental_equals_rebuild(prompt, rounds, k, kw):
    drafter = suffix(**kw)
    drafter.start([prompt])
    ids = list(prompt)
    for new in rounds:
        ids = ids + new
        assert ask_one(drafter, ids, k) == fresh_suffix(ids, k, **kw)
