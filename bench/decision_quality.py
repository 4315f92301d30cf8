"""Decision quality and cost-model fidelity of a tuned plan, measured end to end with the real
speculative loop (never with the cost model), on held-back prompts the profile did not see.

For every batch bucket it decodes at every D in 0..D_max (the oracle sweep) and compares:
  (a) no speculation  (b) the best single D for all buckets, as a hand sweep finds it (measured)
  (c) the engine's usual default K  (d) the tuned plan  (e) the oracle: the best measured D at that bucket
and the cost model's predicted tokens/s and tokens per forward against the measured ones at every point.

    python bench/decision_quality.py                      # demo pair on this machine (about 15 minutes on 2 cores)
    python bench/decision_quality.py --profile P --quick  # a reduced run (the test uses it)

Writes bench/results/decision_quality.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.exporters.validate import DeviceSpeed, context_prompts, measure_decode, plan_drafter
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.records import sha256_file
from specdec_tune.profiles.schema import load_profile

from common import ROOT, counted, run_and_write, shown

# The K engines run when a user sets none or copies the docs' example: vLLM's n-gram and draft-model examples
# use 5; suffix decoding defaults K to its tree depth (24); EAGLE-3 examples use 3; MTP defaults to its layer count (1).
ENGINE_DEFAULT_K = {"ngram": 5, "draft_model": 5, "suffix": 24, "eagle3": 3, "mtp": 1, "dflash": 7, "dspark": 7}


def _rel_err(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def run(args) -> dict:
    profile = load_profile(args.profile)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plan = search(profile, sha256_file(args.profile), SearchSettings(seed=args.seed, out_dir=Path(tmp)))
    search_s = time.perf_counter() - started
    buckets = [b for b in plan["buckets"] if b["batch"] <= args.max_batch]
    d_max = min(args.max_draft_len, profile.workload.max_draft_len)
    mech, quant = plan["mechanism"], plan["quant"]
    cost = CostModel(profile, ctx=plan["ctx"])
    target = load_model(profile.target["path"], dtype=profile.device.get("dtype", "auto"))
    drafter = plan_drafter(plan, profile, target)
    pool = context_prompts(target, plan["ctx"], args.new_tokens, d_max, "held_back")
    if len(pool) < max(args.rows, *(b["batch"] for b in buckets)):
        raise SpecdecError(f"only {len(pool)} held-back prompts reach the context {plan['ctx']}", "use fewer or smaller batches")
    sweep: dict = {}
    speed = DeviceSpeed(target, profile, plan["ctx"], args.seed)
    reused = json.loads(args.reuse_sweep.read_text()) if args.reuse_sweep else None
    measured = {(p["batch"], p["draft_len"]): p for p in reused["sweep"]} if reused else {}

    def oracle_sweep() -> None:
        for b in buckets:
            B = b["batch"]
            for D in range(d_max + 1):
                if (B, D) in measured:  # measured before, by this script: the measurements do not depend on the model
                    old = measured[(B, D)]
                    m = {"tokens_per_s": old["measured_tokens_per_s"], "tokens_per_forward": old["measured_tokens_per_forward"]}
                    ratio = old.get("device_speed_ratio", 1.0)
                else:
                    rows = max(B, args.rows)  # small batches decode several batches, so that AL is not one prompt's
                    # the device's speed against profile time, probed around each point (shared machines drift)
                    m, ratio = speed.measure(lambda: measure_decode(target, drafter, pool[:rows], D, args.new_tokens, args.repeats, args.seed,
                                                                    batch_size=B))
                p = cost.predict(B, D, mech, quant)
                sweep[(B, D)] = {"batch": B, "draft_len": D, "measured_tokens_per_s": m["tokens_per_s"],
                                 "measured_tokens_per_forward": m["tokens_per_forward"], "predicted_tokens_per_s": p.tokens_per_s.value,
                                 "predicted_tokens_per_forward": p.tokens_per_forward.value, "predicted_source": p.tokens_per_s.source,
                                 "device_speed_ratio": ratio, "predicted_at_current_speed_tokens_per_s": p.tokens_per_s.value / ratio}
                print(f"  B={B:3d} D={D:2d}: measured {m['tokens_per_s']:8.1f} tok/s (predicted {p.tokens_per_s.value:8.1f}), "
                      f"tokens/forward {m['tokens_per_forward']:.3f} (predicted {p.tokens_per_forward.value:.3f})", file=sys.stderr, flush=True)

    _, calls, sweep_s = counted(oracle_sweep)
    sweep_forwards = calls[len(target.model.layers)]
    if reused:  # the sweep's cost is the one its measurement took
        sweep_s, sweep_forwards = reused["cost"]["oracle_sweep_s"], reused["cost"]["oracle_sweep_target_forwards"]
    batches = [b["batch"] for b in buckets]
    # decisions are compared at one device speed: each point's measurement scaled to the speed at profile time
    # (the machine drifts by 10-20% over the sweep; points minutes apart would otherwise compare the drift)
    tps = lambda B, D: sweep[(B, D)]["measured_tokens_per_s"] * sweep[(B, D)]["device_speed_ratio"]  # noqa: E731
    single = max(range(d_max + 1), key=lambda D: (statistics.mean(tps(B, D) / tps(B, 0) for B in batches), -D))
    default_k = min(ENGINE_DEFAULT_K.get(mech, 3), d_max)
    rows = []
    for b in buckets:
        B = b["batch"]
        plan_D = min(b["draft_len"], d_max)
        oracle_D = max(range(d_max + 1), key=lambda D: tps(B, D))
        row = {"batch": B, "plan_draft_len": plan_D, "oracle_draft_len": oracle_D, "single_draft_len": single, "default_draft_len": default_k,
               "tokens_per_s": {"no_spec": tps(B, 0), "single_d": tps(B, single), "engine_default": tps(B, default_k), "plan": tps(B, plan_D),
                                "oracle": tps(B, oracle_D)}}
        row["vs_oracle"] = {k: v / row["tokens_per_s"]["oracle"] for k, v in row["tokens_per_s"].items()}
        row["vs_no_spec"] = {k: v / row["tokens_per_s"]["no_spec"] for k, v in row["tokens_per_s"].items()}
        rows.append(row)
    points = list(sweep.values())
    tps_err = [_rel_err(p["predicted_at_current_speed_tokens_per_s"], p["measured_tokens_per_s"]) for p in points]
    raw_err = [_rel_err(p["predicted_tokens_per_s"], p["measured_tokens_per_s"]) for p in points]
    al_err = [_rel_err(p["predicted_tokens_per_forward"], p["measured_tokens_per_forward"]) for p in points]
    plan_points = [sweep[(r["batch"], r["plan_draft_len"])] for r in rows]
    mean_ratio = lambda key: statistics.mean(r["vs_no_spec"][key] for r in rows)  # noqa: E731
    return {
        "source": "measured", "profile": shown(args.profile), "device": profile.device.get("name"), "dtype": profile.device.get("dtype"),
        "mechanism": mech, "quant": quant, "ctx": plan["ctx"], "split": "held_back", "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": args.rows,
        "max_draft_len": d_max, "engine_default_k": default_k, "best_single_draft_len_measured": single,
        "plan_schedule": [[b["batch"], b["draft_len"]] for b in buckets], "buckets": rows, "sweep": points,
        "measured_rounds": "rounds with every row of the batch decoding (a continuously batched server's steady state)",
        "fidelity": {"tokens_per_s_median_err_pct": 100 * statistics.median(tps_err), "tokens_per_s_worst_err_pct": 100 * max(tps_err),
                     "unscaled_tokens_per_s_median_err_pct": 100 * statistics.median(raw_err), "unscaled_tokens_per_s_worst_err_pct": 100 * max(raw_err),
                     "device_speed_ratio_range": [min(p["device_speed_ratio"] for p in points), max(p["device_speed_ratio"] for p in points)],
                     "tokens_per_forward_median_err_pct": 100 * statistics.median(al_err), "tokens_per_forward_worst_err_pct": 100 * max(al_err),
                     "plan_tokens_per_s_err_pct": [100 * _rel_err(p["predicted_at_current_speed_tokens_per_s"], p["measured_tokens_per_s"])
                                                   for p in plan_points]},
        "targets": {"plan_min_vs_oracle": min(r["vs_oracle"]["plan"] for r in rows), "plan_mean_speedup": mean_ratio("plan"),
                    "single_d_mean_speedup": mean_ratio("single_d"), "plan_beats_single_d": mean_ratio("plan") > mean_ratio("single_d")},
        "sweep_reused_from": shown(args.reuse_sweep),
        "cost": {"search_s": search_s, "oracle_sweep_s": sweep_s, "oracle_sweep_target_forwards": sweep_forwards},
    }


def table(result: dict) -> str:
    lines = [f"decision quality (measured decode tokens/s at the profile's device speed; predictions from the cost model): {result['mechanism']} on {result['device']} ({result['dtype']}), held-back prompts, ctx {result['ctx']}, "
             f"{result['new_tokens']} new tokens, at least {result['rows']} prompts per point, median of {result['repeats']} after a warm-up",
             "| batch | plan D | oracle D | no spec | single D | engine default | plan | oracle | plan / oracle | plan / no spec |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["buckets"]:
        t = r["tokens_per_s"]
        lines.append(f"| {r['batch']} | {r['plan_draft_len']} | {r['oracle_draft_len']} | {t['no_spec']:.0f} | {t['single_d']:.0f} (D={r['single_draft_len']}) | "
                     f"{t['engine_default']:.0f} (D={r['default_draft_len']}) | {t['plan']:.0f} | {t['oracle']:.0f} | {r['vs_oracle']['plan']:.3f} | "
                     f"{r['vs_no_spec']['plan']:.3f} |")
    f, g = result["fidelity"], result["targets"]
    lo, hi = f["device_speed_ratio_range"]
    lines += ["", f"cost model vs measured over {len(result['sweep'])} points: tokens/s median {f['tokens_per_s_median_err_pct']:.1f}% "
              f"(worst {f['tokens_per_s_worst_err_pct']:.1f}%) with predictions scaled by the device's speed now against profile time "
              f"(x{1 / hi:.3f} to x{1 / lo:.3f}; unscaled median {f['unscaled_tokens_per_s_median_err_pct']:.1f}%, worst "
              f"{f['unscaled_tokens_per_s_worst_err_pct']:.1f}%), tokens per forward median {f['tokens_per_forward_median_err_pct']:.1f}% "
              f"(worst {f['tokens_per_forward_worst_err_pct']:.1f}%)",
              f"plan at least {100 * g['plan_min_vs_oracle']:.1f}% of the oracle in every bucket; mean speedup plan {g['plan_mean_speedup']:.3f}x "
              f"vs best single D {g['single_d_mean_speedup']:.3f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=ROOT / "tests" / "data" / "demo_profile.json")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decision_quality.json")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8, help="prompts decoded per point at least (in batches of the bucket's size)")
    ap.add_argument("--max-batch", type=int, default=1 << 30)
    ap.add_argument("--max-draft-len", type=int, default=1 << 30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse-sweep", type=Path, default=None, help="take the measured points from an earlier result of this script "
                    "(same profile, prompts and settings) and recompute the plan and the predictions")
    ap.add_argument("--quick", action="store_true", help="batches up to 2, D up to 2, 8 tokens, 1 repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_batch, args.max_draft_len, args.new_tokens, args.repeats, args.rows = 2, 2, 8, 1, 2
    result = run_and_write(run, args)
    if result is None:
        return 1
    text = table(result)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
