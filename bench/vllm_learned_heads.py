"""Learned heads run inside vLLM: a head folder written by this tool, with the speculative config as the bundle writes
it, decoding held-back demo prompts (SmolLM2-135M, fp32, greedy) in vLLM and in this tool's own decode loop.

Per mechanism:
  head      the demo target's head, trained here with short settings (TRAINING; cached by its settings like the
            demo head, reused by later runs) or, with --random-heads and for DSpark, deterministic random weights
            (seed 0): vLLM's own loader checks the folder first (exporters/vllm_head_check.py)
  vLLM      `{"method", "num_speculative_tokens", "model": <head folder>}` (vllm_spelling.speculative_config, what
            exporters/vllm_config.py writes) run by the package's runner; its outputs against vLLM's plain greedy run
            of the same prompts, its per-request counters as tokens per forward (rounds after the first token: vLLM's
            prefill emits it without a draft)
  loop      profiles/specdec.generate with the same head folder on each prompt plus its first greedy token, so that
            both sides draft from the same point and emit the same tokens; its outputs against the target's greedy
            trajectory
A mechanism this platform's vLLM refuses is recorded with vLLM's words. DFlash runs at D = block_size - 1 (the block
the head was trained on and the loop drafts with) and again at D = 3: vLLM's DFlash proposer runs a block of
1 + num_speculative_tokens slots (vllm/v1/spec_decode/dflash.py), the loop always its full block.

    SPECDEC_TUNE_VLLM_PYTHON=... python bench/vllm_learned_heads.py [--prompts 8] [--new-tokens 64] [--random-heads]

Writes bench/results/vllm_learned_heads.json and a table (.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec_tune.exporters.vllm_head_check import check_head
from specdec_tune.profiles import replay
from specdec_tune.profiles.calibration import select_prompts
from specdec_tune.profiles.drafters import create
from specdec_tune.profiles.drafters.checkpoints import save_head
from specdec_tune.profiles.drafters.heads import head_kind
from specdec_tune.profiles.models.folders import architectures, model_folder
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.models.views import engine_model_view
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.profiles.train_drafter import demo_head_folder, train
from specdec_tune.profiles.vllm_engine import VllmEngine
from specdec_tune.settings import TrainSettings
from specdec_tune.vllm_spelling import speculative_config

from common import ROOT, run_and_write, write_table

# A short training: the heads only need to accept some tokens (the default demo head trains for 20 minutes)
TRAINING = dict(max_prompts=48, new_tokens=96, package_tokens=40_000, budget_minutes=4.0, eval_points=0)
RUNS = (("eagle3", None), ("dflash", None), ("dflash", 3), ("dspark", None))  # (mechanism, D; None = the head's own)
TRAINED = ("eagle3", "dflash")


def head_folder(mechanism: str, target, random: bool, tmp: Path) -> tuple[Path, dict]:
    """The head this run uses and how it was made."""
    if random or mechanism not in TRAINED:
        torch.manual_seed(0)
        head = head_kind(mechanism).new(target.model, seed=0)
        _, verifier, config, _ = model_folder(None)
        folder = save_head(
            head,
            mechanism,
            tmp / mechanism,
            verifier=str(verifier),
            verifier_architectures=architectures(config, f"{verifier}/config.json"),
            speculative_tokens=head.max_drafts if head.block else 3,
        )
        return folder, {"weights": "random (seed 0)"}
    settings = TrainSettings(mechanism=mechanism, target=target.ref.path, **TRAINING)
    folder = demo_head_folder(settings, target)
    t0 = time.perf_counter()
    trained_now = not (folder / "config.json").is_file()
    if trained_now:
        train(settings, progress=lambda msg: print(f"  {mechanism}: {msg}", file=sys.stderr, flush=True))
    record = json.loads((folder / "training.json").read_text())
    return folder, {
        "weights": "trained",
        "training": {k: v for k, v in TRAINING.items()},
        "trained_now_s": round(time.perf_counter() - t0, 1) if trained_now else None,
        "train": record["train"],
        "data": record["data"],
        "draft_vocab": record["draft_vocab"],
    }


def loop_side(target, drafter, prompts: list[list[int]], trajectories: list[list[int]], D: int, n: int) -> dict:
    """This tool's decode loop from each prompt plus its first greedy token (where vLLM's first decode round starts)."""
    starts = [list(p) + g[:1] for p, g in zip(prompts, trajectories)]
    t0 = time.perf_counter()
    result = generate(target.model, starts, drafter=drafter, num_draft_tokens=D, max_new_tokens=n - 1)
    total = SpecCounters.total(result.per_prompt)
    outputs = [g[:1] + t for g, t in zip(trajectories, result.tokens)]
    return {
        "tokens_per_forward": total.tokens_per_target_forward,
        "rounds": total.num_rounds,
        "tokens": total.num_emitted_tokens,
        "drafts": total.num_drafts,
        "accepted": total.num_accepted_tokens,
        "accepted_per_pos": total.num_accepted_tokens_per_pos,
        "rounds_per_prompt": [c.num_rounds for c in result.per_prompt],
        "identical_to_greedy": sum(o == g for o, g in zip(outputs, trajectories)),
        "s": round(time.perf_counter() - t0, 1),
    }


def vllm_side(engine: VllmEngine, view: Path, config: dict | None, prompts: list[list[int]], n: int) -> dict:
    """One engine run of every prompt at once (the agreement bench's job), counted as the vllm backend counts it."""
    job = {
        "model_dir": str(view),
        "max_num_seqs": len(prompts),
        "speculative_config": config,
        "engine": {"dtype": "float32"},
        "runs": [
            {"name": "heads", "prompts": prompts, "concurrency": len(prompts), "max_tokens": n, "ignore_eos": True}
        ],
    }
    t0 = time.perf_counter()
    raw = engine.run(job, 1800)
    if not raw.get("ok") or raw["runs"][0].get("error"):
        return {"error": raw.get("error") or raw["runs"][0]["error"], "s": round(time.perf_counter() - t0, 1)}
    requests = raw["runs"][0]["requests"]
    tokens = sum(len(r["output_ids"]) - 1 for r in requests)
    rounds = [r["rounds"] for r in requests]
    return {
        "tokens_per_forward": tokens / sum(rounds),
        "rounds": sum(rounds),
        "tokens": tokens,
        "accepted": sum(sum((r.get("spec") or {}).get("per_step_accepted", [])) for r in requests),
        "accepted_per_pos": raw["runs"][0]["counters"]["num_accepted_tokens_per_pos"],
        "rounds_per_prompt": rounds,
        "outputs": [r["output_ids"] for r in requests],
        "init_s": raw.get("init_s"),
        "s": round(time.perf_counter() - t0, 1),
    }


def head_summary(check: dict) -> dict:
    keep = ("ok", "steps_run", "steps_not_run", "unloaded", "dropped", "from_target", "unused", "error")
    return {k: check.get(k) for k in keep} | {"model_class": (check.get("model_class") or {}).get("class")}


def run(args) -> dict:
    engine = VllmEngine.locate()
    target = load_model(None, dtype="float32")
    chosen = select_prompts("default", "held_back", args.prompts)
    prompts = encode_prompts(
        target.tokenizer,
        chosen,
        context_tokens=target.model.config.max_position_embeddings,
        max_new_tokens=args.new_tokens,
        max_draft_tokens=8,
    )
    t0 = time.perf_counter()
    trajectories = replay.trajectories(target.model, prompts, args.new_tokens, len(prompts))
    trajectory_s = time.perf_counter() - t0
    rows, heads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        view = engine_model_view(model_folder(None)[1], Path(tmp) / "target")
        plain = vllm_side(engine, view, None, prompts, args.new_tokens)
        greedy = plain.pop("outputs", None)
        for mechanism, D in RUNS:
            if mechanism not in heads:
                folder, made = head_folder(mechanism, target, args.random_heads, Path(tmp))
                t0 = time.perf_counter()
                check = check_head(folder)
                made["vllm_head_check"] = head_summary(check) | {"s": round(time.perf_counter() - t0, 1)}
                heads[mechanism] = (folder, made)
            folder, made = heads[mechanism]
            drafter = create(mechanism, target, {"model": str(folder)})
            D = D or drafter.max_draft_len or 3
            config = speculative_config(mechanism, D, {}, model=str(folder))
            theirs = vllm_side(engine, view, config, prompts, args.new_tokens)
            row = {"mechanism": mechanism, "draft_len": D, "speculative_config": config, "head": made, "vllm": theirs}
            if "error" in theirs:
                rows.append(row | {"runs_in_vllm": False})
                continue
            outputs = theirs.pop("outputs")
            theirs["identical_to_vllm_greedy"] = (
                sum(o == g for o, g in zip(outputs, greedy)) if greedy is not None else None
            )
            theirs["identical_to_loop_greedy"] = sum(o == g for o, g in zip(outputs, trajectories))
            ours = loop_side(target, drafter, prompts, trajectories, D, args.new_tokens)
            rows.append(
                row
                | {
                    "runs_in_vllm": True,
                    "loop": ours,
                    "rel_diff": theirs["tokens_per_forward"] / ours["tokens_per_forward"] - 1,
                    "same_rounds_per_prompt": sum(
                        a == b for a, b in zip(theirs["rounds_per_prompt"], ours["rounds_per_prompt"])
                    ),
                }
            )
    plain_identical = sum(o == g for o, g in zip(greedy, trajectories)) if greedy is not None else None
    return {
        "source": "measured",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "vllm_version": engine.version,
        "target": dataclasses.asdict(target.ref),
        "prompts": len(prompts),
        "split": "held_back",
        "new_tokens": args.new_tokens,
        "dtype": "float32",
        "temperature": 0.0,
        "trajectory_s": round(trajectory_s, 1),
        "vllm_plain": {k: v for k, v in plain.items() if k != "outputs"}
        | {"identical_to_loop_greedy": plain_identical},
        "runs": rows,
        "rounds": "both sides count the decode rounds after the first token (vLLM's prefill emits it without a draft)",
        "accepted": (
            "vLLM drafts K in every round and counts the drafts its last round accepts past max_tokens; the loop "
            "drafts no further than max_tokens: tokens per forward (emitted / rounds) is the figure compared"
        ),
    }


def table(result: dict) -> str:
    plain = result["vllm_plain"]
    lines = [
        f"learned heads in vLLM {result['vllm_version']} and in the loop ({result['prompts']} held-back prompts, "
        f"greedy fp32, {result['new_tokens']} tokens; vLLM plain greedy = loop greedy on "
        f"{plain.get('identical_to_loop_greedy')}/{result['prompts']})",
        "",
        "| mechanism | D | head | vLLM loader | tokens/forward vLLM | loop | vLLM / loop - 1 | same rounds per prompt "
        "| vLLM spec = vLLM greedy | loop spec = greedy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        check = r["head"]["vllm_head_check"]
        loader = "ok" if check["ok"] else f"refused: {(check['error'] or 'steps not run')[:60]}"
        if check["ok"] and check["dropped"]:
            loader += f" (dropped {', '.join(d['name'] for d in check['dropped'])})"
        if not r["runs_in_vllm"]:
            lines.append(
                f"| {r['mechanism']} | {r['draft_len']} | {r['head']['weights']} | {loader} "
                f"| vLLM refuses: {r['vllm']['error'][:110]} | | | | | |"
            )
            continue
        v, o, n = r["vllm"], r["loop"], result["prompts"]
        lines.append(
            f"| {r['mechanism']} | {r['draft_len']} | {r['head']['weights']} | {loader} "
            f"| {v['tokens_per_forward']:.3f} | {o['tokens_per_forward']:.3f} | {100 * r['rel_diff']:+.1f}% "
            f"| {r['same_rounds_per_prompt']}/{n} | {v['identical_to_vllm_greedy']}/{n} "
            f"| {o['identical_to_greedy']}/{n} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--random-heads", action="store_true", help="deterministic random heads instead of trained ones")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_learned_heads.json")
    args = ap.parse_args(argv)
    result = run_and_write(run, args)
    if result is None:
        return 1
    write_table(args, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
