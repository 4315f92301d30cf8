"""Learned draft heads that read the target's hidden states (EAGLE-3, MTP): their layers and their drafting loop.

A head drafts at sequence position p from two inputs: a hidden state h_p ([hidden]) and the embedding of
token x_{p+1}; its output predicts x_{p+2} and carries a new hidden state c_p. For a sequence of N tokens
(x_{N-1} not yet run by the target) one round of D serial steps is:

  catch-up   every position p the target verified since the last round, with h_p = combine(target states at p)
             and token x_{p+1}; writes the head's KV at p. The last one (p = N-2) gives d_1 and c_{N-2}.
  step k≥2   position N-3+k with h = c of step k-1 and token d_{k-1}; gives d_k.

The head's own static KV cache keeps positions 0..N-2 computed from target states; the draft steps write past
them and are overwritten by the next catch-up (rollback is free, as in the target's cache).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from specdec_tune import SpecdecError
from specdec_tune.kernels.sampling import sample_tokens
from specdec_tune.profiles.drafters.base import Draft, Drafter, DraftKind, DraftRequest
from specdec_tune.profiles.drafters.quant import quantize_linear_weights
from specdec_tune.profiles.models.llama import DecoderLayer, KVCache, ModelConfig, rope_lookup, step_coordinates

if TYPE_CHECKING:
    from specdec_tune.profiles.models.generic import GenericCausalLM, LogitHead
    from specdec_tune.profiles.models.llama import CausalLM


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / mid / high target layers when a checkpoint names none (vLLM's and speculators' default)."""
    return (2, num_layers // 2, num_layers - 3) if num_layers > 4 else (0, num_layers // 2, num_layers - 1)


class DraftHead(nn.Module):
    """What the drafting loop needs from a head. Subclasses set `hidden_layers` and implement `layer`, `combine` and
    `features_with`."""

    config: ModelConfig  # the head's transformer layer (vocab_size = the target's vocabulary)
    hidden_layers: tuple[int, ...]  # target layers read (CausalLM.forward_capture ids)
    embed_tokens: nn.Embedding  # usually the target's, shared
    # its own (EAGLE-3, draft vocabulary) or the target's (MTP; a transformers target's is a LogitHead)
    lm_head: nn.Linear | LogitHead
    block: ClassVar[bool] = False  # drafts a whole block in one pass (DFlash, DSpark), else one token per step

    def __init__(self) -> None:
        super().__init__()
        self._rope_table = None

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, len(hidden_layers) * target_hidden] -> the head's input hidden state [B, T, hidden]."""
        raise NotImplementedError

    @property
    def layer(self) -> DecoderLayer:
        """The head's decoder layer (its `self_attn` is the one attention the head runs)."""
        raise NotImplementedError

    def features_with(self, tokens: torch.Tensor, hidden: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] (x_{p+1}), hidden [B, T, hidden] (h_p), `attend` (x -> attention output) ->
        (the state the LM head reads [B, T, hidden], the carried state [B, T, hidden])."""
        raise NotImplementedError

    def step_with(self, tokens: torch.Tensor, hidden: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, T, draft_vocab] float32, carried state [B, T, hidden]); see `features_with`."""
        features, carry = self.features_with(tokens, hidden, attend)
        return self.lm_head(features).float(), carry

    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        cache: KVCache,
        start_pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step_with` at positions start_pos[b]+t, attending over (and writing to) the head's KV cache."""
        positions, mask, rows, cos, sin = self._coordinates(start_pos, tokens.shape[1], cache)
        attn = self.layer.self_attn

        def attend(x: torch.Tensor) -> torch.Tensor:
            return attn(x, cos, sin, cache.k[0], cache.v[0], rows, positions, mask)

        return self.step_with(tokens, hidden, attend)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [B, T] -> [B, T, 1, head_dim] in the head's dtype."""
        p = next(self.parameters())
        self._rope_table, cos, sin = rope_lookup(self._rope_table, self.config, positions, p.dtype, p.device)
        return cos, sin

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (identity unless the head has a reduced vocabulary)."""
        return ids

    def target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary [B, V_draft] -> over the target's [B, V]."""
        return q

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.config, 1, batch, capacity, p.dtype, p.device)

    def _coordinates(self, start_pos: torch.Tensor, T: int, cache: KVCache):
        positions, mask, rows = step_coordinates(start_pos, T, cache.capacity)
        return (positions, mask, rows, *self.rope(positions))


class DraftVocabulary:
    """For heads with a reduced draft vocabulary: `d2t[i]` is draft id i's target id minus i (speculators / vLLM);
    all zeros is the full vocabulary in order."""

    d2t: torch.Tensor
    config: ModelConfig
    lm_head: nn.Linear | LogitHead  # its own, or the target's (a transformers target's is a LogitHead)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]  # [V_draft, hidden]: a LogitHead has no out_features

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def target_probs(self, q: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any()):
            return q
        out = q.new_zeros((q.shape[0], self.config.vocab_size))
        return out.index_copy_(1, self.to_target_ids(torch.arange(self.draft_vocab_size, device=q.device)), q)


def head_layer_config(target: ModelConfig, **changes) -> ModelConfig:
    """The target's widths for a one-layer head (what speculators' transformer_layer_config holds). The layer is a
    llama decoder layer whatever the target's family (no biases, no q/k norm), and says so: the engines build a head's
    layer from its model type, and vLLM's EAGLE-3 reader builds llama or qwen3 layers only."""
    llama = dataclasses.replace(target, model_type="llama", num_layers=1, o_bias=False, qk_norm=False)
    return dataclasses.replace(llama, attention_bias=False, **changes)


# ---------------------------------------------------------------------------- head kinds


Reader = Callable[
    [dict, dict, "CausalLM | GenericCausalLM", Path], DraftHead
]  # (config.json, weights, target, folder) -> the head, checked
_Head = TypeVar("_Head", bound=DraftHead)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checkpoint layout other than speculators', told apart by a field of its config.json."""

    name: str  # "modelopt", "z-lab"
    marker: str  # the config.json field (an object) that marks it
    read: Reader


@dataclasses.dataclass(frozen=True)
class HeadKind(Generic[_Head]):
    """One kind of learned head as the rest of the package sees it; each head's module registers its kinds."""

    name: str  # the mechanism: "eagle3", "mtp", "dflash", "dspark"
    # (target CausalLM, **shape) -> random weights of the default shape; shape keys: draft_vocab, aux_layers, seed,
    # draft_layers, block_size, mask_token_id, markov_rank (each kind reads its own)
    new: Callable[..., _Head]
    read: Callable[[dict, dict, CausalLM | GenericCausalLM, Path], _Head]  # its speculators checkpoint (a `Reader`)
    speculators_fields: Callable[[_Head], dict]  # its algorithm fields in speculators' config.json
    shared: Callable[[_Head], set[str]]  # the target's tensors it runs with: left out of its checkpoint
    training_fields: tuple[str, ...]  # the trainer's settings that shape it (and so name its cached demo head)
    eval_draft_len: int  # the D its learning curve is measured at
    reads_aux_states: bool = True  # reads target states below the last layer (MTP reads the last layer's only)
    layouts: tuple[Layout, ...] = ()


HEAD_KINDS: dict[str, HeadKind[Any]] = {}


def register_head_kind(kind: HeadKind[Any]) -> None:
    HEAD_KINDS[kind.name] = kind


def head_kinds() -> dict[str, HeadKind[Any]]:
    """Every learned head's kind by name; their modules register them as they are imported, here on first use."""
    for module in ("eagle3", "mtp", "dflash"):
        importlib.import_module(f"specdec_tune.profiles.drafters.{module}")
    return HEAD_KINDS


def head_kind(name: str) -> HeadKind[Any]:
    kinds = head_kinds()
    if name not in kinds:
        raise SpecdecError(f"{name!r} is not a learned head", f"use one of {', '.join(kinds)}")
    return kinds[name]


def shares_embedding(head: DraftHead) -> set[str]:
    """The common case of `HeadKind.shared`: the target's embedding only."""
    return {"embed_tokens.weight"}


# ---------------------------------------------------------------------------- the drafter


class HeadDrafter(Drafter):
    """The drafting loop shared by every head (see the module docstring). Subclasses pick the head."""

    kind: ClassVar[DraftKind] = "serial"
    replay = "head"  # the head's state is a function of the prefix: rounds replay from one teacher-forced pass

    def __init__(self, head: DraftHead, options: object, weights_hash: str | None) -> None:
        self.head = head.eval().requires_grad_(False)
        self.options = options
        self.weights_hash = weights_hash
        self.hidden_layers = tuple(head.hidden_layers)
        self.cache: KVCache | None = None
        self.capacity = 0
        self.fed: list[int] = []  # per row: positions 0..fed-1 of the head's cache come from target states

    @classmethod
    def from_head(cls, head: DraftHead, weights_hash: str | None = None) -> HeadDrafter:
        """This mechanism's drafter around a head already in memory (training, tests)."""
        drafter = cls.__new__(cls)
        HeadDrafter.__init__(drafter, head, cls.Options(), weights_hash)
        return drafter

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["hidden_layers"] = list(self.hidden_layers)
        return out

    def with_quantized_weights(self, fmt: str) -> HeadDrafter:
        twin = copy.copy(self)
        twin.head = quantize_linear_weights(self.head, fmt)  # a deep copy: weights shared with the target stay exact
        twin.cache = None
        return twin

    def start(self, prompts: list[list[int]]) -> None:
        self.cache, self.capacity = None, 0
        self.fed = [0] * len(prompts)

    def keep_rows(self, indices: list[int]) -> None:
        self.fed = [self.fed[i] for i in indices]
        if self.cache is not None:
            self.cache.keep_rows(torch.tensor(indices, dtype=torch.long, device=self.cache.k[0].device))

    def _ensure_cache(self, rows: int, need: int) -> None:
        if self.cache is None or self.cache.capacity < need:
            old, self.cache = self.cache, self.head.new_cache(rows, max(need, 2 * self.capacity, 256))
            self.capacity = self.cache.capacity
            if old is not None:
                for dst, src in zip(self.cache.k + self.cache.v, old.k + old.v):
                    dst[:, :, : src.shape[2]] = src

    def _checked_counts(self, request: DraftRequest) -> list[int]:
        """Per row, how many target states the request carries, checked to continue where the head stopped."""
        if request.hidden_states is None or request.num_hidden is None:
            raise SpecdecError(
                f"the {self.name} drafter needs the target's hidden states in each request",
                "run it through specdec.generate, which passes them",
            )
        for b, (s, n) in enumerate(zip(request.token_ids, request.num_hidden)):
            if len(s) - 1 - n != self.fed[b]:
                raise SpecdecError(
                    f"row {b}: hidden states for positions {len(s) - 1 - n}.. arrived, but the {self.name} head "
                    f"has run positions 0..{self.fed[b] - 1}",
                    "pass the states of every position the target ran, once",
                )
        return list(request.num_hidden)

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        seqs, B, K = request.token_ids, len(request.token_ids), max(request.max_tokens)
        counts = self._checked_counts(request)
        T = max(counts)
        if K == 0 or T == 0:  # nothing asked, or one-token prompts: no target state yet
            return Draft(tokens=[[] for _ in seqs])
        head = self.head
        device = next(head.parameters()).device
        self._ensure_cache(B, max(len(s) for s in seqs) + K + 1)
        assert self.cache is not None  # _ensure_cache made it

        # Catch-up: positions fed[b]..len-2 with target states and tokens x_{p+1}.
        tokens = torch.zeros((B, T), dtype=torch.long)
        for b, (s, f) in enumerate(zip(seqs, self.fed)):
            tokens[b, : len(s) - 1 - f] = torch.tensor(s[f + 1 :], dtype=torch.long)
        start = torch.tensor(self.fed, dtype=torch.long, device=device)
        dtype = next(head.parameters()).dtype
        assert request.hidden_states is not None  # _checked_counts raised otherwise
        hidden = head.combine(request.hidden_states[:, :T].to(device=device, dtype=dtype))  # [B, T, hidden]
        logits, carry = head.step(tokens.to(device), hidden, self.cache, start)
        rows = torch.arange(B, device=device)
        last = torch.tensor([max(n - 1, 0) for n in counts], device=device)
        step_logits, carry = logits[rows, last], carry[rows, last][:, None]  # [B, V_draft], [B, 1, hidden]
        pos = start + last + 1

        drafted, probs = [], []
        for step in range(K):
            if request.temperature == 0:
                token = head.to_target_ids(step_logits.argmax(-1))
            else:
                q = torch.softmax(step_logits / request.temperature, dim=-1)
                token = head.to_target_ids(sample_tokens(q, request.generator))
                probs.append(head.target_probs(q))
            drafted.append(token)
            if step + 1 < K:  # d_k at position N-2+k from its own carried state
                logits, carry = head.step(token[:, None], carry, self.cache, pos)
                step_logits = logits[:, 0]
                pos = pos + 1
        self.fed = [len(s) - 1 for s in seqs]
        draft_tokens = torch.stack(drafted, dim=1).tolist()  # [B, K]
        out = [d[:m] if n > 0 else [] for d, m, n in zip(draft_tokens, request.max_tokens, counts)]
        return Draft(tokens=out, probs=torch.stack(probs, dim=1) if probs else None)

    @torch.inference_mode()
    def replay_proposals(
        self, ids: list[int], states: torch.Tensor, known: list[int], max_tokens: int
    ) -> list[list[int]]:
        """The greedy drafts (`max_tokens` long) of the rounds that start with ids[:N] known, for each N in
        `known` (≥ 2).

        states [1, len(ids) - 1, len(hidden_layers) * hidden]: the target's states at positions 0..len(ids)-2 from one
        teacher-forced pass. The head's cache at positions 0..N-2 depends only on those states and tokens (the draft
        steps' entries are overwritten by the next catch-up), so one catch-up over the whole sequence serves every
        round; each round's chain then runs as one row of a batch, over its own copy of that cache, exactly as in
        `propose` (step k at position N-3+k, attending to positions up to its own)."""
        head = self.head
        device, dtype = next(head.parameters()).device, next(head.parameters()).dtype
        S = len(ids) - 1
        cache = head.new_cache(1, len(ids) + max_tokens + 1)
        tokens = torch.tensor([ids[1:]], dtype=torch.long, device=device)  # [1, S]: x_{p+1} at position p
        hidden = head.combine(states[:, :S].to(device=device, dtype=dtype))  # [1, S, hidden]
        logits, carry = head.step(
            tokens, hidden, cache, torch.zeros(1, dtype=torch.long, device=device)
        )  # [1, S, V], [1, S, hidden]
        at = torch.tensor(
            [N - 2 for N in known], dtype=torch.long, device=device
        )  # [A]: where each round's d_1 comes from
        step_logits, carry = logits[0, at], carry[0, at][:, None]  # [A, V_draft], [A, 1, hidden]
        cache.keep_rows(torch.zeros(len(known), dtype=torch.long, device=device))  # a copy of the catch-up per round
        pos, drafted = at + 1, []
        for step in range(max_tokens):
            token = head.to_target_ids(step_logits.argmax(-1))  # [A]
            drafted.append(token)
            if step + 1 < max_tokens:
                logits, carry = head.step(token[:, None], carry, cache, pos)
                step_logits, pos = logits[:, 0], pos + 1
        return torch.stack(drafted, dim=1).tolist()  # [A, max_tokens]


__all__ = [
    "HEAD_KINDS",
    "head_kinds",
    "DraftHead",
    "DraftVocabulary",
    "HeadDrafter",
    "HeadKind",
    "Layout",
    "default_aux_layers",
    "head_kind",
    "head_layer_config",
    "register_head_kind",
]
