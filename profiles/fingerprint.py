"""Device fingerprint: what the timings in a profile were measured on, and what makes them stale.

`device_fingerprint` records the accelerator (or CPU), the software stack and the dtype as a
JSON-able dict. `STALENESS_FACTORS` is the one list of those fields whose change invalidates a
profile or a bundle (the factors are listed in one place; exporters/staleness.py adds the bundle's); `device_factors`
picks them and `diff_factors` names the ones that changed.

Everything here is best effort and never fails on a missing tool: a field that cannot be read is None.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import re
import shutil
import subprocess
from pathlib import Path

import torch

from specdec_tune import SpecdecError

# Device fields that make a profile or bundle stale when they change ("engine": the serving engine a profile was
# measured in, e.g. "vllm 0.32.0"; absent from a torch profile). Memory size, CPU flags, the
# Python version and the OS string are recorded for the reader but do not change the timings enough
# (or are implied by the name) to invalidate them.
STALENESS_FACTORS = (
    "kind",
    "name",
    "capability",
    "driver",
    "cuda_runtime",
    "torch",
    "triton",
    "dtype",
    "threads",
    "engine",
)

CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")

_NVIDIA_SMI_TIMEOUT_S = 5.0


# ---------------------------------------------------------------- host (CPU) facts


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _cpuinfo_field(field: str) -> str | None:
    """First value of `field` in /proc/cpuinfo ("model name", "flags"), or None off Linux."""
    for line in _read_text("/proc/cpuinfo").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == field:
            return value.strip()
    return None


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_flags_of_note() -> list[str]:
    flags = set((_cpuinfo_field("flags") or "").split())
    return [f for f in CPU_FLAGS_OF_NOTE if f in flags]


def host_memory_bytes() -> int | None:
    """MemTotal from /proc/meminfo (reported in kB), or None off Linux."""
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", _read_text("/proc/meminfo"), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


# ---------------------------------------------------------------- software versions


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def triton_version() -> str | None:
    return _dist_version("triton", "pytorch-triton")


@functools.lru_cache(maxsize=1)
def nvidia_driver_version() -> str | None:
    """The NVIDIA driver version ("550.54.15"), from the kernel module, pynvml or nvidia-smi; else None.

    torch only exposes the CUDA driver *API* version (an int such as 12040), which is a different
    quantity, so it is not used here.
    """
    for probe in (_driver_from_proc, _driver_from_pynvml, _driver_from_nvidia_smi):
        try:
            version = probe()
        except Exception:  # a probe that breaks just yields nothing
            version = None
        if version:
            return version
    return None


def _driver_from_proc() -> str | None:
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
    match = re.search(r"Kernel Module\s+([0-9][0-9.]+)", _read_text("/proc/driver/nvidia/version"))
    return match.group(1) if match else None


def _driver_from_pynvml() -> str | None:
    import pynvml

    pynvml.nvmlInit()
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return version.decode() if isinstance(version, bytes) else str(version)


def _driver_from_nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    done = subprocess.run(
        [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=_NVIDIA_SMI_TIMEOUT_S,
        check=False,
    )
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return lines[0].strip() if lines else None


# ---------------------------------------------------------------- fingerprint


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _accelerator_fields(device: torch.device) -> dict:
    """kind, name, capability, memory_bytes, driver for the device itself."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "kind": "cuda",
            "name": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "memory_bytes": int(props.total_memory),
            "driver": nvidia_driver_version(),
        }
    return {
        "kind": device.type,
        "name": cpu_model(),
        "capability": None,
        "memory_bytes": host_memory_bytes(),
        "driver": None,  # a CPU profile does not go stale with the GPU driver
    }


def device_fingerprint(device: torch.device, dtype: torch.dtype) -> dict:
    """A JSON-able record of the device, the software stack and the dtype the timings were taken with."""
    return {
        **_accelerator_fields(device),
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version(),
        "cpu_model": cpu_model(),
        "threads": torch.get_num_threads(),
        "cpu_flags_of_note": cpu_flags_of_note(),
        "dtype": dtype_name(dtype),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "engine": None,  # this package's own loop; a serving engine's profile names it ("vllm 0.32.0")
    }


def device_factors(fp: dict) -> dict:
    """The staleness factors of a fingerprint (missing ones read as None)."""
    return {name: fp.get(name) for name in STALENESS_FACTORS}


def diff_factors(old: dict, new: dict) -> list[str]:
    """ "name: old -> new" for each staleness factor that differs; empty when nothing that matters changed."""
    before, after = device_factors(old), device_factors(new)
    return [f"{name}: {before[name]} -> {after[name]}" for name in STALENESS_FACTORS if before[name] != after[name]]


# ---------------------------------------------------------------- device names


def resolve_device(name: str) -> torch.device:
    """ "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N" -> a torch.device."""
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise SpecdecError(f"unknown device {name!r}", "use one of: auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise SpecdecError(
            f"device {name!r} requested but CUDA is not available (torch {torch.__version__})",
            "use --device cpu or auto, or install a CUDA build of torch on a machine with an NVIDIA GPU",
        )
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise SpecdecError(
            f"device {name!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible",
            "pick an index below the device count, or check CUDA_VISIBLE_DEVICES",
        )
    return torch.device(text)


# ---------------------------------------------------------------- the dtype the device computes natively


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 where the device computes it natively (CUDA, AVX-512-BF16/AMX CPUs), else fp32."""
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in table:
        raise SpecdecError(f"unknown dtype {name!r}", "use auto, float32, bfloat16 or float16")
    return table[name]


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
