"""Acceptance by replay: every D's greedy counters from the target's own trajectory.

Under greedy verification the output is the target's greedy sequence g whatever is drafted, and while a
chain drafter's drafts are accepted its context *is* g. So a round that starts after g[:i] runs as:

    k       = min(D, max_new_tokens - i - 1)               (the loop's cap near the end)
    p       = the drafter's proposal from prompt + g[:i], at most k tokens
    n       = the longest prefix of p equal to g[i:]        (accepted)
    emitted = p[:n] + [g[i+n]], cut at the end of generation and after the first stop token
    next round at i + len(emitted); the row ends at max_new_tokens or on a stop token

which gives the loop's counters (vLLM's and ours) exactly, for every D, from g plus the proposals. g is
generated once per prompt, plainly and without stopping (a draft may run past a stop token, and the loop
counts what it accepts there), and shared by every drafter. The proposals:

  - token-only drafters (n-gram, suffix): the drafter itself asked from each prefix in order, one row at a
    time (its state follows the growing prefix exactly as in the loop); cached per (i, k);
  - a draft model: one teacher-forced forward over prompt + g gives its greedy token t[i] after g[:i]; the
    chain from i proposes t[i], t[i+1], ... for as long as each equals g (until then its context is g), and
    its first mismatch is all a round needs, so p = t[i : i+k] has the true chain's accepted prefix and length;
  - a learned head (EAGLE-3, MTP, DFlash, DSpark): one teacher-forced target pass over prompt + g gives the
    hidden states the loop's verify passes would hand it; the head catches up over the whole sequence once and
    drafts every round's chain (or block) as a row of one batch (`HeadDrafter.replay_proposals`).

Sampling (temperature > 0) keeps the loop. The loop checks the replay on a sample (`profiler`): equal
counters in fp32, a mismatch fails the profile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec_tune.profiles.drafters.base import Drafter, DraftRequest
from specdec_tune.profiles.models.llama import CausalLM
from specdec_tune.profiles.specdec import SpecCounters, generate

if TYPE_CHECKING:
    from specdec_tune.profiles.models.generic import GenericCausalLM

Proposer = Callable[[int, int], list[int]]  # (i tokens of g known, k) -> proposal of at most k tokens


def trajectories(
    target: CausalLM | GenericCausalLM, prompts: Sequence[Sequence[int]], new_tokens: int, batch: int
) -> list[list[int]]:
    """The target's greedy continuation of each prompt, `new_tokens` long (no stop token), batched."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        out += generate(target, prompts[start : start + batch], max_new_tokens=new_tokens).tokens
    return out


def replay(
    trajectory: Sequence[int],
    propose: Proposer,
    draft_lens: Sequence[int],
    max_new_tokens: int,
    stop: set[int],
    max_draft_len: int,
) -> list[SpecCounters]:
    """The loop's counters for one prompt at each D in `draft_lens` (rule in the module docstring).

    The rounds of all D advance together, position by position, so that the proposer is asked in
    non-decreasing i (a stateful drafter follows a growing prefix, as in the loop)."""
    g = trajectory
    counters = {D: SpecCounters(max_draft_len=max_draft_len) for D in draft_lens}
    next_start = {D: 0 for D in draft_lens}
    while next_start:
        i = min(next_start.values())
        for D in [D for D, start in next_start.items() if start == i]:
            k = min(D, max_new_tokens - i - 1)
            p = propose(i, k) if k > 0 else []
            n = 0
            while n < len(p) and p[n] == g[i + n]:
                n += 1
            emitted = (p[:n] + [g[i + n]])[: max_new_tokens - i]
            for j, tok in enumerate(emitted):
                if tok in stop:
                    emitted = emitted[: j + 1]
                    break
            counters[D].record(len(p), n, len(emitted))
            next_start[D] = i + len(emitted)
            if next_start[D] >= max_new_tokens or emitted[-1] in stop:
                del next_start[D]
    return [counters[D] for D in draft_lens]


def prefix_proposer(
    drafter: Drafter,
    prompt: Sequence[int],
    trajectory: Sequence[int],
    target: CausalLM | GenericCausalLM,
    max_draft_len: int,
) -> Proposer:
    """Ask a token-only drafter from each prefix prompt + g[:i], for i non-decreasing (cached per (i, k))."""
    drafter.start([list(prompt)])
    cache: dict[tuple[int, int], list[int]] = {}
    last = [0]

    def propose(i: int, k: int) -> list[int]:
        if (i, k) not in cache:
            if i < last[0]:
                raise ValueError("prefix proposals must be asked in order")  # the drafter only follows a growing prefix
            last[0] = i
            ids = list(prompt) + list(trajectory[:i])
            cache[(i, k)] = drafter.propose(DraftRequest([ids], [k], 0.0)).tokens[0]
        return cache[(i, k)]

    return propose


@torch.inference_mode()
def teacher_forced_tokens(
    model: CausalLM | GenericCausalLM, prompt: Sequence[int], trajectory: Sequence[int]
) -> list[int]:
    """t[i] = the model's greedy token after prompt + g[:i], for i = 0..len(g)-1: one forward over the sequence."""
    ids = torch.tensor([list(prompt) + list(trajectory[:-1])], dtype=torch.long, device=model.device)  # [1, P + N - 1]
    cache = model.new_cache(1, ids.shape[1])
    hidden = model(ids, cache, torch.zeros(1, dtype=torch.long, device=model.device), logits="hidden")  # [1, T, W]
    last = hidden[0, len(prompt) - 1 :]  # [N, W]: the states that predict g[0..N-1]
    return model.lm_head(last).argmax(-1).tolist()


