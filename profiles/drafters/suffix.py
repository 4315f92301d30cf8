"""Suffix decoding (SuffixDecoding; arctic-inference, vLLM `method="suffix"`) over each row's own text.

Index. Per row, a suffix trie of bounded depth D = max_tree_depth over the row's tokens (prompt and
generated): every start position s contributes the path t[s : min(s+D, n)], so a node's count is the
number of occurrences of its string in the row (for strings of length ≤ D). The trie is updated
incrementally: appending one token extends the ≤ D "active" suffixes (those of length 0..D-1) by one
node each, so a round costs O(D) per new token plus the lookup below, never O(context length).
Memory is O(n·D) nodes per row (arctic's path-compressed tree would be O(n); not needed at our sizes).

Lookup, each round, with pattern = the last min(n, D) tokens and k = request.max_tokens[b]
(arctic-inference `SuffixTree::speculate` + `_speculate_path`, as vLLM calls it):
  for every match length m = 1 .. len(pattern) - 1 (shorter to longer):
    start at the node of the last m tokens (it always exists: the row itself is indexed);
    cap = min(k, floor(m · max_spec_factor + 1e-6))      # arctic truncates, it does not round up
    walk greedily: child c = the child with the highest count, p *= count(c) / count(node);
      stop before emitting c if p < min_token_prob, when there is no child, or at cap tokens;
    score = sum of p over the emitted tokens;
  keep the draft with the highest score; ties go to the longer match (arctic compares with >=).
Because the trailing occurrence of the suffix has no continuation yet, a pattern seen once before
gives p = 1/2 for its first token, and a node at depth D has no children (match + draft ≤ D).

Differences from arctic-inference, on purpose:
  - Ties between equally frequent children go to the one counted most recently (arctic: hash-map
    order, i.e. unspecified); probabilities are float64 (arctic: float32).
  - No cross-request global tree (arctic's `max_cached_requests` cache of past responses): each row
    sees only its own prompt and output, so a run's rows stay independent.
Proposals are deterministic: probs=None (q is one-hot).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.base import Draft, Drafter, DraftRequest, register

if TYPE_CHECKING:
    from collections.abc import Sequence

    from specdec_tune.profiles.models.loading import LoadedModel

_TOKEN_SPAN = 1 << 32  # edge key = node * _TOKEN_SPAN + token, so token ids must lie in [0, 2**32)
_ROOT = 0


class SuffixTrie:
    """Bounded-depth suffix trie of one growing token sequence (see the module docstring)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.edges: dict[int, int] = {}  # node * _TOKEN_SPAN + token -> child node
        self.count: list[int] = [0]  # count[v] = occurrences of v's string in the sequence
        self.token: list[int] = [-1]  # token[v] = last token of v's string
        self.best: list[int] = [-1]  # best[v] = most frequent child (ties: most recently counted), -1 if none
        self.active: list[int] = []  # active[m-1] = node of the last m tokens, m = 1..min(n, D)
        self.n = 0  # tokens indexed so far
        self.last = -1  # the last token indexed (to check that the next list extends this one)

    def extend(self, tokens: Sequence[int]) -> None:
        """Index tokens appended to the sequence: O(D) dict operations per token."""
        if not tokens:
            return
        if min(tokens) < 0 or max(tokens) >= _TOKEN_SPAN:
            raise SpecdecError("suffix drafter got a token id outside [0, 2**32)", "pass token ids from the tokenizer")
        edges, count, token, best = self.edges, self.count, self.token, self.best
        for tok in tokens:
            extended = []
            # Extend the suffixes of length 0..D-1 by tok; the length-D one is dropped (depth bound).
            for node in [_ROOT, *self.active[: self.max_depth - 1]]:
                key = node * _TOKEN_SPAN + tok
                child = edges.get(key)
                if child is None:
                    child = len(count)
                    edges[key] = child
                    count.append(0)
                    token.append(tok)
                    best.append(-1)
                count[child] += 1
                b = best[node]
                if b < 0 or count[child] >= count[b]:
                    best[node] = child
                extended.append(child)
            self.active = extended
        self.n += len(tokens)
        self.last = tokens[-1]

    def speculate(self, k: int, max_spec_factor: float, min_token_prob: float) -> list[int]:
        """The best-scoring greedy draft over all match lengths (rule in the module docstring)."""
        best_draft: list[int] = []
        best_score = 0.0
        for m in range(1, len(self.active)):  # pattern = last len(active) tokens; m < len(pattern)
            cap = min(k, int(m * max_spec_factor + 1e-6))
            draft, score = self._walk(self.active[m - 1], cap, min_token_prob)
            if score >= best_score:
                best_draft, best_score = draft, score
        return best_draft

    def _walk(self, node: int, cap: int, min_token_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent child from `node`: (tokens, sum of their path probabilities)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < cap:
            child = self.best[node]
            if child < 0:
                break
            prob *= self.count[child] / self.count[node]
            if prob < min_token_prob:
                break
            draft.append(self.token[child])
            score += prob
            node = child
        return draft, score


@register("suffix")
class SuffixDrafter(Drafter):
    """Model-free suffix decoding: follow the most frequent continuation of the longest useful suffix."""

    kind = "model_free"
    replay = "prefix"  # proposals depend only on the tokens so far

    @dataclasses.dataclass(frozen=True)
    class Options:
        max_tree_depth: int = 24  # D: bounds match length + draft length (vLLM suffix_decoding_max_tree_depth)
        max_spec_factor: float = 1.0  # draft ≤ floor(factor · match length) tokens (vLLM default 1.0)
        min_token_prob: float = 0.1  # stop when the path's empirical probability drops below this (vLLM 0.1)

        def __post_init__(self) -> None:
            if self.max_tree_depth < 2:
                raise SpecdecError(
                    f"suffix max_tree_depth={self.max_tree_depth} is too small",
                    "use at least 2 (one token to match, one to propose); vLLM's default is 24",
                )
            if not 0 <= self.max_spec_factor < math.inf:
                raise SpecdecError(
                    f"suffix max_spec_factor={self.max_spec_factor} is not a finite value ≥ 0", "use e.g. 1.0"
                )
            if not 0 <= self.min_token_prob <= 1:
                raise SpecdecError(
                    f"suffix min_token_prob={self.min_token_prob} is not a probability",
                    "use a value in [0, 1], e.g. 0.1",
                )

    def __init__(self, target: LoadedModel | None, options: Options) -> None:
        self.target = target  # unused: suffix decoding needs no model
        self.options = options
        self._rows: list[SuffixTrie] = []

    def start(self, prompts: list[list[int]]) -> None:
        self._rows = [self._build(prompt) for prompt in prompts]

    def propose(self, request: DraftRequest) -> Draft:
        if len(request.token_ids) != len(self._rows):
            raise SpecdecError(
                f"suffix drafter holds {len(self._rows)} rows but was asked about {len(request.token_ids)}",
                "call start() with the batch's prompts and keep_rows() when rows finish",
            )
        opts = self.options
        tokens = []
        for b, (ids, k) in enumerate(zip(request.token_ids, request.max_tokens)):
            row = self._sync(b, ids)
            tokens.append(row.speculate(k, opts.max_spec_factor, opts.min_token_prob) if k > 0 else [])
        return Draft(tokens=tokens)

    def keep_rows(self, indices: list[int]) -> None:
        self._rows = [self._rows[i] for i in indices]

    def _build(self, token_ids: Sequence[int]) -> SuffixTrie:
        row = SuffixTrie(self.options.max_tree_depth)
        row.extend(token_ids)
        return row

    def _sync(self, b: int, token_ids: list[int]) -> SuffixTrie:
        """Index only the tokens appended since last time.

        Rebuilds the row if the list is shorter than what was indexed or its token at the old end differs
        (an O(1) check, not a full prefix comparison: the interface promises lists only grow).
        """
        row = self._rows[b]
        if len(token_ids) < row.n or (row.n > 0 and token_ids[row.n - 1] != row.last):
            row = self._rows[b] = self._build(token_ids)
        else:
            row.extend(token_ids[row.n :])
        return row
