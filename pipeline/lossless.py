"""The lossless gate: the plan's drafter at each D > 0 of its schedule, on held-back prompts, in fp32, must reproduce
plain greedy decoding token for token. A plan that never speculates has nothing to compare: the gate is then not
applicable (neither a pass nor a failure), and says so."""

from __future__ import annotations

from typing import Any

from specdec_tune import SpecdecError
from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.profiles.decode_run import decode_prompts
from specdec_tune.profiles.drafters import create
from specdec_tune.profiles.models.loading import LoadedModel, load_model
from specdec_tune.profiles.prompts import prompts_by_domain
from specdec_tune.profiles.schema import Profile
from specdec_tune.settings import MeasureSettings


def profile_drafter(profile: Profile, mechanism: str, quant: str, target: LoadedModel):
    """A drafter the profile measured, over `target`, from the profile's record of it, in weight format `quant`."""
    info = next((d for d in profile.drafters if d.name == mechanism), None)
    if info is None:
        raise SpecdecError(
            f"the profile has no drafter {mechanism!r}", "export with the profile the plan was searched on"
        )
    options = {k: str(v) for k, v in info.options.items() if v not in ("", None)}
    drafter = create(mechanism, target, options)
    return drafter.with_quantized_weights(quant) if quant != "none" else drafter


def plan_drafter(plan: Plan, profile: Profile, target: LoadedModel):
    """The plan's drafter over `target`, in the plan's weight format."""
    return profile_drafter(profile, plan.mechanism, plan.quant, target)


def lossless_gate(plan: Plan, profile: Profile, s: MeasureSettings) -> dict:
    """Greedy speculative output against plain greedy output at each D > 0 of the schedule.

    Returns {"applicable": True, "passed": bool, "runs": [...], ...}, or, for a plan that never speculates (D = 0 in
    every bucket: nothing to compare), {"applicable": False, "passed": None, "note": ...}: neither a pass nor a failure.
    """
    ds = sorted({d for _, d in plan.schedule if d > 0})
    if not ds:
        return {"applicable": False, "passed": None, "draft_lens": [], "note": "the plan never speculates"}
    target = load_model(profile.target["path"], dtype="float32")
    drafter = plan_drafter(plan, profile, target)
    ids = [
        ids
        for ids, _ in prompts_by_domain(
            target.tokenizer, target.model.config.max_position_embeddings, s.prompts, s.new_tokens, max(ds), "held_back"
        )
    ]
    stop = list(target.model.config.eos_token_ids)
    kwargs: dict[str, Any] = dict(max_new_tokens=s.new_tokens, temperature=0.0, seed=s.seed, stop_token_ids=stop)
    plain, _, _ = decode_prompts(target, ids, len(ids), **kwargs)
    runs = []
    for D in ds:
        spec, _, _ = decode_prompts(target, ids, len(ids), drafter=drafter, num_draft_tokens=D, **kwargs)
        same = sum(a == b for a, b in zip(spec, plain))
        runs.append({"draft_len": D, "prompts": len(ids), "identical": same})
    return {
        "applicable": True,
        "passed": all(r["identical"] == r["prompts"] for r in runs),
        "dtype": "float32",
        "split": "held_back",
        "runs": runs,
    }


def lossless_failed(gate: dict) -> bool:
    """Whether the lossless gate failed: passed is False. True passes; None (a plan that never speculates: not
    applicable) and a skipped gate are not failures."""
    return gate.get("passed") is False


def lossless_gate_or_refuse(plan: Plan, profile: Profile, s: MeasureSettings) -> dict:
    """The gate's record, or the one-line refusal of a plan whose drafter changed the greedy output."""
    gate = lossless_gate(plan, profile, s)
    if lossless_failed(gate):
        bad_run = next(r for r in gate["runs"] if r["identical"] != r["prompts"])
        raise SpecdecError(
            f"lossless gate failed: {plan.mechanism} at D={bad_run['draft_len']} changed the greedy output of "
            f"{bad_run['prompts'] - bad_run['identical']} of {bad_run['prompts']} held-back prompts",
            "the drafter or the loop is broken; nothing was exported",
        )
    return gate
