"""The generic model path (transformers' modules, profiles/models/generic.py) against the built-in forward
(profiles/models/llama.py) on the demo target: the verify step's time per (B, 1+D), the unit the profile measures.

Both load the same weights in the same dtype; each cell is a VerifyStep (a static cache holding --ctx tokens, then
B rows x 1+D new tokens) of each path. Rounds visit the cells in a shuffled order and alternate which path goes
first, so drift on a shared machine lands on both alike; each (path, cell) pools its samples over the rounds into
a median with its 95% interval. The ratio generic / built-in is of the medians, with the interval's ends crossed
(generic low / built-in high .. generic high / built-in low).

    python bench/generic_path.py                       # B 1,4,8 x 1+D 1,2,4,8 at ctx 128, 5 rounds (a few minutes)
    python bench/generic_path.py --batch 1 --tokens 1,4 --rounds 2

Writes bench/results/generic_path.json and a short table beside it (.md).
"""

from __future__ import annotations

import argparse
import platform
import random
from pathlib import Path

import torch

from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.timing import Timing
from specdec_tune.profiles.verify_curve import VerifyStep

from common import ROOT, run_and_write, write_table

PATHS = {"builtin": "builtin", "generic": "transformers"}  # result name -> load_model(implementation=...)


def run(args) -> dict:
    models = {name: load_model(None, dtype=args.dtype, implementation=impl).model for name, impl in PATHS.items()}
    cells = [(B, T) for B in args.batch for T in args.tokens]
    steps = {
        (name, B): VerifyStep(model, B, args.ctx, max(args.tokens), seed=B)
        for name, model in models.items()
        for B in args.batch
    }
    samples: dict[tuple[str, int, int], list[float]] = {(name, B, T): [] for name in models for B, T in cells}
    rng = random.Random(0)
    for r in range(args.rounds):
        order = cells[:]
        rng.shuffle(order)
        for B, T in order:
            for name in list(models) if r % 2 == 0 else list(models)[::-1]:
                timing = steps[(name, B)].timing(T, warmup=1, repeats=args.repeats)
                samples[(name, B, T)].extend(timing.samples_ms)
    rows = []
    for B, T in cells:
        fast, generic = Timing.of(samples[("builtin", B, T)]), Timing.of(samples[("generic", B, T)])
        rows.append(
            {
                "batch": B,
                "tokens": T,
                "builtin_ms": fast.as_dict(),
                "generic_ms": generic.as_dict(),
                "ratio": generic.median_ms / fast.median_ms,
                "ratio_interval": [generic.ci_low_ms / fast.ci_high_ms, generic.ci_high_ms / fast.ci_low_ms],
            }
        )
    return {
        "what": (
            "verify step time, generic path (transformers' modules under the loop's cache) against the built-in forward"
        ),
        "source": "measured",
        "target": "smollm2-135m (llama)",
        "dtype": str(models["builtin"].dtype).removeprefix("torch."),
        "ctx": args.ctx,
        "rounds": args.rounds,
        "repeats_per_visit": args.repeats,
        "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "cells": rows,
    }


def table(result: dict) -> str:
    lines = [
        f"generic / built-in verify step, demo target, {result['dtype']}, ctx {result['ctx']} (measured, medians over "
        f"{result['rounds']} interleaved rounds, 95% intervals)",
        "",
        "| B | 1+D | built-in ms | generic ms | generic / built-in |",
        "|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        f, g = c["builtin_ms"], c["generic_ms"]
        lines.append(
            f"| {c['batch']} | {c['tokens']} | {f['median_ms']:.1f} [{f['ci_low_ms']:.1f}–{f['ci_high_ms']:.1f}] | "
            f"{g['median_ms']:.1f} [{g['ci_low_ms']:.1f}–{g['ci_high_ms']:.1f}] | "
            f"{c['ratio']:.2f}x [{c['ratio_interval'][0]:.2f}–{c['ratio_interval'][1]:.2f}] |"
        )
    return "\n".join(lines)


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=ints, default=[1, 4, 8])
    parser.add_argument("--tokens", type=ints, default=[1, 2, 4, 8])
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "generic_path.json")
    args = parser.parse_args()
    result = run_and_write(run, args)
    if result is not None:
        write_table(args, table(result))


if __name__ == "__main__":
    main()
