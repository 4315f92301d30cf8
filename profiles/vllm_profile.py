"""`specdec-tune profile --engine vllm`: the profile measured inside vLLM, the engine the bundle is for.

Units, each measured by engines started fresh in a process of their own, each engine logged when it finishes (a killed
profile resumes without repeating them): the plain unit by PLAIN_ENGINES (2), a speculative unit by UNIT_ENGINES (1):
  plain     vLLM without speculation: T_round(B, 0) at every batch and context bucket
  (m, D)    mechanism m at draft length D: T_round(B, D) at every batch and context bucket, and greedy acceptance at D
            from vLLM's own counters (per request and verify step: drafted and accepted)
  D_max     the unit at each mechanism's longest draft also measures acceptance: in its engine on up to 7 profiling
            prompts per domain (every MT-Bench category's), and at every temperature > 0 on the first
            `sampled_prompts_per_domain` of each; then, while the budget lasts, in an engine that only decodes, on
            every other profiling prompt of each domain whose tokens per forward at D_max is still wider than
            ±`acceptance_half_width` (95%), as far as the time allows. Its counters are the profile's acceptance
            records; the other units' are the checks of the derived figures (derived vs direct, as the torch backend's
            loop records them)
Order: plain; each mechanism at D_max; each at D = 1 (these run whatever the budget: without both ends of every curve
there is no plan); then, while the budget lasts, the midpoint of each gap in D whose ends differ by more than the
tolerance and the noise at some (B, ctx), as the torch backend bisects its verify curve.

Engines per unit: on a 2-core CPU an engine costs about 10 s before its first timed step (starting it, the speed
probe's first samples, a warm-up; importing vLLM, another 10 s, is paid once, as the engines are forked from one process
that imported it: profiles/vllm_engine.py), about as much as its timing runs, and the draft model's D_max unit decodes
for minutes more to measure acceptance. Timing every unit in three engines cost the demo pair's profile about 750 s,
half of what a sweep of every D in engines of its own costs (about 1,540 s), where the tuning as a whole (profile,
search, measured refinement) is to cost at most a third of it. So the speculative units are timed in one engine each,
and the plain unit, the one every speedup is relative to and the cheapest, in two (three made the demo pair's profile
0.24 of that sweep on its own): its engines give the between-engine term and the speed's elasticity (below) that every
unit's rounds are corrected and widened by, the elasticity fitted on their steps and the probe samples between them,
the term pooled over every cell they timed. Where the model then cannot separate two draft lengths, the search's
measured refinement decodes them (pipeline/refine.py).

Interleaving: a shared machine's speed drifts by 20% within minutes. The plain unit's engines are spread among the
others (`schedule`), so that they sample the spells the speculative units ran in; each speculative unit's spell is
corrected by its own speed probe (below).

A timed round is one LLMEngine.step() with B requests decoding, none prefilling and none finished: a timing run starts
B real calibration texts laid end to end and cut to the context bucket, and decodes 32 tokens each per engine with EOS
ignored, so the batch stays full. (Not fewer: a lookup drafter that accepts well spends 16 tokens in 6 full rounds, all
of them the heavy drafting right after the prefill; at B = 8 on a 2-core CPU, 16 tokens read an n-gram round at D = 7
7-15% above plain where 64 read it 3% above.) (A lookup drafter's round costs what its rows propose: on long
concatenated texts that can be more than on the acceptance prompts; each cell records the tokens its rows emitted per
round.) A cell's figure is the median of its steady steps with the median's 95% interval; each mechanism's cells are
then fitted non-decreasing in D, batch and context (weighted isotonic regression, as the verify curve: a longer draft,
more requests or a longer context never make a round cheaper), a cell moved beyond its interval becoming `fitted`.

Speed: every engine times a fixed piece of work of the target's shape around and within each run (vllm_runner.Probe).
A unit timed in one engine lands in whatever spell that engine met (on this 2-core machine the probe moved 25% within
one profile). So each engine's steps are brought to the profile's reference speed before they are pooled:

    step at reference = step · (probe_ref / probe_pass)^e

probe_pass is the median of the engine's probe samples, probe_ref the median of every sample of the profile, and e the
elasticity of a step's time in the probe's: the least-squares slope of log step ms on log probe ms over every cell
timed by several engines (the plain unit's), each cell about its own means (its engines ran in different spells),
clamped to [0, 1] (a step is partly host work that the probe's spell moves less). A round point keeps the steps' raw
median beside (`raw_median_ms`); `engine.speed_probe` keeps probe_ref and e, and a later run's probe against them says
how much slower or faster the machine runs than the profile's reference (the engine benches and the export's engine
check give their errors at reference speed beside the raw ones).

Engines: two engines of one configuration, started one after the other, differ by more than their steps' noise (a
process's own luck: where its memory and threads land; on this 2-core CPU 2-6% sd at reference speed, while the
median of one engine's 30 steps holds about ±2%). Steps of one engine are not independent of each other, so the
median's interval over the pooled steps would claim a precision that a new set of engines does not reproduce. The
profile estimates that term from the plain unit's engines (`between_engines_sd`: over every cell timed by several
engines, the variance of the engines' log medians less their own squared standard errors) and adds 1.96·sd/√(engines)
to each cell's interval, on the log scale, as an independent error (`engine.between_engines`): about ±2.8% for the plain
unit's two engines at 2% sd, ±4% for a speculative unit's one.

A mechanism the engine will not start is recorded in `engine.mechanisms` with vLLM's reason, a unit that crashes or runs
out of memory part-way records its remaining cells infeasible with the engine's message; the profile goes on with the
rest."""

