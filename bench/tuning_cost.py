"""What tuning costs: wall time and target forwards of `profile` + `search`, against the oracle sweep
that bench/decision_quality.py runs (every D at every bucket, measured end to end).

Target forwards are counted the same way in both (common.py): every call on the full-depth
target is one forward; drafter forwards on a truncated copy are counted apart.

    python bench/tuning_cost.py                 # the default demo profile on this machine (about 10 minutes)
    python bench/tuning_cost.py --quick         # a reduced profile (the test uses it)

Writes bench/results/tuning_cost.json and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.profiles.profiler import Profiler, ProfileSettings
from specdec_tune.profiles.records import sha256_file

from common import ROOT, counted, run_and_write



def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        settings = ProfileSettings(out_dir=folder / "profile", force=True, **args.profile_overrides)
        profile, calls, profile_s = counted(lambda: Profiler(settings).run())
        target_layers = profile.target["num_layers"]
        t0 = time.perf_counter()
        search(profile, sha256_file(folder / "profile" / "profile.json"), SearchSettings(seed=0, out_dir=folder))
        search_s = time.perf_counter() - t0
    result = {"source": "measured", "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in args.profile_overrides.items()},
              "profile_s": profile_s, "search_s": search_s, "target_forwards": calls[target_layers],
              "drafter_forwards": sum(n for layers, n in calls.items() if layers != target_layers),
              "device": profile.device.get("name"), "dtype": profile.device.get("dtype")}
    oracle_path = ROOT / "bench" / "results" / "decision_quality.json"
    if oracle_path.exists() and not args.quick:
        oracle = json.loads(oracle_path.read_text())
        result["oracle"] = {"from": str(oracle_path.relative_to(ROOT)), "wall_s": oracle["cost"]["oracle_sweep_s"],
                            "target_forwards": oracle["cost"]["oracle_sweep_target_forwards"], "points": len(oracle["sweep"]),
                            "repeats": oracle["repeats"] + 1, "new_tokens": oracle["new_tokens"]}
        result["forwards_ratio"] = result["target_forwards"] / result["oracle"]["target_forwards"]
        result["wall_ratio"] = (profile_s + search_s) / result["oracle"]["wall_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tuning_cost.json")
    ap.add_argument("--keep", type=Path, default=None, help="keep profile/profile.json, plan.json and the study under this folder")
    ap.add_argument("--quick", action="store_true", help="a reduced profile: ngram only, batches 1-2, D_max 2, one HumanEval prompt, a 1-minute budget")
    args = ap.parse_args(argv)
    args.profile_overrides = ({"drafters": ("ngram",), "prompts": "humaneval", "batch_buckets": (1, 2), "ctx_buckets": (64,), "max_draft_len": 2,
                               "prompts_per_domain": 1, "new_tokens": 8, "temperatures": (0.0,), "quant_formats": (), "acceptance_batch": 1,
                               "budget_minutes": 1.0}
                              if args.quick else {})
    result = run_and_write(run, args)
    if result is None:
        return 1
    line = (f"measured: profile {result['profile_s']:.0f} s + search {result['search_s']:.1f} s, {result['target_forwards']} target forwards "
            f"({result['drafter_forwards']} drafter forwards)")
    if "oracle" in result:
        line += (f"; oracle sweep {result['oracle']['wall_s']:.0f} s, {result['oracle']['target_forwards']} target forwards: "
                 f"ratio {result['forwards_ratio']:.2f} (forwards), {result['wall_ratio']:.2f} (wall)")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
