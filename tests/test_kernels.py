"""The Triton kernels against their torch references under the interpreter (TRITON_INTERPRET=1), the kernel
table, and the ahead-of-time cubins with their manifest and loader. Outputs are poisoned before every run.

Verification attention covers G in 1, 3, 4, 8 x D in 0, 1, 3, 7, 15, contiguous and paged caches, ragged KV
lengths, fp32 / fp16 / bf16; acceptance is checked against the reference loop itself (`verify_greedy`
exactly, `verify_sampled` in distribution).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors run in the interpreter
triton = pytest.importorskip("triton")
if (
    type(triton.language.standard.cdiv).__name__ != "InterpretedFunction"
):  # triton's own jit functions were made for a GPU
    pytest.fail(
        "triton was imported before TRITON_INTERPRET=1 was set (an earlier module imported torch._dynamo or triton): "
        "set TRITON_INTERPRET=1 in conftest.py, or run this file alone",
        pytrace=False,
    )

from scipy.stats import chisquare  # noqa: E402

from specdec_tune import SpecdecError  # noqa: E402
from specdec_tune.kernels import acceptance, aot, sampling, tuning  # noqa: E402
from specdec_tune.kernels import verify_attention as va  # noqa: E402
from specdec_tune.profiles.models.llama import gqa_attention  # noqa: E402
from specdec_tune.profiles.specdec import verify_greedy, verify_sampled  # noqa: E402

# a kernel module imported earlier in this process without the interpreter holds GPU-compiled kernels: decorate again
importlib.reload(va)
importlib.reload(acceptance)

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIM = 16
NUM_KV_HEADS = 2
PAGE_SIZE = 8
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2**-10},
    torch.bfloat16: {"atol": 8e-3, "rtol": 2**-7},
}  # a half-ulp of the output dtype over the fp32 reference
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GRID = [(G, D) for G in (1, 3, 4, 8) for D in (0, 1, 3, 7, 15)]


def attention_case(G: int, D: int, dtype: torch.dtype, paged: bool, seed: int, prefixes=(0, 5, 22)):
    """q, k, v, kv_lens, block_table for len(prefixes) sequences with ragged KV lengths prefix + 1 + D; the cache's
    unused slots and pages hold garbage (large values) that a wrong mask or index would pick up."""
    g = torch.Generator().manual_seed(seed)
    B, T, H = len(prefixes), 1 + D, G * NUM_KV_HEADS
    lens = torch.tensor([p + T for p in prefixes], dtype=torch.int32)
    capacity = int(lens.max()) + 3
    q = torch.randn((B, H, T, HEAD_DIM), generator=g).to(dtype)
    if paged:
        pages = -(-capacity // PAGE_SIZE)
        table = (
            torch.randperm(B * pages + 2, generator=g)[: B * pages].view(B, pages).to(torch.int32)
        )  # shuffled, two spare pages
        shape = (B * pages + 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    else:
        table, shape = None, (B, NUM_KV_HEADS, capacity, HEAD_DIM)
    k = (torch.randn(shape, generator=g) * 100).to(dtype)
    v = (torch.randn(shape, generator=g) * 100).to(dtype)
    for b, L in enumerate(lens.tolist()):  # real keys and values at unit scale, garbage elsewhere
        if paged:
            slots = torch.arange(L)
            k[table[b, slots // PAGE_SIZE].long(), slots % PAGE_SIZE] = torch.randn(
                (L, NUM_KV_HEADS, HEAD_DIM), generator=g
            ).to(dtype)
            v[table[b, slots // PAGE_SIZE].long(), slots % PAGE_SIZE] = torch.randn(
                (L, NUM_KV_HEADS, HEAD_DIM), generator=g
            ).to(dtype)
        else:
            k[b, :, :L] = torch.randn((NUM_KV_HEADS, L, HEAD_DIM), generator=g).to(dtype)
            v[b, :, :L] = torch.randn((NUM_KV_HEADS, L, HEAD_DIM), generator=g).to(dtype)
    return q, k, v, lens, table


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def run_attention(q, k, v, lens, table, **kw) -> torch.Tensor:
    out = poisoned(q)
    got = va.verify_attention(q, k, v, lens, block_table=table, out=out, **kw)
    assert got is out and not torch.isnan(out).any()
    return out


# ------------------------------------------------------------------------------- verify attention


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize(("G", "D"), GRID)
def test_verify_attention_matches_reference(G, D, paged):
    dtype = DTYPES[(G + D + paged) % 3]  # every dtype meets both caches and all of G and D across the grid
    q, k, v, lens, table = attention_case(G, D, dtype, paged, seed=100 * G + D)
    ref = va.verify_attention_ref(q, k, v, lens, table, out_dtype=torch.float32)
    torch.testing.assert_close(run_attention(q, k, v, lens, table).float(), ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_verify_attention_split_kv_and_row_blocks(dtype, paged):
    """Split key ranges (flash-decoding combine), ranges with no visible key, several row blocks per KV head."""
    q, k, v, lens, table = attention_case(3, 7, dtype, paged, seed=7, prefixes=(0, 9, 40))
    ref = va.verify_attention_ref(q, k, v, lens, table, out_dtype=torch.float32)
    small = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}  # 24 rows -> 2 row blocks
    for splits in (2, 5):
        torch.testing.assert_close(
            run_attention(q, k, v, lens, table, num_splits=splits, config=small).float(), ref, **TOLERANCE[dtype]
        )


def test_verify_attention_equals_the_models_attention():
    """Uniform lengths on a contiguous cache: the kernel computes what the model's `gqa_attention` computes."""
    B, H, H_kv, T, ctx = 2, 9, 3, 4, 29
    g = torch.Generator().manual_seed(3)
    q = torch.randn((B, H, T, 64), generator=g)
    k, v = torch.randn((B, H_kv, ctx + T, 64), generator=g), torch.randn((B, H_kv, ctx + T, 64), generator=g)
    positions = ctx + torch.arange(T)
    mask = (torch.arange(ctx + T)[None, :] <= positions[:, None]).expand(B, 1, T, ctx + T)
    expected = gqa_attention(q, k, v, mask)
    got = run_attention(q, k, v, torch.full((B,), ctx + T, dtype=torch.int32), None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_reference_mask_matters():
    """The checks above can fail: dropping the draft block's causal mask, or reading one slot past a sequence, shows."""
    q, k, v, lens, _ = attention_case(3, 3, torch.float32, False, seed=11, prefixes=(6, 6, 6))
    B, _, T, _ = q.shape
    L = int(lens[0])
    ref = va.verify_attention_ref(q, k, v, lens)
    full = gqa_attention(q, k[:, :, :L], v[:, :, :L], torch.ones((B, 1, T, L), dtype=torch.bool))
    assert not torch.allclose(ref, full, atol=1e-3)
    torch.testing.assert_close(
        ref[:, :, -1], full[:, :, -1], atol=1e-5, rtol=1e-5
    )  # the last new token sees every key anyway
    one_more = run_attention(q, k, v, lens + 1, None)  # the extra slot holds garbage
    assert not torch.allclose(one_more, ref, atol=1e-2)


def test_verify_attention_rejects_bad_shapes():
    q, k, v, lens, _ = attention_case(3, 1, torch.float32, False, seed=1)
    with pytest.raises(SpecdecError, match="multiple of KV heads"):
        va.verify_attention(q[:, :5], k, v, lens)
    with pytest.raises(SpecdecError, match="int32"):
        va.verify_attention(q, k, v, lens.long())
    with pytest.raises(SpecdecError, match="dtypes"):
        va.verify_attention(q, k.half(), v, lens)


# ------------------------------------------------------------------------------- acceptance


def acceptance_case(B: int, K: int, V: int, seed: int, dtype=torch.float32):
    """Logits, drafts that follow the target's argmax for a random prefix then differ, ragged draft lengths."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((B, K + 1, V), generator=g).to(dtype)
    drafts = logits[:, :K].float().argmax(-1)
    if K:
        stop = torch.randint(0, K + 1, (B,), generator=g)  # first wrong draft (K: none)
        for b in range(B):
            if stop[b] < K:
                drafts[b, stop[b]] = (drafts[b, stop[b]] + 1 + torch.randint(0, V - 1, (1,), generator=g)) % V
    lens = torch.randint(0, K + 1, (B,), generator=g)
    return logits, drafts, lens


def int_outputs(B: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((B,), -7, dtype=torch.long), torch.full(
        (B,), -7, dtype=torch.long
    )  # poison: no valid count or token


@pytest.mark.parametrize("K", [0, 1, 3, 7, 15])
def test_greedy_accept_equals_verify_greedy(K):
    for seed, dtype in enumerate(DTYPES):
        logits, drafts, lens = acceptance_case(9, K, 77, seed=10 * K + seed, dtype=dtype)
        out = int_outputs(9)
        n, token = acceptance.greedy_accept(
            logits, drafts, lens, config={"BLOCK_V": 16, "num_warps": 4, "num_stages": 1}, out=out
        )
        expected = verify_greedy(logits.float(), drafts, lens)
        assert torch.equal(n, expected[0]) and torch.equal(token, expected[1])
    if K:
        assert int(expected[0].max()) > 0  # some drafts were accepted: the walk was exercised


def test_greedy_accept_ties_take_the_first_index():
    """Integer logits with many equal maxima (also across chunk boundaries): the first index wins, as in
    torch.argmax."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (16, 4, 40), generator=g).float()
    drafts = logits[:, :3].argmax(-1)
    drafts[::3, 1] = 39  # some rows stop at the second draft
    lens = torch.full((16,), 3)
    for block_v in (16, 64):
        n, token = acceptance.greedy_accept(
            logits, drafts, lens, config={"BLOCK_V": block_v, "num_warps": 4, "num_stages": 1}, out=int_outputs(16)
        )
        expected = verify_greedy(logits, drafts, lens)
        assert torch.equal(n, expected[0]) and torch.equal(token, expected[1])


@pytest.mark.parametrize("with_probs", [False, True], ids=["one-hot", "draft-probs"])
@pytest.mark.parametrize("K", [0, 1, 3, 7])
def test_rejection_sample_equals_reference_for_the_same_uniforms(K, with_probs):
    B, V = 12, 45
    logits, drafts, lens = acceptance_case(B, K, V, seed=K + 100 * with_probs)
    g = torch.Generator().manual_seed(K)
    probs = torch.softmax(2 * torch.randn((B, K, V), generator=g), -1) if with_probs else None
    if with_probs and K:
        probs[0, 0] = torch.softmax(logits[0, 0] / 0.8, -1)  # q == p: the residual has no mass, p itself is sampled
        lens[0] = K
    u = (torch.rand((B, K), generator=g) * 0.7, torch.rand((B,), generator=g))  # u < 0.7: a good share of acceptances
    n, token = acceptance.rejection_sample(
        logits,
        drafts,
        lens,
        probs,
        0.8,
        uniforms=u,
        out=int_outputs(B),
        config={"BLOCK_V": 16, "num_warps": 4, "num_stages": 1},
    )
    expected = acceptance.rejection_sample_ref(logits, drafts, lens, probs, 0.8, *u)
    assert torch.equal(n, expected[0]) and torch.equal(token, expected[1])
    assert ((0 <= token) & (token < V)).all()


def exact_distribution(logits, drafts, draft_len, probs, temperature, rejected_from_p=False) -> torch.Tensor:
    """P(num_accepted = n, next = x) for one sequence, flattened [(K+1)·V], from the algorithm's definition in float64.
    rejected_from_p: the wrong rule that samples p_n after a rejection (the negative control)."""
    K1, V = logits.shape
    p = torch.softmax(logits.double() / temperature, -1)
    q = probs.double() if probs is not None else torch.nn.functional.one_hot(drafts, V).double()
    out = torch.zeros((K1, V), dtype=torch.float64)
    reach = 1.0
    for i in range(draft_len):
        a = min(1.0, float(p[i, drafts[i]] / q[i, drafts[i]]))
        residual = (p[i] - q[i]).clamp_min(0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        out[i] = reach * (1 - a) * (p[i] if rejected_from_p else residual)
        reach *= a
    out[draft_len] += reach * p[draft_len]
    return out.flatten()


def test_rejection_sampling_is_distributed_as_the_reference_loop():
    """Kernel samples and `verify_sampled` samples against the exact distribution of (accepted, next token), and the
    same test rejects the wrong residual rule (so it can fail)."""
    K, V, T = 3, 5, 1.0
    g = torch.Generator().manual_seed(17)  # a case whose outcomes spread over n = 0, 2, 3 with every cell >= 4%
    logits = torch.randn((K + 1, V), generator=g)
    drafts = torch.randint(0, V, (K,), generator=g)
    probs = torch.softmax(torch.randn((K, V), generator=g) * 1.5, -1)
    exact = exact_distribution(logits, drafts, K, probs, T)
    wrong = exact_distribution(logits, drafts, K, probs, T, rejected_from_p=True)
    keep = exact > 1e-9

    def counts(n: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return torch.bincount(n * V + token, minlength=(K + 1) * V).double()

    N = 600
    rows = (
        logits.expand(N, -1, -1).contiguous(),
        drafts.expand(N, -1).contiguous(),
        torch.full((N,), K),
        probs.expand(N, -1, -1).contiguous(),
    )
    n, token = acceptance.rejection_sample(*rows, T, torch.Generator().manual_seed(1), out=int_outputs(N))
    kernel_counts = counts(n, token)
    assert kernel_counts[~keep].sum() == 0
    assert chisquare(kernel_counts[keep], exact[keep] / exact[keep].sum() * N).pvalue > 1e-3
    assert chisquare(kernel_counts[keep], wrong[keep] / wrong[keep].sum() * N).pvalue < 1e-6

    M = 60000
    rows_ref = (logits.expand(M, -1, -1), drafts.expand(M, -1), torch.full((M,), K), probs.expand(M, -1, -1))
    loop_counts = counts(*verify_sampled(*rows_ref, T, torch.Generator().manual_seed(2)))
    assert loop_counts[~keep].sum() == 0
    assert chisquare(loop_counts[keep], exact[keep] / exact[keep].sum() * M).pvalue > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_tokens_draws_each_token_at_its_probability(dtype):
    """The inverse-CDF sampler the loop and the drafters draw with: frequencies match the weights (chi-square), a
    zero-weight token is never drawn, also where u lands at the very top; a uniform draw fails the same test."""
    probs = torch.tensor([0.0, 0.05, 0.0, 0.5, 0.3, 0.15, 0.0], dtype=dtype)
    N = 20000
    tokens = sampling.sample_tokens(probs.expand(N, -1), torch.Generator().manual_seed(5))
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep], probs[keep].double() / probs[keep].double().sum() * N).pvalue > 1e-3
    assert chisquare(counts[keep], torch.full((int(keep.sum()),), N / keep.sum().item())).pvalue < 1e-6
    top = sampling.inverse_cdf(probs[None].float(), torch.tensor([1.0]))  # u·Σw at the sum: the last weighted token
    assert top.tolist() == [5]


def test_acceptance_rejects_bad_input():
    logits, drafts, lens = acceptance_case(2, 3, 20, seed=0)
    with pytest.raises(SpecdecError, match="logits are"):
        acceptance.greedy_accept(logits[:, :2], drafts, lens)
    with pytest.raises(SpecdecError, match="temperature"):
        acceptance.rejection_sample(logits, drafts, lens, None, 0.0)


# ------------------------------------------------------------------------------- tile rules and table


DEMO_SCHEDULE = [{"batch": 1, "draft_len": 3}, {"batch": 4, "draft_len": 1}, {"batch": 16, "draft_len": 0}]
DEMO_SERVED = tuning.ServedShapes(((1, 3), (4, 1), (16, 0)), ctx=512, tile_rows=128)
DEMO_SHAPES = tuning.ModelShapes(num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152)


def test_buckets_step_at_tile_multiples():
    assert [tuning.rows_bucket(r) for r in (3, 12, 16, 17, 128, 129, 256, 257)] == [4, 16, 16, 32, 128, 256, 256, 384]
    assert (
        tuning.rows_bucket(100, tile_rows=64) == 128
        and tuning.kv_bucket(516) == 1024
        and tuning.vocab_bucket(49152) == 65536
    )
    rule = [va.tile_rule(va.key_for(3, 1 + D, 64, 4096))["BLOCK_M"] for D in (0, 3, 7, 42, 60)]
    assert rule == [
        16,
        16,
        32,
        128,
        128,
    ]  # G·(1+D) = 3, 12, 24, 129, 183: one 128-row tile holds D up to 128/G - 1 = 41


def test_model_shapes_from_a_target_folder(tiny_hf_dir, make_plan):
    from specdec_tune.exporters.artifacts import served_shapes, target_shapes

    assert target_shapes(str(tiny_hf_dir)) == tuning.ModelShapes(4, 2, 8, 64)
    plan = make_plan(
        DEMO_SCHEDULE, ctx=512, mechanism="draft_model", tile={"policy": "aligned", "rows": 128, "group": 3}
    )
    assert served_shapes(plan) == DEMO_SERVED
    cpu = make_plan(DEMO_SCHEDULE, ctx=512, mechanism="draft_model")
    assert served_shapes(cpu).tile_rows == tuning.DEFAULT_TILE_ROWS  # a CPU plan: the NVIDIA tile
    with pytest.raises(SpecdecError, match="multiple of KV heads"):
        tuning.call_shapes(DEMO_SERVED, tuning.ModelShapes(9, 4, 64, 100))


def test_call_shapes_and_modeled_table(tmp_path):
    calls = tuning.call_shapes(DEMO_SERVED, DEMO_SHAPES)
    attention = [c for c in calls if c["kernel"] == "verify_attention"]
    assert [c["key"]["rows_bucket"] for c in attention] == [16, 8, 4] and {
        c["key"]["kv_bucket"] for c in attention
    } == {1024}
    assert sum(c["kernel"] == "greedy_accept" for c in calls) == 2  # buckets with D > 0
    table = tuning.tune_kernels(calls)  # no GPU: tile rules, recorded as modeled
    assert {e.source for e in table.entries} == {"modeled"} and len(table.entries) == 5
    table.write(tmp_path / "t.json")
    again = tuning.KernelTable.read(tmp_path / "t.json")
    assert again == table and tuning.stale_factors(again) == []
    key = attention[0]["key"]
    assert again.config_for("verify_attention", key) == va.tile_rule(key)
    moved = tuning.KernelTable.from_json(table.to_json() | {"factors": table.factors | {"triton_version": "0.0"}})
    assert tuning.stale_factors(moved) == [f"triton_version: 0.0 -> {table.factors['triton_version']}"]


def test_tuning_times_candidates_and_keeps_the_fastest(monkeypatch):
    """The timed path without a GPU: a fake bench that prefers one config, and one candidate that fails (scores inf)."""
    calls = [c for c in tuning.call_shapes(DEMO_SERVED, DEMO_SHAPES) if c["kernel"] == "verify_attention"][:1]
    candidates = va.prune(va.CONFIGS, calls[0]["key"])
    favourite = candidates[-1]

    def fake_bench(config, **shape):
        if config == candidates[0]:
            raise RuntimeError("out of resources")
        return 1.0 if config == favourite else 2.0

    monkeypatch.setattr(va, "bench", fake_bench)

    class Cuda:
        type = "cuda"

    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(tuning, "current_factors", lambda device=None: {"device": "fake"})
    table = tuning.tune_kernels(calls, device=Cuda())
    (entry,) = table.entries
    assert entry.source == "measured" and entry.config == favourite and entry.median_ms == 1.0
    assert [t["median_ms"] for t in entry.timings].count(None) == 1


# ------------------------------------------------------------------------------- AOT


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    manifest = aot.build_bundle_kernels(DEMO_SERVED, out, shapes=DEMO_SHAPES, archs=("sm_90", "sm_100"))
    return out, manifest


def test_cubins_for_sm90_and_sm100(bundle):
    out, manifest = bundle
    assert (out / "kernels" / "manifest.json").is_file() and json.loads(
        (out / "kernels" / "manifest.json").read_text()
    ) == manifest
    binaries = manifest["binaries"]
    assert {b["arch"] for b in binaries} == {"sm_90", "sm_100"}
    for b in binaries:
        cubin = (out / b["path"]).read_bytes()
        assert aot.cubin_arch(cubin) == b["arch"] and b["bytes"] == len(cubin) > 1000
    keys = {(b["kernel"], json.dumps(b["key"], sort_keys=True)) for b in binaries}
    assert len(keys) == 5  # three attention keys, two acceptance kernels
    per_attention_key = [
        b
        for b in binaries
        if b["kernel"] == "verify_attention" and b["arch"] == "sm_90" and b["key"]["rows_bucket"] == 16
    ]
    assert sorted(
        (b["function"], b["constexprs"].get("PAGED"), b["constexprs"].get("SPLIT_KV")) for b in per_attention_key
    ) == [
        ("verify_attention_combine_kernel", None, None),
        *[("verify_attention_kernel", p, s) for p in (False, True) for s in (False, True)],
    ]
    assert aot.check_kernel_manifest(out, manifest) == []


def test_kernel_manifest_check_catches_tampering(bundle, tmp_path):
    import shutil

    out, manifest = bundle
    copy = tmp_path / "b"
    shutil.copytree(out, copy)
    victim = manifest["binaries"][0]
    data = bytearray((copy / victim["path"]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / victim["path"]).write_bytes(bytes(data))
    other = next(b for b in manifest["binaries"] if b["arch"] != victim["arch"])
    lying = json.loads(json.dumps(manifest))
    lying["binaries"][1]["arch"] = "sm_90" if lying["binaries"][1]["arch"] == "sm_100" else "sm_100"
    (copy / other["metadata_path"]).unlink()
    errors = aot.check_kernel_manifest(copy, lying)
    assert any("does not match its sha256" in e for e in errors)
    assert any("cubin but its entry says" in e for e in errors)
    assert any("is missing" in e for e in errors)
    assert aot.check_kernel_manifest(
        copy, manifest | {"binaries": [b | {"path": "../x.cubin"} for b in manifest["binaries"][:1]]}
    )
    thin = manifest | {"binaries": [b for b in manifest["binaries"] if b["arch"] == "sm_90"]}
    assert any(e.startswith("no sm_100 cubin") for e in aot.check_kernel_manifest(out, thin))


def test_loader_refuses_another_arch_and_falls_back_to_jit(bundle):
    out, manifest = bundle
    sm90 = next(b for b in manifest["binaries"] if b["arch"] == "sm_90")
    on_blackwell = aot.Launcher(out, device_arch="sm_100")
    with pytest.raises(SpecdecError, match="built for sm_90"):
        on_blackwell.load(sm90)
    kernel = aot.Launcher(out, device_arch="sm_90").load(sm90)  # the matching arch loads (launching needs the GPU)
    assert kernel.asm["cubin"] == (out / sm90["path"]).read_bytes() and kernel.metadata.target.arch == 90

    here = aot.Launcher(out)  # this machine: no GPU, so every call JITs (here: the interpreter) and says why
    q, k, v, lens, table = attention_case(3, 3, torch.float32, True, seed=2)
    got = run_attention(q, k, v, lens, table, launcher=here)
    torch.testing.assert_close(got, va.verify_attention_ref(q, k, v, lens, table), atol=1e-5, rtol=1e-5)
    assert here.launched == {} and here.fallbacks == ["verify_attention_kernel: no CUDA device"]
    pretend = aot.Launcher(out, device_arch="sm_90")  # a GPU of the right arch, but CPU tensors: still JIT
    run_attention(q, k, v, lens, table, launcher=pretend)
    assert pretend.fallbacks == ["verify_attention_kernel: tensors are not on the GPU"]


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_benchmark_quick(tmp_path):
    """On a GPU: the kernels compiled for it match the reference and the benchmark runs (in a fresh interpreter-free
    process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "verify_attention_gpu.py"), "--quick", "--out", str(tmp_path / "v.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "v.json").read_text())
    assert all(c["passed"] for c in result["check"]) and result["tile_steps"]
    assert (
        result["aot"]["passed"] and result["aot"]["launched"]["verify_attention_kernel"] >= 1
    )  # shipped cubins ran, not the JIT
