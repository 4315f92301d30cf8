"""`specdec-tune search`: from profile.json to plan.json.

The cost model (cost_model.py) answers every candidate; the space (space.py) holds the choices and
engine constraints; the Optuna study (study.py) samples it; the sampled best is polished bucket by
bucket and checked against the exact optimum (the space decomposes, so `exhaustive` is cheap), and
the plan records the gap. `--device` plans for a hardware-table device from a local profile
(projection.py): every time is then modeled, and the plan says so.

`--memory-fraction` (and `--tensor-parallel`) bound every bucket by the memory model (memory.py): a draft length that
does not fit is infeasible there, a bucket that does not fit even without speculation is not planned (its note says by
how much), and the plan records the concurrency that fits per mechanism and D.

`--mix` weights the profile's domains by their share of the requests (the mixed acceptance is derived in
cost_model.py). The plan records the normalised mix; where the domains, each searched alone for the chosen
drafter, disagree on D at some bucket beyond their intervals, it adds `per_domain` and a note per bucket.
"""

from __future__ import annotations

import dataclasses

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel, normalise_mix
from specdec_tune.autotune.hardware import get_device_spec
from specdec_tune.autotune.plan import build_plan, drafter_decision
from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.autotune.projection import project
from specdec_tune.autotune.space import Candidate, Space
from specdec_tune.autotune.study import best_of, front_of, run_study, trials_for
from specdec_tune.formats import WEIGHT_FORMATS
from specdec_tune.profiles.schema import Profile
from specdec_tune.records import sha256_json, write_json
from specdec_tune.settings import SearchSettings

STUDY_FILE = "study.journal"


def knee(space: Space, front: list[Candidate]) -> Candidate:
    """The Pareto point a plan takes: the most throughput that meets the floors; with no floor, the point
    with the largest product of throughput and per-user rate, each relative to the front's maximum."""
    s = space.s
    meets = [
        c
        for c in front
        if space.at_cap(c).per_user_tokens_per_s.value >= s.min_user_tokens_per_s
        and space.at_cap(c).tokens_per_s.value >= s.min_tokens_per_s
    ]
    if not meets:
        raise SpecdecError(
            "no point the study found meets the floors", "raise --trials or lower --min-user-tps / --min-tps"
        )
    if s.min_user_tokens_per_s or s.min_tokens_per_s:
        return max(meets, key=lambda c: space.at_cap(c).tokens_per_s.value)
    top_tps = max(space.at_cap(c).tokens_per_s.value for c in meets)
    top_user = max(space.at_cap(c).per_user_tokens_per_s.value for c in meets)
    return max(
        meets,
        key=lambda c: (
            space.at_cap(c).tokens_per_s.value / top_tps * space.at_cap(c).per_user_tokens_per_s.value / top_user
        ),
    )


def domain_spaces(
    profile: Profile, settings: SearchSettings, mix: dict[str, float], chosen: Candidate
) -> dict[str, Space]:
    """One space per domain of the mix, for the chosen drafter (a domain whose floors cannot be met alone is left
    out)."""
    alone = dataclasses.replace(settings, mechanisms=(chosen.mechanism,), quant_formats=(chosen.quant,))
    spaces = {}
    for domain in mix:
        try:
            spaces[domain] = Space(CostModel(profile, domain=domain, **memory_options(settings)), alone)
        except SpecdecError:
            continue
    return spaces


def memory_options(settings: SearchSettings) -> dict:
    return {"memory_fraction": settings.memory_fraction, "tensor_parallel": settings.tensor_parallel or None}


def search(profile: Profile, profile_hash: str, settings: SearchSettings) -> Plan:
    """The plan for `profile` under `settings`, written to OUT/plan.json (the study beside it, resumable)."""
    if settings.min_tokens_per_s and settings.objective not in ("per-user", "pareto"):
        raise SpecdecError(
            "--min-tps is a floor for the per-user and pareto objectives", "add --objective per-user, or drop --min-tps"
        )
    if not settings.study_name:
        key = sha256_json(
            [profile.fingerprint, dataclasses.asdict(settings) | {"out_dir": None, "storage": None, "trials": None}]
        )
        settings = dataclasses.replace(settings, study_name=f"specdec-tune-{key[:12]}")
    if settings.device:
        spec = get_device_spec(settings.device)
        profile = project(profile, spec)
        settings = dataclasses.replace(settings, quant_formats=tuple(f for f in WEIGHT_FORMATS if f in spec.formats))
    mix = normalise_mix(profile, dict(settings.mix)) if settings.mix else None
    space = Space(CostModel(profile, mix=mix, **memory_options(settings)), settings)
    # the default study is an append-only journal file: one line per trial event, a fraction of SQLite's commit cost
    storage = settings.storage or f"journal:{(settings.out_dir / STUDY_FILE).resolve()}"
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    study = run_study(space, storage, settings)
    exact, exact_value = space.exhaustive()
    strict = space.strict_optimum()
    summary: dict[str, object] = {
        "trials": len(study.trials),
        "trial_budget": trials_for(space, settings),
        "exhaustive_value": exact_value,
        "strict_optimum_value": strict,
        "tie_tolerance": settings.tie_tolerance,
    }
    if settings.objective == "pareto":
        front = front_of(study, space)  # polished: every drafter and D at each cap the study's front reached
        chosen = knee(space, space.pareto_front({c.max_batch for c in front}))
    else:
        front = None
        sampled = best_of(study, space)
        chosen = sampled
        if (
            settings.objective == "speedup"
        ):  # the sampled drafter and policy, with D per bucket exact (the buckets decompose); a drafter listed earlier
            # within the tie tolerance of it taken instead (Space.preferred)
            best_drafter = space.fill(sampled.mechanism, sampled.quant, sampled.tile_policy, sampled.max_batch)
            chosen = space.preferred(best_drafter)
        value = space.score(chosen)
        summary |= {
            "best_sampled_value": space.score(sampled),
            "best_value": value,
            "gap_pct": 100 * (exact_value - value) / exact_value if exact_value else 0.0,
            "gap_to_strict_optimum_pct": 100 * (strict - space.strict_score(chosen)) / strict if strict else 0.0,
        }
        if (
            settings.objective == "speedup"
        ):  # the drafter the ties passed over, if any, with every predicted difference deciding: what the ties gave up
            with space.strictly():
                untied = space.fill(best_drafter.mechanism, best_drafter.quant, chosen.tile_policy, chosen.max_batch)
            if (untied.mechanism, untied.quant) != (chosen.mechanism, chosen.quant):
                summary["untied_drafter"] = {"mechanism": untied.mechanism, "quant": untied.quant}
            summary["untied_schedule"] = [[B, D] for B, D in zip(space.served(chosen.max_batch), untied.schedule)]
            summary["untied_gain_pct"] = 100 * (space.strict_score(untied) / space.strict_score(chosen) - 1)
            summary["drafter_decision"] = drafter_decision(space, chosen)
    # the default study lives beside plan.json: recorded relative to it, so that the plan does not depend on where it
    # was written
    recorded_storage = settings.storage or f"journal:{STUDY_FILE} (beside plan.json)"
    plan = build_plan(
        profile,
        profile_hash,
        space,
        chosen,
        settings=settings,
        storage=recorded_storage,
        study_summary=summary,
        study_front=front,
        domains=domain_spaces(profile, settings, mix, chosen) if mix else None,
    )
    write_json(settings.out_dir / "plan.json", plan.to_json())
    return plan
