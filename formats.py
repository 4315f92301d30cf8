"""Weight formats: the one table of what each format stores and which devices run it natively.

Every stage reads it: the profiler emulates each format's rounding (`profiles.drafters.quant`), the hardware table
says which devices run which format and what its GEMMs cost there (`autotune.hardware`, `autotune.projection`).

- ``none``:  unquantized weights in the compute dtype (16 bits assumed for bf16/fp16).
- ``fp8``:   FP8 E4M3 with one fp32 scale per output channel; tensor cores from sm_89 (Ada, Hopper).
- ``nvfp4``: FP4 E2M1 in blocks of 16 along the input dim, one E4M3 scale per block, one fp32 scale per tensor;
             tensor cores from sm_100 (Blackwell).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specdec_tune import SpecdecError

NVFP4_BLOCK = 16  # elements per NVFP4 block scale, along the last dim


@dataclass(frozen=True)
class WeightFormat:
    """One weight format: what it costs in storage and where it runs natively.

    ``element_bits`` is the stored width of one weight; ``scale_bits`` / ``scale_group`` is the scale overhead per
    weight when one scale covers ``scale_group`` weights (``None`` = one per row, i.e. the row length);
    ``tensor_scale_bits`` is the per-tensor overhead. ``min_capability`` is the CUDA compute capability from which
    tensor cores run the format (``None`` = everywhere); ``compute_dtype`` the dtype its GEMMs run in there.
    """

    name: str
    element_bits: int
    scale_bits: int
    scale_group: int | None
    tensor_scale_bits: int
    min_capability: tuple[int, int] | None
    compute_dtype: str
    description: str

    def bits_per_weight(self, shape: Sequence[int] | None = None) -> float:
        """Average stored bits per weight, scales included; without ``shape`` the per-tensor and per-row terms
        (which vanish for large tensors) are left out."""
        bits = float(self.element_bits)
        if shape is None or len(shape) == 0:
            return bits + (self.scale_bits / self.scale_group if self.scale_group else 0.0)
        numel = max(1, math.prod(int(d) for d in shape))
        group = self.scale_group or max(1, int(shape[-1]))
        return bits + (self.scale_bits / group if self.scale_bits else 0.0) + self.tensor_scale_bits / numel


FORMATS: dict[str, WeightFormat] = {
    "none": WeightFormat(
        name="none",
        element_bits=16,
        scale_bits=0,
        scale_group=None,
        tensor_scale_bits=0,
        min_capability=None,
        compute_dtype="bf16",
        description="unquantized weights in the compute dtype (16 bits assumed for bf16/fp16)",
    ),
    "fp8": WeightFormat(
        name="fp8",
        element_bits=8,
        scale_bits=32,
        scale_group=None,
        tensor_scale_bits=0,
        min_capability=(8, 9),
        compute_dtype="fp8",
        description="FP8 E4M3 weights with one fp32 scale per output channel (sm_89+ natively)",
    ),
    "nvfp4": WeightFormat(
        name="nvfp4",
        element_bits=4,
        scale_bits=8,
        scale_group=NVFP4_BLOCK,
        tensor_scale_bits=32,
        min_capability=(10, 0),
        compute_dtype="nvfp4",
        description=(
            "NVFP4: FP4 E2M1 weights, an E4M3 scale per 16 weights, an fp32 scale per tensor (sm_100+ natively)"
        ),
    ),
}

WEIGHT_FORMATS = tuple(FORMATS)  # in the order the search tries them


def get_format(fmt: str) -> WeightFormat:
    """The table's entry for ``fmt``; an unknown name is a SpecdecError naming the known ones."""
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise SpecdecError(f"unknown quantization format {fmt!r}", f"use one of: {', '.join(WEIGHT_FORMATS)}") from None


def bits_per_weight(fmt: str, shape: Sequence[int] | None = None) -> float:
    """Average stored bits per weight of ``fmt`` (see `WeightFormat.bits_per_weight`)."""
    return get_format(fmt).bits_per_weight(shape)


def supported_natively(fmt: str, capability: tuple[int, int] | None) -> bool:
    """Whether a device of CUDA compute ``capability`` runs ``fmt`` in hardware (``None``: no CUDA device, where
    only ``none`` is native)."""
    need = get_format(fmt).min_capability
    if need is None:
        return True
    return capability is not None and tuple(capability) >= need
