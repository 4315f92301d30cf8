"""GPU paths: CUDA-event timing, the forward on CUDA against CPU, a small profile on CUDA. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from specdec_tune.profiles.models.llama import CausalLM, ModelConfig, init_random
from specdec_tune.profiles.timing import time_call

pytestmark = pytest.mark.gpu


def tiny() -> CausalLM:
    c = ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return init_random(CausalLM(c)).eval()


def test_cuda_event_timing():
    dev = torch.device("cuda")
    x = torch.randn(2048, 2048, device=dev)
    t = time_call(lambda: x @ x, device=dev, repeats=5)
    assert t.median_ms > 0 and t.p10_ms <= t.median_ms <= t.p90_ms


def test_forward_on_cuda_matches_cpu():
    cpu_model = tiny()
    gpu_model = tiny().cuda()
    tokens = torch.randint(0, 128, (3, 9))
    start = torch.zeros(3, dtype=torch.long)
    with torch.inference_mode():
        ref = cpu_model(tokens, cpu_model.new_cache(3, 32), start)
        out = gpu_model(tokens.cuda(), gpu_model.new_cache(3, 32), start.cuda()).cpu()
    assert torch.allclose(out, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.demo
def test_small_profile_on_cuda(tmp_path):
    from specdec_tune.profiles.torch_profile import TorchProfiler
    from specdec_tune.settings import ProfileSettings

    settings = ProfileSettings(
        device="cuda",
        batch_buckets=(1, 4),
        ctx_buckets=(64,),
        max_draft_len=3,
        prompts_per_domain=1,
        new_tokens=8,
        temperatures=(0.0,),
        drafters=("ngram",),
        quant_formats=(),
        out_dir=tmp_path,
    )
    profile = TorchProfiler(settings).run()
    assert profile.device["kind"] == "cuda" and profile.device["capability"]
    assert all(p.median_ms and p.median_ms > 0 for p in profile.verify if p.source == "measured")
    measured = {
        (a["batch"], a["tokens"]): a["bytes"] for a in profile.memory["activation"] if a["source"] == "measured"
    }
    assert set(measured) == {(B, T) for B in (1, 4) for T in range(1, 5)} and measured[(4, 4)] > measured[(1, 1)] > 0


def test_the_allocator_peak_counts_what_a_call_allocates():
    from specdec_tune.profiles.memory import allocator_peak_bytes

    dev = torch.device("cuda")
    keep = torch.empty(1 << 20, dtype=torch.uint8, device=dev)  # allocated before: not counted
    peak = allocator_peak_bytes(lambda: torch.empty(1 << 22, dtype=torch.uint8, device=dev), dev)
    assert 1 << 22 <= peak < (1 << 22) + (1 << 21) and keep.numel()


def test_generic_path_on_cuda_matches_cpu_and_stays_lossless(hf_variant_dir, tmp_path, monkeypatch):
    """The generic path (transformers' modules under the loop's cache) on the GPU: a sliding-window family's logits
    agree with its CPU run, and greedy speculation equals plain greedy there."""
    from specdec_tune.profiles.drafters.ngram import NgramDrafter
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.specdec import generate

    monkeypatch.setenv("SPECDEC_TUNE_CACHE", str(tmp_path / "cache"))
    folder = str(hf_variant_dir("gemma3_text"))
    cpu, gpu = load_model(folder, dtype="float32"), load_model(folder, dtype="float32", device="cuda")
    toks = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    start = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        want = cpu.model(toks, cpu.model.new_cache(2, 12), start)
        got = gpu.model(toks.cuda(), gpu.model.new_cache(2, 12), start.cuda())
    torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=1e-3)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7]]
    plain = generate(gpu.model, prompts, max_new_tokens=16).tokens
    spec = generate(
        gpu.model, prompts, drafter=NgramDrafter(None, NgramDrafter.Options()), num_draft_tokens=3, max_new_tokens=16
    ).tokens
    assert spec == plain


def test_sample_tokens_on_cuda_draws_only_weighted_tokens_at_their_rates():
    """The sampled loop's draw on a GPU (a CUDA generator, the fp32 cumsum there): zero-weight tokens never come out and
    the frequencies follow the weights."""
    from specdec_tune.kernels.sampling import sample_tokens

    probs = torch.tensor([0.0, 0.25, 0.0, 0.75], device="cuda")
    tokens = sample_tokens(probs.expand(40000, -1), torch.Generator(device="cuda").manual_seed(0))
    counts = torch.bincount(tokens, minlength=4).cpu()
    assert counts[0] == counts[2] == 0
    assert abs(counts[1].item() / 40000 - 0.25) < 0.01
