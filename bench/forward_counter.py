"""Count model forwards while a function runs, by model depth (the target is the deepest)."""

from __future__ import annotations

import collections
import time

from specdec_tune.profiles.models.llama import CausalLM


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
