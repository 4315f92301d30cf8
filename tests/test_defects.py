"""Checks that keep stated behaviour and stated figures true: decode's lossless check, the export gate for a plan that
never speculates, what quantized draft time is, the projection of learned heads, the README's figures against the
results they quote, and the demo marker on tests that run the real demo target."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from specdec_tune import SpecdecError
from specdec_tune.cli import main
from specdec_tune.profiles.schema import Profile, load_profile
from specdec_tune.progress import Progress
from specdec_tune.records import sha256_file

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
PROFILE_PATH = TESTS / "data" / "demo_profile.json"
README = (REPO / "README.md").read_text()


def _refuse_loading(monkeypatch) -> None:
    """Loading any model fails the test: the refusal must come before the target loads."""

    def load_model(*args, **kwargs):
        raise AssertionError(f"a model was loaded: {args} {kwargs}")

    for where in (
        "profiles.decode_run",
        "profiles.models.loading",
        "pipeline.lossless",
        "pipeline.throughput_check",
        "pipeline.export",
    ):
        monkeypatch.setattr(f"specdec_tune.{where}.load_model", load_model)


# ---------------------------------------------------------------------------- decode --check-lossless without a drafter


def test_check_lossless_without_a_drafter_is_refused(monkeypatch, capsys):
    from specdec_tune.profiles.decode_run import DecodeSettings

    with pytest.raises(SpecdecError, match="--check-lossless needs a drafter") as e:
        DecodeSettings(check_lossless=True).validate()
    assert "add --drafter ngram" in e.value.hint and "\n" not in str(e.value)
    DecodeSettings(check_lossless=True, drafter="ngram").validate()  # with a drafter it stands

    _refuse_loading(monkeypatch)
    assert main(["decode", "--check-lossless"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --check-lossless needs a drafter") and err.count("\n") == 1


def test_an_unknown_drafter_is_refused_before_the_target_loads(monkeypatch, capsys):
    _refuse_loading(monkeypatch)
    assert main(["decode", "--drafter", "nope"]) == 1
    assert "unknown drafter mechanism 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- a plan that never speculates


@pytest.fixture(scope="module")
def never_speculates(tmp_path_factory) -> tuple[Path, Path]:
    """(plan.json, profile.json): the demo profile with every drafter accepting nothing, so D = 0 in every bucket."""
    from specdec_tune.autotune.search import SearchSettings, search

    folder = tmp_path_factory.mktemp("never")
    doc = json.loads(PROFILE_PATH.read_text())
    for a in doc["acceptance"]:
        a["tokens_per_forward"] = [1.0] * len(a["tokens_per_forward"])
        a["mean_al_vllm"] = [1.0] * len(a["mean_al_vllm"])
        a["tokens_per_forward_ci"] = [[1.0, 1.0] for _ in a.get("tokens_per_forward_ci", [])]
    profile = folder / "profile.json"
    profile.write_text(json.dumps(doc))
    search(
        load_profile(profile),
        sha256_file(profile),
        SearchSettings(seed=0, trials=20, mechanisms=("ngram",), out_dir=folder),
    )
    plan = folder / "plan.json"
    assert all(b["draft_len"] == 0 for b in json.loads(plan.read_text())["buckets"])
    return plan, profile


def test_lossless_gate_is_not_applicable_when_the_plan_never_speculates(monkeypatch, make_plan):
    from specdec_tune.pipeline.lossless import MeasureSettings, lossless_gate

    _refuse_loading(monkeypatch)
    plan = make_plan([{"batch": 1, "draft_len": 0}, {"batch": 4, "draft_len": 0}])
    gate = lossless_gate(plan, None, MeasureSettings())
    assert gate["applicable"] is False and gate["passed"] is None
    assert gate["note"] == "the plan never speculates"


def test_a_plan_that_never_speculates_exports_with_the_gate_not_applicable(
    never_speculates, tmp_path, monkeypatch, capsys
):
    from specdec_tune.exporters import bundle as bundle_module
    from specdec_tune.pipeline import export as export_module

    plan, profile = never_speculates
    _refuse_loading(monkeypatch)
    monkeypatch.setattr(bundle_module, "ship_kernels", lambda *a: {"skipped": "kernels are not what this test checks"})
    monkeypatch.setattr(
        export_module, "throughput_check", lambda *a, **k: {"checked": False, "why": "not measured in this test"}
    )
    out = tmp_path / "bundle"
    assert main(["export", "--plan", str(plan), "--profile", str(profile), "--out", str(out), "--no-onnx"]) == 0
    printed = capsys.readouterr().out
    assert "lossless not applicable (the plan never speculates)" in " ".join(printed.split())

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["validation"]["lossless"] == "not applicable (the plan never speculates)"
    gate = json.loads((out / "validation.json").read_text())["lossless"]
    assert gate["applicable"] is False and gate["passed"] is None
    report = (out / "report" / "report.md").read_text()
    assert "lossless (fp32 greedy, held-back prompts): not applicable (the plan never speculates)" in report
    assert "passed" not in next(line for line in report.splitlines() if line.startswith("- lossless"))

    assert main(["validate", str(out), "--lossless-prompts", "1"]) == 0
    assert "lossless: not applicable (the plan never speculates)" in capsys.readouterr().out


# ---------------------------------------------------------------------------- quantized draft time


CLAIMS_OF_MEASURED_QUANT_TIME = (
    r"time is measured[^.]*where the device runs the format",
    r"measured only where the device runs",
    r"quantized drafter on a device that has the format\s+but is not this one",
)


def test_nothing_claims_quantized_draft_time_is_measured_and_it_is_modeled():
    from specdec_tune.autotune.cost_model import CostModel
    from specdec_tune.profiles.drafters import quant

    texts = {"README.md": README, "profiles/drafters/quant.py docstring": quant.__doc__}
    for folder in ("kernels", "profiles", "autotune", "exporters"):
        texts |= {str(p.relative_to(REPO)): p.read_text() for p in (REPO / folder).rglob("*.py")}
    for where, text in texts.items():
        for claim in CLAIMS_OF_MEASURED_QUANT_TIME:
            assert not re.search(claim, " ".join(text.split())), (where, claim)
    assert "modeled" in quant.__doc__ and "--device" in quant.__doc__
    assert re.search(r"quantized[^.]*draft time[^.]*modeled", " ".join(README.split()))

    profile = load_profile(PROFILE_PATH)
    assert not [p for p in profile.draft if p.quant != "none"]  # the profiler times full-precision drafters only
    cost = CostModel(profile)
    full, fp8 = cost.draft_ms("draft_model", "none", 1, 3), cost.draft_ms("draft_model", "fp8", 1, 3)
    assert fp8.source == "modeled" and fp8.value == full.value


def tiny_target(vocab: int = 1024, layers: int = 4):
    """A tiny random target of our own model class, wrapped as a loaded model."""
    import torch

    from specdec_tune.profiles.models.folders import ModelRef
    from specdec_tune.profiles.models.llama import CausalLM, ModelConfig, init_random
    from specdec_tune.profiles.models.loading import LoadedModel

    c = ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = init_random(CausalLM(c), seed=0).eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=None, ref=ModelRef("tiny", "hf", "llama", "float32", "c", "w", layers))


def tiny_profiler(target, drafters: dict, quant_formats=("fp8", "nvfp4")):
    """A TorchProfiler over `target` and `drafters` without loading anything (the phases under test only)."""
    import types

    import torch

    from specdec_tune.profiles.torch_profile import TorchProfiler
    from specdec_tune.settings import ProfileSettings

    profiler = TorchProfiler.__new__(TorchProfiler)
    profiler.s = ProfileSettings(max_draft_len=3, batch_buckets=(1, 2), ctx_buckets=(16,), quant_formats=quant_formats)
    profiler.model, profiler.device, profiler.progress = target.model, torch.device("cpu"), Progress()
    profiler.prompt_ids = [[1, 2, 3, 4, 5, 6, 7, 8]]
    profiler.drafters = drafters
    profiler.guard = types.SimpleNamespace(run=lambda measure: (measure(), 1.0, 1.0))
    return profiler


def test_a_fresh_profile_times_no_quantized_drafter(tmp_path):
    """Draft time is measured for the drafters as they are (full precision); a weight format only changes acceptance."""
    from specdec_tune.profiles.drafters import create
    from specdec_tune.profiles.profile_run import Budget
    from specdec_tune.profiles.schema import DraftPoint
    from specdec_tune.profiles.store import MeasurementLog

    target = tiny_target()
    profiler = tiny_profiler(target, {"draft_model": create("draft_model", target, {"layers": "1"})})
    points = [
        DraftPoint.model_validate(p) for p in profiler._draft_costs(MeasurementLog(tmp_path, "f" * 64), Budget(10.0))
    ]
    assert points and {p.quant for p in points} == {"none"}
    assert profiler._drafter_infos()[0]["quant_formats"] == [
        "none",
        "fp8",
        "nvfp4",
    ]  # acceptance is what the formats get


# ---------------------------------------------------------------------------- projection of learned heads

TARGET_VOCAB = 49152  # SmolLM2-135M, the demo profile's target


def learned_heads_profile(draft_vocab: int | None = 8192) -> Profile:
    """The demo profile with a DFlash (one pass over its block) and an EAGLE-3 (one step per token) head added, each
    with draft points at D = 1..7; `draft_vocab` None leaves the draft vocabulary unrecorded, as older profiles do."""
    doc = json.loads(PROFILE_PATH.read_text())
    model = {"hidden_layers": [2, 15, 27], "shares_target_weights": True, "weights_hash": "0" * 64}
    if draft_vocab is not None:
        model["draft_vocab_size"] = draft_vocab
    doc["drafters"] += [
        {
            "name": "dflash",
            "kind": "parallel",
            "options": {"model": "/heads/dflash", "random": False},
            "model": {**model, "layers": 2},
            "quant_formats": ["none"],
            "draft_len_multiple": 1,
            "max_draft_len": 7,
        },
        {
            "name": "eagle3",
            "kind": "serial",
            "options": {"model": "/heads/eagle3", "random": False},
            "model": {**model, "layers": 1},
            "quant_formats": ["none"],
            "draft_len_multiple": 1,
            "max_draft_len": None,
        },
    ]
    for name in (
        "dflash",
        "eagle3",
    ):  # a profile records every drafter's memory: here the draft model's figures stand in
        doc["memory"]["drafters"][name] = doc["memory"]["drafters"]["draft_model"]
    batch, ctx = doc["workload"]["batch_buckets"][0], doc["workload"]["ctx_buckets"][0]
    for name, ms_at in (
        ("dflash", lambda D: 3.5),
        ("eagle3", lambda D: 1.2 * D),
    ):  # as measured on the 2-core CPU, roughly
        doc["draft"] += [
            {
                "mechanism": name,
                "quant": "none",
                "batch": batch,
                "draft_len": D,
                "ctx": ctx,
                "median_ms": ms_at(D),
                "repeats": 5,
                "source": "measured",
            }
            for D in range(1, 8)
        ]
    return Profile.model_validate(doc)


def projected_draft_ms(profile: Profile, device: str = "h200") -> dict[tuple[str, int, int], float]:
    """(mechanism, batch, D) -> projected draft ms, and the projected profile's notes."""
    from specdec_tune.autotune.hardware import get_device_spec
    from specdec_tune.autotune.projection import project

    projected = project(profile, get_device_spec(device))
    return {
        (p.mechanism, p.batch, p.draft_len): p.median_ms for p in projected.draft if p.quant == "none"
    }, projected.notes


