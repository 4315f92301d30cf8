"""What the measured refinement prices a group at, against what the loop spends decoding it.

The refinement (pipeline/refine.py) lets contenders in while their first two groups fit its budget, priced before
anything is decoded (`_LoopGroups.group_cost_s`: each batch's prefill, its rounds until the first row is done at the
predicted round time, each contender's warm-up once). This script searches a torch profile's plan (no refinement),
then decodes contenders through the refinement's own group decoder: at every bucket no speculation, the plan's D and
D_max, group by group in a shuffled order, each contender's group timed alone, the first with its warm-up. Both are
given per contender, with the ratio measured / priced; the total is what a budget of that many seconds buys.

    python bench/refine_price.py [--profile bench/results/profile_headline_cpu.json] [--groups 3] [--quick]

Writes bench/results/refine_price.json and a table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.plan import cost_model_of
from specdec_tune.autotune.search import search
from specdec_tune.pipeline.refine import GROUP_DECODERS, _Running
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file
from specdec_tune.settings import RefineSettings, SearchSettings

from common import ROOT, run_and_write, shown, write_table


def run(args) -> dict:
    profile = load_profile(args.profile)
    if profile.backend != "torch":
        raise SpecdecError(f"{args.profile} was measured in {profile.backend}", "pass a profile of this tool's loop")
    with tempfile.TemporaryDirectory() as tmp:
        plan = search(profile, sha256_file(args.profile), SearchSettings(seed=0, out_dir=Path(tmp)))
    cost = cost_model_of(profile, plan)
    s = RefineSettings(group_prompts=args.group_prompts)
    top = min(profile.workload.max_draft_len, cost.draft_len_limit(plan.mechanism))
    keys = [(b.batch, D, "") for b in plan.buckets[: args.buckets] for D in sorted({0, b.draft_len, top})]
    decoder = GROUP_DECODERS[profile.backend]
    timed: dict[tuple, list[float]] = {k: [] for k in keys}
    rng = random.Random(0)
    with decoder(plan, profile, s, keys) as groups:
        for group in range(args.groups):
            for key in rng.sample(keys, len(keys)):
                started = time.perf_counter()
                groups.rates(group, [_Running(None, *key)])  # type: ignore[arg-type]
                timed[key].append(time.perf_counter() - started)
    rows = []
    for key in keys:
        first = decoder.group_cost_s(plan, profile, cost, s, [key], first=True)
        later = decoder.group_cost_s(plan, profile, cost, s, [key])
        measured_later = statistics.median(timed[key][1:])
        rows.append(
            {
                "batch": key[0],
                "draft_len": key[1],
                "priced_first_s": first,
                "measured_first_s": timed[key][0],
                "priced_group_s": later,
                "measured_group_s": measured_later,
                "measured_group_runs_s": timed[key][1:],
                "measured_vs_priced": measured_later / later,
            }
        )
    priced = sum(r["priced_first_s"] + (args.groups - 1) * r["priced_group_s"] for r in rows)
    measured = sum(sum(timed[k]) for k in keys)
    return {
        "source": "measured",
        "profile": shown(args.profile),
        "mechanism": plan.mechanism,
        "ctx": plan.ctx,
        "groups": args.groups,
        "group_prompts": s.group_prompts,
        "new_tokens": s.new_tokens,
        "what": "seconds per contender's group: priced by the refinement before decoding (modeled) and timed in its "
        "group decoder (measured); the later groups' median of measured",
        "contenders": rows,
        "total_priced_s": priced,
        "total_measured_s": measured,
        "total_measured_vs_priced": measured / priced,
    }


def table(r: dict) -> str:
    lines = [
        f"The refinement's price of a group against its decode ({r['mechanism']}, ctx {r['ctx']}, {r['groups']} groups "
        f"of at least {r['group_prompts']} prompts, {r['new_tokens']} tokens; {r['profile']}): all groups priced "
        f"{r['total_priced_s']:.1f} s (modeled), decoded in {r['total_measured_s']:.1f} s (measured), "
        f"ratio {r['total_measured_vs_priced']:.2f}",
        "",
        "| batch | D | first group priced / measured s | later group priced / median measured s | measured / priced |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['batch']} | {c['draft_len']} | {c['priced_first_s']:.2f} / {c['measured_first_s']:.2f} "
        f"| {c['priced_group_s']:.2f} / {c['measured_group_s']:.2f} | {c['measured_vs_priced']:.2f} |"
        for c in r["contenders"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=ROOT / "bench" / "results" / "profile_headline_cpu.json")
    ap.add_argument("--groups", type=int, default=3, help="groups per contender, at least 2")
    ap.add_argument("--group-prompts", type=int, default=RefineSettings.group_prompts)
    ap.add_argument("--buckets", type=int, default=None, help="the plan's first buckets only (default: all)")
    ap.add_argument("--quick", action="store_true", help="the first bucket, 2 groups of 1 prompt")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "refine_price.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.group_prompts, args.buckets = 2, 1, 1
    if args.groups < 2:
        ap.error("--groups must be at least 2: the first group holds the warm-ups")
    result = run_and_write(run, args)
    if result is None:
        return 1
    write_table(args, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
