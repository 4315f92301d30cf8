"""Heads in the speculators layout rewritten for SGLang 0.5.23 (exporters/sglang_heads.py): the config fields and the
weight names and shapes SGLang's draft classes read, the heads it cannot run, and (where SPECDEC_TUNE_SGLANG_PYTHON
names SGLang's virtualenv) SGLang's own config load, model class and load_weights on each written folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec_tune import SpecdecError
from specdec_tune.exporters.mechanisms import MECHANISMS
from specdec_tune.exporters.sglang_head_check import ALGORITHMS, check_sglang_head
from specdec_tune.exporters.sglang_heads import write_sglang_head
from specdec_tune.profiles.drafters.checkpoints import save_head
from specdec_tune.profiles.drafters.dflash import new_dflash_head
from specdec_tune.profiles.drafters.eagle3 import new_eagle3_head
from specdec_tune.profiles.drafters.mtp import new_mtp_head
from specdec_tune.profiles.models.llama import CausalLM, ModelConfig, init_random

SGLANG_PYTHON = os.environ.get("SPECDEC_TUNE_SGLANG_PYTHON")

# The tiny target: 8 Llama layers, width 32 (4 heads of 8, 2 KV heads), MLP 64, vocabulary 64.
TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 8,
    "hidden_size": 32,
    "vocab_size": 64,
}
# speculators' ids (the stream entering target layer i; the heads' default (2, N//2, N-3)) and SGLang's: it captures
# before layer id + 1 for an explicit id (models/llama.py:929-953), so its id is one less.
SPECULATORS_IDS, SGLANG_IDS = [2, 4, 5], [1, 3, 4]
DRAFT_VOCAB = list(range(0, 64, 3))  # 22 target ids: EAGLE-3's reduced draft vocabulary, d2t = id - index

LAYER = {  # the layer settings every written config carries flat (llama_eagle3.py, dflash.py read them so)
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
CONFIGS = {
    # models/llama_eagle3.py:151-161 (target_hidden_size, eagle_config ids), :306 (draft_vocab_size), :303 (tied);
    # model_runner_components/spec_aux_hidden_state.py:185-194 (eagle_config read by the server)
    "eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": 22,
        "target_hidden_size": 32,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": SGLANG_IDS, "use_aux_hidden_state": True},
    },
    # models/dflash.py:671, 700-758; speculative/dflash_utils.py:588-702 (block_size, num_target_layers top-level,
    # dflash_config.target_layer_ids / mask_token_id)
    "dflash": {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "block_size": 5,
        "num_target_layers": 8,
        "dflash_config": {"target_layer_ids": SGLANG_IDS, "mask_token_id": 63},
    },
    # models/dspark.py:385-405 (markov fields read top-level), :487-507 (confidence head),
    # speculative/dspark_components/dspark_config.py:29-31 (sample_from_anchor, default true), :295-297 (gamma)
    "dspark": {
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "block_size": 4,
        "num_target_layers": 8,
        "dflash_config": {"target_layer_ids": SGLANG_IDS, "mask_token_id": 63},
        "sample_from_anchor": True,
        "markov_rank": 8,
        "markov_head_type": "rnn",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    },
}

# Weight names as the classes' load_weights consume them, and shapes. EAGLE-3 (models/llama_eagle3.py:325-378): under
# `model.` but lm_head; q/k/v and gate/up are stacked by the loader; d2t becomes hot_token_id; t2d is not written.
EAGLE3_WEIGHTS = {
    "model.fc.weight": (32, 96),
    "model.layers.0.self_attn.q_proj.weight": (32, 64),
    "model.layers.0.self_attn.k_proj.weight": (16, 64),
    "model.layers.0.self_attn.v_proj.weight": (16, 64),
    "model.layers.0.self_attn.o_proj.weight": (32, 32),
    "model.layers.0.mlp.gate_proj.weight": (64, 32),
    "model.layers.0.mlp.up_proj.weight": (64, 32),
    "model.layers.0.mlp.down_proj.weight": (32, 64),
    "model.layers.0.input_layernorm.weight": (32,),
    "model.layers.0.post_attention_layernorm.weight": (32,),
    "model.layers.0.hidden_norm.weight": (32,),
    "model.norm.weight": (32,),
    "lm_head.weight": (22, 32),
    "d2t": (22,),
}
# DFlash (models/dflash.py:886-985): its own names, no prefix; q/k norms per layer; no LM head (the target's).
DFLASH_WEIGHTS = {
    "fc.weight": (32, 96),
    "hidden_norm.weight": (32,),
    "norm.weight": (32,),
    **{
        f"layers.{i}.{name}": shape
        for i in range(2)
        for name, shape in {
            "self_attn.q_proj.weight": (32, 32),
            "self_attn.k_proj.weight": (16, 32),
            "self_attn.v_proj.weight": (16, 32),
            "self_attn.o_proj.weight": (32, 32),
            "self_attn.q_norm.weight": (8,),
            "self_attn.k_norm.weight": (8,),
            "mlp.gate_proj.weight": (64, 32),
            "mlp.up_proj.weight": (64, 32),
            "mlp.down_proj.weight": (32, 64),
            "input_layernorm.weight": (32,),
            "post_attention_layernorm.weight": (32,),
        }.items()
    },
}
# DSpark (models/dspark.py:340-345 RNNHead, 424-437 confidence head over [hidden; rank], 627-665 load_weights)
DSPARK_WEIGHTS = {
    **DFLASH_WEIGHTS,
    "markov_head.markov_w1.weight": (64, 8),
    "markov_head.markov_w2.weight": (64, 8),
    "markov_head.joint_proj.weight": (24, 48),
    "markov_head.joint_proj.bias": (24,),
    "confidence_head.proj.weight": (1, 40),
    "confidence_head.proj.bias": (1,),
}
WEIGHTS = {"eagle3": EAGLE3_WEIGHTS, "dflash": DFLASH_WEIGHTS, "dspark": DSPARK_WEIGHTS}


@pytest.fixture(scope="module")
def target() -> CausalLM:
    c = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return init_random(CausalLM(c), seed=0).eval().requires_grad_(False)


HEADS = {
    "eagle3": lambda t: new_eagle3_head(t, draft_vocab=DRAFT_VOCAB, seed=1),
    "dflash": lambda t: new_dflash_head(t, block_size=5, seed=1),
    "dspark": lambda t: new_dflash_head(t, markov_rank=8, markov_head_type="rnn", block_size=4, seed=1),
}


def layout(mechanism: str):
    """The registry's SGLang layout of the kind (None where SGLang runs no separately trained head)."""
    return MECHANISMS[mechanism].sglang.head_layout


