"""Weight quantization emulation ("fake quantization") for drafters.

A weight is quantized to a low-precision format and immediately dequantized back to its own dtype,
so the drafter runs on any device (CPU included) while its outputs carry the format's rounding.
This is what the profiler uses to measure a quantized drafter's acceptance length (autotune/cost_model.py,
quantization): accuracy is emulated here. Time is not: emulated weights run at full-precision speed, so
the profiler times drafters in full precision only. A quantized drafter's draft time is the full-precision
time labelled modeled (`autotune.cost_model.CostModel.draft_ms`), or, under `specdec-tune search --device`,
the hardware table's roofline projection for a device that runs the format natively (`specdec_tune.formats`,
`autotune.projection`), also modeled.

Formats (the table: `specdec_tune.formats`)
-------------------------------------------
- ``none``:  identity.
- ``fp8``:   FP8 E4M3 (``float8_e4m3fn``: max 448, 3 mantissa bits, subnormals down to 2^-9) with one
             fp32 scale per output channel (row of an ``[out, in]`` Linear weight).
- ``nvfp4``: NVIDIA FP4: FP4 E2M1 elements (magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} and a sign bit)
             in blocks of 16 consecutive elements along the input (last) dim, one FP8 E4M3 scale per
             block, and one fp32 scale per tensor.

All arithmetic is done in float32 whatever the input dtype; the dequantized result is cast back to
the input dtype. For bf16/fp16 weights that final cast adds the compute dtype's own rounding of
``q * scale`` (real kernels dequantize inside the GEMM at higher precision), an error far below the
format's own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from specdec_tune import SpecdecError
from specdec_tune.formats import NVFP4_BLOCK, WEIGHT_FORMATS, get_format

E4M3_MAX = 448.0  # largest finite float8_e4m3fn magnitude
E2M1_MAX = 6.0  # largest FP4 e2m1 magnitude

# FP4 e2m1 magnitudes indexed by their 3-bit code (exponent 2 bits, mantissa 1 bit = the code's low bit).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --------------------------------------------------------------------------------------------- FP8


def fake_quant_fp8_e4m3(w: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 with a per-output-channel scale, quantized and dequantized back to ``w.dtype``.

    For each row r (all dims but the last are rows; a Linear weight is ``[out, in]``)::

        scale_r = amax_r / 448                      (fp32; a zero row uses scale 1 and stays zero)
        q       = float8_e4m3fn(clamp(w / scale_r, -448, 448))     (torch's cast: round to nearest even)
        w'      = q * scale_r

    The clamp only absorbs the last-ulp overshoot of ``amax / (amax / 448)``; the cast itself would
    saturate on some builds and give NaN on others.
    """
    _check_float(w)
    if w.numel() == 0:
        return w.detach().clone()
    rows = _as_rows(w)  # [R, K] float32
    amax = rows.abs().amax(dim=-1, keepdim=True)  # [R, 1]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # [R, 1]
    q = _round_e4m3(rows / scale)  # [R, K]
    return (q * scale).reshape(w.shape).to(w.dtype)


def _round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest float8_e4m3fn value (ties to even), saturating at ±448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


# ------------------------------------------------------------------------------------------- NVFP4


def fake_quant_nvfp4(w: torch.Tensor) -> torch.Tensor:
    """NVFP4, quantized and dequantized back to ``w.dtype``.

    The last dim is cut into blocks of 16 consecutive elements (zero-padded to a multiple of 16,
    padding stripped afterwards; zeros do not change any amax)::

        global  = amax_tensor / (6 * 448)                  (fp32; 1 when the tensor is all zero)
        s_b     = e4m3(amax_block / 6 / global)            (block scale, <= 448 so it fits E4M3)
        q       = e2m1(clamp(w / (s_b * global), -6, 6))   (0 where s_b rounded to 0)
        w'      = q * s_b * global

    ``e2m1`` rounds to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} (sign kept); a value exactly halfway
    between two neighbours goes to the one whose e2m1 code is even (mantissa bit 0), i.e. the IEEE
    round-half-to-even rule: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. The clamp is
    needed because rounding s_b down can push a block's largest element slightly past 6.
    """
    _check_float(w)
    if w.numel() == 0:
        return w.detach().clone()
    rows = _as_rows(w)  # [R, K] float32
    k = rows.shape[-1]
    blocks = _pad_last(rows, NVFP4_BLOCK).reshape(rows.shape[0], -1, NVFP4_BLOCK)  # [R, NB, 16]
    global_scale = nvfp4_global_scale(rows)  # [] fp32
    block_scale = nvfp4_block_scales(blocks, global_scale)  # [R, NB, 1], on the e4m3 grid
    step = block_scale * global_scale  # [R, NB, 1]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = round_e2m1(blocks / safe) * (step > 0)  # [R, NB, 16]
    out = (q * step).reshape(rows.shape[0], -1)[:, :k]  # [R, K]
    return out.reshape(w.shape).to(w.dtype)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp32 scale ``amax / (6 * 448)``, so every block scale fits in E4M3 (1 for a zero tensor)."""
    amax = x.detach().abs().amax().to(torch.float32)  # []
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def nvfp4_block_scales(blocks: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3-rounded block scales ``e4m3(amax_block / 6 / global)``: ``blocks`` [..., 16] -> [..., 1]."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    return _round_e4m3(amax / E2M1_MAX / global_scale)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest FP4 e2m1 value, ties to the even code, saturating at ±6.

    The code of |x| is the number of midpoints it lies above. Between codes i and i+1 the midpoint
    m_i counts when |x| > m_i if i is even (a tie stays on even i) and when |x| >= m_i if i is odd
    (a tie moves up to even i+1).
    """
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=x.device)  # [8]
    mag = x.abs().clamp(max=E2M1_MAX)
    code = torch.zeros(x.shape, dtype=torch.long, device=x.device)
    for i in range(len(E2M1_GRID) - 1):
        mid = (E2M1_GRID[i] + E2M1_GRID[i + 1]) / 2
        code += (mag > mid) if i % 2 == 0 else (mag >= mid)
    return torch.copysign(grid[code], x)


