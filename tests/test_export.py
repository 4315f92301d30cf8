"""export / validate / check: engine configs for every mechanism, schedule translations, the bundle's
integrity checks, staleness factors, and the losslessness gate against a deliberately lossy drafter."""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import statistics
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

from specdec_tune import SpecdecError, __version__
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.cli import main
from specdec_tune.exporters import schedule as sched
from specdec_tune.exporters.bundle import head_config_fields, read_manifest
from specdec_tune.exporters.config_checks import check_document
from specdec_tune.exporters.engines import ExportContext, serving_engines
from specdec_tune.exporters.mechanisms import MECHANISMS as MECHANISMS_REGISTRY
from specdec_tune.exporters.safety import noisy_thresholds, top_band_cost
from specdec_tune.exporters.staleness import STALE_EXIT_CODE
from specdec_tune.exporters.versions import DEFAULT_VERSIONS, rules_line
from specdec_tune.pipeline.export import ExportSettings, export
from specdec_tune.profiles.drafters.speculators_layout import head_fields
from specdec_tune.profiles.models.folders import architectures
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file, write_json

PROFILE_PATH = Path(__file__).parent / "data" / "demo_profile.json"
MECHANISMS = ("ngram", "suffix", "draft_model", "eagle3", "mtp", "dflash", "dspark")


# ---------------------------------------------------------------------------- schedules


@st.composite
def schedules(draw):
    buckets = sorted(draw(st.sets(st.integers(1, 512), min_size=1, max_size=8)))
    ds = draw(st.lists(st.integers(0, 15), min_size=len(buckets), max_size=len(buckets)))
    ds[0] = max(ds)  # the plan's rule: the smallest bucket carries the maximum
    return list(zip(buckets, ds))


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_engine_schedules_give_the_same_draft_length_at_every_batch_size(schedule):
    vllm, trt, bands = sched.to_vllm(schedule), sched.to_trtllm(schedule), sched.to_sglang(schedule)
    want = {}
    for B in range(1, schedule[-1][0] + 1):
        want[B] = next(d for b, d in schedule if b >= B)
        assert sched.k_at(vllm, B) == want[B] == sched.k_at(trt, B)
        assert next(k for lo, hi, k in bands if lo <= B <= hi) == want[B]
    assert vllm[0][0] == 1 and all(r2[0] == r1[1] + 1 for r1, r2 in zip(vllm, vllm[1:]))
    assert trt[min(trt)] == max(trt.values())
    # and back: the engine forms convert to the same per-batch-size K
    top = schedule[-1][0]
    for form in (sched.from_vllm(vllm), sched.from_trtllm(trt, top)):
        assert all(next(d for b, d in form if b >= B) == want[B] for B in range(1, top + 1))


def test_a_schedule_that_breaks_the_tensorrt_rule_is_refused():
    with pytest.raises(SpecdecError, match="smallest batch"):
        sched.to_trtllm([(1, 1), (4, 3)])


# ---------------------------------------------------------------------------- engine configs


LAYER = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 1,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}
BLOCK_HEAD = {
    "transformer_layer_config": LAYER,
    "block_size": 8,
    "aux_hidden_state_layer_ids": [2, 15, 27],
    "mask_token_id": 49151,
}
HEADS = {
    "eagle3": {"transformer_layer_config": LAYER, "eagle_aux_hidden_state_layer_ids": [2, 15, 27]},
    "mtp": {"transformer_layer_config": LAYER, "num_nextn_predict_layers": 1},
    "dflash": BLOCK_HEAD,
    "dspark": BLOCK_HEAD | {"markov_rank": 8, "markov_head_type": "gated", "sample_from_anchor": True},
}


def _predict(batch: int, draft_len: int) -> dict:
    """A made-up cost model for render tests: tokens/s rising with D at batch 1, falling with D at large batches."""
    value = 100.0 * batch * (1 + 0.2 * draft_len / batch - 0.01 * draft_len)
    return {"value": value, "source": "interpolated", "low": 0.9 * value, "high": 1.1 * value}


def _context(mechanism: str, schedule, versions=None, quant="none") -> ExportContext:
    options = {"ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 5}, "suffix": {"max_tree_depth": 24}}.get(
        mechanism, {}
    )
    learned = mechanism not in ("ngram", "suffix")
    return ExportContext(
        single_draft_len=2,
        mechanism=mechanism,
        quant=quant,
        schedule=list(schedule),
        max_batch=schedule[-1][0],
        drafter={"name": mechanism, "options": options},
        target_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        drafter_model="/models/draft" if learned else None,
        versions=dict(DEFAULT_VERSIONS, **(versions or {})),
        head=HEADS.get(mechanism, {}),
        target_architectures=("LlamaForCausalLM",),
        predict=_predict,
    )


def test_speculators_config_takes_the_heads_own_fields(tmp_path):
    """A learned head named by `model=`: the bundle's speculators config carries the head's draft vocabulary, layer ids
    and layer config from the head folder's config.json (read as JSON), not just what the drafter options give."""
    own = {
        "speculators_model_type": "eagle3",
        "draft_vocab_size": 8192,
        "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
        "target_hidden_size": 576,
        "norm_before_residual": False,
        "transformer_layer_config": {"hidden_size": 576},
        "auto_map": {"x": "y"},
    }
    (tmp_path / "config.json").write_text(json.dumps(own))
    ctx = dataclasses.replace(
        _context("eagle3", [(1, 3)]), drafter={"name": "eagle3", "options": {"model": str(tmp_path), "random": False}}
    )
    ctx = dataclasses.replace(ctx, head=head_fields(ctx.drafter["options"]))
    config = serving_engines()["speculators"].render(ctx).document
    assert config["draft_vocab_size"] == 8192 and config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["transformer_layer_config"] == {"hidden_size": 576} and "auto_map" not in config


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("schedule", [[(1, 4), (4, 2), (16, 1), (64, 0)], [(1, 3), (8, 3)], [(1, 0), (8, 0)]])
def test_every_engine_config_validates_for_every_mechanism(mechanism, schedule):
    for name, engine in serving_engines().items():
        ctx = _context(mechanism, schedule)
        files = engine.render(ctx)
        result = check_document(engine, files.document, ctx.versions[name])
        assert result["errors"] == [], (name, mechanism, result)
        assert files.decisions, "every engine says what it emitted"
        if name == "vllm" and files.document:
            runs = files.deviation["schedule"] if files.deviation else schedule  # a loop-measured DFlash: its block
            assert files.document["method"] == mechanism and files.document["num_speculative_tokens"] == max(
                d for _, d in runs
            )
        if name == "trtllm" and files.document.get("speculative_config"):
            spec = files.document["speculative_config"]
            assert spec["decoding_type"] in ("NGram", "Draft_Target", "Eagle", "MTP")  # the 1.2 line's
            if "draft_len_schedule" in spec:
                assert set(spec["draft_len_schedule"]) <= set(files.document["cuda_graph_config"]["batch_sizes"])
        if name == "sglang" and files.document["supported"]:
            for band in files.document["bands"]:
                argv = band["argv"]
                if band["draft_len"]:
                    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == str(band["draft_len"] + 1)
        if files.deviation:  # an engine that cannot run the plan's schedule says what it runs and what that costs
            assert all("tokens_per_s" in row for row in files.deviation["buckets"]) and files.deviation["why"]


