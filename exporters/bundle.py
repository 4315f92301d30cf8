"""The bundle: a plan rendered into every engine's files, its manifest, and reading one back.

    bundle/
      README.md            how each engine takes its files, and the decisions made for this plan
      manifest.json        every file's sha256; staleness factors; inputs' hashes; figure sources; validation summary
      validation.json      engine config checks, lossless gate, predicted vs measured throughput, and any repair of it
      inputs/              plan.json and profile.json the bundle was made from
      vllm/ trtllm/ sglang/ speculators/   one folder per engine (engines.py registry)
      kernels/             Triton kernels for the plan's shapes: sources, chosen configs, sm_90 / sm_100 cubins
                           (artifacts.py)
      drafter/             a networked drafter as ONNX, its onnxruntime parity, a TensorRT engine or its build command;
                           checkpoint/: a draft model cut from the target, as the engines load it
      report/              report.md and its PNG plots

This module renders and reads; it measures nothing. `stage` writes a plan's files into a staging folder beside OUT
(each engine config checked against its engine's rules), `write_bundle` adds what the checks found and the manifest,
and `swap_into_place` renames the staging folder over OUT, so OUT holds either the previous bundle or a complete new
one. The checks that measure (the lossless gate, the throughput check, the engine check) and the loop that re-measures
and re-plans are the pipeline's (pipeline/export.py). Reading a bundle parses JSON only; every path in a manifest must
stay inside the bundle folder.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import shutil
from pathlib import Path

import yaml

from specdec_tune import SpecdecError, __version__
from specdec_tune.autotune.plan import cost_model_of, figure_json
from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.exporters.artifacts import (
    check_shipped_kernels,
    kernels_summary,
    onnx_summary,
    ship_draft_checkpoint,
    ship_drafter_onnx,
    ship_kernels,
)
from specdec_tune.exporters.config_checks import check_document
from specdec_tune.exporters.engines import ENGINE_MODEL_IDS, ExportContext, load_schema_file, serving_engines
from specdec_tune.exporters.head_folders import head_errors, head_loads, ship_head_folders
from specdec_tune.exporters.mechanisms import mechanism as mechanism_spelling
from specdec_tune.exporters.memory_limits import engine_memory
from specdec_tune.exporters.native_checks import Facts
from specdec_tune.exporters.report import bundle_readme, write_report
from specdec_tune.exporters.safety import engine_costs, noisy_thresholds, safety_lines, top_band_cost
from specdec_tune.exporters.staleness import changed_factors, staleness_factors
from specdec_tune.exporters.validation_text import lossless_text, throughput_text, tolerance_forgone
from specdec_tune.exporters.versions import DEFAULT_VERSIONS, rules_line
from specdec_tune.profiles.drafters.speculators_layout import head_fields
from specdec_tune.profiles.models.folders import architectures, model_folder
from specdec_tune.profiles.schema import DrafterInfo, Profile
from specdec_tune.records import read_json, sha256_file, write_json
from specdec_tune.settings import ExportSettings

BUNDLE_SCHEMA_VERSION = 1


def _conform(document, schema_file: str, path: Path, what: str, fix: str) -> None:
    """One line naming the first place a document leaves its JSON Schema (so that no later read can crash)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(load_schema_file(schema_file)).iter_errors(document)
    )
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "(top level)"
        raise SpecdecError(f"{path} is not a valid {what}: at {where}, {error.message[:160]}", fix)


