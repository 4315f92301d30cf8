"""The learned drafter as ONNX, checked against torch in onnxruntime, and a TensorRT engine built from it.

Two graphs per drafter (a `profiles.models.llama.CausalLM`, e.g. the `draft_model` drafter's model):

    drafter.onnx      tokens [batch, tokens] int64                               -> logits [batch, tokens, V] fp32
    drafter_kv.onnx   tokens [batch, tokens], past_k, past_v [layers, batch, H_kv, past, hd]
                      -> logits, present_k, present_v [layers, batch, H_kv, past + tokens, hd]

batch, tokens (the draft length per step, 1+D for a verify-shaped call) and past are dynamic. The
graph is the model's own forward without its Python-side bookkeeping: RoPE angles from the positions
past..past+tokens-1 in float64 (as the model's table), causal mask j <= past + t, the same layer
modules and `gqa_attention`. Every row of a batch shares one past length: a serving engine with
ragged rows pads them. Parity is measured on the real `CausalLM.forward` (its static KV cache after a
prefill of `past` tokens) against onnxruntime, in fp32, at shapes other than the traced ones; the
error is scaled by the logits' size (`check_parity`), and torch's own fp32-vs-fp64 error is recorded beside it.

TensorRT: where `tensorrt` imports, an engine is built with an optimisation profile over
batch 1..max_batch, tokens 1..1+max_draft_len (and past 1..ctx), in bf16 (fp16 where bf16 is absent),
with FP8 enabled when the plan quantizes the drafter to fp8. Elsewhere the result is a skip record
naming the reason and the `trtexec` command, which the folder's README.md repeats. Quantized plans
export weights that carry the format's rounding (`profiles.drafters.quant`), which is what the profile's
acceptance was measured with.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import cast

import torch
from torch import nn

from specdec_tune import SpecdecError
from specdec_tune.formats import get_format
from specdec_tune.profiles.drafters.quant import quantize_linear_weights
from specdec_tune.profiles.models.llama import CausalLM, DecoderLayer, gqa_attention, rotate
from specdec_tune.records import sha256_file, write_json

PARITY_TOLERANCE_FP32 = 1e-4  # parity error bound (check_parity): max |onnxruntime - torch| / max(1, max |torch|), fp32
OPSET = 18


def inverse_frequencies(c) -> torch.Tensor:
    """[hd/2] float64 RoPE frequencies, as the models' tables compute them."""
    return 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [1, T, 1, hd] (float64 angles, as the models' tables; traceable)."""
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, hd]
    return angles.cos().to(dtype)[None, :, None, :], angles.sin().to(dtype)[None, :, None, :]


