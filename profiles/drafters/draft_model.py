"""External draft model: a small causal LM with the target's tokenizer, run autoregressively (D serial steps).

With `model` unset it is the target's first `layers` layers plus the target's final norm and LM head,
sharing the target's weights: an early-exit drafter that works as-is for any target. With `model`
set it loads that checkpoint (folder or GGUF) and checks the vocabulary matches the target's.

The draft keeps its own static KV cache. Row b's cache holds `fed[b]` correct tokens; each round it
first catches up on the tokens the target emitted since (1 or 2 after a partly accepted draft, more
after a fully accepted one), then drafts one token per step. Drafts the target rejects need no undo:
the next round's catch-up overwrites their slots.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch

from specdec_tune import SpecdecError
from specdec_tune.kernels.sampling import sample_tokens
from specdec_tune.profiles.drafters.base import Draft, Drafter, DraftRequest, register
from specdec_tune.profiles.drafters.quant import quantize_linear_weights
from specdec_tune.profiles.models.loading import LoadedModel, check_same_vocabulary, load_model

if TYPE_CHECKING:
    from specdec_tune.profiles.models.llama import KVCache


@register("draft_model")
class DraftModelDrafter(Drafter):
    kind = "serial"
    replay = "teacher_forced"  # a greedy chain: one forward over the trajectory replays it

    @dataclasses.dataclass(frozen=True)
    class Options:
        model: str = ""  # checkpoint folder or .gguf; empty = the target's first `layers` layers
        layers: int = 0  # layers kept from the target (0 = a third of them, at least 1)

    def __init__(self, target: LoadedModel, options: Options) -> None:
        self.options = options
        if options.model:
            loaded = load_model(options.model, dtype=target.ref.dtype, device=str(target.model.device))
            check_same_vocabulary(target, loaded)
            self.model = loaded.model
        else:
            n = options.layers or max(1, target.model.config.num_layers // 3)
            if n >= target.model.config.num_layers:
                raise SpecdecError(
                    f"a draft of {n} layers is as large as the {target.model.config.num_layers}-layer target",
                    "use fewer layers (option layers=N)",
                )
            self.model = target.model.truncated(n)
        self.cache: KVCache | None = None
        # Per row, the cache holds seq[:checked] (known to match) followed by `unchecked` (drafts that may be rejected).
        self.checked: list[int] = []
        self.unchecked: list[list[int]] = []

    def with_quantized_weights(self, fmt: str) -> DraftModelDrafter:
        twin = copy.copy(self)
        twin.model = quantize_linear_weights(self.model, fmt)  # a deep copy: the target's shared weights stay exact
        twin.cache = None
        return twin

    def start(self, prompts: list[list[int]]) -> None:
        self.capacity = 0
        self.cache = None
        self.checked = [0] * len(prompts)
        self.unchecked = [[] for _ in prompts]

    def _ensure_cache(self, rows: int, need: int) -> None:
        if self.cache is None or self.cache.capacity < need:
            old, self.cache = self.cache, self.model.new_cache(rows, max(need, 2 * self.capacity, 256))
            self.capacity = self.cache.capacity
            if old is not None:  # grow: copy what is cached
                self.cache.write_prefix(torch.arange(old.batch, device=self.model.device), old)

    def keep_rows(self, indices: list[int]) -> None:
        self.checked = [self.checked[i] for i in indices]
        self.unchecked = [self.unchecked[i] for i in indices]
        if self.cache is not None:
            self.cache.keep_rows(torch.tensor(indices, dtype=torch.long, device=self.model.device))

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        seqs, B, K = request.token_ids, len(request.token_ids), max(request.max_tokens)
        if K == 0:
            return Draft(tokens=[[] for _ in seqs])
        device = self.model.device
        self._ensure_cache(B, max(len(s) for s in seqs) + K + 1)

        # Catch up: the cache is correct up to where its unchecked drafts and the sequence part.
        # The last token is always run again: its logits start the draft (a row drafting less than the batch's longest
        # can have it cached already, when the target took the drafts beyond its own D)
        start = [
            c + min(common_prefix(u, s[c:]), len(s) - c - 1) for c, u, s in zip(self.checked, self.unchecked, seqs)
        ]
        pending = [s[p:] for s, p in zip(seqs, start)]  # ≥ 1 token each
        width = max(len(p) for p in pending)
        tokens = torch.zeros((B, width), dtype=torch.long)
        for b, p in enumerate(pending):
            tokens[b, : len(p)] = torch.tensor(p)
        pos = torch.tensor(start, dtype=torch.long, device=device)
        hidden = self.model(tokens.to(device), self.cache, pos, logits="hidden")  # [B, width, W]
        last = torch.tensor([len(p) - 1 for p in pending], device=device)
        # the head only where the draft starts: over a whole prompt's catch-up it would cost as much as the layers
        step_logits = self.model.lm_head(hidden[torch.arange(B, device=device), last]).float()  # [B, V]
        pos = pos + last + 1

        drafted, probs = [], []
        for step in range(K):
            token, q = _pick(step_logits, request.temperature, request.generator)
            drafted.append(token)
            if q is not None:
                probs.append(q)
            if step + 1 < K:
                step_logits = self.model(token[:, None], self.cache, pos)[:, 0]
                pos = pos + 1
        draft_tokens = torch.stack(drafted, dim=1).tolist()  # [B, K]
        # The cache now holds seq + d_1..d_{K-1} for every row.
        self.checked = [len(s) for s in seqs]
        self.unchecked = [d[: K - 1] for d in draft_tokens]
        out = [d[:m] for d, m in zip(draft_tokens, request.max_tokens)]
        return Draft(tokens=out, probs=torch.stack(probs, dim=1) if probs else None)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
    """Next draft token per row [B], and its distribution [B, V] when sampled (None when greedy)."""
    if temperature == 0:
        return logits.argmax(-1), None
    q = torch.softmax(logits / temperature, dim=-1)
    return sample_tokens(q, generator), q


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
