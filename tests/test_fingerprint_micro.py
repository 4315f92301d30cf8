"""Device fingerprint, device names, and the attention / GEMM micro-curves (CPU, tiny shapes)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.fingerprint import (
    STALENESS_FACTORS,
    device_factors,
    device_fingerprint,
    diff_factors,
    resolve_device,
)
from specdec_tune.profiles.micro import (
    attention_curve,
    default_m_values,
    knee,
    linear_curve,
    linear_forward_curve,
    verify_attention,
    verify_attention_inputs,
)
from specdec_tune.profiles.models.llama import ModelConfig

CPU = torch.device("cpu")

TINY = ModelConfig(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_fields_and_json():
    fp = device_fingerprint(CPU, torch.bfloat16)
    for field in (*STALENESS_FACTORS, "memory_bytes", "cpu_model", "cpu_flags_of_note", "python", "platform"):
        assert field in fp
    assert fp["kind"] == "cpu" and fp["capability"] is None and fp["driver"] is None
    assert fp["dtype"] == "bfloat16" and fp["torch"] == torch.__version__
    assert fp["threads"] == torch.get_num_threads() and fp["name"]
    assert set(fp["cpu_flags_of_note"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert json.loads(json.dumps(fp)) == fp


def test_diff_factors_names_changed_fields():
    old = device_fingerprint(CPU, torch.float32)
    assert diff_factors(old, dict(old)) == []
    new = {**old, "dtype": "bfloat16", "threads": old["threads"] + 1, "python": "0.0", "memory_bytes": 1}
    changed = diff_factors(old, new)
    assert changed == ["dtype: float32 -> bfloat16", f"threads: {old['threads']} -> {old['threads'] + 1}"]
    assert set(device_factors(old)) == set(STALENESS_FACTORS)


# ---------------------------------------------------------------- resolve_device


def test_resolve_device_cpu_and_auto():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_resolve_device_cuda_without_cuda(name):
    with pytest.raises(SpecdecError) as err:
        resolve_device(name)
    assert "CUDA is not available" in err.value.message and err.value.hint


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "nvidia"])
def test_resolve_device_unknown(name):
    with pytest.raises(SpecdecError) as err:
        resolve_device(name)
    assert "auto" in err.value.hint and "cpu" in err.value.hint


# ---------------------------------------------------------------- attention


def reference_attention(q, k, v, mask):
    """Explicit GQA attention: KV heads repeated G times (head h reads KV head h // G), masked softmax."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1).double(), v.repeat_interleave(G, dim=1).double()
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # [B, H, T, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_verify_attention_inputs_shapes_and_mask():
    q, k, v, mask = verify_attention_inputs(TINY, batch=2, ctx=5, T=3, dtype=torch.float32, device=CPU)
    assert q.shape == (2, 4, 3, 16) and k.shape == v.shape == (2, 2, 8, 16) and mask.shape == (2, 1, 3, 8)
    assert mask.dtype == torch.bool
    assert all(t.std() > 0.5 for t in (q, k, v))  # random normal, not zeros
    # query t sees the 5 cached keys and new keys 0..t
    assert mask[0, 0].sum(-1).tolist() == [6, 7, 8]
    assert not mask[1, 0, 0, 6:].any() and mask[1, 0, 2].all()


@pytest.mark.parametrize("ctx,T", [(0, 1), (7, 4), (20, 9)])
def test_verify_attention_matches_reference(ctx, T):
    q, k, v, mask = verify_attention_inputs(TINY, batch=2, ctx=ctx, T=T, dtype=torch.float32, device=CPU, seed=3)
    torch.testing.assert_close(
        verify_attention(q, k, v, mask).double(), reference_attention(q, k, v, mask), atol=1e-5, rtol=1e-5
    )


def test_attention_curve_points():
    draft_lens = [0, 1, 3, 7]
    points = attention_curve(TINY, CPU, torch.float32, ctx_tokens=32, draft_lens=draft_lens, batch=2, repeats=3)
    assert [p["draft_len"] for p in points] == draft_lens
    for p, D in zip(points, draft_lens):
        assert p["kind"] == "attention" and p["source"] == "measured"
        assert p["tokens"] == 1 + D and p["rows_per_kv_head"] == TINY.group_size * (1 + D)
        assert p["ctx"] == 32 and p["batch"] == 2 and p["repeats"] >= 3
        assert 0 < p["p10_ms"] <= p["median_ms"] <= p["p90_ms"]
    json.dumps(points)


# ---------------------------------------------------------------- linear


def test_linear_curve_layers_and_shapes():
    m_values = [1, 4, 16]
    points = linear_curve(TINY, CPU, torch.float32, m_values=m_values, repeats=3)
    expected = {
        "qkv": (64, (4 + 2 * 2) * 16),
        "o": (64, 64),
        "gate_up": (64, 256),
        "down": (128, 64),
        "lm_head": (64, 256),
    }
    assert len(points) == len(expected) * len(m_values)
    for p in points:
        assert (p["in_features"], p["out_features"]) == expected[p["layer"]]
        assert p["gflop"] == pytest.approx(2 * p["m"] * p["in_features"] * p["out_features"] / 1e9)
        assert p["median_ms"] > 0 and p["achieved_gflops"] > 0 and p["source"] == "measured"
    assert {(p["layer"], p["m"]) for p in points} == {(layer, m) for layer in expected for m in m_values}
    forward = linear_forward_curve(points, TINY.num_layers)
    assert [p["m"] for p in forward] == m_values and all(p["median_ms"] > 0 for p in forward)


# ---------------------------------------------------------------- default_m_values


def test_default_m_values_small_grid_is_exact():
    assert default_m_values([1, 4], 4) == [1, 2, 3, 4, 8, 12, 16]


def test_default_m_values_thinning():
    values = default_m_values([1, 2, 4, 8, 16, 32, 64], 33)
    assert values == sorted(set(values)) and len(values) <= 24
    assert values[0] == 1 and values[-1] == 64 * 33
    ratios = [b / a for a, b in zip(values, values[1:])]
    assert max(ratios) < 3  # spread over the whole range, not bunched at one end
    with pytest.raises(SpecdecError):
        default_m_values([], 4)


# ---------------------------------------------------------------- knee


def curve(ys, xs=None):
    xs = xs or [1, 2, 4, 8, 16, 32][: len(ys)]
    return [{"x": x, "y": y} for x, y in zip(xs, ys)]


def test_knee_flat_then_rising():
    assert knee(curve([1.0, 1.05, 1.1, 1.2, 2.0, 4.0]), "x", "y") == 8


def test_knee_all_flat_is_largest_x():
    assert knee(curve([1.0, 1.0, 1.1, 1.0, 1.2, 1.24]), "x", "y") == 32


def test_knee_rising_from_start_is_smallest_x():
    assert knee(curve([1.0, 1.5, 2.5, 4.0]), "x", "y") == 1


def test_knee_edge_cases():
    assert knee([], "x", "y") is None
    assert knee(list(reversed(curve([1.0, 1.1, 3.0]))), "x", "y") == 2  # order of points does not matter
    with pytest.raises(ValueError):
        knee(curve([1.0, 1.0], xs=[1, 1]), "x", "y")
