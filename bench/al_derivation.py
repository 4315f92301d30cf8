"""AL(D) derived from one run at D_max, against AL measured directly at every D, on the same prompts.

The derivation (profiles/specdec.py, `derived_at`) is exact for greedy chain drafters whose k-th
proposal does not depend on D; this measures how close it is for the drafters as they run.

    python bench/al_derivation.py             # ngram and suffix on the demo target, D_max 15 (about 8 minutes)
    python bench/al_derivation.py --quick     # D_max 3, 1 prompt per domain, 8 tokens (the test uses it)

Writes bench/results/al_derivation.json and prints a short table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from specdec_tune.profiles.specdec import SpecCounters
from specdec_tune.profiles.store import MeasurementLog
from specdec_tune.profiles.torch_profile import TorchProfiler
from specdec_tune.settings import ProfileSettings

from common import ROOT, run_and_write


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        settings = ProfileSettings(
            drafters=tuple(args.drafter),
            prompts_per_domain=args.prompts_per_domain,
            new_tokens=args.new_tokens,
            max_draft_len=args.max_draft_len,
            dtype="float32",
            out_dir=Path(tmp),
            batch_buckets=(1,),
        )
        profiler = TorchProfiler(settings)
        log = MeasurementLog(Path(tmp), "al-derivation")
        out = {}
        for name, drafter in profiler.drafters.items():
            base = SpecCounters.total(profiler.run_counters(drafter, args.max_draft_len, 0.0, log, f"{name}/max"))
            rows = []
            for D in range(1, args.max_draft_len):
                direct = SpecCounters.total(
                    profiler.run_counters(drafter, D, 0.0, log, f"{name}/{D}")
                ).tokens_per_target_forward
                derived = base.derived_at(D)[0]
                rows.append(
                    {
                        "draft_len": D,
                        "derived": derived,
                        "direct": direct,
                        "rel_diff_pct": 100 * (derived - direct) / direct,
                    }
                )
                print(f"  {name} D={D}: derived {derived:.4f} direct {direct:.4f}", file=sys.stderr, flush=True)
            diffs = [abs(r["rel_diff_pct"]) for r in rows]
            out[name] = {
                "at_max": base.tokens_per_target_forward,
                "rows": rows,
                "median_abs_diff_pct": statistics.median(diffs),
                "worst_abs_diff_pct": max(diffs),
            }
    return {
        "source": "measured",
        "dtype": "float32",
        "temperature": 0.0,
        "max_draft_len": args.max_draft_len,
        "prompts": f"{args.prompts_per_domain} per domain, profile split",
        "new_tokens": args.new_tokens,
        "drafters": out,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", action="append", default=None)
    ap.add_argument("--max-draft-len", type=int, default=15)
    ap.add_argument("--prompts-per-domain", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "al_derivation.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    args.drafter = args.drafter or ["ngram", "suffix"]
    if args.quick:
        args.max_draft_len, args.prompts_per_domain, args.new_tokens, args.drafter = 3, 1, 8, ["ngram"]
    result = run_and_write(run, args)
    if result is None:
        return 1
    for name, r in result["drafters"].items():
        print(
            f"{name}: derived (from the measured D_max run) vs directly measured tokens per forward over "
            f"D=1..{args.max_draft_len - 1}: median {r['median_abs_diff_pct']:.2f}%, "
            f"worst {r['worst_abs_diff_pct']:.2f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
