"""`specdec-tune check BUNDLE --metrics SOURCE`: whether the traffic a server ran over a window is still the workload
the bundle's plan was tuned for, from the serving engine's own counters (pipeline/serving_metrics.py).

Acceptance. The live figure against the profile's 95% interval at the K the server ran, for the plan's mix:
    vLLM     its mean acceptance length 1 + accepted / drafts (rounds that drafted, so buckets served at K = 0 and
             rounds a lookup drafter found nothing to propose leave it unmoved), against the profile's
             `mean_al_vllm` at K; a mix weighs each domain's figure and bound by its share
    SGLang   tokens per verify forward, against the cost model's AL(K) (its mix: the weighted harmonic mean)
The live interval: accepted tokens per round n has P(n ≥ i) = accepted_i / rounds (vLLM's per-position counters), so
    SE = sqrt((E[n²] − E[n]²) / rounds),   E[n²] = Σ_i (2i − 1) P(n ≥ i),   interval = figure ± 1.96 SE
with rounds taken as independent (rounds of one request are not: it is narrower than a per-request interval); where
the engine counts no distribution (SGLang) n ∈ [0, K] bounds the variance by K² / 4. The workload has drifted when the
two intervals are apart; under `MIN_ROUNDS` rounds the window is too short to judge.

Concurrency. Running + waiting requests at each scrape, against the plan's batch buckets: the share of the busy
scrapes above the largest bucket (the server runs at most that many; the rest queue), the share in the bands the plan
serves at K = 0, and, with the window's length, Little's mean. It has drifted when more than `ABOVE_SHARE` of the busy
scrapes lie above the largest bucket (with `MIN_BUSY` busy scrapes at least), or, with fewer, when Little's mean does.

What the drift costs. Each bucket's predicted tokens/s under the live acceptance: the profile's accepted tokens per
round scaled by live / profiled (AL_live(D) = 1 + (AL(D) − 1) · ρ, ρ = (live − 1) / (profiled − 1)) over the same
round time, beside the plan's own; both averaged over the live concurrency (a request above the largest bucket is
served at it). The re-tune command follows from what drifted.
"""

from __future__ import annotations

import math
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.autotune.plan import cost_model_of
from specdec_tune.autotune.plan_schema import Plan, load_plan
from specdec_tune.exporters.bundle import read_manifest
from specdec_tune.pipeline.serving_metrics import ENGINE_METRICS
from specdec_tune.profiles.schema import Profile, load_profile

MIN_ROUNDS = 100  # rounds (vLLM: drafts; SGLang: forwards) below which the window's acceptance is not judged
MIN_BUSY = 5  # busy scrapes below which the concurrency is judged on Little's mean alone
ABOVE_SHARE = 0.10  # the share of busy scrapes above the largest bucket beyond which the concurrency has drifted
Z95 = 1.959963984540054


def served_schedule(manifest: dict, engine: str) -> list[tuple[int, int]]:
    """(batch bucket, K) as the engine serves the bundle: its deviation's schedule where it has one."""
    entry = manifest["engines"].get(engine)
    if entry is None:
        raise SpecdecError(
            f"the bundle has no {engine} config, but the metrics are {engine}'s", "check the bundle that server runs"
        )
    runs = (entry.get("deviation") or {}).get("schedule") or manifest["plan"]["schedule"]
    return [(int(b), int(d)) for b, d in runs]


def band_of(schedule: list[tuple[int, int]], concurrency: int) -> int | None:
    """The index of the bucket serving `concurrency` requests (the first whose batch holds them); None above all."""
    return next((i for i, (b, _) in enumerate(schedule) if concurrency <= b), None)


# ---------------------------------------------------------------------------------------------------------- acceptance


def live_interval(figure: float, rounds: float, per_position: list[float] | None, k: int) -> tuple[float, float]:
    """figure ± 1.96 SE of the accepted tokens per round (module docstring)."""
    if per_position:
        at_least = [a / rounds for a in per_position]
        mean = sum(at_least)
        variance = max(0.0, sum((2 * i + 1) * p for i, p in enumerate(at_least)) - mean**2)
    else:
        variance = k * k / 4
    half = Z95 * math.sqrt(variance / rounds)
    return figure - half, figure + half


def _record(profile: Profile, plan: Plan, domain: str):
    found = [
        a
        for a in profile.acceptance
        if (a.mechanism, a.quant, a.domain, a.temperature) == (plan.mechanism, plan.quant, domain, 0.0)
    ]
    if not found:
        raise SpecdecError(
            f"the bundle's profile has no greedy acceptance for {plan.mechanism}/{plan.quant} on {domain!r}",
            "re-export the bundle from its profile",
        )
    return found[0]


