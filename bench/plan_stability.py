"""Do two fresh profiles of the same pair on the same machine give the same plan?

Each profile is searched with the default settings (in memory: nothing is written beside it), and every pair
of plans is compared bucket by bucket. A bucket agrees when both plans take the same drafter and D, or, where
they differ, when the two predictions are apart by less than their stated intervals: the plans' 95% speedup
intervals overlap (speedup, not tokens/s: each profile's device ran at its own speed, and the speedup is relative
to the same profile's plain decoding). Each profile's verify curve is also checked monotone (non-decreasing in
1+D, batch and context), as the search reads it.

    python bench/plan_stability.py --profile A/profile.json --profile B/profile.json [--profile C/profile.json]

Writes bench/results/plan_stability.json and prints a short table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tempfile
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file

from common import ROOT, run_and_write, shown, write_table


def monotone_violations(profile) -> list[str]:
    """Verify cells (the values the search reads) that fall below a neighbour with fewer tokens, rows or context."""
    ms = {(p.batch, p.tokens, p.ctx): p.median_ms for p in profile.verify if p.median_ms is not None}
    batches, ctxs = sorted({k[0] for k in ms}), sorted({k[2] for k in ms})
    before = lambda xs, x: xs[xs.index(x) - 1] if xs.index(x) else None  # noqa: E731
    out = []
    for (B, t, c), v in ms.items():
        for lower in ((B, t - 1, c), (before(batches, B), t, c), (B, t, before(ctxs, c))):
            if lower in ms and v < ms[lower] - 1e-9:
                out.append(f"B={B} 1+D={t} ctx={c}: {v:.2f} ms below {lower}: {ms[lower]:.2f} ms")
    return out


def plan_of(path: Path) -> dict:
    profile = load_profile(path)
    with tempfile.TemporaryDirectory() as tmp:
        plan = search(profile, sha256_file(path), SearchSettings(out_dir=Path(tmp))).to_json()
    name = (
        shown(path)
        if Path(path).resolve().is_relative_to(ROOT)
        else f"{Path(path).resolve().parent.name}/{Path(path).name}"
    )
    return {
        "profile": name,
        "created_at": profile.created_at,
        "prompts": sum(profile.workload.prompts_by_domain.values()),
        "verify_monotone_violations": monotone_violations(profile),
        "mechanism": plan["mechanism"],
        "quant": plan["quant"],
        "buckets": [
            {
                "batch": b["batch"],
                "draft_len": b["draft_len"],
                "speedup": b["predicted"]["speedup"],
                "tokens_per_s": b["predicted"]["tokens_per_s"],
            }
            for b in plan["buckets"]
        ],
    }


def compare(a: dict, b: dict) -> dict:
    rows = []
    for x, y in zip(a["buckets"], b["buckets"]):
        same = (a["mechanism"], a["quant"], x["draft_len"]) == (b["mechanism"], b["quant"], y["draft_len"])
        sx, sy = x["speedup"], y["speedup"]
        overlap = (
            sx["low"] is not None and sy["low"] is not None and max(sx["low"], sy["low"]) <= min(sx["high"], sy["high"])
        )
        rows.append(
            {
                "batch": x["batch"],
                "draft_len": [x["draft_len"], y["draft_len"]],
                "speedup": [sx["value"], sy["value"]],
                "same_setting": same,
                "speedup_intervals_overlap": overlap,
                "agrees": same or overlap,
            }
        )
    return {
        "profiles": [a["profile"], b["profile"]],
        "same_plan": all(r["same_setting"] for r in rows),
        "agrees_in_every_bucket": all(r["agrees"] for r in rows),
        "buckets": rows,
    }


def run(args) -> dict:
    if len(args.profile) < 2:
        raise SpecdecError("plan stability needs at least two profiles", "pass --profile twice or more")
    plans = [plan_of(p) for p in args.profile]
    pairs = [compare(a, b) for a, b in itertools.combinations(plans, 2)]
    return {
        "search": {k: v for k, v in dataclasses.asdict(SearchSettings()).items() if k not in ("out_dir", "storage")},
        "plans": plans,
        "pairs": pairs,
        "summary": {
            "pairs": len(pairs),
            "same_plan": sum(p["same_plan"] for p in pairs),
            "agree_in_every_bucket": sum(p["agrees_in_every_bucket"] for p in pairs),
            "profiles_with_a_non_monotone_verify_curve": sum(bool(p["verify_monotone_violations"]) for p in plans),
        },
    }


def table(result: dict) -> str:
    lines = [
        "| profile | prompts | drafter | D per batch | speedup per batch (95%) | verify monotone |",
        "|---|---|---|---|---|---|",
    ]
    for p in result["plans"]:
        ds = ", ".join(f"{b['batch']}:{b['draft_len']}" for b in p["buckets"])
        ss = ", ".join(
            f"{b['speedup']['value']:.2f} [{b['speedup']['low']:.2f}, {b['speedup']['high']:.2f}]" for b in p["buckets"]
        )
        lines.append(
            f"| {p['profile']} | {p['prompts']} | {p['mechanism']} | {ds} | {ss} | "
            f"{'yes' if not p['verify_monotone_violations'] else len(p['verify_monotone_violations'])} |"
        )
    s = result["summary"]
    lines.append(
        f"\n{s['pairs']} pairs: {s['same_plan']} the same plan, {s['agree_in_every_bucket']} agreeing in every bucket "
        "(same setting, or speedup intervals that overlap)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, action="append", default=[], help="a profile.json (twice or more)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_stability.json")
    args = parser.parse_args()
    result = run_and_write(run, args)
    if result is None:
        raise SystemExit(1)
    write_table(args, table(result))
