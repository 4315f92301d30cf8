"""A per-batch schedule priced as vLLM runs it, against the best static K.

A per-batch table is not free in vLLM 0.32; two costs come with it that a static K does not pay:

graph mode   with `num_speculative_tokens_per_batch_size` set, the V1 model runner overrides a cudagraph mode with
             full graphs (the default FULL_AND_PIECEWISE) to PIECEWISE (vllm/config/vllm.py,
             `_maybe_override_dynamic_sd_cudagraph_mode`): attention then runs eagerly between the captured pieces,
             in every layer of every target forward. Priced per round as

                 graph_ms = layers x EAGER_ATTENTION_US_PER_LAYER / 1000

             on a GPU of the hardware table (modeled: a CUDA launch costs about 5 us of host time, and an eager
             attention layer launches its KV-cache write and its attention kernel through a custom op, about three
             launches' worth; at 30 layers that is 0.45 ms, 15-20% of a small model's decode step, the size of the
             ~14% single-stream loss vLLM users report from the override). None on a CPU: vLLM runs no CUDA graphs
             there, and a table costs what a static K does.
K = 0 band   vLLM's model drafters (SpecDecodeBaseProposer.propose, vllm/v1/spec_decode/llm_base_proposer.py: EAGLE-3,
             MTP, DFlash, DSpark, a draft model) run their first forward before they return an empty draft, so a band
             at K = 0 of a speculative engine pays one drafter step per round. Priced as the drafter's time at D = 1
             at that batch: measured where the profile timed the drafter apart (this tool's loop), else a D = 1 round
             less a plain one (the engine's rounds: modeled, an upper bound: it holds the second verified token).

Each bucket's tokens/s as run is its stated prediction (the cost model's, or a refined bucket's fitted figure) with
those costs added to its round:

    tokens/s as run = tokens/s x round_ms / (round_ms + graph_ms + k0_ms)

and the schedule is kept only where its mean speedup as run beats the best static K's (which runs with full graphs and
no K = 0 band); otherwise the vLLM config carries the static K and says why. Data parallel > 1 is the export's (vLLM
drops the table there: exporters/vllm_config.py).
"""

from __future__ import annotations

import dataclasses

from specdec_tune.autotune.cost_model import CostModel, Figure, weakest
from specdec_tune.autotune.hardware import find_device_spec
from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.vllm_spelling import VLLM

EAGER_ATTENTION_US_PER_LAYER = 15.0  # host time per layer of a forward that PIECEWISE graphs leave eager (above)


def graph_mode(plan: Plan) -> tuple[float, str]:
    """Per-round cost of the graph mode a table forces, and what it rests on."""
    name = plan.device.name or ""
    spec = find_device_spec(name)
    if spec is None:
        return 0.0, f"none on {name or 'this device'}: vLLM runs no CUDA graphs on a CPU, a table runs as a static K"
    if plan.mechanism in VLLM and VLLM[plan.mechanism].v2_runner:
        return (
            0.0,
            f"none: vLLM runs {plan.mechanism} on its V2 model runner, which keeps full CUDA graphs with a table",
        )
    layers = plan.profile.target.num_layers
    ms = layers * EAGER_ATTENTION_US_PER_LAYER / 1000
    return ms, (
        f"vLLM 0.32 runs a per-batch table with PIECEWISE CUDA graphs instead of FULL_AND_PIECEWISE on {spec.name}: "
        f"{layers} layers x {EAGER_ATTENTION_US_PER_LAYER:g} us of eager attention = {ms:.2f} ms per round (modeled)"
    )


def _k0_drafter_ms(cost: CostModel, plan: Plan, batch: int) -> Figure:
    m, q = plan.mechanism, plan.quant
    if not cost.engine_rounds:
        return cost.draft_ms(m, q, batch, 1)
    one, plain = cost.predict(batch, 1, m, q).round_ms, cost.predict(batch, 0, m, q).round_ms
    return Figure(max(0.0, one.value - plain.value), "modeled")


def _as_run(f: Figure, round_ms: float, extra_ms: float, source: str) -> Figure:
    scale = round_ms / (round_ms + extra_ms) if extra_ms else 1.0
    return Figure(
        f.value * scale,
        weakest(f.source, source) if extra_ms else f.source,
        None if f.low is None else f.low * scale,
        None if f.high is None else f.high * scale,
    )


def priced(plan: Plan, cost: CostModel) -> Plan:
    """The plan with each bucket's vLLM costs of its schedule (`engine_costs`) and the schedule against the best static
    K (`schedule_pricing`); a plan that never speculates or runs one K everywhere needs no table and is returned as
    it is."""
    draft_lens = {b.draft_len for b in plan.buckets}
    fields = {k: v for k, v in plan.model_dump(exclude_unset=True).items() if k != "schedule_pricing"}
    buckets = [{k: v for k, v in b.model_dump(exclude_unset=True).items() if k != "engine_costs"} for b in plan.buckets]
    if plan.max_draft_len == 0 or len(draft_lens) == 1:
        return Plan.model_validate(fields | {"buckets": buckets})
    graph_ms, graph_text = graph_mode(plan)
    forward_at_k0 = VLLM[plan.mechanism].forward_at_k0 if plan.mechanism in VLLM else False
    as_run = []
    for b, row in zip(plan.buckets, buckets):
        p = cost.predict(b.batch, b.draft_len, plan.mechanism, plan.quant)
        k0 = _k0_drafter_ms(cost, plan, b.batch) if forward_at_k0 and b.draft_len == 0 else None
        extra = graph_ms + (k0.value if k0 else 0.0)
        source = weakest("modeled" if graph_ms else "measured", k0.source if k0 else "measured")
        stated = Figure(**b.predicted.speedup.model_dump())  # the model's, or a refined bucket's fitted figure
        speedup = _as_run(stated, p.round_ms.value, extra, source)
        as_run.append(speedup.value)
        costs = {
            "graph_mode_ms": round(graph_ms, 4),
            "k0_drafter_ms": None if k0 is None else dataclasses.asdict(k0),
            "speedup_as_run": dataclasses.asdict(speedup),
        }
        row["engine_costs"] = costs
    schedule_mean = sum(as_run) / len(as_run)
    static = plan.single_draft_len
    keep = schedule_mean > static.mean_speedup
    k0_text = (
        f"its K = 0 buckets pay a {plan.mechanism} drafter forward each round"
        if forward_at_k0 and 0 in draft_lens
        else "no K = 0 bucket pays a drafter forward"
    )
    why = (
        f"per-batch schedule in vLLM: mean speedup {schedule_mean:.3f}x as run ({graph_text}; {k0_text}) against "
        f"{static.mean_speedup:.3f}x for the best static K = {static.draft_len}"
    )
    pricing = {
        "engine": "vllm",
        "graph_mode": graph_text,
        "graph_mode_ms": round(graph_ms, 4),
        "schedule_mean_speedup_as_run": schedule_mean,
        "static_draft_len": static.draft_len,
        "static_mean_speedup": static.mean_speedup,
        "choice": "schedule" if keep else "static",
        "why": why,
    }
    return Plan.model_validate(fields | {"buckets": buckets, "schedule_pricing": pricing})
