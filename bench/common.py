"""What the benchmark scripts share: counting model forwards, repository-relative paths, writing a result, and judging a
plan against what a sweep measured."""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Hashable
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import normalise_mix
from specdec_tune.autotune.search import search
from specdec_tune.pipeline.refine import refine, skipped
from specdec_tune.profiles.drafters.dflash import DFlashHead
from specdec_tune.profiles.drafters.eagle3 import Eagle3Head
from specdec_tune.profiles.drafters.heads import DraftHead
from specdec_tune.profiles.drafters.mtp import MtpHead
from specdec_tune.profiles.intervals import pooled_half_width, pooled_rel_sd, runs_interval
from specdec_tune.profiles.models.generic import GenericCausalLM
from specdec_tune.profiles.models.llama import CausalLM
from specdec_tune.records import write_json
from specdec_tune.settings import ENGINE_DEFAULT_DRAFT_LEN, RefineSettings, SearchSettings

ROOT = Path(__file__).resolve().parent.parent

# What one counted forward is, per kind (written into the results that count them).
FORWARDS_COUNTED = {
    "target": (
        "one pass of the full-depth target (forward or forward_capture, built-in or generic path): a verify step, "
        "a prefill, a timed profile step"
    ),
    "draft_model": (
        "one pass of a shallower model (the draft model): its catch-up over the new tokens, or one draft step"
    ),
    "eagle3, mtp": "one DraftHead.step: a serial head's catch-up over the new target states, or one draft step",
    "dflash, dspark": (
        "one DFlashHead.block_hidden: the block pass (the catch-up's key/value projections are not counted)"
    ),
}


def _head_kind(head: DraftHead) -> str:
    """The mechanism a head belongs to, as the drafter registry names it."""
    if isinstance(head, DFlashHead):
        return "dspark" if head.markov_head is not None else "dflash"
    if isinstance(head, Eagle3Head):
        return "eagle3"
    return "mtp" if isinstance(head, MtpHead) else type(head).__name__


class ForwardCounter:
    """Model forwards run while `active()` is open: model passes by depth, learned-head passes by mechanism.

    Every model pass goes through its forward's `_run` (forward and forward_capture alike, CausalLM and
    GenericCausalLM), a serial head's through `DraftHead.step`, a block head's through `DFlashHead.block_hidden`: those
    are patched while counting.
    """

    def __init__(self) -> None:
        self.by_depth: collections.Counter = collections.Counter()  # CausalLM layers -> passes
        self.heads: collections.Counter = collections.Counter()  # mechanism -> head passes

    @contextlib.contextmanager
    def active(self):
        runs = {cls: cls._run for cls in (CausalLM, GenericCausalLM)}
        step, block = DraftHead.step, DFlashHead.block_hidden
        by_depth, heads = self.by_depth, self.heads

        def counting(run):
            def counted_run(model, *a, **k):
                by_depth[len(model.layers)] += 1
                return run(model, *a, **k)

            return counted_run

        def counted_step(head, *a, **k):
            heads[_head_kind(head)] += 1
            return step(head, *a, **k)

        def counted_block(head, *a, **k):
            heads[_head_kind(head)] += 1
            return block(head, *a, **k)

        for cls, run in runs.items():
            cls._run = counting(run)
        DraftHead.step, DFlashHead.block_hidden = counted_step, counted_block
        try:
            yield self
        finally:
            for cls, run in runs.items():
                cls._run = run
            DraftHead.step, DFlashHead.block_hidden = step, block

    def paused(self, fn):
        """fn wrapped so that the forwards it runs (a speed probe's) are not counted."""

        def run(*args, **kwargs):
            by_depth, heads = self.by_depth.copy(), self.heads.copy()
            try:
                return fn(*args, **kwargs)
            finally:
                self.by_depth.clear(), self.by_depth.update(by_depth)
                self.heads.clear(), self.heads.update(heads)

        return run

    def summary(self, target_layers: int) -> dict:
        """{"target_forwards": n, "drafter_forwards": {"draft_model": n, "eagle3": n, ...}}: a model of the target's
        depth is the target, a shallower (or deeper) one the draft model; kinds that never ran are left out."""
        drafters = {"draft_model": sum(n for depth, n in self.by_depth.items() if depth != target_layers)} | dict(
            self.heads
        )
        return {
            "target_forwards": self.by_depth[target_layers],
            "drafter_forwards": {k: n for k, n in sorted(drafters.items()) if n},
        }