# --------------------------------------------------------------------------------------- by name


def _identity(w: torch.Tensor) -> torch.Tensor:
    return w


# the emulation of each format of the weight-format table (specdec_tune.formats)
FAKE_QUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": _identity,
    "fp8": fake_quant_fp8_e4m3,
    "nvfp4": fake_quant_nvfp4,
}
assert tuple(FAKE_QUANT) == WEIGHT_FORMATS


def fake_quant(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize-dequantize ``w`` in format ``fmt``; same shape and dtype as ``w``."""
    return FAKE_QUANT[get_format(fmt).name](w)


def quantization_error(w: torch.Tensor, fmt: str) -> float:
    """Relative Frobenius error ``||q(w) - w|| / ||w||`` (0.0 for an all-zero ``w``), for reports."""
    ref = w.detach().to(torch.float32)
    norm = torch.linalg.vector_norm(ref)
    if norm == 0:
        return 0.0
    diff = fake_quant(w.detach(), fmt).to(torch.float32) - ref
    return float(torch.linalg.vector_norm(diff) / norm)


# ----------------------------------------------------------------------------------------- modules


_Module = TypeVar("_Module", bound=nn.Module)


def quantize_linear_weights(module: _Module, fmt: str, skip: tuple[str, ...] = ()) -> _Module:
    """A deep copy of ``module`` whose ``nn.Linear`` weights are fake-quantized in ``fmt``.

    - Only ``nn.Linear`` (and subclasses) weights change; biases, embeddings and norms stay exact.
      The LM head is an ``nn.Linear`` and is quantized too unless ``skip`` names it.
    - ``skip`` holds module-name suffixes: a Linear named ``n`` is left exact when ``n == s`` or
      ``n`` ends with ``"." + s`` for some ``s`` (``skip=("lm_head",)``). Names matching nothing are
      ignored, so one skip list can serve drafters with and without their own head.
    - The original module's tensors are never modified (a drafter may share them with the target).
    - Tied weights: Linears sharing one Parameter keep sharing one quantized Parameter in the copy.
      A Parameter also used by anything else (an ``nn.Embedding``, a skipped Linear, any other
      module) is untied: the quantizing Linears get their own quantized Parameter and the other
      users keep the exact copy.
    """
    get_format(fmt)
    if fmt == "none":
        return copy.deepcopy(module)
    users = _parameter_users(module)  # id(param) -> [(module name, attr name)]
    targets = _linears_to_quantize(module, skip)  # [(name, nn.Linear)]
    target_names = {name for name, _ in targets}

    quantized: dict[int, nn.Parameter] = {}  # id(original weight) -> its quantized Parameter
    for _, linear in targets:
        weight = linear.weight
        if id(weight) not in quantized and weight.is_floating_point() and weight.device.type != "meta":
            with torch.no_grad():
                data = fake_quant(weight.detach(), fmt)
            quantized[id(weight)] = nn.Parameter(data, requires_grad=weight.requires_grad)

    # Weights used only by quantizing Linears are swapped in during the copy (never copied exact);
    # shared ones are copied exact and the quantizing Linears re-pointed afterwards.
    memo: dict[int, object] = {}
    untie: dict[int, nn.Parameter] = {}
    for pid, param in quantized.items():
        only_targets = all(attr == "weight" and name in target_names for name, attr in users.get(pid, []))
        if only_targets:
            memo[pid] = param
        else:
            untie[pid] = param
    new = copy.deepcopy(module, memo)

    new_modules = dict(new.named_modules(remove_duplicate=False))
    for name, linear in targets:
        untied = untie.get(id(linear.weight))
        if untied is not None:
            new_modules[name].weight = untied
    return new


def _linears_to_quantize(module: nn.Module, skip: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """Every (name, nn.Linear) reachable in ``module``, aliases included, minus those ``skip`` names."""
    return [
        (name, m)
        for name, m in module.named_modules(remove_duplicate=False)
        if isinstance(m, nn.Linear) and not _skipped(name, skip)
    ]


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def _parameter_users(module: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """id(Parameter) -> every (module name, attribute) that holds it, across aliased submodules."""
    users: dict[int, list[tuple[str, str]]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None:
                users.setdefault(id(p), []).append((name, attr))
    return users


# ---------------------------------------------------------------------------------------- helpers


def _check_float(w: torch.Tensor) -> None:
    if not torch.is_tensor(w) or not w.is_floating_point():
        raise SpecdecError(
            f"cannot fake-quantize a {getattr(w, 'dtype', type(w).__name__)} tensor",
            "pass a floating-point weight (float32, bfloat16 or float16)",
        )


def _as_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` as float32 rows [R, K]: the last dim is K, all others fold into R (a scalar is [1, 1])."""
    x = w.detach().to(torch.float32)
    return x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim of ``x`` [R, K] up to a multiple of ``multiple`` -> [R, K']."""
    pad = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


__all__ = [
    "E2M1_GRID",
    "FAKE_QUANT",
    "fake_quant",
    "fake_quant_fp8_e4m3",
    "fake_quant_nvfp4",
    "nvfp4_block_scales",
    "nvfp4_global_scale",
    "quantization_error",
    "quantize_linear_weights",
    "round_e2m1",
]
