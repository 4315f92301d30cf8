"""The engines' own code as the check of a bundle's files (exporters/native_checks.py): what runs where, what is
compared, and the checks themselves where the engines' virtualenvs are named (skipped otherwise)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specdec_tune.exporters.config_checks import check_document
from specdec_tune.exporters.engines import serving_engines
from specdec_tune.exporters.native_checks import EngineMissing, Facts, interpreter, uncovered_decode_shapes
from specdec_tune.profiles.models.views import engine_model_view

VLLM_PYTHON = os.environ.get("SPECDEC_TUNE_VLLM_PYTHON")


def test_cuda_graph_coverage_needs_a_multiple_of_the_query_length():
    """vLLM pads B x (1+K) decode tokens up to a captured size that 1+K divides: with sizes [1, 2, 4, 8], batch 2 at
    K = 1 (4 tokens) fits 4, batch 3 at K = 1 (6 tokens) fits 8, at K = 2 batches 1 and 2 (3 and 6 tokens) fit nothing
    (no size is a multiple of 3), and batch 9 at K = 0 is beyond the largest size."""
    assert uncovered_decode_shapes([1, 2, 4, 8], [1, 1, 1]) == []
    assert uncovered_decode_shapes([1, 2, 4, 8], [2, 2]) == [(1, 2), (2, 2)]
    assert uncovered_decode_shapes([1, 2, 4, 8], [0] * 9) == [(9, 0)]


def test_facts_give_the_draft_length_an_engine_should_run_at_each_batch():
    facts = Facts(None, 32, [(2, 3), (8, 1), (32, 0)])
    assert [facts.k_at(b) for b in (1, 2, 3, 8, 9, 32)] == [3, 3, 1, 1, 0, 0]


def test_a_missing_engine_is_said_and_the_schema_and_rules_still_run(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_TUNE_SPECULATORS_PYTHON", raising=False)
    if interpreter_here("speculators"):
        pytest.skip("speculators imports in this interpreter")
    with pytest.raises(EngineMissing, match="SPECDEC_TUNE_SPECULATORS_PYTHON"):
        interpreter("speculators", "SPECDEC_TUNE_SPECULATORS_PYTHON")
    engine = serving_engines()["speculators"]
    config = {
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "x", "architectures": ["LlamaForCausalLM"]},
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = check_document(engine, config, "0.9.0", tmp_path, Facts(None, 8, [(8, 3)]))
    assert result["engine_code"].startswith("not run: speculators") and any(
        "transformer_layer_config" in e for e in result["errors"]
    )


def interpreter_here(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def test_the_vllm_view_of_a_converted_gguf_names_its_class_and_drops_the_gguf_quantization(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "quantization_config": {"quant_method": "gguf"}})
    )
    (folder / "model.safetensors").write_bytes(b"0")
    view = engine_model_view(folder, tmp_path / "view")
    config = json.loads((view / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and "quantization_config" not in config
    assert (view / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()


@pytest.mark.skipif(not VLLM_PYTHON, reason="SPECDEC_TUNE_VLLM_PYTHON names no vLLM virtualenv")
def test_vllm_builds_the_written_file_and_its_lookup_runs_the_schedule(tmp_path):
    """vLLM's own EngineArgs on the written speculative_config.json; its dense lookup gives the plan's K per batch, and
    a file that disagrees with what the bundle means to run is caught."""
    from specdec_tune.profiles.models.folders import model_folder

    target = Path(model_folder(None)[1])
    engine = serving_engines()["vllm"]
    config = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
        "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 1], [9, 16, 0]],
    }
    (tmp_path / "speculative_config.json").write_text(json.dumps(config))
    result = check_document(engine, config, "0.32.0", tmp_path, Facts(target, 16, [(2, 3), (8, 1), (16, 0)]))
    assert (
        result["errors"] == [] and "VllmConfig" in result["engine_code"] and "CUDA-graph sizes" in result["engine_code"]
    )
    wrong = check_document(engine, config, "0.32.0", tmp_path, Facts(target, 16, [(2, 3), (8, 2), (16, 0)]))
    assert any("runs K=1 at batch 3, the bundle means 2" in e for e in wrong["errors"])
