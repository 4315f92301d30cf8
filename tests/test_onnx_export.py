"""The learned drafter exported to ONNX: parity with the model's own forward in onnxruntime (fp32, under 1e-4) at
batch, draft-length and past-length shapes other than the traced ones; the TensorRT step's skip record and command."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from specdec_tune import SpecdecError
from specdec_tune.exporters import onnx_export
from specdec_tune.profiles.drafters.draft_model import DraftModelDrafter
from specdec_tune.profiles.models.folders import ModelRef
from specdec_tune.profiles.models.llama import CausalLM, ModelConfig, init_random
from specdec_tune.profiles.models.loading import LoadedModel


def tiny_target(seed: int = 0, **switches) -> CausalLM:
    c = ModelConfig(
        model_type=switches.pop("model_type", "llama"),
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=switches.pop("tied", False),
        **switches,
    )
    torch.manual_seed(seed)
    model = init_random(CausalLM(c), seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-trivial norm gains and biases, so a graph that skips one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
    return model


def draft_model_of(target: CausalLM) -> CausalLM:
    """The `draft_model` drafter's model for this target: its first layers with the target's norm and head."""
    ref = ModelRef("tiny", "hf", "llama", "float32", "c", "w", target.config.num_layers)
    return DraftModelDrafter(
        LoadedModel(model=target, tokenizer=None, ref=ref), DraftModelDrafter.Options(layers=2)
    ).model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    draft = draft_model_of(tiny_target())
    out = tmp_path_factory.mktemp("drafter")
    cases = [(1, 1, 1), (7, 5, 3), (2, 9, 30)]  # traced at batch 2, tokens 3, past 5: none of these
    return draft, out, onnx_export.export_drafter(draft, out, max_batch=8, max_draft_len=8, ctx=64, parity_cases=cases)


def test_draft_model_exports_with_parity(exported):
    _, out, result = exported
    assert set(result["graphs"]) == {"drafter.onnx", "drafter_kv.onnx"}
    for name, graph in result["graphs"].items():
        parity = graph["parity"]
        assert parity["passed"] and parity["parity_err"] < 1e-4 and parity["max_abs_err"] < 1e-4, (
            name,
            parity,
        )  # unit-scale logits
        assert all(c["onnx_vs_fp64"] < 1e-4 and c["torch_fp32_vs_fp64"] < 1e-4 for c in parity["cases"])
        assert all(c["logits_max_abs"] > 1.0 for c in parity["cases"])  # logits large enough for a wrong layer to show
        assert [(c["batch"], c["tokens"]) for c in parity["cases"]] == [(1, 1), (7, 5), (2, 9)]
    assert all(c["present_k_parity_err"] < 1e-4 for c in result["graphs"]["drafter_kv.onnx"]["parity"]["cases"])
    if not onnx_export.tensorrt_available():
        assert sorted(result["files"]) == sorted(["drafter.onnx", "drafter_kv.onnx", "README.md", "export.json"])
    assert json.loads((out / "export.json").read_text()) == result


def test_onnx_inputs_are_dynamic(exported):
    import onnx

    _, out, _ = exported
    graph = onnx.load(str(out / "drafter_kv.onnx")).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims["tokens"] == ["batch", "tokens"]
    assert dims["past_k"][1] == "batch" and dims["past_k"][3] == "past"


def test_parity_check_can_fail(exported):
    draft, out, _ = exported
    changed = copy.deepcopy(draft)
    with torch.no_grad():
        changed.layers[1].mlp.down_proj.weight.mul_(1.01)
    parity = onnx_export.check_parity(changed, out / "drafter.onnx", with_cache=False, cases=[(2, 3, 0)])
    assert not parity["passed"] and parity["parity_err"] > 1e-4


def test_tensorrt_skip_record_and_command(exported):
    if onnx_export.tensorrt_available():
        pytest.skip("tensorrt is installed: the engine is built instead")
    _, out, result = exported
    for name, graph in result["graphs"].items():
        trt = graph["tensorrt"]
        assert trt["built"] is False and "not importable" in trt["skipped"]
        assert trt["command"].startswith(f"trtexec --onnx={name} ") and "--maxShapes=tokens:8x9" in trt["command"]
        assert trt["command"] in (out / "README.md").read_text()
    assert "past_k:2x8x2x64x8" in result["graphs"]["drafter_kv.onnx"]["tensorrt"]["command"]


def test_architecture_switches_export(tmp_path):
    """qk-norm, q/k/v and o biases, tied head: the graph carries every switch the model's forward has."""
    target = tiny_target(seed=3, model_type="qwen3", qk_norm=True, attention_bias=True, o_bias=True, tied=True)
    result = onnx_export.export_drafter(
        target.truncated(2), tmp_path, max_batch=4, max_draft_len=3, ctx=32, with_cache=False, parity_cases=[(3, 4, 0)]
    )
    assert result["graphs"]["drafter.onnx"]["parity"]["parity_err"] < 1e-4


def test_fp8_plan_exports_fp8_rounded_weights(tmp_path):
    draft = draft_model_of(tiny_target(seed=5))
    result = onnx_export.export_drafter(
        draft, tmp_path, max_batch=4, max_draft_len=3, ctx=32, quant="fp8", with_cache=False, parity_cases=[(2, 4, 0)]
    )
    assert result["quant"] == "fp8" and result["graphs"]["drafter.onnx"]["parity"]["passed"]
    assert "--fp8" in result["graphs"]["drafter.onnx"]["tensorrt"]["command"]
    # the graph computes the quantized drafter, not the original one
    unquantized = onnx_export.check_parity(draft, tmp_path / "drafter.onnx", with_cache=False, cases=[(2, 4, 0)])
    assert unquantized["parity_err"] > 1e-4
    with pytest.raises(SpecdecError, match="unknown quantization"):
        onnx_export.export_drafter(draft, tmp_path / "x", quant="int3")