def test_checks_catch_broken_configs():
    engines = serving_engines()
    bad_vllm = {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 3]]}
    errors = check_document(engines["vllm"], bad_vllm, "0.32.0")["errors"]
    assert any("start at 1" in e for e in errors) and any("exceeds num_speculative_tokens" in e for e in errors)
    assert check_document(engines["vllm"], {"method": "medusa2", "num_speculative_tokens": 0}, "0.32.0")["errors"]
    bad_trt = {
        "max_batch_size": 8,
        "speculative_config": {
            "decoding_type": "DraftTarget",
            "max_draft_len": 3,
            "draft_len_schedule": {"1": 2, "8": 3},
        },
        "cuda_graph_config": {"batch_sizes": [1]},
    }
    errors = check_document(engines["trtllm"], bad_trt, "1.3.0rc29")["errors"]
    assert any("decoding_type" in e for e in errors) and any("draft_len_schedule key 1 must equal" in e for e in errors)
    assert any("miss schedule keys" in e for e in errors)
    bad_trt["speculative_config"]["draft_len_schedule"] = {"2": 3, "8": 1}  # 1.2: key 1 is required
    assert any("must include batch_size=1" in e for e in check_document(engines["trtllm"], bad_trt, "1.2.1")["errors"])


def test_engine_versions_decide_what_is_emitted():
    ctx = _context("ngram", [(1, 3), (4, 1), (16, 0)], versions={"vllm": "0.31.0"})
    vllm = serving_engines()["vllm"].render(ctx)
    assert "num_speculative_tokens_per_batch_size" not in vllm.document and vllm.document["num_speculative_tokens"] == 2
    assert any("no per-batch table" in d for d in vllm.decisions)


def test_an_engine_version_without_rules_is_refused_naming_the_known_ones(plan_path, tmp_path, capsys):
    known = {"trtllm": "1.2.0 to 1.2.1, 1.3.0rc27 to 1.3.0rc29", "vllm": "0.10.0 to 0.33.0"}
    for engine, version in (("trtllm", "1.4.0"), ("trtllm", "1.3.0rc3"), ("vllm", "0.5.0")):
        code = main(
            [
                "export",
                "--plan",
                str(plan_path),
                "--profile",
                str(PROFILE_PATH),
                "--out",
                str(tmp_path / "b"),
                "--configs-only",
                f"--{engine}-version",
                version,
            ]
        )
        err = capsys.readouterr().err
        assert code == 1 and f"no {engine} rules are known for version {version}" in err and known[engine] in err
        assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------- rules from the engines' released sources


def _sglang_router_steps(table: dict, graph_sizes: list[int], batch: int) -> list[int]:
    """SGLang 0.5.23's own lookup (speculative/adaptive_step_router.py): pad the batch up to a captured graph size, then
    take the largest key at or below it."""
    i = bisect.bisect_left(graph_sizes, batch)
    padded = graph_sizes[i] if i < len(graph_sizes) else batch
    keys = sorted(int(k) for k in table)
    return table[str(keys[max(0, bisect.bisect_right(keys, padded) - 1)])]["candidate_steps"]


def test_sglang_runs_the_per_batch_schedule_from_an_adaptive_config_file():
    """--speculative-adaptive-config takes a path to a JSON file keyed by batch size; one candidate per key makes it the
    plan's per-batch table, at every batch size once SGLang has padded it to a CUDA-graph size."""
    schedule = [(1, 7), (2, 7), (8, 3), (32, 1), (64, 0)]
    files = serving_engines()["sglang"].render(_context("eagle3", schedule))
    argv = files.document["adaptive"]["argv"]
    path = argv[argv.index("--speculative-adaptive-config") + 1]
    assert path == "adaptive.json" and path in files.files and not path.lstrip().startswith("{")
    table = json.loads(files.files[path])
    assert all(key.isdigit() and isinstance(entry["candidate_steps"], list) for key, entry in table.items())
    graphs = [int(a) for a in argv[argv.index("--cuda-graph-bs-decode") + 1 :]]
    for batch in range(1, 65):
        assert _sglang_router_steps(table, graphs, batch) == [next(d for b, d in schedule if b >= batch)], batch
    assert (
        '"$here/adaptive.json"' in files.files["launch.sh"]
        and "exec python -m sglang.launch_server" in files.files["launch.sh"]
    )
    ngram = serving_engines()["sglang"].render(_context("ngram", schedule))
    assert "adaptive" not in ngram.document and len(ngram.document["bands"]) == 4


def test_fixed_block_drafters_export_the_checkpoints_block():
    """DSpark: TensorRT-LLM needs max_draft_len = block_size and keeps it at every batch size; SGLang's DSPARK takes
    num_draft_tokens = block + 1 and DFLASH one step of the block: a band speculates at the block's D or not at all."""
    schedule = [(1, 4), (4, 2), (16, 0)]
    engines = serving_engines()
    trt = engines["trtllm"].render(_context("dspark", schedule, versions={"trtllm": "1.3.0rc29"}))
    spec = trt.document["speculative_config"]
    assert spec["max_draft_len"] == spec["block_size"] == 8 and "draft_len_schedule" not in spec
    assert [r["draft_len"] for r in trt.deviation["buckets"]] == [8, 8, 8]
    assert all(r["tokens_per_s"]["source"] == "interpolated" for r in trt.deviation["buckets"])
    old_trt = engines["trtllm"].render(_context("dspark", schedule))  # 1.2.1 has no DSpark
    assert "speculative_config" not in old_trt.document and [r["draft_len"] for r in old_trt.deviation["buckets"]] == [
        0,
        0,
        0,
    ]
    for mechanism, drafts in (("dspark", 8), ("dflash", 7)):
        doc = engines["sglang"].render(_context(mechanism, schedule)).document
        on, off = doc["bands"]
        assert (on["draft_len"], off["draft_len"]) == (drafts, 0) and "--speculative-algorithm" not in off["argv"]
        assert on["argv"][on["argv"].index("--speculative-num-draft-tokens") + 1] == str(drafts + 1)
        assert "--speculative-num-steps" not in on["argv"]  # both force one step


def test_tensorrt_modes_that_cannot_follow_a_schedule_get_the_static_config_they_run():
    """1.3rc: the NGram two-model path ignores draft_len_schedule (no support_dynamic_draft_len): one D, the plan's best
    single one, with its predicted cost. 1.2: keys are lower bounds and only modes with a drafter object follow them."""
    schedule = [(1, 4), (4, 2), (16, 1), (64, 0)]
    engines = serving_engines()
    new = engines["trtllm"].render(_context("ngram", schedule, versions={"trtllm": "1.3.0rc29"}))
    assert (
        "draft_len_schedule" not in new.document["speculative_config"]
        and new.document["speculative_config"]["max_draft_len"] == 2
    )
    assert [r["draft_len"] for r in new.deviation["buckets"]] == [2, 2, 2, 2] and "change_pct" in new.deviation[
        "buckets"
    ][0]
    old = engines["trtllm"].render(_context("ngram", schedule)).document["speculative_config"]
    assert old["draft_len_schedule"] == {1: 4, 2: 2, 5: 1, 17: 0}
    assert all(
        sched.k_at_lower(old["draft_len_schedule"], b) == next(d for x, d in schedule if x >= b) for b in range(1, 65)
    )
    eagle = engines["trtllm"].render(_context("eagle3", schedule))
    assert (
        eagle.document["speculative_config"]["decoding_type"] == "Eagle"
        and eagle.document["speculative_config"]["eagle3_one_model"]
    )
    assert "draft_len_schedule" not in eagle.document["speculative_config"] and eagle.deviation
    assert (
        not Version(DEFAULT_VERSIONS["trtllm"]).is_prerelease
        and rules_line("trtllm", DEFAULT_VERSIONS["trtllm"]).name == "1.2"
    )