from __future__ import annotations

import collections
import dataclasses
import random
import time
from pathlib import Path

from specdec_tune import SpecdecError, __version__
from specdec_tune.profiles import intervals, replay
from specdec_tune.profiles.acceptance_records import acceptance_records
from specdec_tune.profiles.drafters.base import describe_spec
from specdec_tune.profiles.fingerprint import device_factors, device_fingerprint
from specdec_tune.profiles.memory import memory_record
from specdec_tune.profiles.models.folders import model_folder, weights_hash
from specdec_tune.profiles.models.loading import describe_model
from specdec_tune.profiles.models.views import engine_model_view, write_cut_draft
from specdec_tune.profiles.profile_run import Budget, ProfileRun, drafter_specs, workload_record
from specdec_tune.profiles.prompts import encode_fitting
from specdec_tune.profiles.schema import SCHEMA_VERSION
from specdec_tune.profiles.specdec import SpecCounters
from specdec_tune.profiles.store import MeasurementLog
from specdec_tune.profiles.timing import Timing
from specdec_tune.profiles.vllm_engine import CPU_KV_CACHE_BYTES, speed_probe_spec
from specdec_tune.profiles.vllm_records import (
    at_reference,
    between_engines_sd,
    counters_of,
    half_widths,
    merged,
    round_points,
    speed_probe_record,
    summarise,
)
from specdec_tune.progress import Progress
from specdec_tune.records import sha256_json
from specdec_tune.settings import ProfileSettings
from specdec_tune.vllm_spelling import VLLM, speculative_config

UNIT_TIMEOUT_S = 1800.0  # one engine: start-up, every timing run and the acceptance runs
PLAIN_ENGINES = 2  # engines of the plain unit, spread among the others': the between-engine term and the speed's fit
UNIT_ENGINES = 1  # engines of a speculative unit: its rounds' intervals hold the between-engine term for one
TIMING_TOKENS = 32  # per request of a timing run, per engine: the batch stays full for tens of rounds
EXTRA_ACCEPTANCE_S = 120.0  # engine seconds the acceptance engine may spend on more prompts past the budget
ACCEPTANCE_PROMPTS_PER_DOMAIN = 7  # at D_max: every MT-Bench category's profiling prompts, as many of the others
WARMUP_TOKENS = 4  # a short run before the timed ones: the engine's first steps allocate and build


def engines_of(key: tuple[str, int]) -> int:
    """How many timed engines measure a unit (module docstring, "Engines per unit")."""
    return PLAIN_ENGINES if key[1] == 0 else UNIT_ENGINES


def first_per_domain(prompts: list, k: int) -> list:
    """The first `k` prompts of each domain, in their order."""
    taken: collections.Counter = collections.Counter()
    out = []
    for p in prompts:
        if taken[p.domain] < k:
            taken[p.domain] += 1
            out.append(p)
    return out


