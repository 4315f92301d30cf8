"""What tuning costs: wall time and model forwards of `profile` + `search`, against the oracle sweep
that bench/decision_quality.py runs (every mechanism and D at every bucket, measured end to end).

Forwards are counted the same way in both (common.py, ForwardCounter): every pass of the full-depth
target is one target forward; the drafters' passes are counted apart, per mechanism: a shallower
CausalLM is the draft model, a learned head's step or block pass is that head's (FORWARDS_COUNTED
says what one forward of each kind is; n-gram and suffix drafters run no network).

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
from specdec_tune.profiles.torch_profile import TorchProfiler
from specdec_tune.records import sha256_file
from specdec_tune.settings import ProfileSettings

from common import FORWARDS_COUNTED, ROOT, counted, run_and_write

# Drafters that run a network of their own, whose forwards a profile of them must have counted.
NETWORK_DRAFTERS = ("draft_model", "eagle3", "mtp", "dflash", "dspark")


def oracle_cost(oracle: dict, path: Path) -> dict:
    """What decision_quality's oracle sweep cost, and what it swept (a result from before every mechanism was swept
    records no oracle_kind: it swept the plan's mechanism alone)."""
    return {
        "from": str(path.relative_to(ROOT)),
        "oracle_kind": oracle.get("oracle_kind", "D-only (plan's mechanism)"),
        "mechanisms": list(oracle.get("mechanisms_swept", [oracle["mechanism"]])),
        "wall_s": oracle["cost"]["oracle_sweep_s"],
        "target_forwards": oracle["cost"]["oracle_sweep_target_forwards"],
        "drafter_forwards": oracle["cost"].get("oracle_sweep_drafter_forwards", "not counted"),
        "points": len(oracle["sweep"]),
        "repeats": oracle["repeats"] + 1,
        "new_tokens": oracle["new_tokens"],
    }


def check_bounds(result: dict) -> list[str]:
    """What breaks the bounds of an honest tuning-cost figure; one line per violation, [] when none.

    - the counting saw the target run, and saw every profiled drafter that has a network run;
    - with an oracle sweep at hand (a full run: the quick profile has none of the same size to compare with),
      profile + search took fewer target forwards than the oracle sweep, which is what tuning ahead of time is for.
    """
    out = []
    if result["target_forwards"] <= 0:
        out.append("no target forward was counted: the counter missed the profile's model")
    out += [
        f"drafter {name}: no forward counted, though the profile ran it"
        for name in result["drafters"]
        if name in NETWORK_DRAFTERS and not result["drafter_forwards"].get(name)
    ]
    oracle = result.get("oracle")
    if oracle and result["target_forwards"] >= oracle["target_forwards"]:
        out.append(
            f"profile + search took {result['target_forwards']} target forwards, not below the oracle sweep's "
            f"{oracle['target_forwards']} ({oracle['from']})"
        )
    return out


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        settings = ProfileSettings(out_dir=folder / "profile", force=True, **args.profile_overrides)
        profile, counter, profile_s = counted(lambda: TorchProfiler(settings).run())
        t0 = time.perf_counter()
        search(profile, sha256_file(folder / "profile" / "profile.json"), SearchSettings(seed=0, out_dir=folder))
        search_s = time.perf_counter() - t0
    result = {
        "source": "measured",
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in args.profile_overrides.items()},
        "profile_s": profile_s,
        "search_s": search_s,
        "drafters": [d.name for d in profile.drafters],
        **counter.summary(profile.target["num_layers"]),
        "forwards_counted": FORWARDS_COUNTED,
        "device": profile.device.get("name"),
        "dtype": profile.device.get("dtype"),
        "acceptance_prompts": max(
            (a.prompts for a in profile.acceptance if a.domain == "all" and a.temperature == 0), default=0
        ),
        "phase_s": profile.phase_s,
        "phases_skipped": [n for n in profile.notes if n.startswith("phase skipped")],
    }
    oracle_path = ROOT / "bench" / "results" / "decision_quality.json"
    if oracle_path.exists() and not args.quick:
        result["oracle"] = oracle_cost(json.loads(oracle_path.read_text()), oracle_path)
        result["forwards_ratio"] = result["target_forwards"] / result["oracle"]["target_forwards"]
        result["wall_ratio"] = (profile_s + search_s) / result["oracle"]["wall_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tuning_cost.json")
    ap.add_argument(
        "--keep", type=Path, default=None, help="keep profile/profile.json, plan.json and the study under this folder"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a reduced profile: ngram only, batches 1-2, D_max 2, one HumanEval prompt, an 18-second budget",
    )
    args = ap.parse_args(argv)
    args.profile_overrides = (
        {
            "drafters": ("ngram",),
            "prompts": "humaneval",
            "batch_buckets": (1, 2),
            "ctx_buckets": (64,),
            "max_draft_len": 2,
            "prompts_per_domain": 1,
            "new_tokens": 8,
            "temperatures": (0.0,),
            "quant_formats": (),
            "acceptance_batch": 1,
            "budget_minutes": 0.3,
        }
        if args.quick
        else {}
    )
    result = run_and_write(run, args)
    if result is None:
        return 1
    drafters = ", ".join(f"{k} {n}" for k, n in result["drafter_forwards"].items()) or "none ran a network"
    line = (
        f"measured: profile {result['profile_s']:.0f} s ({result['acceptance_prompts']} greedy acceptance prompts, "
        f"{len(result['phases_skipped'])} phases skipped) + search {result['search_s']:.1f} s, "
        f"{result['target_forwards']} target forwards "
        f"(drafter forwards: {drafters})"
    )
    if "oracle" in result:
        o = result["oracle"]
        line += (
            f"; oracle sweep ({o['oracle_kind']}: {', '.join(o['mechanisms'])}) {o['wall_s']:.0f} s, "
            f"{o['target_forwards']} target forwards: "
            f"ratio {result['forwards_ratio']:.2f} (forwards), {result['wall_ratio']:.2f} (wall)"
        )
    print(line)
    violations = check_bounds(result)
    print("bounds: " + ("kept" if not violations else "; ".join(violations)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