def counted(fn):
    """Run fn() while counting forwards; returns (result, ForwardCounter, seconds)."""
    counter = ForwardCounter()
    t0 = time.perf_counter()
    with counter.active():
        result = fn()
    return result, counter, time.perf_counter() - t0


def shown(path) -> str | None:
    """A path as a result file records it: relative to the repository when inside it, else its name."""
    if path is None:
        return None
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def run_and_write(run, args) -> dict | None:
    """run(args), written atomically to args.out; a handled error is one line on stderr and None."""
    try:
        result = run(args)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    write_json(args.out, result)
    return result


def write_table(args, text: str) -> None:
    """The result's short table, beside its JSON (same name, .md) and on stdout."""
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


# ---------------------------------------------------------------------------- a plan against what a sweep measured
# (the torch decision-quality bench and the vLLM engine oracle share these; pure but `searched_for`)


ENGINE_DEFAULT_K = ENGINE_DEFAULT_DRAFT_LEN  # the K engines run when a user sets none (settings.py)

CONFIRMATION = (
    "the oracle is the best of a bucket's measured points, and the best of several noisy figures reads high (the "
    "winner's curse): the plan and the oracle were measured again, apart from the sweep that chose the oracle, in "
    "alternating runs (shuffled per round), and plan / oracle is the ratio of their medians"
)
NO_SPEC = "none"  # the mechanism recorded for D = 0: no drafter runs


