"""Shared fixtures: tiny random checkpoints (the built-in Llama family and seven others) saved as Hugging Face folders,
and the gpu marker."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it (cli.py): before torch starts its threads
import torch  # noqa: E402

# The GGUF -> safetensors conversion cache is the one normal use shares; a test that must not touch it
# points SPECDEC_TUNE_CACHE elsewhere with monkeypatch.
os.environ.setdefault("SPECDEC_TUNE_CACHE", str(Path.home() / ".cache" / "specdec-tune"))
if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


# Families outside the built-in four, run through transformers' own modules (profiles/models/generic.py): the config
# class and what each needs beyond TINY. A sliding window of 6 is shorter than the tests' sequences, so the window's
# mask is exercised; gemma2 soft-caps attention scores and final logits; mixtral and qwen3_moe route over experts.
OTHER_FAMILIES = {
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=6, query_pre_attn_scalar=8)),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=8,
            sliding_window=6,
            query_pre_attn_scalar=8,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    ),
    "phi3": ("Phi3Config", dict(pad_token_id=0, eos_token_id=1, bos_token_id=1, sliding_window=None)),
    "olmo2": ("Olmo2Config", dict(pad_token_id=0, eos_token_id=1)),
    "granite": (
        "GraniteConfig",
        dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3),
    ),
    # its final norm is `final_layer_norm` and it keeps 4 KV heads, not the 2 TINY names: found from the module
    "gpt_neox": ("GPTNeoXConfig", dict(eos_token_id=1, bos_token_id=1)),
    # multi-query (one KV head, whatever the config says elsewhere) and a parallel attention / MLP block
    "falcon": ("FalconConfig", dict(eos_token_id=1, bos_token_id=1)),
    # local layers that cut a window of 4 from a causal buffer aligned to the key length, not from the masks
    "gpt_neo": (
        "GPTNeoConfig",
        dict(
            attention_types=[[["global", "local"], 1], [["global"], 1]], window_size=4, eos_token_id=1, bos_token_id=1
        ),
    ),
}


def build_hf_model(kind: str = "llama", tied: bool = False, seed: int = 0, **overrides):
    """A tiny random transformers model of `kind` (llama, mistral, qwen2, qwen3, or one of OTHER_FAMILIES), float32,
    eval mode.

    Weights are re-drawn at the scale of a trained model (norm gains and biases non-trivial), so a
    forward that skips a bias, a norm or a rotation gives visibly different logits.
    """
    import transformers

    if kind in OTHER_FAMILIES:
        name, extra = OTHER_FAMILIES[kind]
        config_cls = getattr(transformers, name)
    else:
        config_cls = {
            "llama": transformers.LlamaConfig,
            "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config,
        }[kind]
        extra = {"head_dim": 8} if kind == "qwen3" else {}  # Qwen3Config defaults head_dim to 128
        if kind == "mistral":
            extra["sliding_window"] = None
    config = config_cls(**{**TINY, **extra, "tie_word_embeddings": tied, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # linear weights; a MoE layer's experts stacked as [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="session")
def hf_variant_dir(tmp_path_factory):
    """Factory: hf_variant_dir(kind, tied=False, **config overrides) -> a saved folder (built once per session)."""
    made: dict[tuple, Path] = {}

    def make(kind: str = "llama", tied: bool = False, **overrides) -> Path:
        key = (kind, tied, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{kind}{'-tied' if tied else ''}")
            build_hf_model(kind, tied, **overrides).save_pretrained(folder, safe_serialization=True)
            made[key] = folder
        return made[key]

    return make


@pytest.fixture(scope="session")
def build_hf():
    """build_hf(kind, tied=False, seed=0, **config overrides) -> an in-memory transformers model."""
    return build_hf_model


@pytest.fixture(scope="session")
def tiny_hf_dir(hf_variant_dir) -> Path:
    """A tiny random Llama (vocab 64, 3 layers, 4 heads / 2 KV heads) saved with safetensors."""
    return hf_variant_dir("llama")


def build_plan(buckets: list[dict], *, mechanism: str = "ngram", quant: str = "none", ctx: int = 128, **fields):
    """A valid `Plan` record around `buckets` ({"batch", "draft_len", and optionally "tokens_per_s": a figure dict,
    "rationale": the bucket's rationale record}):
    every other figure and field a plausible placeholder, for the checks that read a plan's schedule and predictions."""
    from specdec_tune.autotune.plan_schema import PREDICTED_FIGURES, Plan

    one = {"value": 1.0, "source": "modeled"}

    def bucket(b: dict) -> dict:
        predicted = {name: one for name in PREDICTED_FIGURES} | {"tokens_per_s": b.get("tokens_per_s", one)}
        rationale = b.get("rationale", {"text": "test"})
        return {"batch": b["batch"], "draft_len": b["draft_len"], "predicted": predicted, "rationale": rationale}

    digest = "0" * 64
    schedule = [bucket(b) for b in buckets]
    record = {
        "schema_version": 2,
        "tool_version": "test",
        "created_at": "",
        "notes": [],
        "excluded_buckets": [],
        "mix": None,
        "profile": {
            "fingerprint": digest,
            "sha256": digest,
            "device": "cpu",
            "target": {
                "path": "x",
                "format": "hf",
                "arch": "llama",
                "dtype": "float32",
                "config_hash": digest,
                "weights_hash": digest,
                "num_layers": 1,
            },
        },
        "device": {"name": "cpu", "times": "modeled"},
        "objective": {"kind": "speedup"},
        "mechanism": mechanism,
        "quant": quant,
        "max_draft_len": max(b["draft_len"] for b in buckets),
        "max_batch": buckets[-1]["batch"],
        "ctx": ctx,
        "tile": {"policy": "free", "rows": 1, "group": 1},
        "buckets": schedule,
        "single_draft_len": {"draft_len": 0, "mean_speedup": 1.0, "schedule_mean_speedup": 1.0},
        "pareto": {"exact": [], "method": "test"},
        "study": {
            "storage": "memory",
            "name": "test",
            "seed": 0,
            "space_size": 1,
            "trials": 0,
            "trial_budget": 0,
            "exhaustive_value": 1.0,
            "strict_optimum_value": 1.0,
            "tie_tolerance": 0.02,
        },
        "settings_hash": digest,
        "search_settings": {
            "objective": "speedup",
            "trials": 0,
            "seed": 0,
            "min_user_tokens_per_s": 0.0,
            "min_tokens_per_s": 0.0,
            "mechanisms": [],
            "quant_formats": ["none"],
            "tile_rows": 0,
            "tie_tolerance": 0.02,
            "study_name": "test",
            "device": None,
            "mix": [],
            "memory_fraction": 0.9,
            "tensor_parallel": 0,
        },
    }
    return Plan.model_validate(record | fields)


@pytest.fixture
def make_plan():
    """build_plan(buckets, **fields) -> a Plan record (see build_plan)."""
    return build_plan


@pytest.fixture
def fixed_speed():
    """A stand-in for pipeline.throughput_check.DeviceSpeed that reports one speed ratio and probes nothing."""

    def make(ratio: float):
        class Fixed:
            def __init__(self, *args, **kwargs):
                self.why = None

            def measure(self, fn, batch=1, draft_len=1):
                return fn(lambda: None), [ratio]

            def reference(self, batch, draft_len):
                return None

        return Fixed

    return make


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _search_does_not_decode(monkeypatch):
    """`search` through the CLI refines by decoding on this machine; tests of the search itself do not decode (their
    plans are the cost model's): tests/test_refine.py measures the refinement with a stand-in decoder."""
    from specdec_tune.pipeline import refine

    monkeypatch.setattr(refine, "skipped", lambda plan, profile: "not in this test (tests/test_refine.py decodes it)")
