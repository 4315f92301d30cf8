"""Acceptance by replay against the speculative loop, on held-back prompts of the demo pair: equal counters, and the cost.

For every registered drafter (the learned heads untrained, `random=1`: a trained head is not committed, and the
replay's equality does not depend on the head's quality):
  exact   fp32: the loop's counters and the replay's at each checked D, prompt by prompt (they must be equal);
  dtype   the profile's dtype (bf16 where the CPU computes it): tokens per forward by replay and by the loop at D_max,
          and their difference (the loop verifies 1+D tokens per forward, the trajectory one: batch-shape numerics);
  cost    what greedy acceptance at every D costs each way, in wall seconds and model forwards:
            loop   one speculative run per drafter at D_max, plus direct runs at D_max/4 and D_max/2
                   (the old profile's way; every other D derived from D_max's rounds, not measured);
            replay one greedy trajectory per prompt shared by every drafter, plus each drafter's proposals
                   (exact at every D).

    python bench/acceptance_replay.py            # 16 held-back prompts, 32 tokens, D_max 7 (the CPU profile's defaults)
    python bench/acceptance_replay.py --quick    # 4 prompts, 16 tokens, D_max 3

Writes bench/results/acceptance_replay.json and prints a short table.
"""  # noqa: E501 - the first line is the --help description (`__doc__.splitlines()[0]`): it stays whole

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from specdec_tune.profiles import replay
from specdec_tune.profiles.calibration import select_prompts
from specdec_tune.profiles.drafters import create
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.specdec import SpecCounters, generate

from common import ROOT, counted, run_and_write, write_table

DRAFTER_OPTIONS = {
    "ngram": {},
    "suffix": {},
    "draft_model": {},
    "eagle3": {"random": "1"},
    "mtp": {"random": "1"},
    "dflash": {"random": "1"},
    "dspark": {"random": "1"},
}


def _encoded(target, n: int, new_tokens: int, d_max: int) -> list[list[int]]:
    prompts = select_prompts("default", "held_back", n)
    return encode_prompts(
        target.tokenizer,
        prompts,
        context_tokens=target.model.config.max_position_embeddings,
        max_new_tokens=new_tokens,
        max_draft_tokens=d_max,
    )


def _d_max(drafter, args) -> int:
    """The longest draft the drafter makes here (a block head: its block)."""
    return min(args.max_draft_len, drafter.max_draft_len or args.max_draft_len)


def _replayed(
    target, drafters: dict, ids, args, stop: set[int], lens: list[int]
) -> tuple[dict[str, list[list[SpecCounters]]], list[list[int]]]:
    """Per drafter and prompt, the replayed counters at each D of `lens` the drafter can make; and the trajectories."""
    trajectories = replay.trajectories(target.model, ids, args.new_tokens, args.batch)
    out = {}
    for name, d in drafters.items():
        d_max = _d_max(d, args)
        out[name] = [
            replay.replay(
                t,
                replay.proposer(d, p, t, target.model, d_max),
                [D for D in lens if D <= d_max],
                args.new_tokens,
                stop,
                args.max_draft_len,
            )
            for p, t in zip(ids, trajectories)
        ]
    return out, trajectories


def _looped(target, drafter, ids, D: int, args, stop: set[int], texts: list | None = None) -> list[SpecCounters]:
    """The loop's per-prompt counters at D (its generated tokens appended to `texts` when given)."""
    out = []
    for start in range(0, len(ids), args.batch):
        result = generate(
            target.model,
            ids[start : start + args.batch],
            drafter=drafter,
            num_draft_tokens=D,
            max_new_tokens=args.new_tokens,
            stop_token_ids=sorted(stop),
        )
        out += result.per_prompt
        if texts is not None:
            texts += result.tokens
    return out


def exact_check(args) -> dict:
    """fp32: replay and loop counters, prompt by prompt, at every checked D."""
    target = load_model("smollm2-135m", dtype="float32")
    ids = _encoded(target, args.prompts, args.new_tokens, args.max_draft_len)
    stop = set(target.model.config.eos_token_ids)
    drafters = {name: create(name, target, options) for name, options in DRAFTER_OPTIONS.items()}
    replayed, _ = _replayed(target, drafters, ids, args, stop, args.check_lens)
    out = {}
    for name, drafter in drafters.items():
        rows = []
        for i, D in enumerate(D for D in args.check_lens if D <= _d_max(drafter, args)):
            looped = _looped(target, drafter, ids, D, args, stop)
            equal = sum(
                dataclasses.asdict(r[i])
                == dataclasses.asdict(SpecCounters.merge(c, SpecCounters(max_draft_len=args.max_draft_len)))
                for r, c in zip(replayed[name], looped)
            )
            rows.append(
                {
                    "draft_len": D,
                    "prompts": len(ids),
                    "equal_prompts": equal,
                    "tokens_per_forward": SpecCounters.total([r[i] for r in replayed[name]]).tokens_per_target_forward,
                    "accepted_tokens": SpecCounters.total(looped).num_accepted_tokens,
                }
            )
            print(f"  fp32 {name} D={D}: {equal}/{len(ids)} prompts with equal counters", file=sys.stderr, flush=True)
        out[name] = rows
    return out


