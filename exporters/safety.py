"""Schedule safety: what users of per-batch draft lengths run into, checked on the plan before the bundle ships.

thresholds  vLLM keys K on the scheduled request count (prefills included) and TensorRT-LLM on the batch it runs,
            so near a threshold the count crosses it back and forth from step to step. Where the two draft lengths
            on either side predict throughputs within each other's 95% intervals at the buckets beside the
            threshold, the figures cannot tell them apart: the switch buys nothing measurable and is flagged.
top band    where the largest buckets run K = 0, a speculative deployment still pays there. vLLM reserves
            lookahead KV slots for num_speculative_tokens per request whatever the batch's K (vllm/config/vllm.py
            `num_lookahead_tokens` at 0.32: K for EAGLE-family and draft models, K + 1 for DFlash, none for
            n-gram and suffix), and the drafter's weights stay resident. Said in bytes at the band's largest
            batch (computed from the configs: modeled), beside the plan's predicted tokens/s there, which a plain
            server matches (the cost model charges no drafter work at K = 0).
"""

from __future__ import annotations

from pathlib import Path

from specdec_tune.autotune.cost_model import Figure
from specdec_tune.exporters.engines import ExportContext
from specdec_tune.exporters.schedule import bands

MIB = 1 << 20


def _overlap(a: dict, b: dict) -> bool:
    """Whether two figures (plan.json's form) overlap, a figure without an interval being its value alone."""
    (lo_a, hi_a), (lo_b, hi_b) = Figure(**a).bounds(), Figure(**b).bounds()
    return lo_a <= hi_b and lo_b <= hi_a


def noisy_thresholds(ctx: ExportContext) -> list[dict]:
    """Thresholds between bands whose draft lengths the predictions cannot tell apart at the buckets beside them."""
    if ctx.predict is None:
        return []
    buckets = [b for b, _ in ctx.schedule]
    out = []
    for (_, hi, k_below), (_, _, k_above) in zip(bands(ctx.schedule), bands(ctx.schedule)[1:]):
        beside = [hi, buckets[buckets.index(hi) + 1]]
        figures = {b: {k: ctx.predict(b, k) for k in (k_below, k_above)} for b in beside}
        if all(_overlap(figures[b][k_below], figures[b][k_above]) for b in beside):
            out.append(
                {
                    "threshold": hi,
                    "draft_lens": [k_below, k_above],
                    "tokens_per_s": {str(b): {str(k): f for k, f in fs.items()} for b, fs in figures.items()},
                    "text": f"K {k_below} -> {k_above} above batch {hi}: at batches {beside[0]} and {beside[1]} the "
                    "two predict tokens/s within each other's 95% intervals, so the switch is inside the noise; "
                    "the engine keys K "
                    f"on the live request count (vLLM counts prefills), which crosses {hi} back and forth",
                }
            )
    return out


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """Key and value bytes one token holds in every layer of a model with this Hugging Face config."""
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def top_band_cost(ctx: ExportContext, dtype_bytes: int, bundle: Path | None = None) -> dict | None:
    """What the top K = 0 band still costs in a speculative deployment, and that a plain server predicts the same there
    (a drafter folder named relative to the bundle is looked up in `bundle`)."""
    top_lo, top_hi, top_k = bands(ctx.schedule)[-1]
    if top_k != 0 or not ctx.speculates:
        return None
    slots = ctx.spelling.vllm.lookahead(ctx.max_draft_len, ctx.head)
    lookahead_bytes = slots * kv_bytes_per_token(ctx.target_config, dtype_bytes) * top_hi
    model = ctx.checkpoint_for("vllm")
    folder = Path(model) if model else None
    if folder is not None and not folder.is_absolute() and bundle is not None:
        folder = bundle / folder
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder and folder.is_dir() else None
    throughput = {str(b): ctx.predict(b, 0) for b, d in ctx.schedule if b >= top_lo} if ctx.predict else {}
    if not lookahead_bytes and not weights:
        text = (
            f"batches {top_lo}-{top_hi} run K = 0; the {ctx.mechanism} drafter reserves no lookahead KV and holds no "
            "weights, so a speculative server costs there what a plain one does"
        )
    else:
        text = (
            f"batches {top_lo}-{top_hi} run K = 0, yet a speculative vLLM server reserves {slots} lookahead KV "
            f"slot(s) per request there ({lookahead_bytes / MIB:.1f} MiB at batch {top_hi}, modeled from the target's "
            "config)"
            + (f" and keeps the drafter's {weights / MIB:.1f} MiB of weights resident" if weights else "")
            + ": a plain server predicts the same tokens/s there with that memory free for more requests; where "
            "traffic can be routed by load, serve that band without speculation"
        )
    return {
        "band": [top_lo, top_hi],
        "lookahead_slots_per_request": slots,
        "lookahead_kv_bytes": lookahead_bytes,
        "source": "modeled",
        "drafter_weight_bytes": weights,
        "plain_tokens_per_s": throughput,
        "text": text,
    }


def engine_costs(ctx: ExportContext) -> dict:
    """What each bucket pays in vLLM for the per-batch table: the graph mode it forces and a K = 0 band's drafter
    forward (autotune/engine_pricing.py), and which the vLLM config carries, the table or the static K."""
    pricing = ctx.schedule_pricing
    if not ctx.speculates or pricing is None:
        text = (
            "one K for every batch: no per-batch table, so no graph-mode cost and no K = 0 band"
            if ctx.speculates
            else "no speculation: no per-batch table"
        )
        return {"buckets": {}, "text": text}
    parts = []
    for batch, costs in sorted(pricing["buckets"].items()):
        k0 = costs["k0_drafter_ms"]
        parts.append(
            f"B={batch}: graph mode +{costs['graph_mode_ms']:.2f} ms"
            + (f", K = 0 drafter forward +{k0['value']:.2f} ms ({k0['source']})" if k0 else "")
            + f", {costs['speedup_as_run']['value']:.3f}x as run"
        )
    carried = "the table" if pricing["choice"] == "schedule" else f"static K = {pricing['static_draft_len']}"
    if ctx.data_parallel > 1:
        carried = f"static K (data parallel {ctx.data_parallel})"
    return {
        "buckets": pricing["buckets"],
        "choice": pricing["choice"],
        "text": f"{pricing['why']}; per bucket {'; '.join(parts)}; the vLLM config carries {carried}",
    }


def safety_lines(safety: dict) -> list[str]:
    """What the schedule-safety record flags, one line each (the bundle's README and manifest)."""
    return (
        [t["text"] for t in safety["noisy_thresholds"]]
        + ([safety["top_band"]["text"]] if safety["top_band"] else [])
        + [safety["engine_costs"]["text"]]
    )
