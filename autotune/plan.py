"""plan.json: the chosen schedule with its predicted figures, the reason for each D, and the Pareto set.

Rationale per bucket names the hardware guideline that set D:
  1 the target's GEMMs turn compute-bound (verifying 1+D tokens stops being nearly free)
  2 attention: one tile of R rows holds D up to R/G − 1 (G query heads per KV head)
  3 tile alignment: G·(1+D) a whole number of tiles
  4 low latency: the draft cost caps D
  5 the measured acceptance: it stops growing, or still pays at the longest draft
and, where the schedule's rule set it instead (D never rises with batch; TensorRT-LLM's smallest key carries the
maximum: space.py), that rule ("schedule"), or where the next longer draft does not fit in
memory at that batch ("memory"). Where D was taken over a longer one it ties with (space.py: the 95% interval of their
tokens/s ratio holds 1; without per-prompt counts, their intervals overlap; without intervals, the 2% tolerance)
the rationale says so and carries both intervals (and the ratio's); a bucket whose
prediction rests on a verify cell the monotone fit moved beyond its interval carries a flag naming the cell.

`device.times` is the weakest source among the bucket predictions (`device.sources` counts them), or
"modeled (hardware table)" for a plan projected onto another device.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import overload

import numpy as np

from specdec_tune import __version__
from specdec_tune.autotune.cost_model import SOURCES, CostModel, Figure, Prediction, weakest
from specdec_tune.autotune.engine_pricing import priced
from specdec_tune.autotune.hardware import get_device_spec
from specdec_tune.autotune.plan_schema import PLAN_SCHEMA_VERSION, PREDICTED_FIGURES, Plan, plan_record
from specdec_tune.autotune.projection import project
from specdec_tune.autotune.space import Candidate, Space, share_faster
from specdec_tune.profiles.schema import Profile
from specdec_tune.records import sha256_json


def cost_model_of(profile: Profile, plan: Plan, mix: dict[str, float] | None = None) -> CostModel:
    """The cost model a plan's figures came from (its device projection, mix, context and memory budget): for what the
    plan did not choose (an engine's deviation, the KV capacity it should get). `mix`: another domain mix than the
    plan's (the prompts a measurement decoded)."""
    settings = plan.search_settings
    device = settings.device
    return CostModel(
        project(profile, get_device_spec(device)) if device else profile,
        ctx=plan.ctx,
        mix=mix or plan.mix,
        memory_fraction=settings.memory_fraction,
        tensor_parallel=settings.tensor_parallel or None,
    )


@overload
def figure_json(f: Figure) -> dict: ...
@overload
def figure_json(f: Figure | None) -> dict | None: ...
def figure_json(f: Figure | None) -> dict | None:
    """A figure as plan.json holds it: value, source and its 95% interval (null where the profile has none)."""
    return None if f is None else {"value": f.value, "source": f.source, "low": f.low, "high": f.high}


def _interval(f: Figure) -> list[float] | None:
    return [f.low, f.high] if f.has_interval else None  # type: ignore[list-item]


def _bounds_of(p: Prediction) -> dict:
    return {"draft_len": p.draft_len, "tokens_per_s": _interval(p.tokens_per_s), "speedup": _interval(p.speedup)}


def predicted_json(p: Prediction) -> dict:
    """A prediction's figures as a bucket of plan.json holds them."""
    return {name: figure_json(getattr(p, name)) for name in PREDICTED_FIGURES}


def _loss_pct(own: float, other: float) -> float:
    return 100 * (own - other) / own if own else 0.0


MOE_WAKE_RATIO = 1.15  # more experts woken than this, relative to one token, is named as why speculation loses


def experts_woken(moe: dict, B: int, tokens: int) -> float | None:
    """The profile's measured experts per MoE layer for a verify step of `tokens` tokens per row at batch B (None: not
    measured)."""
    return next((p["experts_woken"] for p in moe.get("points", ()) if p["batch"] == B and p["tokens"] == tokens), None)


def moe_line(
    moe: dict, B: int, tokens: int, verify_ratio: float | None, tokens_per_forward: float | None
) -> dict | None:
    """For a mixture-of-experts target: the experts a step of `tokens` tokens wakes against one token's, and, where
    speculation is off (`verify_ratio` and the `tokens_per_forward` that draft would give are passed), that routing is
    why: the drafts would be accepted (over 1.02 tokens per forward) but the step costs more than they bring, and it
    wakes MOE_WAKE_RATIO times the experts of one token or more."""
    one, many = (experts_woken(moe, B, 1), experts_woken(moe, B, tokens)) if moe else (None, None)
    if not one or many is None:
        return None
    text = (
        f"mixture of experts: verifying {tokens} tokens per row at batch {B} wakes {many:.1f} of {moe['num_experts']} "
        f"experts per layer against {one:.1f} for one token (measured)"
    )
    why = (
        verify_ratio is not None
        and tokens_per_forward is not None
        and many / one >= MOE_WAKE_RATIO
        and 1.02 < tokens_per_forward < verify_ratio
    )
    if why:
        assert verify_ratio is not None  # `why` holds only with a ratio
        text += "; the extra experts' weights are why speculation loses here" + (
            f" (the step costs {verify_ratio:.2f}x one)" if math.isfinite(verify_ratio) else ""
        )
    return {
        "text": text,
        "tokens": tokens,
        "experts_woken": many,
        "experts_woken_one_token": one,
        "why_speculation_loses": why,
    }


def _deciding_guideline(
    space: Space, c: Candidate, B: int, D: int, p: Prediction, allowed: list[int]
) -> tuple[int | str, str]:
    """The guideline (or rule) that set D at batch B, and the line that says how: the schedule's rule where it moved D,
    the longest draft, memory, or what the next longer draft would add (tokens per forward against verify and draft
    time: guidelines 1, 3, 4, 5)."""
    cost, m, q = space.cost, c.mechanism, c.quant
    longer = [d for d in allowed if d > D]
    better_alone = max(allowed, key=lambda d: (space.bucket_value(B, d, m, q, c.tile_policy), -d))
    at = space.buckets.index(B)
    near = at + 1 if D > better_alone else at - 1  # the neighbour that holds it: a larger batch up, a smaller one down
    if D != better_alone and 0 <= near < len(
        c.schedule
    ):  # the schedule's rule moved it: D never rises with batch (space.py)
        return "schedule", (
            f"alone this bucket would take D={better_alone}; D never rises with batch, and the schedule as a whole "
            f"scores higher with D={D} here (batch {space.buckets[near]} takes D={c.schedule[near]})"
        )
    if not longer:
        return 5, f"the longest allowed draft: measured acceptance still pays at D={D}"
    n = cost.predict(B, longer[0], m, q)
    if n.round_ms.source == "infeasible":
        need = cost.memory_need(B, longer[0], m, q)
        why = (
            f"at ctx {cost.ctx} it {need.text()}"
            if need is not None and not need.fits
            else "out of memory when profiled"
        )
        return "memory", f"D={longer[0]} does not fit in memory at batch {B} ({why})"
    # what the next longer draft would add, as shares of this round
    tpf_gain = n.tokens_per_forward.value / p.tokens_per_forward.value - 1
    round_gain = (n.round_ms.value - p.round_ms.value) / p.round_ms.value
    if p.verify_ms is None or n.verify_ms is None:  # the engine's whole round: the cost of a longer draft is not split
        guideline = 3 if c.tile_policy == "aligned" else 5 if D and tpf_gain < 0.005 else 1
        return (
            guideline,
            f"D={longer[0]} would add {tpf_gain:+.1%} tokens per forward against {round_gain:+.1%} time per engine "
            "round",
        )
    verify_gain = (
        n.verify_ms.value - p.verify_ms.value
    ) / p.round_ms.value  # the round in parts: which grows more decides 1 or 4
    draft_gain = round_gain - verify_gain
    guideline = (
        3 if c.tile_policy == "aligned" else 5 if D and tpf_gain < 0.005 else 1 if verify_gain >= draft_gain else 4
    )
    return guideline, (
        f"D={longer[0]} would add {tpf_gain:+.1%} tokens per forward against {verify_gain:+.1%} verify and "
        f"{draft_gain:+.1%} draft+host time per round"
    )


def rationale(space: Space, c: Candidate, B: int, D: int) -> dict:
    """Why this D at this batch: the deciding guideline, the figures behind it, the next-best alternatives."""
    cost, m, q = space.cost, c.mechanism, c.quant
    p = space.cost.predict(B, D, m, q)
    if cost.engine_rounds:  # the engine's whole round at D against its step without speculation
        cost_ratio = cost.predict(B, max(D, 1), m, q).round_ms.value / cost.predict(B, 0, m, q).round_ms.value
        ratio_key, ratio_text = (
            "round_cost_vs_no_speculation",
            (
                f"a round at D={max(D, 1)} costs {cost_ratio:.2f}x a step without speculation"
                if math.isfinite(cost_ratio)
                else f"a round at D={max(D, 1)} does not fit"
            ),
        )
    else:
        cost_ratio = (
            cost.verify_ms(B, 1 + max(D, 1)).value / cost.verify_ms(B, 1).value
        )  # infinite where 1+D tokens ran out of memory
        ratio_key, ratio_text = (
            "verify_cost_vs_one_token",
            (
                f"verifying {1 + D} tokens costs {cost_ratio:.2f}x one"
                if math.isfinite(cost_ratio)
                else f"verifying {1 + max(D, 1)} tokens does not fit"
            ),
        )
    round_ms = p.round_ms.value
    draft_share = p.draft_ms.value / round_ms if p.draft_ms is not None else None  # None: the engine timed whole rounds
    own = space.bucket_score(B, D, m, q)
    allowed = space.allowed(m, c.tile_policy)
    lines = [
        f"D={D}: {p.tokens_per_forward.value:.3f} tokens per target forward; {ratio_text} (M = {B * (1 + D)} GEMM rows)"
        if D
        else f"speculation off at batch {B}"
    ]
    guideline, line = _deciding_guideline(space, c, B, D, p, allowed)
    lines.append(line)
    moe = moe_line(
        cost.profile.moe,
        B,
        1 + max(D, 1),
        None if D else cost_ratio,
        None if D else cost.predict(B, max(D, 1), m, q).tokens_per_forward.value,
    )
    if moe:
        lines.append(moe["text"])
    tile = space.tiles(D)
    if space.tile_rows > 1:
        lines.append(
            f"attention: G·(1+D) = {tile['query_rows_per_kv_head']} query rows per KV head in {tile['tiles']} "
            f"tile(s) of {space.tile_rows} ({tile['fill']:.0%} full); one tile holds D up to {space.tile_rows}/G − 1 = "
            f"{space.tile_rows // space.group - 1} (guidelines 2, 3)"
        )
    else:
        lines.append("no attention tile on this device: guidelines 2 and 3 are neutral")
    # the runner-up among the draft lengths this schedule allows (TensorRT-LLM: none above its maximum)
    others = sorted(
        ((space.bucket_score(B, d, m, q), d) for d in allowed if d != D and d <= max(c.schedule)), reverse=True
    )
    rivals = [
        (max(space.bucket_score(B, d, m2, q2) for d in space.allowed(m2, c.tile_policy)), m2, q2)
        for m2, q2 in space.pairs
        if m2 != m
    ]
    tie = _tie(space, c, B, D)
    if tie:
        lines.append(tie["text"])
    runner_up = tie["with_draft_len"] if tie else others[0][1] if others else None  # the D this one was weighed against
    out = {
        "guideline": guideline,
        "text": "; ".join(lines),
        "figures": {
            "tokens_per_forward": p.tokens_per_forward.value,
            "round_ms": p.round_ms.value,
            **{k: f.value for k in ("verify_ms", "draft_ms", "host_ms") if (f := getattr(p, k)) is not None},
            ratio_key: cost_ratio if math.isfinite(cost_ratio) else None,
            "draft_share": draft_share,
            **tile,
        },
        "next_best": {"draft_len": others[0][1], "loss_pct": _loss_pct(own, others[0][0])} if others else None,
        "tie": tie,
        "decision": decision(space, c, B, D, runner_up),
        "intervals": {
            "chosen": _bounds_of(p),
            "runner_up": _bounds_of(space.cost.predict(B, runner_up, m, q)) if runner_up is not None else None,
        },
    }
    if moe:
        out["moe"] = moe
    if rivals:
        score, m2, q2 = max(rivals)
        out["next_mechanism"] = {"mechanism": m2, "quant": q2, "loss_pct": _loss_pct(own, score)}  # guideline 5
    return out


def _tie(space: Space, c: Candidate, B: int, D: int) -> dict | None:
    """Where the bucket's best D by expected speedup is longer, and D was taken over it within the tie tolerance."""
    _, best = space.bucket_best(B, c.mechanism, c.quant, c.tile_policy)
    if best == D or space.tie_rule(B, D, best, c.mechanism, c.quant) is None:
        return None
    loss = _loss_pct(space.bucket_score(B, best, c.mechanism, c.quant), space.bucket_score(B, D, c.mechanism, c.quant))
    text = (
        f"D={D} is expected {loss:.1f}% below D={best} (mean speedup over {len(space.cost.draws.models)} draws of the "
        f"profile), within the {space.tie_tolerance:.1%} a shorter draft may give up: the shorter draft is taken"
    )
    return {"rule": "expected", "with_draft_len": best, "expected_loss_pct": loss, "text": text}


def decision(space: Space, c: Candidate, B: int, D: int, runner_up: int | None) -> dict | None:
    """The bucket's decision under the profile's uncertainty: its expected speedup, and against the runner-up the
    expected gain and the share of draws in which the choice beats it (None where the bucket has one choice)."""
    if runner_up is None:
        return None
    mine, theirs = (
        space.bucket_score(B, D, c.mechanism, c.quant),
        space.bucket_score(B, runner_up, c.mechanism, c.quant),
    )
    return {
        "expected_speedup": mine,
        "runner_up_draft_len": runner_up,
        "runner_up_expected_speedup": theirs,
        "expected_gain_pct": 100 * (mine / theirs - 1) if theirs else 0.0,
        "p_beats_runner_up": space.beats(B, D, runner_up, c.mechanism, c.quant),
        "draws": len(space.cost.draws.models),
    }


def drafter_decision(space: Space, c: Candidate) -> dict | None:
    """The plan's drafter against the best other one, each at its best schedule at c's policy and cap, as the search
    scored them: expected mean speedups, per draw the runner-up's over the choice's (its mean and 2.5-97.5% points,
    modeled) and the share of draws in which the choice is faster (None where c's drafter is the only one)."""
    runner = space.drafter_runner_up(c)
    if runner is None:
        return None
    mine, theirs = space.schedule_draws(c), space.schedule_draws(runner)  # [draws] each
    ratio = theirs / mine
    low, high = np.quantile(ratio, [0.025, 0.975])
    return {
        "expected_speedup": float(mine.mean()),
        "runner_up": runner.mechanism,
        "runner_up_quant": runner.quant,
        "runner_up_schedule": [[B, D] for B, D in zip(space.served(c.max_batch), runner.schedule)],
        "runner_up_expected_speedup": float(theirs.mean()),
        "runner_up_vs_choice": {
            "value": float(ratio.mean()),
            "source": "modeled",
            "low": float(low),
            "high": float(high),
        },
        "p_beats_runner_up": share_faster(mine, theirs),
        "draws": len(ratio),
    }


def fit_flags(space: Space, B: int, D: int) -> list[str]:
    """The verify cells a prediction rests on, (B, 1) and (B, 1+D), that the monotone fit moved beyond their
    interval."""
    flags = []
    for tokens in sorted({1, 1 + D}):
        moved = space.cost.fit_moved(B, tokens)
        if moved:
            flags.append(
                f"rests on verify cell B={B}, 1+D={tokens}, ctx={space.cost.ctx} which the monotone fit moved from "
                f"{moved[0]:.2f} to {moved[1]:.2f} ms"
            )
    return flags


def bucket_memory(cost: CostModel, mechanism: str, quant: str, B: int, D: int) -> dict:
    """What the bucket holds in device memory at the plan's context, and the concurrency that fits at its D."""
    need = cost.memory_need(B, D, mechanism, quant)
    memory = cost.memory
    assert need is not None and memory is not None, "called only for a profile with a memory record (build_plan)"
    return {
        "needed_bytes": need.total_bytes,
        "weights_bytes": need.weights_bytes,
        "kv_bytes": need.kv_bytes,
        "activation_bytes": need.activation_bytes,
        "max_concurrency": memory.max_concurrency(cost.ctx, D, mechanism, quant),
    }


def device_times(profile: Profile, predictions: list[Prediction]) -> dict:
    """The plan's `device` record: what its figures rest on, the weakest source among the bucket predictions."""
    counts = {s: n for s in SOURCES if (n := sum(p.speedup.source == s for p in predictions))}
    projected = profile.device.get("projected_from")
    times = "modeled (hardware table)" if projected else weakest(*counts)
    return {
        "name": profile.device.get("name"),
        "engine": profile.backend,
        "projected_from": projected,
        "times": times,
        "sources": counts,
    }


def per_domain(space: Space, c: Candidate, domains: dict[str, Space]) -> dict | None:
    """Each domain's own best schedule for the chosen drafter, where the domains disagree on D at some bucket.

    Each domain's choice at a bucket is its own expected-value decision (a shorter draft within the tie tolerance of its
    best taken), so two different choices are apart beyond that tolerance.
    """
    served = space.served(c.max_batch)
    own: dict[str, dict] = {}
    choice: dict[str, dict[int, int]] = {}
    for d, ds in domains.items():
        allowed = ds.allowed(c.mechanism, c.tile_policy)
        choice[d] = {
            B: max(allowed, key=lambda D: (ds.bucket_value(B, D, c.mechanism, c.quant, c.tile_policy), -D))
            for B in served
        }
        best = ds.fill(c.mechanism, c.quant, c.tile_policy, c.max_batch)
        own[d] = {
            "schedule": [
                {
                    "batch": B,
                    "draft_len": D,
                    "speedup": figure_json(ds.cost.predict(B, D, c.mechanism, c.quant).speedup),
                }
                for B, D in zip(served, best.schedule)
            ],
            "mix_schedule_speedup": [
                figure_json(ds.cost.predict(B, D, c.mechanism, c.quant).speedup) for B, D in zip(served, c.schedule)
            ],
        }
    apart = [
        {
            "batch": B,
            "draft_len": D,
            "by_domain": {d: choice[d][B] for d in domains},
            "apart_by": f"the {space.tie_tolerance:.1%} tie tolerance of their expected speedups",
        }
        for B, D in zip(served, c.schedule)
        if len({choice[d][B] for d in domains}) > 1
    ]
    return {"domains": own, "disagreeing_buckets": apart} if apart else None


def disagreement_line(row: dict) -> str:
    ds = ", ".join(f"{d} D={D}" for d, D in row["by_domain"].items())
    return (
        f"batch {row['batch']}: the domains disagree on D beyond {row['apart_by']} ({ds}); "
        f"the mix takes D={row['draft_len']}"
    )


def _point(space: Space, c: Candidate) -> dict:
    p = space.at_cap(c)
    return {
        "mechanism": p.mechanism,
        "quant": p.quant,
        "max_batch": p.batch,
        "draft_len": p.draft_len,
        "tile_policy": c.tile_policy,
        "tokens_per_s": figure_json(p.tokens_per_s),
        "per_user_tokens_per_s": figure_json(p.per_user_tokens_per_s),
    }


def front_coverage(space: Space, found: list[Candidate], exact: list[Candidate]) -> dict:
    """How close a sampled front comes to the exact one: the exact points it holds, and for the others the
    worst shortfall of the best sampled point at the same cap (on the weaker of the two objectives)."""
    have = [space.at_cap(c) for c in found]
    hits, worst = 0, 0.0
    for c in exact:
        e = space.at_cap(c)
        ratios = [
            min(
                p.tokens_per_s.value / e.tokens_per_s.value,
                p.per_user_tokens_per_s.value / e.per_user_tokens_per_s.value,
            )
            for p in have
            if p.batch == e.batch
        ]
        best = max(ratios, default=0.0)
        hits += best >= 1 - 1e-12
        worst = max(worst, 1 - best)
    return {"study_found": hits, "study_worst_gap_pct": 100 * worst}


def build_plan(
    profile: Profile,
    profile_hash: str,
    space: Space,
    c: Candidate,
    *,
    settings,
    storage: str,
    study_summary: dict,
    study_front: list[Candidate] | None,
    domains: dict[str, Space] | None = None,
) -> Plan:
    served = space.served(c.max_batch)
    predictions = [space.cost.predict(B, D, c.mechanism, c.quant) for B, D in zip(served, c.schedule)]
    buckets = [
        {
            "batch": B,
            "draft_len": D,
            "predicted": predicted_json(p),
            "rationale": rationale(space, c, B, D),
            "flags": fit_flags(space, B, D),
            **({"memory": bucket_memory(space.cost, c.mechanism, c.quant, B, D)} if space.cost.memory else {}),
        }
        for B, D, p in zip(served, c.schedule, predictions)
    ]
    exact = space.pareto_front()
    pareto = {
        "exact": [_point(space, x) for x in exact],
        "method": "every operating point (drafter, cap, D at the cap) through the cost model",
    }
    if study_front is not None:
        pareto |= {"study": [_point(space, x) for x in study_front], **front_coverage(space, study_front, exact)}
    unserved = [B for B in space.buckets if B > c.max_batch]
    notes = list(profile.notes) + (
        [f"batch buckets {unserved} are above the chosen cap (max_num_seqs {c.max_batch})"] if unserved else []
    )
    if space.excluded:
        notes.append(f"batch buckets {sorted(space.excluded)} are not planned: {'; '.join(space.excluded.values())}")
    split = per_domain(space, c, domains) if domains else None
    if split:
        notes += [disagreement_line(row) for row in split["disagreeing_buckets"]]
    # the best one D for every bucket (what an engine without a per-batch table runs), for fallbacks and comparison
    single = max(
        space.allowed(c.mechanism, c.tile_policy),
        key=lambda D: (space.schedule_score(dataclasses.replace(c, schedule=(D,) * len(served))), -D),
    )
    single_value = space.schedule_score(dataclasses.replace(c, schedule=(single,) * len(served)))
    plan = plan_record(
        {
            "schema_version": PLAN_SCHEMA_VERSION,
            "tool_version": __version__,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "profile": {
                "fingerprint": profile.fingerprint,
                "sha256": profile_hash,
                "device": profile.device.get("name"),
                "target": profile.target,
            },
            "device": device_times(profile, predictions),
            "notes": notes,
            "excluded_buckets": [{"batch": B, "why": why} for B, why in sorted(space.excluded.items())],
            "mix": dict(space.cost.mix) if space.cost.mix else None,
            "objective": {
                "kind": settings.objective,
                "min_user_tokens_per_s": settings.min_user_tokens_per_s,
                "min_tokens_per_s": settings.min_tokens_per_s,
            },
            "mechanism": c.mechanism,
            "quant": c.quant,
            "max_draft_len": max(c.schedule),
            "max_batch": c.max_batch,
            "ctx": space.cost.ctx,
            "tile": {
                "policy": c.tile_policy,
                "rows": space.tile_rows,
                "group": space.group,
                "policies_searched": space.policies,
            },
            "buckets": buckets,
            **({"per_domain": split} if split else {}),
            **(
                {
                    "memory": space.cost.memory.summary(
                        space.cost.ctx, space.pairs, {m: space.allowed(m, "free") for m, _ in space.pairs}
                    )
                }
                if space.cost.memory
                else {}
            ),
            "single_draft_len": {
                "draft_len": single,
                "mean_speedup": single_value,
                "schedule_mean_speedup": space.schedule_score(c),
            },
            "pareto": pareto,
            "study": {
                "storage": storage,
                "name": settings.study_name,
                "seed": settings.seed,
                "space_size": space.size(),
                **study_summary,
            },
            "settings_hash": sha256_json(dataclasses.asdict(settings) | {"out_dir": None, "storage": None}),
            "search_settings": recorded_settings(settings),
        }
    )
    return priced(plan, space.cost)


def recorded_settings(settings) -> dict:
    """The search settings as plan.json keeps them (where the study lives is left out: it is the run's, not the plan's),
    so that a plan can be searched again with the same settings (`export` does, after re-measuring)."""
    return {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in dataclasses.asdict(settings).items()
        if k not in ("out_dir", "storage")
    }
