"""The measured refinement's groups in vLLM, for a profile measured there (pipeline/refine.py decides; this decodes).

A group starts a few engines and gives every running contender one bucket run in one of them. The contenders of each
bucket are dealt, in the group's shuffled order, to engines 1, 2, ...: engine j runs, at each bucket that has a j-th
contender, that contender's K, through vLLM's per-batch table (`num_speculative_tokens_per_batch_size`, the engine kind
the bundle serves a plan with; a K = 0 band is the bundle's "no speculation" inside a speculative engine). The plain
engine (no speculative config) runs every bucket whose contenders include it. So a group costs as many engine starts as
the busiest bucket has contenders, plus one, not one per contender; the engines run in a shuffled order, and the deal
changes every group, so the device's drift and an engine's draw of its between-engine spread fall on every contender
alike.

Each bucket runs at its concurrency B on the profiling split of the profile's calibration prompts, whole where enough
fit its context, else cut to it (pipeline/engine_check.decoded_prompts and run_buckets: `group_prompts` requests at
least, 48 tokens each, EOS ignored, a finished request replaced by the next), the pool turned by as many each group. A
contender's figure is its run's steady tokens/s as the cost model predicts it (engine_check.steady_figures:
1e3 · B · tokens per step / median step ms); vLLM must have run the K asked for, else the refinement stops.
"""

from __future__ import annotations

import collections
import random
import tempfile
from pathlib import Path
from typing import Any

from specdec_tune import SpecdecError
from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.exporters.schedule import to_vllm
from specdec_tune.pipeline.engine_check import decoded_prompts, run_buckets, steady_figures
from specdec_tune.profiles.models.views import write_cut_draft
from specdec_tune.profiles.schema import Profile
from specdec_tune.profiles.vllm_engine import VllmEngine
from specdec_tune.settings import RefineSettings
from specdec_tune.vllm_spelling import speculative_config

PLAIN = "plain"  # pipeline/refine.py's name for the engine without a speculative config


def cut_drafts(profile: Profile, mechanisms: set[str], folder: Path) -> dict[str, Path]:
    """The draft models cut from the target (each a folder of its own under `folder`), by mechanism."""
    return {
        d.name: write_cut_draft(
            profile.target["path"], int(d.model["layers"]), folder / d.name, profile.target["dtype"]
        )
        for d in profile.drafters
        if d.name in mechanisms and d.model and d.model.get("shares_target_weights")
    }


def engine_config(profile: Profile, mechanism: str, draft_len: int, drafts: dict[str, Path]) -> dict | None:
    """vLLM's speculative_config for one mechanism at K = `draft_len` (None: no speculation)."""
    if draft_len == 0:
        return None
    info = next(d for d in profile.drafters if d.name == mechanism)
    return speculative_config(
        mechanism,
        draft_len,
        info.options,
        model=str(drafts[mechanism]) if mechanism in drafts else info.options.get("model"),
    )


def table_config(
    profile: Profile, mechanism: str, ks: dict[int, int], drafts: dict[str, Path], always_table: bool = False
) -> dict:
    """One speculative engine running K = ks[B] at each batch B: the largest K (at least 1, as vLLM requires) with the
    per-batch table, or that K alone where every batch takes it (unless `always_table`)."""
    top = max(1, *ks.values())
    config = engine_config(profile, mechanism, top, drafts)
    assert config is not None
    if always_table or set(ks.values()) != {top}:
        config["num_speculative_tokens_per_batch_size"] = to_vllm(sorted(ks.items()))
    return config


def engine_s(profile: Profile, mechanism: str) -> tuple[float, float]:
    """What one engine of the refinement costs, (a speculative engine of `mechanism`, the plain engine), from the
    profile's engines of those units: their seconds (start-up, model load, timed steps) less the acceptance prompts
    they decoded (a refinement engine decodes none), over the engines started. A profile that recorded no seconds per
    unit prices both at its engine seconds over all the engines it started."""
    units = profile.engine.get("units", {})

    def per_engine(name: str) -> float | None:
        timed = [u for key, u in units.items() if key.split("/")[0] == name and u["ok"] and u.get("engine_s")]
        started = sum(len(u["init_s"]) for u in timed)
        return sum(u["engine_s"] - u["accept_s"] for u in timed) / started if started else None

    started = sum(len(u.get("init_s") or ()) for u in units.values())
    overall = profile.phase_s.get("engine units", 0.0) / max(1, started)
    return per_engine(mechanism) or overall, per_engine("none") or overall


