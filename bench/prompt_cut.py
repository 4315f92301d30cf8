"""Acceptance on the held-back prompts as the engine benches decode them (cut to the context bucket) and whole.

The engine check (`export`) and `bench/decision_quality.py` time their buckets at one context: every held-back prompt
long enough is cut to its last ctx - N/2 tokens (`profiles/prompts.cut_to_context`). The profile measures acceptance
on whole prompts. A lookup drafter copies from its prompt, so a cut that drops the text a prompt asks about changes
what it accepts. This script replays the target's greedy trajectory on the same prompts both ways (`profiles/replay.py`,
which equals vLLM's counters: `bench/vllm_agreement.py`) and gives tokens per forward per prompt and pooled.

    python bench/prompt_cut.py [--mechanism ngram] [-D 7] [--ctx 128] [--new-tokens 48] [--prompts 8] [--quick]

Writes bench/results/prompt_cut.json and a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specdec_tune.profiles import replay
from specdec_tune.profiles.drafters import create
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.prompts import cut_to_context, prompts_by_domain
from specdec_tune.profiles.specdec import SpecCounters

from common import ROOT, run_and_write, write_table

OPTIONS = {"ngram": {"prompt_lookup_min": "2", "prompt_lookup_max": "5"}, "suffix": {}}


def tokens_per_forward(target, drafter, prompts: list[list[int]], D: int, n: int) -> list[SpecCounters]:
    """One prompt's counters each, from the trajectory's second token on (the prefill gives the first), no stop
    token."""
    out = []
    for prompt, g in zip(prompts, replay.trajectories(target.model, prompts, n, len(prompts))):
        head, rest = list(prompt) + g[:1], g[1:]
        out.append(
            SpecCounters.total(
                replay.replay(rest, replay.proposer(drafter, head, rest, target.model, D), [D], n - 1, set(), D)
            )
        )
    return out


def run(args) -> dict:
    started = time.perf_counter()
    target = load_model(None, dtype=args.dtype)
    whole = prompts_by_domain(
        target.tokenizer,
        int(target.model.config.max_position_embeddings),
        1000,
        args.new_tokens,
        args.draft_len,
        "held_back",
    )
    cut = cut_to_context(whole, args.ctx, args.new_tokens)[: args.prompts]  # the engine benches' pool, in their order
    kept = len(cut[0][0]) if cut else 0
    chosen = [(ids, d) for ids, d in whole if len(ids) >= kept][: args.prompts]
    drafter = create(args.mechanism, target, OPTIONS.get(args.mechanism, {}))
    sides = {"cut": [ids[-kept:] for ids, _ in chosen], "whole": [ids for ids, _ in chosen]}
    counters = {k: tokens_per_forward(target, drafter, v, args.draft_len, args.new_tokens) for k, v in sides.items()}
    rows = [
        {
            "domain": d,
            "prompt_tokens": len(ids),
            "cut_to": kept,
            **{f"{k}_tokens_per_forward": counters[k][i].tokens_per_target_forward for k in sides},
        }
        for i, (ids, d) in enumerate(chosen)
    ]
    pooled = {k: SpecCounters.total(v).tokens_per_target_forward for k, v in counters.items()}
    return {
        "source": "measured",
        "mechanism": args.mechanism,
        "draft_len": args.draft_len,
        "ctx": args.ctx,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "split": "held_back",
        "method": "replay of the target's greedy trajectory, no stop token",
        "pooled_tokens_per_forward": pooled,
        "prompts": rows,
        "s": time.perf_counter() - started,
    }


def table(r: dict) -> str:
    p = r["pooled_tokens_per_forward"]
    lines = [
        f"{r['mechanism']} tokens per forward at D={r['draft_len']} on {len(r['prompts'])} held-back prompts, "
        f"{r['new_tokens']} tokens, {r['dtype']}: cut to the last {r['prompts'][0]['cut_to']} tokens (ctx {r['ctx']}) "
        f"as the engine benches decode them, and whole (as the profile does); pooled: cut {p['cut']:.3f}, "
        f"whole {p['whole']:.3f}",
        "",
        "| domain | prompt tokens | cut | whole |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {x['domain']} | {x['prompt_tokens']} | {x['cut_tokens_per_forward']:.3f} "
        f"| {x['whole_tokens_per_forward']:.3f} |"
        for x in r["prompts"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mechanism", choices=sorted(OPTIONS), default="ngram")
    ap.add_argument("-D", "--draft-len", type=int, default=7)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 16 tokens, D = 3")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prompt_cut.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.draft_len = 2, 16, 3
    result = run_and_write(run, args)
    if result is None:
        return 1
    write_table(args, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
