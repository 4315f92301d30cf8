"""`specdec-tune search`: choose one mechanism, its weight format and D per batch bucket from a profile.

The space: mechanism (one per deployment) x drafter weight format x D_b in 0..D_max for every batch
bucket b. The objective is the traffic-weighted mean predicted speedup over the buckets (cost_model),
subject to a per-user rate floor in every bucket. Engine constraints are part of the space:
  - TensorRT-LLM's `draft_len_schedule` value at the smallest key must equal `max_draft_len`, so D at
    the smallest bucket is the schedule's maximum (a sampled schedule is repaired to satisfy it);
  - vLLM's ranges start at batch 1 and each K is capped at `num_speculative_tokens` (the maximum):
    any schedule satisfies that once the smallest bucket is 1.
Optuna's TPE sampler searches the space (SQLite under the run's folder by default; any Optuna storage
URL lets several workers fill one study); its best schedule is then polished bucket by bucket with the
drafter and the schedule's maximum held. `exhaustive` finds the exact optimum by decomposition
(buckets are independent once mechanism, format and the schedule's maximum are fixed): it is how the
study is checked, and the plan records the gap.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from specdec_tune import SpecdecError, __version__
from specdec_tune.autotune.cost_model import CostModel, Prediction
from specdec_tune.profiles.records import sha256_json, write_json
from specdec_tune.profiles.schema import Profile

PLAN_SCHEMA_VERSION = 1
SLO_PENALTY = 10.0  # objective units lost per unit of relative per-user-rate shortfall


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    trials: int = 0  # 0 = 100 per batch bucket, at least 300
    seed: int = 0
    min_user_tokens_per_s: float = 0.0  # per-user rate floor in every bucket
    mechanisms: tuple[str, ...] = ()  # () = every profiled mechanism
    quant_formats: tuple[str, ...] = ("none",)
    storage: str | None = None  # Optuna storage URL; None = sqlite under out_dir
    study_name: str = ""  # "" = named after the profile and these settings
    out_dir: Path = Path("artifacts")
    device: str | None = None  # plan for this hardware-table device instead of the profiled one (times modeled)


@dataclasses.dataclass(frozen=True)
class Candidate:
    mechanism: str
    quant: str
    schedule: tuple[int, ...]  # D per batch bucket, in bucket order


class Space:
    """The feasible choices and the objective, over one cost model."""

    def __init__(self, cost: CostModel, settings: SearchSettings) -> None:
        self.cost, self.s = cost, settings
        self.buckets = list(cost.profile.workload.batch_buckets)
        known = cost.mechanisms
        for m in settings.mechanisms:
            if m not in known:
                raise SpecdecError(f"mechanism {m!r} is not in the profile", f"profiled: {', '.join(known)}; re-run profile with --drafter {m}")
        self.mechanisms = list(settings.mechanisms) or known
        self.pairs = [(m, q) for m in self.mechanisms for q in settings.quant_formats if q in cost.quants(m)]
        if not self.pairs:
            raise SpecdecError("no mechanism was profiled with the requested weight formats", "add --quant none or profile the formats")
        self._pred: dict[tuple[int, int, str, str], Prediction] = {}
        floor = settings.min_user_tokens_per_s
        for B in self.buckets:
            if floor and max(self.predict(B, D, m, q).per_user_tokens_per_s.value
                             for m, q in self.pairs for D in range(cost.max_draft_len + 1)) < floor:
                raise SpecdecError(f"no setting reaches {floor:g} tokens/s per user at batch {B}",
                                   "lower --min-user-tps or drop that batch bucket")

    def trials(self) -> int:
        return self.s.trials or max(300, 100 * len(self.buckets))

    def size(self) -> int:
        return len(self.pairs) * (self.cost.max_draft_len + 1) ** (len(self.buckets) - 1)  # D at the smallest bucket is fixed by the rest

    def predict(self, B: int, D: int, m: str, q: str) -> Prediction:
        key = (B, D, m, q)
        if key not in self._pred:
            self._pred[key] = self.cost.predict(B, D, m, q)
        return self._pred[key]

    def bucket_score(self, B: int, D: int, m: str, q: str) -> float:
        p = self.predict(B, D, m, q)
        floor = self.s.min_user_tokens_per_s
        shortfall = max(0.0, floor - p.per_user_tokens_per_s.value) / floor if floor else 0.0
        return p.speedup.value - SLO_PENALTY * shortfall

    def score(self, c: Candidate) -> float:
        return sum(self.bucket_score(B, D, c.mechanism, c.quant) for B, D in zip(self.buckets, c.schedule)) / len(self.buckets)

    @staticmethod
    def repair(schedule: list[int]) -> tuple[int, ...]:
        """TensorRT-LLM: the smallest bucket carries the schedule's maximum."""
        return (max(schedule), *schedule[1:])

    def exhaustive(self) -> tuple[Candidate, float]:
        best: tuple[float, Candidate] | None = None
        for m, q in self.pairs:
            for top in range(self.cost.max_draft_len + 1):  # the schedule's maximum, held by the smallest bucket
                rest = [max(range(top + 1), key=lambda D, B=B: (self.bucket_score(B, D, m, q), -D)) for B in self.buckets[1:]]
                cand = Candidate(m, q, (top, *rest))
                value = self.score(cand)
                if best is None or value > best[0] + 1e-12:
                    best = (value, cand)
        assert best is not None
        return best[1], best[0]


