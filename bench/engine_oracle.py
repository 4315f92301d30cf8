"""`decision_quality.py --engine vllm`: the oracle run in vLLM itself, for a profile measured there
(`profile --engine vllm`).

Every point is a vLLM engine at one configuration: no speculation, every single K of every mechanism vLLM ran when
profiled (D = 1 .. its limit), and the plan's own schedule as one engine with vLLM's per-batch table. Each engine runs
every batch bucket at its concurrency on the same held-back prompts (the engine check's runs: pipeline/engine_check.py,
48 tokens per request, EOS ignored, a finished request replaced by the next) and a bucket's figure is its steady steps'
(B requests decoding): tokens/s = 1e3 · B · tokens per round / median step ms. Each configuration's engine runs
`--repeats` times, the configurations taking turns (odd passes in reverse order), and a bucket's steady steps are pooled
over its engines: a slow spell of the machine then lands on every configuration, not on the few that ran in it. The
decisions, the cost model's error and the targets are computed as for the torch backend (decision_quality.summarize),
the re-measure of each bucket's plan and oracle too (`confirm`: the plan's own engine against the oracle's, `--confirm`
engines each, taking turns). Speed: each engine times the profile's speed probe around and within every bucket run
(profiles/vllm_runner.py Probe); a point's `device_speed_ratio` is (the median of its runs' probe samples over the
profile's reference)^elasticity (vllm_engine.speed_ratio), and its `scaled` tokens/s the raw figure times that ratio:
what the point would measure at the profile's reference speed. Cost: the profile's engine seconds plus the search's
against the oracle sweep's engine seconds (each engine's start-up included on both sides).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.pipeline.engine_check import (
    BUCKET_TOKENS,
    decoded_prompts,
    held_back_prompts,
    run_buckets,
    steady_figures,
)
from specdec_tune.pipeline.refine_engine import cut_drafts, engine_config, table_config
from specdec_tune.profiles.schema import load_profile
from specdec_tune.profiles.vllm_engine import VllmEngine, probe_median_ms, speed_ratio
from specdec_tune.records import sha256_file, sha256_json, write_json
from specdec_tune.settings import RefineSettings

from common import (
    ENGINE_DEFAULT_K,
    TARGETS,
    confirmed,
    headline,
    point_key,
    point_record,
    refined_buckets,
    role_keys,
    searched_for,
    shown,
    summarize,
)

NO_SPEC = "none"
SCALING = (
    "each point's measured tokens/s x (probe ms in its engines / the profile's reference probe ms)^elasticity, the "
    "probe (profiles/vllm_runner.py Probe: the target's linear layers of one decode forward) timed in the engine's "
    "process around each of the point's runs and between their steps, the median of those samples, the reference and "
    "the elasticity the profile's (engine.speed_probe: its rounds are brought to that speed); a ratio above 1 means "
    "the device ran slower than the reference"
)
PLAN = ("plan", -1)


def interleaved(
    engine,
    profile,
    batches: list[int],
    pool,
    rows: int,
    configs: dict,
    passes: int,
    unit_s: dict,
    batches_of: dict | None = None,
) -> dict:
    """Every config's engine started `passes` times, the configs taking turns (odd passes in the reverse order, so
    that a drift in the machine's speed lands on every config alike): per config and batch, the bucket's run from each
    pass. A config runs the buckets `batches_of` gives it (default: all); its engine seconds are added to `unit_s`."""
    batches_of = {key: (batches_of or {}).get(key, batches) for key in configs}
    out: dict = {key: {B: [] for B in batches_of[key]} for key in configs}
    for p in range(passes):
        for key in list(configs) if p % 2 == 0 else list(configs)[::-1]:
            t0 = time.perf_counter()
            raw = run_buckets(engine, profile, batches_of[key], pool, rows, max(batches), config=configs[key])
            unit_s[f"{key[0]}/{key[1]}"] = unit_s.get(f"{key[0]}/{key[1]}", 0.0) + time.perf_counter() - t0
            if not raw.get("ok"):
                raise SpecdecError(
                    f"vLLM did not run {key[0]} at D={key[1]}: {raw.get('error')}",
                    "sweep the mechanisms the profile ran",
                )
            by_name = {r.get("name"): r for r in raw["runs"]}
            for B in batches_of[key]:
                out[key][B].append(by_name.get(f"bucket/{B}"))
    return out


def confirm(engine, profile, rows: list[dict], mech: str, pool, args, drafts: dict) -> tuple[dict, dict | None]:
    """The re-measure in vLLM, as common.HEADLINE: at each bucket the plan's D, no speculation (a plain engine), the
    engine's default K, the sweep's best single configuration and the oracle, each in a single-K engine of its own (the
    same engine kind for the plan and every baseline), `args.confirm` engines each, taking turns; a configuration runs
    only the buckets it stands for, and each engine's bucket figure is one run. (plan / oracle as
    decision_quality.CONFIRMATION, the headline; None with fewer than two passes.)"""
    configs: dict = {}
    batches_of: dict = {}
    for r in rows:
        for B, m, D in dict.fromkeys(role_keys(r, mech).values()):
            configs.setdefault((m, D), engine_config(profile, m, D, drafts))
            batches_of.setdefault((m, D), []).append(B)
    runs = interleaved(
        engine, profile, sorted({r["batch"] for r in rows}), pool, args.rows, configs, args.confirm, {}, batches_of
    )
    again: dict = {}
    factors: dict | None = {}  # each engine's device speed factor: its probe against the profile's reference
    reference_ms = (profile.engine.get("speed_probe") or {}).get("median_ms")
    for (m, D), by_batch in runs.items():
        for B, engine_runs in by_batch.items():
            for run in engine_runs:
                fig = steady_figures([run], B)
                if "error" in fig:
                    raise SpecdecError(f"{m} D={D} at batch {B}, measured again: {fig['error']}", "run with more rows")
                again.setdefault(point_key(B, m, D), []).append(fig["measured_tokens_per_s"])
                probe_ms = probe_median_ms([run])
                if factors is not None and probe_ms and reference_ms:
                    factors.setdefault(point_key(B, m, D), []).append(probe_ms / reference_ms)
                else:
                    factors = None
    return confirmed(rows, again, args.confirm), headline(rows, again, mech, factors) if args.confirm >= 2 else None


def _sweep_settings(
    profile, engine: VllmEngine, ctx: int, batches: list[int], pool, rows: int, mechanisms: dict
) -> dict:
    """What the sweep's measurements depend on (not the profile's figures: a new profile of the same setup reuses
    them)."""
    options = {d.name: d.options for d in profile.drafters if d.name in mechanisms}
    return {
        "engine": f"vllm {engine.version}",
        "device": profile.device.get("name"),
        "target": profile.target.get("weights_hash"),
        "dtype": profile.target.get("dtype"),
        "ctx": ctx,
        "batches": batches,
        "rows": rows,
        "tokens_per_request": BUCKET_TOKENS,
        "held_back_prompts_sha256": sha256_json(pool),
        "mechanisms": {
            m: {"max_draft_len": v["max_draft_len"], "options": options.get(m)} for m, v in mechanisms.items()
        },
        "engine_options": profile.engine.get("options", {}),
        "max_model_len": profile.engine.get("max_model_len"),
    }


def run_engine(args, engine=None) -> dict:
    profile = load_profile(args.profile)
    speed = profile.engine.get("speed_probe")
    if profile.backend != "vllm":
        raise SpecdecError(
            f"{args.profile} was profiled with --engine {profile.backend}",
            "profile with --engine vllm for the vLLM oracle",
        )
    engine = engine or VllmEngine.locate()
    ctx = profile.workload.ctx_buckets[0]
    batches = [B for B in profile.workload.batch_buckets if B <= args.max_batch]
    needed = max(args.rows, *batches)
    if args.prompts is None:  # as the export's engine check decodes them
        held, args.prompts = decoded_prompts(profile, ctx, profile.workload.max_draft_len, needed)
    else:
        held = held_back_prompts(
            profile, ctx, BUCKET_TOKENS, profile.workload.max_draft_len, whole=args.prompts == "whole"
        )
    if len(held) < needed:
        raise SpecdecError(
            f"only {len(held)} held-back prompts reach the context {ctx}", "use fewer or smaller batches"
        )
    refined = None if args.no_refine else RefineSettings(seed=args.seed)
    pool, mix, plan, search_s = searched_for(profile, sha256_file(args.profile), held[:needed], args.seed, refined)
    buckets = [b for b in plan["buckets"] if b["batch"] in batches]
    cost = CostModel(profile, ctx=plan["ctx"], mix=mix)
    mech = plan["mechanism"]
    mechanisms = {
        m: {"quant": "none", "max_draft_len": min(cost.draft_len_limit(m), args.max_draft_len)} for m in cost.mechanisms
    }
    mechanisms = {mech: mechanisms[mech]} | {
        m: v for m, v in mechanisms.items() if m != mech and args.mechanisms == "all"
    }
    units = [(NO_SPEC, 0)] + [(m, D) for m, v in mechanisms.items() for D in range(1, v["max_draft_len"] + 1)]
    settings = _sweep_settings(profile, engine, ctx, batches, pool, args.rows, mechanisms) | {"passes": args.repeats}
    reused = json.loads(args.reuse_sweep.read_text()) if args.reuse_sweep else None
    if reused is not None:
        differ = [k for k, v in settings.items() if reused.get("settings", {}).get(k) != v]
        if differ:
            raise SpecdecError(
                f"{args.reuse_sweep} was swept with another {differ[0]}", "run the sweep again without --reuse-sweep"
            )
    before = {(p["batch"], p["mechanism"], p["draft_len"]): p for p in (reused or {}).get("sweep", [])}
    points, unit_s = [], dict((reused or {}).get("cost", {}).get("oracle_unit_s", {}))
    todo = [
        u for u in units if not all((B, *u) in before for B in batches)
    ]  # the rest was measured by an earlier sweep with these settings
    with tempfile.TemporaryDirectory() as tmp:
        drafts = cut_drafts(profile, set(mechanisms), Path(tmp))
        schedule = [[b["batch"], b["draft_len"]] for b in buckets]
        configs = {u: engine_config(profile, *u, drafts) for u in todo}
        if any(D for _, D in schedule):  # the plan's schedule in one engine, vLLM's per-batch table choosing D
            configs[PLAN] = table_config(profile, mech, dict(schedule), drafts, always_table=True)
        runs = interleaved(engine, profile, batches, pool, args.rows, configs, args.repeats, unit_s)
        for m, D in units:
            if (m, D) not in runs:
                figures = {
                    B: {
                        "measured_tokens_per_s": before[(B, m, D)]["measured_tokens_per_s"],
                        "tokens_per_round": before[(B, m, D)]["measured_tokens_per_forward"],
                        **{
                            k: before[(B, m, D)].get(k)
                            for k in (
                                "measured_raw_tokens_per_s",
                                "measured_interval_tokens_per_s",
                                "draft_len_applied",
                                "probe_ms",
                            )
                        },
                    }
                    for B in batches
                }
            else:
                figures = {
                    B: steady_figures(runs[(m, D)][B], B) | {"probe_ms": probe_median_ms(runs[(m, D)][B])}
                    for B in batches
                }
            for B in batches:
                fig = figures[B]
                if "error" in fig:
                    raise SpecdecError(f"{m} D={D} at batch {B}: {fig['error']}", "run with more rows")
                p = point_record(
                    B,
                    m,
                    "none",
                    D,
                    {"tokens_per_s": fig["measured_tokens_per_s"], "tokens_per_forward": fig["tokens_per_round"]},
                    speed_ratio(fig.get("probe_ms"), speed) or 1.0,
                    cost.predict(B, D, m),
                )
                points.append(
                    p
                    | {
                        "measured_raw_tokens_per_s": fig["measured_raw_tokens_per_s"],
                        "measured_interval_tokens_per_s": fig["measured_interval_tokens_per_s"],
                        "draft_len_applied": fig["draft_len_applied"],
                        "probe_ms": fig.get("probe_ms"),
                    }
                )
                print(
                    f"  B={B:3d} {m:>12s} D={D:2d}: vLLM {p['measured_tokens_per_s']:8.1f} tok/s "
                    f"(scaled {p['scaled_measured_tokens_per_s']:8.1f}, "
                    f"predicted {p['predicted_tokens_per_s']:8.1f}), "
                    f"tokens/round {p['measured_tokens_per_forward']:.3f} "
                    f"(predicted {p['predicted_tokens_per_forward']:.3f})",
                    file=sys.stderr,
                    flush=True,
                )
        plan_run = (
            [{"batch": B, "draft_len": D, **steady_figures(runs[PLAN][B], B)} for B, D in schedule]
            if PLAN in runs
            else None
        )
        default_k = min(ENGINE_DEFAULT_K.get(mech, 3), mechanisms[mech]["max_draft_len"])
        summary = summarize(points, schedule, mech, default_k)
        if args.confirm and todo:  # the sweep kept where the re-measure fails: --reuse-sweep takes it
            checkpoint = args.out.with_suffix(".sweep.json")
            write_json(checkpoint, {"settings": settings, "sweep": points, "cost": {"oracle_unit_s": unit_s}})
            print(f"the sweep is kept in {checkpoint} (--reuse-sweep) until the re-measure ends", file=sys.stderr)
        confirmation, measured_again = (
            confirm(engine, profile, summary["buckets"], mech, pool, args, drafts) if args.confirm else (None, None)
        )
    if args.confirm and todo:
        checkpoint.unlink(missing_ok=True)
    oracle_s = sum(v for k, v in unit_s.items() if k != f"{PLAN[0]}/{PLAN[1]}")
    applied = speed is not None and all(p["probe_ms"] for p in points)
    profile_s = profile.phase_s.get("engine units", 0.0)
    return {
        "source": "measured",
        "engine": f"vllm {engine.version}",
        "profile": shown(args.profile),
        "device": profile.device.get("name"),
        "dtype": profile.target.get("dtype"),
        "mechanism": mech,
        "quant": "none",
        "ctx": plan["ctx"],
        "split": "held_back",
        "mix": mix,
        "prompts": args.prompts,
        "new_tokens": BUCKET_TOKENS,
        "repeats": args.repeats,
        "rows": args.rows,
        "max_draft_len": args.max_draft_len,
        "oracle_kind": "every profiled mechanism x D" if args.mechanisms == "all" else "D-only (plan's mechanism)",
        "mechanisms_swept": mechanisms,
        "engine_default_k": default_k,
        "plan_schedule": schedule,
        "refinement": plan.get("refinement"),
        "refined_buckets": refined_buckets(plan),
        "refine_skipped": plan["refine_skipped"],
        "plan_schedule_measured": schedule,
        "plan_schedule_run": plan_run,
        "figures": f"raw measured tokens/s (steady steps of the engine, pooled over {args.repeats} interleaved engines "
        "per point); `scaled` beside them: see scaling",
        "scaling": {
            "method": SCALING,
            "probe_ms_at_profile_time": (speed or {}).get("median_ms"),
            "elasticity": (speed or {}).get("elasticity"),
            "probe": (speed or {}).get("spec"),
            "applied": applied,
            "why_not": None
            if applied
            else "the profile or a point's engines timed no speed probe: `scaled` equals raw",
        },
        "measured_rounds": "engine steps with every request of the bucket decoding",
        **summary,
        "sweep": points,
        "settings": settings,
        "confirmation": confirmation,
        "headline": measured_again,
        "targets_stated": TARGETS,
        "sweep_reused_from": {"path": shown(args.reuse_sweep), "sha256": sha256_file(args.reuse_sweep)}
        if reused
        else None,
        "cost": {
            "search_s": search_s,
            "refine_s": (plan.get("refinement") or {}).get("spent_s", 0.0),
            "profile_engine_s": profile_s,
            "oracle_sweep_s": oracle_s,
            "oracle_unit_s": unit_s,
            "tuning_vs_oracle": (profile_s + search_s) / oracle_s,
            "oracle_sweep_target_forwards": "n/a (engine)",
            "oracle_sweep_drafter_forwards": {},
        },
    }