@pytest.mark.parametrize("batch", [1, 16, 256])
def test_projected_block_head_is_one_pass_and_serial_head_one_step_per_token(batch):
    ms, _ = projected_draft_ms(learned_heads_profile())
    assert ms[("dflash", batch, 7)] == pytest.approx(ms[("dflash", batch, 1)], rel=0.02)  # flat in D
    assert ms[("eagle3", batch, 7)] == pytest.approx(7 * ms[("eagle3", batch, 1)], rel=1e-9)  # D steps
    assert ms[("eagle3", batch, 7)] > 5 * ms[("eagle3", batch, 1)]


def test_projected_learned_head_pays_for_its_draft_vocabulary_not_the_targets():
    small, notes = projected_draft_ms(learned_heads_profile(draft_vocab=8192))
    full, _ = projected_draft_ms(learned_heads_profile(draft_vocab=TARGET_VOCAB))
    unrecorded, old_notes = projected_draft_ms(learned_heads_profile(draft_vocab=None))
    for mechanism in ("eagle3", "dflash"):
        for batch in (1, 64):
            assert small[(mechanism, batch, 3)] < full[(mechanism, batch, 3)]
            assert unrecorded[(mechanism, batch, 3)] == pytest.approx(
                full[(mechanism, batch, 3)]
            )  # the fallback: target vocabulary
    assert not any("draft vocabulary" in n for n in notes)
    fallback = [n for n in old_notes if "draft vocabulary" in n]
    assert (
        len(fallback) == 1
        and "dflash" in fallback[0]
        and "eagle3" in fallback[0]
        and "target's vocabulary" in fallback[0]
    )
    # the draft model (the target's own first layers) keeps the target's head
    assert small[("draft_model", 1, 3)] == pytest.approx(full[("draft_model", 1, 3)])


