"""The speculative decoding loop: the reference the profiler measures with.

One round for a batch of rows (each row: prompt + tokens generated so far; the target's KV cache
holds every token but the last):
  1. the drafter proposes k_b ≤ D tokens for row b (model-free drafters may propose fewer, or none);
  2. one target forward over [last token, d_1..d_k] per row (padded to the longest draft) gives
     the target's distribution p_0..p_k at each position;
  3. verification accepts a prefix d_1..d_n and emits one more token from the target (the bonus on
     full acceptance, the correction otherwise): n+1 tokens per row per target forward;
  4. the KV cache length advances by 1+n; the rejected drafts' slots are simply reused (rollback).
     A drafter that declares `hidden_layers` (EAGLE-3, MTP) receives, with its next request, the target's
     hidden states at those layers for the 1+n verified positions (after prefill: for the prompt but its last token).

Verification:
  greedy (temperature 0): accept d_i while d_i == argmax p_{i-1}; emit argmax p_n.
  sampled (Leviathan et al. 2023, Chen et al. 2023): accept d_i with probability min(1, p(d_i)/q(d_i));
  on the first rejection emit a sample of norm(max(p - q, 0)); after full acceptance sample p_k.
  q is the draft's distribution; a deterministic proposal has q = one-hot(d_i), so it is accepted
  with probability p(d_i) and the residual is p with d_i removed. Output is distributed as the target's.

Counters follow vLLM's names (`num_drafts`, `num_draft_tokens`, `num_accepted_tokens`,
`num_accepted_tokens_per_pos`), counted over rounds that had a draft. Rounds without a draft are
counted too (`num_rounds`, `num_emitted_tokens`): throughput depends on tokens per target forward
over all rounds, which is smaller than vLLM's mean acceptance length when drafts are sometimes empty.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec_tune import SpecdecError
from specdec_tune.kernels.greedy import verify_greedy
from specdec_tune.kernels.sampling import sample_tokens
from specdec_tune.profiles.drafters.base import Draft, Drafter, DraftRequest
from specdec_tune.profiles.models.llama import CausalLM

if TYPE_CHECKING:
    from specdec_tune.profiles.models.generic import GenericCausalLM


@dataclasses.dataclass
class SpecCounters:
    """Acceptance counts over (row, round) pairs; `merge` adds two runs."""

    max_draft_len: int
    num_drafts: int = 0  # row-rounds that had ≥ 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(
        default_factory=list
    )  # [i]: drafts with d_1..d_{i+1} accepted
    num_reached_per_pos: list[int] = dataclasses.field(
        default_factory=list
    )  # [i]: drafts that proposed d_{i+1} with d_1..d_i accepted
    num_rounds: int = 0  # row-rounds, with or without a draft (= target forwards per row)
    num_emitted_tokens: int = 0  # tokens appended to the outputs
    # rounds[L][n]: row-rounds that proposed L tokens and had n accepted (L, n in 0..max_draft_len)
    rounds: list[list[int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.max_draft_len
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * n
        self.num_reached_per_pos = self.num_reached_per_pos or [0] * n
        self.rounds = self.rounds or [[0] * (n + 1) for _ in range(n + 1)]

    def record(self, draft_len: int, num_accepted: int, num_emitted: int) -> None:
        self.num_rounds += 1
        self.num_emitted_tokens += num_emitted
        self.rounds[draft_len][num_accepted] += 1
        if draft_len == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += draft_len
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1
        for i in range(min(num_accepted + 1, draft_len)):
            self.num_reached_per_pos[i] += 1

    @staticmethod
    def total(counters: Sequence[SpecCounters]) -> SpecCounters:
        """Several runs' counters added."""
        return functools.reduce(SpecCounters.merge, counters)

    def merge(self, other: SpecCounters) -> SpecCounters:
        n = max(self.max_draft_len, other.max_draft_len)

        def add(a: list[int], b: list[int], size: int = n) -> list[int]:
            return [x + y for x, y in zip(a + [0] * (size - len(a)), b + [0] * (size - len(b)))]

        def add_rows(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
            pad: list[list[int]] = [[]] * (n + 1)
            return [add(x, y, n + 1) for x, y in zip(a + pad[len(a) :], b + pad[len(b) :])]

        return SpecCounters(
            max_draft_len=n,
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            num_accepted_tokens_per_pos=add(self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
            num_reached_per_pos=add(self.num_reached_per_pos, other.num_reached_per_pos),
            num_rounds=self.num_rounds + other.num_rounds,
            num_emitted_tokens=self.num_emitted_tokens + other.num_emitted_tokens,
            rounds=add_rows(self.rounds, other.rounds),
        )

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's figure: 1 + accepted / drafts, over rounds that had a draft only."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Tokens emitted per row-round over all rounds: the AL that belongs in the throughput formula."""
        return self.num_emitted_tokens / self.num_rounds if self.num_rounds else 0.0

    def derived_at(self, draft_len: int) -> tuple[float, float]:
        """(tokens per target forward, vLLM mean AL) for a run at D = draft_len, derived from this run's rounds.

        A round that had n drafts accepted emitted n+1 tokens in one forward. At a smaller D the same
        n+1 tokens take ceil((n+1)/(D+1)) forwards: the drafter keeps proposing the continuation it
        would have proposed anyway. That is exact for greedy chain drafters (a greedy draft model's
        continuation after accepting its own tokens is the same chain) and close for lookup drafters.
        It corrects what a per-round cap min(n, D) gets wrong: long accepted runs are fewer rounds at
        D_max than at small D, so capping each round undercounts AL at small D.
        """
        tokens, rounds, drafted = self.derived_counts(draft_len)
        if not rounds:
            return 1.0, 1.0
        accepted = tokens - rounds
        return tokens / rounds, (1.0 + accepted / drafted) if drafted else 1.0

    def derived_counts(self, draft_len: int) -> tuple[int, int, int]:
        """(tokens, target forwards, forwards that drafted) of a run at D = draft_len, derived as in `derived_at`."""
        D = draft_len
        tokens = rounds = drafted = 0
        for L, row in enumerate(self.rounds):
            for n, count in enumerate(row):
                forwards = count * (-(-(n + 1) // (D + 1)) if D > 0 else n + 1)
                tokens += count * (n + 1)
                rounds += forwards
                drafted += forwards if L > 0 and D > 0 else 0
        return tokens, rounds, drafted

    def conditional_acceptance(self) -> list[float | None]:
        """a_k = P(d_k accepted | d_1..d_{k-1} accepted, d_k proposed); None where never reached."""
        return [a / r if r else None for a, r in zip(self.num_accepted_tokens_per_pos, self.num_reached_per_pos)]


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per prompt, prompt excluded, in input order
    per_prompt: list[SpecCounters]  # acceptance counters per prompt, in input order
    target_forwards: int  # batched target forward calls (prefill excluded)
    draft_s: float  # wall time inside drafter.propose
    verify_s: float  # wall time inside the target's verification forwards
    total_s: float  # whole decode, prefill excluded
    full_batch_s: float = 0.0  # wall time of the rounds in which every row was still decoding
    full_batch_tokens: int = 0  # tokens emitted in those rounds

    @property
    def full_batch_tokens_per_s(self) -> float:
        """Throughput at the batch size as a continuously batched server keeps it: rounds after the first row
        finished (a static batch's tail, running fewer rows) are left out."""
        return self.full_batch_tokens / self.full_batch_s if self.full_batch_s > 0 else 0.0

    @property
    def counters(self) -> SpecCounters:
        """All prompts' counters added."""
        return SpecCounters.total(self.per_prompt)


# ---------------------------------------------------------------------------- verification


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)): the chance to keep a draft token x drawn from q when the target says p."""
    return torch.clamp(p_x / q_x.clamp_min(1e-30), max=1.0)


def verify_sampled(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling. draft_probs: [B, K, V] or None for one-hot (deterministic) proposals."""
    B, K = drafts.shape
    p = torch.softmax(logits / temperature, dim=-1)  # [B, 1+K, V]
    if K:
        p_x = p[:, :K].gather(2, drafts[:, :, None]).squeeze(2)  # [B, K]
        q_x = draft_probs.gather(2, drafts[:, :, None]).squeeze(2) if draft_probs is not None else torch.ones_like(p_x)
        u = torch.rand((B, K), generator=generator, device=logits.device)
        offered = torch.arange(K, device=drafts.device)[None, :] < draft_lens[:, None]
        keep = (u < accept_probability(p_x, q_x)) & offered
        num_accepted = keep.long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(B, dtype=torch.long, device=logits.device)

    rows = torch.arange(B, device=logits.device)
    dist = p[rows, num_accepted].clone()  # [B, V]: p_n
    rejected = num_accepted < draft_lens  # the emitted token replaces a rejected draft: use the residual
    if rejected.any():
        idx = num_accepted.clamp(max=max(K - 1, 0))
        if draft_probs is not None:
            q = draft_probs[rows, idx]  # [B, V]
        else:
            q = torch.zeros_like(dist).scatter_(1, drafts[rows, idx][:, None], 1.0)
        residual = (dist - q).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        # p == q exactly leaves no residual mass; then any p-sample is correct (the branch has probability 0).
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), dist)
        dist = torch.where(rejected[:, None], residual, dist)
    next_token = sample_tokens(dist, generator)
    return num_accepted, next_token


