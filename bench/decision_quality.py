"""Decision quality and cost-model fidelity of a tuned plan, measured end to end with the real
speculative loop (never with the cost model), on held-back prompts the profile did not see.

For every batch bucket it decodes every profiled mechanism at every D it allows (the oracle sweep; D = 0,
no speculation, once per bucket) and compares:
  (a) no speculation  (b) the best single (mechanism, D) for all buckets, as a hand sweep finds it (measured)
  (c) the engine's usual default K for the plan's mechanism  (d) the tuned plan
  (e) the oracle: the best measured (mechanism, D) at that bucket
and the cost model's predicted tokens/s and tokens per forward against the measured ones at every point.
`--mechanisms plan` sweeps the plan's mechanism alone: its oracle is then a D-only oracle.

The oracle is the best of a bucket's measured points, and the best of several noisy figures reads high. So after the
sweep, each bucket's plan and oracle are measured again (`--confirm` runs each, alternating, apart from the sweep that
chose the oracle), and plan / oracle is also given on those runs; the bounds are judged on them where they ran.

Every figure is computed on the raw measured tokens/s. Beside it, under `scaled`, the same figure on
speed-scaled tokens/s (SCALING below): a shared machine drifts while the sweep runs, and points minutes
apart would otherwise compare the drift as well as the decisions.

    python bench/decision_quality.py                      # demo pair on this machine (about 15 minutes per mechanism
                                                          # on 2 cores)
    python bench/decision_quality.py --profile P --quick  # a reduced run (the test uses it)

Writes bench/results/decision_quality.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.pipeline.lossless import profile_drafter
from specdec_tune.pipeline.refine import group_rows
from specdec_tune.pipeline.throughput_check import (
    DeviceSpeed,
    at_profile_speed_tokens_per_s,
    context_prompts_by_domain,
    measure_decode,
)
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file, sha256_json
from specdec_tune.settings import RefineSettings

from common import (
    ENGINE_DEFAULT_K,
    FORWARDS_COUNTED,
    NO_SPEC,
    ROOT,
    TARGETS,
    ForwardCounter,
    config_name,
    confirmed,
    headline,
    headline_bounds,
    headline_points,
    point_key,
    point_record,
    refined_buckets,
    run_and_write,
    searched_for,
    shown,
    summarize,
    write_table,
)

SCALING = (
    "each run's measured tokens/s x (probe ms now / probe ms at profile time), the probe being one verify step at "
    "the point's batch, one new token, ctx {ctx} cached (median of 5 after 2 warm-ups), timed before and after the "
    "run and averaged, and a point's scaled figure the median over its runs; probe ms at profile time is the "
    "profile's verify step of that shape. A factor above 1 means the device ran slower than when it was profiled, and "
    "the scaled figure is what the point would measure at profile-time speed"
)
PROMPTS = {
    "cut": "cut to the context (their last ctx - N/2 tokens)",
    "whole": "whole (those between half of ctx - N/2 tokens and all of it)",
}
ORACLE_KINDS = {"all": "every profiled mechanism x D", "plan": "D-only (plan's mechanism)"}
SWEEP_ORDER = "interleaved"  # the timed runs' order (`interleaved_runs`), a sweep setting


# ---------------------------------------------------------------------------- what is swept


def swept_mechanisms(
    profile, cost: CostModel, plan: dict, batches: list[int], which: str, max_mechanisms: int, max_draft_len: int
) -> dict[str, dict]:
    """{mechanism: {"quant", "max_draft_len"}} to sweep, the plan's first.

    `which` "all": every profiled drafter the cost model has acceptance for; "plan": the plan's alone. Each runs
    D = 1 .. min(its own limit `CostModel.draft_len_limit`, `max_draft_len`); the plan's at the plan's weight
    format, the others at full precision. Past `max_mechanisms`, the others kept are those the cost model rates
    best (mean over the buckets of their best predicted tokens/s): the plan's nearest rivals.
    """
    plan_mech = plan["mechanism"]
    others = (
        [d.name for d in profile.drafters if d.name in cost.mechanisms and d.name != plan_mech]
        if which == "all"
        else []
    )
    quant = {m: "none" if "none" in cost.quants(m) else cost.quants(m)[0] for m in others} | {plan_mech: plan["quant"]}

    def rated(m: str) -> float:
        limit = min(cost.draft_len_limit(m), max_draft_len)
        return statistics.mean(
            max(cost.predict(B, D, m, quant[m]).tokens_per_s.value for D in range(1, limit + 1)) for B in batches
        )

    others = sorted(others, key=rated, reverse=True)[: max(0, max_mechanisms - 1)]
    chosen = {m: quant[m] for m in [plan_mech, *others]}
    return {m: {"quant": q, "max_draft_len": min(cost.draft_len_limit(m), max_draft_len)} for m, q in chosen.items()}


def sweep_settings(args, profile_sha256: str, dtype: str, **known) -> dict:
    """What the sweep's measurements depend on. Without `known` (ctx, batches, mechanisms, prompts: they need the
    plan and the tokenizer) the part that the command line alone sets, checked before anything runs."""
    settings = {
        "profile_sha256": profile_sha256,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rows": args.rows,
        "seed": args.seed,
        "split": "held_back",
        "max_draft_len": args.max_draft_len,
        "dtype": dtype,
        "order": SWEEP_ORDER,
    }
    return settings | known


def check_reuse(reused: dict, settings: dict, path) -> None:
    """Refuse a sweep measured with other settings: names the first key (in `settings`' order) that differs."""
    recorded = reused.get("settings")
    if recorded is None:
        raise SpecdecError(
            f"{path} records no sweep settings (made before they were recorded)",
            "run the sweep again without --reuse-sweep",
        )
    for key, value in settings.items():
        if recorded.get(key) != value:
            raise SpecdecError(
                f"{path} was swept with {key} = {json.dumps(recorded.get(key))}, this run has {json.dumps(value)}",
                "run with the same settings, or without --reuse-sweep",
            )


# ---------------------------------------------------------------------------- the sweep


def sweep_points(batches: list[int], mechanisms: dict[str, dict]) -> list[tuple[int, str, str, int]]:
    """(batch, mechanism, quant, D) of the sweep: per bucket, D = 0 once, then every mechanism's D = 1 .. its limit."""
    return [
        (B, m, s["quant"], D)
        for B in batches
        for m, s in [(NO_SPEC, {"quant": NO_SPEC, "max_draft_len": 0}), *mechanisms.items()]
        for D in ([0] if m == NO_SPEC else range(1, s["max_draft_len"] + 1))
    ]


def interleaved_runs(points: list[tuple], repeats: int, seed: int) -> list[tuple]:
    """The order the timed runs go in: one run of every point of a bucket per round, shuffled afresh each round, for
    `repeats` rounds, then the next bucket. A slow spell then falls on every configuration of the bucket alike instead
    of on the few measured while it lasted, and the configurations compared within a bucket are compared under the
    same drift."""
    rng = random.Random(seed)
    order = []
    for B in dict.fromkeys(p[0] for p in points):
        here = [p for p in points if p[0] == B]
        for _ in range(repeats):
            rng.shuffle(here)
            order += list(here)
    return order


CONFIRM_ROWS = (
    "each run measured again decodes whole batches of the bucket's size: at least --rows prompts, and enough for about "
    "{run_s:g} s at the bucket's swept no-speculation tokens/s (the held-back prompts taken again in order where more "
    "are needed: acceptance is per prompt, so a repeated batch accepts as it did, and only the timing is sampled "
    "again). A large batch's run over the sweep's few prompts lasts a second or two, and on a shared machine so short "
    "a run varies by 15% run to run"
)


def run_rows(batch: int, rows: int, no_spec_tokens_per_s: float, new_tokens: int, run_s: float) -> int:
    """Prompts one re-measured run decodes at `batch` (CONFIRM_ROWS)."""
    return group_rows(batch, max(rows, math.ceil(run_s * no_spec_tokens_per_s / new_tokens)))


def cycled(pool: list, n: int) -> list:
    """The first `n` of `pool` taken again and again."""
    return [pool[i % len(pool)] for i in range(n)]


# ---------------------------------------------------------------------------- decisions and fidelity (pure: no model)


def untied_measured(plan: dict, points: list[dict], rows: list[dict]) -> list[dict]:
    """The search's schedule with every expected difference deciding (no shorter-draft tolerance; the plan's
    `study.untied_schedule`, in the drafter a drafter tie passed over where one did),
    measured on the sweep where it swept that D (raw tokens/s and the share of the bucket's oracle), else None."""
    mechanism = (plan["study"].get("untied_drafter") or {}).get("mechanism", plan["mechanism"])
    swept = [p for p in points if p["mechanism"] in (mechanism, NO_SPEC)]
    by = {(p["batch"], p["draft_len"]): p["measured_tokens_per_s"] for p in swept}
    oracle = {r["batch"]: r["tokens_per_s"]["oracle"] for r in rows}
    return [
        {
            "batch": B,
            "mechanism": mechanism,
            "draft_len": D,
            "measured_tokens_per_s": by.get((B, D)),
            "vs_oracle": by[(B, D)] / oracle[B] if (B, D) in by else None,
        }
        for B, D in plan["study"].get("untied_schedule", [])
        if B in oracle
    ]


def check_bounds(
    result: dict, min_vs_oracle: float = 0.8, max_median_err_pct: float = 25.0, figures: str = "raw"
) -> list[str]:
    """What breaks the bounds a tuned plan should keep, on the raw figures (or `figures="scaled"`): the plan at
    least `min_vs_oracle` of the oracle in every bucket (on the re-measure where the result has one, CONFIRMATION),
    the cost model's median tokens/s error below `max_median_err_pct`, and the headline's TARGETS (its speed-corrected
    figures for "scaled"). One line per violation, naming the bucket and the configs; [] when none."""
    pick = (lambda d: d) if figures == "raw" else (lambda d: d["scaled"])
    again = (
        {b["batch"]: b["plan_vs_oracle"] for b in (result.get("confirmation") or {}).get("buckets", [])}
        if figures == "raw"
        else {}
    )
    out = []
    for r in result["buckets"]:
        row = pick(r)
        if r["batch"] in again:
            if again[r["batch"]] < min_vs_oracle:
                out.append(
                    f"batch {r['batch']}: the plan ({config_name(r['plan_mechanism'], r['plan_draft_len'])}) reaches "
                    f"{100 * again[r['batch']]:.1f}% of the oracle "
                    f"({config_name(r['oracle_mechanism'], r['oracle_draft_len'])}) measured again, below "
                    f"{100 * min_vs_oracle:.0f}%"
                )
        elif row["vs_oracle"]["plan"] < min_vs_oracle:
            out.append(
                f"batch {r['batch']}: the plan ({config_name(r['plan_mechanism'], r['plan_draft_len'])}) reaches "
                f"{100 * row['vs_oracle']['plan']:.1f}% of the oracle "
                f"({config_name(row['oracle_mechanism'], row['oracle_draft_len'])}; {row['tokens_per_s']['plan']:.1f} "
                f"against {row['tokens_per_s']['oracle']:.1f} tok/s, {figures}), below {100 * min_vs_oracle:.0f}%"
            )
    err = pick(result["fidelity"])["tokens_per_s_median_err_pct"]
    if err >= max_median_err_pct:
        out.append(
            f"cost model: median tokens/s error {err:.1f}% over {result['fidelity']['points']} points ({figures}) "
            f"is not below {max_median_err_pct:g}%"
        )
    headline = result.get("headline") or {}
    if judged := headline if figures == "raw" else headline.get("speed_corrected"):
        out += headline_bounds(judged, result["cost"].get("tuning_vs_oracle"))
    return out


# ---------------------------------------------------------------------------- the run


def run(args) -> dict:
    profile = load_profile(args.profile)
    profile_sha256, dtype = sha256_file(args.profile), profile.device.get("dtype", "auto")
    reused = json.loads(args.reuse_sweep.read_text()) if args.reuse_sweep else None
    if reused:  # what the command line sets is checked before the search and the model load
        check_reuse(reused, sweep_settings(args, profile_sha256, dtype), args.reuse_sweep)
    # the held-back prompts decoded (long enough for the plan's context, the search's default: the first bucket)
    ctx = profile.workload.ctx_buckets[0]
    needed = max(args.rows, *(B for B in profile.workload.batch_buckets if B <= args.max_batch))
    target = load_model(profile.target["path"], dtype=dtype)
    held = context_prompts_by_domain(
        target, ctx, args.new_tokens, profile.workload.max_draft_len, "held_back", whole=args.prompts == "whole"
    )
    if len(held) < needed:
        raise SpecdecError(
            f"only {len(held)} held-back prompts reach the context {ctx}", "use fewer or smaller batches"
        )
    refined = None if args.no_refine else RefineSettings(seed=args.seed)
    pool, mix, plan, search_s = searched_for(profile, profile_sha256, held[:needed], args.seed, refined)
    assert plan["ctx"] == ctx, "the search plans for the profile's first context bucket"
    buckets = [b for b in plan["buckets"] if b["batch"] <= args.max_batch]
    batches = [b["batch"] for b in buckets]
    cost = CostModel(profile, ctx=plan["ctx"], mix=mix)
    cap = min(args.max_draft_len, profile.workload.max_draft_len)
    mechanisms = swept_mechanisms(profile, cost, plan, batches, args.mechanisms, args.max_mechanisms, cap)
    mech, quant = plan["mechanism"], plan["quant"]
    settings = sweep_settings(
        args,
        profile_sha256,
        dtype,
        ctx=plan["ctx"],
        batches=batches,
        mechanisms=mechanisms,
        held_back_prompts_sha256=sha256_json(pool),
    )
    if reused:
        check_reuse(reused, settings, args.reuse_sweep)
    speed = DeviceSpeed(target, profile, plan["ctx"], args.seed)
    counter = ForwardCounter()
    measured_before = {(p["batch"], p["mechanism"], p["draft_len"]): p for p in reused["sweep"]} if reused else {}
    drafters: dict = {}

    def measure(B: int, m: str, q: str, D: int, rows: int = 0) -> tuple[float, float, float]:
        """One timed run (after a short warm-up) over `rows` prompts (default: the sweep's): (tokens/s, its
        speed-scaled tokens/s, tokens per forward)."""
        if m != NO_SPEC and m not in drafters:
            drafters[m] = profile_drafter(profile, m, q, target)
        rows = rows or max(B, args.rows)  # small batches decode several batches, so that AL is not one prompt's

        def decode(between) -> dict:
            with counter.active():  # the decodes' forwards only: the speed probes between the runs are not the sweep's
                return measure_decode(
                    target,
                    drafters.get(m),
                    cycled(pool, rows),
                    D,
                    args.new_tokens,
                    1,
                    args.seed,
                    batch_size=B,
                    between=counter.paused(between),
                )

        decoded, ratios = speed.measure(
            decode, batch=B
        )  # the device's speed against profile time, probed on either side of the run
        return decoded["tokens_per_s"], at_profile_speed_tokens_per_s(decoded, ratios)[0], decoded["tokens_per_forward"]

    swept = sweep_points(batches, mechanisms)
    runs: dict[tuple, list[tuple[float, float, float]]] = {p: [] for p in swept}
    sweep_started = time.perf_counter()
    for point in [] if measured_before else interleaved_runs(swept, args.repeats, args.seed):
        runs[point].append(measure(*point))
        B, m, _, D = point
        tps, scaled, _ = runs[point][-1]
        print(
            f"  run {len(runs[point])} of B={B:3d} {m:>12s} D={D:2d}: {tps:8.1f} tok/s (scaled {scaled:8.1f}) "
            f"[{(time.perf_counter() - sweep_started) / 60:.1f} min]",
            file=sys.stderr,
            flush=True,
        )
    points = []
    for B, m, q, D in swept:
        old = measured_before.get((B, m, D))  # the settings matched: every point was measured, by this script
        if old:
            meas, ratio = (
                {
                    "tokens_per_s": old["measured_tokens_per_s"],
                    "tokens_per_forward": old["measured_tokens_per_forward"],
                    "runs_tokens_per_s": old.get("runs_tokens_per_s"),
                },
                old["device_speed_ratio"],
            )
        else:  # the median over the point's runs, raw and scaled apart
            done = runs[(B, m, q, D)]
            raw, scaled = statistics.median(r[0] for r in done), statistics.median(r[1] for r in done)
            meas, ratio = (
                {"tokens_per_s": raw, "tokens_per_forward": done[-1][2], "runs_tokens_per_s": [r[0] for r in done]},
                scaled / raw,
            )
        p = point_record(B, m, q, D, meas, ratio, cost.predict(B, D, m, q))
        points.append(p)
        print(
            f"  B={B:3d} {m:>12s} D={D:2d}: measured {p['measured_tokens_per_s']:8.1f} tok/s "
            f"(scaled {p['scaled_measured_tokens_per_s']:8.1f}, "
            f"predicted {p['predicted_tokens_per_s']:8.1f}), tokens/forward {p['measured_tokens_per_forward']:.3f} "
            f"(predicted {p['predicted_tokens_per_forward']:.3f})",
            file=sys.stderr,
            flush=True,
        )
    counts = counter.summary(len(target.model.layers))
    sweep_cost = {
        "oracle_sweep_s": time.perf_counter() - sweep_started,
        "oracle_sweep_target_forwards": counts["target_forwards"],
        "oracle_sweep_drafter_forwards": counts["drafter_forwards"],
    }
    if reused:  # the sweep's cost is the one its measurement took
        sweep_cost = {k: reused["cost"][k] for k in sweep_cost}
    schedule = [[b["batch"], min(b["draft_len"], mechanisms[mech]["max_draft_len"])] for b in buckets]
    default_k = min(ENGINE_DEFAULT_K.get(mech, 3), mechanisms[mech]["max_draft_len"])
    summary = summarize(points, schedule, mech, default_k)
    again: dict[tuple[int, str, int], list[float]] = {}
    again_log: list[dict] = []  # each run measured again, with the device's speed probed before and after it
    factors: dict[tuple[int, str, int], list[float]] | None = {}  # each run's speed factor (None: one was not probed)
    quants = {m: v["quant"] for m, v in mechanisms.items()}
    again_rows = {
        r["batch"]: run_rows(r["batch"], args.rows, r["tokens_per_s"]["no_spec"], args.new_tokens, args.confirm_run_s)
        for r in summary["buckets"]
    }
    for B, m, q, D in interleaved_runs(headline_points(summary["buckets"], mech, quants), args.confirm, args.seed + 1):
        runs = again.setdefault(point_key(B, m, D), [])
        runs.append(measure(B, m, q, D, again_rows[B])[0])
        probes = speed.last_probes or [None]
        if factors is not None and None not in (probes[0], probes[-1]):
            factors.setdefault(point_key(B, m, D), []).append(math.sqrt(probes[0] * probes[-1]))
        else:
            factors = None
        again_log.append(
            {
                "batch": B,
                "config": config_name(m, D),
                "tokens_per_s": runs[-1],
                "device_speed_before": probes[0],
                "device_speed_after": probes[-1],
            }
        )
        print(
            f"  again: run {len(runs)} of B={B:3d} {m:>12s} D={D:2d}: {runs[-1]:8.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    profile_s = sum(profile.phase_s.values())
    return {
        "source": "measured",
        "profile": shown(args.profile),
        "device": profile.device.get("name"),
        "dtype": profile.device.get("dtype"),
        "mechanism": mech,
        "quant": quant,
        "ctx": plan["ctx"],
        "split": "held_back",
        "mix": mix,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rows": args.rows,
        "max_draft_len": cap,
        "oracle_kind": ORACLE_KINDS[args.mechanisms],
        "mechanisms_swept": mechanisms,
        "engine_default_k": default_k,
        "plan_schedule": [[b["batch"], b["draft_len"]] for b in buckets],
        "refinement": plan.get("refinement"),
        "refined_buckets": refined_buckets(plan),
        "refine_skipped": plan["refine_skipped"],
        "plan_schedule_measured": schedule,
        "figures": "raw measured tokens/s; `scaled` beside them: see scaling",
        "scaling": {
            "method": SCALING.format(ctx=plan["ctx"]),
            "probe_ms_at_profile_time": {B: ms for (B, tokens), ms in speed.profiled_ms.items() if tokens == 1},
            "applied": speed.profiled_ms is not None,
            "why_not": speed.why,
        },
        "measured_rounds": "rounds with every row of the batch decoding (a continuously batched server's steady state)",
        **summary,
        "untied": untied_measured(plan, points, summary["buckets"]),
        "sweep": points,
        "confirmation": confirmed(summary["buckets"], again, args.confirm) if args.confirm else None,
        "confirm_rows": {"per_batch": again_rows, "method": CONFIRM_ROWS.format(run_s=args.confirm_run_s)}
        if args.confirm
        else None,
        "headline": headline(summary["buckets"], again, mech, factors) | {"runs": again_log}
        if args.confirm >= 2
        else None,
        "targets_stated": TARGETS,
        "settings": settings,
        "sweep_settings_hash": sha256_json(settings),
        "sweep_reused_from": {"path": shown(args.reuse_sweep), "sha256": sha256_file(args.reuse_sweep)}
        if reused
        else None,
        "cost": {
            "search_s": search_s,
            "refine_s": (plan.get("refinement") or {}).get("spent_s", 0.0),
            "profile_s": profile_s,
            "tuning_vs_oracle": (profile_s + search_s) / sweep_cost["oracle_sweep_s"],
            **sweep_cost,
            "forwards_counted": {
                k: v for k, v in FORWARDS_COUNTED.items() if k == "target" or set(k.split(", ")) & {*mechanisms}
            },
        },
    }


# ---------------------------------------------------------------------------- the table


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}%"


def table(result: dict) -> str:
    mechs = ", ".join(sorted(result["mechanisms_swept"], key=lambda m: m != result["mechanism"]))  # the plan's first
    oracle = (
        f"oracle over every profiled mechanism x D ({mechs})"
        if result["oracle_kind"] == ORACLE_KINDS["all"]
        else f"D-only oracle (the plan's mechanism, {mechs})"
    )
    lines = [
        *headline_lines(result),
        f"decision quality, {oracle}: raw measured decode tokens/s first, speed-scaled beside them; predictions from "
        f"the cost model. Plan: {result['mechanism']} on {result['device']} ({result['dtype']}), searched and "
        "predicted for the decoded prompts' mix ("
        + ", ".join(f"{d} {w:.0%}" for d, w in result.get("mix", {}).items())
        + f"), held-back prompts {PROMPTS[result.get('prompts', 'cut')]}, ctx {result['ctx']}, "
        f"{result['new_tokens']} new tokens, at least {result['rows']} prompts per point, median of "
        f"{result['repeats']} runs interleaved with the bucket's other points (each after a short warm-up)",
        "| batch | plan | oracle | no spec | best single | engine default | plan tok/s | oracle tok/s | plan / oracle "
        "| plan / no spec | scaled: oracle | scaled: plan / oracle | scaled: plan / no spec |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["buckets"]:
        t, s = r["tokens_per_s"], r["scaled"]
        lines.append(
            f"| {r['batch']} | {config_name(r['plan_mechanism'], r['plan_draft_len'])} "
            f"| {config_name(r['oracle_mechanism'], r['oracle_draft_len'])} "
            f"| {t['no_spec']:.0f} | {t['single_d']:.0f} ({config_name(r['single_mechanism'], r['single_draft_len'])}) "
            f"| {t['engine_default']:.0f} (D={r['default_draft_len']}) | {t['plan']:.0f} | {t['oracle']:.0f} "
            f"| {r['vs_oracle']['plan']:.3f} | {r['vs_no_spec']['plan']:.3f} "
            f"| {config_name(s['oracle_mechanism'], s['oracle_draft_len'])} | {s['vs_oracle']['plan']:.3f} "
            f"| {s['vs_no_spec']['plan']:.3f} |"
        )
    f, g, c = result["fidelity"], result["targets"], result["cost"]
    lo, hi = f["device_speed_ratio_range"]
    per_mech = "; ".join(
        f"{m} {_pct(x['tokens_per_s_median_err_pct'])} over {x['points']} "
        f"(scaled {_pct(x['scaled']['tokens_per_s_median_err_pct'])})"
        for m, x in f["by_mechanism"].items()
    )
    reused = result["sweep_reused_from"]
    lines += [
        "",
        f"cost model vs measured over {f['points']} points, raw: tokens/s median "
        f"{_pct(f['tokens_per_s_median_err_pct'])} (worst {_pct(f['tokens_per_s_worst_err_pct'])}); speed-scaled: "
        f"median {_pct(f['scaled']['tokens_per_s_median_err_pct'])} "
        f"(worst {_pct(f['scaled']['tokens_per_s_worst_err_pct'])}); tokens per forward (D >= 1) median "
        f"{_pct(f['tokens_per_forward_median_err_pct'])} (worst {_pct(f['tokens_per_forward_worst_err_pct'])})",
        f"tokens/s median error per mechanism: {per_mech}",
        f"plan at least {100 * g['plan_min_vs_oracle']:.1f}% of the oracle in every bucket "
        f"(scaled {100 * g['scaled']['plan_min_vs_oracle']:.1f}%); "
        f"mean speedup plan {g['plan_mean_speedup']:.3f}x vs best single config {g['single_d_mean_speedup']:.3f}x "
        f"(scaled {g['scaled']['plan_mean_speedup']:.3f}x vs {g['scaled']['single_d_mean_speedup']:.3f}x)",
        *(
            [
                f"the sweep's own noise: a run's relative sd {100 * n['run_rel_sd']:.1f}% (pooled over the points); "
                "plan / oracle with its 95% interval: "
                + "; ".join(
                    f"batch {b['batch']} {b['plan_vs_oracle']:.3f} ({b['low']:.3f}-{min(b['high'], 9.99):.3f})"
                    for b in n["buckets"]
                )
            ]
            if (n := result.get("sweep_noise"))
            else []
        ),
        *([confirmation_line(again)] if (again := result.get("confirmation")) else []),
        *(
            [
                "without the shorter-draft tolerance (the same search with every expected difference deciding): "
                + "; ".join(
                    f"batch {u['batch']} {config_name(u.get('mechanism', result['mechanism']), u['draft_len'])} "
                    + (f"{100 * u['vs_oracle']:.1f}% of the oracle" if u["vs_oracle"] is not None else "not swept")
                    for u in untied
                )
            ]
            if (untied := result.get("untied"))
            else []
        ),
        f"scaling: {result['scaling']['method']}; factors x{lo:.3f} to x{hi:.3f}"
        + ("" if result["scaling"]["applied"] else f" (not applied: {result['scaling']['why_not']})"),
        f"oracle sweep: {len(result['sweep'])} points in {c['oracle_sweep_s']:.0f} s, "
        f"{c['oracle_sweep_target_forwards']} target forwards, "
        f"drafter forwards {json.dumps(c.get('oracle_sweep_drafter_forwards', {}))}"
        + (f" (measured earlier: {reused['path']}, sha256 {reused['sha256'][:12]})" if reused else ""),
    ]
    return "\n".join(lines)


def _x(x: dict) -> str:
    return f"{x['value']:.3f} [{x['low']:.3f}-{x['high']:.3f}]"


def headline_lines(result: dict) -> list[str]:
    """The headline first (HEADLINE): per bucket the plan over every baseline, then the mean speedups; [] without."""
    h = result.get("headline")
    if not h:
        return []
    refined = (
        "refined (measured refinement on)"
        if result.get("refinement")
        else f"not refined ({result.get('refine_skipped')})"
    )
    rows = result.get("confirm_rows")
    per_run = (
        f" (prompts per run by batch: {', '.join(f'{B}: {n}' for B, n in rows['per_batch'].items())})" if rows else ""
    )
    lines = [
        f"headline: the plan ({refined}) against what a user runs without the tool, all measured again in "
        f"{h['rounds']} interleaved rounds on held-back prompts{per_run}; plan / X with its 95% interval",
        "| batch | plan | plan tok/s | / no spec | / engine default | / best single | / oracle |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in h["buckets"]:
        v, c = b["plan_vs"], b["configs"]
        lines.append(
            f"| {b['batch']} | {c['plan']} | {b['tokens_per_s']['plan']:.1f} | {_x(v['no_spec'])} "
            f"| {_x(v['engine_default'])} ({c['engine_default']}) | {_x(v['single_d'])} ({c['single_d']}) "
            f"| {_x(v['oracle'])} ({c['oracle']}) |"
        )
    m, r = h["mean_speedup"], h["plan_vs_mean_speedup"]
    cost = result["cost"]
    lines += [
        "",
        f"mean speedup over no speculation: plan {_x(m['plan'])}, engine default {_x(m['engine_default'])}, "
        f"best single {_x(m['single_d'])}, oracle {_x(m['oracle'])}; "
        f"plan / engine default {_x(r['engine_default'])}, plan / best "
        f"single {_x(r['single_d'])}, plan / oracle {_x(r['oracle'])}",
        f"tuning: profile {cost.get('profile_s', cost.get('profile_engine_s', 0.0)):.0f} s + search "
        f"{cost['search_s']:.0f} s (refinement {cost.get('refine_s', 0.0):.0f} s) = {cost['tuning_vs_oracle']:.2f} of "
        "the oracle sweep's "
        f"{cost['oracle_sweep_s']:.0f} s",
        f"targets: {', '.join(f'{k} {v:.3g}' for k, v in result['targets_stated'].items())}",
        "",
    ]
    if sc := h.get("speed_corrected"):
        ratios = ", ".join(f"batch {b['batch']} {_x(b['plan_vs']['oracle'])}" for b in sc["buckets"])
        r = sc["plan_vs_mean_speedup"]
        lines += [
            f"speed-corrected beside them (elasticity {sc['elasticity']:.2f}: each run's tokens/s x its device speed "
            f"factor^e): plan / oracle {ratios}; mean speedup plan / engine default {_x(r['engine_default'])}, "
            f"plan / best single {_x(r['single_d'])}, plan / oracle {_x(r['oracle'])}",
            "",
        ]
    return lines


def confirmation_line(c: dict) -> str:
    def one(b: dict) -> str:
        if b["same_config"]:
            return f"batch {b['batch']} 1 (the plan is the oracle)"
        return f"batch {b['batch']} {b['plan_vs_oracle']:.3f}" + (
            f" ({b['low']:.3f}-{b['high']:.3f})" if b["low"] is not None else ""
        )

    return (
        f"measured again ({c['repeats']} runs each of the plan and the oracle, alternating; a run's relative sd "
        f"{_pct(100 * c['run_rel_sd'] if c['run_rel_sd'] else None)}): plan / oracle "
        + "; ".join(map(one, c["buckets"]))
        + f"; at least {100 * c['plan_min_vs_oracle']:.1f}% in every bucket"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=ROOT / "tests" / "data" / "demo_profile.json")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decision_quality.json")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs per point, in rounds over the bucket's points (interleaved)"
    )
    ap.add_argument(
        "--rows", type=int, default=8, help="prompts decoded per point at least (in batches of the bucket's size)"
    )
    ap.add_argument("--max-batch", type=int, default=1 << 30)
    ap.add_argument(
        "--max-draft-len",
        type=int,
        default=1 << 30,
        help="caps every mechanism's D (each also stops at its own profiled limit)",
    )
    ap.add_argument(
        "--mechanisms",
        choices=sorted(ORACLE_KINDS),
        default="all",
        help="all: the oracle sweeps every profiled mechanism x D; plan: the plan's mechanism alone (a D-only oracle)",
    )
    ap.add_argument(
        "--max-mechanisms",
        type=int,
        default=1 << 30,
        help="sweep at most this many mechanisms: the plan's and the ones the cost model rates best after it",
    )
    ap.add_argument(
        "--confirm",
        type=int,
        default=5,
        help="runs of each bucket's plan and oracle measured again after the sweep "
        "(0: none); plan / oracle on them beside the sweep's",
    )
    ap.add_argument(
        "--confirm-run-s",
        type=float,
        default=8.0,
        help="each run measured again lasts about this long (whole batches, at the swept no-speculation speed; "
        "0: as many prompts as the sweep's runs)",
    )
    ap.add_argument(
        "--prompts",
        choices=sorted(PROMPTS),
        default=None,
        help="the held-back prompts decoded: cut to the context "
        "bucket (every row's KV cache at ctx), or whole, those that fit (the text a lookup drafter copies from kept, "
        "as the profile measures acceptance). Default: as the engine's export check decodes them: torch cut; vllm "
        "whole where enough fit, else cut",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-refine",
        action="store_true",
        help="judge the cost model's plan alone (default: the plan as `search` writes it, measured refinement on)",
    )
    ap.add_argument(
        "--reuse-sweep",
        type=Path,
        default=None,
        help="take the measured points from an earlier result of this script and "
        "recompute the plan, the predictions and the decisions; refused unless it was swept with the same settings "
        "(profile, prompts, tokens, repeats, rows, seed, context, batches, mechanisms, D limits, dtype)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="batches up to 2, D up to 1, 8 tokens, 1 repeat, 2 prompts per point, and at most "
        "2 mechanisms (the plan's and the cost model's best other one)",
    )
    ap.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default="torch",
        help="where the oracle runs: torch (this tool's loop) or vllm (the engine itself, for a profile measured in "
        "it; writes decision_quality_vllm.json unless --out is given; bounds: plan >= 95%% of the oracle, median error "
        "<= 10%%, tuning <= 1/3 of the oracle sweep's engine time)",
    )
    args = ap.parse_args(argv)
    if args.engine == "vllm":
        return _main_engine(args, ap)
    args.prompts = args.prompts or "cut"
    if args.quick:
        args.max_batch, args.max_draft_len, args.new_tokens, args.repeats, args.rows, args.confirm = (
            2,
            1,
            8,
            1,
            2,
            min(args.confirm, 1),
        )
        args.confirm_run_s = 0.0
        args.max_mechanisms = min(args.max_mechanisms, 2)
    result = run_and_write(run, args)
    if result is None:
        return 1
    write_table(args, table(result))
    for figures in ("raw", "scaled"):
        violations = check_bounds(result, figures=figures)
        print(
            "bounds (plan >= 80% of the oracle in every bucket, median tokens/s error < 25%, the headline's targets "
            f"where it ran; {figures} figures): " + ("kept" if not violations else "; ".join(violations))
        )
    return 0


def engine_table(result: dict) -> str:
    """`table` and what only the engine's oracle has: the tuning cost in engine seconds, the plan's schedule in one
    engine."""
    c = result["cost"]
    run = "; ".join(
        f"batch {r['batch']}: D={r['draft_len']} planned, vLLM ran D={r.get('draft_len_applied')}, "
        f"{r.get('measured_tokens_per_s', float('nan')):.1f} tok/s"
        for r in result["plan_schedule_run"] or []
    )
    return (
        table(result) + f"\ntuning (profile {c['profile_engine_s']:.0f} s + search {c['search_s']:.0f} s) "
        f"against the oracle sweep's {c['oracle_sweep_s']:.0f} engine seconds: {c['tuning_vs_oracle']:.2f}"
        + (f"\nthe plan's schedule in one engine (vLLM's per-batch table): {run}" if run else "")
    )


def _main_engine(args, ap) -> int:
    from engine_oracle import run_engine

    if args.out == ap.get_default("out"):
        args.out = ROOT / "bench" / "results" / "decision_quality_vllm.json"
    result = run_and_write(run_engine, args)
    if result is None:
        return 1
    write_table(args, engine_table(result))
    tuning = result["cost"]["tuning_vs_oracle"]
    for figures in ("raw", "scaled"):
        violations = check_bounds(result, min_vs_oracle=0.95, max_median_err_pct=10.0, figures=figures) + (
            [f"tuning cost {tuning:.2f} of the oracle sweep's, above 1/3"]
            if tuning > 1 / 3 and not result.get("headline")  # else the headline's bounds name it
            else []
        )
        print(
            "bounds (plan >= 95% of the vLLM oracle in every bucket, median tokens/s error <= 10%, tuning <= 1/3 of "
            f"the sweep; {figures} figures): " + ("kept" if not violations else "; ".join(violations))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