def teacher_forced_proposer(
    drafter: Drafter,
    prompt: Sequence[int],
    trajectory: Sequence[int],
    target: CausalLM | GenericCausalLM,
    max_draft_len: int,
) -> Proposer:
    """A draft model's proposals (`drafter.model`, greedy chain): see the module docstring."""
    # a "teacher_forced" drafter (Drafter.replay) keeps its draft model in `model`, which Drafter does not declare
    t = teacher_forced_tokens(drafter.model, prompt, trajectory)  # type: ignore[attr-defined]
    return lambda i, k: t[i : i + k]


@functools.lru_cache(maxsize=2)  # the head drafters of one prompt (and their quantized twins) share a pass
@torch.inference_mode()
def target_states(
    target: CausalLM | GenericCausalLM, sequence: tuple[int, ...], layers: tuple[int, ...]
) -> torch.Tensor:
    """The target's hidden states at `layers` for positions 0..len(sequence)-2, one teacher-forced pass:
    [1, len(sequence) - 1, len(layers) * hidden] (what the loop's verify passes hand a head, position by position)."""
    ids = torch.tensor([sequence[:-1]], dtype=torch.long, device=target.device)  # [1, S]
    _, states = target.forward_capture(
        ids,
        target.new_cache(1, ids.shape[1]),
        torch.zeros(1, dtype=torch.long, device=target.device),
        layers,
        logits="none",
    )
    return states


def head_proposer(
    drafter: Drafter,
    prompt: Sequence[int],
    trajectory: Sequence[int],
    target: CausalLM | GenericCausalLM,
    max_draft_len: int,
) -> Proposer:
    """A learned head's greedy drafts for every round at once (see the module docstring); a round with fewer than two
    tokens known has no target state yet and drafts nothing, as in the loop."""
    sequence = tuple(prompt) + tuple(trajectory)
    known = [N for N in range(len(prompt), len(sequence)) if N >= 2]
    # a "head" drafter (Drafter.replay) is a HeadDrafter, whose replay_proposals Drafter does not declare
    chains = drafter.replay_proposals(  # type: ignore[attr-defined]
        list(sequence), target_states(target, sequence, tuple(drafter.hidden_layers)), known, max_draft_len
    )
    by_start = dict(zip((N - len(prompt) for N in known), chains))
    return lambda i, k: by_start.get(i, [])[:k]


# How each drafter is asked in a replay, by the name it declares in `Drafter.replay` (None: the loop measures it).
PROPOSERS: dict[
    str | None, Callable[[Drafter, Sequence[int], Sequence[int], CausalLM | GenericCausalLM, int], Proposer]
] = {
    "prefix": prefix_proposer,
    "teacher_forced": teacher_forced_proposer,
    "head": head_proposer,
}


def proposer(
    drafter: Drafter,
    prompt: Sequence[int],
    trajectory: Sequence[int],
    target: CausalLM | GenericCausalLM,
    max_draft_len: int,
) -> Proposer:
    """How `drafter` proposes at every round of `trajectory` (its PROPOSERS entry)."""
    return PROPOSERS[drafter.replay](drafter, prompt, trajectory, target, max_draft_len)


# ---------------------------------------------------------------------------- intervals


def per_prompt_rates(counters: Sequence[Sequence[SpecCounters]]) -> dict[str, np.ndarray]:
    """Per prompt and D = 0..D_max, the sums the acceptance figures are ratios of: [P, D_max + 1] each.

    tokens per forward = Σ emitted / Σ rounds;   vLLM's mean AL = 1 + Σ accepted / Σ drafts.
    counters[p][D-1] are prompt p's counters at D (D = 0 is plain decoding: one token per round)."""
    P, n = len(counters), len(counters[0]) + 1
    out = {k: np.zeros((P, n)) for k in ("emitted", "rounds", "accepted", "drafts")}
    for p, row in enumerate(counters):
        out["emitted"][p, 0] = out["rounds"][p, 0] = row[0].num_emitted_tokens
        for D, c in enumerate(row, start=1):
            out["emitted"][p, D], out["rounds"][p, D] = c.num_emitted_tokens, c.num_rounds
            out["accepted"][p, D], out["drafts"][p, D] = c.num_accepted_tokens, c.num_drafts
    return out


def derived_rates(counters: Sequence[SpecCounters], max_draft_len: int) -> dict[str, np.ndarray]:
    """`per_prompt_rates` for loop runs at D_max: each smaller D's sums derived from the prompt's rounds
    (`SpecCounters.derived_counts`), so that loop records carry intervals over prompts too."""
    out = {k: np.zeros((len(counters), max_draft_len + 1)) for k in ("emitted", "rounds", "accepted", "drafts")}
    for p, c in enumerate(counters):
        for D in range(max_draft_len + 1):
            tokens, forwards, drafted = c.derived_counts(D)
            out["emitted"][p, D], out["rounds"][p, D], out["drafts"][p, D] = tokens, forwards, drafted
            out["accepted"][p, D] = tokens - forwards
    return out
