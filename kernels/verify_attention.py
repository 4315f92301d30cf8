"""Verification attention: one decode-attention call in which every sequence checks 1+D new tokens.

In a speculative round the target runs T = 1+D query tokens per sequence (the last accepted token and
D drafts) against that sequence's KV cache, whose last T slots already hold the new tokens' keys and
values. Per sequence b, KV head h, query head g of that KV head's group, and new token t < T:

    L_b     = kv_lens[b]                                  keys 0..L_b-1, the T new ones last
    s_{t,j} = (q_{g,t} · k_j) / sqrt(hd)                   j = 0..L_b-1
    visible : j <= L_b - T + t                            the whole prefix, and the draft block causally
    o_{g,t} = Σ_j softmax_j(s_{t,·})[j] · v_j              fp32 accumulation whatever the input dtype

Grouped-query packing: the G query heads of one KV head and their T tokens are G·T rows
r = g·T + t of one block (`gqa_attention` in the model packs them the same way), so one load of a
KV tile serves all G·(1+D) rows. A program takes BLOCK_M packed rows of one (sequence, KV head); when
G·(1+D) crosses a multiple of BLOCK_M a second row block reads the same keys again: the tile step
that guideline 3 of the plan's rationale is about (autotune/plan.py).

Online softmax (log2 units, scores pre-scaled by log2(e)/sqrt(hd)), per KV tile:

    m'  = max(m, max_j s_j);   l' = l·2^(m-m') + Σ_j 2^(s_j-m');   acc' = acc·2^(m-m') + P·V

Split KV (flash-decoding): at small batch the (sequence, KV head, row block) grid is smaller than the
GPU, so the keys are cut into `num_splits` ranges, each program writes its normalised partial output
o_s and lse_s = m_s + log2(l_s) (a range with no visible key has lse = -inf), and a combine kernel merges them:

    o = Σ_s 2^(lse_s - lse*) · o_s / Σ_s 2^(lse_s - lse*),   lse* = max_s lse_s

KV caches:
- contiguous: k, v [B, H_kv, capacity, hd] (the model's `KVCache` layer tensors);
- paged: k, v [num_blocks, page_size, H_kv, hd] (vLLM's layout) and block_table [B, max_blocks] int32:
  key j of sequence b lives in page block_table[b, j // page_size], slot j % page_size.

The Triton interpreter (`TRITON_INTERPRET=1`) computes bf16 `tl.dot` wrongly, so there (and for fp32
inputs) the dots run on fp32 copies of the tiles (DOT_FP32); on a GPU fp16/bf16 tiles go to the tensor
cores and P is rounded to the input dtype before P·V, as flash attention does.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from specdec_tune import SpecdecError
from specdec_tune.kernels.buckets import kv_bucket, next_pow2, rows_bucket

KERNEL = "verify_attention"
KEY = ("rows_bucket", "head_dim", "kv_bucket")  # G·(1+D) bucket against the tile, head dim, KV-length bucket
MAX_KV_SPLITS = 32  # the combine kernel reads up to this many partials per row
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Candidate configs for timing on a GPU; `prune` drops the ones that cannot suit a key.
CONFIGS = [
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
    for m in (16, 32, 64, 128)
    for n in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3)
]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def verify_attention_kernel(
    # Pointers: q [B, H, T, hd]; k, v (contiguous or paged, see the module docstring); out [B, H, T, hd]
    Q,
    K,
    V,
    Out,
    KVLens,  # [B] int32: keys per sequence, the T new ones included
    BlockTable,  # [B, max_blocks] int32 (paged only)
    OPart,
    LsePart,  # split partials: [B, H_kv, num_splits, G·T, BLOCK_D] and [B, H_kv, num_splits, G·T] fp32
    # Strides (the last dim of every tensor is contiguous)
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kn,  # contiguous: (sequence, KV head, position); paged: (page, KV head, slot)
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_bt,  # block table row stride
    # Sizes
    num_kv_heads,
    group,
    num_tokens,
    num_splits,  # H_kv, G, T = 1+D, key ranges per sequence
    qk_scale,  # log2(e) / sqrt(hd)
    # Meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_bh = tl.program_id(0)  # sequence b, KV head h
    pid_m = tl.program_id(1)  # block of packed query rows
    pid_s = tl.program_id(2)  # key range
    b = pid_bh // num_kv_heads
    h = pid_bh % num_kv_heads
    kv_len = tl.load(KVLens + b)
    num_rows = group * num_tokens
    b64 = b.to(tl.int64)  # sequence and page offsets in int64: a long cache's batch stride times B overflows int32

    # ---- the BLOCK_M packed rows r = g·T + t of this program, and the last key each may see
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < num_rows
    g = offs_m // num_tokens
    t = offs_m % num_tokens
    head = h * group + g  # query head
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + b64 * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    last_key = kv_len - num_tokens + t  # [BLOCK_M]

    # ---- this program's key range: range s of num_splits, in whole BLOCK_N tiles
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * per_split
    end = tl.minimum(start + per_split, kv_len)

    # ---- online softmax over the key tiles
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if PAGED:
            page = tl.load(BlockTable + b64 * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            k_rows = page * stride_kb + (offs_n % PAGE_SIZE) * stride_kn
            v_rows = page * stride_vb + (offs_n % PAGE_SIZE) * stride_vn
        else:
            k_rows = b64 * stride_kb + offs_n * stride_kn
            v_rows = b64 * stride_vb + offs_n * stride_vn
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + h * stride_kh + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0
        )  # [BLOCK_N, BLOCK_D]
        v = tl.load(V + h * stride_vh + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = (offs_n[None, :] <= last_key[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # ---- epilogue: the output rows, or this range's partial and its log-sum-exp
    if SPLIT_KV:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = (pid_bh * num_splits + pid_s) * num_rows + offs_m  # row of [B, H_kv, num_splits, G·T]
        tl.store(LsePart + part, lse, mask=row_ok)
        tl.store(OPart + part[:, None] * BLOCK_D + offs_d[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
    else:
        o = acc / l_i[:, None]
        tl.store(
            Out + b64 * stride_ob + head[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :],
            o.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def verify_attention_combine_kernel(
    OPart,
    LsePart,
    Out,  # partials as above; out [B, H, T, hd]
    stride_ob,
    stride_oh,
    stride_ot,
    num_kv_heads,
    group,
    num_tokens,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)  # one packed row of one (sequence, KV head)
    num_rows = group * num_tokens
    r = pid % num_rows
    bh = pid // num_rows
    b = bh // num_kv_heads
    h = bh % num_kv_heads

    # ---- weights 2^(lse_s - lse*) of the key ranges (an empty range weighs 0)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    part = (bh * num_splits + offs_s) * num_rows + r  # [BLOCK_S]
    lse = tl.load(LsePart + part, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S]

    # ---- the weighted mean of the partial outputs
    offs_d = tl.arange(0, BLOCK_D)
    o = tl.load(OPart + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    g = r // num_tokens
    t = r % num_tokens
    tl.store(
        Out + b.to(tl.int64) * stride_ob + (h * group + g) * stride_oh + t * stride_ot + offs_d,
        out.to(Out.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# -------------------------------------------------------------------------------- torch reference


def verify_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The same attention in fp32 torch, one sequence at a time; returns [B, H, T, hd] in out_dtype (default q's).

    q: [B, H, T, hd]; contiguous k, v: [B, H_kv, capacity, hd]; paged k, v: [num_blocks, page_size, H_kv, hd]
    with block_table [B, max_blocks]. Keys are gathered into [H_kv, L_b, hd] per sequence, then the
    query rows of each KV head attend with the causal-in-block mask j <= L_b - T + t.
    """
    B, H, T, hd = q.shape
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    for b in range(B):
        L = int(kv_lens[b])
        if block_table is None:
            kb, vb = k[b, :, :L], v[b, :, :L]  # [H_kv, L, hd]
        else:
            pages = block_table[b, : -(-L // k.shape[1])].long()
            kb = k[pages].flatten(0, 1)[:L].transpose(0, 1)  # [num_pages·page_size, H_kv, hd] -> [H_kv, L, hd]
            vb = v[pages].flatten(0, 1)[:L].transpose(0, 1)
        H_kv = kb.shape[0]
        G = H // H_kv
        rows = q[b].float().reshape(H_kv, G * T, hd)  # packed rows r = g·T + t
        scores = rows @ kb.float().transpose(1, 2) / math.sqrt(hd)  # [H_kv, G·T, L]
        t = torch.arange(T, device=q.device).repeat(G)  # [G·T]
        visible = torch.arange(L, device=q.device)[None, :] <= (L - T + t)[:, None]  # [G·T, L]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[b] = (probs @ vb.float()).reshape(H, T, hd).to(out.dtype)
    return out


# -------------------------------------------------------------------------------- tile rules


def key_for(group: int, num_tokens: int, head_dim: int, kv_len: int, tile_rows: int = 128) -> dict:
    """The tuning key of one call shape: G·T rows bucketed against the tile, head dim, KV length bucket."""
    return {
        "rows_bucket": rows_bucket(group * num_tokens, tile_rows),
        "head_dim": head_dim,
        "kv_bucket": kv_bucket(kv_len),
    }


def tile_rule(key: dict) -> dict:
    """The config chosen without timing it.

    BLOCK_M: the smallest tile (16 at least, for tl.dot) holding all G·(1+D) rows of a KV head, capped
    at 128 rows (one tensor-core tile; beyond it the rows take ceil(G·(1+D)/128) blocks).
    BLOCK_N: 64 keys; 128 when the score tile BLOCK_M x 128 and the K/V tiles still fit comfortably
    (head dim <= 64) and the cache is long enough to use them; 32 for caches under 64 keys.
    Warps: 4, 8 for 128-row tiles. Stages: 3 for head dims up to 64, else 2 (shared memory).
    """
    rows, hd, kv = key["rows_bucket"], key["head_dim"], key["kv_bucket"]
    block_m = min(max(16, next_pow2(rows)), 128)
    if kv < 64:
        block_n = 32
    elif hd <= 64 and block_m <= 64 and kv >= 1024:
        block_n = 128
    else:
        block_n = 64
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "num_warps": 8 if block_m == 128 else 4,
        "num_stages": 3 if hd <= 64 else 2,
    }


def prune(configs: list[dict], key: dict) -> list[dict]:
    """Candidates worth timing for this key: row tiles near the rows' own size, tiles that fit shared memory."""
    rows, hd = key["rows_bucket"], key["head_dim"]
    want_m = min(max(16, next_pow2(rows)), 128)
    block_d = max(16, next_pow2(hd))
    kept = []
    for c in configs:
        if c["BLOCK_M"] not in (want_m, max(16, want_m // 2), min(128, want_m * 2)):
            continue
        smem_bytes = c["num_stages"] * 2 * c["BLOCK_N"] * block_d * 2 + c["BLOCK_M"] * block_d * 2
        if smem_bytes > 160 * 1024 or c["BLOCK_M"] * c["BLOCK_N"] > 128 * 128:
            continue
        if c["BLOCK_N"] > max(32, key["kv_bucket"]):
            continue
        kept.append(c)
    return kept or [tile_rule(key)]


def num_splits_for(programs: int, kv_capacity: int, block_n: int, num_sms: int) -> int:
    """Key ranges per sequence so that the grid fills the GPU about twice (flash-decoding's heuristic):
    ceil(2·SMs / programs), at most MAX_KV_SPLITS and at least two key tiles per range."""
    if num_sms <= 0:
        return 1
    want = -(-2 * num_sms // max(programs, 1))
    return max(1, min(want, MAX_KV_SPLITS, kv_capacity // (2 * block_n)))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


# ---------------------------------------------------------------------------------------- wrapper


def _check(q, k, v, kv_lens, block_table) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise SpecdecError(
            f"verify attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}",
            "q is [B, H, T, hd]; k, v are [B, H_kv, capacity, hd] or paged [num_blocks, page_size, H_kv, hd]",
        )
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise SpecdecError(
            f"verify attention dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}",
            "use one of fp16, bf16, fp32 for all three",
        )
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise SpecdecError("verify attention needs the head dim contiguous in q, k and v", "pass .contiguous() tensors")
    H_kv = k.shape[2] if block_table is not None else k.shape[1]
    if k.shape[-1] != q.shape[-1] or q.shape[1] % H_kv:
        raise SpecdecError(
            f"{q.shape[1]} query heads over {H_kv} KV heads, head dims {q.shape[-1]}/{k.shape[-1]}",
            "query heads must be a multiple of KV heads, with one head dim",
        )
    if kv_lens.shape != (q.shape[0],) or kv_lens.dtype != torch.int32:
        raise SpecdecError(f"kv_lens is {tuple(kv_lens.shape)} {kv_lens.dtype}", "pass kv_lens as [B] int32")
    if block_table is not None and (
        block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or block_table.dtype != torch.int32
    ):
        raise SpecdecError(
            f"block_table is {tuple(block_table.shape)} {block_table.dtype}",
            "pass block_table as [B, max_blocks] int32",
        )


def verify_attention(
    q: torch.Tensor,  # [B, H, T, hd]
    k: torch.Tensor,  # [B, H_kv, capacity, hd], or paged [num_blocks, page_size, H_kv, hd]
    v: torch.Tensor,  # like k
    kv_lens: torch.Tensor,  # [B] int32, >= T: keys per sequence with the T new ones (already written) last
    *,
    block_table: torch.Tensor | None = None,  # [B, max_blocks] int32 for a paged cache
    config: dict | None = None,  # BLOCK_M, BLOCK_N, num_warps, num_stages; default: the tile rule for this shape
    num_splits: int | None = None,  # key ranges per sequence; default: fill the GPU (1 off a GPU)
    tile_rows: int = 128,
    out: torch.Tensor | None = None,  # [B, H, T, hd] to write into
    launcher=None,  # a kernels.aot.Launcher holding shipped cubins; None = JIT
) -> torch.Tensor:
    """Attention of T = 1+D new query tokens per sequence over its KV cache, causal within the new block."""
    _check(q, k, v, kv_lens, block_table)
    B, H, T, hd = q.shape
    paged = block_table is not None
    H_kv = k.shape[2] if paged else k.shape[1]
    G = H // H_kv
    capacity = block_table.shape[1] * k.shape[1] if block_table is not None else k.shape[2]
    config = config or tile_rule(key_for(G, T, hd, capacity, tile_rows))
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    m_blocks = triton.cdiv(G * T, block_m)
    if num_splits is None:
        num_splits = num_splits_for(B * H_kv * m_blocks, capacity, block_n, _num_sms(q.device))
    if not 1 <= num_splits <= MAX_KV_SPLITS:
        raise SpecdecError(f"num_splits {num_splits} is out of range", f"use 1..{MAX_KV_SPLITS}")
    out = torch.empty_like(q) if out is None else out
    block_d = max(16, next_pow2(hd))
    split = num_splits > 1
    # partials only when the keys are split; otherwise a one-element fp32 stand-in keeps the argument types fixed
    o_part = torch.empty((B, H_kv, num_splits, G * T, block_d) if split else (1,), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((B, H_kv, num_splits, G * T) if split else (1,), device=q.device, dtype=torch.float32)
    table = block_table if block_table is not None else kv_lens  # any int32 pointer: never read when not paged
    # paged k is [num_blocks, page_size, H_kv, hd]: (page, KV head, slot) strides are (0, 2, 1)
    k_strides = (k.stride(0), k.stride(2), k.stride(1)) if paged else (k.stride(0), k.stride(1), k.stride(2))
    v_strides = (v.stride(0), v.stride(2), v.stride(1)) if paged else (v.stride(0), v.stride(1), v.stride(2))
    args = (
        q,
        k,
        v,
        out,
        kv_lens,
        table,
        o_part,
        lse_part,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        *k_strides,
        *v_strides,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        table.stride(0),
        H_kv,
        G,
        T,
        num_splits,
        1.4426950408889634 / math.sqrt(hd),
    )
    constexprs = {
        "HEAD_DIM": hd,
        "BLOCK_D": block_d,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "PAGE_SIZE": k.shape[1] if paged else 1,
        "PAGED": paged,
        "SPLIT_KV": split,
        "DOT_FP32": q.dtype == torch.float32 or interpreting(),
    }
    _launch(launcher, verify_attention_kernel, (B * H_kv, m_blocks, num_splits), args, constexprs, config)
    if split:
        combine_args = (o_part, lse_part, out, out.stride(0), out.stride(1), out.stride(2), H_kv, G, T, num_splits)
        _launch(
            launcher,
            verify_attention_combine_kernel,
            (B * H_kv * G * T, 1, 1),
            combine_args,
            {"HEAD_DIM": hd, "BLOCK_D": block_d, "BLOCK_S": MAX_KV_SPLITS},
            {"num_warps": 4, "num_stages": 1},
        )
    return out


def _launch(launcher, kernel, grid, args, constexprs, config) -> None:
    """Run a shipped cubin when the launcher has one for this specialisation, else the JIT kernel."""
    if launcher is not None and launcher.launch(kernel, grid, args, constexprs, config):
        return
    kernel[grid](*args, **constexprs, num_warps=config["num_warps"], num_stages=config["num_stages"])


def signature(kernel, dtype: torch.dtype) -> dict[str, str]:
    """Triton types of the runtime arguments, for compiling ahead of time (kernels.aot)."""
    elem = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    if kernel is verify_attention_kernel:
        ptrs = {
            "Q": elem,
            "K": elem,
            "V": elem,
            "Out": elem,
            "KVLens": "*i32",
            "BlockTable": "*i32",
            "OPart": "*fp32",
            "LsePart": "*fp32",
        }
        ints = [
            "stride_qb",
            "stride_qh",
            "stride_qt",
            "stride_kb",
            "stride_kh",
            "stride_kn",
            "stride_vb",
            "stride_vh",
            "stride_vn",
            "stride_ob",
            "stride_oh",
            "stride_ot",
            "stride_bt",
            "num_kv_heads",
            "group",
            "num_tokens",
            "num_splits",
        ]
        return {**ptrs, **dict.fromkeys(ints, "i32"), "qk_scale": "fp32"}
    ints = ["stride_ob", "stride_oh", "stride_ot", "num_kv_heads", "group", "num_tokens", "num_splits"]
    return {"OPart": "*fp32", "LsePart": "*fp32", "Out": elem, **dict.fromkeys(ints, "i32")}


# -------------------------------------------------------------------------------------- benchmark


def make_inputs(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
    kv_len: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    page_size: int = 0,
    seed: int = 0,
):
    """Random q, k, v, kv_lens (all sequences at kv_len) and block table (page_size > 0: a paged cache, pages
    shuffled)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn((batch, num_heads, num_tokens, head_dim), generator=g).to(device=device, dtype=dtype)
    kv_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    if page_size:
        pages_per_seq = -(-kv_len // page_size)
        perm = torch.randperm(batch * pages_per_seq, generator=g)
        block_table = perm.view(batch, pages_per_seq).to(device=device, dtype=torch.int32)
        shape = (batch * pages_per_seq, page_size, num_kv_heads, head_dim)
    else:
        block_table = None
        shape = (batch, num_kv_heads, kv_len, head_dim)
    k = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return q, k, v, kv_lens, block_table


def bench(
    config: dict,
    *,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
    kv_len: int,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 0,
    launcher=None,
) -> float:
    """Median ms of one call with this config on the current CUDA device (triton.testing.do_bench)."""
    q, k, v, kv_lens, table = make_inputs(
        batch, num_heads, num_kv_heads, head_dim, num_tokens, kv_len, dtype=dtype, device="cuda", page_size=page_size
    )
    out = torch.empty_like(q)
    return triton.testing.do_bench(
        lambda: verify_attention(q, k, v, kv_lens, block_table=table, config=config, out=out, launcher=launcher),
        return_mode="median",
    )
