"""Measured refinement: where the cost model cannot separate a bucket's contenders, decode them and keep the fastest.

The search decides each bucket on the mean of the profile's draws (autotune/space.py); a bucket is uncertain where
its choice beats the runner-up in fewer than `CERTAIN` of the draws, or where a shorter draft was taken within the
tie tolerance. At each uncertain bucket B the contenders are, in the plan's mechanism and weights,

    the plan's D, the runner-up D, the D the tolerance passed over, the best single D across buckets (the plan's
    `single_draft_len`), the engine's default K (`ENGINE_DEFAULT_DRAFT_LEN`, capped at the profile's D_max), and D = 0
    where the draws leave it a chance (it beats the plan's D in at least `NO_SPEC_CHANCE` of them)

each decoded end to end in the profile's own engine (this tool's loop, `_LoopGroups`; vLLM, pipeline/refine_engine.py,
where no speculation is two contenders: a K = 0 band of a speculative engine and the plain engine) on the profiling
split of the profile's calibration prompts (the prompts it decided on, those long enough for the plan's context, cut to
it; never the held-back split the lossless gate reads). One Optuna study holds one trial per (bucket, D, engine). A
trial measures in groups: one group is `group_rows(B)` prompts (whole batches of B, at least `group_prompts`) decoding
`new_tokens`, its tokens/s counted over the rounds in which every row of a batch still decodes (what the cost model
predicts), and the trial reports the mean of its groups after each. The trials of a bucket run interleaved, group by
group in a shuffled order each round, so that the device's drift falls on every contender alike. A successive-halving
pruner (`BucketHalving`) keeps, at groups 2, 4, ..., the better half of a bucket's trials by their mean so far, always
at least two.

    budget   a sixth (`BUDGET_SHARE`) of what measuring every D of every bucket with as many groups would cost, priced
             in the loop per batch as its prefill and its rounds until the first row is done (the loop stops there) at
             the predicted round time, each contender's warm-up once (`_LoopGroups.group_cost_s`); in vLLM an engine per
             D and group, each costing what the profile's engines of its mechanism (or the plain ones) cost on
             average, less the acceptance prompts they decoded (`refine_engine.engine_s`); `--refine-budget` sets
             seconds. It bounds what is measured before anything is: the contenders decoded are those whose first
             `MIN_GROUPS` groups fit it (`affordable`): a bucket's model's D and the engine's default K (else the
             contender likeliest to beat it) as a pair, no speculation with them where the draws give it a real chance
             (`NO_SPEC_FIRST`; in its place where the three do not fit), the pairs in the order of their expected gain,
             then the measured buckets' other contenders, likeliest first; the rest are recorded as not measured, a
             bucket no pair of which fits keeps the model's D. It is looked at again between groups, at the last group's
             time per contender (less its warm-ups, paid once): after the first, the contenders let in last leave until
             the rest's remaining `MIN_GROUPS` groups fit (a pair leaves whole; they are recorded pruned, one group's
             figure without an interval); later, where the next group would overrun it, the contenders still in stop
             with as many groups
    result   per bucket, among the trials not pruned, the highest expected tokens/s over the model's D, the cost model's
             draws and the measured groups combined (`expected_vs_model`: a group decodes the same prompts for every
             contender, so the ratio pairs them; a few noisy groups move the prediction little), each measured ratio
             first carried from the domains the groups decoded to the plan's mix by the cost model (`_to_plan_mix`; the
             bucket records the decoded mix), D kept from rising with batch. Each measured figure's 95% interval is the
             t-interval over the groups on a log scale (`intervals.runs_interval`). Where the choice is not the model's
             D, the bucket takes it and its rationale says why; the figures are labelled `measured (refinement)`. Its
             prediction is the cost model's at that D, but for its throughput (tokens/s, per-user tokens/s, speedup):
             those are the model's D's times the choice's expected ratio over it, source "fitted" (`fitted_prediction`),
             so that a bucket which measured faster than the model's D never states less

The study lives in a journal beside the plan (or any Optuna storage URL: several workers, one per device, may measure
one study, each taking the (bucket, D) no other has started); a killed run resumes it, a finished trial is never
measured again, and the export's repair (pipeline/repair.py), which re-plans on re-measured cells, refines its new plan
from the same study.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
import optuna

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel, normalise_mix
from specdec_tune.autotune.engine_pricing import priced
from specdec_tune.autotune.plan import bucket_memory, cost_model_of, predicted_json
from specdec_tune.autotune.plan_schema import Bucket, BucketRefinement, Contender, Figure, Plan, Refinement
from specdec_tune.autotune.study import open_storage
from specdec_tune.pipeline.lossless import plan_drafter
from specdec_tune.pipeline.refine_engine import PLAIN, EngineGroups
from specdec_tune.pipeline.throughput_check import WARMUP_TOKENS, another_device, context_prompts_by_domain
from specdec_tune.profiles.calibration import load_calibration
from specdec_tune.profiles.intervals import runs_interval
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.prompts import cut_length
from specdec_tune.profiles.schema import Profile
from specdec_tune.profiles.specdec import generate
from specdec_tune.settings import ENGINE_DEFAULT_DRAFT_LEN, RefineSettings

MIN_GROUPS = 2  # groups a contender decodes before it is judged: the budget lets in contenders whose groups fit
BUDGET_SHARE = 1 / 6  # of what measuring every D of every bucket would cost: the refinement's default budget
# The cost model's error on the ratio of two D's tokens/s at one batch, beside its draws' spread: the rms of
# log(measured ratio / predicted ratio) over the 112 D-pairs of bench/results/decision_quality.json is 0.055, that
# sweep's own noise included (a point's relative sd about 0.04).
MODEL_RATIO_SD = 0.05
NO_SPEC_CHANCE = 0.01  # D = 0 is a contender where it beats the model's D in at least this share of the draws
NO_SPEC_FIRST = 0.1  # ... and joins the bucket's first pair where it does in at least this share
SPREAD_DRAWS = 4000  # draws of the groups' spread in `expected_vs_model`
CERTAIN = 0.9  # a choice faster than its runner-up in at least this share of the draws is not measured
LABEL = "measured (refinement)"


def skipped(plan: Plan, profile: Profile) -> str | None:
    """Why this plan cannot be refined here, or None."""
    if plan.projected:
        return f"the plan is for {plan.device.name} (modeled): only the device that runs it can measure it"
    other = another_device(profile.device)
    if other:
        return f"the profile was measured on another device ({other})"
    why = GROUP_DECODERS[profile.backend].unavailable(profile)
    if why:
        return f"the profile's engine does not run here ({why})"
    try:
        load_calibration(profile.workload.calibration)
    except SpecdecError as e:
        return f"the profile's calibration prompts do not load here ({e.message})"
    return None


def uncertain(plan: Plan) -> list[int]:
    """The batches whose choice the model did not settle (module docstring)."""
    batches = []
    for b in plan.buckets:
        decision, tie = b.rationale.decision, getattr(b.rationale, "tie", None)
        if tie or decision is None or decision.p_beats_runner_up < CERTAIN:
            batches.append(b.batch)
    return batches


def contenders(plan: Plan, batch: int, max_draft_len: int, cost: CostModel) -> dict[int, str]:
    """{D: why it is measured} at one bucket (module docstring), longest role first where two name one D."""
    bucket = next(b for b in plan.buckets if b.batch == batch)
    roles: dict[int, str] = {bucket.draft_len: "the model's choice"}
    if bucket.rationale.decision is not None:
        roles.setdefault(bucket.rationale.decision.runner_up_draft_len, "the runner-up")
    tie = getattr(bucket.rationale, "tie", None)
    if isinstance(tie, dict) and "with_draft_len" in tie:
        roles.setdefault(int(tie["with_draft_len"]), "passed over by the tie tolerance")
    roles.setdefault(plan.single_draft_len.draft_len, "the best single D")
    roles.setdefault(engine_default(plan, max_draft_len), "the engine's default K")
    if float((cost.draws.speedup(batch, bucket.draft_len, plan.mechanism, plan.quant) <= 1).mean()) >= NO_SPEC_CHANCE:
        roles.setdefault(0, "no speculation")
    return {D: why for D, why in roles.items() if D <= max_draft_len}


class BucketHalving(optuna.pruners.BasePruner):
    """Successive halving within a bucket: at group r = 2, 4, 8, ... a trial is pruned where its mean so far is below
    the `keep`-th best mean at r among its bucket's trials that reached r (keep = half of them, at least two)."""

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        if step is None or step < 2 or step & (step - 1):  # rungs at 2, 4, 8, ...
            return False
        batch = trial.user_attrs["batch"]
        at_rung = [
            t.intermediate_values[step]
            for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("batch") == batch and step in t.intermediate_values
        ]
        keep = max(2, len(at_rung) // 2)
        if len(at_rung) <= keep:
            return False
        return trial.intermediate_values[step] < sorted(at_rung, reverse=True)[keep - 1]


# A contender: (batch, D, engine), engine "" where the backend runs every D one way (this tool's loop; in vLLM a
# speculative engine, D = 0 a K = 0 band of it) and PLAIN for vLLM's engine without a speculative config
Key = tuple[int, int, str]


def _key(t: optuna.trial.FrozenTrial) -> Key:
    return t.user_attrs["batch"], t.user_attrs["draft_len"], t.user_attrs.get("engine", "")


def _name(key: Key) -> str:
    return "the plain engine" if key[2] == PLAIN else f"D={key[1]}"


@dataclasses.dataclass
class _Running:
    trial: optuna.Trial
    batch: int
    draft_len: int
    engine: str
    rates: list[float] = dataclasses.field(default_factory=list)
    domains: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # of the prompts decoded

    @property
    def key(self) -> Key:
        return self.batch, self.draft_len, self.engine


def group_rows(batch: int, prompts: int) -> int:
    """Prompts one group decodes at `batch`: whole batches, at least `prompts` (RefineSettings.group_prompts)."""
    return batch * -(-prompts // batch)


def sweep_cost_s(plan: Plan, profile: Profile, cost: CostModel, s: RefineSettings, max_draft_len: int) -> float:
    """What measuring every D of every bucket with `s.groups` groups would cost, as the profile's backend runs them."""
    every = [(b.batch, D, "") for b in plan.buckets for D in range(max_draft_len + 1)]
    return groups_cost_s(plan, profile, cost, s, every, s.groups)


def groups_cost_s(plan: Plan, profile: Profile, cost: CostModel, s: RefineSettings, keys: list[Key], n: int) -> float:
    """`n` groups of `keys` as the profile's backend decodes them, the first with its warm-ups."""
    price = GROUP_DECODERS[profile.backend].group_cost_s
    return price(plan, profile, cost, s, keys, first=True) + (n - 1) * price(plan, profile, cost, s, keys)


def engine_default(plan: Plan, max_draft_len: int) -> int:
    """The engine's default K for the plan's mechanism (`ENGINE_DEFAULT_DRAFT_LEN`), capped at the profile's D_max."""
    return min(ENGINE_DEFAULT_DRAFT_LEN.get(plan.mechanism, 3), max_draft_len)


def affordable(
    plan: Plan, profile: Profile, cost: CostModel, s: RefineSettings, wanted: dict[Key, str], budget_s: float
) -> list[Key]:
    """The contenders whose first `MIN_GROUPS` groups fit the budget, in the order they were let in. A bucket is
    measured as a pair first: its model's D and a challenger, the engine's default K where it is a contender (what
    the user runs without the plan), else the contender likeliest to beat the model's D (the share of the cost
    model's draws in which it is faster), and no speculation (as the backend runs it in the plan's engine: in vLLM a
    K = 0 band) where it beats the model's D in at least `NO_SPEC_FIRST` of the draws (where speculation may lose,
    the bucket is not left to choose between two draft lengths; where the three do not fit, no speculation is the
    challenger: whether to speculate comes before which K, and the default K may follow with the other contenders);
    the buckets in the order of what measuring the pair is expected to gain (the largest mean over the draws of a
    challenger's excess over the model's D), each while the pairs so far fit; then the measured buckets' other
    contenders, likeliest first, while their groups' price holds. What does not fit is recorded as not measured."""
    model_d = {b.batch: b.draft_len for b in plan.buckets}
    model_draws = {B: cost.draws.speedup(B, D, plan.mechanism, plan.quant) for B, D in model_d.items()}
    default = engine_default(plan, min(profile.workload.max_draft_len, cost.draft_len_limit(plan.mechanism)))

    # per contender and draw: its speedup over the model's D's
    over_model = {k: cost.draws.speedup(k[0], k[1], plan.mechanism, plan.quant) / model_draws[k[0]] for k in wanted}
    chance = {k: float((ratio > 1.0).mean()) for k, ratio in over_model.items()}
    challengers = sorted(
        (k for k in wanted if k[1] != model_d[k[0]] or k[2]),
        key=lambda k: (k[1] == default and not k[2], chance[k]),
        reverse=True,
    )
    units = []  # per bucket: (expected gain, its ways to be measured first, each tried where the one before won't fit)
    for B in dict.fromkeys(k[0] for k in wanted):
        first = next((k for k in challengers if k[0] == B), None)
        if first is None:
            continue
        model_key = [k for k in wanted if k[0] == B and k[1] == model_d[B] and not k[2]]
        plain: Key = (B, 0, "")
        ways = [[first]]
        if plain in challengers and plain != first and chance[plain] >= NO_SPEC_FIRST:
            ways = [[first, plain], [plain]]
        gain = max(float(np.maximum(over_model[k] - 1.0, 0.0).mean()) for k in ways[0])
        units.append((gain, [model_key + way for way in ways]))
    chosen: list[Key] = []
    for _, ways in sorted(units, key=lambda u: u[0], reverse=True):
        way = next(
            (w for w in ways if groups_cost_s(plan, profile, cost, s, [*chosen, *w], MIN_GROUPS) <= budget_s), []
        )
        chosen += way
    measured = {k[0] for k in chosen}
    for k in (k for k in challengers if k[0] in measured and k not in chosen):
        if groups_cost_s(plan, profile, cost, s, [*chosen, k], MIN_GROUPS) <= budget_s:
            chosen.append(k)
    return chosen


def refine(
    plan: Plan, profile: Profile, s: RefineSettings, out_dir: Path, on_line: Callable[[str], None] = print
) -> Plan:
    """The plan with its uncertain buckets measured (module docstring); a plan with none comes back as it was, its
    `refinement` saying so."""
    batches = uncertain(plan)
    cost = cost_model_of(profile, plan)
    max_draft_len = min(profile.workload.max_draft_len, cost.draft_len_limit(plan.mechanism))
    budget_s = s.budget_s or sweep_cost_s(plan, profile, cost, s, max_draft_len) * BUDGET_SHARE
    summary: dict[str, Any] = {
        "source": LABEL,
        "split": "profile",
        "groups": s.groups,
        "new_tokens": s.new_tokens,
        "budget_s": budget_s,
        "uncertain_batches": batches,
        "certain_when": f"the choice beats its runner-up in at least {CERTAIN:.0%} of the draws, no tie",
    }
    if not batches:
        return plan.model_copy(update={"refinement": Refinement(**summary, spent_s=0.0, trials=0, pruned=0)})
    storage = s.storage or f"journal:{out_dir / 'refine.journal'}"
    study = optuna.create_study(
        storage=open_storage(storage),
        # named by what the decodes depend on (search settings, and the profile's device, models and workload), not
        # by profile.json's bytes: a repair that re-measures cells and re-plans finds the trials it already decoded
        study_name=f"refine-{plan.settings_hash[:12]}-{profile.fingerprint[:12]}",
        direction="maximize",
        pruner=BucketHalving(),
        load_if_exists=True,
    )
    wanted = _wanted(plan, profile, batches, max_draft_len, cost)
    kept = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = {_key(t): t for t in study.get_trials(deepcopy=False, states=kept) if "batch" in t.user_attrs}
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    if s.storage is None:  # a run of this journal that was killed: its open trials start over
        for t in running:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        running = []
    started = {_key(t) for t in running}  # another worker's, on a shared storage
    within = affordable(plan, profile, cost, s, wanted, budget_s)
    todo = [k for k in wanted if k in within and k not in done and k not in started]
    t0 = time.monotonic()
    if todo:
        on_line(
            f"refine: {len(wanted)} contenders at batch {', '.join(map(str, batches))}; {len(within)} within the "
            f"budget of {budget_s:.0f} s (the others expected to gain less), {len(done)} already measured"
        )
        _measure(plan, profile, s, study, todo, within, budget_s, on_line)
    spent_s = time.monotonic() - t0
    finished = {_key(t): t for t in study.get_trials(deepcopy=False, states=kept) if "batch" in t.user_attrs}
    return _refined(plan, profile, cost, wanted, finished, summary | {"storage": storage, "spent_s": spent_s})


def settings_of(refinement: Refinement, out_dir: Path) -> RefineSettings:
    """The RefineSettings a plan's refinement ran with (its own journal in `out_dir` as the default storage)."""
    own = refinement.storage in (None, f"journal:{out_dir / 'refine.journal'}")
    return RefineSettings(
        groups=refinement.groups,
        new_tokens=refinement.new_tokens,
        budget_s=refinement.budget_s,
        storage=None if own else refinement.storage,
    )


def prefill_s(cost: CostModel, batch: int, prompt_tokens: int) -> float:
    """A prefill of `batch` prompts of `prompt_tokens`, priced on the profile's verify cells: the one-token step at B,
    plus each row's further tokens at the per-token slope of batch 1's verify line (1 to 1 + D_max tokens). Batch 1's
    slope, as the slope at B itself overstated the loop's timed prefills at batch 8 on a 2-core CPU (measured once;
    `bench/refine_price.py` times the whole price against the loop)."""
    one = cost.verify_ms(1, 1).value
    slope_ms = (cost.verify_ms(1, cost.max_draft_len + 1).value - one) / cost.max_draft_len
    return (cost.verify_ms(batch, 1).value + batch * (prompt_tokens - 1) * slope_ms) / 1e3


def rounds_to_first_done(profile: Profile, cost: CostModel, plan: Plan, batch: int, draft_len: int, n: int) -> float:
    """Expected rounds a batch of `batch` prompts decodes until its first row has `n` tokens: the mean of the least of
    B prompts' rounds, drawn from the profile's greedy per-prompt counts for the plan's drafter, each prompt's rounds
    scaled to `n`. With the r_(k) sorted ascending over N prompts,

        E[min of B draws] = Σ_k r_(k) · (((N − k + 1)/N)^B − ((N − k)/N)^B)

    Without per-prompt counts: n over the predicted tokens per round."""
    if draft_len == 0:
        return float(n)
    record = next(
        (
            a
            for a in profile.acceptance
            if (a.mechanism, a.quant, a.domain, a.temperature) == (plan.mechanism, plan.quant, "all", 0.0)
            and a.per_prompt is not None
            and draft_len <= a.max_draft_len
        ),
        None,
    )
    if record is None:
        return n / cost.predict(batch, draft_len, plan.mechanism, plan.quant).tokens_per_forward.value
    assert record.per_prompt is not None  # selected above
    rounds = np.sort([row[draft_len] * n / record.new_tokens for row in record.per_prompt.rounds])  # [N]
    at_least = ((len(rounds) - np.arange(len(rounds) + 1)) / len(rounds)) ** batch  # P(min ≥ r_(k)), k = 1..N+1
    return float(rounds @ (at_least[:-1] - at_least[1:]))


class _LoopGroups:
    """Groups decoded in this tool's loop (the torch backend): each contender's `group_rows(B)` prompts as batches of
    B, one after another in the group's order, after a short warm-up the first time."""

    plain_engine = False  # D = 0 is plain decoding in the loop: one way

    @staticmethod
    def unavailable(profile: Profile) -> str | None:
        return None

    @staticmethod
    def group_cost_s(
        plan: Plan, profile: Profile, cost: CostModel, s: RefineSettings, keys: list[Key], first: bool = False
    ) -> float:
        """One group of `keys`, one after another: each batch's prefill (`prefill_s`) and its rounds until its first
        row is done (`rounds_to_first_done`; the loop stops there) at the predicted round time; in the `first` group
        each key's warm-up too (one batch, `WARMUP_TOKENS`)."""
        prompt_tokens = cut_length(plan.ctx, s.new_tokens)  # the pool's prompts (context_prompts)

        def batch_s(B: int, D: int, new_tokens: int) -> float:
            round_ms = cost.predict(B, D, plan.mechanism, plan.quant).round_ms.value
            rounds = rounds_to_first_done(profile, cost, plan, B, D, new_tokens)
            return prefill_s(cost, B, prompt_tokens) + rounds * round_ms / 1e3

        return sum(
            group_rows(B, s.group_prompts) // B * batch_s(B, D, s.new_tokens)
            + (batch_s(B, D, WARMUP_TOKENS) if first else 0.0)
            for B, D, _ in keys
        )

    def __init__(self, plan: Plan, profile: Profile, s: RefineSettings, todo: list[Key]) -> None:
        self.target = load_model(profile.target["path"], dtype=profile.device.get("dtype") or "auto")
        self.drafter = plan_drafter(plan, profile, self.target)
        self.s = s
        spec = profile.workload.calibration
        prompts = context_prompts_by_domain(
            self.target, plan.ctx, s.new_tokens, max(k[1] for k in todo), "profile", spec=spec
        )
        self.pool, self.domains = [ids for ids, _ in prompts], [domain for _, domain in prompts]
        if not self.pool:
            raise SpecdecError(
                f"no prompt of the profiling split of {spec} reaches the plan's context of {plan.ctx} tokens",
                "pass --no-refine",
            )
        self.warm: set[Key] = set()
        self.warmup_s = 0.0  # the warm-ups' seconds so far: paid once per contender, not by a later group

    def __enter__(self) -> _LoopGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _turn(self, group: int, batch: int) -> list[int]:
        """The pool's prompts (indices) a contender at `batch` decodes in `group`."""
        rows = group_rows(batch, self.s.group_prompts)
        return [(group * rows + i) % len(self.pool) for i in range(rows)]

    def decoded_domains(self, group: int, batch: int) -> list[str]:
        return [self.domains[i] for i in self._turn(group, batch)]

    def rates(self, group: int, order: list[_Running]) -> list[float]:
        out = []
        for r in order:
            ids = [self.pool[i] for i in self._turn(group, r.batch)]
            kwargs: dict[str, Any] = dict(
                drafter=self.drafter if r.draft_len else None,
                num_draft_tokens=r.draft_len,
                max_new_tokens=self.s.new_tokens,
                temperature=0.0,
                seed=self.s.seed,
                stop_token_ids=(),
                until_first_done=True,  # the tail is not read: only the rounds every row decodes count
            )
            if r.key not in self.warm:
                started = time.monotonic()
                generate(self.target.model, ids[: r.batch], **(kwargs | {"max_new_tokens": WARMUP_TOKENS}))
                self.warm.add(r.key)
                self.warmup_s += time.monotonic() - started
            outs = [generate(self.target.model, ids[i : i + r.batch], **kwargs) for i in range(0, len(ids), r.batch)]
            out.append(sum(o.full_batch_tokens for o in outs) / sum(o.full_batch_s for o in outs))
        return out


# Per measurement backend, what decodes its groups (a context manager): `rates(group, order)` each contender's tokens/s
# on the group's prompts; `warmup_s` the seconds spent so far on what no later group repeats; `plain_engine` whether
# D = 0 runs two ways (a plain engine apart); `unavailable` why it cannot run here, or None; `group_cost_s` what one
# group of some contenders costs in it
GROUP_DECODERS: dict[str, Any] = {"torch": _LoopGroups, "vllm": EngineGroups}


def _wanted(plan: Plan, profile: Profile, batches: list[int], max_draft_len: int, cost: CostModel) -> dict[Key, str]:
    """{contender: why it is measured} over the uncertain batches; no speculation once per way the backend runs it (in
    vLLM a K = 0 band of a speculative engine, which a mixed plan's D = 0 buckets run, and the plain engine, which a
    plan that never speculates runs: two engine paths)."""
    wanted: dict[Key, str] = {}
    two_ways = GROUP_DECODERS[profile.backend].plain_engine
    for B in batches:
        for D, why in contenders(plan, B, max_draft_len, cost).items():
            if D or not two_ways:
                wanted[B, D, ""] = why
                continue
            wanted[B, 0, ""] = why + " (K = 0 in the speculative engine)"
            wanted[B, 0, PLAIN] = "no speculation: the plain engine, no speculative config"
    return wanted


def _measure(
    plan: Plan,
    profile: Profile,
    s: RefineSettings,
    study: optuna.Study,
    todo: list[Key],
    let_in: list[Key],
    budget_s: float,
    on_line: Callable[[str], None],
) -> None:
    """Every contender of `todo` as a trial, interleaved group by group, until each finished, was pruned or the budget
    ran out (module docstring); where the first group says the rest will not fit, those let in last (`let_in`, the
    budget's order) leave first."""
    with GROUP_DECODERS[profile.backend](plan, profile, s, todo) as groups:
        running = []
        for B, D, engine in todo:
            trial = study.ask()
            trial.set_user_attr("batch", B)
            trial.set_user_attr("draft_len", D)
            if engine:
                trial.set_user_attr("engine", engine)
            running.append(_Running(trial, B, D, engine))
        rng = random.Random(s.seed)
        t0 = time.monotonic()
        group_s_per_trial = 0.0  # the last group's wall time per contender: what the next group will cost
        for group in range(s.groups):
            if 0 < group < MIN_GROUPS:  # the price was a prediction: the first group's time says what still fits
                left_s = budget_s - (time.monotonic() - t0)
                by_rank = sorted(running, key=lambda r: let_in.index(r.key))
                for r in _over_budget(by_rank, group_s_per_trial, MIN_GROUPS - group, left_s):
                    study.tell(r.trial, state=optuna.trial.TrialState.PRUNED)
                    running.remove(r)
                    on_line(f"refine: batch {r.batch} {_name(r.key)} left after {len(r.rates)} group(s) for the budget")
            next_s = group_s_per_trial * len(running)
            if group >= MIN_GROUPS and time.monotonic() - t0 + next_s > budget_s:
                on_line(f"refine: the budget of {budget_s:.0f} s allows {group} groups of {s.groups}")
                break
            if not running:
                break
            started, warmed_s = time.monotonic(), groups.warmup_s
            order = running[:]
            rng.shuffle(order)  # every contender decodes the same prompts in this group, in another order each time
            for r, rate in zip(order, groups.rates(group, order)):
                r.rates.append(rate)
                r.domains.update(groups.decoded_domains(group, r.batch))
                r.trial.set_user_attr("rates", r.rates)  # a pruned contender's groups still pair with the others'
                r.trial.set_user_attr("domains", dict(r.domains))
                r.trial.report(statistics.fmean(r.rates), step=len(r.rates))
            # what the next group costs: this one's time less its warm-ups, which no later group repeats
            group_s_per_trial = (time.monotonic() - started - (groups.warmup_s - warmed_s)) / len(order)
            for r in order:
                if r.trial.should_prune():
                    study.tell(r.trial, state=optuna.trial.TrialState.PRUNED)
                    running.remove(r)
                    on_line(f"refine: batch {r.batch} {_name(r.key)} pruned after {len(r.rates)} groups")
            on_line(f"refine: group {group + 1} of {s.groups} done, {len(running)} contenders left")
        for r in running:
            study.tell(r.trial, statistics.fmean(r.rates))


def _over_budget(by_rank: list[_Running], s_per_trial: float, groups: int, left_s: float) -> list[_Running]:
    """The contenders to leave so that `groups` more groups of the rest fit in `left_s` at `s_per_trial`: the last let
    in first (`by_rank` in `affordable`'s order), and a bucket's model D with its last challenger (a pair is measured
    whole)."""
    kept = by_rank[:]
    out: list[_Running] = []
    while kept and groups * s_per_trial * len(kept) > left_s:
        last = kept.pop()
        out.append(last)
        mine = [r for r in kept if r.batch == last.batch]
        if len(mine) == 1:  # the bucket's model D alone: nothing left to pair with it
            kept.remove(mine[0])
            out.append(mine[0])
    return out


def _figure(values: list[float]) -> Figure:
    """The geometric mean of a contender's groups with its 95% interval (none from a single group)."""
    low, high = runs_interval(values) if len(values) > 1 else (None, None)
    return Figure(value=statistics.geometric_mean(values), source="measured", low=low, high=high)


def _contender(
    t: optuna.trial.FrozenTrial | None,
    key: Key,
    role: str,
    predicted: float,
    reference: list[float],
    expected: Figure | None,
) -> Contender:
    """One contender's record; `reference` the model's D's group rates (pruned or not; empty where it has none)."""
    rates = _rates(t)
    paired = [r / m for r, m in zip(rates, reference)]
    return Contender(
        draft_len=key[1],
        engine="plain" if key[2] == PLAIN else None,
        role=role,
        predicted_tokens_per_s=predicted,
        measured_tokens_per_s=_figure(rates) if rates else None,
        vs_model=_figure(paired) if paired else None,
        expected_vs_model=expected,
        groups=len(rates),
        outcome="not measured" if t is None else "pruned" if t.state == optuna.trial.TrialState.PRUNED else "measured",
    )


def _rates(t: optuna.trial.FrozenTrial | None) -> list[float]:
    return list(t.user_attrs.get("rates", [])) if t is not None else []


def expected_vs_model(
    model_log_ratios: dict[Hashable, np.ndarray], paired: dict[Hashable, list[float]]
) -> dict[Hashable, Figure]:
    """Each contender's tokens/s over the model's D at one bucket, expected from the model and the groups together.

    For a contender D, the cost model's draws give log(TPS_D / TPS_model) a normal prior N(mu_m, s_m^2), s_m^2 the
    draws' variance + MODEL_RATIO_SD^2; its n paired groups give the mean x of their log-ratios with variance
    v^2 / n. Given v^2 the posterior is normal with precision 1/s_m^2 + n/v^2 and mean (mu_m/s_m^2 + x n/v^2) over that
    precision. v^2 itself is known only from the bucket's few groups (sum of squares about each contender's mean, S,
    over df = sum of n - 1): it is drawn from its posterior S / chi^2_df (`SPREAD_DRAWS`, seeded), and the figure is
    the mixture over those draws: its expected ratio E[exp(mu)], 95% interval the mixture's 2.5% and 97.5% points,
    source "fitted" (the model fitted to what was measured). Where the groups leave v^2 wide (two groups: df = 1) the
    draws that make them noisy give way to the model; where they are many and consistent they decide. On simulated
    buckets it covers 90-95% of truths at 2-4 groups, typically narrower than the model alone (a plug-in v^2 with
    1.96 covered 70-85%; Student's t on the posterior sd 95%, up to four times as wide as the model at two groups).
    With no groups, the model alone (1.96). `paired` holds each D's paired log-ratios (the model's D itself excluded:
    its ratio is 1)."""
    groups = {D: np.asarray(x, dtype=np.float64) for D, x in paired.items() if len(x)}
    df = sum(x.size - 1 for x in groups.values())
    squares = sum(float(((x - x.mean()) ** 2).sum()) for x in groups.values())
    rng = np.random.default_rng(0)
    spread = squares / rng.chisquare(df, SPREAD_DRAWS) if df and squares > 0 else None  # draws of v^2
    unit = rng.standard_normal(SPREAD_DRAWS)
    out = {}
    for D, draws in model_log_ratios.items():
        prior_mean, prior_var = float(draws.mean()), float(draws.var()) + MODEL_RATIO_SD**2
        x = groups.get(D)
        if x is None or not df:
            half = 1.96 * math.sqrt(prior_var)
            out[D] = Figure(
                value=math.exp(prior_mean + prior_var / 2),
                source="fitted",
                low=math.exp(prior_mean - half),
                high=math.exp(prior_mean + half),
            )
            continue
        if spread is None:  # noiseless groups: they alone decide
            logs = np.full(SPREAD_DRAWS, float(x.mean()))
        else:
            precision = 1 / prior_var + x.size / spread
            mean = (prior_mean / prior_var + float(x.mean()) * x.size / spread) / precision
            logs = mean + unit / np.sqrt(precision)  # one draw of log ratio per draw of v^2
        low, high = np.quantile(logs, [0.025, 0.975])
        out[D] = Figure(value=float(np.exp(logs).mean()), source="fitted", low=math.exp(low), high=math.exp(high))
    return out


def _log_ratios(cost: CostModel, plan: Plan, b: Bucket, keys: list[Key]) -> dict[Hashable, np.ndarray]:
    """Per contender, the cost model's draws of log(its tokens/s over the model's D's) at bucket `b`."""
    model = np.log(cost.draws.speedup(b.batch, b.draft_len, plan.mechanism, plan.quant))
    return {k: np.log(cost.draws.speedup(b.batch, k[1], plan.mechanism, plan.quant)) - model for k in keys}


def _to_plan_mix(
    profile: Profile,
    plan: Plan,
    b: Bucket,
    keys: list[Key],
    prior: dict[Hashable, np.ndarray],
    decoded: dict[str, int],
) -> dict[Hashable, float]:
    """Per contender, what carries a log ratio measured on the groups' prompts to the plan's traffic: the cost model's
    mean log ratio for the plan's mix less that for the mix of domains the groups decoded (`decoded`, prompt counts).
    The groups decode the profiling prompts long enough for the plan's context, mostly HumanEval and extraction, which
    accept far more than the plan's mix: read as they are, a longer draft measures better than the plan's traffic would
    see it. Zero where the groups' domains are the plan's mix or the profile has no acceptance for one of them."""
    plan_mix = plan.mix or {d: 1 / len(profile.workload.domains) for d in profile.workload.domains}
    total = sum(decoded.values())
    shares = {d: n / total for d, n in decoded.items()} if total else {}
    if not shares or all(abs(shares.get(d, 0.0) - w) < 1e-9 for d, w in plan_mix.items()):
        return {k: 0.0 for k in keys}
    try:
        there = _log_ratios(cost_model_of(profile, plan, mix=normalise_mix(profile, shares)), plan, b, keys)
    except SpecdecError:
        return {k: 0.0 for k in keys}
    return {k: float(prior[k].mean() - there[k].mean()) for k in keys}


def _refined(
    plan: Plan,
    profile: Profile,
    cost: CostModel,
    wanted: dict[Key, str],
    finished: dict[Key, optuna.trial.FrozenTrial],
    summary: dict[str, Any],
) -> Plan:
    """The plan with each measured bucket's fastest contender (module docstring, "result"): by the geometric mean of its
    groups' tokens/s over the model's D's on the same prompts (the groups both decoded, the model's D pruned or not);
    D does not rise with batch."""
    buckets: list[dict] = []
    pruned, ceiling = 0, max(k[1] for k in wanted)  # the first bucket may take any contender, one past the plan's too
    batches = {k[0] for k in wanted}
    for b in plan.buckets:
        keys = [k for k in wanted if k[0] == b.batch]
        if not keys:
            buckets.append(b.model_dump())
            ceiling = b.draft_len
            continue
        mine: Key = (b.batch, b.draft_len, "")
        reference = _rates(finished.get(mine))
        expected: dict[Hashable, Figure] = {}
        decoded = dict(finished[mine].user_attrs.get("domains") or {}) if reference else {}
        if reference:  # the model's D decoded: every other contender pairs with it group by group
            others = [k for k in keys if k != mine]
            prior = _log_ratios(cost, plan, b, others)
            shift = _to_plan_mix(profile, plan, b, others, prior, decoded)
            expected = expected_vs_model(
                prior,
                {k: [math.log(r / m) + shift[k] for r, m in zip(_rates(finished.get(k)), reference)] for k in others},
            ) | {mine: Figure(value=1.0, source="measured", low=1.0, high=1.0)}
        rows = [
            _contender(
                finished.get(k),
                k,
                wanted[k],
                cost.predict(b.batch, k[1], plan.mechanism, plan.quant).tokens_per_s.value,
                reference,
                expected.get(k),
            )
            for k in keys
        ]
        pruned += sum(c.outcome == "pruned" for c in rows)
        # D does not rise with batch: at most the D of the batch below, at least that of any larger bucket not measured
        floor = max((x.draft_len for x in plan.buckets if x.batch > b.batch and x.batch not in batches), default=0)
        allowed = [c for c in rows if c.outcome == "measured" and floor <= c.draft_len <= ceiling]
        score = (lambda c: c.expected_vs_model.value) if reference else (lambda c: c.measured_tokens_per_s.value)
        best = max(allowed, key=score) if allowed else None
        chosen = best.draft_len if best else min(max(b.draft_len, floor), ceiling)
        ceiling = chosen
        record = BucketRefinement(
            model_draft_len=b.draft_len,
            chosen_draft_len=chosen,
            chosen_engine=best.engine if best else None,
            decoded_mix={d: n / sum(decoded.values()) for d, n in decoded.items()} or None,
            contenders=rows,
        )
        if chosen == b.draft_len and record.chosen_engine is None:
            buckets.append(b.model_dump() | {"refinement": record.model_dump()})
            continue
        why = (
            {"text": _why(b.draft_len, best, rows), "guideline": "refined"}
            if best
            else {
                "text": f"no contender measured within D {floor}-{chosen}, the range that keeps D from rising with "
                f"batch after its neighbours' refinement: D={chosen}, the model's D={b.draft_len} brought into it",
                "guideline": "schedule",
            }
        )
        prediction = predicted_json(cost.predict(b.batch, chosen, plan.mechanism, plan.quant))
        if best is not None and best.expected_vs_model is not None:
            prediction |= fitted_prediction(b, best.expected_vs_model)
        buckets.append(
            b.model_dump()
            | {
                "draft_len": chosen,
                "predicted": prediction,
                "rationale": why,
                "flags": [],
                "refinement": record.model_dump(),
                **({"memory": bucket_memory(cost, plan.mechanism, plan.quant, b.batch, chosen)} if b.memory else {}),
            }
        )
    refinement = Refinement(**summary, trials=sum(1 for k in wanted if k in finished), pruned=pruned)
    fields = plan.model_dump() | {
        "buckets": buckets,
        "max_draft_len": max(b["draft_len"] for b in buckets),
        "refinement": refinement.model_dump(),
    }
    return priced(Plan.model_validate(fields), cost)


THROUGHPUT_FIGURES = ("tokens_per_s", "per_user_tokens_per_s", "speedup")


def fitted_prediction(model: Bucket, ratio: Figure) -> dict:
    """A refined bucket's throughput figures: the model's D's prediction times the chosen contender's expected ratio
    over it (`expected_vs_model`, the cost model's draws and the measured groups combined), source "fitted". At one
    batch plain decoding is the same for every D, so tokens/s, per-user tokens/s and speedup all scale by the ratio.
    The interval multiplies bound by bound (the prediction's where it has one, the ratio's): at least as wide as
    either, as the two are not independent (the ratio's prior is drawn from the same profile)."""
    out = {}
    for name in THROUGHPUT_FIGURES:
        f = getattr(model.predicted, name)
        value = f.value * ratio.value
        low = _or(f.low, f.value) * _or(ratio.low, ratio.value)
        high = _or(f.high, f.value) * _or(ratio.high, ratio.value)
        out[name] = {"value": value, "source": "fitted", "low": min(low, value), "high": max(high, value)}
    return out


def _or(bound: float | None, value: float) -> float:
    return value if bound is None else bound


def _interval(f: Figure, spec: str) -> str:
    return f"[{f.low:{spec}}–{f.high:{spec}}]" if f.low is not None and f.high is not None else "(one group)"


def _label(c: Contender) -> str:
    return "the plain engine" if c.engine == PLAIN else f"D={c.draft_len}"


def _why(model_draft_len: int, best: Contender, rows: list[Contender]) -> str:
    m, e = best.measured_tokens_per_s, best.expected_vs_model
    assert m is not None
    text = f"{LABEL}: {_label(best)} decoded {m.value:.1f} tok/s {_interval(m, '.1f')} over {best.groups} groups"
    if best.vs_model is not None and e is not None:
        text += (
            f", x{best.vs_model.value:.3f} {_interval(best.vs_model, '.3f')} the model's D={model_draft_len} on the "
            f"same prompts; expected x{e.value:.3f} {_interval(e, '.3f')} with the model's draws"
        )
    else:
        text += f"; the model's D={model_draft_len} was pruned"
    mine = next(c for c in rows if c.draft_len == model_draft_len and c.engine is None)
    text += f" (predicted {best.predicted_tokens_per_s:.1f} against {mine.predicted_tokens_per_s:.1f} tok/s)"
    if best.engine == PLAIN:
        text += (
            "; the bundle runs the plain engine where no bucket speculates, else a K = 0 band of the speculative engine"
        )
    return text


def refinement_lines(plan: Plan) -> list[str]:
    """What the refinement measured at each bucket and what the bucket took, one line each."""
    lines = []
    for b in plan.buckets:
        r = b.refinement
        if r is None:
            continue
        figures = ", ".join(
            _contender_text(c, r.model_draft_len) for c in sorted(r.contenders, key=lambda c: c.draft_len)
        )
        chosen = "the plain engine" if r.chosen_engine == PLAIN else f"D={r.chosen_draft_len}"
        verdict = (
            f"keeps D={r.model_draft_len}"
            if r.chosen_draft_len == r.model_draft_len and r.chosen_engine is None
            else f"takes {chosen} over the model's D={r.model_draft_len}"
        )
        lines.append(
            f"batch {b.batch} ({LABEL}: tok/s, over the model's D on the same prompts with its 95% interval, and "
            "expected with the model's draws): "
            f"{figures}; {verdict}"
        )
    return lines


def _contender_text(c: Contender, model_draft_len: int) -> str:
    """One contender's measured tokens/s and its paired ratio over the model's D (the figure it is judged by)."""
    m = c.measured_tokens_per_s
    if m is None:
        return f"{_label(c)} {c.outcome}"
    text = f"{_label(c)} {m.value:.1f}"
    if c.vs_model is not None and (c.draft_len != model_draft_len or c.engine is not None):
        text += f" x{c.vs_model.value:.3f} {_interval(c.vs_model, '.3f')}"
        if (e := c.expected_vs_model) is not None:
            text += f" expected x{e.value:.3f}"
    return text + (" (pruned)" if c.outcome == "pruned" else "")
