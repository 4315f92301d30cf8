"""The hardware table: datasheet entries, format support, the local-CPU estimate and the roofline model."""

from __future__ import annotations

import re

import pytest

from specdec_tune import SpecdecError
from specdec_tune.autotune.hardware import (
    DEVICES,
    DeviceSpec,
    find_device_spec,
    formats_for_capability,
    get_device_spec,
    local_cpu_spec,
    roofline_ms,
    supports,
)

GPUS = ("a100", "h100", "h200", "b200", "l40s", "mi300x")


@pytest.mark.parametrize("key", GPUS)
def test_every_gpu_present_with_positive_figures_and_a_cited_number(key):
    spec = DEVICES[key]
    assert isinstance(spec, DeviceSpec) and spec.key == key
    assert spec.memory_bytes > 0 and spec.memory_bw_bytes_s > 0
    assert spec.peak_flops and all(v > 0 for v in spec.peak_flops.values())
    assert {"fp32", "bf16", "fp16"} <= set(spec.peak_flops)
    assert spec.attention_tile_rows > 0
    assert spec.formats and spec.formats[0] == "none"
    assert not spec.estimated
    assert any(re.search(r"\d", s) for s in spec.sources)
    # Each peak in the table appears (to within rounding) in some source string, so no figure is uncited.
    text = " ".join(spec.sources).replace(",", "")
    cited = {float(x) for x in re.findall(r"\d+(?:\.\d+)?", text)}
    for dtype, flops in spec.peak_flops.items():
        tflops, pflops = flops / 1e12, flops / 1e15
        assert any(abs(c - tflops) < 0.06 or abs(c - pflops) < 0.006 for c in cited), (key, dtype)


def test_vendor_specific_architecture_fields():
    assert DEVICES["h200"].capability == (9, 0) and DEVICES["h200"].arch == "sm_90"
    assert DEVICES["b200"].capability == (10, 0)
    assert DEVICES["l40s"].capability == (8, 9)
    assert DEVICES["mi300x"].capability is None and DEVICES["mi300x"].gfx == "gfx942"
    assert DEVICES["mi300x"].arch == "gfx942"


def test_format_support():
    for key in ("h100", "h200", "b200", "l40s", "mi300x"):
        assert supports(DEVICES[key], "fp8"), key
    assert not supports(DEVICES["a100"], "fp8")
    assert [k for k in GPUS if supports(DEVICES[k], "nvfp4")] == ["b200"]
    assert supports(DEVICES["b200"], "fp4")
    assert all(supports(DEVICES[k], "none") for k in GPUS)


def test_nvidia_formats_follow_the_capability_rule():
    for spec in DEVICES.values():
        if spec.capability is not None:
            assert spec.formats == formats_for_capability(spec.capability), spec.key
    assert formats_for_capability((8, 0)) == ("none",)
    assert formats_for_capability((12, 0)) == ("none", "fp8", "nvfp4")


def test_dense_bf16_ordering_and_bandwidth():
    bf16 = {k: DEVICES[k].peak_flops["bf16"] for k in GPUS}
    assert bf16["a100"] < bf16["h100"] == bf16["h200"] < bf16["b200"]
    # dense, not sparse: H100 SXM bf16 is ~989 TFLOPS, not the 1,979 printed with sparsity
    assert bf16["h100"] == pytest.approx(989.5e12)
    assert DEVICES["h200"].memory_bw_bytes_s > DEVICES["h100"].memory_bw_bytes_s
    assert DEVICES["h200"].memory_bytes > DEVICES["h100"].memory_bytes


def test_get_device_spec_is_case_insensitive_and_errors_name_valid_keys():
    assert get_device_spec("H200") is DEVICES["h200"]
    assert get_device_spec(" Mi300X ") is DEVICES["mi300x"]
    assert get_device_spec("h100-sxm") is DEVICES["h100"]
    assert get_device_spec("CPU").key == "cpu"
    with pytest.raises(SpecdecError) as err:
        get_device_spec("tpu-v5")
    msg = str(err.value)
    assert "tpu-v5" in msg
    for key in GPUS + ("cpu",):
        assert key in err.value.hint


