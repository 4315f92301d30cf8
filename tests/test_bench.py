"""Each benchmark script runs end to end in its reduced mode, so that none of them rots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.demo


def _run(script: str, out: Path) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_decision_quality_quick(tmp_path):
    r = _run("decision_quality.py", tmp_path / "dq.json")
    assert r["source"] == "measured" and len(r["sweep"]) == len(r["buckets"]) * (r["max_draft_len"] + 1)
    for row in r["buckets"]:
        assert row["vs_oracle"]["oracle"] == 1.0 and all(0 < v <= 1.0 + 1e-12 for v in row["vs_oracle"].values())
        assert row["tokens_per_s"]["no_spec"] > 0
    assert r["fidelity"]["tokens_per_s_median_err_pct"] >= 0 and r["cost"]["oracle_sweep_target_forwards"] > 0
    assert (tmp_path / "dq.md").read_text().startswith("decision quality")


def test_al_derivation_quick(tmp_path):
    r = _run("al_derivation.py", tmp_path / "al.json")
    rows = r["drafters"]["ngram"]["rows"]
    assert [x["draft_len"] for x in rows] == [1, 2] and all(x["direct"] >= 1.0 and x["derived"] >= 1.0 for x in rows)


def test_tuning_cost_quick(tmp_path):
    r = _run("tuning_cost.py", tmp_path / "tc.json")
    assert r["target_forwards"] > 0 and r["profile_s"] > 0 and r["search_s"] > 0
