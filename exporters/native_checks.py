"""The engines' own code as the check of a bundle's files, each engine in its own interpreter.

An engine's packages pin versions that clash with this tool's, so each runs in a virtualenv of its own, named by an
environment variable (or in this interpreter where the package imports here). A short program runs there on the
bundle's file as written and prints one JSON line; what it reports is compared with what the bundle means to run.

    vLLM         SPECDEC_TUNE_VLLM_PYTHON         EngineArgs(model=target, speculative_config=<file>)
                                                  .create_engine_config(): the SpeculativeConfig against the target's
                                                  config (and the head's), then the whole VllmConfig where this
                                                  platform's model runner takes the method; vLLM's own dense lookup
                                                  (build_dynamic_sd_schedule_lookup) gives K per batch
    speculators  SPECDEC_TUNE_SPECULATORS_PYTHON  SpeculatorModelConfig.from_pretrained on a folder holding the bundle's
                                                  config.json: the class registered for its type, the fields kept
    SGLang       SPECDEC_TUNE_SGLANG_PYTHON       prepare_server_args (SGLang's argument parser) on every launch argv;
                                                  AdaptiveSpeculativeParams on adaptive.json gives the steps per batch
                                                  size (its full resolution needs a GPU build of torchvision: not run
                                                  here)
    TensorRT-LLM not installable here             the rules in trtllm_config.py, per release line (versions.py)

A check that cannot run (no interpreter) raises `EngineMissing`; the caller falls back to the schema and the rules and
says so in validation.json.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from specdec_tune.profiles.models.views import engine_model_view


class EngineMissing(ImportError):
    """No interpreter with the engine's package: the engine's own check cannot run here."""


@dataclasses.dataclass(frozen=True)
class Facts:
    """What an engine's own check needs beyond the file: where the target's config is, and what the engine should
    run."""

    target_folder: Path | None  # the target as a Hugging Face folder, where it is on this machine
    max_batch: int
    runs: list[tuple[int, int]]  # (batch bucket, D) the engine is meant to run: the plan's, or its recorded deviation
    max_model_len: int | None = None  # None: the target config's own

    def k_at(self, batch: int) -> int:
        return next((d for b, d in self.runs if b >= batch), 0)


def interpreter(package: str, variable: str) -> str:
    if importlib.util.find_spec(package) is not None:
        return sys.executable
    python = os.environ.get(variable)
    if not python or not Path(python).is_file():
        raise EngineMissing(f"{package}: set {variable} to a python that has it")
    return python


def run_program(python: str, program: str, job: dict, cwd: Path, timeout_s: float = 600) -> dict:
    """Run `program` with the job's JSON path as its argument; its last line starting with RESULT is the answer."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_LOGGING_LEVEL="ERROR",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        try:
            done = subprocess.run(
                [python, "-c", program, str(job_path)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                cwd=cwd,
            )
        except subprocess.TimeoutExpired:
            return {"errors": [f"the check program ran past {timeout_s:.0f} s ({python})"]}
    lines = [line[len("RESULT ") :] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {
            "errors": [f"the check program failed (exit {done.returncode}): {tail[-1] if tail else 'no output'}"[:400]]
        }
    return json.loads(lines[-1])


def _k_mismatch(what: str, k_per_batch: list[int], facts: Facts) -> list[str]:
    wrong = [b for b, k in enumerate(k_per_batch, 1) if b <= facts.max_batch and k != facts.k_at(b)]
    return (
        [f"{what} runs K={k_per_batch[wrong[0] - 1]} at batch {wrong[0]}, the bundle means {facts.k_at(wrong[0])}"]
        if wrong
        else []
    )


# ---------------------------------------------------------------------------- vLLM

_VLLM = r"""
import json, sys
job = json.load(open(sys.argv[1]))
import vllm
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
config, out = job["config"], {"version": vllm.__version__, "errors": [], "notes": []}
fields = set(
    getattr(SpeculativeConfig, "__pydantic_fields__", None) or getattr(SpeculativeConfig, "__dataclass_fields__", {})
)
out["errors"] += [f"a field vLLM does not know: {k}" for k in sorted(set(config) - fields)]
args = EngineArgs(
    model=job["target"],
    speculative_config=dict(config),
    max_num_seqs=job["max_batch"],
    max_model_len=job["max_model_len"],
)
try:
    vc = args.create_engine_config()
    out["built"] = "VllmConfig"
    # the CUDA-graph sizes vLLM's own rule captures on a GPU (this platform captures none): graphs on, defaults left
    # to it
    try:
        from vllm.config.compilation import CUDAGraphMode
        cc = vc.compilation_config
        cc.cudagraph_mode, cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes = (
            CUDAGraphMode.FULL_AND_PIECEWISE,
            None,
            None,
        )
        vc.model_config.enforce_eager = False
        vc._set_cudagraph_sizes()
        out["cudagraph_capture_sizes"] = list(cc.cudagraph_capture_sizes)
    except Exception as e:
        out["notes"].append(" ".join(f"CUDA-graph sizes not computed: {type(e).__name__}: {e}".split())[:300])
except Exception as e:
    msg = " ".join(f"{type(e).__name__}: {e}".split())
    if (
        "Model Runner V1 does not support" in msg
        or "Model Runner V2 does not yet support" in msg
        or ("required for" in msg and "install" in msg.lower())
    ):
        out["built"] = "fields only"
        out["notes"].append("not built on this platform: " + msg[:300])
    else:
        out["errors"].append("vLLM refuses it: " + msg[:400])
ranges = config.get("num_speculative_tokens_per_batch_size")
try:
    out["k_per_batch"] = (
        build_dynamic_sd_schedule_lookup(
            ranges,
            vllm_max_batch_size=job["max_batch"],
            vllm_num_speculative_tokens=config["num_speculative_tokens"],
        )[1:]
        if ranges
        else [config["num_speculative_tokens"]] * job["max_batch"]
    )
except ValueError as e:
    out["errors"].append(f"vLLM's schedule lookup refuses it: {e}")
print("RESULT " + json.dumps(out))
"""


def check_vllm(document: dict, folder: Path, facts: Facts) -> dict:
    python = interpreter("vllm", "SPECDEC_TUNE_VLLM_PYTHON")
    if facts.target_folder is None:
        raise EngineMissing("vllm: the target is not on this machine")
    with tempfile.TemporaryDirectory() as tmp:
        view = engine_model_view(facts.target_folder, Path(tmp) / "target")
        config = json.loads(
            (folder / "speculative_config.json").read_text()
        )  # the file as written, not the document in memory
        out = run_program(
            python,
            _VLLM,
            {"config": config, "target": str(view), "max_batch": facts.max_batch, "max_model_len": facts.max_model_len},
            cwd=folder.parent,
        )  # paths are relative to the bundle
    errors = out.get("errors", []) + (
        _k_mismatch("vLLM's schedule lookup", out["k_per_batch"], facts) if "k_per_batch" in out else []
    )
    how = f"vLLM {out.get('version', '?')}'s own EngineArgs ({out.get('built', 'not built')}) and schedule lookup"
    notes = out.get("notes", [])
    if "cudagraph_capture_sizes" in out and "k_per_batch" in out:
        uncovered = uncovered_decode_shapes(out["cudagraph_capture_sizes"], out["k_per_batch"])
        errors += [
            f"no CUDA graph vLLM captures by default fits a decode batch of {b} requests at K={k} "
            f"({b * (1 + k)} tokens)"
            for b, k in uncovered[:3]
        ]
        if not uncovered:
            notes.append(
                "vLLM's default CUDA-graph capture sizes (its own rule, as on a GPU: "
                f"{len(out['cudagraph_capture_sizes'])} sizes up to "
                f"{max(out['cudagraph_capture_sizes'])} tokens) fit every batch x (1+K) of the schedule"
            )
            how += " and CUDA-graph sizes"
    return {"checked_with": how, "errors": errors, "notes": notes}


def uncovered_decode_shapes(capture_sizes: list[int], k_per_batch: list[int]) -> list[tuple[int, int]]:
    """(batch, K) whose uniform decode step no captured graph serves: vLLM pads B x (1+K) tokens up to a capture size
    that is a multiple of 1+K (vllm/config/vllm.py `_set_cudagraph_sizes`), else runs it eagerly."""
    return [
        (b, k)
        for b, k in enumerate(k_per_batch, 1)
        if not any(s >= b * (1 + k) and s % (1 + k) == 0 for s in capture_sizes)
    ]


# ---------------------------------------------------------------------------- speculators

_SPECULATORS = r"""
import json, shutil, sys, tempfile
job = json.load(open(sys.argv[1]))
import importlib.metadata
from speculators import SpeculatorModelConfig
import speculators.models
raw, out = json.load(open(job["config"])), {"version": importlib.metadata.version("speculators"), "errors": []}
folder = tempfile.mkdtemp()
shutil.copy(job["config"], folder + "/config.json")
try:
    cfg = SpeculatorModelConfig.from_pretrained(folder)
    registered = (SpeculatorModelConfig.registry or {}).get(raw["speculators_model_type"])
    if registered is None or type(cfg) is not registered:
        out["errors"].append(
            f"loaded as {type(cfg).__name__}, not the class registered for {raw['speculators_model_type']!r}"
        )
    again = cfg.to_dict()
    out["errors"] += [
        f"{k} changed on load: {raw[k]!r} -> {again.get(k)!r}"
        for k in job["fields"]
        if k in raw and again.get(k) != raw[k]
    ]
    layer = again.get("transformer_layer_config") or {}
    out["errors"] += [
        f"transformer_layer_config.{k} changed on load"
        for k in ("model_type", "hidden_size", "num_hidden_layers")
        if k in raw.get("transformer_layer_config", {}) and layer.get(k) != raw["transformer_layer_config"][k]
    ]
    out["verifier_architectures"] = list(cfg.speculators_config.verifier.architectures or [])
except Exception as e:
    out["errors"].append(" ".join(f"speculators refuses it: {type(e).__name__}: {e}".split())[:400])
print("RESULT " + json.dumps(out))
"""


def check_speculators(document: dict, folder: Path, facts: Facts) -> dict:
    from specdec_tune.profiles.drafters.speculators_layout import ALGORITHM_FIELDS

    python = interpreter("speculators", "SPECDEC_TUNE_SPECULATORS_PYTHON")
    out = run_program(
        python,
        _SPECULATORS,
        {
            "config": str(folder / "config.json"),
            "fields": [f for f in ALGORITHM_FIELDS if f != "transformer_layer_config"],
        },
        cwd=folder,
    )
    return {
        "checked_with": f"speculators {out.get('version', '?')}'s own SpeculatorModelConfig.from_pretrained",
        "errors": out.get("errors", []),
    }


# ---------------------------------------------------------------------------- SGLang

_SGLANG = r"""
import contextlib, importlib.metadata, io, json, sys
job = json.load(open(sys.argv[1]))
from sglang.srt.server_args import prepare_server_args
out = {"version": importlib.metadata.version("sglang"), "errors": []}
for argv in job["argvs"]:
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            prepare_server_args(argv)
    except SystemExit:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        out["errors"].append(
            f"SGLang's argument parser refuses {' '.join(argv[:6])} ...: {lines[-1] if lines else 'exit'}"
        )
if job.get("adaptive"):
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
    params = AdaptiveSpeculativeParams(job["adaptive"]["initial_steps"], job["adaptive"]["path"])
    params.set_cuda_graph_bs(job["adaptive"]["graphs"])
    out["k_per_batch"] = [params.get_steps_for_batch(b) for b in range(1, job["max_batch"] + 1)]
print("RESULT " + json.dumps(out))
"""


def check_sglang(document: dict, folder: Path, facts: Facts) -> dict:
    python = interpreter("sglang", "SPECDEC_TUNE_SGLANG_PYTHON")
    launch = ["python", "-m", "sglang.launch_server"]
    argvs = [b["argv"][len(launch) :] for b in document.get("bands", [])]
    job: dict = {"argvs": argvs, "max_batch": facts.max_batch}
    if "adaptive" in document:
        argv = document["adaptive"]["argv"][len(launch) :]
        argvs.append(argv)
        flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
        graphs = [int(a) for a in argv[argv.index("--cuda-graph-bs-decode") + 1 :] if a.isdigit()]
        job["adaptive"] = {
            "path": str(folder / flag("--speculative-adaptive-config")),
            "initial_steps": int(flag("--speculative-num-steps")),
            "graphs": graphs,
        }
    out = run_program(python, _SGLANG, job, cwd=folder)
    errors = out.get("errors", []) + (
        _k_mismatch("SGLang's adaptive controller", out["k_per_batch"], facts) if "k_per_batch" in out else []
    )
    how = f"SGLang {out.get('version', '?')}'s own argument parser" + (
        " and adaptive controller" if "adaptive" in job else ""
    )
    # prepare_server_args parses; ServerArgs' resolution (its speculative rules, the draft config's load) runs when a
    # server starts on its GPU: a learned head's config load, class and weights are checked apart (sglang_head_check)
    note = "not run: ServerArgs' resolution at server start (speculative rules, draft config load) needs SGLang's GPU"
    return {"checked_with": how, "errors": errors, "notes": [note]}