def profiled_mean_al(profile: Profile, plan: Plan, k: int) -> tuple[float, float, float, list[float]]:
    """(value, low, high, per-position rates) of vLLM's mean acceptance length at K for the plan's mix: each domain's
    figure and bounds weighed by its share; the rates at the profile's longest draft."""
    shares = plan.mix or {"all": 1.0}
    value = low = high = 0.0
    rates = None
    for domain, w in shares.items():
        r = _record(profile, plan, domain)
        at = min(k, r.max_draft_len)
        v = r.mean_al_vllm[at]
        lo, hi = r.mean_al_vllm_ci[at] if r.mean_al_vllm_ci else (v, v)
        value, low, high = value + w * v, low + w * lo, high + w * hi
        own = [a / r.num_drafts if r.num_drafts else 0.0 for a in r.num_accepted_tokens_per_pos]
        rates = [w * x for x in own] if rates is None else [a + w * x for a, x in zip(rates, own)]
    return value, low, high, rates or []


def draft_len_weights(window: dict, schedule: list[tuple[int, int]]) -> dict[int, float]:
    """The share of the window's rows served at each K: each busy scrape's running requests, at the K of the bucket
    holding them (the engine picks K by the batch it runs); without a busy scrape, Little's mean; without that, every
    bucket alike."""
    largest = schedule[-1][0]
    weights: dict[int, float] = {}
    running = [r for r in window["running_samples"] if r > 0]
    little = window.get("little_mean_concurrency")
    if not running and little:
        running = [max(1, min(largest, round(little)))]
    for r in running or [b for b, _ in schedule]:
        k = schedule[band_of(schedule, min(r, largest)) or 0][1]
        weights[k] = weights.get(k, 0.0) + r
    total = sum(weights.values())
    return {k: w / total for k, w in sorted(weights.items(), reverse=True)}


def acceptance(window: dict, plan: Plan, profile: Profile, cost: CostModel, k_shares: dict[int, float]) -> dict:
    """The live acceptance against the profiled interval at the K the server ran (module docstring), each K weighed
    by the share of the window's rows it served."""
    counts_drafts = window.get("drafts") is not None
    figure_name = "mean acceptance length" if counts_drafts else "tokens per forward"
    if counts_drafts:  # rounds at K = 0 draft nothing and leave vLLM's figure unmoved
        total = sum(w for k, w in k_shares.items() if k > 0)
        k_shares = {k: w / total for k, w in k_shares.items() if k > 0}
    out: dict = {"figure": figure_name, "draft_len_shares": k_shares}
    if not any(k > 0 for k in k_shares):
        return out | {"verdict": "not judged", "why": "the server ran no bucket that speculates in the window"}
    rounds = window["drafts"] if counts_drafts else window["forwards"]
    if rounds < MIN_ROUNDS:
        return out | {
            "verdict": "not judged",
            "rounds": rounds,
            "why": f"the window holds {rounds:.0f} rounds, fewer than the {MIN_ROUNDS} an interval needs: scrape a "
            "longer window",
        }
    k = max(k_shares)
    per_pos = None
    if counts_drafts:
        live = 1 + window["accepted_tokens"] / rounds
        profiled_at = {d: profiled_mean_al(profile, plan, d) for d in k_shares}
        bands = {d: figure[:3] for d, figure in profiled_at.items()}
        per_pos = window["accepted_per_position"]
        rates = profiled_at[k][3]
        out["per_position"] = [
            {"position": i + 1, "live": a / rounds, "profiled": rates[i] if i < len(rates) else None}
            for i, a in enumerate(per_pos)
        ]
    else:
        live = window["generated_tokens"] / rounds
        figures = {d: cost.tokens_per_forward(plan.mechanism, plan.quant, d) for d in k_shares if d}
        bands = {d: (f.value, *f.bounds()) for d, f in figures.items()} | {0: (1.0, 1.0, 1.0)}
    low_live, high_live = live_interval(live, rounds, per_pos, k)
    profiled, low, high = (sum(w * bands[d][i] for d, w in k_shares.items()) for i in range(3))
    apart = high_live < low or high < low_live
    at = ", ".join(f"{d} ({100 * w:.0f}%)" for d, w in k_shares.items())
    out |= {
        "verdict": "drifted" if apart else "inside",
        "rounds": rounds,
        "live": live,
        "live_interval": [low_live, high_live],
        "profiled": profiled,
        "profiled_interval": [low, high],
        "at": at,
        "rule": "drifted when the live and the profiled 95% intervals are apart; the profiled figure and bounds are "
        "each K's weighed by the share of the rows it served",
    }
    if apart:
        out["text"] = (
            f"workload: acceptance {live:.2f} live vs {low:.2f}-{high:.2f} profiled at K = {at} ({figure_name})"
        )
    return out


# --------------------------------------------------------------------------------------------------------- concurrency


