"""EAGLE-3 (Li et al. 2025): one decoder layer over the fused low/mid/high target states and the next token's embedding.

  g_p    = fc([a_p; m_p; z_p])                          target states entering three layers, [3*H_t] -> [H]
  x      = [input_layernorm(e(x_{p+1})); hidden_norm(h_p)]  [2H]: q/k/v read both
  r      = h_p (or hidden_norm(h_p) with norm_before_residual) + attn(x)
  c_p    = r + mlp(post_attention_layernorm(r))          carried to the next step (h = c_p there)
  logits = lm_head(norm(c_p))                            over the draft vocabulary; target id = id + d2t[id]

h_p = g_p at positions the target verified; at a draft step h is the previous step's c. This is vLLM's
`llama_eagle3.py` forward and speculators' `Eagle3DraftModel` layout (weights `fc`, `layers.0.*`, `norm`,
`lm_head`, `d2t`, `t2d`; the embedding is the target's unless the checkpoint carries one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.base import register
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
    shares_embedding,
)
from specdec_tune.profiles.models.llama import CausalLM, DecoderLayer, ModelConfig, RMSNorm

if TYPE_CHECKING:
    from specdec_tune.profiles.models.generic import GenericCausalLM
    from specdec_tune.profiles.models.loading import LoadedModel


class Eagle3Layer(DecoderLayer):
    """A Llama decoder layer whose attention reads [normed embedding; normed hidden] (2*hidden wide)."""

    def __init__(self, c: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__(c)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        attn.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        attn.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def mix(self, embeds: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
        """embeds, hidden: [B, T, H] -> output before the final norm [B, T, H]; `attend` is the attention (cached or
        training)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        residual = residual + attend(x)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Head(DraftVocabulary, DraftHead):
    def __init__(
        self,
        config: ModelConfig,
        *,
        target_hidden_size: int,
        aux_layers: tuple[int, ...],
        draft_vocab_size: int,
        norm_before_residual: bool,
        embed_tokens: nn.Embedding,
    ) -> None:
        super().__init__()
        self.config = config
        self.hidden_layers = tuple(aux_layers)
        self.target_hidden_size = target_hidden_size
        self.norm_before_residual = norm_before_residual
        H = config.hidden_size
        self.fc = nn.Linear(len(aux_layers) * target_hidden_size, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config, norm_before_residual)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.embed_tokens = embed_tokens
        # d2t[i]: target id of draft id i minus i (speculators / vLLM); zeros = the full vocabulary, in order.
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))

    @property
    def layer(self) -> Eagle3Layer:
        return cast(Eagle3Layer, self.layers[0])  # nn.ModuleList's items are typed as any nn.Module

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden)

    def features_with(self, tokens, hidden, attend):
        carry = self.layers[0].mix(self.embed_tokens(tokens), hidden, attend)
        return self.norm(carry), carry