def test_profile_records_each_heads_draft_vocabulary():
    from specdec_tune.profiles.drafters.dflash import DFlashDrafter, new_dflash_head
    from specdec_tune.profiles.drafters.eagle3 import Eagle3Drafter, new_eagle3_head
    from specdec_tune.profiles.drafters.mtp import MtpDrafter, new_mtp_head

    target = tiny_target(vocab=1024)
    drafters = {
        "eagle3": Eagle3Drafter.from_head(new_eagle3_head(target.model, draft_vocab=list(range(0, 1024, 4)), seed=1)),
        "dflash": DFlashDrafter.from_head(
            new_dflash_head(target.model, draft_vocab=list(range(0, 1024, 2)), block_size=4, seed=1)
        ),
        "mtp": MtpDrafter.from_head(new_mtp_head(target.model, seed=1)),
    }
    infos = {i["name"]: i for i in tiny_profiler(target, drafters)._drafter_infos()}
    assert {name: i["model"]["draft_vocab_size"] for name, i in infos.items()} == {
        "eagle3": 256,
        "dflash": 512,
        "mtp": 1024,
    }


# ---------------------------------------------------------------------------- README figures against the results


def _max_examples(path: Path, only: str | None = None) -> list[int]:
    """hypothesis max_examples of each test in `path` (or of the test named `only`)."""
    counts = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and (only is None or node.name == only):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and getattr(deco.func, "id", "") == "settings":
                    counts += [k.value.value for k in deco.keywords if k.arg == "max_examples"]
    return counts