def concurrency(window: dict, schedule: list[tuple[int, int]]) -> dict:
    samples = window["concurrency_samples"]
    busy = [c for c in samples if c > 0]
    largest = schedule[-1][0]
    shares = [0.0] * len(schedule)
    above = 0
    for c in busy:
        i = band_of(schedule, c)
        if i is None:
            above += 1
        else:
            shares[i] += 1
    n = len(busy)
    little = window.get("little_mean_concurrency")
    out: dict = {
        "samples": len(samples),
        "busy_samples": n,
        "largest_bucket": largest,
        "max_seen": max(samples) if samples else 0,
        "bands": [
            {"batch": b, "draft_len": d, "share": shares[i] / n if n else None} for i, (b, d) in enumerate(schedule)
        ],
        "share_above": above / n if n else None,
        "share_at_k0": sum(shares[i] for i, (_, d) in enumerate(schedule) if d == 0) / n if n else None,
        "little_mean": little,
    }
    if n >= MIN_BUSY:
        drifted = above / n > ABOVE_SHARE
        said = f"{100 * above / n:.0f}% of {n} busy scrapes above batch {largest}"
    elif little is not None:
        drifted = little > largest
        said = f"Little's mean {little:.1f} requests in the system"
    else:
        return out | {
            "verdict": "not judged",
            "why": f"{n} busy scrapes (at least {MIN_BUSY}, or the window's length for Little's mean, are needed)",
        }
    out["verdict"] = "drifted" if drifted else "inside"
    if drifted:
        out["text"] = (
            f"workload: concurrency {said}, the plan's largest bucket (up to {out['max_seen']} requests running and "
            "waiting)"
        )
    return out


# ------------------------------------------------------------------------------------------------------------ the cost


def throughput(plan: Plan, schedule: list[tuple[int, int]], accept: dict, conc: dict, cost: CostModel) -> dict | None:
    """Each bucket's predicted tokens/s, the plan's and under the live acceptance, and their averages over the live
    concurrency (module docstring)."""
    if accept.get("live") is None:
        return None
    live, profiled = accept["live"], accept["profiled"]
    rho = (live - 1) / (profiled - 1) if profiled > 1 else 1.0
    rows = []
    for b, d in schedule:
        p = cost.predict(b, d, plan.mechanism, plan.quant)
        al = p.tokens_per_forward.value
        at_live = 1 + (al - 1) * rho
        rows.append(
            {
                "batch": b,
                "draft_len": d,
                "planned_tokens_per_s": p.tokens_per_s.value,
                "live_acceptance_tokens_per_s": p.tokens_per_s.value * at_live / al,
                "source": "modeled",
            }
        )
    out: dict = {"buckets": rows, "acceptance_scale": rho}
    weights = [band["share"] for band in conc["bands"]]
    if conc.get("share_above") is not None:
        weights[-1] += conc["share_above"]  # served at the largest bucket, the rest queued
        out["over_live_concurrency"] = {
            key: sum(w * r[key] for w, r in zip(weights, rows))
            for key in ("planned_tokens_per_s", "live_acceptance_tokens_per_s")
        }
    return out


def retune_command(accept: dict, conc: dict, profile: Profile) -> str | None:
    if accept.get("verdict") == "drifted":
        return (
            "specdec-tune profile --prompts TRAFFIC.jsonl && specdec-tune search && specdec-tune export  "
            "(TRAFFIC.jsonl: a sample of the live requests, one {domain, prompt} or chat per line)"
        )
    if conc.get("verdict") == "drifted":
        seen = max(conc["max_seen"], conc["largest_bucket"] + 1)
        if max(profile.workload.batch_buckets) >= seen:
            return "specdec-tune search && specdec-tune export  (the profile already holds larger batches)"
        buckets = [1]
        while buckets[-1] < seen:
            buckets.append(buckets[-1] * 2)
        return (
            f"specdec-tune profile --batch {','.join(map(str, buckets))} && specdec-tune search && specdec-tune export"
        )
    return None


def workload_check(bundle: Path, window: dict) -> dict:
    """The window's figures (serving_metrics.window_figures) against the bundle's plan and profile."""
    manifest = read_manifest(bundle)
    plan = load_plan(Path(bundle) / "inputs" / "plan.json")
    profile = load_profile(Path(bundle) / "inputs" / "profile.json")
    engine = window["engine"]
    schedule = served_schedule(manifest, engine)
    conc = concurrency(window, schedule)
    cost = cost_model_of(profile, plan)
    accept = acceptance(window, plan, profile, cost, draft_len_weights(window, schedule))
    drifted = [x["text"] for x in (accept, conc) if x.get("verdict") == "drifted"]
    return {
        "bundle": str(bundle),
        "engine": engine,
        "window": window,
        "acceptance": accept,
        "concurrency": conc,
        "throughput": throughput(plan, schedule, accept, conc, cost),
        "drifted": drifted,
        "fresh": not drifted,
        "retune": retune_command(accept, conc, profile),
        "engine_note": ENGINE_METRICS[engine].not_counted or None,
    }