def cost_and_dtype(args) -> dict:
    """The profile's dtype: the old way (loop at D_max + two direct checks) against replay at every D."""
    target = load_model("smollm2-135m", dtype="auto")
    ids = _encoded(target, args.prompts, args.new_tokens, args.max_draft_len)
    stop = set(target.model.config.eos_token_ids)
    layers = target.model.config.num_layers
    drafters = {name: create(name, target, options) for name, options in DRAFTER_OPTIONS.items()}
    checks = sorted({max(1, args.max_draft_len // 4), max(1, args.max_draft_len // 2)} - {args.max_draft_len})

    texts: dict[str, list[list[int]]] = {name: [] for name in drafters}  # the loop's tokens at D_max, per prompt

    def the_loop():
        return {
            name: [
                _looped(target, d, ids, D, args, stop, texts[name] if D == _d_max(d, args) else None)
                for D in (_d_max(d, args), *(c for c in checks if c < _d_max(d, args)))
            ]
            for name, d in drafters.items()
        }

    looped, loop_count, loop_s = counted(the_loop)
    lens = list(range(1, args.max_draft_len + 1))
    (replayed, trajectories), replay_count, replay_s = counted(
        lambda: _replayed(target, drafters, ids, args, stop, lens)
    )
    per_drafter = {}
    for name in DRAFTER_OPTIONS:
        loop_tpf = SpecCounters.total(looped[name][0]).tokens_per_target_forward
        replay_tpf = SpecCounters.total([r[-1] for r in replayed[name]]).tokens_per_target_forward
        # Where the loop's text is the plain greedy text (the trajectory), its counters must equal the replay's in any
        # dtype; where a near-tie flipped with the batch shape (1+D tokens verified at once against one), the texts part
        # and so do the counters: the difference lives in those prompts alone.
        same = [i for i, (t, g) in enumerate(zip(texts[name], trajectories)) if list(t) == list(g[: len(t)])]
        same_equal = sum(
            dataclasses.asdict(replayed[name][i][-1])
            == dataclasses.asdict(
                SpecCounters.merge(looped[name][0][i], SpecCounters(max_draft_len=args.max_draft_len))
            )
            for i in same
        )
        per_drafter[name] = {
            "loop_tokens_per_forward_at_d_max": loop_tpf,
            "replay_tokens_per_forward_at_d_max": replay_tpf,
            "rel_diff_pct": 100 * (replay_tpf - loop_tpf) / loop_tpf,
            "prompts_same_text": len(same),
            "prompts_same_text_equal_counters": same_equal,
        }
    return {
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "per_drafter": per_drafter,
        "loop": {
            "what": f"one run per drafter at D_max and at D = {checks}; other D derived",
            "wall_s": loop_s,
            **loop_count.summary(layers),
        },
        "replay": {
            "what": "one trajectory per prompt, shared; every D exact",
            "wall_s": replay_s,
            **replay_count.summary(layers),
        },
    }


def run(args) -> dict:
    exact = exact_check(args)
    cost = cost_and_dtype(args)
    return {
        "source": "measured",
        "prompts": f"{args.prompts} held-back prompts (default set)",
        "new_tokens": args.new_tokens,
        "max_draft_len": args.max_draft_len,
        "batch": args.batch,
        "greedy": True,
        "exact_fp32": exact,
        "all_equal": all(r["equal_prompts"] == r["prompts"] for rows in exact.values() for r in rows),
        "profile_dtype": cost,
    }


def table(r: dict) -> str:
    lines = [
        f"acceptance by replay vs the loop: {r['prompts']}, {r['new_tokens']} tokens, greedy",
        "| drafter | fp32: prompts with equal counters (D checked) | tokens/forward at D_max, replay vs loop "
        f"({r['profile_dtype']['dtype']}) | prompts whose loop text is the plain greedy text "
        f"({r['profile_dtype']['dtype']}) |",
        "|---|---|---|---|",
    ]
    for name, rows in r["exact_fp32"].items():
        eq = ", ".join(f"{x['equal_prompts']}/{x['prompts']} (D={x['draft_len']})" for x in rows)
        d = r["profile_dtype"]["per_drafter"][name]
        lines.append(
            f"| {name} | {eq} | {d['replay_tokens_per_forward_at_d_max']:.3f} "
            f"vs {d['loop_tokens_per_forward_at_d_max']:.3f} "
            f"({d['rel_diff_pct']:+.1f}%) | {d['prompts_same_text']}/{rows[0]['prompts']} "
            f"({d['prompts_same_text_equal_counters']} with equal counters) |"
        )
    loop, rep = r["profile_dtype"]["loop"], r["profile_dtype"]["replay"]
    lines += [
        "",
        f"cost of greedy acceptance for {len(r['exact_fp32'])} drafters: loop {loop['wall_s']:.0f} s, "
        f"{loop['target_forwards']} target forwards ({loop['what']}); replay {rep['wall_s']:.0f} s, "
        f"{rep['target_forwards']} target forwards ({rep['what']})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-draft-len", type=int, default=7)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "acceptance_replay.json")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens, D_max 3")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.max_draft_len = 4, 16, 3
    args.check_lens = sorted({1, min(3, args.max_draft_len), min(7, args.max_draft_len), args.max_draft_len})
    result = run_and_write(run, args)
    if result is None:
        return 1
    write_table(args, table(result))
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
