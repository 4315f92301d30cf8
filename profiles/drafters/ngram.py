"""Prompt lookup (n-gram) drafting, with the matching rule of vLLM's `method="ngram"`.

The rule (vLLM `vllm/v1/spec_decode/ngram_proposer.py::_find_longest_matched_ngram_and_propose_tokens`,
a reverse-KMP scan; restated here from what that code computes):

  Let t = t[0..N-1] be the row's tokens (prompt + generated, the last one included).
  1. n* = the LONGEST n in [1, prompt_lookup_max] such that the last n tokens t[N-n:] also occur
     earlier, ending at or before t[N-2] (so at least one token follows that occurrence; the
     occurrence may overlap the suffix itself).
  2. If there is no such n, or n* < prompt_lookup_min: propose nothing.
  3. Otherwise take the EARLIEST such occurrence (smallest start p) of that n*-gram and propose
     t[p+n* : p+n*+k], i.e. up to k tokens that followed it: fewer than k when it sits near the end.

With k = request.max_tokens[b] (vLLM caps k at max_model_len - N the same way). vLLM's own defaults
when both window values are unset are prompt_lookup_min = prompt_lookup_max = 5; ours are 2 and 5, so
short repeats are used too. The proposals are deterministic: probs=None (q is one-hot).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.base import Draft, Drafter, DraftRequest, register

if TYPE_CHECKING:
    from specdec_tune.profiles.models.loading import LoadedModel


def find_ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """Return (n*, start) for the rule in the module docstring; (0, 0) when nothing qualifies.

    `start` is the index of the first token after the earliest occurrence of the last n* tokens.
    Cost: one vectorized filter per n over the surviving candidates, so O(N) for n = 1 and
    O(#candidates) after that.
    """
    # tokens: [N] int64
    n_tokens = tokens.shape[0]
    if n_tokens < max(min_n, 2):
        return 0, 0
    # Candidates are identified by q = the index right after an occurrence (q in [1, N-1]).
    # n = 1: the token before q equals the last token.
    cand = np.flatnonzero(tokens[: n_tokens - 1] == tokens[n_tokens - 1]) + 1  # [C] int64, ascending
    best_n, best_q = 0, 0
    n = 1
    while cand.size:
        best_n, best_q = n, int(cand[0])  # cand ascending: cand[0] is the earliest occurrence
        if n == max_n:
            break
        n += 1
        # Extend every surviving occurrence one token to the left: t[q-n] == t[N-n].
        cand = cand[cand >= n]
        cand = cand[tokens[cand - n] == tokens[n_tokens - n]]
    if best_n < min_n:
        return 0, 0
    return best_n, best_q


@register("ngram")
class NgramDrafter(Drafter):
    """Model-free prompt lookup: copy what followed the longest earlier repeat of the recent tokens."""

    kind = "model_free"
    replay = "prefix"  # proposals depend only on the tokens so far

    @dataclasses.dataclass(frozen=True)
    class Options:
        prompt_lookup_min: int = 2  # shortest suffix n-gram worth matching (vLLM default when unset: 5)
        prompt_lookup_max: int = 5  # longest suffix n-gram tried; the longest match wins (vLLM default: 5)

        def __post_init__(self) -> None:
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise SpecdecError(
                    f"ngram window prompt_lookup_min={self.prompt_lookup_min}, "
                    f"prompt_lookup_max={self.prompt_lookup_max} is invalid",
                    "use 1 <= prompt_lookup_min <= prompt_lookup_max, e.g. prompt_lookup_min=2 prompt_lookup_max=5",
                )

    def __init__(self, target: LoadedModel | None, options: Options) -> None:
        self.target = target  # unused: prompt lookup needs no model
        self.options = options

    def start(self, prompts: list[list[int]]) -> None:
        """Stateless: every round scans the full token list."""

    def propose(self, request: DraftRequest) -> Draft:
        return Draft(tokens=[self._propose_row(ids, k) for ids, k in zip(request.token_ids, request.max_tokens)])

    def _propose_row(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [N]
        n, start = find_ngram_match(tokens, self.options.prompt_lookup_min, self.options.prompt_lookup_max)
        if n == 0:
            return []
        return tokens[start : start + k].tolist()