def open_storage(url: str):
    """An Optuna storage: `journal:PATH` is a JournalStorage file (many processes, no server); anything else an RDB URL."""
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    return url


def run_study(space: Space, storage: str, settings: SearchSettings, n_trials: int | None = None):
    """Fill (or continue) the Optuna study; several processes may call this on one storage."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=settings.seed, multivariate=True, n_startup_trials=20)
    study = optuna.create_study(study_name=settings.study_name, storage=open_storage(storage), direction="maximize",
                                sampler=sampler, load_if_exists=True)
    done = sum(1 for t in study.trials if t.state.is_finished())
    labels = [f"{m}/{q}" for m, q in space.pairs]
    if done == 0:  # start from "no speculation" for every drafter: the plan never loses to plain decoding
        for label in labels:
            study.enqueue_trial({"drafter": label, **{f"D_at_batch_{B}": 0 for B in space.buckets}})
    if n_trials is None:  # fill the study up to its trial count: a rerun or a resumed run adds only what is missing
        n_trials = max(0, space.trials() - done)
    D_max = space.cost.max_draft_len

    def objective(trial) -> float:
        m, q = space.pairs[labels.index(trial.suggest_categorical("drafter", labels))]
        schedule = space.repair([trial.suggest_int(f"D_at_batch_{B}", 0, D_max) for B in space.buckets])
        trial.set_user_attr("schedule", list(schedule))
        return space.score(Candidate(m, q, schedule))

    if n_trials:
        study.optimize(objective, n_trials=n_trials)
    return study


def best_of(study, space: Space) -> Candidate:
    t = study.best_trial
    m, q = t.params["drafter"].split("/")
    return Candidate(m, q, tuple(t.user_attrs["schedule"]))


def polish(space: Space, c: Candidate) -> Candidate:
    """Best D per bucket with the drafter and the schedule's maximum held: no bucket alone can do better."""
    top = c.schedule[0]
    rest = [max(range(top + 1), key=lambda D, B=B: (space.bucket_score(B, D, c.mechanism, c.quant), -D)) for B in space.buckets[1:]]
    return Candidate(c.mechanism, c.quant, (top, *rest))


