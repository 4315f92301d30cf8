"""What the bundle carries besides engine configs: the tuned Triton kernels for the plan's shapes (AOT cubins
per target architecture, `kernels.aot`); for a drafter with its own network, its ONNX graph with the
onnxruntime parity check and a TensorRT engine or the command that builds one (`exporters.onnx_export`); and for a
draft model cut from the target, the checkpoint folder the engines load it from."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.exporters.mechanisms import mechanism
from specdec_tune.kernels.tuning import DEFAULT_TILE_ROWS, ModelShapes, ServedShapes
from specdec_tune.profiles.models.folders import model_config, model_folder
from specdec_tune.profiles.models.llama import CausalLM
from specdec_tune.profiles.models.views import write_cut_draft
from specdec_tune.profiles.schema import Profile

TARGET_ARCHS = ("sm_90", "sm_100")


def ship_kernels(plan: Plan, profile: Profile, staging: Path) -> dict:
    """kernels/ in the bundle: configs for the plan's shapes (timed on a CUDA device, else chosen by the tile rules
    and labelled modeled), compiled for TARGET_ARCHS. Returns the kernel manifest (paths relative to the bundle)."""
    if importlib.util.find_spec("triton") is None:
        return {"skipped": "triton is not installed here", "fix": "pip install triton, then export again"}
    import torch

    from specdec_tune.kernels import aot

    device = torch.device("cuda") if torch.cuda.is_available() and not plan.projected else None
    dtype = {"float32": "float32", "float16": "float16"}.get(profile.target.get("dtype") or "", "bfloat16")
    return aot.build_bundle_kernels(
        served_shapes(plan),
        staging,
        TARGET_ARCHS,
        shapes=target_shapes(profile.target["path"]),
        dtype=dtype,
        device=device,
    )


def served_shapes(plan: Plan) -> ServedShapes:
    """The plan's buckets, context and attention tile as the kernels see them; a plan made on a device without a
    tile (a CPU) gets the NVIDIA one."""
    rows = plan.tile.rows
    return ServedShapes(tuple(plan.schedule), plan.ctx, rows if rows > 1 else DEFAULT_TILE_ROWS)


def target_shapes(path: str):
    """The kernels' view of the target (`kernels.tuning.ModelShapes`) from its config (a Hugging Face folder or GGUF, as
    `profile.target["path"]` names it); no weights are read."""
    _, _, config, _ = model_folder(path)
    return ModelShapes.from_model_config(model_config(config))


DRAFT_CHECKPOINT = (
    "drafter/checkpoint"  # relative to the bundle: the engines' launch commands run from the bundle folder
)


def ship_draft_checkpoint(plan: Plan, profile: Profile, staging: Path) -> str | None:
    """drafter/checkpoint/ for a draft model cut from the target (`draft_model` without model=): every engine loads a
    draft model from a folder of its own, so the target's first layers are written as one: its config with
    num_hidden_layers cut (and `architectures` named), the embedding, those layers, the final norm and the LM head, in
    bfloat16 (float16 for a float16 target). Returns the folder relative to the bundle; None where the plan does not
    speculate or its drafter has a checkpoint, or none."""
    info = next((d for d in profile.drafters if d.name == plan.mechanism), None)
    spelling = mechanism(plan.mechanism)
    if (
        not plan.max_draft_len
        or info is None
        or not spelling.checkpoint
        or spelling.learned_head
        or info.options.get("model")
    ):
        return None
    layers = int((info.model or {})["layers"])
    write_cut_draft(
        profile.target["path"],
        layers,
        staging / DRAFT_CHECKPOINT,
        "float16" if profile.target.get("dtype") == "float16" else "bfloat16",
    )
    return DRAFT_CHECKPOINT


def needs_drafter_network(plan: Plan, profile: Profile) -> bool:
    """Whether the plan speculates with a drafter that is a network of its own (its ONNX graph ships in drafter/)."""
    info = next((d for d in profile.drafters if d.name == plan.mechanism), None)
    return bool(plan.max_draft_len) and info is not None and info.kind != "model_free"


def ship_drafter_onnx(plan: Plan, drafter, staging: Path) -> dict:
    """drafter/ in the bundle for a drafter that is a network of its own, given loaded in fp32 (`drafter`; None for a
    model-free one, or a plan that never speculates)."""
    if drafter is None:
        return {"skipped": f"{plan.mechanism} has no network to export"}
    network, head = getattr(drafter, "model", None), getattr(drafter, "head", None)
    D, ctx = plan.max_draft_len, plan.ctx
    cases = [(1, 1, 1), (3, 1 + D, ctx // 2), (min(plan.max_batch, 4), 2, ctx)]
    try:
        if isinstance(network, CausalLM):
            from specdec_tune.exporters.onnx_export import export_drafter

            return export_drafter(
                network,
                staging / "drafter",
                name=plan.mechanism,
                max_batch=plan.max_batch,
                max_draft_len=D,
                ctx=ctx,
                quant=plan.quant,
                with_plain=False,
                parity_cases=cases,
            )
        if head is not None:  # a learned head: its per-round graphs (exporters.onnx_heads)
            from specdec_tune.exporters.onnx_heads import export_head

            return export_head(
                head,
                staging / "drafter",
                name=plan.mechanism,
                max_batch=plan.max_batch,
                max_draft_len=D,
                ctx=ctx,
                quant=plan.quant,
                parity_cases=cases,
            )
    except ImportError as e:
        raise SpecdecError(
            f"exporting the drafter to ONNX needs {e.name}",
            "pip install onnx onnxscript onnxruntime, or export with --no-onnx",
        ) from None
    return {"skipped": f"ONNX export covers causal-LM drafters and learned heads; {plan.mechanism} is neither"}


def kernels_summary(kernels: dict) -> dict:
    """The manifest's entry for kernels/ (its own manifest lists every binary)."""
    if "skipped" in kernels:
        return kernels
    return {
        "manifest": "kernels/manifest.json",
        "triton_version": kernels["triton_version"],
        "archs": kernels["archs"],
        "binaries": len(kernels["binaries"]),
    }


def onnx_summary(export: dict) -> dict:
    """The manifest's entry for drafter/: files, parity error and whether a TensorRT engine was built, per graph."""
    if "skipped" in export:
        return export
    graphs = export["graphs"]
    return {k: export[k] for k in ("drafter", "quant", "files")} | {
        "parity": {g: r["parity"]["parity_err"] for g, r in graphs.items()},
        "tensorrt": {g: r["tensorrt"].get("built", False) for g, r in graphs.items()},
    }


def check_shipped_kernels(bundle: Path, manifest: dict) -> list[str]:
    """Errors in the bundle's kernels (empty when it holds, or when the bundle carries none)."""
    entry = manifest.get("kernels") or {}
    if "skipped" in entry or not entry:
        return []
    from specdec_tune.kernels import aot

    return aot.check_kernel_manifest(bundle, aot.read_kernel_manifest(bundle))
