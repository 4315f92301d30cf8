"""`specdec-tune check --metrics`: a serving engine's Prometheus scrapes over a window against the bundle's plan.

Synthetic scrapes (vLLM's and SGLang's metric names as their releases define them) check the arithmetic and every
refusal; the scrapes recorded from a live vLLM-CPU server started from a bundle's own serve.sh
(bench/workload_drift.py, tests/data/metrics/) check the verdicts on real traffic, and the live run itself runs where
the vLLM virtualenv is named."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_tune import SpecdecError
from specdec_tune.cli import main
from specdec_tune.pipeline import serving_metrics as sm
from specdec_tune.pipeline import workload_check as wc

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "data" / "metrics"
PLAN = ROOT / "bench" / "results" / "plan_vllm_cpu.json"  # ngram, K = 3, 3, 2, 1 at batch 1, 2, 4, 8
PROFILE = ROOT / "bench" / "results" / "profile_vllm_cpu.json"


def vllm_scrape(
    generated=0, accepted=0, drafts=0, draft_tokens=0, per_pos=(0, 0, 0), finished=0, latency=0.0, running=0, waiting=0
) -> str:
    pos = "".join(
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}\n'
        for i, v in enumerate(per_pos)
    )
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        "# TYPE vllm:generation_tokens counter\n"
        f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {generated}\n'
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}\n'
        "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n"
        f"{pos}"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {finished}\n'
        f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} {finished}\n'
        f'vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} {latency}\n'
    )


def scrapes(*texts: str) -> list[sm.Scrape]:
    return [sm.Scrape(f"scrape{i}", sm.parse_scrape(t, f"scrape{i}")) for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The committed vLLM-CPU plan exported configs-only (vLLM serves it with per-batch K 3, 3, 2, 1); the export reads
    the demo target's config, so the tests that take it are marked demo."""
    out = tmp_path_factory.mktemp("b") / "bundle"
    assert main(["export", "--plan", str(PLAN), "--profile", str(PROFILE), "--out", str(out), "--configs-only"]) == 0
    return out


# ---------------------------------------------------------------------------------------------------- the window


def test_counters_are_differenced_and_the_gauges_sampled():
    """1000 tokens over the window, 300 of them accepted drafts in 200 drafting rounds, 20 requests finished: vLLM's
    mean acceptance length 1 + 300/200 and 1000 − 300 − 20 row-forwards; running + waiting at each scrape; Little's
    mean = Σ latency / window."""
    start = vllm_scrape(generated=50, accepted=10, drafts=10, draft_tokens=30, per_pos=(8, 2, 0), finished=1, latency=2)
    mid = vllm_scrape(running=8, waiting=3)
    end = vllm_scrape(
        generated=1050,
        accepted=310,
        drafts=210,
        draft_tokens=630,
        per_pos=(158, 102, 50),
        finished=21,
        latency=122,
        running=2,
    )
    w = sm.window_figures(scrapes(start, mid, end), window_s=60.0)
    assert (w["engine"], w["generated_tokens"], w["accepted_tokens"], w["drafts"]) == ("vllm", 1000, 300, 200)
    assert w["accepted_per_position"] == [150, 100, 50] and w["forwards"] == 1000 - 300 - 20
    assert w["concurrency_samples"] == [0, 11, 2] and w["little_mean_concurrency"] == pytest.approx(120 / 60)


def test_the_live_interval_follows_from_the_per_position_counts():
    """Per position 150, 100, 50 of 200 rounds: n accepted is 0, 1, 2, 3 with shares 0.25, 0.25, 0.25, 0.25."""
    low, high = wc.live_interval(2.5, 200, [150, 100, 50], 3)
    n = [0, 1, 2, 3]
    var = sum(x * x for x in n) / 4 - (sum(n) / 4) ** 2
    half = 1.959963984540054 * math.sqrt(var / 200)
    assert (low, high) == (pytest.approx(2.5 - half), pytest.approx(2.5 + half))
    low, high = wc.live_interval(2.0, 100, None, 4)  # no distribution: n in [0, K] bounds the variance by K^2 / 4
    assert high - 2.0 == pytest.approx(1.959963984540054 * 2 / 10)