def resolve_versions(overrides: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The engine versions to export for: the defaults, each override checked against the release lines the tool
    knows."""
    versions = dict(DEFAULT_VERSIONS)
    for engine, version in overrides:
        if engine not in versions:
            raise SpecdecError(f"unknown engine {engine!r}", f"use one of {', '.join(versions)}")
        rules_line(engine, version)
        versions[engine] = version
    return versions


def head_config_fields(mechanism: str, options: dict) -> dict:
    """A learned head's own config fields, refused with one line where one an engine needs is missing."""
    spelling = mechanism_spelling(mechanism)
    if not spelling.learned_head or not options:  # no drafter: the plan never speculates
        return {}
    fields = head_fields(options)
    fields |= {field: value for field, value, _ in spelling.head_defaults if fields.get(field) is None}
    where = f"the {mechanism} head's config.json ({options.get('model') or 'none: a random-weight head has no folder'})"
    for field, engine in spelling.needs:
        if fields.get(field) in (None, {}, []):
            raise SpecdecError(
                f"{where} has no {field}, which {engine} needs",
                f"give a {mechanism} head whose config.json sets {field}",
            )
    layer_type = (fields.get("transformer_layer_config") or {}).get("model_type", "llama")
    for engine, builds in spelling.layer_types:
        if layer_type not in builds:
            raise SpecdecError(
                f"{where} has transformer_layer_config.model_type {layer_type!r}, which {engine} refuses "
                f"(it builds {' or '.join(builds)} layers)",
                f"train the head with `specdec-tune train-drafter` (its layer is llama-style whatever the target) "
                f"or give one whose transformer_layer_config is {' or '.join(builds)}",
            )
    return fields


def plan_drafter_info(plan: Plan, profile: Profile) -> DrafterInfo | None:
    """The profile's record of the drafter the plan speculates with (None where it never speculates); a plan whose
    mechanism the profile did not measure is refused."""
    if not plan.max_draft_len:
        return None
    info = next((d for d in profile.drafters if d.name == plan.mechanism), None)
    if info is None:
        raise SpecdecError(
            f"the plan speculates with {plan.mechanism!r}, which its profile did not measure",
            "export with the profile the plan was searched on, or re-run `specdec-tune search`",
        )
    return info


def export_context(
    plan: Plan, profile: Profile, s: ExportSettings, versions: dict, shipped_draft: str | None
) -> ExportContext:
    """What every engine renders from: the plan, the drafter's record, the target as the engines load it, and the
    plan's cost model for what the plan did not choose (a deviation's predicted tokens/s)."""
    info = plan_drafter_info(plan, profile)
    _, folder, target_config, _ = model_folder(profile.target["path"])
    target_path = profile.target["path"]
    cost = cost_model_of(profile, plan)

    def predict(batch: int, draft_len: int) -> dict:
        return figure_json(cost.predict(batch, draft_len, plan.mechanism, plan.quant).tokens_per_s)

    return ExportContext(
        mechanism=plan.mechanism,
        quant=plan.quant,
        schedule=plan.schedule,
        max_batch=plan.max_batch,
        drafter=info.model_dump(mode="json") if info else {},
        target_model=s.engine_model or ENGINE_MODEL_IDS.get(target_path, target_path),
        drafter_model=shipped_draft or ((info.options.get("model") or None) if info else None),
        versions=versions,
        single_draft_len=plan.single_draft_len.draft_len,
        memory=engine_memory(plan),
        head=head_config_fields(plan.mechanism, info.options if info else {}),
        target_architectures=tuple(architectures(target_config, f"{folder}/config.json")),
        target_config=target_config,
        target_folder=folder,
        predict=predict,
        schedule_pricing=(
            plan.schedule_pricing.model_dump()
            | {"buckets": {b.batch: b.engine_costs.model_dump() for b in plan.buckets if b.engine_costs}}
            if plan.schedule_pricing
            else None
        ),
        data_parallel=s.data_parallel,
        profile_engine=profile.engine.get("name") or None,
    )


def figure_sources(plan: Plan) -> dict:
    counts: dict[str, int] = {}
    for b in plan.buckets:
        for fig in (getattr(b.predicted, name) for name in type(b.predicted).model_fields):
            if fig is not None:  # verify / draft / host are null where the engine timed whole rounds
                counts[fig.source] = counts.get(fig.source, 0) + 1
    return {
        "predicted_figures_by_source": counts,
        "device_times": plan.device.times,
        "acceptance": "measured on the calibration split (AL below D_max derived from the D_max rounds: modeled)",
    }


@dataclasses.dataclass(frozen=True)
class Staged:
    """What one plan renders into the staging folder before anything is measured."""

    ctx: ExportContext
    engines: dict
    configs: list
    safety: dict
    kernels: dict
    drafter_onnx: dict
    heads: dict  # the learned head's folder per engine, and which engines refused it (head_folders.ShippedHeads)


def stage(plan: Plan, profile: Profile, s: ExportSettings, versions: dict, staging: Path, drafter=None) -> Staged:
    """Engine configs (each checked against its engine's rules), kernels and, given the loaded `drafter` (a network of
    its own, in fp32), its ONNX graph, in a fresh staging folder."""
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    ctx = export_context(plan, profile, s, versions, ship_draft_checkpoint(plan, profile, staging))
    heads = ship_head_folders(ctx, staging)
    ctx = dataclasses.replace(ctx, head_folders=heads.folders, head_refused=heads.refused)
    engines, configs = {}, []
    for name, engine in serving_engines().items():
        files = engine.render(ctx)
        for rel, text in files.files.items():
            (staging / engine.folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / engine.folder / rel).write_text(text)
        runs = [(b, d) for b, d in files.deviation["schedule"]] if files.deviation else ctx.schedule
        facts = Facts(ctx.target_folder, ctx.max_batch, runs)
        engines[name] = {
            "version": versions[name],
            "rules": rules_line(name, versions[name]).source,
            "folder": engine.folder,
            "files": sorted(files.files),
            "decisions": files.decisions,
            "gates": files.gates,
            **({"deviation": files.deviation} if files.deviation else {}),
        }
        configs.append(check_document(engine, files.document, versions[name], staging / engine.folder, facts))
    bad = [c for c in configs if c["errors"]]
    if bad:
        raise SpecdecError(
            f"the {bad[0]['engine']} config fails its check: {bad[0]['errors'][0]}", "report this with the plan.json"
        )
    for name, load in head_loads(ctx, staging, ctx.target_folder, ctx.target_config).items():
        engines[name]["head_load"] = load
        for error in head_errors(load, engines[name].get("deviation")):
            raise SpecdecError(f"the {name} head folder: {error}", "report this with the head's config.json")
    dtype_bytes = 4 if profile.target.get("dtype") == "float32" else 2
    safety = {
        "noisy_thresholds": noisy_thresholds(ctx),
        "top_band": top_band_cost(ctx, dtype_bytes, staging),
        "engine_costs": engine_costs(ctx),
    }
    kernels = ship_kernels(plan, profile, staging)
    drafter_onnx = ship_drafter_onnx(plan, drafter, staging) if s.onnx_drafter else {"skipped": "--no-onnx"}
    return Staged(ctx, engines, configs, safety, kernels, drafter_onnx, dataclasses.asdict(heads))


def write_bundle(
    staging: Path, s: ExportSettings, plan: Plan, profile: Profile, versions: dict, staged: Staged, validation: dict
) -> dict:
    """validation.json, the inputs, the report, the README and, last, the manifest hashing them all."""
    write_json(staging / "validation.json", validation)
    (staging / "inputs").mkdir()
    shutil.copyfile(s.plan, staging / "inputs" / "plan.json")
    shutil.copyfile(s.profile, staging / "inputs" / "profile.json")
    write_report(staging / "report", plan, profile, staged.engines, validation)
    (staging / "README.md").write_text(bundle_readme(plan, staged.engines, staged.safety))
    tp = validation["throughput"]
    manifest = {
        "schema_version": BUNDLE_SCHEMA_VERSION,
        "tool_version": __version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "plan": {
            "sha256": sha256_file(s.plan),
            "mechanism": plan.mechanism,
            "quant": plan.quant,
            "schedule": [list(bd) for bd in plan.schedule],
            "max_batch": plan.max_batch,
        },
        "profile": {"sha256": sha256_file(s.profile), "fingerprint": profile.fingerprint},
        "target": profile.target,
        "drafter": staged.ctx.drafter,
        "heads": staged.heads,
        "device": plan.device.model_dump(mode="json"),
        "factors": staleness_factors(plan, profile, versions),
        # the engine the figures were measured in (its config is the one they hold for); none for this tool's own loop
        "primary_engine": profile.engine.get("name") or None,
        "engines": staged.engines,
        "figures": figure_sources(plan),
        "kernels": kernels_summary(staged.kernels),
        "drafter_onnx": onnx_summary(staged.drafter_onnx),
        "validation": {
            "configs_ok": True,
            "speculating_batches": [B for B, D in plan.schedule if D > 0],
            "buckets": len(plan.schedule),
            "tolerance_forgone": tolerance_forgone(plan),
            "lossless": lossless_text(validation["lossless"]),
            "throughput": throughput_text(tp),
            "throughput_worst_error_pct": (tp.get("worst") or {}).get("error_pct"),
            "device_drift_pct": tp.get("device_drift_pct"),
            "repairs": validation.get("repairs", []),
            "schedule_safety": safety_lines(staged.safety),
        },
        "files": {str(p.relative_to(staging)): sha256_file(p) for p in sorted(staging.rglob("*")) if p.is_file()},
    }
    write_json(staging / "manifest.json", manifest)
    return manifest


# ------------------------------------------------------------------------- the bundle folder: staged, then swapped in


def staging_folder(out: Path) -> Path:
    """Where this process stages a bundle for OUT: beside it, so that the swap is a rename."""
    return out.parent / f".{out.name}.staging-{os.getpid()}"


def refuse_foreign_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (not (out / "manifest.json").is_file() and any(out.iterdir()))):
        raise SpecdecError(f"{out} exists and is not a bundle", "choose an empty or new folder with --out")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_interrupted(out: Path) -> None:
    """Clean up after an export killed mid-way (SIGKILL leaves its staging folder, or, between the two renames
    of the swap, the previous bundle under its `.old-PID` name): put the previous bundle back, drop the rest."""
    if not out.parent.is_dir() or not any(out.parent.glob(f".{out.name}.*-*")):
        return
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for leftover in sorted(out.parent.glob(f".{out.name}.*-*")):
            kind, _, pid = leftover.name.rpartition("-")
            if not pid.isdigit() or not kind.endswith((".staging", ".old")) or _pid_alive(int(pid)):
                continue
            if kind.endswith(".old") and not out.exists():
                leftover.rename(out)
            else:
                shutil.rmtree(leftover, ignore_errors=True)