class ExportedForward(nn.Module):
    """`CausalLM.forward` as a static graph: no cache object, positions from the past length, float64 RoPE angles."""

    inv_freq: torch.Tensor  # a buffer (register_buffer), which the type checker cannot see

    def __init__(self, model: CausalLM, with_cache: bool) -> None:
        super().__init__()
        self.model = model
        self.with_cache = with_cache
        self.register_buffer("inv_freq", inverse_frequencies(model.config), persistent=False)  # [hd/2] float64

    def forward(self, tokens: torch.Tensor, past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None):
        # tokens: [B, T]; past_k, past_v: [layers, B, H_kv, P, hd]
        m, c = self.model, self.model.config
        B, T = tokens.shape
        P = past_k.shape[3] if past_k is not None else 0
        positions = torch.arange(T, device=tokens.device) + P  # [T]
        cos, sin = rope_tables(self.inv_freq, positions, m.dtype)
        keys = torch.arange(P + T, device=tokens.device)
        mask = (keys[None, :] <= positions[:, None])[None, None].expand(B, 1, T, P + T)  # [B, 1, T, P+T]
        x = m.embed_tokens(tokens)  # [B, T, hidden]
        present_k, present_v = [], []
        # a CausalLM's layers are DecoderLayers; the ModuleList does not say so
        for i, layer in enumerate(cast("list[DecoderLayer]", m.layers)):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(B, T, c.num_heads, c.head_dim)
            k = a.k_proj(h).view(B, T, c.num_kv_heads, c.head_dim)
            v = a.v_proj(h).view(B, T, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, T, hd]
            if past_k is not None:
                assert past_v is not None  # the KV graph takes both halves of the cache
                k = torch.cat((past_k[i], k), dim=2)  # [B, H_kv, P+T, hd]
                v = torch.cat((past_v[i], v), dim=2)
            present_k.append(k)
            present_v.append(v)
            out = gqa_attention(q.transpose(1, 2), k, v, mask)  # [B, H, T, hd]
            x = x + a.o_proj(out.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = m.lm_head(m.norm(x)).float()  # [B, T, V]
        if past_k is None:
            return logits
        return logits, torch.stack(present_k), torch.stack(present_v)


# ------------------------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True)
class ExportShapes:
    """The range the graphs and the engine serve."""

    max_batch: int
    max_tokens: int  # 1 + max_draft_len
    max_past: int  # ctx


def _example(model: CausalLM, B: int, T: int, P: int, seed: int) -> tuple[torch.Tensor, ...]:
    c = model.config
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, c.vocab_size, (B, T), generator=g)
    if P == 0:
        return (tokens,)
    shape = (len(model.layers), B, c.num_kv_heads, P, c.head_dim)
    return tokens, torch.randn(shape, generator=g).to(model.dtype), torch.randn(shape, generator=g).to(model.dtype)


def export_onnx(model: CausalLM, path: Path, *, with_cache: bool, shapes: ExportShapes) -> Path:
    """Trace `model` (fp32, eval) to an ONNX file with dynamic batch, tokens and past."""
    from torch.export import Dim

    wrapper = ExportedForward(model, with_cache).eval()
    batch = Dim("batch", min=1, max=max(shapes.max_batch, 2))
    tokens = Dim("tokens", min=1, max=max(shapes.max_tokens, 2))
    if with_cache:
        past = Dim("past", min=1, max=max(shapes.max_past, 2))
        args = _example(model, 2, 3, 5, seed=0)
        dynamic = {"tokens": {0: batch, 1: tokens}, "past_k": {1: batch, 3: past}, "past_v": {1: batch, 3: past}}
        names = (["tokens", "past_k", "past_v"], ["logits", "present_k", "present_v"])
    else:
        args = _example(model, 2, 3, 0, seed=0)
        dynamic = {"tokens": {0: batch, 1: tokens}}
        names = (["tokens"], ["logits"])
    return export_module(wrapper, args, dynamic, names, path)


def export_module(
    wrapper: nn.Module, args: tuple, dynamic: dict, names: tuple[list[str], list[str]], path: Path
) -> Path:
    """torch.export `wrapper` at `args` with `dynamic` shapes and save it as one self-contained ONNX file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            args,
            dynamo=True,
            dynamic_shapes=dynamic,
            input_names=names[0],
            output_names=names[1],
            opset_version=OPSET,
            external_data=False,
            verbose=False,
        )
    assert program is not None  # dynamo=True always returns the ONNXProgram
    program.save(str(path))
    return path


# ------------------------------------------------------------------------------------- parity


def _torch_logits(model: CausalLM, tokens: torch.Tensor, past_tokens: torch.Tensor | None) -> torch.Tensor:
    """The model's own forward: prefill `past_tokens` into a fresh static cache, then `tokens` on top of it."""
    B, T = tokens.shape
    P = 0 if past_tokens is None else past_tokens.shape[1]
    cache = model.new_cache(B, P + T)
    if P:
        model(past_tokens, cache, torch.zeros(B, dtype=torch.long), logits="none")
    return model(tokens, cache, torch.full((B,), P, dtype=torch.long))


