"""Acceptance: from the target's logits over [last token, d_1..d_K], how many drafts each sequence keeps
and which token it emits next. One program per sequence; the same rules as the reference loop
(`profiles.specdec.verify_greedy` and `verify_sampled`).

Greedy (temperature 0), per sequence with L = draft_lens[b] <= K drafts:

    a_i = argmax_v logits[i, v]            (the first index on ties, as torch.argmax)
    n   = the first i < L with d_{i+1} != a_i, else L        (accepted drafts)
    next token = a_n

The kernel walks i = 0, 1, .. and stops at the first mismatch, so it reads n+1 logit rows, not 1+K.
The row argmax runs lane-wise over BLOCK_V-wide chunks (each lane keeps its first maximum, strict >),
then takes the largest value and, among lanes holding it, the smallest index: the global first maximum.

Rejection sampling (temperature T > 0; Leviathan et al. 2023, Chen et al. 2023), with
p_i = softmax(logits[i] / T) and q_i the draft distribution (one-hot at d_{i+1} when the drafts are
deterministic):

    accept d_{i+1} while u_i < min(1, p_i(d_{i+1}) / q_i(d_{i+1})) and i < L      (u_i ~ U[0,1), given)
    rejected at n < L: next ~ norm(max(p_n - q_n, 0))   (p_n itself when that residual has no mass)
    all L accepted:    next ~ p_L

The next token is drawn by inverse CDF with one more uniform u: the first v whose running sum of the
weights w exceeds u·Σw. Given the same uniforms the kernel and `rejection_sample_ref` agree token for
token; with fresh uniforms the output is distributed as `verify_sampled`'s (tests/test_kernels.py).
Softmax statistics use a lane-wise online max/sum: m' = max(m, x), s' = s·e^(m-m') + e^(x-m').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_tune import SpecdecError
from specdec_tune.kernels.buckets import next_pow2, vocab_bucket
from specdec_tune.kernels.greedy import verify_greedy
from specdec_tune.kernels.sampling import inverse_cdf

KERNELS = ("greedy_accept", "rejection_sample")
KEY = ("vocab_bucket",)
CONFIGS = [{"BLOCK_V": v, "num_warps": w, "num_stages": 1} for v in (512, 1024, 2048, 4096, 8192) for w in (4, 8, 16)]


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_argmax(row, vocab_size, BLOCK_V: tl.constexpr):
    """First index of the largest value of row[0:vocab_size]."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        x = tl.load(row + v0 + offs, mask=v0 + offs < vocab_size, other=float("-inf")).to(tl.float32)
        better = x > best  # strict: a lane keeps its earliest maximum
        best = tl.where(better, x, best)
        best_idx = tl.where(better, v0 + offs, best_idx)
    top = tl.max(best, 0)
    return tl.min(tl.where(best == top, best_idx, vocab_size), 0)