def deal(order: list[Any]) -> list[dict[int, Any]]:
    """The contenders (each with `batch`) dealt to engines: engine j holds each batch's j-th contender in `order`."""
    engines: list[dict[int, Any]] = []
    seen: dict[int, int] = {}
    for r in order:
        j = seen.get(r.batch, 0)
        seen[r.batch] = j + 1
        if j == len(engines):
            engines.append({})
        engines[j][r.batch] = r
    return engines


class EngineGroups:
    """The refinement's groups in vLLM (module docstring). A context manager: the cut draft models live in a folder of
    its own until it closes."""

    plain_engine = True  # no speculation runs two ways: a K = 0 band of a speculative engine, and the plain engine
    warmup_s = 0.0  # every group starts its engines afresh: nothing is paid once for later groups

    @staticmethod
    def unavailable(profile: Profile) -> str | None:
        try:
            VllmEngine.locate()
        except SpecdecError as e:
            return e.message
        return None

    @staticmethod
    def group_cost_s(
        plan: Plan,
        profile: Profile,
        cost: object,
        s: RefineSettings,
        keys: list[tuple[int, int, str]],
        first: bool = False,
    ) -> float:
        """One group of `keys`: as many speculative engines as the busiest bucket has contenders, and the plain one
        where a key runs it, each priced by `engine_s` (its start included, so the `first` group costs no more)."""
        per_bucket = collections.Counter(B for B, _, engine in keys if not engine)
        speculative_s, plain_s = engine_s(profile, plan.mechanism)
        return max(per_bucket.values(), default=0) * speculative_s + any(engine for *_, engine in keys) * plain_s

    def __init__(self, plan: Plan, profile: Profile, s: RefineSettings, todo: list[tuple[int, int, str]]) -> None:
        self.plan, self.profile, self.rows = plan, profile, s.group_prompts
        self.engine = VllmEngine.locate()
        self.rng = random.Random(s.seed)
        spec = profile.workload.calibration
        needed = max(self.rows, *(k[0] for k in todo))
        prompts, _ = decoded_prompts(profile, plan.ctx, max(k[1] for k in todo), needed, "profile", spec)
        self.pool, self.domains = [ids for ids, _ in prompts], [domain for _, domain in prompts]
        if len(self.pool) < needed:
            raise SpecdecError(
                f"{len(self.pool)} prompts of the profiling split of {spec} reach the plan's context of {plan.ctx} "
                f"tokens, fewer than the {needed} a group decodes at once",
                "pass --no-refine",
            )
        self._tmp = tempfile.TemporaryDirectory(prefix="specdec-refine-")
        self.drafts = cut_drafts(profile, {plan.mechanism}, Path(self._tmp.name))

    def __enter__(self) -> EngineGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()

    def decoded_domains(self, group: int, batch: int) -> list[str]:
        """The domains of the prompts a bucket of `batch` decodes in `group`: the pool turned by the group, read as
        engine_check.run_buckets reads it."""
        turn = group * self.rows
        return [self.domains[(turn + i) % len(self.pool)] for i in range(batch * max(2, -(-self.rows // batch)))]

    def rates(self, group: int, order: list[Any]) -> list[float]:
        """Each contender's steady tokens/s in this group, in `order`'s order."""
        plain = [r for r in order if r.engine == PLAIN]
        engines: list[tuple[dict | None, dict[int, Any]]] = [
            (table_config(self.profile, self.plan.mechanism, {B: r.draft_len for B, r in e.items()}, self.drafts), e)
            for e in deal([r for r in order if r.engine != PLAIN])
        ]
        if plain:
            engines.append((None, {r.batch: r for r in plain}))
        self.rng.shuffle(engines)
        turn = (group * self.rows) % len(self.pool)
        pool = self.pool[turn:] + self.pool[:turn]
        largest = max(b.batch for b in self.plan.buckets)  # the bundle's max_num_seqs
        out: dict[int, float] = {}
        for config, held in engines:
            raw = run_buckets(self.engine, self.profile, sorted(held), pool, self.rows, largest, config=config)
            if not raw.get("ok"):
                raise SpecdecError(f"vLLM did not run a refinement engine: {raw.get('error')}", "pass --no-refine")
            by_name = {run.get("name"): run for run in raw["runs"]}
            for B, r in held.items():
                fig = steady_figures([by_name.get(f"bucket/{B}")], B)
                if "error" in fig:
                    raise SpecdecError(f"refinement at batch {B}: {fig['error']}", "pass --no-refine")
                if fig["draft_len_applied"] != r.draft_len:
                    raise SpecdecError(
                        f"vLLM ran K = {fig['draft_len_applied']} at batch {B} where the refinement asked for "
                        f"{r.draft_len}",
                        "pass --no-refine",
                    )
                out[id(r)] = fig["measured_tokens_per_s"]
        return [out[id(r)] for r in order]
