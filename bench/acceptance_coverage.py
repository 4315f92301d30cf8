"""Coverage of the profile's acceptance intervals by held-back prompts.

For every greedy acceptance record of a profile (mechanism x domain, unquantized weights) and every D = 1..D_max,
the held-back prompts of that domain (the split a profile never reads) are replayed (profiles/replay.py: the
loop's counters, checked equal in fp32 by the profile) in the profile's dtype, and their tokens per forward is
compared with the profile's 95% interval. `all` mixes the domains as the profile does (equal request shares).

The held-back figure is itself an estimate from a few prompts (MT-Bench holds back 3 per domain): it is written
with its own 95% bootstrap interval, and a cell outside the profile's interval whose two intervals overlap is
counted apart ("outside, intervals overlap") from one where they do not. For the same reason even a perfectly
calibrated 95% interval of the mean covers a held-back mean of m prompts less often than 95%: with n profile
prompts, held-back minus profile mean has n/m + 1 times the profile mean's variance, so the chance it lands inside
is erf(1.96 / sqrt(2 (1 + n/m))) (72% for n = 7, m = 3). The table gives that expected coverage beside the measured.

A second check needs no held-back prompts: the largest domain's profiling prompts (HumanEval: 123) stand in for the
population; `SUBSAMPLES` draws of n of them (without replacement) each get their interval the profile's way (percentile
bootstrap, plain and widened for n: `intervals.widening`), and the share of draws whose interval holds the whole
domain's tokens per forward is that interval's coverage on real per-prompt spreads (n = 7, as an MT-Bench category, and
20).

    python bench/acceptance_coverage.py                      # artifacts/profile/profile.json, every held-back prompt
    python bench/acceptance_coverage.py --profile P --quick  # 1 held-back prompt per domain, D up to 3

Writes bench/results/acceptance_coverage.json and prints a short table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from specdec_tune import SpecdecError
from specdec_tune.pipeline.lossless import profile_drafter
from specdec_tune.profiles import intervals, replay
from specdec_tune.profiles.calibration import CalibrationSet, load_calibration
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file

from common import ROOT, counted, run_and_write, shown, write_table

RESAMPLES = 1000
SUBSAMPLES = 300
SUBSAMPLE_SIZES = (7, 20)


def held_back(profile, per_domain: int | None) -> CalibrationSet:
    """The held-back split of the profile's calibration set (refused when the set changed since the profile)."""
    calibration = load_calibration(profile.workload.calibration)
    pool, held = calibration.split()
    if pool.fingerprint() != profile.workload.calibration_fingerprint:
        raise SpecdecError(
            f"the calibration set {profile.workload.calibration!r} is not the one this profile read",
            "profile again with the installed calibration prompts",
        )
    return held.per_domain(len(held.prompts) if per_domain is None else per_domain)


def calibrated_coverage(profile_prompts: int, held_back_prompts: int, z: float = 1.96) -> float:
    """The chance that a held-back mean of m prompts lands inside a calibrated 95% interval of the mean of n profile
    prompts (same per-prompt spread): P(|Z| sqrt(1/n + 1/m) < z sqrt(1/n)) = erf(z / sqrt(2 (1 + n/m)))."""
    return math.erf(z / math.sqrt(2 * (1 + profile_prompts / held_back_prompts)))