def new_eagle3_head(
    target: CausalLM | GenericCausalLM,
    *,
    draft_vocab: list[int] | None = None,
    aux_layers: tuple[int, ...] | None = None,
    seed: int = 0,
) -> Eagle3Head:
    """A head of the default shape for `target`: its layer settings, its embedding (shared), and a draft vocabulary
    `draft_vocab` (target ids, increasing; None = the full vocabulary). The head's own weights are random; the LM head
    starts as the target's rows for the draft vocabulary, the norm as the target's final norm."""
    c = head_layer_config(target.config)
    ids = torch.tensor(draft_vocab if draft_vocab is not None else range(c.vocab_size), dtype=torch.long)
    head = Eagle3Head(
        c,
        target_hidden_size=target.config.hidden_size,
        aux_layers=aux_layers or default_aux_layers(target.config.num_layers),
        draft_vocab_size=len(ids),
        norm_before_residual=False,
        embed_tokens=target.embed_tokens,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith("embed_tokens"):
                continue
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "norm" in name:
                p.fill_(1.0)
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
        head.norm.weight.copy_(target.norm.weight)
        head.d2t.copy_(ids - torch.arange(len(ids)))
    return head.to(device=target.device, dtype=target.dtype)


@register("eagle3")
class Eagle3Drafter(HeadDrafter):
    @dataclasses.dataclass(frozen=True)
    class Options:
        model: str = (
            ""  # speculators or Model-Optimizer EAGLE-3 folder; empty = this target's demo head (trained once, cached)
        )
        random: bool = False  # random weights of the default shape: for timing and losslessness checks only

    def __init__(self, target: LoadedModel, options: Options) -> None:
        head, weights_hash, resolved = resolve_head("eagle3", target, options)
        super().__init__(head, resolved, weights_hash)


# ---------------------------------------------------------------------------- checkpoints


def _eagle3(
    layer: ModelConfig,
    state: dict,
    target: CausalLM | GenericCausalLM,
    folder: Path,
    *,
    target_hidden: int,
    layer_ids,
    draft_vocab: int,
    norm_before_residual: bool,
) -> Eagle3Head:
    ids = tuple(int(i) for i in (layer_ids or default_aux_layers(target.config.num_layers)))
    check_verifier(folder, "EAGLE-3 head", target, hidden=target_hidden, vocab=layer.vocab_size, layer_ids=ids)
    if layer.num_layers != 1:
        raise SpecdecError(
            f"the EAGLE-3 head in {folder} has {layer.num_layers} decoder layers",
            "this tool runs one-layer EAGLE-3 heads",
        )
    own_embedding = "embed_tokens.weight" in state
    if not own_embedding and layer.hidden_size != target.config.hidden_size:
        raise SpecdecError(
            f"the EAGLE-3 head in {folder} is {layer.hidden_size} wide and has no embedding of its own",
            f"it needs the target's hidden size {target.config.hidden_size}",
        )
    state = draft_map(state, draft_vocab, layer, target, folder, "EAGLE-3 head")
    embed = torch.nn.Embedding(layer.vocab_size, layer.hidden_size) if own_embedding else target.embed_tokens
    head = Eagle3Head(
        layer,
        target_hidden_size=target_hidden,
        aux_layers=ids,
        draft_vocab_size=draft_vocab,
        norm_before_residual=norm_before_residual,
        embed_tokens=embed,
    )
    return load_into(head, state, folder, set() if own_embedding else {"embed_tokens.weight"}, target)


def read_speculators(config: dict, state: dict, target: CausalLM | GenericCausalLM, folder: Path) -> Eagle3Head:
    layer = layer_config(config.get("transformer_layer_config") or {}, f"{folder}/config.json transformer_layer_config")
    return _eagle3(
        layer,
        state,
        target,
        folder,
        target_hidden=int(config.get("target_hidden_size") or layer.hidden_size),
        layer_ids=config.get("eagle_aux_hidden_state_layer_ids"),
        draft_vocab=int(config.get("draft_vocab_size") or layer.vocab_size),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
    )


def read_modelopt(config: dict, state: dict, target: CausalLM | GenericCausalLM, folder: Path) -> Eagle3Head:
    eagle = config["eagle_config"]
    if not eagle.get("use_aux_hidden_state", True):
        raise SpecdecError(
            f"the head in {folder} does not read auxiliary target states (EAGLE-1 style)", "use an EAGLE-3 export"
        )
    layer = layer_config(config, f"{folder}/config.json")
    renamed = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v for k, v in state.items()}
    return _eagle3(
        layer,
        renamed,
        target,
        folder,
        target_hidden=int(config.get("target_hidden_size") or layer.hidden_size),
        layer_ids=eagle.get("eagle_aux_hidden_state_layer_ids"),
        draft_vocab=int(config.get("draft_vocab_size") or layer.vocab_size),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
    )


def speculators_fields(head: Eagle3Head) -> dict:
    return {
        "draft_vocab_size": head.draft_vocab_size,
        "norm_before_residual": head.norm_before_residual,
        "target_hidden_size": head.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head.hidden_layers),
    }


register_head_kind(
    HeadKind(
        "eagle3",
        new=lambda target, draft_vocab=None, aux_layers=None, seed=0, **_: new_eagle3_head(
            target, draft_vocab=draft_vocab, aux_layers=aux_layers, seed=seed
        ),
        read=read_speculators,
        speculators_fields=speculators_fields,
        shared=shares_embedding,
        training_fields=("ttt_steps", "step_decay"),
        eval_draft_len=3,
        layouts=(Layout("modelopt", "eagle_config", read_modelopt),),
    )
)