def _rel_err(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def point_record(B: int, mech: str, quant: str, D: int, measured: dict, ratio: float, prediction) -> dict:
    """One swept point: raw measurement (the median of its runs, each run's figure beside it where known), its
    speed-scaled tokens/s, the cost model's prediction."""
    return {
        "batch": B,
        "mechanism": mech,
        "quant": quant,
        "draft_len": D,
        "measured_tokens_per_s": measured["tokens_per_s"],
        "runs_tokens_per_s": measured.get("runs_tokens_per_s"),
        "measured_tokens_per_forward": measured["tokens_per_forward"],
        "device_speed_ratio": ratio,
        "scaled_measured_tokens_per_s": measured["tokens_per_s"] * ratio,
        "predicted_tokens_per_s": prediction.tokens_per_s.value,
        "predicted_tokens_per_forward": prediction.tokens_per_forward.value,
        "predicted_source": prediction.tokens_per_s.source,
    }


def point_key(B: int, mech: str, D: int) -> tuple[int, str, int]:
    return (B, NO_SPEC, 0) if D == 0 else (B, mech, D)


def decisions(
    points: list[dict], schedule: list[list[int]], plan_mech: str, default_k: int, figure: str
) -> tuple[list[dict], dict]:
    """Per bucket: no speculation, best single (mechanism, D), engine default K, plan, oracle, on one tokens/s figure
    of the points (`measured_tokens_per_s` or `scaled_measured_tokens_per_s`). Also the D-only oracle (the plan's
    mechanism's best D), which shows how much of a gap is the D and how much the mechanism."""
    tps = {point_key(p["batch"], p["mechanism"], p["draft_len"]): p[figure] for p in points}
    configs = sorted({(m, D) for _, m, D in tps})
    batches = [B for B, _ in schedule]
    # the best single config, as a hand sweep finds it: highest mean speedup over no speculation, then the shorter D
    single = max(
        (c for c in configs if all((B, *c) in tps for B in batches)),
        key=lambda c: (statistics.mean(tps[(B, *c)] / tps[(B, NO_SPEC, 0)] for B in batches), -c[1]),
    )
    rows = []
    for B, plan_D in schedule:
        here = [(m, D) for m, D in configs if (B, m, D) in tps]
        oracle = max(here, key=lambda c: (tps[(B, *c)], -c[1]))
        own = max((c for c in here if c[0] in (plan_mech, NO_SPEC)), key=lambda c: (tps[(B, *c)], -c[1]))
        default = point_key(B, plan_mech, default_k)
        t = {
            "no_spec": tps[(B, NO_SPEC, 0)],
            "single_d": tps[(B, *single)],
            "engine_default": tps[default],
            "plan": tps[point_key(B, plan_mech, plan_D)],
            "d_only_oracle": tps[(B, *own)],
            "oracle": tps[(B, *oracle)],
        }
        rows.append(
            {
                "batch": B,
                "plan_mechanism": plan_mech if plan_D else NO_SPEC,
                "plan_draft_len": plan_D,
                "oracle_mechanism": oracle[0],
                "oracle_draft_len": oracle[1],
                "d_only_oracle_draft_len": own[1],
                "single_mechanism": single[0],
                "single_draft_len": single[1],
                "default_draft_len": default_k,
                "tokens_per_s": t,
                "vs_oracle": {k: v / t["oracle"] for k, v in t.items()},
                "vs_no_spec": {k: v / t["no_spec"] for k, v in t.items()},
            }
        )
    return rows, {"mechanism": single[0], "draft_len": single[1]}


def _errors(points: list[dict], predicted: str, measured: str) -> dict:
    """Median and worst relative error (%) of `predicted` against `measured` over `points` (None when there are
    none)."""
    errs = [_rel_err(p[predicted], p[measured]) for p in points]
    return (
        {"median": 100 * statistics.median(errs), "worst": 100 * max(errs)} if errs else {"median": None, "worst": None}
    )


def fidelity_of(points: list[dict]) -> dict:
    """The cost model against the measurements: tokens/s on raw and on speed-scaled figures, tokens per forward
    over the points that speculate (at D = 0 both are 1 by construction)."""
    raw, scaled = (
        _errors(points, "predicted_tokens_per_s", "measured_tokens_per_s"),
        _errors(points, "predicted_tokens_per_s", "scaled_measured_tokens_per_s"),
    )
    tpf = _errors(
        [p for p in points if p["draft_len"] > 0], "predicted_tokens_per_forward", "measured_tokens_per_forward"
    )
    return {
        "points": len(points),
        "tokens_per_s_median_err_pct": raw["median"],
        "tokens_per_s_worst_err_pct": raw["worst"],
        "tokens_per_forward_median_err_pct": tpf["median"],
        "tokens_per_forward_worst_err_pct": tpf["worst"],
        "scaled": {"tokens_per_s_median_err_pct": scaled["median"], "tokens_per_s_worst_err_pct": scaled["worst"]},
    }


def summarize(points: list[dict], schedule: list[list[int]], plan_mech: str, default_k: int) -> dict:
    """Everything the result says about the sweep: decisions per bucket (raw, with `scaled` beside), the best single
    config, the cost model's fidelity (over all points, per mechanism, at the plan's points) and the targets."""
    raw_rows, raw_single = decisions(points, schedule, plan_mech, default_k, "measured_tokens_per_s")
    scaled_rows, scaled_single = decisions(points, schedule, plan_mech, default_k, "scaled_measured_tokens_per_s")
    decided = (
        "oracle_mechanism",
        "oracle_draft_len",
        "d_only_oracle_draft_len",
        "single_mechanism",
        "single_draft_len",
        "tokens_per_s",
        "vs_oracle",
        "vs_no_spec",
    )
    for row, scaled in zip(raw_rows, scaled_rows):
        row["scaled"] = {k: scaled[k] for k in decided}
    by_point = {point_key(p["batch"], p["mechanism"], p["draft_len"]): p for p in points}
    plan_points = [by_point[point_key(B, plan_mech, D)] for B, D in schedule]
    fidelity = fidelity_of(points)
    fidelity["by_mechanism"] = {
        m: fidelity_of([p for p in points if p["mechanism"] == m]) for m in sorted({p["mechanism"] for p in points})
    }
    fidelity["plan_tokens_per_s_err_pct"] = [
        100 * _rel_err(p["predicted_tokens_per_s"], p["measured_tokens_per_s"]) for p in plan_points
    ]
    fidelity["scaled"]["plan_tokens_per_s_err_pct"] = [
        100 * _rel_err(p["predicted_tokens_per_s"], p["scaled_measured_tokens_per_s"]) for p in plan_points
    ]
    ratios = [p["device_speed_ratio"] for p in points]
    fidelity["device_speed_ratio_range"] = [min(ratios), max(ratios)]

    def targets(rows: list[dict]) -> dict:
        mean_ratio = lambda key: statistics.mean(r["vs_no_spec"][key] for r in rows)  # noqa: E731
        return {
            "plan_min_vs_oracle": min(r["vs_oracle"]["plan"] for r in rows),
            "plan_mean_speedup": mean_ratio("plan"),
            "single_d_mean_speedup": mean_ratio("single_d"),
            "plan_beats_single_d": mean_ratio("plan") > mean_ratio("single_d"),
        }

    return {
        "buckets": raw_rows,
        "best_single_measured": raw_single | {"scaled": scaled_single},
        "fidelity": fidelity,
        "targets": targets(raw_rows) | {"scaled": targets(scaled_rows)},
        "sweep_noise": sweep_noise(points, raw_rows),
    }


def sweep_noise(points: list[dict], rows: list[dict]) -> dict | None:
    """How far the sweep's own noise reaches, from the runs of every point: a run's relative sd pooled over the points
    (`pooled_rel_sd`), and per bucket plan / oracle with a 95% interval, each point's median of n runs taken as
    independent at that noise (`pooled_half_width`; the runs of a bucket's points share rounds, so the drift they
    share cancels and the interval is conservative). None where the points keep no runs (a sweep before they did)."""
    runs = {point_key(p["batch"], p["mechanism"], p["draft_len"]): p.get("runs_tokens_per_s") for p in points}
    if not all(r and len(r) >= 2 for r in runs.values()):
        return None
    rel_sd = pooled_rel_sd(runs.values())
    if not rel_sd:
        return None
    buckets = []
    for r in rows:
        plan, oracle = (point_key(r["batch"], r[f"{x}_mechanism"], r[f"{x}_draft_len"]) for x in ("plan", "oracle"))
        value = r["vs_oracle"]["plan"]
        h = (
            0.0
            if plan == oracle
            else math.hypot(*(pooled_half_width(len(runs[k]), rel_sd, 1.0) for k in (plan, oracle)))
        )
        buckets.append(
            {"batch": r["batch"], "plan_vs_oracle": value, "low": value * math.exp(-h), "high": value * math.exp(h)}
        )
    return {"run_rel_sd": rel_sd, "buckets": buckets}


def confirmed(rows: list[dict], runs: dict[tuple[int, str, int], list[float]], repeats: int) -> dict:
    """Plan / oracle per bucket on the re-measure (CONFIRMATION): each side the median of its runs (raw tokens/s), the
    ratio's 95% interval from the runs' pooled relative sd (None with fewer than 3 runs a point); 1 where the plan is
    the oracle."""
    rel_sd = pooled_rel_sd(runs.values())
    buckets = []
    for r in rows:
        plan, oracle = (point_key(r["batch"], r[f"{x}_mechanism"], r[f"{x}_draft_len"]) for x in ("plan", "oracle"))
        if plan == oracle:
            buckets.append({"batch": r["batch"], "plan_vs_oracle": 1.0, "low": 1.0, "high": 1.0, "same_config": True})
            continue
        value = statistics.median(runs[plan]) / statistics.median(runs[oracle])
        h = math.hypot(*(pooled_half_width(len(runs[k]), rel_sd, 1.0) for k in (plan, oracle))) if rel_sd else None
        buckets.append(
            {
                "batch": r["batch"],
                "plan_vs_oracle": value,
                "low": value * math.exp(-h) if h is not None else None,
                "high": value * math.exp(h) if h is not None else None,
                "same_config": False,
                "plan_runs_tokens_per_s": runs[plan],
                "oracle_runs_tokens_per_s": runs[oracle],
            }
        )
    return {
        "method": CONFIRMATION,
        "repeats": repeats,
        "run_rel_sd": rel_sd,
        "buckets": buckets,
        "plan_min_vs_oracle": min(b["plan_vs_oracle"] for b in buckets),
    }


# what a user runs without the tool, and the best it could run, each measured again beside the plan (`headline`)
BASELINES = {
    "no_spec": "no speculation",
    "engine_default": "the engine's default K",
    "single_d": "the best single configuration of the sweep",
    "oracle": "the oracle (the sweep's best configuration at the bucket)",
}
HEADLINE = (
    "after the sweep, every bucket's plan, no speculation, the engine's default K, the sweep's best single "
    "configuration and the bucket's oracle are decoded again in rounds (one run of each distinct configuration per "
    "round, shuffled afresh, the device's speed probed before and after each run): plan / X per bucket is the "
    "geometric mean over the rounds of the round's plan tokens/s over X's, and a mean-speedup ratio the geometric "
    "mean over the rounds of mean_B(plan / no spec) / mean_B(X / no spec); each with its t-interval over the rounds "
    "on a log scale (95%)"
)
TARGETS = {  # the bounds `check_bounds` holds the headline to (docs/benchmarks.md states them)
    "mean_vs_single_d": 0.99,  # and its 95% interval reaching 1.0
    "mean_vs_engine_default": 0.99,  # and its 95% interval reaching 1.0
    "bucket_vs_oracle": 0.98,  # in every bucket, its 95% lower bound at least `bucket_vs_oracle_low`
    "bucket_vs_oracle_low": 0.95,
    "tuning_vs_oracle_sweep": 1 / 3,  # profile + search + refinement against the sweep's seconds
}


def role_keys(row: dict, plan_mech: str) -> dict[str, tuple[int, str, int]]:
    """The point each role decodes at one bucket: the plan's and every baseline's (`BASELINES`)."""
    B = row["batch"]
    return {
        "plan": point_key(B, row["plan_mechanism"], row["plan_draft_len"]),
        "no_spec": point_key(B, NO_SPEC, 0),
        "engine_default": point_key(B, plan_mech, row["default_draft_len"]),
        "single_d": point_key(B, row["single_mechanism"], row["single_draft_len"]),
        "oracle": point_key(B, row["oracle_mechanism"], row["oracle_draft_len"]),
    }


def headline_points(rows: list[dict], plan_mech: str, quants: dict[str, str]) -> list[tuple[int, str, str, int]]:
    """(batch, mechanism, quant, D) of every distinct configuration the headline decodes again."""
    keys = dict.fromkeys(k for r in rows for k in role_keys(r, plan_mech).values())
    return [(B, m, quants.get(m, NO_SPEC), D) for B, m, D in keys]


def _ratio(ratios: list[float]) -> dict:
    low, high = runs_interval(ratios)
    return {"value": statistics.geometric_mean(ratios), "low": low, "high": high}


SPEED_CORRECTED = (
    "each run's tokens/s x f^e, f its device speed factor (probe ms now / probe ms at profile time, the geometric "
    "mean of the probes before and after it: above 1 the device ran slower) and e the elasticity of tokens/s in f: "
    "the least-squares slope of log tokens/s on log f over every run, each configuration at each batch about its own "
    "means, negated and clamped to [0, 1] (a run is partly host work the probe's spell moves less); the ratios then "
    "as the raw ones, e taken as known"
)


def speed_elasticity(runs: dict[Hashable, list[float]], factors: dict[Hashable, list[float]]) -> float:
    """e of SPEED_CORRECTED: how much of the probe's slowdown a run's tokens/s shows."""
    xs, ys = [], []
    for key, rates in runs.items():
        log_f, log_r = [math.log(f) for f in factors[key]], [math.log(r) for r in rates]
        mean_f, mean_r = statistics.mean(log_f), statistics.mean(log_r)
        xs += [x - mean_f for x in log_f]
        ys += [y - mean_r for y in log_r]
    sxx = sum(x * x for x in xs)
    return min(max(-sum(x * y for x, y in zip(xs, ys)) / sxx, 0.0), 1.0) if sxx else 0.0


def headline(
    rows: list[dict],
    runs: dict[tuple[int, str, int], list[float]],
    plan_mech: str,
    factors: dict[tuple[int, str, int], list[float]] | None = None,
) -> dict:
    """The plan against every baseline on the runs measured again (HEADLINE), paired round by round; where each run's
    device speed factor is known (`factors`, aligned with `runs`), the same figures speed-corrected beside them
    (SPEED_CORRECTED)."""
    out = {"method": HEADLINE, "rounds": min(len(v) for v in runs.values()), **_paired(rows, runs, plan_mech)}
    if factors:
        e = speed_elasticity(runs, factors)
        corrected = {k: [r * f**e for r, f in zip(v, factors[k])] for k, v in runs.items()}
        out["speed_corrected"] = {"method": SPEED_CORRECTED, "elasticity": e, **_paired(rows, corrected, plan_mech)}
    return out


def _paired(rows: list[dict], runs: dict[tuple[int, str, int], list[float]], plan_mech: str) -> dict:
    keys = {r["batch"]: role_keys(r, plan_mech) for r in rows}
    rounds = min(len(v) for v in runs.values())
    buckets = []
    for r in rows:
        k = keys[r["batch"]]
        buckets.append(
            {
                "batch": r["batch"],
                "configs": {role: config_name(key[1], key[2]) for role, key in k.items()},
                "tokens_per_s": {role: statistics.median(runs[key]) for role, key in k.items()},
                "plan_vs": {
                    role: {"value": 1.0, "low": 1.0, "high": 1.0, "same_config": True}
                    if k[role] == k["plan"]
                    else _ratio([a / b for a, b in zip(runs[k["plan"]][:rounds], runs[k[role]][:rounds])])
                    | {"same_config": False}
                    for role in BASELINES
                },
            }
        )

    def mean_speedup(role: str, i: int) -> float:
        return statistics.mean(runs[k[role]][i] / runs[k["no_spec"]][i] for k in keys.values())

    return {
        "buckets": buckets,
        "mean_speedup": {role: _ratio([mean_speedup(role, i) for i in range(rounds)]) for role in ("plan", *BASELINES)},
        "plan_vs_mean_speedup": {
            role: _ratio([mean_speedup("plan", i) / mean_speedup(role, i) for i in range(rounds)])
            for role in ("engine_default", "single_d", "oracle")
        },
    }


def headline_bounds(h: dict, tuning_vs_oracle: float | None) -> list[str]:
    """What breaks TARGETS on the headline; one line per violation."""
    out = []
    for role, name in (("single_d", "mean_vs_single_d"), ("engine_default", "mean_vs_engine_default")):
        x = h["plan_vs_mean_speedup"][role]
        if x["value"] < TARGETS[name] or x["high"] < 1.0:
            out.append(
                f"mean speedup, plan / {BASELINES[role]}: {x['value']:.3f} [{x['low']:.3f}-{x['high']:.3f}], below "
                f"{TARGETS[name]} or its interval short of 1.0"
            )
    for b in h["buckets"]:
        x = b["plan_vs"]["oracle"]
        if x["value"] < TARGETS["bucket_vs_oracle"] or x["low"] < TARGETS["bucket_vs_oracle_low"]:
            out.append(
                f"batch {b['batch']}: the plan ({b['configs']['plan']}) reaches {100 * x['value']:.1f}% "
                f"[{100 * x['low']:.1f}-{100 * x['high']:.1f}] of the oracle ({b['configs']['oracle']}), below "
                f"{100 * TARGETS['bucket_vs_oracle']:.0f}% (lower bound {100 * TARGETS['bucket_vs_oracle_low']:.0f}%)"
            )
        d = b["plan_vs"]["engine_default"]
        if b["configs"]["engine_default"] != b["configs"]["oracle"] and d["value"] < 1.0:
            out.append(
                f"batch {b['batch']}: the plan ({b['configs']['plan']}) measures {d['value']:.3f} of the engine's "
                f"default ({b['configs']['engine_default']}), which is not the oracle there"
            )
    if tuning_vs_oracle is not None and tuning_vs_oracle > TARGETS["tuning_vs_oracle_sweep"]:
        out.append(f"tuning cost {tuning_vs_oracle:.2f} of the oracle sweep's, above 1/3")
    return out


def config_name(mech: str, D: int) -> str:
    return "no spec" if D == 0 else f"{mech} D={D}"


def refined_buckets(plan: dict) -> list[dict]:
    """Each refined bucket's record (pipeline/refine.py: the model's D, the contenders measured, the choice)."""
    return [{"batch": b["batch"]} | b["refinement"] for b in plan["buckets"] if b.get("refinement")]


def searched_for(
    profile,
    profile_sha256: str,
    held: list[tuple[list[int], str]],
    seed: int,
    refined: RefineSettings | None = None,
) -> tuple[list[list[int]], dict, dict, float]:
    """(prompts, mix, plan, search seconds): the plan is searched, and every point predicted, for the domain mix of the
    prompts decoded. The length filter keeps mostly HumanEval and extraction prompts, which accept more than the
    profile's equal mix of nine domains. With `refined`, the search's measured refinement runs as `search` runs it
    (on the profiling split, never the held-back prompts decoded here; its seconds are in the search's), and the plan's
    "refine_skipped" says why not where it cannot run (None where it ran)."""
    domains = [d for _, d in held]
    mix = normalise_mix(profile, {d: domains.count(d) for d in dict.fromkeys(domains)})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        found = search(profile, profile_sha256, SearchSettings(seed=seed, out_dir=Path(tmp), mix=tuple(mix.items())))
        why = skipped(found, profile) if refined is not None else "--no-refine"
        if refined is not None and why is None:
            found = refine(found, profile, refined, Path(tmp), on_line=lambda line: print(line, file=sys.stderr))
        elif refined is not None:
            print(f"the plan is not refined: {why}", file=sys.stderr)
        plan = found.to_json() | {"refine_skipped": why}
    return [ids for ids, _ in held], mix, plan, time.perf_counter() - started
