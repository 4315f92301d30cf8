"""What the benchmark scripts share: counting model forwards, repository-relative paths, writing a result."""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.profiles.models.llama import CausalLM
from specdec_tune.profiles.records import write_json

ROOT = Path(__file__).resolve().parent.parent


def counted(fn):
    """Run fn() while counting CausalLM forwards by model depth; returns (result, {layers: calls}, seconds)."""
    calls: collections.Counter = collections.Counter()
    original = CausalLM.forward

    def forward(self, *a, **k):
        calls[len(self.layers)] += 1
        return original(self, *a, **k)

    CausalLM.forward = forward
    t0 = time.perf_counter()
    try:
        result = fn()
    finally:
        CausalLM.forward = original
    return result, calls, time.perf_counter() - t0


def shown(path) -> str | None:
    """A path as a result file records it: relative to the repository when inside it, else its name."""
    if path is None:
        return None
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def run_and_write(run, args) -> dict | None:
    """run(args), written atomically to args.out; a handled error is one line on stderr and None."""
    try:
        result = run(args)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    write_json(args.out, result)
    return result
