"""Memory-aware plans: the memory model against hand computations on real shapes, the search keeping every bucket
inside the budget, the bundle's engine fields, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from specdec_tune import SpecdecError
from specdec_tune.autotune.hardware import get_device_spec
from specdec_tune.autotune.memory import MemoryModel
from specdec_tune.autotune.projection import projected_memory
from specdec_tune.autotune.search import search
from specdec_tune.profiles.memory import memory_record
from specdec_tune.profiles.models.folders import model_folder
from specdec_tune.profiles.schema import Profile, load_profile
from specdec_tune.records import sha256_file
from specdec_tune.settings import ExportSettings, SearchSettings

PROFILE_PATH = Path(__file__).parent / "data" / "demo_profile.json"
LLAMA_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
LLAMA_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
DRAFT_MODEL = {
    "name": "draft_model",
    "kind": "serial",
    "model": {"layers": 32, "shares_target_weights": False},
    "options": {"model": "llama-8b"},
}
NGRAM = {"name": "ngram", "kind": "model_free", "model": None, "options": {}}


def _record(config: dict, dtype: str, device_bytes: int, drafters=(NGRAM,), own=None) -> dict:
    return memory_record(
        config, dtype, list(drafters), {"kind": "cuda", "memory_bytes": device_bytes}, [1], 1, own or {}
    )


def test_the_demo_target_matches_a_hand_computation():
    config = model_folder(None)[
        2
    ]  # smollm2-135m: hidden 576, 30 layers, 9 heads / 3 KV heads of 64, intermediate 1536, 49152 tokens, tied
    record = memory_record(config, "float32", [NGRAM], {"kind": "cpu", "memory_bytes": 25_000_000_000}, [1, 8], 3)
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536  # q, o; k, v; gate, up, down
    params = 49152 * 576 + 30 * per_layer + (2 * 30 + 1) * 576  # embeddings (the head is tied), layers, norms
    assert record["target"]["params"] == params == 134_515_008
    assert record["target"]["weights_bytes"]["none"] == 4 * params
    assert record["target"]["kv_bytes_per_token"] == 2 * 30 * 192 * 4 == 46_080
    per_row = 4 * 49152 + 4 * (2 * 576 + 576 + 2 * 192 + 2 * 1536)
    assert record["activation_bytes_per_row"] == per_row == 217_344
    model = MemoryModel(record, fraction=0.9)
    # ctx 512, no speculation: floor((0.9 · 25e9 − 538 060 032) / (513 · 46 080 + 217 344)) = floor(920.6)
    assert model.max_concurrency(512, 0) == math.floor((0.9 * 25e9 - 4 * params) / (513 * 46_080 + per_row)) == 920
    assert model.need(920, 512, 0).fits and not model.need(921, 512, 0).fits


def test_an_8b_llama_on_an_h100_matches_a_hand_computation():
    h100 = get_device_spec("h100")
    model = MemoryModel(_record(LLAMA_8B, "bfloat16", h100.memory_bytes), fraction=0.9)
    weights = 2 * 8_030_261_248  # 8.03 B parameters in bf16
    kv = 2 * 32 * 8 * 128 * 2  # 131 072 bytes per token
    per_row = 4 * 128256 + 2 * (2 * 4096 + 4096 + 2 * 1024 + 2 * 14336)
    assert model.weights_bytes("none", "none") == weights and model.kv_bytes_per_token("none") == kv
    # ctx 4096: (0.9 · 80e9 − 16.06e9) / (4097 · 131 072 + 599 040) = 104.05
    assert model.max_concurrency(4096, 0) == math.floor((72e9 - weights) / (4097 * kv + per_row)) == 104
    # n-gram at D = 4 reserves 4 more slots per request and its activations grow to 5 rows
    assert model.max_concurrency(4096, 4, "ngram") == math.floor((72e9 - weights) / (4101 * kv + 5 * per_row)) == 103


def test_a_70b_llama_over_eight_gpus_matches_a_hand_computation():
    h200, h100 = get_device_spec("h200"), get_device_spec("h100")
    weights_per_gpu = 2 * 70_553_706_496 / 8
    kv_per_gpu = 2 * 80 * 8 * 128 * 2 / 8  # 8 KV heads, one per GPU: 40 960 bytes per token
    per_row = (4 * 128256 + 2 * (2 * 8192 + 8192 + 2 * 1024 + 2 * 28672)) / 8
    on_h200 = MemoryModel(_record(LLAMA_70B, "bfloat16", h200.memory_bytes), fraction=0.9, tensor_parallel=8)
    assert (
        on_h200.max_concurrency(4096, 0)
        == math.floor((0.9 * 141e9 - weights_per_gpu) / (4097 * kv_per_gpu + per_row))
        == 650
    )
    assert (
        MemoryModel(_record(LLAMA_70B, "bfloat16", h200.memory_bytes), fraction=0.9).max_concurrency(4096, 0) == 0
    )  # 141 GB of weights: one GPU holds none
    # with an 8B draft model (its own weights and KV) at D = 4 on 8 x H100: batch 256 fits without speculation only
    own = {"draft_model": LLAMA_8B}
    on_h100 = MemoryModel(
        _record(LLAMA_70B, "bfloat16", h100.memory_bytes, (NGRAM, DRAFT_MODEL), own), fraction=0.9, tensor_parallel=8
    )
    assert (
        on_h100.max_concurrency(4096, 0) == math.floor((72e9 - weights_per_gpu) / (4097 * kv_per_gpu + per_row)) == 323
    )
    both = (2 * 70_553_706_496 + 2 * 8_030_261_248) / 8
    kv_both = kv_per_gpu + 2 * 32 * 8 * 128 * 2 / 8
    assert (
        on_h100.max_concurrency(4096, 4, "draft_model")
        == math.floor((72e9 - both) / (4101 * kv_both + 5 * per_row))
        == 222
    )
    assert on_h100.need(256, 4096, 0).fits and not on_h100.need(256, 4096, 4, "draft_model").fits


def _without_top_bucket(profile: Profile, top: int) -> Profile:
    data = profile.model_dump(mode="json")
    data["workload"]["batch_buckets"] = [b for b in data["workload"]["batch_buckets"] if b < top]
    for key in ("verify", "draft", "host"):
        data[key] = [p for p in data[key] if p["batch"] < top]
    return Profile.model_validate(data)


def test_a_top_bucket_that_fits_only_without_speculation_is_planned_without_it(tmp_path):
    profile = _without_top_bucket(load_profile(PROFILE_PATH), 16)
    free = search(profile, "0" * 64, SearchSettings(out_dir=tmp_path / "free", trials=60)).to_json()
    top = free["buckets"][-1]
    assert (
        top["draft_len"] > 0 and free["memory"]["fraction"] == 0.9
    )  # precondition: speculation pays at the top bucket
    model = MemoryModel(profile.memory)
    plain = model.need(top["batch"], free["ctx"], 0).total_bytes
    fraction = (plain + 1) / model.device_bytes  # room for the top bucket's plain step and not one slot more
    tight = search(
        profile,
        "0" * 64,
        SearchSettings(
            out_dir=tmp_path / "tight", trials=60, mechanisms=(free["mechanism"],), memory_fraction=fraction
        ),
    ).to_json()
    last = tight["buckets"][-1]
    assert last["batch"] == top["batch"] and last["draft_len"] == 0 and last["rationale"]["guideline"] == "memory"
    assert "does not fit in memory" in last["rationale"]["text"] and "available" in last["rationale"]["text"]
    assert last["memory"]["max_concurrency"] == top["batch"] and any(b["draft_len"] for b in tight["buckets"][:-1])
    per_d = tight["memory"]["max_concurrency"][f"{free['mechanism']}/none"]
    assert (
        all(n < top["batch"] for n in per_d.values())
        and tight["memory"]["sources"]["device memory"] == "the host's MemTotal"
    )


def test_a_bucket_that_does_not_fit_at_all_is_named_with_its_bytes(tmp_path):
    profile = load_profile(PROFILE_PATH)
    model = MemoryModel(profile.memory)
    fraction = (model.need(8, 128, 0).total_bytes + 1) / model.device_bytes
    plan = search(profile, "0" * 64, SearchSettings(out_dir=tmp_path, trials=40, memory_fraction=fraction)).to_json()
    assert [b["batch"] for b in plan["buckets"]][-1] == 8
    why = next(e["why"] for e in plan["excluded_buckets"] if e["batch"] == 16)
    assert "batch 16 at ctx 128 does not fit even without speculation" in why and " GB" in why and "available" in why
    with pytest.raises(SpecdecError, match="no batch bucket can be planned: batch 1 at ctx 128 does not fit"):
        search(
            profile,
            "0" * 64,
            SearchSettings(
                out_dir=tmp_path / "none",
                trials=10,
                memory_fraction=model.weights_bytes("none", "none") / model.device_bytes,
            ),
        )


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.1"])
def test_a_memory_fraction_outside_the_unit_interval_is_one_line(fraction, tmp_path, capsys):
    from specdec_tune.cli import main

    assert main(["search", "--profile", str(PROFILE_PATH), "--out", str(tmp_path), "--memory-fraction", fraction]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--memory-fraction {float(fraction):g} is outside (0, 1]" in err[0]


def test_a_device_projection_plans_into_the_tables_memory(tmp_path):
    plan = search(
        load_profile(PROFILE_PATH), "0" * 64, SearchSettings(out_dir=tmp_path, trials=40, device="h200")
    ).to_json()
    assert plan["memory"]["device_bytes"] == get_device_spec("h200").memory_bytes
    assert plan["memory"]["device_source"] == f"the hardware table: {get_device_spec('h200').name}"
    record = projected_memory(load_profile(PROFILE_PATH).memory, get_device_spec("h200"))
    assert record["dtype_bytes"] == 2 and record["target"]["kv_bytes_per_token"] == 2 * 30 * 192 * 2
    assert all(b["memory"]["needed_bytes"] <= 0.9 * get_device_spec("h200").memory_bytes for b in plan["buckets"])


def test_the_bundle_carries_the_budget_in_every_engines_spelling(tmp_path):
    from specdec_tune.pipeline.export import export

    search(load_profile(PROFILE_PATH), sha256_file(PROFILE_PATH), SearchSettings(out_dir=tmp_path, trials=40))
    out = tmp_path / "bundle"
    export(ExportSettings(plan=tmp_path / "plan.json", profile=PROFILE_PATH, out=out, skip_measure=True))
    plan = json.loads((tmp_path / "plan.json").read_text())
    serve = (out / "vllm" / "serve.sh").read_text()
    assert "--gpu-memory-utilization 0.9" in serve and f"--max-num-seqs {plan['max_batch']}" in serve
    trt = yaml.safe_load((out / "trtllm" / "config.yaml").read_text())
    M = plan["memory"]["device_bytes"]
    W = max(b["memory"]["weights_bytes"] for b in plan["buckets"])
    A = max(b["memory"]["activation_bytes"] for b in plan["buckets"])
    assert trt["kv_cache_config"]["free_gpu_memory_fraction"] == round((0.9 * M - W - A) / (M - W - A), 3)
    assert trt["max_batch_size"] == plan["max_batch"]
    bands = json.loads((out / "sglang" / "bands.json").read_text())["bands"]
    assert all(
        "--mem-fraction-static" in b["argv"]
        and b["argv"][b["argv"].index("--mem-fraction-static") + 1] == f"{round((0.9 * M - A) / M, 3):g}"
        for b in bands
    )
    readme = (out / "README.md").read_text()
    assert "Concurrency that fits, per band" in readme
    assert all(
        f"(D={b['draft_len']}): up to {b['memory']['max_concurrency']} requests fit" in readme for b in plan["buckets"]
    )


@pytest.mark.parametrize("damage", ["device_bytes=null", "no ctx", "fraction=2", "a bucket without memory"])
def test_a_plan_whose_memory_budget_is_damaged_is_refused_in_one_line(tmp_path, damage):
    """Export computes each engine's limits from these fields: a plan missing one is refused at load, not mid-export."""
    from specdec_tune.autotune.plan_schema import load_plan

    plan = json.loads(
        (Path(__file__).parent.parent / "bench" / "results" / "plan_gemma3_270m_cpu_bf16.json").read_text()
    )
    (tmp_path / "ok.json").write_text(json.dumps(plan))
    load_plan(tmp_path / "ok.json")  # undamaged, it loads
    if damage == "device_bytes=null":
        plan["memory"]["device_bytes"] = None
    elif damage == "no ctx":
        del plan["memory"]["ctx"]
    elif damage == "fraction=2":
        plan["memory"]["fraction"] = 2
    else:
        del plan["buckets"][-1]["memory"]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SpecdecError, match="is not a valid plan") as e:
        load_plan(tmp_path / "plan.json")
    assert "\n" not in str(e.value)