def subsample_coverage(profile, draft_len: int, seed: int, draws: int = SUBSAMPLES) -> list[dict]:
    """The second check of the module docstring, per greedy mechanism, on the domain with the most profiling prompts."""
    out = []
    for a in profile.acceptance:
        if a.domain != "all" or a.quant != "none" or a.temperature != 0.0 or a.per_prompt is None:
            continue
        domains = np.asarray(a.per_prompt.domains)
        largest = max(dict.fromkeys(domains.tolist()), key=lambda d: int((domains == d).sum()))
        rows = np.flatnonzero(domains == largest)
        sums = {
            k: np.asarray(getattr(a.per_prompt, k), dtype=float)[rows]
            for k in ("emitted", "rounds", "accepted", "drafts")
        }
        D = min(draft_len, a.max_draft_len)
        truth = float(sums["emitted"][:, D].sum() / sums["rounds"][:, D].sum())
        rng = np.random.default_rng(seed)
        for n in (n for n in SUBSAMPLE_SIZES if n < len(rows) // 2):
            inside = {"plain": 0, "widened": 0}
            factor = intervals.widening([largest] * n, {largest: 1.0})
            for t in range(draws):
                pick = rng.choice(len(rows), n, replace=False)
                drawn = {k: v[pick] for k, v in sums.items()}
                point, _ = intervals.figures(drawn, [largest] * n, {largest: 1.0})
                resampled, _ = intervals.draws(
                    drawn, [largest] * n, {largest: 1.0}, resamples=RESAMPLES // 2, seed=seed + t
                )
                for name, f in (("plain", 1.0), ("widened", factor)):
                    low, high = intervals.widened(point, resampled, f)[D]
                    inside[name] += low <= truth <= high
            out.append(
                {
                    "mechanism": a.mechanism,
                    "domain": largest,
                    "population_prompts": len(rows),
                    "prompts": n,
                    "draft_len": D,
                    "draws": draws,
                    "widening": factor,
                    **{f"coverage_{k}": v / draws for k, v in inside.items()},
                }
            )
    return out


def run(args) -> dict:
    profile = load_profile(args.profile)
    wl = profile.workload
    records = [a for a in profile.acceptance if a.quant == "none" and a.temperature == 0.0 and a.tokens_per_forward_ci]
    if not records:
        raise SpecdecError(
            "the profile has no greedy acceptance record with intervals", "profile again with this version"
        )
    target = load_model(profile.target["path"], dtype=profile.device.get("dtype", "auto"))
    prompts = held_back(profile, 1 if args.quick else args.prompts_per_domain)
    ids = encode_prompts(
        target.tokenizer,
        prompts,
        context_tokens=target.model.config.max_position_embeddings,
        max_new_tokens=wl.new_tokens,
        max_draft_tokens=wl.max_draft_len,
    )
    domains = [p.domain for p in prompts.prompts]
    stop = set(target.model.config.eos_token_ids)

    def replay_all() -> dict[str, list]:
        trajectories = replay.trajectories(target.model, ids, wl.new_tokens, wl.acceptance_batch)
        out = {}
        for mechanism in dict.fromkeys(a.mechanism for a in records):
            drafter = profile_drafter(profile, mechanism, "none", target)
            d_max = next(a.max_draft_len for a in records if a.mechanism == mechanism)
            out[mechanism] = [
                replay.replay(
                    t,
                    replay.proposer(drafter, p, t, target.model, d_max),
                    range(1, d_max + 1),
                    wl.new_tokens,
                    stop,
                    d_max,
                )
                for p, t in zip(ids, trajectories)
            ]
            print(f"  replayed {mechanism} on {len(ids)} held-back prompts", file=sys.stderr, flush=True)
        return out

    replayed, count, seconds = counted(replay_all)
    cells = []
    for a in records:
        rows = [i for i, d in enumerate(domains) if a.domain in ("all", d)]
        if not rows:
            continue
        sums = replay.per_prompt_rates([replayed[a.mechanism][i] for i in rows])
        weights = {d: 1.0 for d in wl.domains} if a.domain == "all" else {a.domain: 1.0}
        tpf, _, tpf_ci, _ = intervals.figures(
            sums, [domains[i] for i in rows], weights, resamples=RESAMPLES, seed=args.seed
        )
        for D in range(1, min(a.max_draft_len, args.max_draft_len) + 1):
            lo, hi = a.tokens_per_forward_ci[D]
            x, (x_lo, x_hi) = float(tpf[D]), (float(tpf_ci[D][0]), float(tpf_ci[D][1]))
            cells.append(
                {
                    "mechanism": a.mechanism,
                    "domain": a.domain,
                    "draft_len": D,
                    "profile_prompts": a.prompts,
                    "held_back_prompts": len(rows),
                    "profile_tokens_per_forward": a.tokens_per_forward[D],
                    "profile_ci": [lo, hi],
                    "held_back_tokens_per_forward": x,
                    "held_back_ci": [x_lo, x_hi],
                    "inside": lo <= x <= hi,
                    "intervals_overlap": x_lo <= hi and lo <= x_hi,
                }
            )
    by_domain = [c for c in cells if c["domain"] != "all"]
    for c in cells:
        c["coverage_if_calibrated"] = calibrated_coverage(c["profile_prompts"], c["held_back_prompts"])
    return {
        "source": "measured",
        "profile": shown(args.profile),
        "profile_sha256": sha256_file(args.profile),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "method": "replay (greedy), the profile's new_tokens and stop tokens",
        "held_back_prompts": len(ids),
        "prompts_by_domain": {d: domains.count(d) for d in dict.fromkeys(domains)},
        "coverage_domain_cells": sum(c["inside"] for c in by_domain) / max(1, len(by_domain)),
        "domain_cells": len(by_domain),
        "outside_but_overlapping": sum(not c["inside"] and c["intervals_overlap"] for c in by_domain),
        "coverage_domain_cells_if_calibrated": sum(c["coverage_if_calibrated"] for c in by_domain)
        / max(1, len(by_domain)),
        "coverage_all_cells": sum(c["inside"] for c in cells) / max(1, len(cells)),
        "held_back_above_profile": sum(
            c["held_back_tokens_per_forward"] > c["profile_tokens_per_forward"] for c in by_domain
        ),
        "wall_s": seconds,
        **count.summary(target.model.config.num_layers),
        "cells": cells,
        "subsample_coverage": subsample_coverage(profile, 3, args.seed, 30 if args.quick else SUBSAMPLES),
    }


def table(r: dict) -> str:
    expected = r.get("coverage_domain_cells_if_calibrated")
    lines = [
        f"held-back tokens per forward inside the profile's 95% interval: {r['coverage_domain_cells']:.1%} of "
        f"{r['domain_cells']} domain x D cells ({r['outside_but_overlapping']} more outside but with overlapping "
        "intervals"
        + (
            f"; a calibrated interval of the mean would cover {expected:.1%} of them at these prompt counts"
            if expected is not None
            else ""
        )
        + "); 'all': "
        f"{r['coverage_all_cells']:.1%} of every cell; held-back above the profile in "
        f"{r['held_back_above_profile']} domain cells ({r['held_back_prompts']} held-back prompts, {r['dtype']}, "
        f"measured by replay in {r['wall_s']:.0f} s)",
        "| mechanism | domain | cells inside | worst D (held-back vs profile interval) |",
        "|---|---|---|---|",
    ]
    tail = [
        f"subsamples of {c['prompts']} of the {c['population_prompts']} {c['domain']} prompts, {c['mechanism']} at "
        f"D={c['draft_len']}: the interval holds the domain's tokens per forward in {c['coverage_plain']:.1%} of "
        f"{c['draws']} draws as a plain percentile interval, {c['coverage_widened']:.1%} widened (x{c['widening']:.2f})"
        for c in r.get("subsample_coverage", [])
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in r["cells"]:
        groups.setdefault((c["mechanism"], c["domain"]), []).append(c)
    for (m, d), cs in groups.items():
        worst = max(
            cs,
            key=lambda c: max(
                c["profile_ci"][0] - c["held_back_tokens_per_forward"],
                c["held_back_tokens_per_forward"] - c["profile_ci"][1],
            ),
        )
        lines.append(
            f"| {m} | {d} | {sum(c['inside'] for c in cs)}/{len(cs)} | "
            f"D={worst['draft_len']}: {worst['held_back_tokens_per_forward']:.3f} "
            f"vs [{worst['profile_ci'][0]:.3f}, {worst['profile_ci'][1]:.3f}] |"
        )
    return "\n".join(lines + [""] + tail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=Path("artifacts/profile/profile.json"))
    ap.add_argument(
        "--prompts-per-domain", type=int, default=None, help="held-back prompts per domain (default: all of them)"
    )
    ap.add_argument("--max-draft-len", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "acceptance_coverage.json")
    ap.add_argument("--quick", action="store_true", help="1 held-back prompt per domain, D up to 3")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_draft_len = 3
    result = run_and_write(run, args)
    if result is None:
        return 1
    write_table(args, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
