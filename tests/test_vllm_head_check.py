"""vLLM's own reader, model class and weight loading on head folders this tool writes (exporters/vllm_head_check.py):
tiny random EAGLE-3, DFlash and DSpark heads for a tiny Llama, and an EAGLE-3 head whose layer type vLLM refuses.
Skipped where SPECDEC_TUNE_VLLM_PYTHON names no vLLM virtualenv."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specdec_tune.exporters.vllm_head_check import check_head
from specdec_tune.profiles.drafters.checkpoints import save_head
from specdec_tune.profiles.drafters.heads import head_kind
from specdec_tune.profiles.models.loading import load_model

VLLM_PYTHON = os.environ.get("SPECDEC_TUNE_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="SPECDEC_TUNE_VLLM_PYTHON names no vLLM virtualenv")

# 8 layers: EAGLE-3's default low / mid / high layers (2, 4, 5) are distinct; head_dim 16 for vLLM's CPU attention
TARGET = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
ALL_STEPS = ["reader", "engine_config", "model_class", "construct", "load_weights"]


@pytest.fixture(scope="module")
def heads(hf_variant_dir, tmp_path_factory) -> dict[str, Path]:
    """One folder per mechanism, written by save_head for the tiny target (named as the verifier, so vLLM finds it);
    EAGLE-3 with a reduced draft vocabulary (d2t and t2d written)."""
    import specdec_tune.profiles.drafters.dflash  # noqa: F401  (registers the dflash and dspark head kinds)
    import specdec_tune.profiles.drafters.eagle3  # noqa: F401

    torch.manual_seed(0)
    folder = hf_variant_dir("llama", **TARGET)
    target = load_model(str(folder), dtype="float32")
    out = tmp_path_factory.mktemp("heads")
    made = {}
    for mechanism, options in (("eagle3", {"draft_vocab": list(range(0, 64, 2))}), ("dflash", {}), ("dspark", {})):
        head = head_kind(mechanism).new(target.model, seed=0, **options)
        made[mechanism] = save_head(
            head,
            mechanism,
            out / mechanism,
            verifier=str(folder),
            verifier_architectures=["LlamaForCausalLM"],
            speculative_tokens=3,
        )
    return made


def _loaded_all(result: dict) -> None:
    assert result["error"] is None, result
    assert result["unloaded"] == [] and result["ok"], result
    assert {"reader", "model_class", "construct", "load_weights"} <= set(result["steps_run"])


def test_vllm_loads_an_eagle3_head_with_a_draft_vocabulary(heads):
    result = check_head(heads["eagle3"])
    _loaded_all(result)
    assert result["steps_run"] == ALL_STEPS and result["steps_not_run"] == []
    assert result["model_class"]["class"].endswith("llama_eagle3.Eagle3LlamaForCausalLM")
    assert result["reader"]["draft_config"]["draft_vocab_size"] == 32
    assert result["reader"]["draft_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # vLLM skips the target-to-draft map by name; the embedding comes from the target
    assert result["dropped"] == [{"name": "t2d", "where": "skipped by the class's load_weights"}]
    assert result["from_target"] == ["model.embed_tokens.weight"]


def test_vllm_loads_a_dflash_head_sharing_the_targets_embedding_and_lm_head(heads):
    result = check_head(heads["dflash"])
    _loaded_all(result)
    assert result["model_class"]["class"].endswith("qwen3_dflash.DFlashQwen3ForCausalLM")
    assert result["dropped"] == []
    assert sorted(result["from_target"]) == ["lm_head.weight", "model.embed_tokens.weight"]
    config = json.loads((heads["dflash"] / "config.json").read_text())
    assert result["reader"]["draft_config"]["dflash_config"]["target_layer_ids"] == [
        i - 1 for i in config["aux_hidden_state_layer_ids"]
    ]


def test_vllm_loads_a_dspark_head_even_where_its_runner_refuses_the_method(heads):
    result = check_head(heads["dspark"])
    _loaded_all(result)
    assert result["model_class"]["class"].endswith("qwen3_dspark.Qwen3DSparkForCausalLM")
    assert result["dropped"] == []
    if "draft_config" in result["steps_run"]:  # a CPU build: the V1 runner refuses DSpark, the draft is built alone
        assert result["steps_not_run"][0]["step"] == "engine_config"
        assert "does not support: dspark" in result["steps_not_run"][0]["reason"]


def test_vllm_refuses_an_eagle3_layer_that_is_neither_llama_nor_qwen3(heads, tmp_path):
    folder = tmp_path / "qwen2-layer"
    folder.mkdir()
    for f in heads["eagle3"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["transformer_layer_config"]["model_type"] = "qwen2"
    (folder / "config.json").write_text(json.dumps(config))
    result = check_head(folder)
    assert not result["ok"] and result["steps_run"] == []
    assert "Unsupported model_type qwen2 for Eagle3 speculator" in result["error"]
    assert result["steps_not_run"][0]["step"] == "reader"
    assert "Unsupported model_type qwen2 for Eagle3 speculator" in result["steps_not_run"][0]["reason"]
    assert [s["step"] for s in result["steps_not_run"]] == ALL_STEPS


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_vllm_loads_an_eagle3_head_trained_for_a_non_llama_target(hf_variant_dir, tmp_path, family):
    """The head's layer is written as what it is, a llama decoder layer, whatever the target's family (gemma2 runs on
    the generic path): vLLM's reader takes it (it refuses a qwen2 layer type, the test above)."""
    import specdec_tune.profiles.drafters.eagle3  # noqa: F401

    folder = hf_variant_dir(family, **TARGET, **({"head_dim": 16} if family == "gemma2" else {}))
    target = load_model(str(folder), dtype="float32")
    head = head_kind("eagle3").new(target.model, seed=0)
    written = save_head(
        head, "eagle3", tmp_path / "h", verifier=str(folder), verifier_architectures=["X"],
        speculative_tokens=3,
    )  # fmt: skip
    assert json.loads((written / "config.json").read_text())["transformer_layer_config"]["model_type"] == "llama"
    _loaded_all(check_head(written))
