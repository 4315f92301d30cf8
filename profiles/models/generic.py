"""Any causal LM the installed transformers implements, run by transformers' own modules under the loop's cache.

The built-in forward (llama.py) is the fast path for llama, mistral, qwen2 and qwen3. Every other family (Gemma's
sliding-window layers, soft-capping and scaled embeddings, Phi, OLMo, Granite, mixture-of-experts targets) runs here:
transformers' decoder computes every layer, and this wrapper supplies what the loop needs around it:

    cache     a `RowKVCache`: transformers' attention calls `update(k, v, layer_idx)`; the cache writes row b's T new
              keys at its own slots start_pos[b]..start_pos[b]+T-1 and returns keys 0..L-1, as llama.KVCache does, so
              ragged rows and rollback (a rejected draft's slots are simply not counted) work unchanged
    masks     one additive mask per attention kind, built from the same coordinates: query t of row b sees keys
              0..start_pos[b]+t ("full_attention"), and only the last `sliding_window` of them ("sliding_attention");
              a model with both kinds gets them as transformers' per-kind mapping
    positions per row, so RoPE and absolute position embeddings see each row's own positions
    hidden    the residual stream entering layer i, captured by a hook (Hugging Face's hidden_states[i]); id L is
              the final-normed state, as in llama.CausalLM.forward_capture
    logits    the LM head, then the family's own logit transform (Gemma's final soft-capping, Granite's scaling,
              Cohere's logit scale): greedy argmax is unchanged by them, sampled distributions are not

Mixture-of-experts layers are counted, not assumed: `count_experts` records how many distinct experts the tokens of
one forward woke per MoE layer (the reason their verify curve rises with the tokens verified).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from specdec_tune import SpecdecError
from specdec_tune.profiles.models.llama import DecoderStack, KVCache, ModelConfig, step_coordinates

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


def _widest(hf_config, name: str):
    """A config field, the largest of its per-layer values where the family sets one per layer (a list, or
    transformers' per-layer configs, whose global attribute raises); None where it has none."""
    try:
        value = getattr(hf_config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: read the layers' own
        value = [getattr(c, name, None) for c in getattr(hf_config, "per_layer_config", None) or []]
    if isinstance(value, (list, tuple)):
        value = max((v for v in value if v is not None), default=None)
    return value


def generic_config(hf_config) -> ModelConfig:
    """The shapes the loop and the learned heads read, from a transformers config object (its attribute_map resolves
    each family's own names: n_embd, n_head, ...; a per-layer field gives its widest layer's: the cache takes each
    layer's own KV shape as it is written)."""
    hidden, heads = int(hf_config.hidden_size), int(_widest(hf_config, "num_attention_heads"))
    eos = getattr(hf_config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if isinstance(eos, int) else ())
    inter = _widest(hf_config, "intermediate_size") or getattr(hf_config, "moe_intermediate_size", None) or 4 * hidden
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return ModelConfig(
        model_type=str(hf_config.model_type),
        vocab_size=int(hf_config.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(inter),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(_widest(hf_config, "num_key_value_heads") or heads),
        head_dim=int(_widest(hf_config, "head_dim") or hidden // heads),
        rms_norm_eps=float(
            getattr(hf_config, "rms_norm_eps", None) or getattr(hf_config, "layer_norm_eps", None) or 1e-6
        ),
        rope_theta=float(
            (rope.get("rope_theta") if isinstance(rope, dict) else None)
            or getattr(hf_config, "rope_theta", None)
            or 10000.0
        ),
        max_position_embeddings=int(
            getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None) or 2048
        ),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
    )


def layer_kinds(hf_config) -> list[str]:
    """The attention kind of each decoder layer: the config's `layer_types`, else one kind from `sliding_window`."""
    n = int(hf_config.num_hidden_layers)
    if "local" in (getattr(hf_config, "attention_layers", None) or []):  # GPT-Neo's spelling of its window layers
        return ["sliding_attention" if a == "local" else "full_attention" for a in hf_config.attention_layers]
    kinds = getattr(hf_config, "layer_types", None)
    if not kinds:
        sliding = getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True)
        kinds = ["sliding_attention" if sliding else "full_attention"] * n
    unknown = sorted(set(kinds) - set(ATTENTION_KINDS))
    if unknown:
        raise SpecdecError(
            f"{hf_config.model_type} layers of kind {unknown[0]!r} are not supported by the generic path",
            f"it runs layers of kind {' and '.join(ATTENTION_KINDS)}",
        )
    return list(kinds)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    num_experts: int
    experts_per_token: int


def moe_shape(hf_config) -> MoeShape | None:
    experts = next(
        (
            getattr(hf_config, k)
            for k in ("num_local_experts", "num_experts", "n_routed_experts")
            if getattr(hf_config, k, None)
        ),
        None,
    )
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    return MoeShape(int(experts), int(top_k)) if experts and top_k else None


class RowKVCache(KVCache):
    """llama.KVCache that transformers' attention writes through (`update`); k[i], v[i]: [B, H_kv, capacity, hd]."""

    def __init__(
        self, config: ModelConfig, layer_index: dict[int, int], batch: int, capacity: int, dtype, device
    ) -> None:
        super().__init__(config, len(layer_index), batch, capacity, dtype, device)
        self.layer_index = layer_index  # transformers' layer_idx -> position in k / v (a cut model keeps its ids)
        # [B, T] cache coordinates of the step's tokens, set before each forward
        self.rows: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.visible = 0  # L: keys 0..L-1 are visible to some query of the step
        self.shaped: set[int] = set()  # layers whose k / v have taken the shape of the keys they were first given

    # transformers' Cache interface (cache_utils.Cache) beyond `update`: what a family's attention and mask code asks
    # of the cache. Lengths are the step's: `visible` keys, the longest row's past before the step's tokens.

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    is_compileable = False
    is_croppable = False
    is_dummy = False
    is_initialized = True
    is_linear = False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.k)  # every layer keeps every key; sliding windows are the masks' (module docstring)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.slots is None else int(self.slots[:, 0].max())

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.visible, 0  # (keys the masks span, their offset)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return False

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def _unsupported(self, what: str):
        raise SpecdecError(
            f"the model asks the loop's cache for {what}, which it does not keep",
            "the generic path runs attention layers; state-space, recurrent and indexer layers are not supported",
        )

    def get_conv_state(self, *args, **kwargs):
        self._unsupported("a convolution state")

    def update_conv_state(self, *args, **kwargs):
        self._unsupported("a convolution state")

    def get_recurrent_state(self, *args, **kwargs):
        self._unsupported("a recurrent state")

    def update_recurrent_state(self, *args, **kwargs):
        self._unsupported("a recurrent state")

    def update_indexer(self, *args, **kwargs):
        self._unsupported("an indexer's keys")

    def crop(self, *args, **kwargs):
        self._unsupported("a crop (the loop rolls back by its own row lengths)")

    def reorder_cache(self, *args, **kwargs):
        self._unsupported("a beam reorder")

    def batch_repeat_interleave(self, *args, **kwargs):
        self._unsupported("a batch repeat")

    def batch_select_indices(self, *args, **kwargs):
        self._unsupported("a batch selection")

    def early_initialization(self, *args, **kwargs):
        pass  # the loop sized the cache before the forward

    def activate_past_recording(self, *args, **kwargs):
        pass

    def reset(self) -> None:
        self.visible = 0

    def offload(self, *args, **kwargs):
        pass  # the cache stays on its device

    def prefetch(self, *args, **kwargs):
        pass

    def write_prefix(self, rows: torch.Tensor, part: KVCache) -> None:
        for i in cast(RowKVCache, part).shaped - self.shaped:  # the layers' own KV shapes, as the part found them
            self._shape(i, part.k[i], part.v[i])
        super().write_prefix(rows, part)

    def _shape(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        B, _, L, _ = self.k[i].shape
        self.k[i] = self.k[i].new_zeros(B, keys.shape[1], L, keys.shape[-1])
        self.v[i] = self.v[i].new_zeros(B, values.shape[1], L, values.shape[-1])
        self.shaped.add(i)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: [B, H_kv, T, hd] -> the row's slots; returns keys and values [B, H_kv, L, hd]
        i = self.layer_index[layer_idx]
        if i not in self.shaped:  # the layer's own KV heads and head sizes (multi-query, per-layer shapes, MLA)
            self._shape(i, key_states, value_states)
        k, v = self.k[i], self.v[i]
        if (key_states.shape[1], key_states.shape[-1], value_states.shape[-1]) != (
            k.shape[1],
            k.shape[-1],
            v.shape[-1],
        ):
            raise SpecdecError(
                f"layer {layer_idx} writes keys of shape {tuple(key_states.shape)} into a cache of {tuple(k.shape)}",
                "this family's layers change their KV shape between steps, which the generic path does not support",
            )
        k[self.rows, :, self.slots] = key_states.transpose(1, 2).to(k.dtype)  # target [B, T, H_kv, hd]
        v[self.rows, :, self.slots] = value_states.transpose(1, 2).to(v.dtype)
        return k[:, :, : self.visible], v[:, :, : self.visible]


class LogitHead(nn.Module):
    """The LM head and the family's logit transform; `weight` is the linear's (learned heads copy rows of it)."""

    def __init__(self, linear: nn.Linear, hf_config, before: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.linear = linear
        self.before = nn.Sequential(*(before or []))  # what the family applies between its decoder and `linear`
        self.softcap = getattr(hf_config, "final_logit_softcapping", None)  # gemma2, gemma3: cap * tanh(logits / cap)
        self.divide = getattr(hf_config, "logits_scaling", None)  # granite: logits / scaling
        self.multiply = getattr(hf_config, "logit_scale", None)  # cohere: logits * scale

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(self.before(hidden))
        if self.multiply:
            logits = logits * self.multiply
        if self.divide:
            logits = logits / self.divide
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def head_modules(model: PreTrainedModel, decoder: nn.Module, linear: nn.Module) -> list[nn.Module]:
    """The modules with weights a causal LM applies between its decoder and its output projection (a prediction
    head's dense layer and norm), in order, seen by running it on one token."""
    order: list[nn.Module] = []
    hooks = [m.register_forward_hook(lambda m, a, o: order.append(m)) for _, m in model.named_children()]
    try:
        with torch.no_grad():
            param = next(model.parameters())
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=param.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if decoder not in order or linear not in order:
        return []
    between = order[order.index(decoder) + 1 : order.index(linear)]
    return [m for m in between if any(True for _ in m.parameters())]


def decoder_parts(decoder: PreTrainedModel) -> tuple[str, nn.ModuleList, Any]:
    """(the layer list's attribute name, the layer list, the final norm) of a transformers decoder, found from the
    module itself: the layer list is the child ModuleList of num_hidden_layers modules; the final norm is the child
    with weights the decoder applies after its last layer, seen by running it on one token (nn.Identity where it
    applies none)."""
    family = decoder.config.model_type
    lists = [(name, m) for name, m in decoder.named_children() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise SpecdecError(
            f"the {family} decoder keeps no list of layers", "the generic path needs a decoder with a layer list"
        )
    # the decoder layers: the list holding the most weights
    name, layers = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    order: list[nn.Module] = []
    hooks = [m.register_forward_hook(lambda m, a, o: order.append(m)) for _, m in decoder.named_children()]
    hooks.append(layers[-1].register_forward_hook(lambda m, a, o: order.append(m)))
    try:
        with torch.no_grad():
            param = next(decoder.parameters())
            decoder(input_ids=torch.zeros((1, 1), dtype=torch.long, device=param.device), use_cache=False)
    except Exception as e:  # any failure of the family's own forward: one line, the family named
        raise SpecdecError(
            f"the {family} decoder does not run on one token ({type(e).__name__}: {str(e).splitlines()[0][:160]})",
            "the generic path runs decoders that take input_ids alone",
        ) from None
    finally:
        for h in hooks:
            h.remove()
    if not any(m is layers[-1] for m in order):
        raise SpecdecError(
            f"the {family} decoder did not run its last layer on one token", "the generic path runs every layer"
        )
    last = max(i for i, m in enumerate(order) if m is layers[-1])
    applied = [m for m in order[last + 1 :] if any(True for _ in m.parameters())]
    return name, layers, applied[-1] if applied else nn.Identity()


class GenericCausalLM(DecoderStack, nn.Module):
    """llama.CausalLM's interface (DecoderStack's forward, forward_capture and cuts; new_cache) over a transformers
    decoder."""

    def __init__(
        self,
        decoder: PreTrainedModel,
        lm_head: LogitHead,
        layer_ids: list[int] | None = None,
        parts: tuple[str, nn.ModuleList, Any] | None = None,
    ) -> None:
        super().__init__()
        self.layers_name, all_layers, self.norm = parts or decoder_parts(decoder)
        ids = list(range(len(all_layers))) if layer_ids is None else layer_ids
        if layer_ids is not None:  # a cut: a shallow copy of the decoder with its own layer list (and config)
            decoder = copy.copy(decoder)
            decoder._modules = dict(decoder._modules)
            if ids != list(range(len(ids))):  # layers with gaps: the per-layer descriptors follow the kept layers
                config = copy.deepcopy(decoder.config)
                kinds = layer_kinds(config)
                config.num_hidden_layers = len(ids)
                if getattr(config, "layer_types", None):
                    config.layer_types = [kinds[i] for i in ids]
                decoder.config = config
            # a first-layers cut keeps the config: the family's per-layer tables (per-layer input embeddings, the
            # layer where KV sharing starts) stay sized for the whole stack, whose loop runs the shorter list
            setattr(decoder, self.layers_name, nn.ModuleList(all_layers[i] for i in ids))
        self.decoder = decoder
        self.lm_head = lm_head
        self.layers = getattr(decoder, self.layers_name)
        self.embed_tokens = cast(nn.Embedding, decoder.get_input_embeddings())  # typed as any nn.Module
        self.config = dataclasses.replace(generic_config(decoder.config), num_layers=len(ids))
        self.kinds = layer_kinds(decoder.config)[: len(ids)]
        self.window = getattr(decoder.config, "sliding_window", None) or getattr(decoder.config, "window_size", None)
        self.own_windows = _own_window_modules(decoder)
        self.chunk = getattr(decoder.config, "attention_chunk_size", None)
        self.moe = moe_shape(decoder.config)
        # transformers' layer_idx of each kept layer (its attention writes under that id)
        kept = [idx for i, layer in zip(ids, self.layers) for idx in _layer_idxs(layer, i)]
        self.layer_index = {idx: pos for pos, idx in enumerate(kept)}
        params = inspect.signature(decoder.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._check_runs(decoder.config.model_type, f"layers {ids}" if layer_ids is not None else "")

    def _check_runs(self, family: str, cut: str) -> None:
        """Two tokens and one more through the loop's cache, as decoding runs them: a family whose layers ask the cache
        for what it does not keep, or whose modules do not take the loop's masks, is refused here in one line."""
        tokens = torch.zeros((1, 3), dtype=torch.long, device=self.device)
        try:
            with torch.no_grad():
                cache = self.new_cache(1, 3)
                self._run(tokens[:, :2], cache, torch.zeros(1, dtype=torch.long, device=self.device), "none", ())
                self._run(tokens[:, 2:], cache, torch.full((1,), 2, dtype=torch.long, device=self.device), "none", ())
        except SpecdecError:
            raise
        except Exception as e:  # the family's own modules under the loop's cache: named, in transformers' words
            what = f"the {family} decoder" + (f" cut to its {cut}" if cut else "")
            raise SpecdecError(
                f"{what} does not run under the loop's cache ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:160] if str(e) else 'no message'})",
                "the generic path runs decoders whose attention writes through transformers' Cache.update"
                + (", and cuts of decoders whose layers keep no state across layers" if cut else ""),
            ) from None

    def _cut(self, layer_ids: list[int]) -> GenericCausalLM:
        return GenericCausalLM(self.decoder, self.lm_head, layer_ids, (self.layers_name, self.layers, self.norm))

    def new_cache(self, batch: int, capacity: int) -> RowKVCache:
        return RowKVCache(self.config, self.layer_index, batch, capacity, self.dtype, self.device)

    def _masks(self, positions: torch.Tensor, visible: torch.Tensor, kinds: set[str]) -> dict[str, torch.Tensor]:
        """Additive masks [B, 1, T, L] per attention kind."""
        L = visible.shape[-1]
        blocked = torch.finfo(self.dtype).min
        out = {}
        for kind in kinds:
            allowed = visible
            keys = torch.arange(L, device=positions.device)
            if kind == "sliding_attention" and self.window:  # key k visible to query position p iff p - window < k <= p
                allowed = allowed & (keys[None, None, :] > positions[:, :, None] - self.window).unsqueeze(1)
            if kind == "chunked_attention" and self.chunk:  # ... iff k and p lie in the same chunk (and k <= p)
                same = keys[None, None, :] // self.chunk == positions[:, :, None] // self.chunk
                allowed = allowed & same.unsqueeze(1)
            out[kind] = torch.zeros(allowed.shape, dtype=self.dtype, device=positions.device).masked_fill(
                ~allowed, blocked
            )
        return out

    def _run(self, tokens, cache: RowKVCache, start_pos, logits: str, layer_ids: tuple[int, ...]):
        T = tokens.shape[1]
        positions, visible, rows = step_coordinates(start_pos, T, cache.capacity)  # [B, T], [B, 1, T, L] bool, [B, T]
        cache.rows, cache.slots, cache.visible = rows, positions, visible.shape[-1]
        captured: dict[int, torch.Tensor] = {}
        hooks = [
            self.layers[i].register_forward_pre_hook(_capture(captured, i), with_kwargs=True)
            for i in layer_ids
            if i < len(self.layers)
        ]
        if self.own_windows:  # the decoder takes one mask; the window layers get theirs on the way in
            masks = self._masks(positions, visible, {"full_attention", "sliding_attention"})
            hooks += [
                m.register_forward_pre_hook(_with_mask(masks["sliding_attention"]), with_kwargs=True)
                for m in self.own_windows
            ]
            mask: torch.Tensor | dict[str, torch.Tensor] = masks["full_attention"]
        else:  # one tensor where the model has one kind, else transformers' per-kind mapping
            masks = self._masks(positions, visible, set(self.kinds))
            mask = masks if len(masks) > 1 else next(iter(masks.values()))
        try:
            out = self.decoder(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_kwarg: cache},
            )
        finally:
            for h in hooks:
                h.remove()
        x = out.last_hidden_state  # [B, T, hidden], final-normed
        captured[len(self.layers)] = x
        result = None if logits == "none" else x if logits == "hidden" else self.lm_head(x).float()
        hidden = (
            torch.cat([captured[i] for i in layer_ids], dim=-1) if layer_ids else None
        )  # [B, T, len(layer_ids) * hidden]
        return result, hidden

    @contextlib.contextmanager
    def count_experts(self) -> Iterator[list[int]]:
        """Within the block, each MoE layer's forward appends the number of distinct experts its tokens woke to the
        yielded list (one entry per MoE layer per forward). Empty for a dense model."""
        woke: list[int] = []
        hooks = (
            [
                m.register_forward_pre_hook(_expert_counter(woke), with_kwargs=True)
                for m in self.layers.modules()
                if _routes_tokens(m)
            ]
            if self.moe
            else []
        )
        try:
            yield woke
        finally:
            for h in hooks:
                h.remove()


def _layer_idxs(layer: nn.Module, default: int) -> list[int]:
    """transformers' layer_idx of every attention module in a decoder layer (a family may run two), in order; the
    layer's position where none is found."""
    found = [getattr(m, "layer_idx", None) for m in layer.modules() if m is not layer]
    return list(dict.fromkeys(int(i) for i in found if i is not None)) or [default]


def _own_window_modules(decoder: nn.Module) -> list[nn.Module]:
    """Attention modules that cut their window from a causal buffer aligned to the key length (GPT-Neo's local
    layers): rows of different lengths in one batch do not share that alignment, so the buffer is reset to plain
    causality and the loop's sliding-window mask, built per row, carries the window (`_with_mask`)."""
    found = []
    for m in decoder.modules():
        bias = getattr(m, "bias", None)
        if (
            getattr(m, "attention_type", None) == "local"
            and isinstance(bias, torch.Tensor)
            and bias.dtype == torch.bool
        ):
            m.bias = torch.tril(torch.ones_like(bias))  # [1, 1, P, P]: key k visible to query q iff k <= q
            found.append(m)
    return found


def _with_mask(mask: torch.Tensor):
    def hook(module, args, kwargs):
        return args, kwargs | {"attention_mask": mask}

    return hook


def _capture(store: dict, i: int):
    def hook(module, args, kwargs):
        store[i] = args[0] if args else kwargs["hidden_states"]

    return hook


def _routes_tokens(module: nn.Module) -> bool:
    """An experts module of transformers' MoE layers: called with the tokens and their top-k expert ids."""
    return hasattr(module, "num_experts") and "top_k_index" in inspect.signature(module.forward).parameters


def _expert_counter(woke: list[int]):
    def hook(module, args, kwargs):
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [tokens, k]
        woke.append(int(torch.unique(top_k_index[top_k_index < module.num_experts]).numel()))

    return hook