def _past_of(model: CausalLM, past_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV cache after a prefill of past_tokens, as [layers, B, H_kv, P, hd] tensors."""
    B, P = past_tokens.shape
    cache = model.new_cache(B, P)
    model(past_tokens, cache, torch.zeros(B, dtype=torch.long), logits="none")
    return torch.stack([k[:, :, :P] for k in cache.k]), torch.stack([v[:, :, :P] for v in cache.v])


def scaled_error(err: float, reference: torch.Tensor) -> float:
    """An error against the size of what it is an error of: absolute below unit scale, relative above it."""
    return err / max(1.0, float(reference.abs().max()))


@torch.no_grad()
def check_parity(
    model: CausalLM, onnx_path: Path, *, with_cache: bool, cases: list[tuple[int, int, int]], seed: int = 1
) -> dict:
    """onnxruntime against the model's own fp32 forward at each (batch, tokens, past) case.

    The parity error is max |onnxruntime - torch| over the logits (and the present KV) divided by max(1, max |torch|):
    the absolute error for unit-scale outputs, the relative one for large logits. A real drafter's logits reach ~70,
    where fp32 itself rounds to ~1e-4: each case also records torch's own fp32 error against an fp64 forward.
    """
    import copy

    import onnxruntime as ort

    runtime = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    exact = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(seed)
    rows = []
    for B, T, P in cases:
        tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
        past_tokens = torch.randint(0, model.config.vocab_size, (B, P), generator=g) if with_cache and P else None
        expected = _torch_logits(model, tokens, past_tokens)  # [B, T, V]
        feed = {"tokens": tokens.numpy()}
        if past_tokens is not None:
            past_k, past_v = _past_of(model, past_tokens)
            feed |= {"past_k": past_k.float().numpy(), "past_v": past_v.float().numpy()}
        outputs = runtime.run(None, feed)
        got = torch.from_numpy(outputs[0])
        if got.shape != expected.shape:
            raise SpecdecError(
                f"onnxruntime returned logits {tuple(got.shape)} for {tuple(expected.shape)}", "re-export the drafter"
            )
        err = float((got - expected).abs().max())
        fp64 = _torch_logits(exact, tokens, past_tokens)
        row = {
            "batch": B,
            "tokens": T,
            "past": P if with_cache else 0,
            "max_abs_err": err,
            "logits_max_abs": float(expected.abs().max()),
            "parity_err": scaled_error(err, expected),
            "torch_fp32_vs_fp64": float((expected.double() - fp64).abs().max()),
            "onnx_vs_fp64": float((got.double() - fp64).abs().max()),
        }
        if past_tokens is not None:
            full_k, _ = _past_of(model, torch.cat((past_tokens, tokens), dim=1))
            k_err = float((torch.from_numpy(outputs[1]) - full_k.float()).abs().max())
            row |= {"present_k_max_abs_err": k_err, "present_k_parity_err": scaled_error(k_err, full_k)}
        rows.append(row)
    worst = max(max(r["parity_err"], r.get("present_k_parity_err", 0.0)) for r in rows)
    return {
        "cases": rows,
        "parity_err": worst,
        "max_abs_err": max(r["max_abs_err"] for r in rows),
        "tolerance": PARITY_TOLERANCE_FP32,
        "passed": worst < PARITY_TOLERANCE_FP32,
        "runtime": f"onnxruntime {ort.__version__} (CPUExecutionProvider)",
    }


# ------------------------------------------------------------------------------------- TensorRT


def _precision_flags(quant: str) -> list[str]:
    return ["--bf16"] + (["--fp8"] if quant == "fp8" else [])


Ranges = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # input -> (min, opt, max) shape


def causal_lm_ranges(shapes: ExportShapes, model: CausalLM, *, with_cache: bool) -> Ranges:
    """The TensorRT optimisation profile of a drafter's graph: batch 1..max, tokens 1..1+D, past 1..ctx."""
    c = model.config
    B, T, P = shapes.max_batch, shapes.max_tokens, shapes.max_past
    L, H, hd = len(model.layers), c.num_kv_heads, c.head_dim
    opt_b = max(1, B // 2)
    ranges: Ranges = {"tokens": ((1, 1), (opt_b, T), (B, T))}
    if with_cache:
        for name in ("past_k", "past_v"):
            ranges[name] = ((L, 1, H, 1, hd), (L, opt_b, H, max(1, P // 2), hd), (L, B, H, P, hd))
    return ranges


def trtexec_command(onnx_name: str, engine_name: str, ranges: Ranges, *, quant: str) -> str:
    """The equivalent command line for building the engine on the deployment machine."""
    shape = lambda i: ",".join(f"{name}:{'x'.join(map(str, r[i]))}" for name, r in ranges.items())  # noqa: E731
    return (
        f"trtexec --onnx={onnx_name} --saveEngine={engine_name} --minShapes={shape(0)} --optShapes={shape(1)} "
        f"--maxShapes={shape(2)} {' '.join(_precision_flags(quant))}"
    )


def tensorrt_available() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def build_tensorrt_engine(onnx_path: Path, engine_path: Path, ranges: Ranges, *, quant: str) -> dict:
    """Build and save a serialized engine with the TensorRT Python API (the same settings as `trtexec_command`)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SpecdecError(f"TensorRT cannot parse {onnx_path.name}: {errors[:300]}", "report this with the ONNX file")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in ranges.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    flags = [trt.BuilderFlag.BF16 if hasattr(trt.BuilderFlag, "BF16") else trt.BuilderFlag.FP16]
    if quant == "fp8":
        flags.append(trt.BuilderFlag.FP8)
    for flag in flags:
        config.set_flag(flag)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SpecdecError(
            f"TensorRT could not build an engine from {onnx_path.name}",
            "run the trtexec command in the bundle README for details",
        )
    engine_path.write_bytes(bytes(serialized))
    return {
        "built": True,
        "engine": engine_path.name,
        "tensorrt_version": trt.__version__,
        "precision": [str(f) for f in flags],
        "sha256": sha256_file(engine_path),
    }


# ------------------------------------------------------------------------------------- bundle step


def export_drafter(
    model: CausalLM,
    out_dir: Path,
    *,
    name: str = "draft_model",
    max_batch: int = 64,
    max_draft_len: int = 8,
    ctx: int = 4096,
    quant: str = "none",
    with_cache: bool = True,
    with_plain: bool = True,
    parity_cases: list[tuple[int, int, int]] | None = None,
) -> dict:
    """Export a drafter for the bundle: ONNX graphs, their parity in onnxruntime, a TensorRT engine or a skip record.

    Writes into out_dir: drafter.onnx (and drafter_kv.onnx with the cache), export.json (parity, TensorRT
    result, shapes), README.md (how to build the engine), drafter*.plan where TensorRT is installed.
    Returns export.json's content; its "files" are relative to out_dir. Raises SpecdecError when the
    parity check fails (nothing should ship then).
    """
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnxscript") is None:
        raise SpecdecError(
            "exporting the drafter to ONNX needs onnx, onnxscript and onnxruntime",
            "pip install onnx onnxscript onnxruntime",
        )
    get_format(quant)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # quantize_linear_weights copies the model: a CausalLM too
    fp32 = cast(CausalLM, quantize_linear_weights(model, quant)) if quant != "none" else model
    fp32 = _fp32_copy(fp32).eval()
    shapes = ExportShapes(max_batch=max_batch, max_tokens=1 + max_draft_len, max_past=ctx)
    cases = parity_cases or [(1, 1, 1), (3, 1 + max_draft_len, 7), (max(1, min(max_batch, 5)), 2, 17)]
    # the cache-free graph is the KV graph at past length 0 in effect: with_plain=False leaves it out
    graphs = ([("drafter.onnx", False)] if with_plain or not with_cache else []) + (
        [("drafter_kv.onnx", True)] if with_cache else []
    )
    result: dict = {"drafter": name, "quant": quant, "shapes": dataclasses.asdict(shapes), "graphs": {}, "files": []}
    for file, cached in graphs:
        path = export_onnx(fp32, out_dir / file, with_cache=cached, shapes=shapes)
        parity = check_parity(
            fp32, path, with_cache=cached, cases=cases if cached else [(b, t, 0) for b, t, _ in cases]
        )
        if not parity["passed"]:
            raise SpecdecError(
                f"{file}: onnxruntime differs from torch by {parity['parity_err']:.2e} "
                f"(tolerance {PARITY_TOLERANCE_FP32:g})",
                "the export is wrong; nothing was written to the bundle",
            )
        trt_result = tensorrt_step(path, causal_lm_ranges(shapes, fp32, with_cache=cached), quant, result["files"])
        result["graphs"][file] = {
            "inputs": "tokens, past_k, past_v" if cached else "tokens",
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "parity": parity,
            "tensorrt": trt_result,
        }
        result["files"].append(file)
    (out_dir / "README.md").write_text(export_readme(result, quant))
    result["files"] += ["README.md", "export.json"]
    write_json(out_dir / "export.json", result)
    return result


def tensorrt_step(onnx_path: Path, ranges: Ranges, quant: str, files: list[str]) -> dict:
    """A TensorRT engine beside the ONNX file where tensorrt imports (its name joins `files`), else a skip record; both
    carry the trtexec command that builds it on the deployment machine."""
    engine = onnx_path.name.replace(".onnx", ".plan")
    command = trtexec_command(onnx_path.name, engine, ranges, quant=quant)
    if not tensorrt_available():
        return {"built": False, "skipped": "tensorrt is not importable on this machine", "command": command}
    files.append(engine)
    return build_tensorrt_engine(onnx_path, onnx_path.with_name(engine), ranges, quant=quant) | {"command": command}


def _fp32_copy(model: CausalLM) -> CausalLM:
    import copy

    twin = copy.deepcopy(model) if model.dtype != torch.float32 else model
    return twin.float() if twin.dtype != torch.float32 else twin


def export_readme(result: dict, quant: str) -> str:
    lines = [
        f"# {result['drafter']} drafter: ONNX and TensorRT",
        "",
        "| graph | inputs | parity err (fp32, onnxruntime; max abs err / max(1, max abs logit)) | TensorRT |",
        "|---|---|---|---|",
    ]
    for file, g in result["graphs"].items():
        trt = "built" if g["tensorrt"]["built"] else f"skipped: {g['tensorrt']['skipped']}"
        lines.append(f"| {file} | {g['inputs']} | {g['parity']['parity_err']:.2e} | {trt} |")
    lines += [
        "",
        "Build the engine on the deployment machine (TensorRT installed, the target GPU present):",
        "",
        "```bash",
    ]
    lines += [g["tensorrt"]["command"] for g in result["graphs"].values()]
    lines += ["```", ""]
    if quant != "none":
        note = (
            f"Weights carry {quant} rounding (the acceptance the plan used was measured with them). "
            "TensorRT runs FP8 GEMMs only where the graph has Q/DQ nodes; `--fp8` enables them where present."
        )
        lines += [note, ""]
    shapes = result["shapes"]
    lines.append(
        f"Dynamic range: batch 1..{shapes['max_batch']}, tokens 1..{shapes['max_tokens']}, "
        f"past 1..{shapes['max_past']} (every row of a batch shares one past length)."
    )
    lines += ["", *result.get("readme_extra", [])]
    return "\n".join(lines).rstrip() + "\n"


def parity_summary(result: dict) -> str:
    """One line per graph, for a report."""
    return "; ".join(f"{f}: {g['parity']['parity_err']:.1e}" for f, g in result["graphs"].items())


__all__ = [
    "ExportedForward",
    "Ranges",
    "check_parity",
    "export_drafter",
    "export_module",
    "export_onnx",
    "inverse_frequencies",
    "rope_tables",
    "tensorrt_step",
    "trtexec_command",
]
