"""Kernels the bundle carries. Imports no stage: profiles, autotune and exporters import these.

One module per job, imported on use (the Triton ones need `triton`):

- `verify_attention`  Triton decode attention verifying 1+D tokens per sequence (GQA-packed, contiguous or paged KV)
- `acceptance`        Triton greedy acceptance and rejection sampling, matching `greedy`
- `greedy`            the greedy verification rule in torch, the reference the kernels and the loop share
- `buckets`           bucket keys: the batch and context sizes a tuned table is keyed by
- `tuning`            tuning keys from model shapes, tile rules, timed choices, the `KernelTable`
- `aot`               cubins per target architecture, the kernel manifest, and the loader with its JIT fallback
"""

__all__ = ["acceptance", "aot", "buckets", "greedy", "tuning", "verify_attention"]
