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


def test_learned_heads_extrapolation_and_draft_curves(tmp_path):
    """The learned-heads summary: the learning-curve fit recovers a known log-linear curve, and the draft-time curves
    come out of a profile per mechanism and batch with their last-to-first ratio."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learned_heads

    curve = [{"training_tokens": n, "tokens_per_forward": 1.0 + 0.1 * __import__("math").log(n / 1000)} for n in (1000, 10_000, 100_000)]
    e = learned_heads.extrapolate(curve, 1.5, tokens_per_s=1000.0)
    assert e["source"] == "modeled" and abs(e["tokens_needed"] / (1000 * 2.718281828 ** 5) - 1) < 1e-6
    assert abs(e["train_hours_at_run_throughput"] - e["tokens_needed"] / 1000 / 3600) < 1e-9
    falling = [dict(p, tokens_per_forward=2 - p["tokens_per_forward"]) for p in curve]
    assert "does not grow" in learned_heads.extrapolate(falling, 1.5, 1.0)["note"]
    profile = {"draft": [{"mechanism": "dflash", "quant": "none", "batch": 1, "draft_len": d, "median_ms": 10.0 + 0.1 * d, "source": "measured"}
                         for d in (1, 7)] + [{"mechanism": "ngram", "quant": "none", "batch": 1, "draft_len": 1, "median_ms": 1.0, "source": "measured"}]}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    curves = learned_heads.draft_curves(tmp_path / "p.json")
    assert set(curves) == {"dflash"} and abs(curves["dflash"]["1"]["ratio_last_to_first"] - 10.7 / 10.1) < 1e-9