def speculators_head(head, mechanism: str, folder: Path) -> Path:
    return save_head(
        head, mechanism, folder, verifier="tiny", verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3
    )


@pytest.fixture(scope="module")
def converted(target, tmp_path_factory) -> dict:
    """mechanism -> (the speculators head folder, write_sglang_head's answer)."""
    root = tmp_path_factory.mktemp("sglang-heads")
    out = {}
    for mechanism, make in HEADS.items():
        torch.manual_seed(1)
        folder = speculators_head(make(target), mechanism, root / f"speculators-{mechanism}")
        out[mechanism] = (
            folder,
            write_sglang_head(layout(mechanism), folder, TARGET_CONFIG, root / f"sglang-{mechanism}"),
        )
    return out


# ---------------------------------------------------------------------------- the written folders


@pytest.mark.parametrize("mechanism", list(HEADS))
def test_the_written_config_carries_what_sglangs_draft_class_reads(converted, mechanism):
    _, result = converted[mechanism]
    config = json.loads((result.folder / "config.json").read_text())
    expected = {**LAYER, **CONFIGS[mechanism]}
    assert {k: config.get(k) for k in expected} == expected
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert "speculators_model_type" not in config and "transformer_layer_config" not in config
    assert any("SGLang adds 1" in d for d in result.decisions)