# ---------------------------------------------------------------------------- the loop


PREFILL_PAD_WASTE = 0.25  # padded prefill tokens beyond the real ones, at most, per row group (`prefill_groups`)


def _pad(rows: Sequence[Sequence[int]], width: int, device) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def prefill_groups(lengths: Sequence[int], waste: float = PREFILL_PAD_WASTE) -> list[list[int]]:
    """Rows grouped by length for the prefill: each group pads to its own longest row, and holds at most `waste`
    more padded tokens than real ones (one padded prefill of 36 calibration prompts of 30 to 380 tokens ran
    3.7x the tokens they hold)."""
    groups: list[list[int]] = []
    tokens = 0  # real tokens of the last group
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):  # rows come shortest first: i pads the group
        if groups and (len(groups[-1]) + 1) * lengths[i] <= (1 + waste) * (tokens + lengths[i]):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return groups


def _prefill(
    target: CausalLM | GenericCausalLM, prompts: Sequence[Sequence[int]], cache, layers: tuple[int, ...]
) -> list[torch.Tensor]:
    """Every prompt but its last token into `cache`, a group of similar lengths at a time (`prefill_groups`);
    with `layers`, each row's hidden states there: [len(prompt) - 1, len(layers) * hidden] (else [])."""
    device = target.device
    pending: list[torch.Tensor | None] = [None] * len(prompts)
    for group in prefill_groups([len(p) - 1 for p in prompts]):
        width = max(len(prompts[b]) - 1 for b in group)
        if width == 0:
            continue
        ids = _pad([prompts[b][:-1] for b in group], width, device)  # [G, width]
        part = target.new_cache(len(group), width)
        start = torch.zeros(len(group), dtype=torch.long, device=device)
        if layers:
            _, hidden = target.forward_capture(
                ids, part, start, layers, logits="none"
            )  # [G, width, len(layers) * hidden]
            for g, b in enumerate(group):
                pending[b] = hidden[g, : len(prompts[b]) - 1]
        else:
            target(ids, part, start, logits="none")
        cache.write_prefix(torch.tensor(group, dtype=torch.long, device=device), part)
    if not layers:
        return []
    like = next((h for h in pending if h is not None), None)
    empty = torch.zeros((0, 0), device=device) if like is None else like[:0]  # a one-token prompt has no state yet
    return [empty if h is None else h for h in pending]


