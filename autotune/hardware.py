"""The hardware table: datasheet figures for the common accelerators, and an estimate for the local CPU.

It serves two purposes:

* modelling the time of what is not measured here: `--device h200`-style planning for a device you do not
  have, including a quantized drafter's time on a device that runs its format (the profile times drafters in
  full precision only). Everything derived from this table is **modeled**, never measured, and the callers
  label it so;
* saying what a device can run at all (`formats`, `supports`): FP8 needs sm_89 or later, NVFP4 needs the
  FP4 tensor cores of sm_100 or later, so the search never proposes a format the device cannot run.

Conventions of the table:

* `peak_flops` are **dense** tensor-core (matrix) peaks in FLOP/s, without 2:4 structured sparsity. Where a
  datasheet gives only the sparse figure (NVIDIA marks them "with sparsity"), it is halved and the source
  string says so. `fp32` is the non-tensor (CUDA-core / vector) figure the datasheet prints.
* `memory_bytes` takes the datasheet's "GB" as 10^9 bytes; the usable figure the driver reports differs and
  the device fingerprint records that one. `memory_bw_bytes_s` is the datasheet peak (TB/s = 10^12 B/s);
  sustained bandwidth is lower, which is one reason a model is a floor and a measurement wins.
* each entry's `sources` cites the document and the figures taken from it; "(not confirmed here)" marks a
  figure that could not be checked against a copy of the document while this table was written.

The table is data: adding a device is adding an entry, nothing else changes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_tune import SpecdecError
from specdec_tune.formats import WEIGHT_FORMATS, supported_natively

TERA = 1e12
GIGA = 1e9

#: Names callers may use for a dtype, mapped to the table's keys.
DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "tf32": "tf32",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e4m3fnuz": "fp8",
    "e4m3": "fp8",
    "fp4": "nvfp4",
    "nvfp4": "nvfp4",
    "float4": "nvfp4",
}


@dataclass(frozen=True)
class DeviceSpec:
    """One device's figures. All peaks are dense (no 2:4 sparsity); see the module docstring."""

    key: str
    name: str
    vendor: str
    #: NVIDIA compute capability, e.g. (9, 0); None for AMD and CPUs.
    capability: tuple[int, int] | None
    memory_bytes: int
    memory_bw_bytes_s: float
    #: dtype -> dense peak FLOP/s (keys among fp32, tf32, bf16, fp16, fp8, nvfp4).
    peak_flops: dict[str, float] = field(hash=False)
    #: Query rows one attention tile processes (guideline 3: prefer G*(1+D) a multiple of it).
    #: 1 means no tile quantization, so the guideline is neutral.
    attention_tile_rows: int
    sources: tuple[str, ...]
    #: Weight formats the device runs natively, among WEIGHT_FORMATS; empty: what an NVIDIA part of its
    #: compute capability runs (`formats_for_capability`).
    formats: tuple[str, ...] = ()
    #: AMD ISA name, e.g. "gfx942"; None elsewhere.
    gfx: str | None = None
    #: True when the figures are estimates rather than datasheet values (the local CPU).
    estimated: bool = False
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.formats:
            object.__setattr__(self, "formats", formats_for_capability(self.capability))

    @property
    def arch(self) -> str:
        """A short architecture label: "sm_90", "gfx942" or "cpu"."""
        if self.capability is not None:
            return f"sm_{self.capability[0]}{self.capability[1]}"
        return self.gfx or self.vendor.lower()

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` (aliases such as "bfloat16" or "fp4" accepted)."""
        key = _dtype_key(dtype)
        if key not in self.peak_flops:
            raise SpecdecError(
                f"{self.name} has no {dtype} peak in the hardware table",
                f"use one of: {', '.join(sorted(self.peak_flops))}",
            )
        return self.peak_flops[key]

    def as_record(self) -> dict[str, Any]:
        """JSON-ready dict, for writing into a profile or plan next to the figures it produced."""
        return {
            "key": self.key,
            "name": self.name,
            "vendor": self.vendor,
            "capability": list(self.capability) if self.capability else None,
            "gfx": self.gfx,
            "memory_bytes": self.memory_bytes,
            "memory_bw_bytes_s": self.memory_bw_bytes_s,
            "peak_flops": dict(self.peak_flops),
            "peak_flops_note": "dense (no 2:4 sparsity)",
            "attention_tile_rows": self.attention_tile_rows,
            "formats": list(self.formats),
            "estimated": self.estimated,
            "sources": list(self.sources),
            "notes": list(self.notes),
        }


def _dtype_key(dtype: str) -> str:
    d = str(dtype).strip().lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(d, d)


def _tf(**tflops: float) -> dict[str, float]:
    """TFLOPS figures -> FLOP/s dict."""
    return {k: v * TERA for k, v in tflops.items()}


def formats_for_capability(capability: tuple[int, int] | None) -> tuple[str, ...]:
    """Weight formats an NVIDIA part of this compute capability runs natively (the rule, for parts not in
    the table). None (non-NVIDIA, unknown) -> ("none",)."""
    return tuple(f for f in WEIGHT_FORMATS if supported_natively(f, capability))


# ---------------------------------------------------------------------------------------------------------
# The table. Per-GPU figures, SXM/OAM board variants unless the name says otherwise.
# ---------------------------------------------------------------------------------------------------------

_NVIDIA_ATTN_TILE = (
    "attention tile: 128 query rows, the M tile of FlashAttention-2/3 forward kernels on sm_80..sm_100 "
    "(guideline 3: autotune/plan.py)"
)

_TABLE: tuple[DeviceSpec, ...] = (
    DeviceSpec(
        key="a100",
        name="NVIDIA A100-SXM4-80GB",
        vendor="NVIDIA",
        capability=(8, 0),
        memory_bytes=int(80 * GIGA),
        memory_bw_bytes_s=2.039 * TERA,
        peak_flops=_tf(fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0),
        attention_tile_rows=128,
        sources=(
            "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), A100 80GB SXM column: FP32 19.5 TFLOPS; "
            "TF32 156 TFLOPS (312 with sparsity); BF16 312 TFLOPS (624 with sparsity); FP16 312 TFLOPS "
            "(624 with sparsity); 80 GB HBM2e; 2,039 GB/s. Dense figures used as printed. No FP8 tensor cores.",
            _NVIDIA_ATTN_TILE,
        ),
    ),
    DeviceSpec(
        key="h100",
        name="NVIDIA H100 SXM5 80GB",
        vendor="NVIDIA",
        capability=(9, 0),
        memory_bytes=int(80 * GIGA),
        memory_bw_bytes_s=3.35 * TERA,
        peak_flops=_tf(fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979.0),
        attention_tile_rows=128,
        sources=(
            "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 SXM column: "
            "FP32 67 TFLOPS; TF32 989 TFLOPS with sparsity -> 494.5 dense; BF16 1,979 with sparsity -> 989.5 "
            "dense; FP16 1,979 with sparsity -> 989.5 dense; FP8 3,958 with sparsity -> 1,979 dense; "
            "80 GB HBM3; 3.35 TB/s.",
            _NVIDIA_ATTN_TILE,
        ),
    ),
    DeviceSpec(
        key="h200",
        name="NVIDIA H200 SXM 141GB",
        vendor="NVIDIA",
        capability=(9, 0),
        memory_bytes=int(141 * GIGA),
        memory_bw_bytes_s=4.8 * TERA,
        peak_flops=_tf(fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979.0),
        attention_tile_rows=128,
        sources=(
            "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column: "
            "141 GB HBM3e; 4.8 TB/s; FP32 67 TFLOPS; TF32 989 TFLOPS with sparsity -> 494.5 dense; BF16/FP16 "
            "1,979 with sparsity -> 989.5 dense; FP8 3,958 TFLOPS with sparsity -> 1,979 dense "
            "(same GH100 compute as H100 SXM).",
            _NVIDIA_ATTN_TILE,
        ),
    ),
    DeviceSpec(
        key="b200",
        name="NVIDIA B200 (HGX B200, 180GB)",
        vendor="NVIDIA",
        capability=(10, 0),
        memory_bytes=int(180 * GIGA),
        memory_bw_bytes_s=7.7 * TERA,
        peak_flops=_tf(fp32=75.0, tf32=1100.0, bf16=2250.0, fp16=2250.0, fp8=4500.0, nvfp4=9000.0),
        attention_tile_rows=128,
        sources=(
            "NVIDIA HGX platform specifications (nvidia.com/en-us/data-center/hgx), HGX B200 per-GPU column: "
            "FP4 Tensor Core 18 PFLOPS with sparsity -> 9 dense; FP8/FP6 9 PFLOPS with sparsity -> 4.5 dense; "
            "FP16/BF16 4.5 PFLOPS with sparsity -> 2.25 dense; TF32 2.2 PFLOPS with sparsity -> 1.1 dense; "
            "FP32 75 TFLOPS; 180 GB HBM3E; 7.7 TB/s.",
            "NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200): 64 TB/s HBM3e for 8 GPUs "
            "(8 TB/s each) in earlier revisions; the table keeps the lower 7.7 TB/s of the HGX page.",
            _NVIDIA_ATTN_TILE,
        ),
    ),
    DeviceSpec(
        key="l40s",
        name="NVIDIA L40S 48GB",
        vendor="NVIDIA",
        capability=(8, 9),
        memory_bytes=int(48 * GIGA),
        memory_bw_bytes_s=864 * GIGA,
        peak_flops=_tf(fp32=91.6, tf32=183.0, bf16=362.05, fp16=362.05, fp8=733.0),
        attention_tile_rows=128,
        sources=(
            "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): FP32 91.6 TFLOPS; TF32 183 | 366 "
            "with sparsity; BF16 362.05 | 733 with sparsity; FP16 362.05 | 733 with sparsity; FP8 733 | 1,466 "
            "with sparsity (dense figures used as printed); 48 GB GDDR6 with ECC; 864 GB/s.",
            _NVIDIA_ATTN_TILE,
        ),
    ),
    DeviceSpec(
        key="mi300x",
        name="AMD Instinct MI300X OAM 192GB",
        vendor="AMD",
        capability=None,
        gfx="gfx942",
        memory_bytes=int(192 * GIGA),
        memory_bw_bytes_s=5.3 * TERA,
        peak_flops=_tf(fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9),
        attention_tile_rows=128,
        formats=("none", "fp8"),
        sources=(
            "AMD Instinct MI300X accelerator data sheet (amd.com/en/products/accelerators/instinct/mi300/"
            "mi300x.html): peak FP16 and BF16 1,307.4 TFLOPS dense (2,614.9 with structured sparsity); peak FP8 "
            "2,614.9 TFLOPS dense (5,229.8 with structured sparsity); 192 GB HBM3; 5.3 TB/s.",
            "Same data sheet: peak FP32 matrix 163.4 TFLOPS and TF32 653.7 TFLOPS dense (not confirmed here).",
            "attention tile: 128 query rows is an assumption taken from the CK-tile FMHA forward kernels "
            "(xformers hip_fmha ck_tiled_fmha_fwd_setting.h: FmhaFwdBlockTile M = 128 for head_dim 64..256), "
            "not a datasheet figure.",
        ),
        notes=("MI300X FP8 is the FNUZ variant (float8_e4m3fnuz), not OCP e4m3fn; checkpoints convert.",),
    ),
)

#: key -> spec, for every GPU in the table. The local CPU is `local_cpu_spec()` (it depends on the machine).
DEVICES: dict[str, DeviceSpec] = {spec.key: spec for spec in _TABLE}

#: Other spellings accepted by `get_device_spec`.
DEVICE_ALIASES: dict[str, str] = {
    "a100-80gb": "a100",
    "a100-sxm": "a100",
    "a100-sxm4-80gb": "a100",
    "h100-sxm": "h100",
    "h100-sxm5": "h100",
    "h200-sxm": "h200",
    "hgx-b200": "b200",
    "mi300": "mi300x",
    "local": "cpu",
    "host": "cpu",
}

#: Substrings of the name a runtime reports (torch.cuda.get_device_name) -> table key. Checked in order;
#: a PCIe/NVL variant is deliberately absent: its figures differ, so it gets no entry rather than a wrong one.
RUNTIME_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bA100[- ]SXM4?[- ]80GB\b", "a100"),
    (r"\bH100 80GB HBM3\b|\bH100[- ]SXM", "h100"),
    (r"\bH200\b(?!.*NVL)", "h200"),
    (r"\bB200\b", "b200"),
    (r"\bL40S\b", "l40s"),
    (r"\bMI300X\b", "mi300x"),
)


def valid_device_keys() -> list[str]:
    return sorted(DEVICES) + ["cpu"]


def get_device_spec(key: str) -> DeviceSpec:
    """The spec for a table key (case-insensitive; "cpu" is the local CPU's estimate)."""
    k = str(key).strip().lower().replace("_", "-")
    k = DEVICE_ALIASES.get(k, k)
    if k == "cpu":
        return local_cpu_spec()
    if k not in DEVICES:
        raise SpecdecError(
            f"unknown device {key!r} for the hardware table",
            f"use one of: {', '.join(valid_device_keys())}",
        )
    return DEVICES[k]


def find_device_spec(runtime_name: str) -> DeviceSpec | None:
    """The table entry for a name as the runtime reports it ("NVIDIA H100 80GB HBM3"), or None."""
    for pattern, key in RUNTIME_NAME_PATTERNS:
        if re.search(pattern, runtime_name, flags=re.IGNORECASE):
            return DEVICES[key]
    return None


def supports(spec: DeviceSpec, fmt: str) -> bool:
    """Whether `spec` runs weight format `fmt` natively: "none" (unquantized), "fp8", "nvfp4" ("fp4" is
    accepted for "nvfp4"; "bf16"/"fp16" mean unquantized weights, i.e. "none")."""
    f = str(fmt).strip().lower()
    f = {"fp4": "nvfp4", "bf16": "none", "fp16": "none", "": "none"}.get(f, f)
    return f in spec.formats


def roofline_ms(spec: DeviceSpec, flops: float, bytes_moved: float, dtype: str) -> float:
    """Modeled time floor, in ms, of one kernel or step: max(flops / peak[dtype], bytes / bandwidth).

    A roofline **model**, never a measurement: it assumes the datasheet peaks are reached and ignores launch
    overhead, tile quantization, and the overlap limits of real kernels, so real times are at or above it.
    Whatever it feeds is labelled `modeled`.
    """
    if flops < 0 or bytes_moved < 0:
        raise SpecdecError(
            f"roofline_ms needs non-negative work, got flops={flops}, bytes={bytes_moved}",
            "pass the FLOPs and bytes of one kernel or step",
        )
    compute_s = flops / spec.peak(dtype)
    memory_s = bytes_moved / spec.memory_bw_bytes_s
    return max(compute_s, memory_s) * 1e3


# ---------------------------------------------------------------------------------------------------------
# The local CPU: no datasheet here, so every figure but the memory size is an estimate.
# ---------------------------------------------------------------------------------------------------------

#: SIMD rules, first match wins: (cpuinfo flags that must all be present, fp32 FLOP/cycle/core, explanation).
#: An FMA counts 2 FLOPs. The figures assume two FMA pipes of the full vector width, so they are an upper
#: bound on throughput (the modeled time is a floor): parts with one 512-bit FMA port, or AVX-512 run on
#: 256-bit pipes (AMD Zen 4), reach half of the AVX-512 figure.
CPU_FP32_RULES: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("avx512f",), 64, "AVX-512: 16 fp32 lanes x 2 (FMA) x 2 FMA pipes = 64 FLOP/cycle/core"),
    (("avx2", "fma"), 32, "AVX2+FMA: 8 fp32 lanes x 2 (FMA) x 2 FMA pipes = 32 FLOP/cycle/core"),
    (("avx",), 16, "AVX: 8 fp32 lanes x (1 add + 1 mul pipe) = 16 FLOP/cycle/core"),
    (("sse2",), 8, "SSE2: 4 fp32 lanes x (1 add + 1 mul pipe) = 8 FLOP/cycle/core"),
    (("asimd",), 16, "Arm NEON: 4 fp32 lanes x 2 (FMA) x 2 pipes = 16 FLOP/cycle/core"),
)
#: bf16 rules: (flags, multiplier of the fp32 figure or absolute FLOP/cycle/core, explanation).
CPU_BF16_RULES: tuple[tuple[tuple[str, ...], str, float, str], ...] = (
    (("amx_bf16",), "abs", 1024.0, "AMX-BF16: 1,024 bf16 FLOP/cycle/core (Intel's Sapphire Rapids figure)"),
    (("avx512_bf16",), "mul", 2.0, "AVX512-BF16 (VDPBF16PS): 2 bf16 products per fp32 lane = 2x fp32"),
)
#: Used when /proc/cpuinfo gives no frequency.
CPU_FALLBACK_HZ = 2.0e9
#: Used when /proc/cpuinfo gives no recognised SIMD flag (a deliberately low figure).
CPU_FALLBACK_FP32_FLOP_PER_CYCLE = 8
#: Sustained DRAM read bandwidth assumed per core in use, capped at a socket-level figure. Not measured:
#: a STREAM-like per-core figure for a recent server core; the profile's measured curves supersede it.
CPU_BW_PER_CORE_BYTES_S = 16 * GIGA
CPU_BW_CAP_BYTES_S = 200 * GIGA
#: Used when /proc/meminfo cannot be read.
CPU_FALLBACK_MEMORY_BYTES = 8 * 1024**3


def _parse_cpuinfo(text: str) -> dict[str, Any]:
    """First processor's model, flags and MHz; logical CPU count; physical cores (cpu cores x sockets)."""
    info: dict[str, Any] = {"model": None, "flags": set(), "mhz": None, "logical": 0}
    sockets: set[str] = set()
    cores_per_socket = None
    for line in text.splitlines():
        if ":" not in line:
            continue
        k, _, v = line.partition(":")
        k, v = k.strip().lower(), v.strip()
        if k == "processor":
            info["logical"] += 1
        elif k == "model name" and info["model"] is None:
            info["model"] = v
        elif k in ("flags", "features") and not info["flags"]:
            info["flags"] = set(v.lower().split())
        elif k == "cpu mhz" and info["mhz"] is None:
            try:
                info["mhz"] = float(v)
            except ValueError:
                pass
        elif k == "physical id":
            sockets.add(v)
        elif k == "cpu cores" and cores_per_socket is None:
            try:
                cores_per_socket = int(v)
            except ValueError:
                pass
    info["physical"] = cores_per_socket * max(1, len(sockets)) if cores_per_socket else None
    return info


def _read(path: str | os.PathLike[str]) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _max_freq_hz(path: str | os.PathLike[str]) -> float | None:
    """cpufreq's maximum, where sysfs exposes it (often absent in VMs)."""
    txt = _read(path).strip()
    try:
        return float(txt) * 1e3 if txt else None  # kHz
    except ValueError:
        return None


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_clock_hz(cpufreq_path: str | os.PathLike[str], mhz: float | None) -> tuple[float, str]:
    """The clock the peak counts with, and where it came from: cpufreq's maximum, else /proc/cpuinfo's current MHz."""
    hz = _max_freq_hz(cpufreq_path)
    if hz:
        return hz, f"{hz / 1e9:.2f} GHz cpufreq max"
    if mhz:
        return mhz * 1e6, f"{mhz / 1e3:.2f} GHz from 'cpu MHz' (current clock, not boost)"
    return CPU_FALLBACK_HZ, f"{CPU_FALLBACK_HZ / 1e9:.2f} GHz assumed (no frequency in /proc/cpuinfo)"


def _simd_flop_per_cycle(flags: set[str]) -> tuple[float, str, float, str]:
    """(fp32 FLOP per cycle per core, why; bf16's, why) from the CPU's SIMD flags (CPU_FP32_RULES, CPU_BF16_RULES)."""
    fp32_cyc, fp32_txt = CPU_FALLBACK_FP32_FLOP_PER_CYCLE, "no SIMD flag recognised: 8 FLOP/cycle/core assumed"
    for need, per_cycle, why in CPU_FP32_RULES:
        if all(f in flags for f in need):
            fp32_cyc, fp32_txt = per_cycle, why
            break
    bf16_cyc, bf16_txt = float(fp32_cyc), "no bf16 instructions: bf16 peak taken as the fp32 peak"
    for need, kind, value, why in CPU_BF16_RULES:
        if all(f in flags for f in need):
            bf16_cyc, bf16_txt = (value if kind == "abs" else fp32_cyc * value), why
            break
    return fp32_cyc, fp32_txt, bf16_cyc, bf16_txt


def local_cpu_spec(
    threads: int | None = None,
    *,
    cpuinfo_path: str | os.PathLike[str] = "/proc/cpuinfo",
    meminfo_path: str | os.PathLike[str] = "/proc/meminfo",
    cpufreq_path: str | os.PathLike[str] = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq",
) -> DeviceSpec:
    """An **estimate** of the local CPU's figures (key "cpu").

    Peak FLOP/s = cores x frequency x SIMD FLOP/cycle (CPU_FP32_RULES / CPU_BF16_RULES) from /proc/cpuinfo;
    memory bandwidth = CPU_BW_PER_CORE_BYTES_S x cores (capped); memory size from /proc/meminfo. `threads` is
    the number of threads the timed run uses (e.g. torch.get_num_threads()); it defaults to the CPUs this
    process may run on. SMT siblings share FMA pipes, so cores are capped at the physical count.
    """
    info = _parse_cpuinfo(_read(cpuinfo_path))
    flags: set[str] = info["flags"]
    parts: list[str] = []

    cores = int(threads) if threads and threads > 0 else _usable_cpus()
    if info["physical"]:
        cores = min(cores, info["physical"])
    cores = max(1, cores)
    parts.append(f"{cores} core(s)" + (f" of {info['physical']} physical" if info["physical"] else ""))

    hz, clock_txt = _cpu_clock_hz(cpufreq_path, info["mhz"])
    fp32_cyc, rule_txt, bf16_cyc, bf16_txt = _simd_flop_per_cycle(flags)
    parts += [clock_txt, rule_txt, bf16_txt]

    peak_fp32 = cores * hz * fp32_cyc
    peak_bf16 = cores * hz * bf16_cyc
    bw = min(cores * CPU_BW_PER_CORE_BYTES_S, CPU_BW_CAP_BYTES_S)

    mem = None
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", _read(meminfo_path), flags=re.MULTILINE)
    if m:
        mem = int(m.group(1)) * 1024
    mem_txt = "memory size from /proc/meminfo MemTotal" if mem else "memory size unknown: 8 GiB assumed"

    model = info["model"] or "unknown CPU"
    sources = (
        f"estimated from /proc/cpuinfo ({model}; " + "; ".join(parts) + f"): peak fp32 {peak_fp32 / GIGA:.0f} "
        f"GFLOP/s, bf16 {peak_bf16 / GIGA:.0f} GFLOP/s, an upper-bound estimate (two full-width FMA pipes "
        "assumed), not a datasheet figure",
        f"memory bandwidth estimate: {CPU_BW_PER_CORE_BYTES_S / GIGA:.0f} GB/s per core x {cores} = "
        f"{bw / GIGA:.0f} GB/s (assumed, not measured; the profile's measured curves supersede it)",
        mem_txt,
    )
    return DeviceSpec(
        key="cpu",
        name=f"local CPU ({model})",
        vendor="CPU",
        capability=None,
        memory_bytes=mem or CPU_FALLBACK_MEMORY_BYTES,
        memory_bw_bytes_s=bw,
        peak_flops={"fp32": peak_fp32, "bf16": peak_bf16},
        attention_tile_rows=1,
        formats=("none",),
        sources=sources,
        estimated=True,
        notes=("attention_tile_rows=1: CPU attention has no tensor-core tile, guideline 3 is neutral",),
    )


__all__ = [
    "DEVICES",
    "DEVICE_ALIASES",
    "DTYPE_ALIASES",
    "WEIGHT_FORMATS",
    "DeviceSpec",
    "find_device_spec",
    "formats_for_capability",
    "get_device_spec",
    "local_cpu_spec",
    "roofline_ms",
    "supports",
    "valid_device_keys",
]