@pytest.mark.parametrize("mechanism", list(HEADS))
def test_the_written_weights_are_named_and_shaped_as_sglangs_load_weights_consumes_them(converted, mechanism):
    source, result = converted[mechanism]
    weights = load_file(str(result.folder / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == WEIGHTS[mechanism]
    original = load_file(str(source / "model.safetensors"))
    for name, tensor in weights.items():  # renamed, the tensors themselves unchanged
        assert torch.equal(tensor, original[name.removeprefix("model.")])
    if mechanism == "eagle3":  # d2t offsets: draft id i is target id i + d2t[i]
        assert (weights["d2t"] + torch.arange(22)).tolist() == DRAFT_VOCAB and "t2d" in original


def test_mtp_is_not_written_and_says_why(target, tmp_path):
    folder = speculators_head(new_mtp_head(target, seed=1), "mtp", tmp_path / "mtp")
    assert layout("mtp") is None
    result = write_sglang_head(layout("mtp"), folder, TARGET_CONFIG, tmp_path / "out")
    assert result.folder is None and "NEXTN" in result.reason and not (tmp_path / "out").exists()


def test_a_head_of_another_kind_than_the_layout_stops_the_conversion(converted, tmp_path):
    source, _ = converted["eagle3"]
    with pytest.raises(SpecdecError, match="not a speculators dflash head .speculators_model_type 'eagle3'"):
        write_sglang_head(layout("dflash"), source, TARGET_CONFIG, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_check_runs_each_written_class_under_the_registrys_sglang_algorithm():
    assert ALGORITHMS == {
        "LlamaForCausalLMEagle3": "EAGLE3",
        "DFlashDraftModel": "DFLASH",
        "DSparkDraftModel": "DSPARK",
    }


@pytest.mark.parametrize(
    ("mechanism", "make", "words"),
    [
        ("dflash", lambda t: new_dflash_head(t, draft_vocab=DRAFT_VOCAB, seed=1), "LM head"),
        ("dflash", lambda t: new_dflash_head(t, layer_ids=(0, 4, 5), seed=1), "layer ids [0]"),
        ("dspark", lambda t: new_dflash_head(t, markov_rank=8, layer_ids=(2, 8), seed=1), "layer ids [8]"),
        ("eagle3", lambda t: new_eagle3_head(t, aux_layers=(2, 5, 4), seed=1), "repeat or go down"),
    ],
)
def test_a_head_sglang_cannot_build_stops_the_conversion(target, tmp_path, mechanism, make, words):
    folder = speculators_head(make(target), mechanism, tmp_path / "head")
    with pytest.raises(SpecdecError, match="SGLang 0.5.23") as e:
        write_sglang_head(layout(mechanism), folder, TARGET_CONFIG, tmp_path / "out")
    assert words in e.value.message and e.value.hint


def test_an_eagle3_head_reading_the_embedding_is_written_with_id_minus_one(target, tmp_path):
    folder = speculators_head(new_eagle3_head(target, aux_layers=(0, 4, 7), seed=1), "eagle3", tmp_path / "head")
    result = write_sglang_head(layout("eagle3"), folder, TARGET_CONFIG, tmp_path / "out")
    config = json.loads((result.folder / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 3, 6]


def test_an_eagle3_head_with_norm_before_residual_is_refused(target, tmp_path):
    head = new_eagle3_head(target, seed=1)
    head.norm_before_residual = True
    folder = speculators_head(head, "eagle3", tmp_path / "head")
    with pytest.raises(SpecdecError, match="norm_before_residual"):
        write_sglang_head(layout("eagle3"), folder, TARGET_CONFIG, tmp_path / "out")


def test_a_tensor_sglang_has_no_parameter_for_stops_the_conversion(converted, tmp_path):
    source, _ = converted["dflash"]
    copy = tmp_path / "head"
    copy.mkdir()
    (copy / "config.json").write_text((source / "config.json").read_text())
    save_file(
        {**load_file(str(source / "model.safetensors")), "extra.weight": torch.zeros(2)}, str(copy / "w.safetensors")
    )
    with pytest.raises(SpecdecError, match="no parameter for extra.weight"):
        write_sglang_head(layout("dflash"), copy, TARGET_CONFIG, tmp_path / "out")


# ---------------------------------------------------------------------------- SGLang's own code


needs_sglang = pytest.mark.skipif(not SGLANG_PYTHON, reason="SPECDEC_TUNE_SGLANG_PYTHON names no SGLang virtualenv")


@needs_sglang
@pytest.mark.parametrize("mechanism", list(HEADS))
def test_sglang_loads_every_tensor_into_its_parameter(converted, mechanism):
    """SGLang's config load, registry, model class and load_weights: nothing dropped, nothing left unloaded, and the
    layers whose input SGLang's target class captures are the speculators ids."""
    _, result = converted[mechanism]
    record = check_sglang_head(result.folder, TARGET_CONFIG)
    assert record["ok"], record
    assert record["steps_run"] == ["config", "parallel", "build", "load", "read back", "capture"], record
    assert record["unloaded"] == [] and record["dropped"] == []
    read = record["read"]
    assert read["model_class"] == CONFIGS[mechanism]["architectures"][0]
    assert read["captured_before_layers"] == SPECULATORS_IDS
    if mechanism == "eagle3":
        assert record["from_target"] == ["model.embed_tokens.weight"]
        assert read["num_aux_hidden_states"] == 3 and read["hot_token_ids"] == 22
        assert read["draft_vocab_size"] == 22 and not read["load_lm_head_from_target"]
    else:
        assert read["num_context_features"] == 3 and read["target_layer_ids"] == SGLANG_IDS
        assert read["mask_token_id"] == 63 and set(read["attention"]) == {"ENCODER_ONLY"}  # no mask inside the block
    if mechanism == "dspark":
        assert read["gamma"] == 4 and read["sample_from_anchor"] and read["markov_head"] == "RNNHead"
        assert read["confidence_head"]


@needs_sglang
def test_the_sglang_check_sees_a_tensor_its_loader_drops(converted, tmp_path):
    """The check is not vacuous: an LM head under `model.` is dropped by SGLang's EAGLE-3 loader without a word, and the
    check reports the tensor dropped and the parameter unloaded."""
    _, result = converted["eagle3"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((result.folder / "config.json").read_text())
    weights = load_file(str(result.folder / "model.safetensors"))
    weights["model.lm_head.weight"] = weights.pop("lm_head.weight")
    save_file(weights, str(broken / "model.safetensors"))
    record = check_sglang_head(broken, TARGET_CONFIG)
    assert not record["ok"] and record["error"] is None
    assert record["dropped"] == ["model.lm_head.weight"] and record["unloaded"] == ["lm_head.weight"]


# ---------------------------------------------------------------------------- the bundle's head folders


def _bundle_context(mechanism: str, folder: Path):
    from specdec_tune.exporters.bundle import head_config_fields
    from specdec_tune.exporters.engines import ExportContext
    from specdec_tune.exporters.versions import DEFAULT_VERSIONS

    return ExportContext(
        mechanism=mechanism,
        quant="none",
        schedule=[(2, 3), (8, 1)],
        max_batch=8,
        drafter={"name": mechanism, "options": {"model": str(folder)}},
        target_model="target",
        drafter_model=str(folder),
        versions=dict(DEFAULT_VERSIONS, trtllm="1.3.0rc29"),
        head=head_config_fields(mechanism, {"model": str(folder)}),
        target_architectures=("LlamaForCausalLM",),
        target_config=TARGET_CONFIG,
    )


@pytest.mark.parametrize("mechanism", list(HEADS))
def test_the_bundle_ships_the_head_in_each_engines_layout_and_every_engine_points_inside_it(
    converted, mechanism, tmp_path
):
    import dataclasses

    from specdec_tune.exporters.engines import serving_engines
    from specdec_tune.exporters.head_folders import ship_head_folders

    source, _ = converted[mechanism]
    ctx = _bundle_context(mechanism, source)
    heads = ship_head_folders(ctx, tmp_path)
    assert heads.folders == {
        "vllm": "speculators",
        "speculators": "speculators",
        "sglang": "sglang/head",
        "trtllm": "trtllm/head",
    }
    assert (
        load_file(str(tmp_path / "speculators" / "model.safetensors")).keys()
        == load_file(str(source / "model.safetensors")).keys()
    )
    sglang = load_file(str(tmp_path / "sglang" / "head" / "model.safetensors"))
    trtllm = load_file(str(tmp_path / "trtllm" / "head" / "model.safetensors"))
    if mechanism == "eagle3":  # TensorRT-LLM: no `model.` prefix, the decoder layer as `midlayer.`
        assert "midlayer.self_attn.q_proj.weight" in trtllm and not any(k.startswith("model.") for k in trtllm)
    else:
        assert trtllm.keys() == sglang.keys()
    ctx = dataclasses.replace(ctx, head_folders=heads.folders, head_refused=heads.refused)
    engines = serving_engines()
    if mechanism == "dspark":  # an rnn Markov head: vLLM 0.32's DSpark builds the vanilla one only
        assert set(heads.refused) == {"vllm"} and engines["vllm"].render(ctx).document is None
    else:
        assert heads.refused == {} and engines["vllm"].render(ctx).document["model"] == "speculators"
    assert engines["trtllm"].render(ctx).document["speculative_config"]["speculative_model"] == "trtllm/head"
    argv = engines["sglang"].render(ctx).document["bands"][0]["argv"]
    assert argv[argv.index("--speculative-draft-model-path") + 1] == "sglang/head"


def test_a_head_sglang_refuses_is_plain_serving_in_sglang_and_tensorrt_and_still_ships_for_vllm(target, tmp_path):
    import dataclasses

    from specdec_tune.exporters.engines import serving_engines
    from specdec_tune.exporters.head_folders import ship_head_folders

    reduced = new_dflash_head(target, draft_vocab=DRAFT_VOCAB, block_size=5, seed=1)  # SGLang: the target's LM head
    folder = speculators_head(reduced, "dflash", tmp_path / "head")
    ctx = _bundle_context("dflash", folder)
    heads = ship_head_folders(ctx, tmp_path / "bundle")
    assert set(heads.folders) == {"vllm", "speculators"} and set(heads.refused) == {"sglang", "trtllm"}
    ctx = dataclasses.replace(ctx, head_folders=heads.folders, head_refused=heads.refused)
    sglang = serving_engines()["sglang"].render(ctx)
    assert sglang.deviation["why"].startswith("SGLang cannot load this head (") and all(
        band["draft_len"] == 0 for band in sglang.document["bands"]
    )
    assert "speculative_config" not in serving_engines()["trtllm"].render(ctx).document
