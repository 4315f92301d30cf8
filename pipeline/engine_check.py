"""A plan profiled in vLLM, checked in vLLM: the bundle's own `vllm/speculative_config.json`, the file as written,
in one engine with the whole schedule active.

The engine starts with `max_num_seqs` the plan's largest batch (as `vllm/serve.sh` starts it), so vLLM's own per-batch
lookup picks the draft length at every step. Each bucket runs at its concurrency B on held-back prompts that fit the
plan's context whole where enough do, else cut to it (`decoded_prompts`), each request decoding 48 tokens with EOS
ignored and a finished request replaced by the next prompt. Its steady steps, B requests decoding and none prefilling,
give:

    D applied      the draft tokens per drafting request in a step (vLLM's counters), largest over the steady steps:
                   it must equal the plan's D (none drafted where D = 0), else the bucket fails
    tokens/round   (requests + accepted draft tokens) / requests, over the steady steps
    tokens/s       raw: 1e3 · tokens / Σ step ms;  as the cost model: 1e3 · B · tokens/round / median step ms, with the
                   interval of the median step, which holds the profile's between-engine term (one engine is one draw
                   of it: vllm_profile, "Engines")
    error          predicted / measured (as the cost model) − 1; inside the noise where the prediction's 95% interval
                   and the measurement's overlap

The KV cache vLLM allocated (blocks x block size) is compared with the memory model's prediction for the plan
(`kv_capacity`), to within 10%; a miss is reported beside the buckets, not refused.

A bucket fails when vLLM ran another D than the plan's: the bundle would not run the plan, and export refuses it. Its
throughput is reported beside its prediction and flagged where the error is beyond the tolerance and outside the noise,
without refusing: on a shared machine the engine's step drifts by 20% within minutes, so such a flag says "re-profile on
a quiet machine", not "the plan is wrong". Beside the raw error, where the profile has a speed probe: the device's speed
ratio (the probe timed in the engine around and within the bucket's run against the profile's reference speed:
vllm_engine.speed_ratio) and the error against the measurement scaled by it, what the bucket would measure at the
speed the profile's rounds were brought to.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from specdec_tune import SpecdecError
from specdec_tune.autotune.plan import cost_model_of
from specdec_tune.autotune.plan_schema import Bucket, Plan
from specdec_tune.exporters.validation_text import describe_row
from specdec_tune.pipeline.throughput_check import margin_pct, verdict
from specdec_tune.profiles.fingerprint import resolve_device
from specdec_tune.profiles.models.folders import model_folder
from specdec_tune.profiles.models.loading import describe_model
from specdec_tune.profiles.models.views import engine_model_view
from specdec_tune.profiles.prompts import cut_to_context, prompts_by_domain
from specdec_tune.profiles.schema import Profile
from specdec_tune.profiles.timing import Timing
from specdec_tune.profiles.vllm_engine import VllmEngine, probe_median_ms, speed_ratio
from specdec_tune.profiles.vllm_records import steady_steps, with_engines
from specdec_tune.settings import MeasureSettings

KV_CAPACITY_TOLERANCE_PCT = 10.0
BUCKET_TOKENS = 48  # per request: tens of steady rounds per bucket even where drafts are accepted
TIMEOUT_S = 1800.0


def held_back_prompts(
    profile: Profile, ctx: int, new_tokens: int, max_draft: int, whole: bool = False
) -> list[tuple[list[int], str]]:
    """The held-back prompts cut to (or, `whole`, fitting) the context, with the target's tokenizer alone (no weights
    loaded)."""
    return split_prompts(profile, ctx, new_tokens, max_draft, "held_back", "default", whole)


def split_prompts(
    profile: Profile, ctx: int, new_tokens: int, max_draft: int, split: str, spec: str, whole: bool
) -> list[tuple[list[int], str]]:
    """One split of a calibration set (`spec`, as `--prompts` takes it), as `held_back_prompts` gives its own."""
    _, tokenizer, config = describe_model(
        profile.target["path"], profile.target.get("dtype", "auto"), resolve_device("cpu")
    )
    prompts = prompts_by_domain(
        tokenizer, int(config.get("max_position_embeddings") or 2048), 1000, new_tokens, max_draft, split, spec
    )
    return cut_to_context(prompts, ctx, new_tokens, whole)


def decoded_prompts(
    profile, ctx: int, max_draft: int, needed: int, split: str = "held_back", spec: str = "default"
) -> tuple[list[tuple[list[int], str]], str]:
    """The held-back prompts (ids, domain) the engine check and the engine bench decode (or another split's), and which
    way: whole, those that fit the context as they are, where at least `needed` do (the text a lookup drafter copies
    from kept, as in the profile's acceptance runs); else each long enough cut to the context
    (`prompts.cut_to_context`)."""
    whole = split_prompts(profile, ctx, BUCKET_TOKENS, max_draft, split, spec, whole=True)
    if len(whole) >= needed:
        return whole, "whole"
    return split_prompts(profile, ctx, BUCKET_TOKENS, max_draft, split, spec, whole=False), "cut"


def run_buckets(
    engine,
    profile,
    batches: list[int],
    pool: list[list[int]],
    rows: int,
    max_num_seqs: int,
    *,
    config: dict | None = None,
    config_file: Path | None = None,
    cwd: Path | None = None,
) -> dict:
    """One engine (the config given, or read from `config_file` as written; neither: no speculation) running each batch
    size at its concurrency over `pool`, `BUCKET_TOKENS` per request: the runner's raw result."""
    runs = [{"name": "warmup", "prompts": pool[:1], "concurrency": 1, "max_tokens": 4, "ignore_eos": True}]
    runs += [
        {
            "name": f"bucket/{B}",
            "prompts": [pool[i % len(pool)] for i in range(B * max(2, -(-rows // B)))],
            "concurrency": B,
            "max_tokens": BUCKET_TOKENS,
            "ignore_eos": True,
        }
        for B in batches
    ]
    with tempfile.TemporaryDirectory(prefix="specdec-engine-") as tmp:
        view = engine_model_view(model_folder(profile.target["path"])[1], Path(tmp) / "target")
        job = {
            "model_dir": str(view),
            "max_num_seqs": max_num_seqs,
            "runs": runs,
            "speculative_config": config,
            "probe": (profile.engine.get("speed_probe") or {}).get("spec"),  # timed around and within each run
            "engine": {
                "dtype": profile.target.get("dtype", "auto"),
                "max_model_len": profile.engine.get("max_model_len"),
                **profile.engine.get("options", {}),
            },
        }
        if config_file is not None:
            job["speculative_config_file"] = str(config_file.resolve())
        return engine.run(job, TIMEOUT_S, cwd=cwd)


def steady_figures(runs: list[dict | None], batch: int, between: dict | None = None) -> dict:
    """A bucket's figures from its steady steps (module docstring), pooled over `runs` (one per engine that ran the
    bucket), the median step's interval holding the profile's between-engine term (`between`: engine.between_engines,
    vllm_records.with_engines); `error` where it has none to time."""
    failed: dict | None | Literal[False] = next((run for run in runs if run is None or run.get("error")), False)
    if failed is not False:
        return {"error": (failed or {}).get("error") or "the engine stopped before this bucket"}
    # past the check above no run is None: the filter only tells the type checker
    steady = [step for run in runs if run is not None for step in steady_steps(run, batch)]
    if len(steady) < 3:
        return {"error": f"{len(steady)} steady steps with {batch} requests decoding: too few to time"}
    drafting = [st["num_draft_tokens"] / st["num_drafts"] for st in steady if st["num_drafts"]]
    requests = batch * len(steady)
    tokens = requests + sum(st["num_accepted_tokens"] for st in steady)
    step = with_engines(Timing.of([st["ms"] for st in steady]), between or {}, len(runs))
    per_round = tokens / requests
    return {
        "draft_len_applied": round(max(drafting)) if drafting else 0,
        "drafting_steps": len(drafting),
        "steady_steps": len(steady),
        "tokens_per_round": per_round,
        "step_ms": step.median_ms,
        "step_ms_interval": [step.ci_low_ms, step.ci_high_ms],
        "measured_raw_tokens_per_s": 1e3 * tokens / sum(st["ms"] for st in steady),
        "measured_tokens_per_s": 1e3 * batch * per_round / step.median_ms,
        "measured_interval_tokens_per_s": [
            1e3 * batch * per_round / step.ci_high_ms,
            1e3 * batch * per_round / step.ci_low_ms,
        ],
    }


def engine_throughput(plan: Plan, profile: Profile, bundle: Path, s: MeasureSettings, engine=None) -> dict:
    """The check of the module docstring; `bundle` is the bundle's folder (staged or shipped)."""
    try:
        engine = engine or VllmEngine.locate()
    except SpecdecError as e:
        return {"checked": False, "engine": "vllm", "why": str(e)}
    config_file = bundle / "vllm" / "speculative_config.json"
    held, prompts = decoded_prompts(profile, plan.ctx, plan.max_draft_len, max(s.rows, plan.max_batch))
    pool = [ids for ids, _ in held]
    if not pool:
        return {
            "checked": False,
            "engine": "vllm",
            "why": f"no held-back prompt reaches the plan's context of {plan.ctx} tokens",
        }
    raw = run_buckets(
        engine,
        profile,
        [b.batch for b in plan.buckets],
        pool,
        s.rows,
        plan.max_batch,
        config_file=config_file if config_file.is_file() else None,
        cwd=bundle,
    )
    if not raw.get("ok"):
        return {
            "checked": True,
            "engine": "vllm",
            "passed": False,
            "tolerance_pct": s.tolerance_pct,
            "buckets": [],
            "error": f"vLLM did not start on the bundle's config: {raw.get('error')}",
        }
    by_name = {r.get("name"): r for r in raw["runs"]}
    speed = profile.engine.get("speed_probe")
    between = profile.engine.get("between_engines")
    rows = [
        bucket_row(
            b,
            steady_figures([run := by_name.get(f"bucket/{b.batch}")], b.batch, between),
            s.tolerance_pct,
            speed_ratio(probe_median_ms([run]), speed),
        )
        for b in plan.buckets
    ]
    timed = [r for r in rows if "error_pct" in r]
    return {
        "checked": True,
        "engine": "vllm",
        "vllm_version": raw.get("vllm_version"),
        "config_file": "vllm/speculative_config.json",
        "kv_capacity": kv_capacity(plan, profile, raw.get("kv_cache")),
        "max_num_seqs": plan.max_batch,
        "tolerance_pct": s.tolerance_pct,
        "tokens_per_request": BUCKET_TOKENS,
        "prompts": prompts,
        "buckets": rows,
        "passed": all(r["passed"] for r in rows),
        "throughput_within": all(r.get("throughput_within", False) for r in rows),
        "inconclusive_batches": [r["batch"] for r in timed if r["verdict"] == "inconclusive"],
        "worst": max(
            ({"batch": r["batch"], "error_pct": r["error_pct"]} for r in timed),
            key=lambda w: abs(w["error_pct"]),
            default=None,
        ),
        "rule": (
            "a bucket passes when vLLM ran the plan's D (and was timed); its throughput's verdict (passed, inside the "
            "noise, inconclusive, failed: pipeline/throughput_check.py, 'Verdicts', within "
            f"{s.tolerance_pct:g}%) is reported, not refused"
        ),
    }


def kv_capacity(plan: Plan, profile: Profile, reported: dict | None) -> dict | None:
    """The KV cache vLLM allocated for the bundle's config (its blocks x block size, in tokens) against the memory
    model's prediction for the plan (autotune/memory.py: the engine's pool, or the budget less weights and activations,
    over the KV bytes per token of the target and the drafter's own layers); agreed within KV_CAPACITY_TOLERANCE_PCT."""
    memory = cost_model_of(profile, plan).memory
    if memory is None or not reported or not reported.get("num_blocks"):
        return None
    engine_tokens = int(reported["num_blocks"]) * int(reported["block_size"])
    predicted = memory.kv_capacity_tokens(plan.mechanism, plan.quant, plan.max_batch, plan.max_draft_len)
    error_pct = 100 * (predicted / engine_tokens - 1)
    return {
        "engine_tokens": engine_tokens,
        "num_blocks": reported["num_blocks"],
        "block_size": reported["block_size"],
        "predicted_tokens": predicted,
        "kv_bytes_per_token": memory.kv_bytes_per_token(plan.mechanism if plan.max_draft_len else "none"),
        "pool_bytes": memory.kv_pool_bytes,
        "error_pct": error_pct,
        "within": abs(error_pct) <= KV_CAPACITY_TOLERANCE_PCT,
        "tolerance_pct": KV_CAPACITY_TOLERANCE_PCT,
    }


def bucket_row(bucket: Bucket, measured: dict, tolerance_pct: float, ratio: float | None = None) -> dict:
    B, D = bucket.batch, bucket.draft_len
    row = {"batch": B, "draft_len": D}
    if "error" in measured:
        return row | {"passed": False, "error": measured["error"]}
    figure = bucket.predicted.tokens_per_s
    p_low, p_high = figure.low or figure.value, figure.high or figure.value
    low, high = measured["measured_interval_tokens_per_s"]
    error_pct = 100 * (figure.value / measured["measured_tokens_per_s"] - 1)
    margin = margin_pct(bucket, tolerance_pct)
    said = verdict(figure.value, (p_low, p_high), (low, high), error_pct, tolerance_pct, margin)
    d_ok = measured["draft_len_applied"] == D and (D > 0 or not measured["drafting_steps"])
    return (
        row
        | measured
        | {
            "draft_len_ok": d_ok,
            "predicted_tokens_per_forward": bucket.predicted.tokens_per_forward.value,
            "predicted_tokens_per_s": figure.value,
            "predicted_source": figure.source,
            "predicted_interval_tokens_per_s": [p_low, p_high],
            "error_pct": error_pct,
            "margin_pct": margin,
            "verdict": said,
            "inside_noise": said == "inside the noise",
            "throughput_within": said in ("passed", "inside the noise"),
            "passed": d_ok,
            "device_speed_ratio": ratio,
            "scaled_error_pct": None
            if ratio is None
            else 100 * (figure.value / (measured["measured_tokens_per_s"] * ratio) - 1),
        }
    )


def engine_refusal(tp: dict) -> SpecdecError:
    if tp.get("error"):
        return SpecdecError(
            f"vLLM check of the bundle failed: {tp['error']}",
            "check the bundle's vllm/speculative_config.json runs in this vLLM",
        )
    bad = "; ".join(describe_row(r) for r in tp["buckets"] if not r["passed"])
    return SpecdecError(
        f"vLLM does not run the plan's schedule from the bundle's config: {bad}",
        "report this with the plan.json: the vLLM config and vLLM's per-batch lookup disagree",
    )