def test_the_bundle_ships_only_the_kv_graph_with_parity_at_long_pasts(tmp_path):
    """The cache-free graph is the KV graph at past 0: a bundle carries the KV graph alone, checked at pasts
    as long as the plan's context."""
    draft = draft_model_of(tiny_target())
    result = onnx_export.export_drafter(
        draft,
        tmp_path,
        max_batch=4,
        max_draft_len=3,
        ctx=64,
        with_plain=False,
        parity_cases=[(1, 1, 1), (3, 4, 32), (4, 2, 64)],
    )
    assert set(result["graphs"]) == {"drafter_kv.onnx"} and not (tmp_path / "drafter.onnx").exists()
    cases = result["graphs"]["drafter_kv.onnx"]["parity"]["cases"]
    assert [c["past"] for c in cases] == [1, 32, 64] and all(c["max_abs_err"] < 1e-4 for c in cases)


# ---------------------------------------------------------------------------- learned heads


def _heads(target: CausalLM) -> dict:
    from specdec_tune.profiles.drafters.dflash import new_dflash_head
    from specdec_tune.profiles.drafters.eagle3 import new_eagle3_head
    from specdec_tune.profiles.drafters.mtp import new_mtp_head

    return {
        "eagle3": lambda: new_eagle3_head(target, draft_vocab=list(range(0, 96, 2)), aux_layers=(0, 1, 2), seed=1),
        "mtp": lambda: new_mtp_head(target, seed=1),
        "dflash": lambda: new_dflash_head(
            target, draft_vocab=list(range(0, 96, 3)), layer_ids=(1, 3), block_size=5, seed=1
        ),
        "dspark": lambda: _markov_active(
            new_dflash_head(target, markov_rank=6, markov_head_type="rnn", layer_ids=(0, 2), block_size=4)
        ),
    }


def _markov_active(head):
    with torch.no_grad():
        head.markov_head.markov_w2.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
    return head


GRAPHS = {
    "eagle3": {"combine.onnx", "step.onnx"},
    "mtp": {"step.onnx"},
    "dflash": {"context.onnx", "block.onnx"},
    "dspark": {"context.onnx", "block.onnx", "markov.onnx"},
}


@pytest.mark.parametrize("mechanism", sorted(GRAPHS))
def test_learned_heads_export_with_parity_against_their_drafting_code(tmp_path, mechanism):
    """Each head's graphs match the head's own drafting code (the cached step, the context and block passes, the Markov
    step) in onnxruntime at batch, token and past shapes other than the traced ones (2, 3, 5), every output."""
    from specdec_tune.exporters.onnx_heads import export_head

    head = _heads(tiny_target(seed=2))[mechanism]()
    result = export_head(
        head,
        tmp_path,
        name=mechanism,
        max_batch=8,
        max_draft_len=6,
        ctx=64,
        parity_cases=[(1, 1, 1), (7, 6, 3), (3, 2, 40)],
    )
    assert set(result["graphs"]) == GRAPHS[mechanism]
    for name, graph in result["graphs"].items():
        assert graph["parity"]["passed"] and graph["parity"]["parity_err"] < 1e-4, (name, graph["parity"])
        assert {c["batch"] for c in graph["parity"]["cases"]} == {1, 7, 3}
        if not onnx_export.tensorrt_available():
            assert graph["tensorrt"]["built"] is False and graph["tensorrt"]["command"].startswith(
                f"trtexec --onnx={name} "
            )
    assert json.loads((tmp_path / "export.json").read_text())["graphs"].keys() == result["graphs"].keys()
    assert "Per round" in (tmp_path / "README.md").read_text()


def test_a_head_drafting_one_token_at_small_batch_exports(tmp_path):
    """A plan with D = 1 and a batch cap of 2: the traced example and the parity shapes stay inside the graphs'
    ranges."""
    from specdec_tune.exporters.onnx_heads import export_head

    head = _heads(tiny_target(seed=2))["eagle3"]()
    result = export_head(head, tmp_path, name="eagle3", max_batch=2, max_draft_len=1, ctx=32)
    assert all(graph["parity"]["passed"] for graph in result["graphs"].values())
    assert {c["batch"] for c in result["graphs"]["step.onnx"]["parity"]["cases"]} == {1, 2}


def test_head_parity_check_can_fail(tmp_path):
    """A test of the test: a head changed after its export no longer matches the graph."""
    from specdec_tune.exporters.onnx_heads import _block_graphs, check_graph_parity, export_head

    head = _heads(tiny_target(seed=2))["dflash"]()
    export_head(head, tmp_path, name="dflash", max_batch=4, max_draft_len=4, ctx=32, parity_cases=[(2, 2, 3)])
    changed = copy.deepcopy(head).float()
    with torch.no_grad():
        changed.layers[1].mlp.down_proj.weight.mul_(1.05)
    block = next(g for g in _block_graphs(changed, 4, 5, 32) if g.file == "block.onnx")
    parity = check_graph_parity(block, tmp_path / "block.onnx", [(2, 2, 3)])
    assert not parity["passed"] and parity["parity_err"] > 1e-4