def schedule(keys: list[tuple[str, int]]) -> list[tuple[tuple[str, int], int]]:
    """Every timed engine of the units `keys`, (unit, its engine's index), in the order they run: the units' first
    engines in the order of `keys` (a refusal is known before its mechanism's other units start), a unit's further
    engines spread evenly among them (engine p of a unit of n at (p + the unit's place / len(keys)) / n of the way, a
    first engine before a later one at the same place)."""
    jobs = [(key, p) for key in keys for p in range(engines_of(key))]
    return sorted(jobs, key=lambda job: ((job[1] + keys.index(job[0]) / len(keys)) / engines_of(job[0]), job[1]))


@dataclasses.dataclass(frozen=True)
class Mechanism:
    name: str
    kind: str
    options: dict
    max_draft_len: int
    model: dict | None  # a draft model's reference: layers cut from the target, or its own checkpoint's hash


class VllmProfiler(ProfileRun):
    """The units of the module docstring, each in engines of their own."""

    backend = "vllm"

    def __init__(
        self, settings: ProfileSettings, progress: Progress | None = None, started: float | None = None, engine=None
    ) -> None:
        from specdec_tune.profiles.vllm_engine import VllmEngine

        super().__init__(settings, progress, started)
        settings = self.s
        assert settings.max_draft_len is not None  # for_device filled it in
        self.engine = engine or VllmEngine.locate()
        self.target_ref, tokenizer, self.hf_config = describe_model(
            settings.target, settings.dtype, self.device, settings.trust_remote_code
        )
        if tokenizer is None:
            raise SpecdecError(f"{settings.target} has no tokenizer files", "give a model folder with its tokenizer")
        self.mechanisms: dict[str, Mechanism] = {}
        for name, options in drafter_specs(settings.drafters):
            if name not in VLLM:
                raise SpecdecError(
                    f"vLLM has no method for drafter {name!r}", f"profile one of {', '.join(VLLM)} with --engine vllm"
                )
            described = describe_spec(name, options)
            limit = described["max_draft_len"]
            own, model = described["options"].get("model"), None
            # its own checkpoint (a draft model's, or a trained head's): its hash makes a bundle stale when it changes
            if own:
                model = {"weights_hash": weights_hash(model_folder(own)[3]), "shares_target_weights": False}
            elif described["kind"] != "model_free" and not VLLM[name].needs_head:  # a draft model cut from the target
                model = {
                    "layers": described["options"].get("layers") or max(1, self.target_ref.num_layers // 3),
                    "shares_target_weights": True,
                }
            self.mechanisms[name] = Mechanism(
                name,
                described["kind"],
                described["options"],
                settings.max_draft_len if limit is None else min(settings.max_draft_len, limit),
                model,
            )
        context = int(self.hf_config.get("max_position_embeddings") or 2048)
        self.encoded = encode_fitting(
            tokenizer,
            self.pool,
            context_tokens=context,
            max_new_tokens=settings.new_tokens,
            max_draft_tokens=settings.max_draft_len,
        )
        self.fitting = fitting = [p for p in self.pool if p.id in self.encoded]
        self.prompt_domain = {p.id: p.domain for p in fitting}
        self.acceptance_prompts = first_per_domain(fitting, ACCEPTANCE_PROMPTS_PER_DOMAIN)
        self.check_prompts = first_per_domain(self.acceptance_prompts, settings.prompts_per_domain)
        self.sampled_prompts = first_per_domain(self.check_prompts, settings.sampled_prompts_per_domain)
        self.timing_rows = {ctx: self._timing_rows(ctx) for ctx in settings.ctx_buckets}
        longest = max(
            [len(self.encoded[p.id]) + settings.new_tokens for p in fitting]
            + [c + TIMING_TOKENS for c in settings.ctx_buckets]
        )
        self.max_model_len = min(context, longest + settings.max_draft_len + 8)
        self.max_num_seqs = max(max(settings.batch_buckets), settings.acceptance_batch)
        self.engine_options = dict(settings.engine_options)
        self.dtype = self.target_ref.dtype
        self.probe = speed_probe_spec(self.hf_config, self.dtype)
        self.device_fp = device_fingerprint(self.device, _torch_dtype(self.dtype)) | {
            "engine": f"vllm {self.engine.version}"
        }
        self.fingerprint = sha256_json(
            {
                "schema": SCHEMA_VERSION,
                "tool": __version__,
                "device": device_factors(self.device_fp),
                "target": dataclasses.asdict(self.target_ref),
                "drafters": [dataclasses.asdict(m) for m in self.mechanisms.values()],
                "workload": self._workload(),
                "engine": {"name": "vllm", "version": self.engine.version, "options": self.engine_options},
            }
        )
        self.supported: dict[str, dict] = {
            m.name: {
                "runs": False,
                "reason": f"vLLM runs {m.name} from a trained head's checkpoint: pass "
                f"--drafter {m.name}:model=FOLDER (a speculators-format head)",
            }
            for m in self.mechanisms.values()
            if VLLM[m.name].needs_head and not m.options.get("model")
        }

    # ------------------------------------------------------------------ inputs

    def _timing_rows(self, ctx: int) -> list[list[int]]:
        """One prompt of exactly `ctx` tokens per request of the largest batch: calibration texts laid end to end
        (each row starting at another prompt), cut to the context."""
        texts = [self.encoded[p.id] for p in self.acceptance_prompts]
        rows = []
        for r in range(max(self.s.batch_buckets)):
            row: list[int] = []
            i = r
            while len(row) < ctx:
                row += texts[i % len(texts)]
                i += max(self.s.batch_buckets)
            rows.append(row[:ctx])
        return rows

    def _workload(self) -> dict:
        return workload_record(self.s, self.calibration, self.pool, self.pool.domains(), self.max_num_seqs)

    def _model_dir(self, work: Path) -> tuple[Path, dict[str, Path]]:
        """The target as vLLM loads it, and each draft model cut from it, in the dtype the engine runs."""
        _, folder, _, _ = model_folder(self.s.target, self.s.trust_remote_code)
        target = engine_model_view(folder, work / "target")
        drafts = {
            m.name: write_cut_draft(self.s.target, int(m.model["layers"]), work / f"draft-{m.name}", self.dtype)
            for m in self.mechanisms.values()
            if m.model and m.model.get("shares_target_weights")
        }
        return target, drafts

    def _job(
        self,
        mechanism: str,
        draft_len: int,
        pass_index: int,
        accept: dict[str, tuple[float, list]],
        target: Path,
        drafts: dict[str, Path],
        timed: bool = True,
    ) -> dict:
        """One engine of a unit: every (B, ctx) cell timed once, in an order shuffled per engine (where `timed`), then
        the acceptance runs `accept` (run name: temperature and prompts)."""
        m = self.mechanisms.get(mechanism)
        config = None
        if draft_len:
            assert m is not None  # a unit that drafts runs one of this profile's mechanisms
            own = m.options.get("model")
            config = speculative_config(
                mechanism,
                draft_len,
                m.options,
                model=str(drafts[mechanism]) if mechanism in drafts else str(Path(own).resolve()) if own else None,
            )
        cells = [(B, ctx) for ctx in self.s.ctx_buckets for B in self.s.batch_buckets]
        random.Random(f"{self.s.seed}/{mechanism}/{draft_len}/{pass_index}").shuffle(cells)
        timing = [
            {
                "name": "warmup",
                "prompts": self.timing_rows[self.s.ctx_buckets[0]][:1],
                "concurrency": 1,
                "max_tokens": WARMUP_TOKENS,
                "ignore_eos": True,
            }
        ]
        timing += [
            {
                "name": f"time/{B}/{ctx}",
                "prompts": self.timing_rows[ctx][:B],
                "concurrency": B,
                "max_tokens": TIMING_TOKENS,
                "ignore_eos": True,
            }
            for B, ctx in cells
        ]
        runs = timing if timed else []
        runs += [
            {
                "name": name,
                "prompts": [self.encoded[q.id] for q in prompts],
                "concurrency": self.max_num_seqs,
                "max_tokens": self.s.new_tokens,
                "temperature": t,
            }
            | ({"seed": self.s.seed} if t > 0 else {})
            for name, (t, prompts) in accept.items()
        ]
        engine = {"dtype": self.dtype, "max_model_len": self.max_model_len, **self.engine_options}
        return {
            "model_dir": str(target),
            "max_num_seqs": self.max_num_seqs,
            "speculative_config": config,
            "engine": engine,
            "runs": runs,
            "trust_remote_code": self.s.trust_remote_code,
            "probe": self.probe,
        }

    def _accept_runs(
        self, mechanism: str, draft_len: int, first: dict | None, budget: Budget
    ) -> dict[str, tuple[float, list]]:
        """What a unit's engine measures of acceptance (module docstring): its first engine's runs where `first` is
        None; else, given that engine's summary, the D_max unit's runs on more prompts."""
        if not draft_len:
            return {}
        at_max = draft_len == self.mechanisms[mechanism].max_draft_len
        if first is None:
            runs = {"accept/0.0": (0.0, self.acceptance_prompts if at_max else self.check_prompts)}
            return runs | (
                {f"accept/{t}": (t, self.sampled_prompts) for t in self.s.temperatures if t > 0} if at_max else {}
            )
        if not at_max or not first["ok"] or self.s.acceptance_half_width <= 0:
            return {}
        counters = [counters_of(r, draft_len) for r in first["accept"].get("0.0", [])]
        domains = [self.prompt_domain[i] for i in first["accept_ids"].get("0.0", [])]
        if not counters:
            return {}
        wide = [
            d
            for d, w in half_widths(counters, domains, draft_len, self.s.seed).items()
            if w > self.s.acceptance_half_width
        ]
        ran = set(first["accept_ids"]["0.0"])
        unused = {d: [q for q in self.fitting if q.domain == d and q.id not in ran] for d in wide}
        dealt = [
            unused[d][k] for k in range(max(map(len, unused.values()), default=0)) for d in wide if k < len(unused[d])
        ]
        s_per_prompt = first["accept_s"].get("0.0", 0.0) / len(counters)
        left_s = max(budget.deadline - time.monotonic(), EXTRA_ACCEPTANCE_S)
        if s_per_prompt > 0:
            dealt = dealt[: int(left_s / s_per_prompt)]
        return {"accept/0.0/more": (0.0, dealt)} if dealt else {}

    # ------------------------------------------------------------------ one unit

    def _units(
        self, log: MeasurementLog, keys: list[tuple[str, int]], budget: Budget, work: list, required: bool
    ) -> dict[tuple[str, int], dict]:
        """Each unit of `keys` measured by its engines (`engines_of`), in `schedule`'s order, each engine's summary
        logged; a unit the engine refused in its first engine is not started again, nor its mechanism at another D.
        Then, where the budget allows, each mechanism's D_max unit decodes more acceptance prompts in an engine of its
        own (`_accept_runs`). `required`: whatever the budget (what that will cost is said once the first engine has
        run, where it is more than the budget has left)."""
        engines: dict[tuple[str, int], list[dict]] = {k: [] for k in keys}
        order = schedule(keys)
        for key, p in order:
            done, top = engines[key], engines.get((key[0], self.mechanisms[key[0]].max_draft_len) if key[1] else key)
            if len(done) < p or (top and not top[0]["ok"]):  # a refused mechanism is not started again
                continue
            if not (required or budget.allows(f"engine unit {key[0]} D={key[1]} engine {p + 1}")):
                continue
            done.append(self._unit(log, *key, p, budget, work))
            finished = sum(map(len, engines.values()))
            self._tick(
                "engine units",
                finished,
                len(order),
                f"{key[0]} D={key[1]} engine {p + 1}: {done[-1]['engine_s'] or 0:.0f} s",
            )
            if required and finished == 1:
                self._say_required_cost(done[-1]["engine_s"], len(order) - 1, budget)
        for (name, D), done in engines.items():
            if not D or D != self.mechanisms[name].max_draft_len or not done or not done[0]["ok"]:
                continue
            logged = f"vllm/{name}/{D}/{len(done)}" in log  # its prompts were chosen by the run that measured it
            more = {} if logged else self._accept_runs(name, D, done[0], budget)
            if (logged or more) and budget.allows(f"more acceptance prompts for {name} at D={D}"):
                done.append(self._unit(log, name, D, len(done), budget, work, more_prompts=more))
        return {k: merged(v) for k, v in engines.items() if v}

    def _say_required_cost(self, engine_s: float | None, engines_left: int, budget: Budget) -> None:
        """The required units run whatever the budget: where they will run past it, say so before they do."""
        if not engine_s:
            return
        needed_s = engine_s * engines_left
        if needed_s > budget.left_s():
            self.progress.note(
                "the required engine units (plain decoding and every mechanism at D = 1 and its longest draft) "
                f"need {engines_left} more engines, about {needed_s / 60:.1f} min at "
                f"{engine_s:.0f} s an engine: past the {self.s.budget_minutes:g}-minute budget "
                f"({budget.left_s() / 60:.1f} min left); they run to the end, the optional units are skipped"
            )

    def _unit(
        self,
        log: MeasurementLog,
        mechanism: str,
        draft_len: int,
        pass_index: int,
        budget: Budget,
        work: list,
        more_prompts: dict[str, tuple[float, list]] | None = None,
    ) -> dict:
        """One engine run, summarised and logged (what the profile needs of it, not the raw steps): a timed engine, the
        unit's first also measuring acceptance; or, given `more_prompts` (`_accept_runs` after the unit's first
        engine), an engine that only decodes those acceptance prompts."""

        def measure():
            if not work:
                work.append(
                    self._model_dir((self.s.out_dir / "engine-models").resolve())
                )  # each engine runs in a folder of its own
            t0 = time.monotonic()
            if more_prompts is not None:
                accept = more_prompts
            else:
                accept = self._accept_runs(mechanism, draft_len, None, budget) if not pass_index else {}
            job = self._job(mechanism, draft_len, pass_index, accept, *work[0], timed=more_prompts is None)
            raw = self.engine.run(job, UNIT_TIMEOUT_S)
            return summarise(
                raw, {name.split("/")[1]: [q.id for q in prompts] for name, (_, prompts) in accept.items()}
            ) | {"engine_s": time.monotonic() - t0}

        return log.measure(f"vllm/{mechanism}/{draft_len}/{pass_index}", measure)

    # ------------------------------------------------------------------ the run

    def _measure_units(self, log: MeasurementLog, budget: Budget) -> tuple[dict[tuple[str, int], dict], float]:
        """Every unit: the required ones, then the bisection's while the budget lasts (module docstring). Returns the
        units and their engine seconds (a resumed profile's too, whichever run measured them)."""
        work: list = []
        t0 = time.monotonic()
        runnable = [m for m in self.mechanisms.values() if m.name not in self.supported]
        first = (
            [("none", 0)]
            + [(m.name, m.max_draft_len) for m in runnable]
            + [(m.name, 1) for m in runnable if m.max_draft_len > 1]
        )
        self.progress.note(
            f"engine units: {len(first)} required (plain, and each mechanism at its longest draft and at D = 1), "
            f"the plain one in {PLAIN_ENGINES} engines, the others in {UNIT_ENGINES}; more where the curve in D bends, "
            "while the budget lasts"
        )
        units = self._units(
            log, first, budget, work, required=True
        )  # what a plan cannot do without: both ends of every curve
        if not units[("none", 0)]["ok"]:
            raise SpecdecError(
                f"vLLM {self.engine.version} did not run the target: {units[('none', 0)]['error']}",
                "check the target loads in vLLM (`vllm serve` it once), or profile with --engine torch",
            )
        running = [m for m in runnable if units[(m.name, m.max_draft_len)]["ok"]]
        for m in runnable:
            u = units[(m.name, m.max_draft_len)]
            self.supported[m.name] = {"runs": u["ok"], "reason": None if u["ok"] else u["error"]}
        todo = [(m.name, mid) for m in running for mid in _bisect(units, m.name, self.s.interp_tolerance)]
        while todo and budget.allows(", ".join(f"engine unit {name} D={D}" for name, D in todo)):
            units |= self._units(log, todo, budget, work, required=False)
            todo = [(m.name, mid) for m in running for mid in _bisect(units, m.name, self.s.interp_tolerance)]
        self._tick("engine units", len(units), len(units))
        logged_s = [u["engine_s"] for u in units.values()]
        return units, (sum(logged_s) if None not in logged_s else time.monotonic() - t0)

    def measure(self, log: MeasurementLog, budget: Budget) -> dict:
        load_s = time.monotonic() - self.started
        units, engine_s = self._measure_units(log, budget)
        speed = speed_probe_record(units, self.probe)
        between = between_engines_sd(
            [(at_reference(c, speed), c["step_pass"]) for u in units.values() if u["ok"] for c in u["cells"].values()]
        )
        rounds, moved = round_points(units, list(self.s.batch_buckets), list(self.s.ctx_buckets), speed, between)
        greedy_ids = {i for u in units.values() for i in u["accept_ids"].get("0.0", [])}
        d_max = self.s.max_draft_len
        assert d_max is not None  # for_device filled it in
        drafters = [
            {
                "name": m.name,
                "kind": m.kind,
                "options": m.options,
                "model": m.model,
                "quant_formats": ["none"],
                "max_draft_len": m.max_draft_len if m.max_draft_len < d_max else None,
            }
            for m in self.mechanisms.values()
        ]
        acceptance, checks_notes = self._acceptance(units)
        return {
            "target": dataclasses.asdict(self.target_ref),
            "timing_shapes": f"{self.target_ref.path} in vLLM {self.engine.version} "
            f"({self.target_ref.arch}, {self.target_ref.num_layers} layers, "
            f"{self.dtype}; real weights)",
            "drafters": drafters,
            "workload": self._workload()
            | {
                "prompts_by_domain": {
                    d: sum(self.prompt_domain[i] == d for i in greedy_ids) for d in self.pool.domains()
                }
            },
            "verify": [],
            "draft": [],
            "host": [],
            "micro": [],
            "acceptance": acceptance,
            "rounds": rounds,
            "notes": self._notes(units, budget, checks_notes, speed, between, moved),
            "memory": self._memory(drafters),
            "phase_s": {"load": round(load_s, 1), "engine units": round(engine_s, 1)},
            "engine": {
                "name": "vllm",
                "version": self.engine.version,
                "python": self.engine.python,
                "options": self.engine_options,
                "max_num_seqs": self.max_num_seqs,
                "max_model_len": self.max_model_len,
                "mechanisms": self.supported,
                "engines_per_unit": {"plain": PLAIN_ENGINES, "speculative": UNIT_ENGINES},
                "speed_probe": speed,
                "between_engines": between,
                "units": {
                    f"{name}/{D}": {
                        "ok": u["ok"],
                        "init_s": u["init_s"],
                        "error": u["error"],
                        "engine_s": u["engine_s"],  # all its engines, start-up to exit
                        "accept_s": round(sum(u["accept_s"].values()), 1),  # of which decoding acceptance prompts
                    }
                    for (name, D), u in units.items()
                },
            },
        }

    def _notes(
        self, units: dict, budget: Budget, checks_notes: list[str], speed: dict | None, between: dict, moved: list[str]
    ) -> list[str]:
        notes = [
            f"measured in vLLM {self.engine.version}: every time is an engine step as vLLM runs it (draft, verify and "
            "host together); "
            "acceptance from vLLM's own per-request counters"
        ]
        notes += [
            f"vLLM does not run {name} here: {v['reason']}" for name, v in self.supported.items() if not v["runs"]
        ]
        notes += [f"engine unit skipped for the time budget: {what}" for what in budget.skipped]
        notes += checks_notes
        if speed:
            notes.append(
                "engine rounds brought to the reference speed "
                f"(the speed probe's median, {speed['median_ms']:.1f} ms): each engine's "
                f"steps x (reference / the engine's probe)^{speed['elasticity']:.2f}, "
                "the elasticity fitted over the cells timed by several engines; "
                "each round keeps its raw median beside (raw_median_ms)"
            )
        if between["sd"] is not None:
            notes.append(
                f"engines of one unit differed by {between['sd']:.1%} "
                "(sd at reference speed, estimated from the plain unit's engines) beyond their "
                f"steps' own noise, over {between['cells']} cells; "
                "each round's interval holds that term (engine.between_engines)"
            )
        if moved:
            notes.append(
                f"{len(moved)} engine round cells disagreed with their neighbours beyond their 95% interval; "
                "the monotone fit moved them (source 'fitted'): " + ", ".join(moved[:6])
            )
        failed = [f"{name} D={D}: {u['error']}" for (name, D), u in units.items() if u["ok"] and u.get("failed_cells")]
        return notes + [f"engine run failed part-way, its remaining cells infeasible: {f}" for f in failed]

    # ------------------------------------------------------------------ records

    def _memory(self, drafters: list[dict]) -> dict:
        """The memory record (profiles/memory.py) for the target in vLLM's dtype; on a CPU vLLM's KV cache is its own
        pool."""
        own = {
            d["name"]: model_folder(d["options"]["model"])[2]
            for d in drafters
            if d["options"].get("model") and d["model"] and "hidden_layers" not in d["model"]
        }
        assert self.s.max_draft_len is not None  # for_device filled it in
        return memory_record(
            self.hf_config,
            self.dtype,
            drafters,
            self.device_fp,
            list(self.s.batch_buckets),
            self.s.max_draft_len,
            own,
            kv_cache_bytes=CPU_KV_CACHE_BYTES if self.device.type == "cpu" else None,
        )

    def _acceptance(self, units: dict) -> tuple[list[dict], list[str]]:
        """Records from each mechanism's D_max unit; the other units' greedy runs check the figures derived at their
        D."""
        records, notes = [], []
        for m in self.mechanisms.values():
            top = units.get((m.name, m.max_draft_len))
            if not top or not top["ok"]:
                continue
            counters = {
                t: [counters_of(r, m.max_draft_len) for r in rows] for t, rows in top["accept"].items()
            }  # per prompt, by temperature
            greedy = dict(zip(top["accept_ids"].get("0.0", []), counters.get("0.0", [])))
            checks = []
            for D in sorted(
                D for (name, D) in units if name == m.name and 0 < D < m.max_draft_len and units[(name, D)]["ok"]
            ):
                direct_rows = units[(m.name, D)]["accept"].get("0.0")
                if not direct_rows or not greedy:
                    continue
                direct = SpecCounters.total([counters_of(r, D) for r in direct_rows]).tokens_per_target_forward
                derived = SpecCounters.total([greedy[p.id] for p in self.check_prompts]).derived_at(D)[0]
                rel = (derived - direct) / direct
                checks.append(
                    {"draft_len": D, "derived": derived, "direct": direct, "rel_diff": rel, "flagged": abs(rel) > 0.05}
                )
                if abs(rel) > 0.05:
                    notes.append(
                        f"{m.name}: tokens per forward derived at D={D} from the D_max run "
                        f"differs from vLLM's own run at D={D} by {rel:+.1%} ({derived:.3f} against {direct:.3f})"
                    )
            notes += self._width_notes(m, top)
            for temp_key, per_prompt in counters.items():
                temp = float(temp_key)
                sums = replay.derived_rates(per_prompt, m.max_draft_len)
                records += acceptance_records(
                    m.name,
                    "none",
                    temp,
                    [self.prompt_domain[i] for i in top["accept_ids"][temp_key]],
                    per_prompt,
                    sums,
                    "loop",
                    checks if temp == 0.0 else [],
                    max_draft_len=m.max_draft_len,
                    new_tokens=self.s.new_tokens,
                    seed=self.s.seed,
                )
        return records, notes

    def _width_notes(self, m: Mechanism, top: dict) -> list[str]:
        """Where greedy tokens per forward at D_max stayed wider than the target, and why (the split or the time ran
        out)."""
        target = self.s.acceptance_half_width
        ids = top["accept_ids"].get("0.0", [])
        if target <= 0 or not ids:
            return []
        counters = [counters_of(r, m.max_draft_len) for r in top["accept"]["0.0"]]
        out = []
        for d, w in half_widths(counters, [self.prompt_domain[i] for i in ids], m.max_draft_len, self.s.seed).items():
            if w > target:
                used = sum(self.prompt_domain[i] == d for i in ids)
                why = (
                    "the profiling split has no more prompts for it"
                    if used >= sum(q.domain == d for q in self.fitting)
                    else "the time allowed no more"
                )
                out.append(
                    f"acceptance: {m.name} tokens per forward at D={m.max_draft_len} is {intervals.half_width_text(w)} "
                    f"for {d} ({used} prompts), above the ±{target:.0%} target: {why}"
                )
        return out


def _bisect(units: dict, name: str, tolerance: float) -> list[int]:
    """The midpoints to measure next: of each gap between measured draft lengths of `name` whose two ends differ, at
    some (B, ctx), by more than the tolerance and more than their medians' 95% half-widths together (a line between
    them could then miss the middle by that much), where the midpoint is not measured yet."""
    lens = sorted(D for (n, D), u in units.items() if n == name and u["ok"])
    out = []
    for a, b in zip(lens, lens[1:]):
        if b - a < 2 or (name, (a + b) // 2) in units:
            continue
        ca, cb = units[(name, a)]["cells"], units[(name, b)]["cells"]
        for key in (k for k in ca if k in cb and ca[k]["step_ms"] and cb[k]["step_ms"]):
            ta, tb = Timing.of(ca[key]["step_ms"]), Timing.of(cb[key]["step_ms"])
            noise = (ta.ci_high_ms - ta.ci_low_ms + tb.ci_high_ms - tb.ci_low_ms) / 2
            if abs(tb.median_ms - ta.median_ms) > max(tolerance * ta.median_ms, noise):
                out.append((a + b) // 2)
                break
    return out


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)
