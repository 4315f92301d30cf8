"""Weight fake-quantization (FP8 E4M3 per channel, NVFP4): known answers, grid membership, module copies."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from specdec_tune import SpecdecError
from specdec_tune.formats import FORMATS, bits_per_weight, supported_natively
from specdec_tune.formats import WEIGHT_FORMATS as QUANT_FORMATS
from specdec_tune.profiles.drafters.quant import (
    E2M1_GRID,
    fake_quant,
    fake_quant_fp8_e4m3,
    fake_quant_nvfp4,
    quantization_error,
    quantize_linear_weights,
    round_e2m1,
)


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value, enumerated from the bit patterns."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def independent_nvfp4_steps(w: torch.Tensor) -> torch.Tensor:
    """Block step s_b * global for w [R, K] with K % 16 == 0, recomputed in float64 -> [R, K/16, 1]."""
    x = w.to(torch.float64)
    glob = x.abs().max() / (6 * 448)
    amax = x.reshape(x.shape[0], -1, 16).abs().amax(-1, keepdim=True)
    scale = (amax / 6 / glob).to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)
    return (scale * glob).to(torch.float32).to(torch.float64)


# ------------------------------------------------------------------------------------------- FP8


def test_fp8_round_trip_exact_on_representable_values():
    grid = e4m3_grid()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for exp in (-7, -2, 0, 3):  # power-of-two row scales: w / scale is exact
        vals = grid[torch.randint(0, len(grid), (63,), generator=gen)]
        signs = torch.where(torch.rand(63, generator=gen) < 0.5, -1.0, 1.0)
        row = torch.cat([torch.tensor([448.0]), vals * signs]) * 2.0**exp  # amax_row = 448 * scale
        rows.append(row)
    w = torch.stack(rows)  # [4, 64]
    assert torch.equal(fake_quant_fp8_e4m3(w), w)


def test_fp8_values_lie_on_scaled_e4m3_grid_per_row():
    w = torch.randn(8, 100, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, 8)[:, None]
    q = fake_quant_fp8_e4m3(w)
    scale = w.abs().amax(-1, keepdim=True) / 448
    on_grid = (q / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    torch.testing.assert_close(q, on_grid, rtol=1e-6, atol=0)
    assert torch.equal(q.abs().amax(-1), w.abs().amax(-1))  # the row max is exactly representable


def test_relative_errors_are_bounded():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(2))
    e_fp8 = quantization_error(w, "fp8")
    e_fp4 = quantization_error(w, "nvfp4")
    assert 0 < e_fp8 < 0.03
    assert e_fp8 < e_fp4 < 0.15
    assert quantization_error(w, "none") == 0.0


# ----------------------------------------------------------------------------------------- NVFP4


def test_round_e2m1_nearest_and_ties_to_even_code():
    x = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.75, -5.0, -2.6])
    want = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -4.0, -3.0])
    assert torch.equal(round_e2m1(x), want)
    grid = torch.tensor(E2M1_GRID)
    assert torch.equal(round_e2m1(grid), grid)
    assert torch.equal(round_e2m1(-grid[1:]), -grid[1:])


def test_nvfp4_values_lie_on_e2m1_grid_times_block_scale():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3)) * 0.02
    w[3, 40] = 1.5  # one outlier sets the tensor scale; its neighbours' blocks use small e4m3 scales
    q = fake_quant_nvfp4(w).to(torch.float64)
    step = independent_nvfp4_steps(w)  # [16, 8, 1]
    codes = q.reshape(16, -1, 16) / step  # [16, 8, 16]
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    dist = (codes.abs()[..., None] - grid).abs().amin(-1)
    assert dist.max() < 1e-5
    # each block takes at most the 8 e2m1 magnitudes, and its largest reaches 4 or 6
    for block in q.reshape(-1, 16):
        assert len(torch.unique(block.abs())) <= len(E2M1_GRID)
    top = codes.abs().amax(-1).round()
    assert set(top.flatten().tolist()) <= {4.0, 6.0}


def test_nvfp4_blocks_are_independent():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(4, 64, generator=gen)
    w[0, 0] = 50.0  # sets the global scale in both tensors
    before = fake_quant_nvfp4(w)
    w2 = w.clone()
    w2[1, 16:32] *= 7.0  # block (1, 1) changes, and gets a larger amax
    w2[1, 20] = 40.0
    after = fake_quant_nvfp4(w2)
    changed = torch.zeros(4, 64, dtype=torch.bool)
    changed[1, 16:32] = True
    assert torch.equal(before[~changed], after[~changed])
    assert not torch.equal(before[changed], after[changed])


def test_nvfp4_outlier_block_does_not_collapse_other_blocks():
    w = torch.full((1, 32), 0.01)
    w[0, 0] = 10.0
    q = fake_quant_nvfp4(w)
    assert q[0, 0] == 10.0  # the tensor amax maps to 6 * 448 exactly
    assert torch.equal(q[0, 1:16], torch.zeros(15))  # 0.01 is under half a step of its own block
    # the second block keeps its own e4m3 scale (0.01 / 6 / global = 0.448 -> 0.4375, so 0.01 -> 6 steps)
    torch.testing.assert_close(q[0, 16:], w[0, 16:], rtol=0.03, atol=0)


def test_nvfp4_subnormal_block_scale_known_answer():
    w = torch.full((1, 32), 0.01)
    w[0, 0] = 1000.0
    q = fake_quant_nvfp4(w)
    glob = 1000.0 / (6 * 448)
    scale = 2 * 2.0**-9  # 0.01 / 6 / glob = 0.00448 rounds to the e4m3 subnormal 2 * 2^-9
    # 0.01 / (scale * glob) = 6.88 saturates to 6: the format loses 13% on this block, by design
    torch.testing.assert_close(q[0, 16:], torch.full((16,), 6 * scale * glob), rtol=1e-6, atol=0)


def test_nvfp4_tiny_block_under_e4m3_range_goes_to_zero_without_nan():
    w = torch.zeros(1, 32)
    w[0, 0] = 1.0
    w[0, 16:] = 1e-9  # block scale rounds to 0 in e4m3
    q = fake_quant_nvfp4(w)
    assert torch.isfinite(q).all()
    assert torch.equal(q[0, 16:], torch.zeros(16))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_zero_tensor_stays_zero(fmt):
    w = torch.zeros(3, 40)
    q = fake_quant(w, fmt)
    assert torch.equal(q, w)
    assert quantization_error(w, fmt) == 0.0


@pytest.mark.parametrize("shape", [(5, 17), (3, 1), (2, 33), (7,), (2, 3, 20), (4, 48)])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_any_last_dim(shape, fmt):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    q = fake_quant(w, fmt)
    assert q.shape == w.shape
    assert torch.isfinite(q).all()
    assert quantization_error(w, fmt) < (0.03 if fmt == "fp8" else 0.2)


def test_nvfp4_padding_matches_explicit_zero_padding():
    w = torch.randn(6, 21, generator=torch.Generator().manual_seed(6))
    padded = torch.cat([w, torch.zeros(6, 11)], dim=1)
    assert torch.equal(fake_quant_nvfp4(w), fake_quant_nvfp4(padded)[:, :21])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_dtype_kept(dtype, fmt):
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(7)).to(dtype)
    q = fake_quant(w, fmt)
    assert q.dtype == dtype and q.shape == w.shape
    assert torch.isfinite(q).all()


def test_bf16_matches_fp32_path_up_to_bf16_rounding():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    for fmt in ("fp8", "nvfp4"):
        want = fake_quant(w.float(), fmt).to(torch.bfloat16)
        assert torch.equal(fake_quant(w, fmt), want)


def test_non_float_tensor_rejected():
    with pytest.raises(SpecdecError):
        fake_quant(torch.ones(2, 16, dtype=torch.int32), "fp8")


# -------------------------------------------------------------------------------------- registry


def test_unknown_format_raises_with_hint():
    with pytest.raises(SpecdecError) as info:
        fake_quant(torch.ones(2, 2), "int4")
    assert all(f in info.value.hint for f in QUANT_FORMATS)
    for call in (
        lambda: quantize_linear_weights(nn.Linear(2, 2), "fp4"),
        lambda: supported_natively("mxfp4", (10, 0)),
        lambda: quantization_error(torch.ones(2), "bf8"),
        lambda: bits_per_weight("int8"),
    ):
        with pytest.raises(SpecdecError):
            call()


@pytest.mark.parametrize(
    "fmt, cap, want",
    [
        ("fp8", (9, 0), True),
        ("fp8", (8, 9), True),
        ("fp8", (8, 0), False),
        ("fp8", (8, 6), False),
        ("fp8", None, False),
        ("nvfp4", (9, 0), False),
        ("nvfp4", (10, 0), True),
        ("nvfp4", (12, 0), True),
        ("nvfp4", None, False),
        ("none", None, True),
        ("none", (7, 0), True),
    ],
)
def test_supported_natively(fmt, cap, want):
    assert supported_natively(fmt, cap) is want


def test_registry_metadata():
    assert tuple(FORMATS) == QUANT_FORMATS
    assert FORMATS["fp8"].min_capability == (8, 9)
    assert FORMATS["nvfp4"].min_capability == (10, 0)
    assert bits_per_weight("fp8") == 8.0
    assert bits_per_weight("fp8", (4096, 4096)) == 8 + 32 / 4096
    assert bits_per_weight("nvfp4") == 4.5
    assert bits_per_weight("nvfp4", (64, 64)) == 4.5 + 32 / 4096
    assert all(FORMATS[f].description for f in QUANT_FORMATS)


# --------------------------------------------------------------------------------------- modules


class TiedLM(nn.Module):
    """Embedding, a norm, two projections and an LM head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(9)
        self.embed = nn.Embedding(40, 32)
        self.norm = nn.LayerNorm(32)
        self.layers = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32, bias=False)])
        self.lm_head = nn.Linear(32, 40, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.lm_head.weight = self.embed.weight


def snapshot(module: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (t.detach().clone(), t.data_ptr()) for n, t in module.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantize_module_leaves_original_untouched(fmt):
    model = TiedLM()
    before = snapshot(model)
    new = quantize_linear_weights(model, fmt)
    after = snapshot(model)
    assert before.keys() == after.keys()
    for name, (data, ptr) in before.items():
        assert torch.equal(after[name][0], data) and after[name][1] == ptr, name
    new_state = new.state_dict()
    for name, t in new_state.items():
        assert t.data_ptr() != before[name][1], name
    assert model.lm_head.weight is model.embed.weight  # the original stays tied


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantize_module_changes_only_linear_weights(fmt):
    model = TiedLM()
    new = quantize_linear_weights(model, fmt)
    for i in range(2):
        old, q = model.layers[i].weight, new.layers[i].weight
        assert isinstance(q, nn.Parameter) and q.dtype == old.dtype
        assert torch.equal(q.detach(), fake_quant(old.detach(), fmt))
        assert not torch.equal(q.detach(), old.detach())
    assert torch.equal(new.layers[0].bias, model.layers[0].bias)
    assert torch.equal(new.norm.weight, model.norm.weight) and torch.equal(new.norm.bias, model.norm.bias)


def test_quantize_module_unties_linear_from_embedding():
    model = TiedLM()
    new = quantize_linear_weights(model, "nvfp4")
    assert new.lm_head.weight is not new.embed.weight
    assert torch.equal(new.embed.weight, model.embed.weight)  # the embedding is exact
    assert torch.equal(new.lm_head.weight.detach(), fake_quant_nvfp4(model.embed.weight.detach()))


def test_quantize_module_skip_keeps_named_linear_exact_and_tied():
    model = TiedLM()
    new = quantize_linear_weights(model, "fp8", skip=("lm_head",))
    assert torch.equal(new.lm_head.weight, model.lm_head.weight)
    assert new.lm_head.weight is new.embed.weight  # nothing to untie: nothing quantized it
    assert not torch.equal(new.layers[1].weight, model.layers[1].weight)
    new = quantize_linear_weights(model, "fp8", skip=("layers.1", "no_such_module"))
    assert torch.equal(new.layers[1].weight, model.layers[1].weight)
    assert not torch.equal(new.layers[0].weight, model.layers[0].weight)
    assert not torch.equal(new.lm_head.weight, model.lm_head.weight)


def test_linears_sharing_a_weight_stay_shared():
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.ReLU(), nn.Linear(16, 16, bias=False))
    model[2].weight = model[0].weight
    new = quantize_linear_weights(model, "nvfp4")
    assert new[0].weight is new[2].weight
    assert torch.equal(new[0].weight.detach(), fake_quant_nvfp4(model[0].weight.detach()))


def test_quantize_module_none_is_exact_copy_and_forward_runs():
    model = TiedLM()
    new = quantize_linear_weights(model, "none")
    for (n, a), (_, b) in zip(model.state_dict().items(), new.state_dict().items()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), n
    ids = torch.tensor([[1, 2, 3]])
    for fmt in QUANT_FORMATS:
        q = quantize_linear_weights(model, fmt)
        out = q.lm_head(q.layers[1](q.layers[0](q.norm(q.embed(ids)))))
        assert out.shape == (1, 3, 40) and torch.isfinite(out).all()


def test_requires_grad_and_dtype_preserved_in_copy():
    model = nn.Linear(32, 8).to(torch.bfloat16)
    model.weight.requires_grad_(False)
    new = quantize_linear_weights(model, "fp8")
    assert new.weight.dtype == torch.bfloat16 and not new.weight.requires_grad
    assert new.bias.requires_grad


def test_error_grows_with_coarser_format_on_a_linear():
    w = nn.Linear(256, 128).weight.detach()
    errors = [quantization_error(w, f) for f in QUANT_FORMATS]
    assert errors == sorted(errors) and errors[0] == 0.0


def test_shapes_product_helper_consistency():
    # bits for a tensor whose size is not a multiple of the block: same formula (padding not stored)
    for shape in itertools.product((16, 48), (32, 100)):
        assert bits_per_weight("nvfp4", shape) == pytest.approx(4.5 + 32 / (shape[0] * shape[1]))
