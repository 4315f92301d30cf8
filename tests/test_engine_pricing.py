"""A per-batch schedule priced as vLLM runs it: the graph mode a table forces on a GPU, a K = 0 band's drafter forward,
the static K where the table does not pay, and data parallel > 1 (vLLM drops the table)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.autotune.engine_pricing import EAGER_ATTENTION_US_PER_LAYER, graph_mode, priced
from specdec_tune.autotune.plan import cost_model_of
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.exporters.bundle import export_context
from specdec_tune.exporters.engines import serving_engines
from specdec_tune.exporters.safety import engine_costs
from specdec_tune.exporters.versions import DEFAULT_VERSIONS
from specdec_tune.profiles.schema import load_profile
from specdec_tune.settings import ExportSettings

PROFILE_PATH = Path(__file__).parent / "data" / "demo_profile.json"


@pytest.fixture(scope="module")
def profile():
    return load_profile(PROFILE_PATH)


def _plan(profile, tmp_path, device=None, mechanism="ngram"):
    settings = SearchSettings(seed=0, trials=60, out_dir=tmp_path, device=device, mechanisms=(mechanism,))
    return search(profile, "h", settings)


def test_on_a_cpu_the_table_costs_no_graph_mode_and_a_lookup_drafter_no_k0_forward(profile, tmp_path):
    plan = _plan(profile, tmp_path)
    assert len({b.draft_len for b in plan.buckets}) > 1 and plan.schedule_pricing is not None
    for b in plan.buckets:
        assert b.engine_costs.graph_mode_ms == 0 and b.engine_costs.k0_drafter_ms is None
        assert b.engine_costs.speedup_as_run.value == pytest.approx(b.predicted.speedup.value)
    assert plan.schedule_pricing.choice == "schedule" and "no CUDA graphs on a CPU" in plan.schedule_pricing.why


def test_on_a_gpu_the_table_pays_piecewise_graphs_and_loses_to_a_static_k_it_does_not_beat(profile, tmp_path):
    plan = _plan(profile, tmp_path, device="h100")
    graph_ms = plan.profile.target.num_layers * EAGER_ATTENTION_US_PER_LAYER / 1000
    assert all(b.engine_costs.graph_mode_ms == pytest.approx(graph_ms) for b in plan.buckets)
    assert all(b.engine_costs.speedup_as_run.value < b.predicted.speedup.value for b in plan.buckets)
    assert all(b.engine_costs.speedup_as_run.source == "modeled" for b in plan.buckets)
    pricing = plan.schedule_pricing
    assert pricing.schedule_mean_speedup_as_run < pricing.static_mean_speedup and pricing.choice == "static"
    ctx = export_context(plan, profile, ExportSettings(), dict(DEFAULT_VERSIONS), None)
    vllm = serving_engines()["vllm"].render(ctx)
    assert "num_speculative_tokens_per_batch_size" not in (vllm.document or {})
    assert "PIECEWISE" in vllm.deviation["why"]
    line = engine_costs(ctx)["text"]
    assert all(f"B={b.batch}: graph mode +{graph_ms:.2f} ms" in line for b in plan.buckets)
    # where the table's gain beats the graph mode's cost, the table is kept
    cost = cost_model_of(profile, plan)
    cheap = plan.single_draft_len.model_copy(update={"mean_speedup": 0.5})
    kept = priced(plan.model_copy(update={"single_draft_len": cheap}), cost)
    assert kept.schedule_pricing.choice == "schedule"


def test_a_k0_band_of_a_model_drafter_pays_its_first_forward(profile, tmp_path):
    """vLLM's model drafters run a forward at K = 0 before returning an empty draft: a K = 0 bucket of a draft-model
    schedule is priced with the drafter's one-step time (the loop's measured draft time at D = 1)."""
    cost = CostModel(profile)
    plan = _plan(profile, tmp_path)
    buckets = [
        b.model_copy(update={"draft_len": d}) for b, d in zip(plan.buckets, [2, 1] + [0] * (len(plan.buckets) - 2))
    ]
    out = priced(plan.model_copy(update={"mechanism": "draft_model", "buckets": buckets, "max_draft_len": 2}), cost)
    for b in out.buckets:
        if b.draft_len:
            assert b.engine_costs.k0_drafter_ms is None
        else:
            want = cost.draft_ms("draft_model", "none", b.batch, 1)
            assert want.value > 0 and b.engine_costs.k0_drafter_ms.value == pytest.approx(want.value)
            assert b.engine_costs.speedup_as_run.value < b.predicted.speedup.value
    assert "K = 0 buckets pay a draft_model drafter forward" in out.schedule_pricing.why
    assert priced(plan, cost).schedule_pricing.why.count("no K = 0 bucket pays") == 1  # n-gram: a lookup, no forward


def test_data_parallel_above_one_exports_the_static_k_and_says_why(profile, tmp_path):
    plan = _plan(profile, tmp_path)
    ctx = export_context(plan, profile, ExportSettings(data_parallel=2), dict(DEFAULT_VERSIONS), None)
    vllm = serving_engines()["vllm"].render(ctx)
    assert "num_speculative_tokens_per_batch_size" not in vllm.document
    assert vllm.document["num_speculative_tokens"] == plan.single_draft_len.draft_len
    assert "data parallel 2 > 1" in vllm.deviation["why"]
    table = serving_engines()["vllm"].render(dataclasses.replace(ctx, data_parallel=1))
    assert "num_speculative_tokens_per_batch_size" in table.document


def test_dspark_runs_on_vllms_v2_runner_which_keeps_full_graphs_with_a_table(profile, tmp_path):
    plan = _plan(profile, tmp_path, device="h100")
    assert graph_mode(plan)[0] > 0
    ms, text = graph_mode(plan.model_copy(update={"mechanism": "dspark"}))
    assert ms == 0 and "V2 model runner" in text
