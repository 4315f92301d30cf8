"""Kernels the bundle carries. Imports no stage: profiles, autotune and exporters import these.

One module per job, imported on use (the Triton ones need `triton`):

- `verify_attention`  Triton decode attention verifying 1+D tokens per sequence (GQA-packed, contiguous or paged KV)
- `acceptance`        Triton greedy acceptance and rejection sampling, matching `greedy`
- `greedy`            the greedy verification rule in torch, the reference the kernels and the loop share
- `buckets`           bucket keys: the batch and context sizes a tuned table is keyed by
- `tuning`            tuning keys from model shapes, tile rules, timed choices, the `KernelTable`
- `aot`               cubins per target architecture, the kernel manifest, and the loader with its JIT fallback
"""

import importlib

__all__ = ["acceptance", "aot", "buckets", "greedy", "tuning", "verify_attention"]


def __getattr__(name: str):
    """Each module on first use (the Triton ones import triton)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