def test_readme_property_case_count_is_the_tests_own():
    row = next(line for line in README.splitlines() if line.startswith("| property-based inputs (hypothesis) |"))
    _, _, cases, what, _ = row.split("|")
    parts = [int(n) for n in re.findall(r"\((\d+)\b", what)]
    counted = _max_examples(TESTS / "test_properties.py") + _max_examples(
        TESTS / "test_export.py", "test_engine_schedules_give_the_same_draft_length_at_every_batch_size"
    )
    assert sorted(parts) == sorted(counted)
    assert int(cases.strip().replace(",", "")) == sum(counted) == sum(parts)


# ---------------------------------------------------------------------------- the demo marker

#: What in a test's body runs the real demo target: the loader without a path, or the demo target by name.
DEMO_LOADER = (r"load_model\(\s*\)", r"load_model\(\s*dtype\s*=", r"smollm2", r"default_target_path\(\)")


def _marked_demo(decorators: list[ast.expr], source: str) -> bool:
    return any("mark.demo" in (ast.get_source_segment(source, d) or "") for d in decorators)


def test_every_test_that_runs_the_demo_target_is_marked_demo():
    checked, unmarked = 0, []
    for path in sorted(TESTS.glob("test_*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        module_marks = " ".join(
            ast.get_source_segment(source, n) or ""
            for n in tree.body
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
        )
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            checked += 1
            body = "\n".join(ast.get_source_segment(source, n) or "" for n in node.body)
            runs_demo = any(re.search(p, body, re.IGNORECASE) for p in DEMO_LOADER)
            if runs_demo and "demo" not in module_marks and not _marked_demo(node.decorator_list, source):
                unmarked.append(f"{path.name}::{node.name}")
    assert checked > 100 and not unmarked, unmarked