def swap_into_place(staging: Path, out: Path) -> None:
    """Replace OUT by the staged bundle with renames, under a lock: a reader never sees half a bundle, and
    two exports into one folder land one after the other."""
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            refuse_foreign_folder(out)
            out.rename(old)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- reading a bundle


def read_manifest(bundle: Path) -> dict:
    """The manifest, with every listed file inside the bundle and matching its hash (no code is run)."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise SpecdecError(f"bundle folder not found: {bundle}", "pass the folder `specdec-tune export` wrote")
    manifest = read_json(bundle / "manifest.json", "bundle manifest")
    if (
        not isinstance(manifest, dict)
        or manifest.get("schema_version") != BUNDLE_SCHEMA_VERSION
        or not isinstance(manifest.get("files"), dict)
    ):
        raise SpecdecError(
            f"{bundle / 'manifest.json'} is not a version-{BUNDLE_SCHEMA_VERSION} bundle manifest",
            "re-export the bundle",
        )
    _conform(
        manifest,
        "manifest.schema.json",
        bundle / "manifest.json",
        "bundle manifest",
        "the bundle was tampered with: re-export it",
    )
    root = bundle.resolve()
    for rel, digest in manifest["files"].items():
        path = bundle / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise SpecdecError(
                f"manifest path {rel!r} escapes the bundle folder", "the bundle was tampered with: re-export it"
            )
        if path.is_symlink() or any(
            (bundle / parent).is_symlink() for parent in Path(rel).parents if str(parent) != "."
        ):
            raise SpecdecError(
                f"bundle file {rel} is (or lies under) a symlink", "the bundle was tampered with: re-export it"
            )
        if not path.resolve().is_relative_to(root):
            raise SpecdecError(
                f"manifest path {rel!r} escapes the bundle folder", "the bundle was tampered with: re-export it"
            )
        if not path.is_file():
            raise SpecdecError(f"bundle file {rel} is missing", "re-export the bundle")
        if sha256_file(path) != digest:
            raise SpecdecError(
                f"bundle file {rel} does not match its hash in the manifest (edited by hand?)", "re-export the bundle"
            )
    extra = sorted(
        str(p.relative_to(bundle))
        for p in bundle.rglob("*")
        if (p.is_file() or p.is_symlink())
        and p.name != "manifest.json"
        and str(p.relative_to(bundle)) not in manifest["files"]
    )
    if extra:
        raise SpecdecError(
            f"bundle holds files its manifest does not list, e.g. {extra[0]}", "remove them or re-export the bundle"
        )
    return manifest


def check_bundle_files(bundle: Path) -> dict:
    """A written bundle without measuring: its hashes, each engine's config against its rules (and the engine's own code
    where it runs here), and its kernels against their manifest."""
    manifest = read_manifest(bundle)
    engines = serving_engines()
    result: dict = {"hashes": f"{len(manifest['files'])} files match the manifest", "configs": []}
    try:
        target_folder = model_folder(manifest["target"]["path"])[1]
    except SpecdecError:
        target_folder = None  # the engines' own checks that need the target's config say they did not run
    for name, entry in manifest["engines"].items():
        engine = engines.get(name)
        if engine is None:
            raise SpecdecError(
                f"the manifest names an unknown engine {name!r}", "re-export the bundle with this version"
            )
        rel = f"{entry['folder']}/{engine.document}"
        if rel not in manifest["files"]:
            result["configs"].append(check_document(engine, None, entry["version"]))
            continue
        try:
            text = (Path(bundle) / rel).read_bytes().decode("utf-8")
            document = yaml.safe_load(text) if rel.endswith(".yaml") else json.loads(text)
        except (yaml.YAMLError, ValueError) as e:  # ValueError: JSON and UTF-8 decoding errors
            first = str(e).splitlines()[0]
            raise SpecdecError(
                f"bundle file {rel} does not parse as plain data ({first})",
                "YAML tags and other constructors are refused: re-export the bundle",
            ) from None
        runs = (entry.get("deviation") or {}).get("schedule") or manifest["plan"]["schedule"]
        facts = Facts(target_folder, manifest["plan"]["max_batch"], [(b, d) for b, d in runs])
        result["configs"].append(
            check_document(engine, document, entry["version"], Path(bundle) / entry["folder"], facts)
        )
    kernel_errors = check_shipped_kernels(Path(bundle), manifest)
    result["kernels"] = {"errors": kernel_errors, "checked": (manifest.get("kernels") or {}).get("binaries", 0)}
    result["passed"] = all(not c["errors"] for c in result["configs"]) and not kernel_errors
    return result


def check_bundle(bundle: Path, *, target: str | None = None, versions: tuple[tuple[str, str], ...] = ()) -> dict:
    """`specdec-tune check`: which staleness factors changed between the bundle and this environment."""
    return {"bundle": str(bundle)} | changed_factors(read_manifest(bundle), target=target, versions=versions)
