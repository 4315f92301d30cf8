"""A Llama-family causal LM with a static, batched KV cache: the step a serving engine runs.

Transformers loads the weights; this module runs them. The timed forward does no per-step
allocation of the cache and no Python-side reshaping of it, so a small model's step time is the
model's work, not framework overhead (profiles/backends.py: the torch backend).

The cache holds, for each row b, the keys and values of positions 0..len_b-1. A forward writes the T
new tokens of row b at positions start_pos[b]..start_pos[b]+T-1 and lets query t see keys
0..start_pos[b]+t. Slots past a row's length are free: rejecting draft tokens is just not advancing
the length (rollback costs nothing), and padded tokens of a ragged batch write only to free slots.

Covers the architectures whose forward is the Llama one up to small switches: llama, mistral
(no sliding window), qwen2 (q/k/v bias), qwen3 (q/k RMSNorm).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec_tune import SpecdecError

if TYPE_CHECKING:
    from typing import Self

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v biases: always for qwen2, per config for llama and qwen3
    o_bias: bool = False  # o_proj bias: llama and qwen3 with attention_bias
    qk_norm: bool = False  # qwen3
    eos_token_ids: tuple[int, ...] = ()

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Read a Hugging Face `config.json` dict; refuse what this forward would get wrong."""
        if not isinstance(hf, dict):
            raise SpecdecError("the model config is not a JSON object", "give a Hugging Face config.json")
        model_type = hf.get("model_type", "?")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
            raise SpecdecError(
                f"unsupported model architecture {model_type!r}",
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        reason = builtin_unsupported(hf)
        if reason:
            raise SpecdecError(
                f"{reason} in the {model_type} config is not supported by the built-in forward",
                "load it through the generic path",
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}

        def count(key: str, default: int | None = None) -> int:
            value = hf.get(key) if hf.get(key) is not None else default
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecdecError(
                    f"{key} in the {model_type} config is {value!r}, not a positive integer", "fix the config.json"
                )
            return value

        def number(key: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise SpecdecError(
                    f"{key} in the {model_type} config is {value!r}, not a positive number", "fix the config.json"
                )
            return float(value)

        hidden, heads = count("hidden_size"), count("num_attention_heads")
        kv_heads = count("num_key_value_heads", heads)
        if heads % kv_heads:
            raise SpecdecError(
                f"{heads} attention heads do not split over {kv_heads} KV heads",
                "fix num_key_value_heads in the config.json",
            )
        # Biases as transformers builds them: qwen2 always has q/k/v biases (no o_proj bias), mistral none,
        # llama and qwen3 put one on q/k/v and o_proj when attention_bias is set.
        bias = {"qwen2": True, "mistral": False}.get(model_type, bool(hf.get("attention_bias", False)))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
            raise SpecdecError(
                f"eos_token_id in the {model_type} config is {eos!r}, not token ids", "fix the config.json"
            )
        return cls(
            model_type=model_type,
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=count("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=count("head_dim", hidden // heads or None),
            rms_norm_eps=number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            rope_theta=number("rope_theta", rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=count("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias,
            o_bias=bias and model_type in ("llama", "qwen3"),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
        )


def builtin_unsupported(hf: dict) -> str | None:
    """What in a config of the four built-in families this forward would get wrong (None: nothing); such a model
    runs through transformers' own modules instead (generic.py)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return f"rope_scaling {rope!r}"
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return f"rope scaling {rope.get('rope_type', rope.get('type'))!r}"
    if hf.get("sliding_window") and hf.get("use_sliding_window", hf.get("model_type") == "mistral"):
        return "sliding-window attention"
    if hf.get("mlp_bias"):
        return "an MLP bias (mlp_bias)"
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {hf.get('hidden_act')!r}"
    return None


class KVCache:
    """Preallocated keys and values: k[layer], v[layer] are [B, H_kv, capacity, head_dim]."""

    def __init__(self, config: ModelConfig, num_layers: int, batch: int, capacity: int, dtype, device) -> None:
        shape = (batch, config.num_kv_heads, capacity, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished sequences leave the batch); one copy per row change."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]

    def write_prefix(self, rows: torch.Tensor, part: KVCache) -> None:
        """Another cache's slots 0..part.capacity-1 into these rows (a prefill run apart for a group of rows)."""
        for k, v, pk, pv in zip(self.k, self.v, part.k, part.v):
            k[rows, :, : part.capacity] = pk
            v[rows, :, : part.capacity] = pv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the Hugging Face (rotate-half) layout. x: [B, T, H, hd]; cos/sin: [B, T, 1, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with the G query heads of each KV head packed as G*T query rows.

    q: [B, H, T, hd]; k, v: [B, H_kv, L, hd]; mask: [B, 1, T, L] bool (True = visible) -> [B, H, T, hd].
    Query head h reads KV head h // G, so q viewed as [B, H_kv, G*T, hd] lines each group up with its
    KV head: one KV read serves G*(1+D) rows, as decode kernels tile it. (Plain SDPA with
    enable_gqa runs a one-token step 3-7x slower than this on CPU, which would flatter speculation.)
    """
    B, H, T, hd = q.shape
    H_kv, L = k.shape[1], k.shape[2]
    G = H // H_kv
    rows = q.reshape(B, H_kv, G * T, hd)
    row_mask = mask.unsqueeze(2).expand(B, 1, G, T, L).reshape(B, 1, G * T, L)
    return F.scaled_dot_product_attention(rows, k, v, attn_mask=row_mask).view(B, H, T, hd)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x, cos, sin):
        """x: [B, T, in] -> rotated q [B, T, H, hd], rotated k and v [B, T, H_kv, hd]."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(self, x, cos, sin, k_cache, v_cache, rows, slots, mask):
        # x: [B, T, hidden]; rows/slots: [B, T] cache coordinates of the new tokens; mask: [B, 1, T, L]
        B, T, _ = x.shape
        c = self.c
        q, k, v = self.qkv(x, cos, sin)
        k_cache[rows, :, slots] = k.to(k_cache.dtype)  # advanced indices first: target is [B, T, H_kv, hd]
        v_cache[rows, :, slots] = v.to(v_cache.dtype)
        L = mask.shape[-1]
        out = gqa_attention(q.transpose(1, 2), k_cache[:, :, :L], v_cache[:, :, :L], mask)  # [B, H, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, rows, slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, rows, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack:
    """What both forwards (CausalLM here, generic.GenericCausalLM) share: dtype and device, cuts by layer id, and the
    two entry points over `_run(tokens, cache, start_pos, logits, layer_ids) -> (logits, hidden)`."""

    config: ModelConfig
    embed_tokens: nn.Embedding
    layers: nn.ModuleList

    if TYPE_CHECKING:  # each forward defines these (declared here for the type checker only: no runtime stubs)

        def _cut(self, layer_ids: list[int]) -> Self: ...

        def _run(
            self, tokens: torch.Tensor, cache: Any, start_pos: torch.Tensor, logits: str, layer_ids: tuple[int, ...]
        ) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def truncated(self, num_layers: int) -> Self:
        """The first `num_layers` layers with this model's embedding, final norm and head, sharing weights."""
        return self.sublayers(list(range(num_layers)))

    def sublayers(self, layer_ids: list[int]) -> Self:
        """These layers (in order) with this model's embedding, final norm and head, sharing weights."""
        n = self.config.num_layers
        if not layer_ids or any(not 0 <= i < n for i in layer_ids) or sorted(set(layer_ids)) != layer_ids:
            raise SpecdecError(
                f"draft layers {layer_ids} are not increasing ids in 0..{n - 1}", "pick distinct layers of the target"
            )
        return self._cut(layer_ids)

    def forward(
        self, tokens: torch.Tensor, cache: KVCache, start_pos: torch.Tensor, logits: str = "all"
    ) -> torch.Tensor | None:
        """Run T new tokens per row on top of the cache.

        tokens: [B, T] int64; start_pos: [B] int64, row b's tokens go to positions start_pos[b]+t.
        logits: "all" -> [B, T, V] float32, "hidden" -> final-normed hidden [B, T, hidden], "none" -> None.
        """
        return self._run(tokens, cache, start_pos, logits, ())[0]

    def forward_capture(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        start_pos: torch.Tensor,
        layer_ids: tuple[int, ...],
        logits: str = "all",
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`forward`, plus the hidden states at `layer_ids`, concatenated: [B, T, len(layer_ids) * hidden].

        Layer id i < num_layers is the residual stream entering layer i (Hugging Face's hidden_states[i],
        vLLM's EAGLE-3 auxiliary layer convention); id num_layers is the final-normed state the LM head reads.
        """
        n = len(self.layers)
        if not layer_ids or any(not 0 <= i <= n for i in layer_ids):
            raise SpecdecError(
                f"hidden-state layer ids {list(layer_ids)} are not in 0..{n}", f"pick ids of this {n}-layer model"
            )
        out, hidden = self._run(tokens, cache, start_pos, logits, layer_ids)
        assert hidden is not None  # layer_ids is not empty (checked above): _run concatenates their states
        return out, hidden


class CausalLM(DecoderStack, nn.Module):
    """Embedding, decoder layers, final norm, LM head; forward over a static KV cache."""

    def __init__(self, config: ModelConfig, layers: nn.ModuleList | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = (
            layers if layers is not None else nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _cut(self, layer_ids: list[int]) -> CausalLM:
        c = dataclasses.replace(self.config, num_layers=len(layer_ids))
        with torch.device("meta"):  # the embedding, norm and head made here are replaced by this model's
            draft = CausalLM(c, layers=nn.ModuleList(self.layers[i] for i in layer_ids))
        draft.embed_tokens, draft.norm, draft.lm_head = self.embed_tokens, self.norm, self.lm_head
        return draft

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(self.config, len(self.layers), batch, capacity, self.dtype, self.device)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [B, T] -> [B, T, 1, head_dim], from a table grown on demand."""
        self._rope_cache, cos, sin = rope_lookup(self._rope_cache, self.config, positions, self.dtype, self.device)
        return cos, sin

    def _run(self, tokens, cache, start_pos, logits: str, layer_ids: tuple[int, ...]):
        positions, mask, rows = step_coordinates(start_pos, tokens.shape[1], cache.capacity)
        cos, sin = self._rope(positions)
        x = self.embed_tokens(tokens)
        captured: dict[int, torch.Tensor] = {}
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, cache.k, cache.v)):
            if i in layer_ids:
                captured[i] = x
            x = layer(x, cos, sin, k_cache, v_cache, rows, positions, mask)
        hidden = None  # [B, T, len(layer_ids) * hidden] when layers are asked for
        if logits == "none" and len(self.layers) not in layer_ids:
            out = None
        else:
            x = self.norm(x)
            captured[len(self.layers)] = x
            out = None if logits == "none" else x if logits == "hidden" else self.lm_head(x).float()
        if layer_ids:
            hidden = torch.cat([captured[i] for i in layer_ids], dim=-1)  # [B, T, len(layer_ids) * hidden]
        return out, hidden


def step_coordinates(start_pos: torch.Tensor, T: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where T new tokens per row go in a static cache: positions [B, T], the causal mask [B, 1, T, L]
    (query t of row b sees keys 0..start_pos[b]+t) and the row index of each token [B, T]."""
    B = start_pos.shape[0]
    if int(start_pos.max()) + T > capacity:
        raise SpecdecError(
            f"sequence needs {int(start_pos.max()) + T} KV slots but the cache holds {capacity}",
            "shorten the prompt or max_new_tokens",
        )
    positions = start_pos[:, None] + torch.arange(T, device=start_pos.device)  # [B, T]
    L = int(positions.max()) + 1  # keys 0..L-1 are visible to some query
    mask = (torch.arange(L, device=start_pos.device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B,1,T,L]
    rows = torch.arange(B, device=start_pos.device)[:, None].expand(B, T)
    return positions, mask, rows


def rope_lookup(table, config: ModelConfig, positions: torch.Tensor, dtype, device):
    """(table, cos, sin): RoPE for positions [B, T] -> [B, T, 1, head_dim]; `table` is grown on demand and returned.

    angle(p, j) = p / theta^(2j / head_dim) for j < head_dim / 2, repeated for the rotate-half layout.
    """
    need = int(positions.max()) + 1
    if table is None or table[0] < need:
        size = max(need, 4096)
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
        )
        angles = torch.outer(torch.arange(size, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [size, hd]
        table = (size, angles.cos().to(device), angles.sin().to(device))
    _, cos, sin = table
    return table, cos[positions].unsqueeze(2).to(dtype), sin[positions].unsqueeze(2).to(dtype)


def init_random(model: CausalLM, seed: int = 0) -> CausalLM:
    """Random weights at the scale a trained model has (for timing and unit tests, not quality)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:
                p.zero_()
    return model