def _rationale(space: Space, c: Candidate, B: int, D: int) -> dict:
    """Why this D at this batch: the figures behind it and the next-best alternative's loss."""
    cost = space.cost
    chosen = space.predict(B, D, c.mechanism, c.quant)
    ratio = cost.verify_ms(B, 1 + max(D, 1)).value / cost.verify_ms(B, 1).value
    alternatives = sorted(((space.bucket_score(B, d, c.mechanism, c.quant), d) for d in range(cost.max_draft_len + 1) if d != D), reverse=True)
    alt_score, alt_D = alternatives[0]
    own = space.bucket_score(B, D, c.mechanism, c.quant)
    if D == 0:
        why = (f"speculation off: verifying 2 tokens costs {ratio:.2f}x one token at batch {B} (the target's GEMMs are compute-bound "
               f"here, guideline 1) and no D pays back its draft and verify cost")
    else:
        draft_share = chosen.draft_ms.value / (chosen.verify_ms.value + chosen.draft_ms.value + chosen.host_ms.value)
        why = (f"D={D}: {chosen.tokens_per_forward.value:.3f} tokens per target forward; verifying {1 + D} tokens costs "
               f"{chosen.verify_ms.value / cost.verify_ms(B, 1).value:.2f}x one token (guideline 1: memory-bound below the knee)")
        if draft_share > 0.2:
            why += f"; drafting is {draft_share:.0%} of the round, which caps D (guideline 4)"
    return {"text": why, "next_best": {"draft_len": alt_D, "loss_pct": 100 * (own - alt_score) / own if own else 0.0}}


def build_plan(profile: Profile, profile_hash: str, space: Space, c: Candidate, *, study, exhaustive_value: float, storage: str,
               settings: SearchSettings, sampled_value: float) -> dict:
    value = space.score(c)
    buckets = []
    for B, D in zip(space.buckets, c.schedule):
        p = space.predict(B, D, c.mechanism, c.quant)
        fig = lambda f: {"value": f.value, "source": f.source}  # noqa: E731
        buckets.append({
            "batch": B, "draft_len": D,
            "predicted": {"tokens_per_s": fig(p.tokens_per_s), "per_user_tokens_per_s": fig(p.per_user_tokens_per_s),
                          "speedup": fig(p.speedup), "tokens_per_forward": fig(p.tokens_per_forward),
                          "verify_ms": fig(p.verify_ms), "draft_ms": fig(p.draft_ms), "host_ms": fig(p.host_ms)},
            "rationale": _rationale(space, c, B, D),
        })
    return {
        "schema_version": PLAN_SCHEMA_VERSION, "tool_version": __version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile": {"fingerprint": profile.fingerprint, "sha256": profile_hash, "device": profile.device.get("name"),
                    "target": profile.target},
        "device": {"name": profile.device.get("name"), "projected_from": profile.device.get("projected_from"),
                   "times": "modeled (hardware table)" if profile.device.get("projected_from") else "measured"},
        "notes": list(profile.notes),
        "objective": {"kind": "mean speedup over buckets", "min_user_tokens_per_s": settings.min_user_tokens_per_s},
        "mechanism": c.mechanism, "quant": c.quant, "max_draft_len": max(c.schedule),
        "buckets": buckets,
        "study": {"storage": storage, "name": settings.study_name, "trials": len(study.trials), "space_size": space.size(),
                  "best_sampled_value": sampled_value, "best_value": value, "exhaustive_value": exhaustive_value,
                  "gap_pct": 100 * (exhaustive_value - value) / exhaustive_value if exhaustive_value else 0.0, "seed": settings.seed},
        "settings_hash": sha256_json(dataclasses.asdict(settings) | {"out_dir": None, "storage": None}),
    }


def search(profile: Profile, profile_hash: str, settings: SearchSettings) -> dict:
    if not settings.study_name:
        key = sha256_json([profile.fingerprint, dataclasses.asdict(settings) | {"out_dir": None, "storage": None, "trials": None}])
        settings = dataclasses.replace(settings, study_name=f"specdec-tune-{key[:12]}")
    if settings.device:
        from specdec_tune.autotune.hardware import get_device_spec
        from specdec_tune.autotune.projection import project

        spec = get_device_spec(settings.device)
        profile = project(profile, spec)
        settings = dataclasses.replace(settings, quant_formats=tuple(f for f in ("none", "fp8", "nvfp4") if f in spec.formats))
    space = Space(CostModel(profile), settings)
    storage = settings.storage or f"sqlite:///{(settings.out_dir / 'study.db').resolve()}"
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    study = run_study(space, storage, settings)
    exact, exact_value = space.exhaustive()
    sampled = best_of(study, space)
    chosen = polish(space, sampled)
    plan = build_plan(profile, profile_hash, space, chosen, study=study, exhaustive_value=exact_value, storage=storage, settings=settings,
                      sampled_value=space.score(sampled))
    write_json(settings.out_dir / "plan.json", plan)
    return plan
