"""DFlash (block diffusion drafting) and DSpark (DFlash plus a sequential Markov bias): a whole block in one pass.

For a sequence of N tokens (x_{N-1}, the anchor, not yet run by the target):

  ctx_p   = hidden_norm(fc([target states at the head's layers at p]))   [H], every verified position p ≤ N-2
  block   = [x_{N-1}, m, ..., m]  (block_size tokens, m = mask_token_id) at positions N-1 .. N-2+block_size
  layer l:  q from input_layernorm(h_block); keys/values = [k/v_proj(ctx_0..N-2) ; k/v_proj(input_layernorm(h_block))]
            every block query sees every context position and the whole block (no causal mask inside it)
  logits  = lm_head(norm(h_block))
  DFlash  slot j = 1..block_size-1 drafts x_{N-1+j}: block_size-1 drafts from one pass
  DSpark  (sample_from_anchor) slot j = 0..block_size-1 drafts x_{N+j}, after adding a low-rank Markov bias
          b_j = W2 f(W1[prev_j], h_j), prev_0 = x_{N-1}, prev_j = the token slot j-1 drafted: the parallel pass,
          then block_size light sequential steps (an embedding row and a rank-r product each)

The context's keys and values are cached per layer (a round projects only the positions verified since the last);
the block's are recomputed each round, so the draft costs one pass whatever D is. Layouts: speculators
`DFlashDraftModel` / `DSparkDraftModel` (`fc`, `hidden_norm`, `layers.i.*` with q/k norms, `norm`, `lm_head` and
`d2t` for a reduced draft vocabulary, `markov_head.*`, `confidence_head.proj`) and z-lab's `DFlashDraftModel`
(the same layer names; the target's head). The embedding is the target's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from specdec_tune import SpecdecError
from specdec_tune.kernels.sampling import sample_tokens
from specdec_tune.profiles.drafters.base import Draft, DraftRequest, register
from specdec_tune.profiles.drafters.checkpoints import resolve_head
from specdec_tune.profiles.drafters.head_reading import check_verifier, draft_map, layer_config, load_into
from specdec_tune.profiles.drafters.heads import (
    DraftHead,
    DraftVocabulary,
    HeadDrafter,
    HeadKind,
    Layout,
    default_aux_layers,
    head_layer_config,
    register_head_kind,
)
from specdec_tune.profiles.models.llama import CausalLM, DecoderLayer, KVCache, ModelConfig, RMSNorm, gqa_attention
from specdec_tune.settings import DSPARK_DEMO_RANK

if TYPE_CHECKING:
    from collections.abc import Iterable

    from specdec_tune.profiles.models.generic import GenericCausalLM, LogitHead
    from specdec_tune.profiles.models.loading import LoadedModel

MARKOV_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """The sequential logit bias of DSpark: b = W2 g, g = W1[prev] (vanilla), sigmoid(gate([h; W1[prev]])) * W1[prev]
    (gated), or the output of a small recurrent cell over the block (rnn)."""

    def __init__(self, target_vocab: int, draft_vocab: int, rank: int, hidden: int, head_type: str) -> None:
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(
        self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev [N] target ids, hidden [N, H] (the slot's backbone state), state [N, r] or None -> (bias [N, V_draft],
        state)."""
        e = self.markov_w1(prev).to(self.markov_w2.weight.dtype)  # [N, r]
        if self.head_type == "vanilla":
            return self.markov_w2(e), state
        if self.head_type == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden.to(e.dtype), e], dim=-1))) * e), state
        state = e.new_zeros(e.shape[0], self.rank) if state is None else state
        gate, cand, out = self.joint_proj(torch.cat([state, e, hidden.to(e.dtype)], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


class ConfidenceHead(nn.Module):
    """DSpark's per-slot acceptance estimate (a logit) from [h; W1[prev]]; loaded and carried, not used to cut
    drafts."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DFlashHead(DraftVocabulary, DraftHead):
    block = True

    def __init__(
        self,
        config: ModelConfig,
        *,
        target_hidden_size: int,
        layer_ids: tuple[int, ...],
        block_size: int,
        mask_token_id: int,
        draft_vocab_size: int,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear | LogitHead | None = None,
        sample_from_anchor: bool = False,
        markov_rank: int = 0,
        markov_head_type: str = "vanilla",
        confidence_head: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.hidden_layers = tuple(layer_ids)
        self.target_hidden_size = target_hidden_size
        self.block_size, self.mask_token_id, self.sample_from_anchor = block_size, mask_token_id, sample_from_anchor
        H = config.hidden_size
        self.fc = nn.Linear(len(layer_ids) * target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head if lm_head is not None else nn.Linear(H, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.markov_head = (
            MarkovHead(config.vocab_size, draft_vocab_size, markov_rank, H, markov_head_type) if markov_rank else None
        )
        self.confidence_head = ConfidenceHead(H + markov_rank) if confidence_head else None

    @property
    def layer(self) -> DecoderLayer:
        return cast(DecoderLayer, self.layers[0])  # nn.ModuleList's items are typed as any nn.Module

    @property
    def first_slot(self) -> int:
        """The block slot that drafts x_N: 0 when the anchor's slot drafts too (DSpark), else 1."""
        return 0 if self.sample_from_anchor else 1

    @property
    def max_drafts(self) -> int:
        return self.block_size - self.first_slot

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.config, len(self.layers), batch, capacity, p.dtype, p.device)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(
        self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx [B, T, H] with RoPE cos, sin [B, T, 1, hd] (its positions) -> per layer (k, v), each [B, H_kv, T, hd]:
        what the block attends to."""
        out = []
        for layer in cast("Iterable[DecoderLayer]", self.layers):  # as `layer`
            _, k, v = layer.self_attn.qkv(ctx, cos, sin)  # the query projection of the context is unused
            out.append((k.transpose(1, 2), v.transpose(1, 2)))
        return out

    def block_hidden(
        self,
        tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block tokens [B, Q] with RoPE cos, sin [B, Q, 1, hd] (their positions) over per-layer context keys/values
        [B, H_kv, L, hd]; mask [B, 1, Q, L + Q] (context keys, then the block's own) -> the normed block states
        [B, Q, H]."""
        B, Q = tokens.shape
        x = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        for layer, (k_ctx, v_ctx) in zip(cast("Iterable[DecoderLayer]", self.layers), context):  # as `layer`
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)  # [B, Q, H, hd], [B, Q, H_kv, hd] x2
            keys = torch.cat([k_ctx.to(k.dtype), k.transpose(1, 2)], dim=2)
            values = torch.cat([v_ctx.to(v.dtype), v.transpose(1, 2)], dim=2)
            out = gqa_attention(q.transpose(1, 2), keys, values, mask)  # [B, H, Q, hd]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, Q, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def draft_logits(
        self, hidden: torch.Tensor, prev: torch.Tensor, choose
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Slot logits [B, V_draft] for slots first_slot.. of hidden [B, S, H], with the Markov bias when the head has
        one. `choose(logits) -> target ids [B]` picks each slot's token; prev [B] is the anchor (the first slot's
        previous token). Returns (logits per slot, chosen ids per slot)."""
        logits_all = self.lm_head(hidden).float()  # [B, S, V_draft]: the parallel pass
        state, logits, chosen = None, [], []
        for j in range(self.first_slot, hidden.shape[1]):
            step = logits_all[:, j]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(prev, hidden[:, j], state)
                step = step + bias.float()
            token = choose(step)
            logits.append(step)
            chosen.append(token)
            prev = token
        return logits, chosen


def block_mask(ctx_len: torch.Tensor, L: int, Q: int) -> torch.Tensor:
    """[B, 1, Q, L + Q]: context key j visible iff j < ctx_len[b]; every key of the block visible."""
    ctx = (torch.arange(L, device=ctx_len.device)[None, :] < ctx_len[:, None])[:, None, None, :].expand(-1, 1, Q, L)
    return torch.cat([ctx, torch.ones((ctx_len.shape[0], 1, Q, Q), dtype=torch.bool, device=ctx_len.device)], dim=-1)


def default_mask_token(target_vocab: int, tokenizer=None) -> int:
    """A token no text uses, for the block's masked slots: the tokenizer's last special token that is not an end of
    text, a start of turn or padding; else the last id of the vocabulary."""
    if tokenizer is not None:
        taken = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id}
        spare = [i for i in getattr(tokenizer, "all_special_ids", []) if i not in taken and i < target_vocab]
        if spare:
            return max(spare)
    return target_vocab - 1


def new_dflash_head(
    target: CausalLM | GenericCausalLM,
    *,
    draft_vocab: list[int] | None = None,
    layers: int = 2,
    block_size: int = 8,
    mask_token_id: int | None = None,
    markov_rank: int = 0,
    markov_head_type: str = "vanilla",
    layer_ids: tuple[int, ...] | None = None,
    seed: int = 0,
) -> DFlashHead:
    """A DFlash head (markov_rank 0) or a DSpark head (markov_rank > 0: the anchor's slot drafts too) of the default
    shape for `target`: `layers` Qwen3-style layers (q/k norms, as speculators builds them) of the target's width, its
    embedding (shared), the LM head started from the target's rows for the draft vocabulary. Random own weights."""
    c = dataclasses.replace(head_layer_config(target.config), num_layers=layers, qk_norm=True, model_type="qwen3")
    ids = torch.tensor(draft_vocab if draft_vocab is not None else range(c.vocab_size), dtype=torch.long)
    head = DFlashHead(
        c,
        target_hidden_size=target.config.hidden_size,
        layer_ids=layer_ids or default_aux_layers(target.config.num_layers),
        block_size=block_size,
        mask_token_id=mask_token_id if mask_token_id is not None else c.vocab_size - 1,
        draft_vocab_size=len(ids),
        embed_tokens=target.embed_tokens,
        sample_from_anchor=markov_rank > 0,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        confidence_head=markov_rank > 0,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith("embed_tokens"):
                continue
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("markov_w1.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
            elif name.endswith("markov_w2.weight"):
                p.zero_()  # the bias starts at zero: DSpark begins as its DFlash backbone
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.zero_()
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
        head.norm.weight.copy_(target.norm.weight)
        head.d2t.copy_(ids - torch.arange(len(ids)))
    return head.to(device=target.device, dtype=target.dtype)


class BlockDrafter(HeadDrafter):
    """One pass over the block per round (see the module docstring); the context cache is the head's KV cache."""

    kind = "parallel"
    head: DFlashHead  # a block head, always

    @property
    def max_draft_len(self) -> int:  # type: ignore[override]
        return self.head.max_drafts

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update(block_size=self.head.block_size, max_draft_len=self.max_draft_len)
        return out

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        seqs, B = request.token_ids, len(request.token_ids)
        counts = self._checked_counts(request)
        K = min(max(request.max_tokens), self.max_draft_len)
        T = max(counts)
        if K == 0 or T == 0:
            return Draft(tokens=[[] for _ in seqs])
        head: DFlashHead = self.head
        device = next(head.parameters()).device
        dtype = next(head.parameters()).dtype
        self._ensure_cache(B, max(len(s) for s in seqs) + T)
        cache = self.cache
        assert cache is not None  # _ensure_cache made it

        # Catch-up: the context's keys and values for positions fed[b] .. len-2, written into the cache.
        start = torch.tensor(self.fed, dtype=torch.long, device=device)
        positions = start[:, None] + torch.arange(
            T, device=device
        )  # [B, T] (rows with fewer states write past len-2, masked)
        assert request.hidden_states is not None  # _checked_counts raised otherwise
        ctx = head.combine(request.hidden_states[:, :T].to(device=device, dtype=dtype))  # [B, T, H]
        rows = torch.arange(B, device=device)[:, None].expand(B, T)
        for (k, v), k_cache, v_cache in zip(head.context_kv(ctx, *head.rope(positions)), cache.k, cache.v):
            k_cache[rows, :, positions] = k.transpose(1, 2).to(k_cache.dtype)
            v_cache[rows, :, positions] = v.transpose(1, 2).to(v_cache.dtype)
        self.fed = [len(s) - 1 for s in seqs]

        # The block: the anchor x_{N-1} and block_size-1 mask tokens at positions N-1 .. N-2+block_size.
        ctx_len = torch.tensor(self.fed, dtype=torch.long, device=device)
        L = int(ctx_len.max())
        S = head.block_size
        tokens = torch.full((B, S), head.mask_token_id, dtype=torch.long, device=device)
        tokens[:, 0] = torch.tensor([s[-1] for s in seqs], device=device)
        block_pos = ctx_len[:, None] + torch.arange(S, device=device)
        context = [(k[:, :, :L], v[:, :, :L]) for k, v in zip(cache.k, cache.v)]
        # The LM head reads every slot, as engines run the block: a strided slice took a ~15x slower CPU path, a
        # contiguous copy of a few rows a ~2x slower one at batch 1, and the pass costs the same either way.
        hidden = head.block_hidden(tokens, *head.rope(block_pos), context, block_mask(ctx_len, L, S))

        probs = []

        def choose(step_logits: torch.Tensor) -> torch.Tensor:
            if request.temperature == 0:
                return head.to_target_ids(step_logits.argmax(-1))
            q = torch.softmax(step_logits / request.temperature, dim=-1)
            probs.append(head.target_probs(q))
            return head.to_target_ids(sample_tokens(q, request.generator))

        _, chosen = head.draft_logits(hidden, tokens[:, 0], choose)
        draft_tokens = torch.stack(chosen[:K], dim=1).tolist()  # [B, K]
        out = [d[:m] if n > 0 else [] for d, m, n in zip(draft_tokens, request.max_tokens, counts)]
        return Draft(tokens=out, probs=torch.stack(probs[:K], dim=1) if probs else None)

    @torch.inference_mode()
    def replay_proposals(
        self, ids: list[int], states: torch.Tensor, known: list[int], max_tokens: int
    ) -> list[list[int]]:
        """HeadDrafter.replay_proposals for a block head: the context keys and values of every position at once (a
        per-position projection), then one block pass per round, all rounds as the rows of one batch (row a's block
        sits at N_a - 1 and sees the context up to N_a - 2, as in `propose`)."""
        head: DFlashHead = self.head
        device, dtype = next(head.parameters()).device, next(head.parameters()).dtype
        S, A, Q = len(ids) - 1, len(known), head.block_size
        ctx = head.combine(states[:, :S].to(device=device, dtype=dtype))  # [1, S, H]
        context = head.context_kv(
            ctx, *head.rope(torch.arange(S, device=device)[None])
        )  # per layer [1, H_kv, S, hd] x2
        ctx_len = torch.tensor([N - 1 for N in known], dtype=torch.long, device=device)  # [A]
        L = int(ctx_len.max())
        tokens = torch.full((A, Q), head.mask_token_id, dtype=torch.long, device=device)
        tokens[:, 0] = torch.tensor([ids[N - 1] for N in known], device=device)
        rows = [(k[:, :, :L].expand(A, -1, -1, -1), v[:, :, :L].expand(A, -1, -1, -1)) for k, v in context]
        hidden = head.block_hidden(
            tokens, *head.rope(ctx_len[:, None] + torch.arange(Q, device=device)), rows, block_mask(ctx_len, L, Q)
        )
        _, chosen = head.draft_logits(
            hidden, tokens[:, 0], lambda step_logits: head.to_target_ids(step_logits.argmax(-1))
        )
        return torch.stack(chosen[:max_tokens], dim=1).tolist()  # [A, min(max_tokens, max_drafts)]


@register("dflash")
class DFlashDrafter(BlockDrafter):
    @dataclasses.dataclass(frozen=True)
    class Options:
        model: str = ""  # speculators or z-lab DFlash folder; empty = this target's demo head (trained once, cached)
        random: bool = False  # random weights of the default shape: for timing and losslessness checks only

    def __init__(self, target: LoadedModel, options: Options) -> None:
        head, weights_hash, resolved = resolve_head("dflash", target, options)
        super().__init__(head, resolved, weights_hash)


@register("dspark")
class DSparkDrafter(BlockDrafter):
    @dataclasses.dataclass(frozen=True)
    class Options:
        model: str = ""  # speculators DSpark folder; empty = this target's demo head (trained once, cached)
        random: bool = False  # random weights of the default shape: for timing and losslessness checks only

    def __init__(self, target: LoadedModel, options: Options) -> None:
        head, weights_hash, resolved = resolve_head("dspark", target, options)
        super().__init__(head, resolved, weights_hash)


# ---------------------------------------------------------------------------- checkpoints


def _block_head(
    what: str,
    layer: ModelConfig,
    state: dict,
    target: CausalLM | GenericCausalLM,
    folder: Path,
    *,
    layer_ids,
    block_size,
    mask_token_id,
    draft_vocab: int,
    target_hidden: int,
    sample_from_anchor: bool,
    markov_rank: int = 0,
    markov_type: str = "vanilla",
    confidence: bool = False,
) -> DFlashHead:
    ids = tuple(int(i) for i in (layer_ids or default_aux_layers(target.config.num_layers)))
    check_verifier(folder, what, target, hidden=target_hidden, vocab=layer.vocab_size, layer_ids=ids)
    if layer.hidden_size != target.config.hidden_size:
        raise SpecdecError(
            f"the {what} in {folder} is {layer.hidden_size} wide",
            f"it reads the target's embedding: it needs width {target.config.hidden_size}",
        )
    if not isinstance(block_size, int) or block_size < 2:
        raise SpecdecError(
            f"the {what} in {folder} has block_size {block_size!r}", "give an integer block_size of at least 2"
        )
    if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < target.config.vocab_size:
        raise SpecdecError(
            f"the {what} in {folder} has mask_token_id {mask_token_id!r}",
            f"set mask_token_id to the id its blocks were trained with (0..{target.config.vocab_size - 1})",
        )
    if markov_type not in MARKOV_TYPES:
        raise SpecdecError(
            f"the {what} in {folder} has markov_head_type {markov_type!r}", f"use one of {', '.join(MARKOV_TYPES)}"
        )
    state = draft_map(state, draft_vocab, layer, target, folder, what)
    own_head = "lm_head.weight" in state
    head = DFlashHead(
        layer,
        target_hidden_size=target_hidden,
        layer_ids=ids,
        block_size=block_size,
        mask_token_id=mask_token_id,
        draft_vocab_size=draft_vocab,
        embed_tokens=target.embed_tokens,
        lm_head=None if own_head else target.lm_head,
        sample_from_anchor=sample_from_anchor,
        markov_rank=markov_rank,
        markov_head_type=markov_type,
        confidence_head=confidence,
    )
    if not own_head and draft_vocab != target.config.vocab_size:
        raise SpecdecError(
            f"the {what} in {folder} has a {draft_vocab}-token draft vocabulary but no lm_head.weight",
            "add its LM head",
        )
    state = {k: v for k, v in state.items() if not k.startswith("verifier_")}
    return load_into(head, state, folder, {"embed_tokens.weight"} | (set() if own_head else {"lm_head.weight"}), target)


def _speculators_block(kind: str):
    def read(config: dict, state: dict, target: CausalLM | GenericCausalLM, folder: Path) -> DFlashHead:
        layer = layer_config(
            config.get("transformer_layer_config") or {}, f"{folder}/config.json transformer_layer_config"
        )
        dspark = kind == "dspark"
        confidence = bool(config.get("enable_confidence_head", True)) if dspark else False
        if confidence and not config.get("confidence_head_with_markov", True):
            raise SpecdecError(
                f"the DSpark head in {folder} feeds its confidence head without the Markov state",
                "this tool reads confidence_head_with_markov heads",
            )
        return _block_head(
            "DSpark head" if dspark else "DFlash head",
            layer,
            state,
            target,
            folder,
            layer_ids=config.get("aux_hidden_state_layer_ids"),
            block_size=config.get("block_size", 8),
            mask_token_id=config.get("mask_token_id"),
            draft_vocab=int(config.get("draft_vocab_size") or layer.vocab_size),
            target_hidden=int(config.get("target_hidden_size") or layer.hidden_size),
            sample_from_anchor=bool(config.get("sample_from_anchor", dspark)),
            markov_rank=int(config.get("markov_rank", 256)) if dspark else 0,
            markov_type=config.get("markov_head_type", "vanilla"),
            confidence=confidence,
        )

    return read


def read_zlab(config: dict, state: dict, target: CausalLM | GenericCausalLM, folder: Path) -> DFlashHead:
    dflash = config["dflash_config"]
    layer = layer_config(config, f"{folder}/config.json")
    ids = dflash.get("target_layer_ids")
    if ids is None:  # z-lab's default: draft-layer-many target layers spread over [1, L-3] (L/2 for one draft layer)
        L, n = int(config.get("num_target_layers", target.config.num_layers)), layer.num_layers
        ids = [L // 2] if n == 1 else [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
    return _block_head(
        "DFlash head",
        layer,
        state,
        target,
        folder,
        layer_ids=[int(i) + 1 for i in ids],
        block_size=config.get("block_size", dflash.get("block_size")),
        mask_token_id=dflash.get("mask_token_id"),
        draft_vocab=layer.vocab_size,
        target_hidden=layer.hidden_size,
        sample_from_anchor=False,
    )


def speculators_fields(head: DFlashHead) -> dict:
    fields = {
        "draft_vocab_size": head.draft_vocab_size,
        "block_size": head.block_size,
        "target_hidden_size": head.target_hidden_size,
        "aux_hidden_state_layer_ids": list(head.hidden_layers),
        "mask_token_id": head.mask_token_id,
        "sample_from_anchor": head.sample_from_anchor,
    }
    if head.markov_head is not None:
        fields.update(
            markov_rank=head.markov_head.rank,
            markov_head_type=head.markov_head.head_type,
            enable_confidence_head=head.confidence_head is not None,
            confidence_head_with_markov=True,
        )
    return fields


def shared(head: DFlashHead) -> set[str]:
    """The target's embedding, and its LM head where the head drafts over the full vocabulary (speculators' rule)."""
    return {"embed_tokens.weight"} | ({"lm_head.weight"} if head.draft_vocab_size == head.config.vocab_size else set())


def _new(dspark: bool):
    def new(
        target: CausalLM | GenericCausalLM,
        draft_vocab=None,
        aux_layers=None,
        seed=0,
        draft_layers=2,
        block_size=8,
        mask_token_id=None,
        markov_rank=DSPARK_DEMO_RANK,
        **_,
    ) -> DFlashHead:
        return new_dflash_head(
            target,
            draft_vocab=draft_vocab,
            layers=draft_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            layer_ids=aux_layers,
            markov_rank=markov_rank if dspark else 0,
            seed=seed,
        )

    return new


_BLOCK_FIELDS = ("block_size", "draft_layers", "position_decay")
register_head_kind(
    HeadKind(
        "dflash",
        new=_new(dspark=False),
        read=_speculators_block("dflash"),
        speculators_fields=speculators_fields,
        shared=shared,
        training_fields=_BLOCK_FIELDS,
        eval_draft_len=7,
        layouts=(Layout("z-lab", "dflash_config", read_zlab),),
    )
)
register_head_kind(
    HeadKind(
        "dspark",
        new=_new(dspark=True),
        read=_speculators_block("dspark"),
        speculators_fields=speculators_fields,
        shared=shared,
        training_fields=(*_BLOCK_FIELDS, "markov_rank"),
        eval_draft_len=7,
    )
)


__all__ = [
    "BlockDrafter",
    "DFlashDrafter",
    "DFlashHead",
    "DSparkDrafter",
    "MARKOV_TYPES",
    "block_mask",
    "default_mask_token",
    "new_dflash_head",
]