@triton.jit
def greedy_accept_kernel(
    # Pointers: logits [B, 1+K, V]; drafts [B, K]; draft_lens, num_accepted, next_token [B]
    Logits,
    Drafts,
    DraftLens,
    NumAccepted,
    NextToken,
    # Strides (the vocab dim is contiguous)
    stride_lb,
    stride_lk,
    stride_db,
    # Sizes
    vocab_size,
    max_draft_len,
    # Meta-parameters
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    draft_len = tl.minimum(tl.load(DraftLens + b), max_draft_len)
    row = Logits + b * stride_lb

    # ---- walk the drafts while each equals the target's argmax one position earlier
    n = 0
    best = _row_argmax(row, vocab_size, BLOCK_V)
    draft = tl.load(Drafts + b * stride_db, mask=draft_len > 0, other=-1)
    while (n < draft_len) & (draft == best):
        n += 1
        best = _row_argmax(row + n * stride_lk, vocab_size, BLOCK_V)
        draft = tl.load(Drafts + b * stride_db + n, mask=n < draft_len, other=-1)
    tl.store(NumAccepted + b, n.to(tl.int64))  # type: ignore[attr-defined]  # the jit carries n as a tl tensor
    tl.store(NextToken + b, best.to(tl.int64))


@triton.jit
def _p_q_tile(row, q_row, v0, offs, vocab_size, temperature, m, s, q_end, d_rej, HAS_DRAFT_PROBS: tl.constexpr):
    """One vocabulary tile of the target's p (softmax at `temperature`, stats m, s) and the draft's q, read only
    below q_end (q_end = 0: q is zero; without draft probs q is one-hot at d_rej)."""
    ok = v0 + offs < vocab_size
    p = tl.exp(tl.load(row + v0 + offs, mask=ok, other=float("-inf")).to(tl.float32) / temperature - m) / s
    if HAS_DRAFT_PROBS:
        q = tl.load(q_row + v0 + offs, mask=v0 + offs < q_end, other=0.0)
    else:
        q = tl.where((v0 + offs == d_rej) & (v0 + offs < q_end), 1.0, 0.0)
    return p, q


@triton.jit
def _softmax_stats(row, vocab_size, temperature, BLOCK_V: tl.constexpr):
    """max m and Σ e^(x-m) of x = row[0:vocab_size] / temperature."""
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab_size, BLOCK_V):
        x = tl.load(row + v0 + offs, mask=v0 + offs < vocab_size, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    top = tl.max(m, 0)
    return top, tl.sum(s * tl.exp(m - top), 0)


@triton.jit
def rejection_sample_kernel(
    # Pointers: logits [B, 1+K, V]; drafts [B, K]; draft_lens [B]; draft_probs [B, K, V] fp32 (HAS_DRAFT_PROBS);
    # uniforms u_accept [B, K], u_sample [B] fp32; outputs num_accepted, next_token [B]
    Logits,
    Drafts,
    DraftLens,
    DraftProbs,
    UAccept,
    USample,
    NumAccepted,
    NextToken,
    # Strides (the vocab dim is contiguous)
    stride_lb,
    stride_lk,
    stride_db,
    stride_qb,
    stride_qk,
    stride_ub,
    # Sizes
    vocab_size,
    max_draft_len,
    temperature,
    # Meta-parameters
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    draft_len = tl.minimum(tl.load(DraftLens + b), max_draft_len)
    row0 = Logits + b * stride_lb

    # ---- accept d_{n+1} with probability min(1, p_n(d) / q_n(d)) while the drafts last
    n = 0
    keep = draft_len > 0
    while keep:
        row = row0 + n * stride_lk
        m, s = _softmax_stats(row, vocab_size, temperature, BLOCK_V)
        d = tl.load(Drafts + b * stride_db + n)
        p_d = tl.exp(tl.load(row + d).to(tl.float32) / temperature - m) / s
        if HAS_DRAFT_PROBS:
            q_d = tl.load(DraftProbs + b * stride_qb + n * stride_qk + d)
        else:
            q_d = 1.0
        u = tl.load(UAccept + b * stride_ub + n)
        accepted = u < tl.minimum(p_d / tl.maximum(q_d, 1e-30), 1.0)
        n += accepted.to(tl.int32)
        keep = accepted & (n < draft_len)

    # ---- the emitted token's weights: residual max(p_n - q_n, 0) after a rejection, else p_n
    row = row0 + n * stride_lk
    m, s = _softmax_stats(row, vocab_size, temperature, BLOCK_V)
    rejected = n < draft_len
    d_rej = tl.load(Drafts + b * stride_db + n, mask=rejected, other=-1)  # one-hot q when there are no draft probs
    offs = tl.arange(0, BLOCK_V)
    q_end = tl.where(rejected, vocab_size, 0)  # q is read only after a rejection (a bound, not `ok & rejected`:
    # the interpreter mishandles masks that broadcast a scalar condition)
    residual_mass = tl.zeros([BLOCK_V], tl.float32)
    p_mass = tl.zeros([BLOCK_V], tl.float32)
    q_row = DraftProbs + b * stride_qb + n * stride_qk
    for v0 in range(0, vocab_size, BLOCK_V):
        p, q = _p_q_tile(row, q_row, v0, offs, vocab_size, temperature, m, s, q_end, d_rej, HAS_DRAFT_PROBS)
        residual_mass += tl.maximum(p - q, 0.0)
        p_mass += p
    use_residual = rejected & (tl.sum(residual_mass, 0) > 0.0)
    q_end = tl.where(use_residual, vocab_size, 0)
    target = tl.load(USample + b) * tl.where(use_residual, tl.sum(residual_mass, 0), tl.sum(p_mass, 0))

    # ---- inverse CDF: the first v whose running weight sum exceeds u·Σw (the last weighted v if rounding leaves none)
    prefix = 0.0
    first = vocab_size
    last_weighted = 0
    for v0 in range(0, vocab_size, BLOCK_V):
        ok = v0 + offs < vocab_size
        p, q = _p_q_tile(row, q_row, v0, offs, vocab_size, temperature, m, s, q_end, d_rej, HAS_DRAFT_PROBS)
        w = tl.where(use_residual, tl.maximum(p - q, 0.0), p)
        w = tl.where(ok, w, 0.0)
        running = prefix + tl.cumsum(w, 0)
        first = tl.minimum(first, tl.min(tl.where(running > target, v0 + offs, vocab_size), 0))
        last_weighted = tl.maximum(last_weighted, tl.max(tl.where(w > 0.0, v0 + offs, 0), 0))
        prefix += tl.sum(w, 0)
    tl.store(NumAccepted + b, n.to(tl.int64))  # type: ignore[attr-defined]  # the jit carries n as a tl tensor
    tl.store(NextToken + b, tl.where(first < vocab_size, first, last_weighted).to(tl.int64))


# ------------------------------------------------------------------------------ torch references


def greedy_accept_ref(
    logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference loop's own greedy rule (kernels.greedy.verify_greedy, which profiles.specdec applies)."""
    return verify_greedy(logits, drafts, draft_lens)


def rejection_sample_ref(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_sampled` with its randomness made explicit: the accept tests use u_accept [B, K] (as it does) and
    the emitted token is the inverse CDF of u_sample [B] (`verify_sampled` draws its u with the generator)."""
    B, K = drafts.shape
    p = torch.softmax(logits.float() / temperature, dim=-1)  # [B, 1+K, V]
    rows = torch.arange(B, device=logits.device)
    lens = draft_lens.clamp(max=K)
    if K:
        p_x = p[:, :K].gather(2, drafts[:, :, None]).squeeze(2)  # [B, K]
        q_x = draft_probs.gather(2, drafts[:, :, None]).squeeze(2) if draft_probs is not None else torch.ones_like(p_x)
        offered = torch.arange(K, device=logits.device)[None, :] < lens[:, None]
        keep = (u_accept < torch.clamp(p_x / q_x.clamp_min(1e-30), max=1.0)) & offered
        num_accepted = keep.long().cumprod(dim=1).sum(dim=1)  # [B]
    else:
        num_accepted = torch.zeros(B, dtype=torch.long, device=logits.device)
    p_n = p[rows, num_accepted]  # [B, V]
    rejected = num_accepted < lens
    idx = num_accepted.clamp(max=max(K - 1, 0))
    q = torch.zeros_like(p_n)  # [B, V]: the rejected draft's distribution (unused where nothing was rejected)
    if K and draft_probs is not None:
        q = draft_probs[rows, idx].float()
    elif K:
        q.scatter_(1, drafts[rows, idx][:, None], 1.0)
    residual = (p_n - q).clamp_min(0.0)
    use_residual = rejected & (residual.sum(-1) > 0)
    w = torch.where(use_residual[:, None], residual, p_n)  # [B, V]
    return num_accepted, inverse_cdf(w, u_sample)


# -------------------------------------------------------------------------------- tile rules


def tile_rule(key: dict) -> dict:
    """The config chosen without timing it: the whole vocabulary in chunks of at most 4096 lanes; 8 warps
    for chunks of 2048 and more (16 lanes per thread), else 4."""
    block_v = min(4096, max(16, next_pow2(key["vocab_bucket"])))
    return {"BLOCK_V": block_v, "num_warps": 8 if block_v >= 2048 else 4, "num_stages": 1}


def prune(configs: list[dict], key: dict) -> list[dict]:
    """Chunks no wider than the vocabulary, and at least 32 lanes per warp."""
    vocab = key["vocab_bucket"]
    kept = [c for c in configs if c["BLOCK_V"] <= max(512, vocab) and c["BLOCK_V"] >= 32 * c["num_warps"]]
    return kept or [tile_rule(key)]


def key_for(vocab_size: int) -> dict:
    return {"vocab_bucket": vocab_bucket(vocab_size)}


# --------------------------------------------------------------------------------------- wrappers


def _check(logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor) -> None:
    if (
        logits.dim() != 3
        or drafts.dim() != 2
        or logits.shape[0] != drafts.shape[0]
        or logits.shape[1] != drafts.shape[1] + 1
    ):
        raise SpecdecError(
            f"acceptance shapes logits {tuple(logits.shape)}, drafts {tuple(drafts.shape)}",
            "logits are [B, 1+K, V] and drafts [B, K]",
        )
    if draft_lens.shape != (drafts.shape[0],):
        raise SpecdecError(
            f"draft_lens is {tuple(draft_lens.shape)}", f"pass one length per sequence: [{drafts.shape[0]}]"
        )
    if logits.stride(-1) != 1:
        raise SpecdecError("acceptance needs the vocab dim of the logits contiguous", "pass .contiguous() logits")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise SpecdecError(f"logits dtype {logits.dtype}", "use fp32, fp16 or bf16 logits")


def _outputs(B: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(B, dtype=torch.long, device=device), torch.empty(B, dtype=torch.long, device=device)


def _drafts_arg(drafts: torch.Tensor) -> torch.Tensor:
    """int64 drafts; a [B, 0] tensor is replaced by one never-read column (no zero-size pointer)."""
    drafts = drafts.long()
    return drafts if drafts.shape[1] else torch.full((drafts.shape[0], 1), -1, dtype=torch.long, device=drafts.device)


def greedy_accept(
    logits: torch.Tensor,  # [B, 1+K, V]
    drafts: torch.Tensor,  # [B, K]; entries past draft_lens are ignored
    draft_lens: torch.Tensor,  # [B]
    *,
    config: dict | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([B], [B]) int64 to write into
    launcher=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted drafts [B] (0..draft_lens) and the next token [B], both int64: exactly `verify_greedy`."""
    _check(logits, drafts, draft_lens)
    B, _, V = logits.shape
    config = config or tile_rule(key_for(V))
    num_accepted, next_token = out if out is not None else _outputs(B, logits.device)
    d = _drafts_arg(drafts)
    args = (
        logits,
        d,
        draft_lens.long(),
        num_accepted,
        next_token,
        logits.stride(0),
        logits.stride(1),
        d.stride(0),
        V,
        drafts.shape[1],
    )
    _launch(launcher, greedy_accept_kernel, (B, 1, 1), args, {"BLOCK_V": config["BLOCK_V"]}, config)
    return num_accepted, next_token


def rejection_sample(
    logits: torch.Tensor,  # [B, 1+K, V]
    drafts: torch.Tensor,  # [B, K]
    draft_lens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, K, V] the drafts' distributions, None for deterministic drafts
    temperature: float,
    generator: torch.Generator | None = None,
    *,
    uniforms: tuple[torch.Tensor, torch.Tensor] | None = None,  # (u_accept [B, K], u_sample [B]); default: drawn here
    config: dict | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([B], [B]) int64 to write into
    launcher=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted drafts [B] and the next token [B]: distributed as `verify_sampled`, equal to `rejection_sample_ref`
    for the same uniforms."""
    _check(logits, drafts, draft_lens)
    if temperature <= 0:
        raise SpecdecError(f"rejection sampling at temperature {temperature}", "use greedy_accept for temperature 0")
    B, K1, V = logits.shape
    K = K1 - 1
    if draft_probs is not None and (draft_probs.shape != (B, K, V) or draft_probs.stride(-1) != 1):
        raise SpecdecError(
            f"draft_probs is {tuple(draft_probs.shape)}", f"pass contiguous [B, K, V] = [{B}, {K}, {V}] probabilities"
        )
    if uniforms is None:
        u_accept = torch.rand((B, K), generator=generator, device=logits.device)
        u_sample = torch.rand((B,), generator=generator, device=logits.device)
    else:
        u_accept, u_sample = uniforms
    config = config or tile_rule(key_for(V))
    num_accepted, next_token = out if out is not None else _outputs(B, logits.device)
    d = _drafts_arg(drafts)
    u_a = u_accept.float().contiguous() if K else torch.ones((B, 1), device=logits.device)
    probs = draft_probs.float() if draft_probs is not None and K else torch.zeros((1, 1, 1), device=logits.device)
    args = (
        logits,
        d,
        draft_lens.long(),
        probs,
        u_a,
        u_sample.float().contiguous(),
        num_accepted,
        next_token,
        logits.stride(0),
        logits.stride(1),
        d.stride(0),
        probs.stride(0),
        probs.stride(1),
        u_a.stride(0),
        V,
        K,
        float(temperature),
    )
    constexprs = {"HAS_DRAFT_PROBS": draft_probs is not None and K > 0, "BLOCK_V": config["BLOCK_V"]}
    _launch(launcher, rejection_sample_kernel, (B, 1, 1), args, constexprs, config)
    return num_accepted, next_token


def _launch(launcher, kernel, grid, args, constexprs, config) -> None:
    if launcher is not None and launcher.launch(kernel, grid, args, constexprs, config):
        return
    kernel[grid](*args, **constexprs, num_warps=config["num_warps"], num_stages=config["num_stages"])


def signature(kernel, dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Triton types of the runtime arguments, for compiling ahead of time (kernels.aot); dtype is the logits'."""
    elem = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    if kernel is greedy_accept_kernel:
        return {
            "Logits": elem,
            "Drafts": "*i64",
            "DraftLens": "*i64",
            "NumAccepted": "*i64",
            "NextToken": "*i64",
            "stride_lb": "i32",
            "stride_lk": "i32",
            "stride_db": "i32",
            "vocab_size": "i32",
            "max_draft_len": "i32",
        }
    return {
        "Logits": elem,
        "Drafts": "*i64",
        "DraftLens": "*i64",
        "DraftProbs": "*fp32",
        "UAccept": "*fp32",
        "USample": "*fp32",
        "NumAccepted": "*i64",
        "NextToken": "*i64",
        **dict.fromkeys(
            [
                "stride_lb",
                "stride_lk",
                "stride_db",
                "stride_qb",
                "stride_qk",
                "stride_ub",
                "vocab_size",
                "max_draft_len",
            ],
            "i32",
        ),
        "temperature": "fp32",
    }


# -------------------------------------------------------------------------------------- benchmark


def bench(
    config: dict,
    *,
    kernel: str = "greedy_accept",
    batch: int,
    draft_len: int,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    launcher=None,
) -> float:
    """Median ms of one call on the current CUDA device, every draft accepted (the longest walk)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn((batch, draft_len + 1, vocab_size), generator=g).to("cuda", dtype)
    drafts = logits[:, :draft_len].argmax(-1)  # greedy: all accepted
    lens = torch.full((batch,), draft_len, dtype=torch.long, device="cuda")
    if kernel == "greedy_accept":
        return triton.testing.do_bench(
            lambda: greedy_accept(logits, drafts, lens, config=config, launcher=launcher), return_mode="median"
        )
    u = (
        torch.zeros((batch, draft_len), device="cuda"),
        torch.rand((batch,), device="cuda"),
    )  # u = 0 accepts every draft
    return triton.testing.do_bench(
        lambda: rejection_sample(logits, drafts, lens, None, 1.0, uniforms=u, config=config, launcher=launcher),
        return_mode="median",
    )