def test_find_device_spec_from_runtime_names():
    assert find_device_spec("NVIDIA H100 80GB HBM3") is DEVICES["h100"]
    assert find_device_spec("NVIDIA H200") is DEVICES["h200"]
    assert find_device_spec("NVIDIA A100-SXM4-80GB") is DEVICES["a100"]
    assert find_device_spec("AMD Instinct MI300X") is DEVICES["mi300x"]
    assert find_device_spec("NVIDIA H100 PCIe") is None  # different figures: no entry rather than a wrong one
    assert find_device_spec("NVIDIA H200 NVL") is None


def test_local_cpu_spec_is_a_labelled_estimate():
    spec = local_cpu_spec()
    assert spec.key == "cpu" and spec.estimated
    assert spec.formats == ("none",)
    assert spec.memory_bytes > 0 and spec.memory_bw_bytes_s > 0
    assert spec.peak_flops["fp32"] > 0 and spec.peak_flops["bf16"] >= spec.peak_flops["fp32"]
    assert "estimate" in " ".join(spec.sources).lower()
    assert any("/proc/cpuinfo" in s for s in spec.sources)
    assert not supports(spec, "fp8")


def test_local_cpu_spec_from_cpuinfo_text(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "".join(
            f"processor\t: {i}\nmodel name\t: Test CPU\ncpu MHz\t\t: 2000.000\nphysical id\t: 0\n"
            "cpu cores\t: 4\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16\n\n"
            for i in range(8)
        )
    )
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\n")
    nofreq = tmp_path / "no_cpufreq"
    spec = local_cpu_spec(threads=8, cpuinfo_path=cpuinfo, meminfo_path=meminfo, cpufreq_path=nofreq)
    # 8 threads but 4 physical cores (SMT): 4 cores x 2 GHz x 64 FLOP/cycle (AVX-512, 2 FMA pipes)
    assert spec.peak_flops["fp32"] == pytest.approx(4 * 2.0e9 * 64)
    assert spec.peak_flops["bf16"] == pytest.approx(2 * spec.peak_flops["fp32"])
    assert spec.memory_bw_bytes_s == pytest.approx(4 * 16e9)
    assert spec.memory_bytes == 16384 * 1024
    assert "Test CPU" in spec.name

    empty = tmp_path / "empty"
    empty.write_text("")
    fallback = local_cpu_spec(threads=2, cpuinfo_path=empty, meminfo_path=empty, cpufreq_path=nofreq)
    assert fallback.peak_flops["fp32"] > 0 and fallback.memory_bytes > 0
    assert "estimate" in " ".join(fallback.sources).lower()


def test_roofline_picks_the_larger_term():
    h200 = DEVICES["h200"]
    # Memory-bound: a decode-sized GEMM, M=1 against an 8192x8192 bf16 weight.
    k = n = 8192
    flops = 2 * 1 * k * n
    bytes_moved = 2 * k * n
    t = roofline_ms(h200, flops, bytes_moved, "bf16")
    assert t == pytest.approx(bytes_moved / h200.memory_bw_bytes_s * 1e3)
    assert t > flops / h200.peak_flops["bf16"] * 1e3
    # Compute-bound: M=8192.
    m = 8192
    flops = 2 * m * k * n
    bytes_moved = 2 * (m * k + k * n + m * n)
    t = roofline_ms(h200, flops, bytes_moved, "bfloat16")
    assert t == pytest.approx(flops / h200.peak_flops["bf16"] * 1e3)
    assert t > bytes_moved / h200.memory_bw_bytes_s * 1e3
    # FP8 halves the compute term on the same device.
    assert roofline_ms(h200, flops, bytes_moved, "fp8") == pytest.approx(t / 2, rel=1e-3)


def test_roofline_rejects_a_dtype_the_device_lacks():
    with pytest.raises(SpecdecError):
        roofline_ms(DEVICES["a100"], 1e9, 1e6, "fp8")
    with pytest.raises(SpecdecError):
        roofline_ms(DEVICES["h100"], 1e9, 1e6, "fp4")
    assert roofline_ms(DEVICES["b200"], 1e12, 1e6, "fp4") > 0


def test_as_record_is_json_ready():
    import json

    rec = DEVICES["b200"].as_record()
    assert json.loads(json.dumps(rec))["formats"] == ["none", "fp8", "nvfp4"]
    assert "dense" in rec["peak_flops_note"]