@torch.inference_mode()
def generate(
    target: CausalLM | GenericCausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Drafter | None = None,
    num_draft_tokens: int | Sequence[int] = 0,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    until_first_done: bool = False,
) -> GenerationResult:
    """Generate for a batch of prompts with speculative decoding (or plainly, with no drafter / D = 0).

    `num_draft_tokens` is one D for every row, or one per row (the rows then draft ragged, as near their end).
    `until_first_done`: stop after the round in which a row finishes, the other rows' outputs cut short there: the
    rounds a full-batch rate reads (`full_batch_s`), without the tail it drops."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SpecdecError("every prompt needs at least one token", "drop empty prompts")
    row_d = [num_draft_tokens] * len(prompts) if isinstance(num_draft_tokens, int) else list(num_draft_tokens)
    if len(row_d) != len(prompts):
        raise SpecdecError(f"{len(row_d)} draft lengths for {len(prompts)} prompts", "give one D, or one per prompt")
    if drafter is not None and min(row_d) < 1:
        raise SpecdecError(
            f"draft length D = {min(row_d)} is invalid with a drafter", "use D ≥ 1, or no drafter for plain decoding"
        )
    if temperature < 0:
        raise SpecdecError(f"temperature {temperature} is negative", "use 0 for greedy or a positive value")
    row_d = row_d if drafter is not None else [0] * len(prompts)
    D = max(row_d)
    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    stop = set(stop_token_ids)

    B = len(prompts)
    capacity = max(len(p) for p in prompts) + max_new_tokens + D + 1
    cache = target.new_cache(B, capacity)
    seqs = [list(p) for p in prompts]
    cache_len = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long, device=device)
    layers = tuple(drafter.hidden_layers) if drafter is not None and D > 0 else ()
    # Per live row: the target's hidden states [n, len(layers) * hidden] at the positions run since the last draft.
    pending: list[torch.Tensor] = []
    if int(cache_len.max()) > 0:  # prefill: everything but the last prompt token
        pending = _prefill(target, prompts, cache, layers)
    if layers and not pending:
        pending = [torch.zeros((0, 0), device=device) for _ in prompts]
    if drafter is not None:
        drafter.start([list(p) for p in prompts])

    counters = [SpecCounters(max_draft_len=d) for d in row_d]
    outputs: list[list[int]] = [[] for _ in range(B)]
    live = list(range(B))  # input index of each cache row
    forwards, draft_s, verify_s = 0, 0.0, 0.0
    full_batch_s, full_batch_tokens = 0.0, 0
    t_start = time.perf_counter()
    while live:
        max_tokens = [min(row_d[i], max_new_tokens - len(outputs[i]) - 1) for i in live]
        t0 = time.perf_counter()
        if D > 0:
            draft_hidden, num_hidden = _pad_hidden(pending) if layers else (None, None)
            draft = drafter.propose(  # type: ignore[union-attr]
                DraftRequest([seqs[i] for i in live], max_tokens, temperature, generator, draft_hidden, num_hidden)
            )
            _check_draft(draft, max_tokens)
        else:
            draft = Draft(tokens=[[] for _ in live])
        t1 = time.perf_counter()
        K = max(len(d) for d in draft.tokens)
        draft_lens = torch.tensor([len(d) for d in draft.tokens], dtype=torch.long, device=device)
        drafts = _pad(draft.tokens, K, device)  # [B, K]
        tokens = torch.cat([torch.tensor([[seqs[i][-1]] for i in live], device=device), drafts], dim=1)  # [B, 1+K]
        if layers:
            logits, hidden = target.forward_capture(tokens, cache, cache_len, layers)  # [B, 1+K, V], [B, 1+K, W]
            assert logits is not None  # forward_capture's default logits="all"
        else:
            logits = target(tokens, cache, cache_len)  # [B, 1+K, V]
        if temperature == 0:
            num_accepted, next_token = verify_greedy(logits, drafts, draft_lens)
        else:
            probs = draft.probs[:, :K] if draft.probs is not None else None
            assert generator is not None  # made above for temperature > 0
            num_accepted, next_token = verify_sampled(logits, drafts, draft_lens, probs, temperature, generator)
        forwards += 1
        t2 = time.perf_counter()
        draft_s += t1 - t0
        verify_s += t2 - t1

        keep, round_tokens = [], 0
        for row, i in enumerate(live):
            n = int(num_accepted[row])
            emitted = draft.tokens[row][:n] + [int(next_token[row])]
            emitted = emitted[: max_new_tokens - len(outputs[i])]
            for j, tok in enumerate(emitted):
                if tok in stop:
                    emitted = emitted[: j + 1]
                    break
            counters[i].record(len(draft.tokens[row]), n, len(emitted))
            round_tokens += len(emitted)
            outputs[i].extend(emitted)
            seqs[i].extend(emitted)
            if len(outputs[i]) < max_new_tokens and emitted[-1] not in stop:
                keep.append(row)
        cache_len = cache_len + 1 + num_accepted
        if layers:  # the verified positions: the last token and the n accepted drafts
            pending = [hidden[row, : 1 + int(num_accepted[row])] for row in range(len(live))]
        if len(live) == B:
            full_batch_s += time.perf_counter() - t0
            full_batch_tokens += round_tokens
        if until_first_done and len(keep) < len(live):
            break
        if len(keep) < len(live):
            rows = torch.tensor(keep, dtype=torch.long, device=device)
            cache.keep_rows(rows)
            cache_len = cache_len.index_select(0, rows)
            live = [live[r] for r in keep]
            pending = [pending[r] for r in keep] if layers else pending
            if drafter is not None and live:
                drafter.keep_rows(keep)
    total_s = time.perf_counter() - t_start
    return GenerationResult(outputs, counters, forwards, draft_s, verify_s, total_s, full_batch_s, full_batch_tokens)


def _pad_hidden(rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Per-row hidden states [n_b, W] -> left-aligned [B, max n_b, W] (zero padding) and the n_b."""
    lens = [int(r.shape[0]) for r in rows]
    width = max((int(r.shape[1]) for r in rows if r.shape[0]), default=0)
    ref = next((r for r in rows if r.shape[0]), rows[0])
    out = torch.zeros((len(rows), max(lens), width), dtype=ref.dtype, device=ref.device)
    for b, r in enumerate(rows):
        out[b, : lens[b]] = r
    return out, lens


def _check_draft(draft: Draft, max_tokens: list[int]) -> None:
    if len(draft.tokens) != len(max_tokens):
        raise SpecdecError(
            f"drafter returned {len(draft.tokens)} rows for {len(max_tokens)}", "fix the drafter's propose()"
        )
    for b, (d, m) in enumerate(zip(draft.tokens, max_tokens)):
        if len(d) > max(m, 0):
            raise SpecdecError(
                f"drafter proposed {len(d)} tokens for row {b}, more than the {m} allowed",
                "fix the drafter's propose()",
            )
