"""The learned heads on the demo target: learning curves, AL per domain, per-position acceptance, draft time against D.

Reads what `specdec-tune train-drafter` recorded beside each cached demo head (training.json: AL measured on held-back
MT-Bench prompts at points along the run) and, when given, a profile with the heads in it (their measured draft-time
curves). Fits AL = a + b·ln(training tokens) to each curve to say how many tokens (and how long at the run's own
throughput) AL would need to reach the target: that figure is an extrapolation and labelled modeled.

    python bench/learned_heads.py [--profile artifacts/profile-learned/profile.json] [--target-al 1.6]
                                  [--out bench/results/learned_heads.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MECHANISMS = ("eagle3", "mtp", "dflash", "dspark")


def training_records(target_name: str) -> dict[str, dict]:
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.train_drafter import TrainSettings, demo_head_folder

    target = load_model(target_name, dtype="float32")
    out = {}
    for m in MECHANISMS:
        path = demo_head_folder(TrainSettings(mechanism=m, target=target.ref.path), target) / "training.json"
        if path.is_file():
            out[m] = json.loads(path.read_text())
    return out


def extrapolate(curve: list[dict], target_al: float, tokens_per_s: float) -> dict:
    """Least-squares AL = a + b ln(tokens) over the curve; the tokens (and training time) where it reaches target_al."""
    xs = [math.log(p["training_tokens"]) for p in curve]
    ys = [p["tokens_per_forward"] for p in curve]
    if len(xs) < 2 or max(xs) == min(xs):
        return {"source": "modeled", "note": "fewer than two curve points"}
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if b <= 0:
        return {
            "source": "modeled",
            "slope_per_ln_token": b,
            "note": "AL does not grow with training tokens on this curve",
        }
    tokens = math.exp((target_al - a) / b)
    return {
        "source": "modeled",
        "fit": "AL = a + b ln(tokens)",
        "a": a,
        "b": b,
        "target_al": target_al,
        "tokens_needed": tokens,
        "train_hours_at_run_throughput": tokens / tokens_per_s / 3600,
    }


def draft_curves(profile_path: Path) -> dict:
    """Measured draft time (median ms) against D at batch 1 and the largest batch, per learned mechanism in the
    profile."""
    profile = json.loads(profile_path.read_text())
    out: dict = {}
    for p in profile["draft"]:
        if p["mechanism"] in MECHANISMS and p["quant"] == "none" and p["median_ms"] is not None:
            out.setdefault(p["mechanism"], {}).setdefault(str(p["batch"]), {})[str(p["draft_len"])] = {
                "median_ms": p["median_ms"],
                "source": p["source"],
            }
    for _m, by_batch in out.items():
        for _b, curve in by_batch.items():
            d = sorted(curve, key=int)
            curve["ratio_last_to_first"] = curve[d[-1]]["median_ms"] / curve[d[0]]["median_ms"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--profile", type=Path, default=None, help="A profile with the learned heads (their draft-time curves)."
    )
    ap.add_argument("--target-al", type=float, default=1.6)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "learned_heads.json")
    args = ap.parse_args()
    records = training_records(args.target)
    if not records:
        print(
            "no trained demo heads yet: run specdec-tune train-drafter --mechanism eagle3 (mtp, dflash, dspark) first",
            file=sys.stderr,
        )
        return 2
    heads = {}
    lines = [
        "learned heads on the demo target: AL on held-back MT-Bench prompts and draft times measured; the budget to "
        "the target AL modeled (an extrapolation of each curve)",
        "",
        "| head | D | training tokens | train s | tokens/forward | mean AL (vLLM) | per-position acceptance |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in records.items():
        curve = r["learning_curve"]
        tps = r["train"]["training_tokens"] / max(r["train"]["train_s"], 1e-9)
        heads[m] = {
            "settings": r["settings"],
            "data": r["data"],
            "train": r["train"],
            "learning_curve": curve,
            "extrapolation": extrapolate(curve, args.target_al, tps) if curve else None,
        }
        for p in curve:
            lines.append(
                f"| {m} | {p['draft_len']} | {p['training_tokens']:,} | {p['train_s']:.0f} "
                f"| {p['tokens_per_forward']:.3f} | "
                f"{p['mean_al_vllm']:.3f} | {' '.join(f'{a:.2f}' for a in p.get('per_position_acceptance', []))} |"
            )
    lines += ["", "| head | domain | prompts | tokens/forward | per-position acceptance |", "|---|---|---|---|---|"]
    for m, h in heads.items():
        last = h["learning_curve"][-1] if h["learning_curve"] else {}
        for d, r in last.get("by_domain", {}).items():
            lines.append(
                f"| {m} | {d} | {r['prompts']} | {r['tokens_per_forward']:.3f} "
                f"| {' '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} |"
            )
    lines += [
        "",
        f"| head | AL {args.target_al} needs (modeled: AL = a + b ln tokens) | at the run's throughput |",
        "|---|---|---|",
    ]
    for m, h in heads.items():
        e = h["extrapolation"] or {}
        if "tokens_needed" in e:
            lines.append(
                f"| {m} | {e['tokens_needed']:.3g} tokens | {e['train_hours_at_run_throughput']:.3g} h on this CPU |"
            )
        else:
            lines.append(f"| {m} | {e.get('note', '-')} | - |")
    record = {
        "schema": "specdec-tune/learned-heads/1",
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": "measured (learning curves, AL, draft times); modeled (extrapolation)",
        "target": args.target,
        "heads": heads,
    }
    if args.profile is not None:
        curves = draft_curves(args.profile)
        record["draft_ms"] = curves
        lines += [
            "",
            "| head | batch | draft ms by D (measured; the profile JSON labels each point) | last D / first D |",
            "|---|---|---|---|",
        ]
        for m, by_batch in curves.items():
            for b, c in by_batch.items():
                ds = sorted((k for k in c if k.isdigit()), key=int)
                times = ", ".join(f"D={d}: {c[d]['median_ms']:.2f}" for d in ds)
                lines.append(f"| {m} | {b} | {times} | {c['ratio_last_to_first']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
