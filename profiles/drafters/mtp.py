"""MTP (DeepSeek-V3 style multi-token prediction): one extra decoder layer that reads the target's final state.

  u      = input_proj([token_layernorm(e(x_{p+1})); hidden_layernorm(h_p)])   [2H] -> [H]
  y      = decoder_layer(u)                                                  a plain Llama layer, own KV cache
  logits = lm_head(final_layernorm(y))                                       the target's embedding and LM head
  c_p    = final_layernorm(y)   (speculators; DeepSeek's own checkpoints carry y, the state before the norm)

h_p is the target's final-normed state at p where the target verified p; at a draft step it is the previous
step's c. A one-layer checkpoint runs D times (vLLM, TensorRT-LLM's MTP-Eagle). Weight names follow
speculators' `MTPDraftModel` (`mtp_layers.0.{input_proj, token_layernorm, hidden_layernorm, final_layernorm,
self_attn.*, mlp.*, input_layernorm, post_attention_layernorm}`); the embedding and head are the target's.
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
from specdec_tune.profiles.drafters.head_reading import check_verifier, layer_config, load_into
from specdec_tune.profiles.drafters.heads import DraftHead, HeadDrafter, HeadKind, head_layer_config, register_head_kind
from specdec_tune.profiles.models.llama import CausalLM, DecoderLayer, ModelConfig, RMSNorm

if TYPE_CHECKING:
    from specdec_tune.profiles.models.generic import GenericCausalLM, LogitHead
    from specdec_tune.profiles.models.loading import LoadedModel


class MtpLayer(DecoderLayer):
    """A Llama decoder layer behind the MTP input projection, with the norm its output goes through."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__(c)
        self.token_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.final_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def mix(self, embeds: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
        """embeds, hidden: [B, T, H] -> the layer's output before final_layernorm [B, T, H]; `attend` is the
        attention."""
        u = self.input_proj(torch.cat([self.token_layernorm(embeds), self.hidden_layernorm(hidden)], dim=-1))
        r = u + attend(self.input_layernorm(u))
        return r + self.mlp(self.post_attention_layernorm(r))


class MtpHead(DraftHead):
    def __init__(
        self,
        config: ModelConfig,
        *,
        final_layer_id: int,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear | LogitHead,
        carry_normed: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.hidden_layers = (final_layer_id,)  # the target's final-normed state
        self.mtp_layers = nn.ModuleList([MtpLayer(config)])
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.carry_normed = carry_normed

    @property
    def layer(self) -> MtpLayer:
        return cast(MtpLayer, self.mtp_layers[0])  # nn.ModuleList's items are typed as any nn.Module

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def features_with(self, tokens, hidden, attend):
        layer = self.mtp_layers[0]
        y = layer.mix(self.embed_tokens(tokens), hidden, attend)
        normed = layer.final_layernorm(y)
        return normed, normed if self.carry_normed else y


def new_mtp_head(target: CausalLM | GenericCausalLM, seed: int = 0) -> MtpHead:
    """A head of the default shape for `target` (its layer settings, embedding and LM head, shared). The layer starts as
    a copy of the target's last layer, the projection as [0, I] (pass the target state through), the norms as ones."""
    c = head_layer_config(target.config)
    head = MtpHead(c, final_layer_id=target.config.num_layers, embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    layer = head.layer
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        last = target.layers[-1].state_dict()
        own = {k: v for k, v in layer.state_dict().items() if k in last and v.shape == last[k].shape}
        layer.load_state_dict({k: last[k].float() for k in own}, strict=False)
        H = c.hidden_size
        proj = torch.randn((H, 2 * H), generator=g) * 0.02 / H**0.5
        proj[:, H:] += torch.eye(H)
        layer.input_proj.weight.copy_(proj)
    return head.to(device=target.device, dtype=target.dtype)


@register("mtp")
class MtpDrafter(HeadDrafter):
    @dataclasses.dataclass(frozen=True)
    class Options:
        model: str = ""  # speculators MTP folder; empty = this target's demo head (trained once, cached)
        random: bool = False  # the untrained default head: for timing and losslessness checks only

    def __init__(self, target: LoadedModel, options: Options) -> None:
        head, weights_hash, resolved = resolve_head("mtp", target, options)
        super().__init__(head, resolved, weights_hash)


# ---------------------------------------------------------------------------- checkpoints


def read_speculators(config: dict, state: dict, target: CausalLM | GenericCausalLM, folder: Path) -> MtpHead:
    layer = layer_config(config.get("transformer_layer_config") or {}, f"{folder}/config.json transformer_layer_config")
    layers = int(config.get("num_nextn_predict_layers", 1))
    if layers != 1:
        raise SpecdecError(
            f"the MTP checkpoint in {folder} has {layers} prediction layers",
            "this tool (like speculators) runs one-layer MTP",
        )
    check_verifier(folder, "MTP head", target, hidden=layer.hidden_size, vocab=layer.vocab_size)
    own = {k for k in ("embed_tokens.weight", "lm_head.weight") if k in state}
    embed = (
        torch.nn.Embedding(layer.vocab_size, layer.hidden_size) if "embed_tokens.weight" in own else target.embed_tokens
    )
    lm_head = (
        torch.nn.Linear(layer.hidden_size, layer.vocab_size, bias=False) if "lm_head.weight" in own else target.lm_head
    )
    head = MtpHead(
        dataclasses.replace(layer, num_layers=1),
        final_layer_id=target.config.num_layers,
        embed_tokens=embed,
        lm_head=lm_head,
    )
    return load_into(head, state, folder, {"embed_tokens.weight", "lm_head.weight"} - own, target)


register_head_kind(
    HeadKind(
        "mtp",
        new=lambda target, seed=0, **_: new_mtp_head(target, seed=seed),
        read=read_speculators,
        speculators_fields=lambda head: {"num_nextn_predict_layers": 1},
        shared=lambda head: {"embed_tokens.weight", "lm_head.weight"},
        training_fields=("ttt_steps", "step_decay"),
        eval_draft_len=3,
        reads_aux_states=False,
    )
)
