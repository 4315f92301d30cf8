"""Kernels the bundle carries, and the weight-format emulation the profiler uses.

One module per job, imported on use (the Triton ones need `triton`; `quant` needs only torch):

- `verify_attention`  Triton decode attention verifying 1+D tokens per sequence (GQA-packed, contiguous or paged KV)
- `acceptance`        Triton greedy acceptance and rejection sampling, matching `profiles.specdec`
- `autotune`          tuning keys from the plan's shapes, tile rules, timed choices, the `KernelTable`
- `aot`               cubins per target architecture, the kernel manifest, and the loader with its JIT fallback
- `onnx_export`       the learned drafter to ONNX, parity in onnxruntime, the TensorRT engine or its build command
- `quant`             FP8 / NVFP4 fake quantization of drafter weights
"""

__all__ = ["acceptance", "aot", "autotune", "onnx_export", "quant", "verify_attention"]