@pytest.mark.parametrize(
    "texts, message",
    [
        (['# TYPE x counter\nx_total{a="1" 3\n'], "is not a Prometheus text scrape"),
        (["<html>not metrics</html>\n"], "is not a Prometheus text scrape"),
        (["\n"], "holds no metrics"),
    ],
)
def test_a_malformed_scrape_is_one_line(texts, message):
    with pytest.raises(SpecdecError, match=message) as e:
        sm.parse_scrape(texts[0], "s.prom")
    assert "\n" not in str(e.value)


def test_counters_that_went_backwards_are_refused():
    with pytest.raises(SpecdecError, match="went backwards .* restarted inside the window"):
        sm.window_figures(scrapes(vllm_scrape(generated=500), vllm_scrape(generated=20)), None)


def test_a_missing_metric_and_a_lone_scrape_are_refused():
    text = vllm_scrape().replace("vllm:spec_decode_num_drafts_total", "vllm:other_total")
    with pytest.raises(SpecdecError, match="has no vllm:spec_decode_num_drafts_total"):
        sm.window_figures(scrapes(text, text), None)
    with pytest.raises(SpecdecError, match="one scrape holds no window"):
        sm.window_figures(scrapes(vllm_scrape()), None)
    other = "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 3\n"
    with pytest.raises(SpecdecError, match="holds no serving engine's metrics"):
        sm.window_figures(scrapes(other, other), None)


def test_an_unreachable_url_is_one_line():
    with pytest.raises(SpecdecError, match="cannot read metrics from http://127.0.0.1:9/metrics"):
        sm.read_scrapes(["http://127.0.0.1:9/metrics"], 5.0, 1.0)
    with pytest.raises(SpecdecError, match="needs a window"):
        sm.read_scrapes(["http://127.0.0.1:9/metrics"], None, 1.0)


def test_durations():
    assert [sm.duration_s(t, "--window") for t in ("10m", "90s", "1h", "2.5")] == [600, 90, 3600, 2.5]
    with pytest.raises(SpecdecError, match="--window 'soon' is not a duration"):
        sm.duration_s("soon", "--window")


# ------------------------------------------------------------------------------------------------- the verdicts


def _window(**figures) -> dict:
    base = {"engine": "vllm", "scrapes": 3, "window_s": 60.0, "generated_tokens": 2000.0, "finished_requests": 40.0}
    return base | figures


@pytest.mark.demo
def test_acceptance_inside_and_drifted_against_the_profiled_interval(bundle):
    """At 4 requests the server runs batch 4's K = 2, where the profile's greedy n-gram record puts vLLM's mean
    acceptance length at 2.15 [2.00-2.28]: a live 2.15 over 400 rounds is inside; a live 1.2 is apart, named with both
    figures, and the re-tune command re-profiles."""
    conc = {"concurrency_samples": [4] * 10, "running_samples": [4] * 10, "little_mean_concurrency": 4.0}
    inside = _window(accepted_tokens=460.0, drafts=400.0, accepted_per_position=[260, 140, 60], **conc)
    r = wc.workload_check(bundle, inside)
    a = r["acceptance"]
    assert a["verdict"] == "inside" and a["draft_len_shares"] == {2: 1.0} and r["fresh"] and r["retune"] is None
    lo, hi = a["profiled_interval"]
    assert lo < a["profiled"] < hi and round(a["profiled"], 4) == 2.1513 and a["live"] == pytest.approx(2.15)
    drifted = _window(accepted_tokens=80.0, drafts=400.0, accepted_per_position=[60, 15, 5], **conc)
    r = wc.workload_check(bundle, drifted)
    assert not r["fresh"] and r["acceptance"]["verdict"] == "drifted"
    assert r["drifted"] == [
        f"workload: acceptance 1.20 live vs {lo:.2f}-{hi:.2f} profiled at K = 2 (100%) (mean acceptance length)"
    ]
    assert r["retune"].startswith("specdec-tune profile --prompts TRAFFIC.jsonl")
    t = r["throughput"]["buckets"]
    assert all(b["live_acceptance_tokens_per_s"] < b["planned_tokens_per_s"] for b in t if b["draft_len"])


