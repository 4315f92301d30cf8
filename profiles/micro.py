"""Micro-curves that explain the hardware guidelines (autotune/plan.py lists them), measured with `time_call`.

- `attention_curve`: one verify-attention call of the target (its real head counts and head_dim)
  over a KV cache of `ctx` tokens, for T = 1+D new tokens. Its x-axis `rows_per_kv_head` = G·(1+D)
  is what an attention kernel tiles (guidelines 2 and 3: the step at multiples of the tile).
- `linear_curve`: the target's GEMMs (fused qkv, o, fused gate_up, down, lm_head) at M = B·(1+D)
  rows; the knee of time over M is where they leave the memory-bound region (guideline 1).
- `knee`: where a curve stops being flat.

Inputs are random normal (never zeros: some kernels take shortcuts on zeros), made once outside the
timed region; only the kernel call itself is timed.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from specdec_tune import SpecdecError
from specdec_tune.profiles.models.llama import ModelConfig, gqa_attention
from specdec_tune.profiles.timing import time_call

KNEE_TOLERANCE = 1.25  # a curve is "flat" while y stays within this factor of its first value
DEFAULT_MAX_M_POINTS = 24


# ---------------------------------------------------------------- attention


def _randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)


def verify_attention_inputs(
    config: ModelConfig, batch: int, ctx: int, T: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v, mask for one verify step of T new tokens on top of `ctx` cached tokens, as the model builds them.

    q: [B, H, T, hd]; k, v: [B, H_kv, ctx+T, hd]; mask: [B, 1, T, ctx+T] bool, True where query t may
    see key j, i.e. j <= ctx + t (all of the cache, and the new block causally), exactly as
    `CausalLM.forward` builds it with start_pos = ctx for every row.
    """
    if batch < 1 or ctx < 0 or T < 1:
        raise SpecdecError(f"bad attention shape batch={batch} ctx={ctx} T={T}", "need batch >= 1, ctx >= 0, T >= 1")
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    L = ctx + T
    q = _randn((batch, config.num_heads, T, config.head_dim), dtype, device, g)
    k = _randn((batch, config.num_kv_heads, L, config.head_dim), dtype, device, g)
    v = _randn((batch, config.num_kv_heads, L, config.head_dim), dtype, device, g)
    positions = ctx + torch.arange(T, device=device)[None, :].expand(batch, T)  # [B, T]
    mask = (torch.arange(L, device=device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, T, L]
    return q, k, v, mask


def verify_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's attention call: q [B, H, T, hd], k/v [B, H_kv, L, hd], bool mask [B, 1, T, L] -> [B, H, T, hd]."""
    return gqa_attention(q, k, v, mask)


def attention_curve(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    ctx_tokens: int,
    draft_lens: list[int],
    batch: int = 1,
    repeats: int = 7,
) -> list[dict]:
    """Time one verify-attention call for T = 1+D, each D in `draft_lens`; one point per D."""
    device = torch.device(device)
    G = config.group_size
    points = []
    for D in draft_lens:
        if D < 0:
            raise SpecdecError(f"draft length {D} is negative", "draft lengths are >= 0")
        T = 1 + D
        q, k, v, mask = verify_attention_inputs(config, batch, ctx_tokens, T, dtype, device)
        with torch.inference_mode():
            timing = time_call(functools.partial(verify_attention, q, k, v, mask), device=device, repeats=repeats)
        points.append(
            {
                "kind": "attention",
                "batch": batch,
                "draft_len": D,
                "tokens": T,
                "rows_per_kv_head": G * T,
                "ctx": ctx_tokens,
                **timing.as_dict(),
                "source": "measured",
            }
        )
        del q, k, v, mask
    return points


# ---------------------------------------------------------------- linear layers


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the target's GEMMs, q/k/v and gate/up fused as engines run them."""
    c = config
    return {
        "qkv": (c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim),
        "o": (c.num_heads * c.head_dim, c.hidden_size),
        "gate_up": (c.hidden_size, 2 * c.intermediate_size),
        "down": (c.intermediate_size, c.hidden_size),
        "lm_head": (c.hidden_size, c.vocab_size),
    }


def linear_curve(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, *, m_values: list[int], repeats: int = 7
) -> list[dict]:
    """Time `F.linear(x, w)` with x [M, in] for each of the target's layer shapes and each M."""
    device = torch.device(device)
    if any(m < 1 for m in m_values):
        raise SpecdecError(f"GEMM row counts {m_values} must be >= 1", "M = batch x tokens is at least 1")
    g = torch.Generator(device=device).manual_seed(0)
    points = []
    for layer, (in_features, out_features) in linear_shapes(config).items():
        w = _randn((out_features, in_features), dtype, device, g) / math.sqrt(in_features)  # [out, in]
        for m in m_values:
            x = _randn((m, in_features), dtype, device, g)  # [M, in]
            with torch.inference_mode():
                timing = time_call(functools.partial(F.linear, x, w), device=device, repeats=repeats)
            gflop = 2 * m * in_features * out_features / 1e9
            points.append(
                {
                    "kind": "linear",
                    "layer": layer,
                    "m": m,
                    "in_features": in_features,
                    "out_features": out_features,
                    "gflop": gflop,
                    **timing.as_dict(),
                    "achieved_gflops": gflop / (timing.median_ms / 1e3) if timing.median_ms > 0 else None,
                    "source": "measured",
                }
            )
        del w
    return points


def linear_forward_curve(points: list[dict], num_layers: int) -> list[dict]:
    """Per M, the linear-layer time of a whole forward: num_layers x (qkv + o + gate_up + down) + lm_head.

    The curve whose knee says where the target's GEMMs leave the memory-bound region.
    """
    per_m: dict[int, float] = {}
    for p in points:
        weight = 1 if p["layer"] == "lm_head" else num_layers
        per_m[p["m"]] = per_m.get(p["m"], 0.0) + weight * p["median_ms"]
    return [{"m": m, "median_ms": ms, "source": "measured"} for m, ms in sorted(per_m.items())]


def default_m_values(batch_buckets: list[int], max_tokens: int, max_points: int = DEFAULT_MAX_M_POINTS) -> list[int]:
    """Sorted distinct M = B·T for B in the buckets and T in 1..max_tokens, thinned geometrically.

    When there are more than `max_points` products, keep the one nearest (in log scale) to each of
    `max_points` geometrically spaced targets between the smallest and the largest; both ends stay.
    """
    if not batch_buckets or any(b < 1 for b in batch_buckets) or max_tokens < 1:
        raise SpecdecError(
            f"bad GEMM grid: batch buckets {batch_buckets}, max tokens {max_tokens}",
            "need buckets >= 1 and max_tokens >= 1",
        )
    products = sorted({b * t for b in batch_buckets for t in range(1, max_tokens + 1)})
    if len(products) <= max_points:
        return products
    lo, hi = math.log(products[0]), math.log(products[-1])
    targets = [lo + (hi - lo) * i / (max_points - 1) for i in range(max_points)]
    kept = {min(products, key=lambda m: abs(math.log(m) - t)) for t in targets}
    return sorted(kept | {products[0], products[-1]})


# ---------------------------------------------------------------- knee


def knee(points: list[dict], x_key: str, y_key: str, tolerance: float = KNEE_TOLERANCE) -> int | None:
    """Where a curve stops being flat: the largest x whose y is within `tolerance` (1.25x) of y at the smallest x.

    Used for "the verify curve's knee" (time over 1+D) and for "GEMMs leave the memory-bound region"
    (time over M). Taking the largest such x, not the end of the first flat run, lets one noisy point
    not end the flat region early. A curve that is flat throughout returns its largest x; one that
    rises from the start returns its smallest x; no points returns None. The points must form one
    curve (one point per x).
    """
    if not points:
        return None
    ordered = sorted(points, key=lambda p: p[x_key])
    xs = [p[x_key] for p in ordered]
    if len(set(xs)) != len(xs):
        raise ValueError(f"knee needs one point per {x_key}; got duplicates in {xs} (filter the curve first)")
    base = ordered[0][y_key]
    return max(p[x_key] for p in ordered if p[y_key] <= tolerance * base)
