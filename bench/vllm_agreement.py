"""Tokens per forward, measured by vLLM and by the torch backend, on the same prompts (greedy, fp32): do they agree?

The torch side replays each drafter exactly on the target's own greedy trajectory (profiles/replay.py, as `profile`
measures acceptance); the vLLM side runs the drafter in vLLM through the package's runner (profiles/vllm_runner.py),
its per-request counters read as the vllm backend reads them. Both count the same rounds: vLLM's first token comes
from the prefill without a draft, so the torch replay starts after the trajectory's first token too, and both emit
exactly N tokens per prompt (no stop token). Target: |vLLM / torch - 1| <= 2% per mechanism. The greedy outputs are
compared token for token as well (the two engines' kernels differ; a near-tie can turn the text).

    SPECDEC_TUNE_VLLM_PYTHON=... python bench/vllm_agreement.py [--prompts 16] [--new-tokens 64] [-D 3]

Writes bench/results/vllm_agreement.json and a table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import tempfile
import time
from pathlib import Path

from specdec_tune.profiles import replay
from specdec_tune.profiles.calibration import select_prompts
from specdec_tune.profiles.drafters import create
from specdec_tune.profiles.models.folders import model_folder
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.models.views import engine_model_view, write_cut_draft
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.specdec import SpecCounters
from specdec_tune.profiles.vllm_engine import VllmEngine
from specdec_tune.vllm_spelling import speculative_config

from common import ROOT, run_and_write, write_table

MECHANISMS = {"ngram": {"prompt_lookup_min": "2", "prompt_lookup_max": "5"}, "draft_model": {}}
TARGET_REL = 0.02


def torch_side(target, drafter, prompts: list[list[int]], trajectories: list[list[int]], D: int, n: int) -> dict:
    """Replayed counters per prompt, from the trajectory's second token on (vLLM's prefill gives the first)."""
    counters = []
    for prompt, g in zip(prompts, trajectories):
        head, rest = list(prompt) + g[:1], g[1:]
        counters += replay.replay(rest, replay.proposer(drafter, head, rest, target.model, D), [D], n - 1, set(), D)
    total = SpecCounters.total(counters)
    return {
        "tokens_per_forward": total.tokens_per_target_forward,
        "rounds": total.num_rounds,
        "tokens": total.num_emitted_tokens,
        "drafts": total.num_drafts,
        "accepted": total.num_accepted_tokens,
    }


def vllm_side(engine: VllmEngine, view: Path, config: dict, prompts: list[list[int]], n: int) -> dict:
    job = {
        "model_dir": str(view),
        "max_num_seqs": len(prompts),
        "speculative_config": config,
        "engine": {"dtype": "float32"},
        "runs": [
            {"name": "agree", "prompts": prompts, "concurrency": len(prompts), "max_tokens": n, "ignore_eos": True}
        ],
    }
    raw = engine.run(job, 1800)
    if not raw.get("ok") or raw["runs"][0].get("error"):
        return {"error": raw.get("error") or raw["runs"][0]["error"]}
    requests = raw["runs"][0]["requests"]
    tokens = sum(len(r["output_ids"]) - 1 for r in requests)
    rounds = sum(r["rounds"] for r in requests)
    accepted = sum(sum((r.get("spec") or {}).get("per_step_accepted", [])) for r in requests)
    return {
        "tokens_per_forward": tokens / rounds,
        "rounds": rounds,
        "tokens": tokens,
        "accepted": accepted,
        "outputs": [r["output_ids"] for r in requests],
        "init_s": raw.get("init_s"),
    }


def run(args) -> dict:
    engine = VllmEngine.locate()
    target = load_model(None, dtype="float32")
    chosen = select_prompts("default", "held_back", args.prompts)
    prompts = encode_prompts(
        target.tokenizer,
        chosen,
        context_tokens=target.model.config.max_position_embeddings,
        max_new_tokens=args.new_tokens,
        max_draft_tokens=args.draft_len,
    )
    t0 = time.perf_counter()
    trajectories = replay.trajectories(target.model, prompts, args.new_tokens, len(prompts))
    trajectory_s = time.perf_counter() - t0
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        view = engine_model_view(model_folder(None)[1], Path(tmp) / "target")
        for name, options in MECHANISMS.items():
            drafter = create(name, target, options)
            model = None
            if name == "draft_model":
                model = str(write_cut_draft(None, len(drafter.model.layers), Path(tmp) / "draft", "float32"))
            t0 = time.perf_counter()
            ours = torch_side(target, drafter, prompts, trajectories, args.draft_len, args.new_tokens)
            ours["s"] = time.perf_counter() - t0 + trajectory_s
            t0 = time.perf_counter()
            theirs = vllm_side(
                engine, view, speculative_config(name, args.draft_len, options, model=model), prompts, args.new_tokens
            )
            theirs["s"] = time.perf_counter() - t0
            if "error" in theirs:
                rows[name] = {"torch": ours, "vllm": theirs, "agrees": None}
                continue
            outputs = theirs.pop("outputs")
            rel = theirs["tokens_per_forward"] / ours["tokens_per_forward"] - 1
            rows[name] = {
                "torch": ours,
                "vllm": theirs,
                "rel_diff": rel,
                "agrees": abs(rel) <= TARGET_REL,
                "identical_outputs": sum(o == g for o, g in zip(outputs, trajectories)),
                "prompts": len(prompts),
            }
    return {
        "source": "measured",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "vllm_version": engine.version,
        "prompts": len(prompts),
        "split": "held_back",
        "new_tokens": args.new_tokens,
        "draft_len": args.draft_len,
        "dtype": "float32",
        "target_rel": TARGET_REL,
        "mechanisms": rows,
        "rounds": "both sides count the decode rounds after the first token (vLLM's prefill emits it without a draft)",
    }


def table(result: dict) -> str:
    lines = [
        f"tokens per forward, torch replay vs vLLM {result['vllm_version']} ({result['prompts']} held-back prompts, "
        f"greedy fp32, D={result['draft_len']}, {result['new_tokens']} tokens)",
        "",
        "| mechanism | torch | vLLM | vLLM / torch - 1 | within 2% | identical outputs | torch s | vLLM s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["mechanisms"].items():
        if r["agrees"] is None:
            lines.append(
                f"| {name} | {r['torch']['tokens_per_forward']:.3f} | vLLM failed: {r['vllm']['error'][:80]} "
                "| | | | | |"
            )
            continue
        lines.append(
            f"| {name} | {r['torch']['tokens_per_forward']:.4f} | {r['vllm']['tokens_per_forward']:.4f} "
            f"| {100 * r['rel_diff']:+.2f}% | {'yes' if r['agrees'] else 'no'} "
            f"| {r['identical_outputs']}/{r['prompts']} | {r['torch']['s']:.0f} | {r['vllm']['s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("-D", "--draft-len", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_agreement.json")
    args = ap.parse_args(argv)
    result = run_and_write(run, args)
    if result is None:
        return 1
    write_table(args, table(result))
    return 0 if all(r["agrees"] for r in result["mechanisms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