@pytest.mark.demo
def test_too_few_rounds_are_not_judged(bundle):
    w = _window(
        accepted_tokens=8.0,
        drafts=40.0,
        accepted_per_position=[6, 1, 1],
        concurrency_samples=[1] * 10,
        running_samples=[1] * 10,
    )
    r = wc.workload_check(bundle, w)
    assert r["acceptance"]["verdict"] == "not judged" and "40 rounds" in r["acceptance"]["why"] and r["fresh"]


@pytest.mark.demo
def test_concurrency_above_the_largest_bucket(bundle):
    """Busy scrapes at 16 requests against a largest bucket of 8: drifted, with the bands' shares; the profile holds no
    batch above 8, so the re-tune command profiles larger ones."""
    w = _window(
        accepted_tokens=280.0,  # 1.70 at the K = 1 of batch 8, where most rows ran: inside
        drafts=400.0,
        accepted_per_position=[280, 0, 0],
        concurrency_samples=[0, 16, 16, 16, 12, 8, 3, 0],
        running_samples=[0, 8, 8, 8, 8, 8, 3, 0],
        little_mean_concurrency=11.0,
    )
    r = wc.workload_check(bundle, w)
    c = r["concurrency"]
    assert c["verdict"] == "drifted" and c["busy_samples"] == 6 and c["share_above"] == pytest.approx(4 / 6)
    assert [b["share"] for b in c["bands"]] == [0, 0, pytest.approx(1 / 6), pytest.approx(1 / 6)]
    assert r["drifted"] == [
        "workload: concurrency 67% of 6 busy scrapes above batch 8, the plan's largest bucket (up to 16 requests "
        "running and waiting)"
    ]
    assert r["retune"].startswith("specdec-tune profile --batch 1,2,4,8,16 ")
    over = r["throughput"]["over_live_concurrency"]
    assert over["planned_tokens_per_s"] == pytest.approx(
        sum(s * b["planned_tokens_per_s"] for s, b in zip([0, 0, 1 / 6, 1 / 6 + 4 / 6], r["throughput"]["buckets"]))
    )
    # two scrapes, both idle: judged on Little's mean over the window
    r = wc.workload_check(
        bundle, w | {"concurrency_samples": [0, 0], "running_samples": [0, 0], "little_mean_concurrency": 3.5}
    )
    assert r["concurrency"]["verdict"] == "inside"
    r = wc.workload_check(
        bundle, w | {"concurrency_samples": [0, 0], "running_samples": [0, 0], "little_mean_concurrency": None}
    )
    assert r["concurrency"]["verdict"] == "not judged"


@pytest.mark.demo
def test_sglang_scrapes_give_tokens_per_forward_and_say_what_sglang_does_not_count(bundle):
    def text(generated: int, verify: int, finished: int) -> str:
        return (
            '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 2\n'
            '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 0\n'
            "# TYPE sglang:generation_tokens counter\n"
            f'sglang:generation_tokens_total{{is_streaming="false",model_name="m"}} {generated}\n'
            "# TYPE sglang:spec_verify_calls counter\n"
            f'sglang:spec_verify_calls_total{{model_name="m"}} {verify}\n'
            "# TYPE sglang:e2e_request_latency_seconds histogram\n"
            f'sglang:e2e_request_latency_seconds_count{{model_name="m"}} {finished}\n'
            f'sglang:e2e_request_latency_seconds_sum{{model_name="m"}} {finished * 2.0}\n'
        )

    w = sm.window_figures(scrapes(text(0, 0, 0), text(1200, 1000, 30)), 60.0)
    assert w["engine"] == "sglang" and w["forwards"] == 1000 and "drafts" not in w
    with pytest.raises(SpecdecError, match="the bundle has no sglang config"):
        wc.served_schedule({"engines": {}, "plan": {}}, "sglang")
    r = wc.workload_check(bundle, w)
    assert r["acceptance"]["figure"] == "tokens per forward" and r["acceptance"]["live"] == pytest.approx(1.2)
    assert "gauges of its last logging interval" in r["engine_note"]


