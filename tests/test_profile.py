"""profile: adaptive sampling, the measurement log, the profile schema, and end-to-end runs on the demo
target (reuse on a matching fingerprint, resume after SIGKILL)."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specdec_tune import SpecdecError
from specdec_tune.profiles import intervals
from specdec_tune.profiles.schema import SCHEMA_VERSION, load_profile
from specdec_tune.profiles.store import MeasurementLog
from specdec_tune.profiles.torch_profile import TorchProfiler
from specdec_tune.profiles.verify_curve import adaptive_sample, fill_curve
from specdec_tune.progress import Progress
from specdec_tune.settings import ProfileSettings

# ---------------------------------------------------------------------------- adaptive sampling


def test_adaptive_sampling_finds_the_bend_and_skips_flat_stretches():
    curve = lambda x: 10.0 if x <= 6 else 10.0 + 5.0 * (x - 6)  # flat, then compute-bound  # noqa: E731
    calls = []
    measured = adaptive_sample(lambda x: calls.append(x) or curve(x), 1, 16, 0.03, [1, 2, 4, 8, 16])
    assert 6 in measured and 7 in measured  # both sides of the bend were measured
    assert len(calls) == len(set(calls)) < 16  # each point once, and not all of them
    filled = fill_curve(measured, range(1, 17))
    assert [x for x, _, _ in filled] == list(range(1, 17))
    for x, y, source in filled:
        assert source == ("measured" if x in measured else "interpolated")
        assert y == pytest.approx(curve(x), rel=0.03)


def test_adaptive_sampling_does_not_chase_noise():
    """A straight line timed with ±10% noise: misses inside the noise bisect nothing (3% alone would bisect most
    gaps); a bend larger than the noise is still found."""
    rng = random.Random(1)
    line = lambda x: 10.0 + 0.5 * x  # noqa: E731
    noisy = adaptive_sample(
        lambda x: line(x) * (1 + rng.uniform(-0.1, 0.1)), 1, 16, 0.03, [1, 2, 4, 8, 16], noise=lambda x: 0.1 * line(x)
    )
    assert len(noisy) <= 8  # the seeds and at most one midpoint per gap: no gap bisected twice
    blind = adaptive_sample(
        lambda x: line(x) * (1 + random.Random(x).uniform(-0.1, 0.1)), 1, 16, 0.03, [1, 2, 4, 8, 16]
    )
    assert len(blind) == 16  # the tolerance alone chases the noise into every point
    bend = lambda x: 10.0 if x <= 6 else 10.0 + 5.0 * (x - 6)  # noqa: E731
    found = adaptive_sample(bend, 1, 16, 0.03, [1, 2, 4, 8, 16], noise=lambda x: 0.5)
    assert 6 in found and 7 in found


def test_adaptive_sampling_stops_at_infeasible_points():
    measured = adaptive_sample(lambda x: None if x >= 9 else float(x), 1, 16, 0.03, [1, 2, 4, 8, 16])
    assert measured[16] is None
    filled = dict((x, (y, s)) for x, y, s in fill_curve(measured, range(1, 17)))
    assert filled[16] == (None, "infeasible")
    assert filled[12][1] == "infeasible"  # no measured point to its right: not interpolated
    assert filled[3] == (3.0, "interpolated")


def test_the_fit_keeps_the_curve_monotone_and_flags_a_cell_that_disagrees_with_its_neighbours():
    """A slow spell on one cell (ctx 128, batch 1, 1+D = 13: 190 ms among 50 ms neighbours) and a batch-8 cell faster at
    1+D = 2 than at 1 are fitted away; the spike is flagged `fitted` with its raw value kept, honest cells stay
    measured."""
    from specdec_tune.profiles.verify_curve import fit_verify

    rng = random.Random(0)
    samples = {}
    for B in (1, 8):
        for ctx in (128, 512):
            for t in range(1, 17):
                base = (50 + 0.3 * t) * (1 + 0.4 * (B == 8)) * (1 + 0.1 * (ctx == 512))
                samples[(B, ctx, t)] = [base * (1 + 0.004 * rng.uniform(-1, 1)) for _ in range(9)]
    samples[(1, 128, 13)] = [190.0 + rng.uniform(-2, 2) for _ in range(9)]
    samples[(8, 128, 2)] = [x - 2.5 for x in samples[(8, 128, 1)]]
    points, fit = fit_verify(samples, {}, [1, 8], [128, 512], 16, visits=3)
    by = {(p["batch"], p["ctx"], p["tokens"]): p for p in points}
    for B in (1, 8):
        for ctx in (128, 512):
            curve = [by[(B, ctx, t)]["median_ms"] for t in range(1, 17)]
            assert all(a <= b + 1e-9 for a, b in zip(curve, curve[1:]))
        assert all(by[(B, 128, t)]["median_ms"] <= by[(B, 512, t)]["median_ms"] + 1e-9 for t in range(1, 17))
    assert all(
        by[(1, ctx, t)]["median_ms"] <= by[(8, ctx, t)]["median_ms"] + 1e-9 for ctx in (128, 512) for t in range(1, 17)
    )
    spike = by[(1, 128, 13)]
    assert (
        spike["source"] == "fitted" and spike["fit_moved"] and spike["raw_median_ms"] > 180 and spike["median_ms"] < 60
    )
    assert {(m["batch"], m["ctx"], m["tokens"]) for m in fit["moved_beyond_interval"]} >= {(1, 128, 13)}
    honest = [p for k, p in by.items() if k not in {(1, 128, 13), (1, 128, 12), (1, 128, 14), (8, 128, 1), (8, 128, 2)}]
    assert sum(p["source"] == "measured" for p in honest) >= 0.9 * len(honest)
    assert all(p["ci_low_ms"] <= p["median_ms"] <= p["ci_high_ms"] for p in points)


def test_a_cell_of_three_samples_does_not_outweigh_a_well_measured_neighbour():
    """Three close samples (min-max 2 ms, 75% coverage) once pulled a 72-sample neighbour 25 ms down (B=2 1+D=1 of a
    fp32 profile on a noisy machine: 141.7 -> 113.1 ms). Its interval is widened to the noise all cells share at 3
    samples, so the fit moves the thin cell, and the well-measured ones keep their medians."""
    from specdec_tune.profiles.intervals import pooled_rel_sd
    from specdec_tune.profiles.verify_curve import fit_verify

    rng = random.Random(1)
    samples = {
        (2, 128, 1): [140 * math.exp(rng.gauss(0, 0.1)) for _ in range(72)],
        (2, 128, 2): [114.0, 115.0, 116.0],
        (2, 128, 3): [155 * math.exp(rng.gauss(0, 0.1)) for _ in range(72)],
    }
    assert pooled_rel_sd(samples.values()) == pytest.approx(0.1, rel=0.25)
    points, fit = fit_verify(samples, {}, [2], [128], 3, visits=50)
    by = {p["tokens"]: p for p in points}
    assert by[1]["source"] == "measured" and by[1]["median_ms"] == pytest.approx(by[1]["raw_median_ms"], rel=0.02)
    assert (
        by[2]["source"] == "fitted" and by[2]["median_ms"] > 130 and by[3]["median_ms"] >= by[2]["median_ms"]
    )  # the thin cell moved
    assert fit["pooled_rel_sd"] == pytest.approx(0.1, rel=0.25)


# ---------------------------------------------------------------------------- measurement log


def test_log_resumes_and_survives_a_torn_line(tmp_path):
    log = MeasurementLog(tmp_path, "f" * 64)
    log.put("a", {"x": 1})
    assert log.measure("a", lambda: pytest.fail("measured twice")) == {"x": 1}
    with open(log.path, "a") as f:
        f.write('{"key": "b", "val')  # a kill in the middle of a write
    again = MeasurementLog(tmp_path, "f" * 64)
    assert again.resumed == 1 and "b" not in again
    again.put("b", [2])
    third = MeasurementLog(tmp_path, "f" * 64)
    assert third.get("a") == {"x": 1} and third.get("b") == [2]


def test_log_of_another_fingerprint_is_not_read(tmp_path):
    MeasurementLog(tmp_path, "a" * 64).put("k", 1)
    assert "k" not in MeasurementLog(tmp_path, "b" * 64)


# ---------------------------------------------------------------------------- schema


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        ("{not json", "not valid JSON"),
        ('{"a": 1}', "no schema_version"),
        ("[1, 2]", "no schema_version"),
        (json.dumps({"schema_version": SCHEMA_VERSION + 1}), "schema version"),
        (json.dumps({"schema_version": SCHEMA_VERSION, "tool_version": "x"}), "not a valid profile"),
    ],
)
def test_bad_profiles_are_refused_with_one_line(tmp_path, content, message):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecdecError, match=message) as e:
        load_profile(path)
    assert "\n" not in str(e.value)


def test_bad_settings():
    with pytest.raises(SpecdecError, match="buckets"):
        ProfileSettings(batch_buckets=(4, 2)).validate()
    with pytest.raises(SpecdecError, match="max-draft-len"):
        ProfileSettings(max_draft_len=0).validate()
    with pytest.raises(SpecdecError, match="check draft lengths"):
        ProfileSettings(max_draft_len=3, check_draft_lens=(3,)).validate()
    assert ProfileSettings(max_draft_len=15).checks == (3, 7)


def test_the_default_grid_is_the_devices_and_a_given_one_is_kept():
    cpu, gpu = ProfileSettings().for_device("cpu"), ProfileSettings().for_device("cuda")
    assert (cpu.batch_buckets, cpu.max_draft_len) == ((1, 2, 4, 8), 7)
    assert (gpu.batch_buckets, gpu.max_draft_len) == ((1, 2, 4, 8, 16, 32, 64, 128, 256), 15)
    given = ProfileSettings(batch_buckets=(1, 16), max_draft_len=3).for_device("cuda")
    assert (given.batch_buckets, given.max_draft_len) == ((1, 16), 3)


# ---------------------------------------------------------------------------- end to end on the demo target

SMALL = dict(
    batch_buckets=(1, 2),
    ctx_buckets=(32,),
    max_draft_len=3,
    prompts_per_domain=1,
    new_tokens=8,
    temperatures=(0.0,),
    budget_minutes=10.0,
    acceptance_half_width=0.0,
    verify_visits=2,
)
SMALL_CLI = [
    "--batch",
    "1,2",
    "--ctx",
    "32",
    "--max-draft-len",
    "3",
    "--prompts-per-domain",
    "1",
    "--new-tokens",
    "8",
    "--half-width",
    "0",
    "--verify-visits",
    "2",
    "--temperatures",
    "0",
    "--quant",
    "none",
    "--drafter",
    "ngram",
    "--drafter",
    "suffix",
]


@pytest.mark.demo
def test_profile_end_to_end_and_reuse(tmp_path):
    settings = ProfileSettings(
        **SMALL, drafters=("ngram", "draft_model:layers=1"), quant_formats=("fp8",), out_dir=tmp_path
    )
    first = TorchProfiler(settings).run()
    loaded = load_profile(tmp_path / "profile.json")
    assert loaded == first
    # every batch x 1+D x ctx point is present, measured or interpolated, with its source
    assert {(p.batch, p.tokens) for p in first.verify} == {(b, t) for b in (1, 2) for t in (1, 2, 3, 4)}
    assert all(p.source in ("measured", "interpolated", "fitted") and p.median_ms > 0 for p in first.verify)
    assert all(p.ci_low_ms <= p.median_ms <= p.ci_high_ms for p in first.verify if p.source != "interpolated")
    assert first.verify_fit["cells_measured"] >= 4 and first.verify_fit["visits"] >= 4
    assert {(p.mechanism, p.batch, p.draft_len) for p in first.draft} == {
        (m, b, d) for m in ("ngram", "draft_model") for b in (1, 2) for d in (1, 2, 3)
    }
    # the serial drafter's cost grows with D (three steps against one; a shared machine's noise can take a third off the
    # ratio)
    dm = {p.draft_len: p.median_ms for p in first.draft if p.mechanism == "draft_model" and p.batch == 1}
    assert dm[3] > 1.5 * dm[1]
    # acceptance per mechanism x domain, derived AL for every D, checks at smaller D, emulated FP8
    domains = set(first.workload.domains)
    greedy = {(a.mechanism, a.domain) for a in first.acceptance if a.quant == "none"}
    assert greedy == {(m, d) for m in ("ngram", "draft_model") for d in domains | {"all"}}
    ngram_all = next(a for a in first.acceptance if a.mechanism == "ngram" and a.domain == "all")
    assert len(ngram_all.tokens_per_forward) == 4 and ngram_all.tokens_per_forward[0] == 1.0
    assert ngram_all.method == "replay" and all(
        lo <= x <= hi for x, (lo, hi) in zip(ngram_all.tokens_per_forward, ngram_all.tokens_per_forward_ci)
    )
    assert [c.draft_len for c in ngram_all.checks] == [3]  # the loop in the profile's dtype against the replay at D_max
    # the per-prompt counts behind it (for paired comparisons) give back its figures, and only the "all" record keeps
    # them
    sums = ngram_all.per_prompt
    assert len(sums.domains) == ngram_all.prompts and all(
        a.per_prompt is None for a in first.acceptance if a.domain != "all"
    )
    tables = {k: np.asarray(getattr(sums, k), dtype=float) for k in ("emitted", "rounds", "accepted", "drafts")}
    tpf, al = intervals.figures(tables, sums.domains, dict.fromkeys(sums.domains, 1.0))
    assert tpf.tolist() == pytest.approx(ngram_all.tokens_per_forward) and al.tolist() == pytest.approx(
        ngram_all.mean_al_vllm
    )
    assert any(a.quant == "fp8" and a.quant_source == "emulated" and a.method == "replay" for a in first.acceptance)
    assert {p.kind for p in first.micro} == {"attention", "linear"}
    assert {(p.mechanism, p.draft_len) for p in first.host} == {
        ("plain", 0),
        ("ngram", 1),
        ("ngram", 3),
        ("draft_model", 1),
        ("draft_model", 3),
    }
    assert "the loop gave equal counters in fp32" in " ".join(first.notes)
    # memory: the target's and the one-layer draft model's weights and KV from the config, activations modeled on a CPU
    memory = first.memory
    layer = memory["target"]["weights_bytes"]["none"] - memory["drafters"]["draft_model"]["weights_bytes"]["none"]
    assert (
        memory["drafters"]["ngram"]["params"] == 0
        and memory["drafters"]["draft_model"]["kv_bytes_per_token"] * memory["target"]["shape"]["layers"]
        == memory["target"]["kv_bytes_per_token"]
        and layer > 0
    )
    assert {a["source"] for a in memory["activation"]} == {"modeled"} and memory["device"][
        "usable_bytes"
    ] == first.device["memory_bytes"]

    # a second run with the same fingerprint reuses the file: nothing measured again
    log_lines = sum(1 for _ in next(tmp_path.glob("measurements-*.jsonl")).open())
    again = TorchProfiler(settings).run()
    assert again.created_at == first.created_at
    assert sum(1 for _ in next(tmp_path.glob("measurements-*.jsonl")).open()) == log_lines
    # other settings, other fingerprint
    assert (
        TorchProfiler(ProfileSettings(**{**SMALL, "new_tokens": 9}, drafters=("ngram",), out_dir=tmp_path)).fingerprint
        != first.fingerprint
    )


def _cli(out: Path) -> list[str]:
    return [sys.executable, "-m", "specdec_tune.cli", "profile", "--out", str(out), *SMALL_CLI]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The same small profile run once without interruption: what a resumed run must reproduce."""
    clean = tmp_path_factory.mktemp("clean")
    subprocess.run(_cli(clean), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return clean


@pytest.mark.demo
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_profile_resumes_after_sigkill(tmp_path, sig, uninterrupted):
    killed, clean = tmp_path / "killed", uninterrupted
    # Ctrl-C as a terminal sends it: to a process whose SIGINT is not ignored (a shell's background job inherits it
    # ignored)
    proc = subprocess.Popen(
        _cli(killed),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 240
    log_lines: list[str] = []
    while time.monotonic() < deadline and proc.poll() is None:
        logs = list(killed.glob("measurements-*.jsonl"))
        if logs:
            log_lines = [line for line in logs[0].read_text().splitlines() if line.endswith("}")]
            if len(log_lines) >= 3:
                break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, sig)
    assert proc.wait() in ((130, -signal.SIGINT) if sig == signal.SIGINT else (-signal.SIGKILL,))
    assert not (killed / "profile.json").exists()
    before = {json.loads(line)["key"]: json.loads(line)["value"] for line in log_lines}
    if sig == signal.SIGINT:  # Ctrl-C: what was logged is kept whole (the resume itself is the SIGKILL case's)
        kept = next(killed.glob("measurements-*.jsonl")).read_text()
        assert kept.endswith("\n") and all("key" in json.loads(line) for line in kept.splitlines())  # no torn line
        assert set(log_lines) <= set(kept.splitlines())
        return

    subprocess.run(_cli(killed), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    resumed = load_profile(killed / "profile.json")
    after = {}
    for line in next(killed.glob("measurements-*.jsonl")).read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        after.setdefault(entry["key"], entry["value"])  # first value logged for each key
    # nothing measured before the kill was measured again or lost
    assert all(after[k] == v for k, v in before.items())
    assert len(after) == sum(
        1 for line in next(killed.glob("measurements-*.jsonl")).read_text().splitlines() if line.endswith("}")
    )
    # acceptance (greedy, deterministic) is identical to an uninterrupted run
    reference = load_profile(clean / "profile.json")
    assert [a.model_dump() for a in resumed.acceptance] == [a.model_dump() for a in reference.acceptance]
    assert resumed.fingerprint == reference.fingerprint


def test_out_of_memory_is_recorded_as_infeasible(tmp_path):
    """A forward that runs out of memory at 1+D >= 3 leaves those points infeasible instead of crashing."""
    import torch

    from specdec_tune.profiles.models.llama import CausalLM, ModelConfig, init_random

    c = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = init_random(CausalLM(c)).eval()

    class Oom(torch.nn.Module):
        config = model.config

        def new_cache(self, *a):
            return model.new_cache(*a)

        def forward(self, tokens, cache, start, logits="all"):
            if tokens.shape[1] >= 3 and logits != "none":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return model(tokens, cache, start, logits)

    from specdec_tune.profiles.store import MeasurementLog
    from specdec_tune.profiles.verify_curve import VerifySampler, fit_verify

    settings = ProfileSettings(max_draft_len=7, batch_buckets=(2,), ctx_buckets=(16,))
    sampler = VerifySampler(
        Oom(), settings, torch.device("cpu"), MeasurementLog(tmp_path, "0" * 64), seeds=[1, 2, 4, 8], t_max=8
    )
    sampler.run(deadline=time.monotonic() + 5)
    assert sampler.infeasible == {(2, 16): 3}  # the smallest 1+D that ran out of memory (bisection reaches it)
    points, _ = fit_verify(sampler.samples, sampler.infeasible, [2], [16], 8, sampler.visits)
    # timed (a fit may move one of two sub-millisecond cells that came out in the wrong order)
    assert all(p["source"] in ("measured", "fitted") and p["median_ms"] > 0 for p in points[:2])
    assert all(p["source"] == "infeasible" and p["median_ms"] is None for p in points if p["tokens"] >= 3)


def test_speed_guard_repeats_a_measurement_a_passing_load_spoiled():
    from specdec_tune.profiles.timing import SpeedGuard

    probes = iter(
        [10.0, 10.0, 10.0, 14.0, 10.2, 10.1]
    )  # quiet; a load (40% slower) arrives after the 2nd run; gone for the 3rd
    runs = iter(["first", "second", "third"])
    guard = SpeedGuard(probe=lambda: next(probes), pause_s=0)
    assert guard.run(lambda: next(runs)) == ("first", 10.0, 10.0)
    assert guard.run(lambda: next(runs)) == ("third", 10.2, 10.1) and guard.repeated == 1 and guard.unsettled == 0
    busy = SpeedGuard(probe=iter([20.0] * 6).__next__, pause_s=0, known_quiet_ms=10.0)  # never back to its quiet 10 ms
    assert busy.run(lambda: "kept")[0] == "kept" and busy.repeated == 2 and busy.unsettled == 1
    noisy = SpeedGuard(
        probe=iter([10.0, 12.0, 11.0, 9.0, 12.5, 10.5]).__next__, pause_s=0
    )  # quiet, with a 2-core CPU's noise
    assert [noisy.run(lambda: "kept")[0] for _ in range(3)] == ["kept"] * 3 and noisy.repeated == 0
    steady = SpeedGuard(probe=iter([20.0, 20.5]).__next__, pause_s=0, known_quiet_ms=10.0, steady_only=True)
    assert steady.run(lambda: "scaled by the caller") == ("scaled by the caller", 20.0, 20.5) and steady.repeated == 0


def test_remeasure_appends_visits_refits_and_rewrites_the_profile(tmp_path, tiny_hf_dir):
    """A cell measured again gets new visits in the log (the old ones kept), the curve is fitted again with them
    pooled, and profile.json is rewritten as a valid, monotone profile."""
    from specdec_tune.profiles.verify_curve import remeasure

    demo = json.loads((Path(__file__).parent / "data" / "demo_profile.json").read_text())
    demo |= {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": "e" * 64,
        "target": {**demo["target"], "path": str(tiny_hf_dir)},
        "device": {**demo["device"], "dtype": "float32"},
    }
    (tmp_path / "profile.json").write_text(json.dumps(demo))
    log = MeasurementLog(tmp_path, "e" * 64)
    for p in demo["verify"]:
        if p["source"] == "measured":
            log.put(
                f"verify/{p['batch']}/{p['ctx']}/{p['tokens']}/visit0", [p["median_ms"] * f for f in (0.99, 1.0, 1.01)]
            )
    spike = next(p for p in demo["verify"] if (p["batch"], p["tokens"], p["ctx"]) == (1, 1, 128))
    new, changes = remeasure(tmp_path / "profile.json", [(1, 1, 128)], visits=2)
    assert len(MeasurementLog(tmp_path, "e" * 64).items("verify/1/128/1/")) == 3  # visit0 kept, visit1 and visit2 added
    assert (
        changes[0]["before_ms"] == pytest.approx(spike["median_ms"])
        and changes[0]["after_ms"] != changes[0]["before_ms"]
    )
    assert load_profile(tmp_path / "profile.json") == new
    for B in new.workload.batch_buckets:
        curve = [p.median_ms for p in new.verify if p.batch == B and p.ctx == 128 and p.median_ms is not None]
        assert curve == sorted(curve)


def test_refinement_visits_the_decision_cells_until_each_is_tight(tmp_path):
    """More visits go to the decision cells alone: a noisy one until its interval is tight (or the visits cap), a
    cell between measured 1+D gets its first samples, an out-of-memory one none, and the other cells are left."""
    from specdec_tune.profiles import verify_curve as pr

    rng = random.Random(0)
    noise = {(1, 128, 2): 0.2, (1, 128, 3): 0.0, (1, 128, 5): 0.0}  # relative spread of a cell's samples

    import torch

    settings = ProfileSettings(max_draft_len=7, batch_buckets=(1,), ctx_buckets=(128,))
    sampler = pr.VerifySampler(
        None, settings, torch.device("cpu"), MeasurementLog(tmp_path, "0" * 64), seeds=[1, 8], t_max=8
    )
    visited = []

    def visit(B, ctx, t):
        visited.append((B, ctx, t))
        sampler.timed.append(
            (
                (B, ctx, t),
                [10.0 * t * (1 + rng.uniform(-1, 1) * noise[(B, ctx, t)]) for _ in range(pr.VERIFY_SAMPLES_PER_VISIT)],
            )
        )

    sampler._visit = visit
    sampler.timed = [
        ((1, 128, 2), [20.0, 26.0, 15.0]),
        *[((1, 128, 3), [30.0] * 3)] * 24,
        ((1, 128, 8), [90.0, 60.0, 80.0]),
    ]
    sampler.infeasible = {(1, 128): 6}
    sampler.refine([(1, 128, 2), (1, 128, 3), (1, 128, 5), (1, 128, 6)], deadline=time.monotonic() + 5)
    assert set(visited) == {
        (1, 128, 2),
        (1, 128, 5),
    }  # tight (3: 72 equal samples), infeasible (6) and not a decision cell (8): no visit
    assert visited.count((1, 128, 5)) == 1  # never measured: one visit of identical samples is tight
    assert (
        visited.count((1, 128, 2)) == pr.REFINE_VISITS_FACTOR * 6 - 1
    )  # 20% noise never gets within 1.5%: the cap (--verify-visits 6)


def test_decision_cells_are_the_best_draft_lengths_by_the_speedup_bound():
    from specdec_tune.profiles.verify_curve import REFINE_CANDIDATES

    profiler = TorchProfiler.__new__(TorchProfiler)
    profiler.s = ProfileSettings(max_draft_len=7, batch_buckets=(1, 4), ctx_buckets=(128, 512))
    profiler._speedup_bounds = lambda verify: {
        ("ngram", 1): {1: 1.2, 2: 1.3, 3: 1.25, 4: 1.1},
        ("ngram", 4): {1: 1.05, 2: 0.9, 3: 0.8, 4: 0.7},
        ("suffix", 4): {5: 1.01},
    }
    assert REFINE_CANDIDATES == 3
    assert profiler.decision_cells([]) == [
        (1, 128, 1),
        (1, 128, 2),
        (1, 128, 3),
        (1, 128, 4),
        (4, 128, 1),
        (4, 128, 2),
        (4, 128, 3),
        (4, 128, 4),
        (4, 128, 6),
    ]


def test_progress_prints_a_line_per_unit_of_work_where_output_is_not_a_terminal(capsys, monkeypatch):
    """In a CI log the bars print nothing until the end: there, each unit of work is a line with the unit, the elapsed
    time, the budget left and an estimate of what the phase still needs (at most one a phase per 10 s, but the phase's
    last), and a phase that finishes twice is one line."""
    from specdec_tune import cli, progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    assert not cli.console.is_terminal  # pytest captures the output
    with cli._progress(15.0) as report:
        for done, unit in (
            (0, ""),
            (1, "ngram D=7 pass 1: 40 s"),
            (2, "ngram D=1 pass 1"),
            (3, "plain pass 2"),
            (4, ""),
            (4, ""),
        ):
            report.tick(
                "engine units", done, 4, unit
            )  # the second is 6 s after the first; the third is within 10 s of it
            now[0] += 6.0  # the last finishes the phase a second time: no line
        report.note("the required units run past the budget")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4, lines
    assert "engine units 1/4 (ngram D=7 pass 1: 40 s): " in lines[0] and "min of the budget left" in lines[0]
    assert "about 0.3 min to go in this phase" in lines[0]  # 6 s a unit, 3 units left
    assert "engine units 3/4 (plain pass 2)" in lines[1] and "engine units: done (4 units)" in lines[2]
    assert lines[3].endswith("the required units run past the budget") and all(line.startswith("[") for line in lines)


def test_time_call_stops_repeating_a_long_call_after_three():
    import torch

    from specdec_tune.profiles.timing import time_call

    slow = lambda: time.sleep(0.02)  # noqa: E731
    assert time_call(slow, device=torch.device("cpu"), warmup=0, repeats=7, max_total_ms=50).repeats == 3
    assert time_call(slow, device=torch.device("cpu"), warmup=0, repeats=7).repeats == 7


def test_growth_adds_only_the_prompts_that_fit_the_budget_widest_domain_first(monkeypatch):
    """Growth fills what is left of the budget: as many prompts as the replay's cost per prompt says fit,
    round-robin over the wide domains, widest first; then it says the budget ended (not a skipped phase)."""
    import time

    from specdec_tune.profiles.calibration import CalibrationPrompt, CalibrationSet
    from specdec_tune.profiles.profile_run import Budget

    monkeypatch.setattr("specdec_tune.profiles.torch_acceptance.FINISH_RESERVE_S", 0.0)  # a budget of seconds

    pool = CalibrationSet(
        "t", tuple(CalibrationPrompt(f"{d}/{i}", d, "x") for d in ("chat", "code", "math") for i in range(10))
    )
    prof = TorchProfiler.__new__(TorchProfiler)
    prof.s, prof.pool, prof.progress = ProfileSettings(acceptance_half_width=0.02), pool, Progress()
    prof.used, prof.encoded = [], {p.id: [1] for p in pool}
    prof._relevant_draft_lens = lambda verify: {1}
    widths = {"chat": 0.10, "code": 0.30, "math": 0.01}  # math is already tight
    prof._half_widths = lambda relevant: widths
    rounds = []

    prof.replay_units = [("draft_model", "none"), ("draft_model", "fp8")]

    def replay_prompts(log, prompts, units):
        assert units == [("draft_model", "none")]  # the quantized twin keeps the starting set
        rounds.append([p.id for p in prompts])
        prof.used += prompts
        time.sleep(0.2 * len(prompts))

    prof._replay_prompts = replay_prompts
    prof.trajectory_s_per_prompt, prof.unit_s_per_prompt = (
        0.15,
        {("draft_model", "none"): 0.05, ("draft_model", "fp8"): 0.5},
    )
    budget = Budget(1.3 / 60)  # room for 6 prompts at 0.2 s each
    notes = prof._grow_acceptance(None, budget, [])
    added = [i for r in rounds for i in r]
    assert rounds[0][:2] == ["code/0", "chat/0"] and not any(i.startswith("math") for i in added)
    assert (
        4 <= len(added) <= 7 and time.monotonic() - budget.deadline < 0.5
    )  # ended near the deadline, not a round past it
    assert budget.skipped == [] and all("the time budget ended" in n for n in notes) and len(notes) == 2


def _growth_profiler(counts: tuple[tuple[str, int], ...], widths: dict[str, float], replay_prompts):
    """A TorchProfiler with only what growth reads: a pool of `counts` prompts per domain, fixed interval `widths`, one
    replayed unit, and `replay_prompts(prof, prompts)` standing in for the replay."""
    from specdec_tune.profiles.calibration import CalibrationPrompt, CalibrationSet

    pool = CalibrationSet("t", tuple(CalibrationPrompt(f"{d}/{i}", d, "x") for d, n in counts for i in range(n)))
    prof = TorchProfiler.__new__(TorchProfiler)
    prof.s, prof.pool, prof.progress = ProfileSettings(acceptance_half_width=0.02), pool, Progress()
    prof.used, prof.encoded, prof.replay_units = [], {p.id: [1] for p in pool}, [("ngram", "none")]
    prof.second_turn_domains = set()
    prof.model = type("Model", (), {"config": type("Config", (), {"max_position_embeddings": 2048})()})()
    prof.target, prof.stop_ids = None, []
    prof._relevant_draft_lens = lambda verify: {1}
    prof._half_widths = lambda relevant: widths
    prof._replay_prompts = lambda log, prompts, units: replay_prompts(prof, prompts)
    return prof


def test_growth_rounds_stay_large_when_one_domain_is_left():
    """A round's trajectories decode together: once the other domains are tight or used up, the last wide domain
    gets the whole round (GROWTH_ROUND_PROMPTS), not a few prompts a round decoded at a small batch."""
    from specdec_tune.profiles.profile_run import Budget
    from specdec_tune.profiles.torch_acceptance import GROWTH_ROUND_PROMPTS

    rounds = []

    def replay_prompts(prof, prompts):
        rounds.append([p.domain for p in prompts])
        prof.used += prompts

    R = GROWTH_ROUND_PROMPTS
    prof = _growth_profiler((("chat", 2), ("code", R + 8)), {"chat": 0.1, "code": 0.2}, replay_prompts)
    prof.trajectory_s_per_prompt, prof.unit_s_per_prompt = 0.001, {}
    prof._grow_acceptance(None, Budget(1.0), [])
    assert R >= 32 and [len(r) for r in rounds] == [R, 10] and rounds[0][:4] == ["code", "chat", "code", "chat"]


def test_growth_says_which_domain_ran_out_of_prompts_and_which_out_of_time(monkeypatch):
    import time

    from specdec_tune.profiles.profile_run import Budget

    monkeypatch.setattr("specdec_tune.profiles.torch_acceptance.FINISH_RESERVE_S", 0.0)  # a budget of seconds

    def replay_prompts(prof, prompts):
        prof.used += prompts
        time.sleep(0.05 * len(prompts))

    prof = _growth_profiler((("chat", 2), ("code", 40)), {"chat": 0.1, "code": 0.1}, replay_prompts)
    prof.trajectory_s_per_prompt, prof.unit_s_per_prompt = 0.05, {}
    notes = prof._grow_acceptance(None, Budget(0.5 / 60), [])  # room for 10 prompts: chat runs out first
    assert [p.domain for p in prof.used].count("chat") == 2
    [chat] = [n for n in notes if "for chat" in n]
    [code] = [n for n in notes if "for code" in n]
    assert "no more prompts" in chat and "(2 prompts)" in chat and "the time budget ended" in code