def test_speculators_config_carries_the_heads_layer_and_the_targets_own_architecture():
    """The verifier's architectures are the target config's own (a multi-part model type is not capitalised into a
    class name); the head's layer config is its real one, never empty."""
    assert architectures({"model_type": "qwen3_moe"}, "x") == ["Qwen3MoeForCausalLM"]
    assert architectures({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "x") == [
        "MixtralForCausalLM"
    ]
    ctx = dataclasses.replace(_context("dflash", [(1, 3)]), target_architectures=("Qwen3MoeForCausalLM",))
    config = serving_engines()["speculators"].render(ctx).document
    assert config["speculators_config"]["verifier"]["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["transformer_layer_config"] == LAYER and config["mask_token_id"] == 49151
    assert config["aux_hidden_state_layer_ids"] == [2, 15, 27]
    emptied = dict(config, transformer_layer_config={})
    assert any(
        "transformer_layer_config" in e
        for e in check_document(serving_engines()["speculators"], emptied, "0.9.0")["errors"]
    )


@pytest.mark.parametrize(
    ("mechanism", "missing", "engine"),
    [
        ("dflash", "mask_token_id", "vLLM"),
        ("dspark", "aux_hidden_state_layer_ids", "vLLM"),
        ("dspark", "block_size", "TensorRT-LLM"),
        ("eagle3", "transformer_layer_config", "speculators"),
    ],
)
def test_a_head_config_without_a_field_an_engine_needs_stops_export_naming_both(tmp_path, mechanism, missing, engine):
    own = {k: v for k, v in HEADS[mechanism].items() if k != missing} | {"speculators_model_type": mechanism}
    (tmp_path / "config.json").write_text(json.dumps(own))
    with pytest.raises(SpecdecError, match=rf"has no {missing}, which {engine}"):
        head_config_fields(mechanism, {"model": str(tmp_path)})


def test_a_threshold_inside_the_noise_is_flagged_and_a_clear_one_is_not():
    schedule = [(1, 3), (4, 3), (8, 1), (16, 1)]
    clear = lambda b, d: {
        "value": 100.0 * b * (1 + d) if b <= 4 else 100.0 * b * (2 - d / 3),
        "source": "measured",
        "low": None,
        "high": None,
    }  # noqa: E731
    assert noisy_thresholds(dataclasses.replace(_context("eagle3", schedule), predict=clear)) == []
    flat = lambda b, d: {"value": 100.0 * b + d, "source": "interpolated", "low": 100.0 * b - 5, "high": 100.0 * b + 5}  # noqa: E731
    flagged = noisy_thresholds(dataclasses.replace(_context("eagle3", schedule), predict=flat))
    assert [(f["threshold"], f["draft_lens"]) for f in flagged] == [(4, [3, 1])] and "inside the noise" in flagged[0][
        "text"
    ]


def test_a_top_band_without_speculation_says_what_it_still_costs(tmp_path):
    """vLLM 0.32 reserves lookahead KV for num_speculative_tokens per request whatever the batch's K: for EAGLE-3 with
    K up to 3, at batch 32, a 30-layer target with 3 KV heads of 64 in bf16 holds 2 x 30 x 3 x 64 x 2 = 23,040 bytes a
    token, so 3 x 23,040 x 32 = 2,211,840 bytes of lookahead; DFlash reserves K + 1 slots, n-gram none."""
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "model.safetensors").write_bytes(b"0" * 4096)
    ctx = dataclasses.replace(
        _context("eagle3", [(1, 3), (8, 1), (32, 0)]), drafter_model=str(tmp_path), target_config=config
    )
    cost = top_band_cost(ctx, dtype_bytes=2)
    assert (
        cost["band"] == [9, 32] and cost["lookahead_slots_per_request"] == 3 and cost["lookahead_kv_bytes"] == 2_211_840
    )
    assert (
        cost["drafter_weight_bytes"] == 4096
        and set(cost["plain_tokens_per_s"]) == {"32"}
        and cost["source"] == "modeled"
    )
    assert (
        top_band_cost(dataclasses.replace(_context("dflash", [(1, 3), (32, 0)]), target_config=config), 2)[
            "lookahead_slots_per_request"
        ]
        == 4
    )
    free = top_band_cost(dataclasses.replace(_context("ngram", [(1, 3), (32, 0)]), target_config=config), 2)
    assert free["lookahead_kv_bytes"] == 0 and "costs there what a plain one does" in free["text"]
    assert top_band_cost(dataclasses.replace(_context("eagle3", [(1, 3), (32, 1)]), target_config=config), 2) is None


@pytest.mark.demo
def test_a_draft_model_cut_from_the_target_ships_as_a_checkpoint_the_engines_load(tmp_path, make_plan):
    """Engines load a draft model from a folder of its own: the bundle writes the target's first layers as one, and it
    is the drafter the plan was made with (its logits equal the truncated target's, in the checkpoint's bfloat16)."""
    import torch

    from specdec_tune.exporters.artifacts import DRAFT_CHECKPOINT, ship_draft_checkpoint
    from specdec_tune.profiles.models.loading import load_model

    profile = load_profile(PROFILE_PATH)
    layers = next(d for d in profile.drafters if d.name == "draft_model").model["layers"]
    assert (
        ship_draft_checkpoint(make_plan([{"batch": 1, "draft_len": 3}], mechanism="ngram"), profile, tmp_path) is None
    )
    assert (
        ship_draft_checkpoint(make_plan([{"batch": 1, "draft_len": 0}], mechanism="draft_model"), profile, tmp_path)
        is None
    )
    rel = ship_draft_checkpoint(make_plan([{"batch": 1, "draft_len": 3}], mechanism="draft_model"), profile, tmp_path)
    config = json.loads((tmp_path / rel / "config.json").read_text())
    assert (
        rel == DRAFT_CHECKPOINT
        and config["num_hidden_layers"] == layers
        and config["architectures"] == ["LlamaForCausalLM"]
    )
    assert "quantization_config" not in config
    draft = load_model(str(tmp_path / rel), dtype="float32").model
    cut = (
        load_model(None, dtype="float32").model.truncated(layers).to(torch.bfloat16).float()
    )  # the checkpoint's rounding
    ids, start = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30]]), torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        want, got = cut(ids, cut.new_cache(1, 16), start), draft(ids, draft.new_cache(1, 16), start)
    assert torch.equal(got.argmax(-1), want.argmax(-1)) and torch.allclose(got, want, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------- bundles


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    search(load_profile(PROFILE_PATH), sha256_file(PROFILE_PATH), SearchSettings(seed=0, trials=100, out_dir=out))
    return out / "plan.json"


@pytest.fixture()
def bundle(plan_path, tmp_path):
    out = tmp_path / "bundle"
    export(ExportSettings(plan=plan_path, profile=PROFILE_PATH, out=out, skip_measure=True))
    return out


def test_bundle_tree_and_manifest(bundle, plan_path):
    manifest = read_manifest(bundle)
    for rel in (
        "vllm/speculative_config.json",
        "vllm/serve.sh",
        "trtllm/config.yaml",
        "sglang/bands.json",
        "report/report.md",
        "report/verify_curve.png",
        "report/pareto_front.png",
        "validation.json",
        "inputs/plan.json",
        "inputs/profile.json",
    ):
        assert rel in manifest["files"], rel
    assert manifest["plan"]["sha256"] == sha256_file(plan_path) and manifest["factors"]["tool_version"] == __version__
    assert manifest["figures"]["predicted_figures_by_source"] and manifest["engines"]["vllm"]["gates"]
    trt = yaml.safe_load((bundle / "trtllm" / "config.yaml").read_text())
    vllm = json.loads((bundle / "vllm" / "speculative_config.json").read_text())
    plan = json.loads(plan_path.read_text())
    trt_runs = (
        dict(manifest["engines"]["trtllm"]["deviation"]["schedule"])
        if manifest["engines"]["trtllm"].get("deviation")
        else None
    )
    for b in plan["buckets"]:
        assert sched.k_at(vllm["num_speculative_tokens_per_batch_size"], b["batch"]) == b["draft_len"]
        if trt_runs is None:
            assert sched.k_at_lower(trt["speculative_config"]["draft_len_schedule"], b["batch"]) == b["draft_len"]
        else:
            # the mode cannot follow the schedule in TensorRT-LLM 1.2.1: what it runs instead is in the config and the
            # manifest
            assert trt.get("speculative_config", {}).get("max_draft_len", 0) == trt_runs[b["batch"]]
    assert main(["validate", str(bundle), "--configs-only"]) == 0


def test_edited_file_fails_its_hash(bundle, capsys):
    path = bundle / "vllm" / "speculative_config.json"
    config = json.loads(path.read_text())
    config["num_speculative_tokens"] += 1
    path.write_text(json.dumps(config, indent=2) + "\n")
    assert main(["validate", str(bundle), "--configs-only"]) == 1
    assert "does not match its hash" in capsys.readouterr().err


@pytest.mark.parametrize("evil", ["../outside.json", "/etc/passwd", "vllm/../../x"])
def test_manifest_path_escaping_the_bundle_is_rejected(bundle, evil):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"][evil] = "0" * 64
    write_json(bundle / "manifest.json", manifest)
    with pytest.raises(SpecdecError, match="escapes the bundle"):
        read_manifest(bundle)


def test_symlinked_or_extra_files_are_rejected(bundle, tmp_path):
    (tmp_path / "secret").write_text("x")
    target = bundle / "vllm" / "serve.sh"
    target.unlink()
    os.symlink(tmp_path / "secret", target)
    with pytest.raises(SpecdecError, match="symlink"):
        read_manifest(bundle)
    target.unlink()
    (bundle / "extra.py").write_text("import os")
    with pytest.raises(SpecdecError):
        read_manifest(bundle)


def test_reexport_replaces_the_bundle_whole(plan_path, bundle):
    (bundle / "report" / "stale.txt").write_text("left over")
    with pytest.raises(SpecdecError, match="not list"):
        read_manifest(bundle)
    export(ExportSettings(plan=plan_path, profile=PROFILE_PATH, out=bundle, skip_measure=True))
    read_manifest(bundle)
    assert not (bundle / "report" / "stale.txt").exists() and not list(bundle.parent.glob(".bundle.staging-*"))


def test_export_refuses_a_plan_from_another_profile(plan_path, tmp_path, capsys):
    other = tmp_path / "profile.json"
    other.write_text(PROFILE_PATH.read_text() + "\n")
    code = main(
        ["export", "--plan", str(plan_path), "--profile", str(other), "--out", str(tmp_path / "b"), "--configs-only"]
    )
    assert code == 1 and "another profile" in capsys.readouterr().err and not (tmp_path / "b").exists()


def _make_fresh_here(bundle: Path) -> None:
    """Point the manifest's device factors at this machine (the recorded profile comes from another run)."""
    import torch

    from specdec_tune.profiles.fingerprint import device_factors, device_fingerprint

    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["factors"]["device"] = device_factors(device_fingerprint(torch.device("cpu"), torch.bfloat16))
    write_json(bundle / "manifest.json", manifest)


def test_check_is_fresh_then_names_each_changed_factor(bundle, capsys):
    _make_fresh_here(bundle)
    versions = [
        "--vllm-version",
        DEFAULT_VERSIONS["vllm"],
        "--trtllm-version",
        DEFAULT_VERSIONS["trtllm"],
        "--sglang-version",
        DEFAULT_VERSIONS["sglang"],
    ]
    assert main(["check", str(bundle), *versions]) == 0
    capsys.readouterr()
    manifest = json.loads((bundle / "manifest.json").read_text())
    changes = {"target_weights": "0" * 64, "tool_version": "0.0.1"}
    for key, value in changes.items():
        manifest["factors"][key] = value
    manifest["factors"]["device"]["name"] = "NVIDIA H100 80GB HBM3"
    manifest["factors"]["device"]["torch"] = "2.9.0"
    write_json(bundle / "manifest.json", manifest)
    assert (
        main(
            [
                "check",
                str(bundle),
                "--json",
                *versions[:2],
                "--trtllm-version",
                "1.4.0",
                "--sglang-version",
                DEFAULT_VERSIONS["sglang"],
            ]
        )
        == STALE_EXIT_CODE
    )
    result = json.loads(capsys.readouterr().out)
    named = {c["factor"] for c in result["changed"]}
    assert named == {"target_weights", "tool_version", "device.name", "device.torch", "engine.trtllm"}
    assert not result["fresh"]


@pytest.mark.demo
def test_lossless_gate_fails_on_a_drafter_that_corrupts_the_target(monkeypatch, make_plan):
    """A drafter sharing the target's weights that edits them in place (the bug a careless in-place
    quantization makes): speculative output then differs from plain output, and the gate says so."""
    import types

    import torch

    from specdec_tune.pipeline.lossless import MeasureSettings, lossless_gate
    from specdec_tune.profiles.drafters import base
    from specdec_tune.profiles.drafters.ngram import NgramDrafter

    class CorruptingDrafter(NgramDrafter):
        def __init__(self, target, options):
            super().__init__(target, options)
            self.head = target.model.lm_head.weight

        def propose(self, request):
            with torch.no_grad():
                self.head.mul_(1.02).add_(torch.randn_like(self.head) * 0.05)
            return super().propose(request)

    monkeypatch.setitem(base._REGISTRY, "lossy", CorruptingDrafter)
    profile = types.SimpleNamespace(
        target={"path": "smollm2-135m"},
        drafters=[types.SimpleNamespace(name="lossy", options={"prompt_lookup_min": 1, "prompt_lookup_max": 3})],
    )
    plan = make_plan([{"batch": 1, "draft_len": 3}], mechanism="lossy")
    gate = lossless_gate(plan, profile, MeasureSettings(prompts=2, new_tokens=16))
    assert not gate["passed"] and gate["runs"][0]["identical"] < gate["runs"][0]["prompts"]
    honest = make_plan([{"batch": 1, "draft_len": 3}], mechanism="ngram")
    profile.drafters = [types.SimpleNamespace(name="ngram", options={"prompt_lookup_min": 1, "prompt_lookup_max": 3})]
    assert lossless_gate(honest, profile, MeasureSettings(prompts=2, new_tokens=16))["passed"]


def test_check_names_a_changed_drafter_checkpoint(bundle, tiny_hf_dir, capsys):
    _make_fresh_here(bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["drafter"] = {
        "name": "draft_model",
        "options": {"model": str(tiny_hf_dir)},
        "model": {"weights_hash": "0" * 64},
    }
    write_json(bundle / "manifest.json", manifest)
    assert main(["check", str(bundle), "--json"]) == STALE_EXIT_CODE
    changed = {c["factor"] for c in json.loads(capsys.readouterr().out)["changed"]}
    assert "drafter_weights" in changed


def test_throughput_gate_scales_by_device_speed_and_names_the_bucket(monkeypatch, fixed_speed, make_plan):
    """The gate compares each bucket's measurement with the prediction at the device's current speed: a
    uniformly slower machine passes with its drift reported; a wrong prediction fails at its bucket."""
    import types

    from specdec_tune.pipeline import throughput_check as validate

    measured = {(1, 3): 100.0, (4, 0): 300.0}
    monkeypatch.setattr(
        validate,
        "measure_decode",
        lambda t, d, ids, D, *a, batch_size, **k: {"tokens_per_s": measured[(batch_size, D)]},
    )
    monkeypatch.setattr(validate, "DeviceSpeed", fixed_speed(1.25))
    monkeypatch.setattr(validate, "plan_drafter", lambda *a: None)
    monkeypatch.setattr(validate, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(validate, "context_prompts", lambda *a: [[1, 2, 3]])
    profile = types.SimpleNamespace(target={"path": "x"}, device={"dtype": "float32"})

    def plan(tps_1, tps_4):
        def bucket(B, D, tps):
            return {"batch": B, "draft_len": D, "tokens_per_s": {"value": tps, "source": "measured"}}

        return make_plan([bucket(1, 3, tps_1), bucket(4, 0, tps_4)])

    ok = validate.throughput_check(plan(125.0, 375.0), profile, validate.MeasureSettings())
    assert ok["passed"] and [round(b["error_pct"], 6) for b in ok["buckets"]] == [0, 0]
    assert [round(b["raw_error_pct"], 6) for b in ok["buckets"]] == [25, 25]
    assert ok["device_drift_pct"] == pytest.approx(25) and "re-profile" in ok["warning"]
    bad = validate.throughput_check(plan(125.0, 500.0), profile, validate.MeasureSettings())
    assert (
        not bad["passed"]
        and bad["worst"]["batch"] == 4
        and bad["worst"]["error_pct"] == pytest.approx(100 * (400 - 300) / 300)
    )


def _decided_by(margin_pct: float) -> dict:
    """A bucket rationale whose decision beat its runner-up by `margin_pct` expected."""
    decision = {
        "expected_speedup": 1.1,
        "runner_up_draft_len": 1,
        "runner_up_expected_speedup": 1.1 / (1 + margin_pct / 100),
        "expected_gain_pct": margin_pct,
        "p_beats_runner_up": 0.8,
        "draws": 200,
    }
    return {"text": "test", "decision": decision}


@pytest.fixture
def loop_check(monkeypatch, fixed_speed, make_plan):
    """check(runs by batch, predicted batch-4 tokens/s interval, batch 4's decision margin) -> (the throughput check's
    record, how often batch 4 was measured): a loop check whose decodes return the given runs, at profile speed."""
    import types

    from specdec_tune.pipeline import throughput_check as validate

    def check(runs: dict[int, list[float]], low_4: float, margin_pct: float, **settings) -> tuple[dict, int]:
        calls = {B: 0 for B in runs}

        def decode(t, d, ids, D, *a, batch_size, **k):
            calls[batch_size] += 1
            r = runs[batch_size]
            return {
                "tokens_per_s": statistics.median(r),
                "tokens_per_s_range": [min(r), max(r)],
                "tokens_per_s_runs": r,
            }

        monkeypatch.setattr(validate, "measure_decode", decode)
        monkeypatch.setattr(validate, "DeviceSpeed", fixed_speed(1.0))
        monkeypatch.setattr(validate, "plan_drafter", lambda *a: None)
        monkeypatch.setattr(validate, "load_model", lambda *a, **k: None)
        monkeypatch.setattr(validate, "context_prompts", lambda *a: [[1, 2, 3]])
        monkeypatch.setattr(validate, "another_device", lambda profiled: "")
        profile = types.SimpleNamespace(target={"path": "x"}, device={"dtype": "float32"})
        one = {
            "batch": 1,
            "draft_len": 3,
            "tokens_per_s": {"value": 100.0, "source": "modeled", "low": 95.0, "high": 105.0},
        }
        four = {
            "batch": 4,
            "draft_len": 1,
            "tokens_per_s": {"value": 360.0, "source": "modeled", "low": low_4, "high": 380.0},
            "rationale": _decided_by(margin_pct),
        }
        measure = validate.MeasureSettings(**settings)
        return validate.throughput_check(make_plan([one, four]), profile, measure), calls[4]

    return check


def test_a_check_too_spread_to_judge_is_inconclusive_never_passed(loop_check):
    """Batch 4 measures 20% below its prediction, the prediction's interval overlapping runs spread ±3%. The plan
    decided that bucket by 1% over its runner-up: runs that spread cannot tell, so the check measures again (up to
    MORE_RUNS x its runs) and then calls the bucket inconclusive: not passed, not failed, nothing repaired. Decided by
    15%, the same runs are fine enough, and the error is inside the noise. Batch 1, within the tolerance with tight
    runs, passes."""
    from specdec_tune.exporters.validation_text import describe_throughput_row, throughput_text
    from specdec_tune.pipeline.repair import failing_rows
    from specdec_tune.pipeline.throughput_check import MORE_RUNS

    runs = {1: [99.0, 100.0, 101.0], 4: [290.0, 300.0, 310.0]}
    tp, measured = loop_check(runs, low_4=305.0, margin_pct=1.0)
    one, four = tp["buckets"]
    assert one["verdict"] == "passed" and one["runs"] == 3
    assert four["verdict"] == "inconclusive" and four["error_pct"] == pytest.approx(20)
    assert measured == MORE_RUNS and four["runs"] == 3 * MORE_RUNS
    assert not tp["passed"] and not tp["failed"] and tp["inconclusive_batches"] == [4] and failing_rows(tp) == []
    assert throughput_text(tp) == "inconclusive at batch 4" and "inconclusive (predicted" in describe_throughput_row(
        four
    )

    tp, measured = loop_check(runs, low_4=305.0, margin_pct=15.0)
    assert tp["buckets"][1]["verdict"] == "inside the noise" and tp["passed"] and measured == 1
    assert throughput_text(tp) == "passed"


def test_measuring_open_verdicts_again_stops_when_its_time_runs_out(loop_check, monkeypatch):
    """Each measurement takes 10 s on a clock that only the check reads: 25 s for measuring again allows two more
    measurements of batch 4 (10 s each, while what is left exceeds one measurement), then the bucket is left open
    and says why."""
    import itertools
    import types

    from specdec_tune.exporters.validation_text import describe_throughput_row
    from specdec_tune.pipeline import throughput_check as validate

    ticks = itertools.count(step=10.0)  # each measurement reads it twice: 10 s apart
    monkeypatch.setattr(validate, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    runs = {1: [99.0, 100.0, 101.0], 4: [290.0, 300.0, 310.0]}
    tp, measured = loop_check(runs, low_4=305.0, margin_pct=1.0, recheck_s=25.0)
    four = tp["buckets"][1]
    assert measured == 3 and four["runs"] == 9 and "left_open" not in four  # MORE_RUNS reached first
    tp, measured = loop_check(runs, low_4=305.0, margin_pct=1.0, recheck_s=15.0)
    four = tp["buckets"][1]
    assert measured == 2 and four["verdict"] == "inconclusive" and "15 s" in four["left_open"]
    assert describe_throughput_row(four).endswith(
        "left open: the check's 15 s for measuring open verdicts again ran out)"
    )
    assert "within 15 s over all buckets" in tp["rule"]


def test_a_check_fails_a_bucket_whose_measurement_is_apart_from_its_prediction(loop_check):
    from specdec_tune.exporters.validation_text import throughput_text
    from specdec_tune.pipeline.repair import failing_rows

    tp, _ = loop_check({1: [99.0, 100.0, 101.0], 4: [290.0, 300.0, 310.0]}, low_4=340.0, margin_pct=1.0)
    assert tp["buckets"][1]["verdict"] == "failed" and tp["failed"] and not tp["passed"]
    assert [r["batch"] for r in failing_rows(tp)] == [4] and throughput_text(tp) == "FAILED at batch 4"


def test_a_bucket_without_speculation_is_checked_against_a_step_its_prediction_does_not_read(monkeypatch, make_plan):
    """The profile caught batch 8's one-token step 30% faster than the device runs it, so the D = 0 prediction, B / that
    step, is 43% high. Scaled by a probe of that same step the measurement would agree with the prediction whatever the
    step's profiled time; probed on the two-token step (profiled right), the check fails the bucket. A bucket that
    speculates keeps the one-token probe."""
    import types

    from specdec_tune.pipeline import throughput_check as validate

    true_ms = {(8, 1): 40.0, (8, 2): 44.0}
    profiled_ms = {(8, 1): 28.0, (8, 2): 44.0}

    class Step:  # the device: each verify step at its true time
        def __init__(self, model, batch, ctx, max_tokens, seed=0):
            self.batch = batch

        def timing(self, tokens, warmup=1, repeats=5):
            return types.SimpleNamespace(median_ms=true_ms[(self.batch, tokens)])

    def decode(t, d, ids, D, *a, batch_size, between, **k):  # plain decoding at the true one-token step
        rate = 1000 * batch_size / true_ms[(batch_size, 1)]
        between()
        for _ in range(3):
            between()
        return {"tokens_per_s": rate, "tokens_per_s_range": [rate, rate], "tokens_per_s_runs": [rate] * 3}

    monkeypatch.setattr(validate, "VerifyStep", Step)
    monkeypatch.setattr(validate, "measure_decode", decode)
    monkeypatch.setattr(validate, "plan_drafter", lambda *a: None)
    monkeypatch.setattr(validate, "load_model", lambda *a, **k: types.SimpleNamespace(model=None))
    monkeypatch.setattr(validate, "context_prompts", lambda *a: [[1, 2, 3]])
    monkeypatch.setattr(validate, "another_device", lambda profiled: "")
    verify = [
        types.SimpleNamespace(batch=B, tokens=t, ctx=128, median_ms=ms, source="measured")
        for (B, t), ms in profiled_ms.items()
    ]
    profile = types.SimpleNamespace(target={"path": "x"}, device={"dtype": "float32"}, verify=verify)
    predicted = 1000 * 8 / profiled_ms[(8, 1)]
    plan = make_plan(
        [
            {
                "batch": 8,
                "draft_len": 0,
                "tokens_per_s": {
                    "value": predicted,
                    "source": "measured",
                    "low": predicted * 0.98,
                    "high": predicted * 1.02,
                },
            }
        ]
    )
    tp = validate.throughput_check(plan, profile, validate.MeasureSettings())
    [row] = tp["buckets"]
    assert row["speed_reference"] == {"batch": 8, "tokens": 2} and row["device_speed_ratio"] == pytest.approx(1.0)
    assert row["error_pct"] == pytest.approx(100 * (40 / 28 - 1)) and row["verdict"] == "failed" and tp["failed"]
    speed = validate.DeviceSpeed(None, profile, 128)
    assert speed.reference(8, 0) == (8, 2) and speed.reference(8, 3) == (8, 1)
    one_token_only = types.SimpleNamespace(verify=verify[:1])
    assert validate.DeviceSpeed(None, one_token_only, 128).reference(8, 0) == (8, 1)  # no two-token step: the one


def test_the_export_line_says_how_many_buckets_speculate_and_what_the_tolerance_gave_up(make_plan):
    from specdec_tune.exporters.validation_text import summary_line, throughput_text, tolerance_forgone

    speculating = {
        "speculating_batches": [1, 2, 4],
        "buckets": 4,
        "tolerance_forgone": {"schedule": [[1, 6], [2, 4], [4, 2], [8, 1]], "expected_gain_pct": 0.12},
        "lossless": "passed",
        "throughput": "passed",
        "throughput_worst_error_pct": -2.5,
        "device_drift_pct": 3.0,
    }
    line = summary_line(speculating)
    assert "speculates at 3 of 4 buckets (batch 1, 2, 4)" in line
    assert "the tie tolerance gives up +0.1% expected mean speedup (D = 6, 4, 2, 1 without it)" in line
    speculating["tolerance_forgone"] |= {"mechanism": "suffix"}  # a drafter tie: the drafter passed over is named
    assert "gives up +0.1% expected mean speedup (suffix D = 6, 4, 2, 1 without it)" in summary_line(speculating)
    assert "throughput passed, worst error -2.5% at the device's current speed (3.0% from profile time)" in line
    plain = {
        "speculating_batches": [],
        "buckets": 4,
        "tolerance_forgone": None,
        "lossless": "not applicable (the plan never speculates)",
        "throughput": throughput_text({"checked": False, "why": "the plan is for h200 (modeled), not this device"}),
        "throughput_worst_error_pct": None,
    }
    line = summary_line(plain)
    assert "speculates at none of 4 buckets: the bundle serves plain decoding" in line
    assert "lossless not applicable" in line and "throughput not applicable (the plan is for h200" in line
    assert throughput_text({"skipped": "--configs-only"}) == "skipped (--configs-only)"
    plan = make_plan([{"batch": 1, "draft_len": 2}, {"batch": 8, "draft_len": 0}])
    assert tolerance_forgone(plan) is None


def test_export_prints_its_summary_line(plan_path, tmp_path, capsys):
    out = tmp_path / "b"
    assert (
        main(
            [
                "export",
                "--plan",
                str(plan_path),
                "--profile",
                str(PROFILE_PATH),
                "--out",
                str(out),
                "--configs-only",
                "--no-onnx",
            ]
        )
        == 0
    )
    printed = " ".join(capsys.readouterr().out.split())
    plan = json.loads(plan_path.read_text())
    speculating = [b["batch"] for b in plan["buckets"] if b["draft_len"]]
    assert f"speculates at {len(speculating)} of {len(plan['buckets'])} buckets" in printed
    assert "lossless skipped (--configs-only); throughput skipped (--configs-only)" in printed
    assert read_manifest(out)["validation"]["speculating_batches"] == speculating


def test_device_speed_probes_each_batch_at_its_own_profiled_step(tiny_hf_dir):
    import types

    from specdec_tune.pipeline.throughput_check import DeviceSpeed
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.verify_curve import time_verify_step

    target = load_model(str(tiny_hf_dir), dtype="float32")
    now = {B: time_verify_step(target.model, B, 32, 1)["median_ms"] for B in (1, 4)}

    def point(B, factor, **kw):
        return types.SimpleNamespace(batch=B, tokens=1, ctx=32, median_ms=now[B] * factor, source="measured", **kw)

    # batch 1 "profiled" 1000x slower than now, batch 4 1000x faster: each bucket's ratio comes from its own batch
    two_tokens = types.SimpleNamespace(
        batch=4, tokens=2, ctx=32, median_ms=1.0, source="measured", raw_median_ms=None
    )  # not a probe's step
    profile = types.SimpleNamespace(
        verify=[point(1, 1000, raw_median_ms=None), point(4, 1e-3, raw_median_ms=None), two_tokens]
    )
    speed = DeviceSpeed(target, profile, 32)
    result, (ratio_1,) = speed.measure(lambda between: "done", batch=1)
    _, (ratio_4,) = speed.measure(lambda between: "done", batch=4)
    _, (ratio_8,) = speed.measure(
        lambda between: "done", batch=8
    )  # not profiled: the nearest profiled batch stands for it
    assert result == "done" and 0 < ratio_1 < 0.01 and ratio_4 > 100 and ratio_8 > 100 and speed.probed_batch(2) == 1
    # the fitted figure (the one the prediction was built from) is what the probe compares with, not the raw median
    fitted = DeviceSpeed(target, types.SimpleNamespace(verify=[point(1, 1000, raw_median_ms=now[1])]), 32)
    assert 0 < fitted.measure(lambda between: None)[1][0] < 0.01
    unprobed = DeviceSpeed(target, types.SimpleNamespace(verify=[]), 32)
    assert (
        unprobed.measure(lambda between: 1, batch=4) == (1, [1.0])
        and unprobed.why == "the profile has no measured verify step with one token at ctx 32"
    )


def test_device_speed_pairs_each_timed_run_with_the_probes_on_either_side():
    """measure_decode calls `between` before its first run and after each; each run's ratio is the mean of its two
    probes."""
    import types

    from specdec_tune.pipeline.throughput_check import DeviceSpeed

    profile = types.SimpleNamespace(
        verify=[types.SimpleNamespace(batch=1, tokens=1, ctx=32, median_ms=10.0, source="fitted")]
    )
    speed = DeviceSpeed(None, profile, 32)
    speed.probes[(1, 1)] = iter([10.0, 20.0, 30.0, 40.0]).__next__

    def runs(between):
        for _ in range(2):
            between()
        between()
        return "runs"

    assert speed.measure(runs) == ("runs", [1.5, 2.5])
    speed.probes[(1, 1)] = iter([10.0, 30.0]).__next__
    assert speed.measure(lambda between: "no probes of its own") == (
        "no probes of its own",
        [2.0],
    )  # probed around it instead


def test_a_bucket_is_judged_on_its_runs_each_at_the_speed_probed_beside_it(make_plan):
    """Runs of 100, 50, 50 tokens/s, with the probes beside them reading the device at profile speed for the first and
    half as fast for the next two, are 100 tokens/s at profile speed: a prediction of 100 is right. Runs that all fell
    in a slow spell which the probes before the first and after the last missed (one ratio, 1.0) fail it."""
    from specdec_tune.pipeline.throughput_check import bucket_row

    [bucket] = make_plan(
        [
            {
                "batch": 1,
                "draft_len": 2,
                "tokens_per_s": {"value": 100.0, "source": "modeled", "low": 99.0, "high": 101.0},
            }
        ]
    ).buckets
    runs = {"tokens_per_s": 50.0, "tokens_per_s_range": [50.0, 100.0], "tokens_per_s_runs": [100.0, 50.0, 50.0]}
    row = bucket_row(bucket, runs, [1.0, 2.0, 2.0], tolerance_pct=15)
    assert row["within"] and row["error_pct"] == pytest.approx(0) and row["device_speed_ratio"] == pytest.approx(2.0)
    assert row["predicted_at_current_speed_tokens_per_s"] == pytest.approx(50.0) and row[
        "measured_at_profile_speed_range_tokens_per_s"
    ] == [100.0, 100.0]
    slow = {"tokens_per_s": 50.0, "tokens_per_s_range": [49.0, 51.0], "tokens_per_s_runs": [49.0, 50.0, 51.0]}
    assert bucket_row(bucket, slow, [2.0, 2.0, 2.0], tolerance_pct=15)["within"]
    missed = bucket_row(bucket, slow, [1.0], tolerance_pct=15)
    assert not missed["within"] and missed["error_pct"] == pytest.approx(100)


def test_throughput_is_not_checked_against_a_profile_from_another_device(make_plan):
    import types

    from specdec_tune.pipeline.throughput_check import MeasureSettings, throughput_check

    profile = types.SimpleNamespace(
        target={"path": "x"}, device={"kind": "cpu", "name": "Another CPU 9000", "dtype": "float32"}
    )
    result = throughput_check(make_plan([{"batch": 1, "draft_len": 3}]), profile, MeasureSettings())
    assert result["checked"] is False and "'Another CPU 9000' there" in result["why"]


def test_engine_modules_compare_no_mechanism_name_outside_the_registry():
    """Every engine's spelling of a mechanism lives in exporters/mechanisms.py; the engine modules look it up."""
    import re

    from specdec_tune.exporters.mechanisms import MECHANISMS

    names = "|".join(MECHANISMS)
    pattern = re.compile(
        rf"""(==|!=|\bin)\s*\(?["']({names})["']|["']({names})["']\s*(==|!=|\bin\b)|\{{\s*["']({names})["']\s*:"""
    )
    folder = Path(__file__).resolve().parents[1] / "exporters"
    found = [
        f"{p.name}:{i}: {line.strip()}"
        for p in sorted(folder.glob("*.py"))
        if p.name != "mechanisms.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
    assert pattern.search('if ctx.mechanism == "ngram":') and pattern.search('STATIC = {"dspark": 1}')


def test_an_imported_eagle3_head_whose_layer_type_vllm_refuses_stops_export_naming_engine_and_field(tmp_path):
    """vLLM 0.32's speculators reader maps an EAGLE-3 layer of model type llama or qwen3 to its architecture and
    raises "Unsupported model_type" for any other (transformers_utils/configs/speculators/algos.py, update_eagle3)."""
    own = HEADS["eagle3"] | {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": LAYER | {"model_type": "qwen2"},
    }
    (tmp_path / "config.json").write_text(json.dumps(own))
    with pytest.raises(SpecdecError, match=r"transformer_layer_config.model_type 'qwen2', which vLLM 0.32") as e:
        head_config_fields("eagle3", {"model": str(tmp_path)})
    assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(own | {"transformer_layer_config": LAYER}))
    assert head_config_fields("eagle3", {"model": str(tmp_path)})["transformer_layer_config"]["model_type"] == "llama"


@pytest.mark.parametrize(("anchor", "drafts", "lookahead"), [(None, 8, 7), (True, 8, 7), (False, 7, 8)])
def test_dspark_sample_from_anchor_is_written_explicitly_and_sets_drafts_and_lookahead(
    tmp_path, anchor, drafts, lookahead
):
    """speculators 0.9.0's DSparkConfig defaults sample_from_anchor to true (as this tool's loop reads a head), vLLM
    0.32's reader to false: the bundle writes the field, and a block's drafts and vLLM's lookahead KV slots
    (VllmConfig.num_lookahead_tokens: K with anchor sampling, K + 1 filling in) follow it."""
    own = {k: v for k, v in HEADS["dspark"].items() if k != "sample_from_anchor"}
    if anchor is not None:
        own["sample_from_anchor"] = anchor
    (tmp_path / "config.json").write_text(json.dumps(own | {"speculators_model_type": "dspark"}))
    head = head_config_fields("dspark", {"model": str(tmp_path)})
    assert head["sample_from_anchor"] is (anchor is not False)
    ctx = dataclasses.replace(_context("dspark", [(4, 8), (8, 0)]), head=head)
    assert ctx.spelling.drafts_per_block(head) == drafts
    written = serving_engines()["speculators"].render(ctx)
    assert written.document["sample_from_anchor"] is head["sample_from_anchor"]
    assert ctx.spelling.vllm.lookahead(7, head) == lookahead


@pytest.mark.parametrize("trtllm", ["1.2.1", "1.3.0rc29"])
def test_a_separately_trained_mtp_head_is_plain_serving_in_the_same_words_for_every_engine(trtllm):
    """vLLM 0.32, SGLang 0.5.23 and TensorRT-LLM 1.2 run MTP from the target checkpoint's own layers: none loads a
    separately trained head, so no engine is pointed at one; each records the one sentence and serves plainly."""
    ctx = _context("mtp", [(2, 3), (8, 1)], versions={"trtllm": trtllm})
    engines = serving_engines()
    rendered = {name: engines[name].render(ctx) for name in ("vllm", "trtllm", "sglang")}
    whys = {name: r.deviation["why"] for name, r in rendered.items()}
    assert len(set(whys.values())) == 1 and "plain serving" in whys["vllm"]
    assert all([b["draft_len"] for b in r.deviation["buckets"]] == [0, 0] for r in rendered.values())
    assert rendered["vllm"].document is None and "speculative_config" not in rendered["trtllm"].document
    assert all(
        band["draft_len"] == 0 and "--speculative-algorithm" not in band["argv"]
        for band in rendered["sglang"].document["bands"]
    )
    assert not any("/models/draft" in text for r in rendered.values() for text in r.files.values())


@pytest.mark.parametrize("mechanism", ["dflash", "dspark", "eagle3"])
def test_tensorrt_layer_ids_are_the_heads_aux_ids_less_one(mechanism):
    """speculators and vLLM's reader count the state entering layer i as i (0: the embeddings); TensorRT-LLM captures
    layer i's output as i (maybe_capture_hidden_states at each decoder layer's end): ids less one, id 0 refused."""
    spec = serving_engines()["trtllm"].render(_context(mechanism, [(2, 3), (8, 1)], versions={"trtllm": "1.3.0rc29"}))
    field = "eagle3_layers_to_capture" if mechanism == "eagle3" else "target_layer_ids"
    assert spec.document["speculative_config"][field] == [1, 14, 26]
    key = "eagle_aux_hidden_state_layer_ids" if mechanism == "eagle3" else "aux_hidden_state_layer_ids"
    ctx = dataclasses.replace(_context(mechanism, [(2, 3)]), head=HEADS[mechanism] | {key: [0, 15, 27]})
    with pytest.raises(SpecdecError, match="reads the embeddings"):
        serving_engines()["trtllm"].render(dataclasses.replace(ctx, versions=dict(ctx.versions, trtllm="1.3.0rc29")))


def test_a_draft_target_schedule_for_a_tensorrt_release_candidate_says_its_lookup_is_unverified():
    schedule = [(2, 3), (8, 1), (32, 0)]
    engines = serving_engines()
    rc = engines["trtllm"].render(_context("draft_model", schedule, versions={"trtllm": "1.3.0rc29"}))
    assert any(d.startswith("unverified: draft_len_schedule keys are written as upper bounds") for d in rc.decisions)
    stable = engines["trtllm"].render(_context("draft_model", schedule))
    assert not any("unverified" in d for d in stable.decisions)


def test_vllm_runs_a_dflash_block_of_the_heads_length_where_the_loop_measured_the_whole_block():
    """vLLM drafts a DFlash block of 1 + K queries (v1/spec_decode/dflash.py); the loop measured the head's whole block
    (block_size 8: 7 drafts). A loop profile's speculating buckets run K = 7 in vLLM, a vLLM profile's as planned."""
    ctx = _context("dflash", [(2, 3), (8, 1), (32, 0)])
    loop = serving_engines()["vllm"].render(ctx)
    assert loop.document["num_speculative_tokens_per_batch_size"] == [[1, 8, 7], [9, 32, 0]]
    assert "1 + K queries" in loop.deviation["why"] and loop.document["num_speculative_tokens"] == 7
    measured = serving_engines()["vllm"].render(dataclasses.replace(ctx, profile_engine="vllm"))
    assert measured.deviation is None and measured.document["num_speculative_tokens"] == 3


def test_a_dspark_head_whose_markov_head_vllm_does_not_build_is_plain_serving_in_vllm(tmp_path):
    from specdec_tune.exporters.head_folders import ship_head_folders

    head = HEADS["dspark"] | {"markov_head_type": "rnn"}
    ctx = dataclasses.replace(_context("dspark", [(2, 8), (8, 0)]), head=head, drafter_model=None)
    assert ship_head_folders(ctx, tmp_path).refused == {}  # no folder: nothing shipped, nothing to refuse
    refused = {"vllm": MECHANISMS_REGISTRY["dspark"].engine_refusals[0][1](head)}
    assert "vanilla Markov head only" in refused["vllm"]
    vllm = serving_engines()["vllm"].render(dataclasses.replace(ctx, head_refused=refused))
    assert vllm.document is None and vllm.deviation["why"].startswith("vLLM cannot load this head (")
    assert (
        MECHANISMS_REGISTRY["dspark"].engine_refusals[0][1](HEADS["dspark"] | {"markov_head_type": "vanilla"}) is None
    )


def test_an_eagle3_head_without_norm_before_residual_gets_the_value_the_loop_ran_written():
    """speculators 0.9.0 and this tool's reader default norm_before_residual to false, vLLM 0.32's reader to true: the
    bundle's speculators config states it."""
    head = {k: v for k, v in HEADS["eagle3"].items() if k != "norm_before_residual"}
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(head | {"speculators_model_type": "eagle3"}))
        fields = head_config_fields("eagle3", {"model": folder})
    assert fields["norm_before_residual"] is False
    written = serving_engines()["speculators"].render(dataclasses.replace(_context("eagle3", [(4, 3)]), head=fields))
    assert written.document["norm_before_residual"] is False
    assert any("norm_before_residual = false written explicitly" in d for d in written.decisions)