# ----------------------------------------------------------------------------------- recorded from a live server


def _check(bundle: Path, window: str, capsys) -> tuple[int, dict]:
    record = json.loads((ROOT / "bench" / "results" / "workload_drift.json").read_text())
    seconds = next(w["seconds"] for w in record["windows"] if w["window"] == window)
    code = main(["check", str(bundle), "--metrics", str(FIXTURES / window), "--window", f"{seconds:.1f}s", "--json"])
    return code, json.loads(capsys.readouterr().out)["workload"]


@pytest.mark.demo
def test_recorded_calibration_traffic_is_fresh(bundle, capsys):
    code, w = _check(bundle, "calibration", capsys)
    assert code == 0 and w["acceptance"]["verdict"] == "inside" and w["concurrency"]["verdict"] == "inside", w


@pytest.mark.demo
def test_recorded_traffic_of_another_kind_drifts_on_acceptance(bundle, capsys):
    code, w = _check(bundle, "other_text", capsys)
    assert code == 3 and w["acceptance"]["verdict"] == "drifted" and w["concurrency"]["verdict"] == "inside", w
    assert w["drifted"][0].startswith("workload: acceptance ")


@pytest.mark.demo
def test_recorded_traffic_above_the_largest_bucket_drifts_on_concurrency(bundle, capsys):
    code, w = _check(bundle, "concurrency", capsys)
    assert code == 3 and w["concurrency"]["verdict"] == "drifted", w
    assert any(d.startswith("workload: concurrency ") for d in w["drifted"])


@pytest.mark.demo
def test_the_text_report_names_each_drifted_factor(bundle, capsys):
    record = json.loads((ROOT / "bench" / "results" / "workload_drift.json").read_text())
    seconds = next(w["seconds"] for w in record["windows"] if w["window"] == "other_text")
    code = main(["check", str(bundle), "--metrics", str(FIXTURES / "other_text"), "--window", f"{seconds:.1f}s"])
    out = capsys.readouterr().out
    assert code == 3 and "stale: workload: acceptance" in out and "re-tune: specdec-tune profile --prompts" in out
    assert "position 1: accepted in" in out and out.rstrip().endswith("workload stale")


@pytest.mark.demo
@pytest.mark.skipif(not os.environ.get("SPECDEC_TUNE_VLLM_PYTHON"), reason="SPECDEC_TUNE_VLLM_PYTHON names no vLLM")
def test_the_live_server_run(tmp_path):
    """The bench end to end against a vLLM server it starts from the bundle's serve.sh (a few minutes)."""
    out = tmp_path / "wd.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "workload_drift.py"),
            *("--out", str(out), "--requests", "16", "--fixtures", str(tmp_path / "scrapes")),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    codes = {w["window"]: w["check"]["exit_code"] for w in json.loads(out.read_text())["windows"]}
    assert codes == {"calibration": 0, "other_text": 3, "concurrency": 3}


@pytest.mark.demo
def test_serve_sh_passes_the_callers_arguments_after_the_plans(bundle, tmp_path):
    """The live run starts the bundle's own serve.sh with --port: a `vllm` on PATH that prints its argv shows it
    last."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "vllm").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (fake / "vllm").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
    done = subprocess.run(
        ["sh", str(bundle / "vllm" / "serve.sh"), "--port", "8765"], capture_output=True, text=True, env=env
    )
    argv = done.stdout.split("\n")[:-1]
    assert done.returncode == 0 and argv[:2] == ["serve", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert "--speculative-config" in argv and argv[-2:] == ["--port", "8765"]
