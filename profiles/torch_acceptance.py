"""The torch profiler's acceptance phases (profiles/torch_profile.py runs them in its order):

    acceptance    greedy: replayed exactly at every D from the target's trajectories (profiles/replay.py), for every
                  drafter in every weight format (FP8 / NVFP4 as fake-quantized weights: emulated)
    check         the loop against the replay on a sample: equal counters in fp32 (else the profile fails), the
                  difference in the profile's dtype recorded
    loop          the speculative loop at D_max for temperatures > 0 (and everything with --acceptance loop),
                  smaller D derived from its rounds
    more prompts  greedy acceptance grows per domain until tokens per forward is within ±half-width at the D a plan
                  could take, the split runs out, or the budget ends; with `second_turns`, an MT-Bench domain whose
                  first turns are used up goes on with their second turns (profiles/second_turns.py)

`AcceptancePhases` is a mixin of `TorchProfiler`: it reads the profiler's target (`target`, `model`, `device`), its
drafters, settings (`s`), prompts (`pool`, `prompt_set`, `encoded`, `sampled_prompts`, `stop_ids`) and
`_relevant_draft_lens`, and keeps what it measured on the profiler (`replayed`, `looped`, `replay_checks`, `used`); with
`s.second_turns` the growth adds MT-Bench's second turns to `pool` and `encoded` where a domain runs out of first turns
(`second_turn_domains`: the domains it did that for).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles import intervals, replay
from specdec_tune.profiles.acceptance_records import BOOTSTRAP_RESAMPLES, acceptance_records
from specdec_tune.profiles.calibration import CalibrationPrompt
from specdec_tune.profiles.drafters import Drafter, create
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.profile_run import Budget, parse_drafter_spec
from specdec_tune.profiles.prompts import encode_fitting
from specdec_tune.profiles.second_turns import second_turns
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.profiles.store import MeasurementLog

if TYPE_CHECKING:
    from specdec_tune.profiles.calibration import CalibrationSet
    from specdec_tune.profiles.models.generic import GenericCausalLM
    from specdec_tune.profiles.models.llama import CausalLM
    from specdec_tune.profiles.models.loading import LoadedModel
    from specdec_tune.settings import ProfileSettings

# Prompts a round of growth adds, dealt round-robin over the domains whose interval is still wide (widest first): a
# round's trajectories decode together, and a prompt's trajectory costs 2.7x as much in a batch of 4 as in one of 32
# and 12% less again in one of 64 (demo target, 2-core CPU: 1.64-1.78, 0.61-0.71 and 0.62 s on 124- to 167-token
# prompts), so a round stays this large when few domains are left.
GROWTH_ROUND_PROMPTS = 64
FLAG_REL_DIFF = 0.05  # replay vs the loop in the profile's dtype: flag differences above this
# The target's greedy trajectories are generated this many prompts at a time: a decode step's cost grows little
# with rows until compute saturates (demo target, 2-core CPU, ctx 256: 34 ms per row at 8 rows, 8.6 at 64). Rows
# are sorted by prompt length so that a batch holds similar lengths; within it the prefill runs in length groups
# (`specdec.prefill_groups`): on a CPU the prefill is where the time goes.
TRAJECTORY_BATCH = 64
# The check of the replay against the loop decodes this many tokens per prompt: a loop round costs nearly the same
# for 2 rows as for 4 on a CPU (the forwards read the weights once per step), so 4 prompts x 16 tokens check as many
# tokens as 2 x 32 in half the time (demo pair, fp32: 3.4 against 5.7 s with n-gram, 10.2 against 20.2 s with the
# draft model).
CHECK_NEW_TOKENS = 16
FINISH_RESERVE_S = (
    5.0  # growth leaves this much of the budget to the acceptance records (bootstrap intervals) and the writing
)


class AcceptancePhases:
    """Greedy acceptance by replay, its check against the loop, the loop for sampled decoding, and growth (module
    docstring)."""

    if TYPE_CHECKING:  # what it reads and keeps on the profiler (TorchProfiler and ProfileRun define them)
        s: ProfileSettings
        target: LoadedModel
        model: CausalLM | GenericCausalLM
        device: torch.device
        drafters: dict[str, Drafter]
        pool: CalibrationSet
        prompt_set: CalibrationSet
        encoded: dict[str, list[int]]  # prompt id -> token ids
        sampled_prompts: list[CalibrationPrompt]
        stop_ids: list[int]
        replay_units: list[tuple[str, str]]  # (drafter, weight format)
        used: list[CalibrationPrompt]
        second_turn_domains: set[str]
        trajectory_s_per_prompt: float
        unit_s_per_prompt: dict[tuple[str, str], float]
        trajectory: dict[str, list[int]]
        replayed: dict[tuple[str, str], dict[str, list[SpecCounters]]]
        looped: dict[tuple[str, str, float], tuple[list[CalibrationPrompt], list[SpecCounters], list[dict]]]
        replay_checks: dict[str, list[dict]]
        replay_exact: dict[str, dict]
        _quantized: dict[tuple[str, str], Drafter]

        def _tick(self, phase: str, done: int, total: int, unit: str = "") -> None: ...

        def d_max(self, drafter: Drafter) -> int: ...

        def _relevant_draft_lens(self, verify: list[dict]) -> set[int]: ...

    def _drafter(self, name: str, fmt: str) -> Drafter:
        """The drafter with its weights in `fmt` (fake-quantized copies are made once)."""
        if fmt == "none":
            return self.drafters[name]
        if (name, fmt) not in self._quantized:
            self._quantized[(name, fmt)] = self.drafters[name].with_quantized_weights(fmt)
        return self._quantized[(name, fmt)]

    def run_counters(
        self,
        drafter: Drafter,
        D: int,
        temperature: float,
        log: MeasurementLog,
        key: str,
        prompts: list[CalibrationPrompt] | None = None,
    ) -> list[SpecCounters]:
        """Per-prompt counters of the speculative loop over `prompts` (default: the starting set), one logged unit per
        batch."""
        prompts = list(self.prompt_set.prompts) if prompts is None else prompts
        out: list[SpecCounters] = []
        B = self.s.acceptance_batch
        for start in range(0, len(prompts), B):
            ids = [self.encoded[p.id] for p in prompts[start : start + B]]

            def run_batch(ids=ids, start=start):
                res = generate(
                    self.model,
                    ids,
                    drafter=drafter,
                    num_draft_tokens=D,
                    max_new_tokens=self.s.new_tokens,
                    temperature=temperature,
                    seed=self.s.seed + start,
                    stop_token_ids=self.stop_ids,
                )
                return {
                    "counters": [dataclasses.asdict(c) for c in res.per_prompt],
                    "draft_s": res.draft_s,
                    "verify_s": res.verify_s,
                    "total_s": res.total_s,
                    "forwards": res.target_forwards,
                }

            done = log.measure(f"{key}/batch{start}", run_batch)
            out += [SpecCounters(**c) for c in done["counters"]]
        return out

    def _trajectories(self, log: MeasurementLog, prompts: list[CalibrationPrompt]) -> None:
        """The target's greedy continuations, generated once per prompt, `TRAJECTORY_BATCH` at a time, and logged."""
        batch = TRAJECTORY_BATCH
        ordered = sorted(prompts, key=lambda p: (len(self.encoded[p.id]), p.id))  # similar lengths share a batch
        for start in range(0, len(ordered), batch):  # fixed batches: a resumed run decodes the same rows together
            chunk = ordered[start : start + batch]
            if any(f"trajectory/{p.id}" not in log for p in chunk):
                for p, t in zip(
                    chunk,
                    replay.trajectories(self.model, [self.encoded[p.id] for p in chunk], self.s.new_tokens, batch),
                ):
                    log.measure(f"trajectory/{p.id}", lambda t=t: t)
        for p in prompts:
            self.trajectory[p.id] = log.get(f"trajectory/{p.id}")

    def _replay_prompts(
        self, log: MeasurementLog, prompts: list[CalibrationPrompt], units: list[tuple[str, str]] | None = None
    ) -> None:
        """The counters of every replayed unit (drafter, weight format) in `units` (default: all) at every D on these
        prompts, the trajectories shared by all."""
        units = self.replay_units if units is None else units
        started = time.monotonic()
        self._trajectories(log, prompts)
        self.trajectory_s_per_prompt = max(
            self.trajectory_s_per_prompt, (time.monotonic() - started) / max(1, len(prompts))
        )
        stop = set(self.stop_ids)
        spent = dict.fromkeys(units, 0.0)
        for p in prompts:  # prompt by prompt: a head's formats share the target's teacher-forced pass
            for name, fmt in units:

                def run(p=p, name=name, fmt=fmt):
                    drafter, D_max = self._drafter(name, fmt), self.d_max(self.drafters[name])
                    propose = replay.proposer(drafter, self.encoded[p.id], self.trajectory[p.id], self.model, D_max)
                    counters = replay.replay(
                        self.trajectory[p.id], propose, range(1, D_max + 1), self.s.new_tokens, stop, D_max
                    )
                    return [dataclasses.asdict(c) for c in counters]

                t0 = time.monotonic()
                self.replayed.setdefault((name, fmt), {})[p.id] = [
                    SpecCounters(**c) for c in log.measure(f"replay/{name}/{fmt}/{p.id}", run)
                ]
                spent[(name, fmt)] += time.monotonic() - t0
        replay.target_states.cache_clear()
        for p in prompts:
            if p not in self.used:
                self.used.append(p)
        for unit, s in spent.items():
            self.unit_s_per_prompt[unit] = max(self.unit_s_per_prompt.get(unit, 0.0), s / max(1, len(prompts)))

    def _acceptance(self, log: MeasurementLog) -> None:
        """Greedy acceptance by replay, for every drafter and weight format (with --acceptance loop: none)."""
        if self.replay_units:
            self._tick("acceptance", 0, 1)
            self._replay_prompts(log, list(self.prompt_set.prompts))
            self._tick("acceptance", 1, 1)

    def _acceptance_loops(self, log: MeasurementLog, budget: Budget) -> None:
        """The speculative loop at D_max where replay does not apply: temperatures > 0 (and everything with
        --acceptance loop), smaller D derived from its rounds. Run after the cheaper phases: it is the costliest."""
        s = self.s
        units = [
            (name, "none", t)
            for t in s.temperatures
            for name in self.drafters
            if t > 0 or (name, "none") not in self.replay_units
        ]
        units += [
            (name, fmt, 0.0)
            for fmt in s.quant_formats
            for name, d in self.drafters.items()
            if d.kind != "model_free" and (name, fmt) not in self.replay_units
        ]
        for i, (name, fmt, temp) in enumerate(units):
            self._tick("loop acceptance", i, len(units))
            label = f"acceptance {name} quant={fmt} T={temp}"
            if not budget.allows(label):
                continue
            drafter = self._drafter(name, fmt)
            prompts = self.sampled_prompts if temp > 0 else list(self.prompt_set.prompts)
            key = f"acceptance/{name}/{fmt}/{temp}"
            per_prompt = self.run_counters(drafter, self.d_max(self.drafters[name]), temp, log, key, prompts)
            checks = []
            if fmt == "none" and temp == 0.0:
                for D in [D for D in s.checks if D < self.d_max(self.drafters[name])]:
                    if not budget.allows(f"AL check {name} D={D}"):
                        continue
                    direct = SpecCounters.total(
                        self.run_counters(drafter, D, 0.0, log, f"check/{name}/{D}", prompts)
                    ).tokens_per_target_forward
                    derived = SpecCounters.total(per_prompt).derived_at(D)[0]
                    rel = (derived - direct) / direct
                    checks.append(
                        {
                            "draft_len": D,
                            "derived": derived,
                            "direct": direct,
                            "rel_diff": rel,
                            "flagged": abs(rel) > FLAG_REL_DIFF,
                        }
                    )
            self.looped[(name, fmt, temp)] = (prompts, per_prompt, checks)
        self._tick("loop acceptance", len(units), len(units))

    def _acceptance_records(self) -> list[dict]:
        records = []
        for (name, fmt), by_prompt in self.replayed.items():
            prompts = [p for p in self.used if p.id in by_prompt]
            rows = [by_prompt[p.id] for p in prompts]
            records += self._records(
                name,
                fmt,
                0.0,
                prompts,
                [r[-1] for r in rows],
                replay.per_prompt_rates(rows),
                "replay",
                self.replay_checks.get(name, []),
            )
        for (name, fmt, temp), (prompts, per_prompt, checks) in self.looped.items():
            sums = replay.derived_rates(per_prompt, self.d_max(self.drafters[name]))
            records += self._records(name, fmt, temp, prompts, per_prompt, sums, "loop", checks)
        order = {name: i for i, name in enumerate(self.drafters)}
        return sorted(
            records, key=lambda r: (r["temperature"], r["quant"] != "none", r["quant"], order[r["mechanism"]])
        )

    def _records(
        self,
        name: str,
        fmt: str,
        temp: float,
        prompts: list[CalibrationPrompt],
        at_max: list[SpecCounters],
        sums: dict[str, np.ndarray],
        method: str,
        checks: list[dict],
    ) -> list[dict]:
        return acceptance_records(
            name,
            fmt,
            temp,
            [p.domain for p in prompts],
            at_max,
            sums,
            method,
            checks,
            max_draft_len=self.d_max(self.drafters[name]),
            new_tokens=self.s.new_tokens,
            seed=self.s.seed,
        )

    def _check_replay(self, log: MeasurementLog, budget: Budget) -> None:
        """The loop checks the replay on a sample of `check_prompts` prompts, `CHECK_NEW_TOKENS` each: in fp32 the
        counters must be equal, prompt by prompt and D by D (a difference fails the profile); in the profile's dtype
        the tokens per forward at D_max are compared and the difference recorded (batch-shape numerics: the loop
        verifies 1+D tokens per forward, the trajectory one)."""
        names = [name for name, fmt in self.replay_units if fmt == "none"]
        if not names or not budget.allows("replay check against the loop"):
            return
        prompts = list(self.prompt_set.prompts)
        sample = prompts[:: max(1, len(prompts) // self.s.check_prompts)][: self.s.check_prompts]
        N = min(CHECK_NEW_TOKENS, self.s.new_tokens)
        ids = [self.encoded[p.id] for p in sample]
        exact, trajs = None, None
        for i, name in enumerate(names):
            self._tick("replay check", i, len(names))
            D_max = self.d_max(self.drafters[name])
            lens = sorted({min(3, D_max), D_max})

            def fp32_check(name=name, lens=lens, D_max=D_max):
                nonlocal exact, trajs
                if exact is None:  # the profile's own target and trajectories where it already runs in fp32
                    exact = (
                        self.target
                        if self.model.dtype == torch.float32
                        else load_model(
                            self.s.target,
                            dtype="float32",
                            device=str(self.device),
                            trust_remote_code=self.s.trust_remote_code,
                        )
                    )
                    trajs = (
                        [self.trajectory[p.id] for p in sample]
                        if exact is self.target
                        else replay.trajectories(exact.model, ids, N, len(ids))
                    )
                spec = next(x for x in self.s.drafters if parse_drafter_spec(x)[0] == name)
                drafter = (
                    self.drafters[name] if exact is self.target else create(name, exact, parse_drafter_spec(spec)[1])
                )
                # the sample's prompts dealt over the checked D, D_max first, in one batch (each row its own D)
                row_d = [lens[-1 - j % len(lens)] for j in range(len(sample))]
                looped, replayed = self._loop_and_replay(exact.model, drafter, ids, trajs, row_d, N)
                for j, (a, b) in enumerate(zip(replayed, looped)):
                    if dataclasses.asdict(a) != dataclasses.asdict(b):
                        return {
                            "equal": False,
                            "draft_len": row_d[j],
                            "prompt": sample[j].id,
                            "replay": [a.num_rounds, a.num_accepted_tokens],
                            "loop": [b.num_rounds, b.num_accepted_tokens],
                        }
                return {
                    "equal": True,
                    "prompts": len(sample),
                    "new_tokens": N,
                    "draft_lens": lens,
                    "prompts_at": {str(D): [p.id for p, d in zip(sample, row_d) if d == D] for D in lens},
                    "tokens_per_forward_at_d_max": SpecCounters.total(
                        [c for c, d in zip(looped, row_d) if d == D_max]
                    ).tokens_per_target_forward,
                }

            result = log.measure(f"replay-check/{name}/fp32/{len(sample)}x{N}", fp32_check)
            if not result["equal"]:
                raise SpecdecError(
                    f"replayed acceptance of {name} differs from the speculative loop in fp32 on prompt "
                    f"{result['prompt']} at D={result['draft_len']} "
                    f"(rounds, accepted: replay {result['replay']}, loop {result['loop']})",
                    "profile with --acceptance loop, and report the drafter: "
                    "its proposals must depend only on the prefix",
                )

            def in_dtype(name=name, D_max=D_max):  # D_max on every row of the sample, in the profile's own dtype
                looped, replayed = self._loop_and_replay(
                    self.model,
                    self.drafters[name],
                    ids,
                    [self.trajectory[p.id] for p in sample],
                    [D_max] * len(sample),
                    N,
                )
                return [SpecCounters.total(c).tokens_per_target_forward for c in (replayed, looped)]

            if self.model.dtype == torch.float32:  # the check above ran in the profile's dtype: equal counters
                replayed_tpf = direct = result["tokens_per_forward_at_d_max"]
            else:
                replayed_tpf, direct = log.measure(
                    f"replay-check/{name}/{self.model.dtype}/{len(sample)}x{N}", in_dtype
                )
            rel = (replayed_tpf - direct) / direct
            self.replay_checks[name] = [
                {
                    "draft_len": D_max,
                    "derived": replayed_tpf,
                    "direct": direct,
                    "rel_diff": rel,
                    "flagged": abs(rel) > FLAG_REL_DIFF,
                }
            ]
            self.replay_exact[name] = result
        self._tick("replay check", len(names), len(names))

    def _loop_and_replay(
        self, model, drafter: Drafter, ids: list[list[int]], trajs: list[list[int]], row_d: list[int], new_tokens: int
    ) -> tuple[list[SpecCounters], list[SpecCounters]]:
        """Per row, the loop's counters (one batch, row b at D = row_d[b]) and the replay's over the row's
        trajectory."""
        looped = generate(
            model, ids, drafter=drafter, num_draft_tokens=row_d, max_new_tokens=new_tokens, stop_token_ids=self.stop_ids
        ).per_prompt
        stop = set(self.stop_ids)
        replayed = [
            replay.replay(g, replay.proposer(drafter, x, g, model, D), [D], new_tokens, stop, D)[0]
            for x, g, D in zip(ids, trajs, row_d)
        ]
        return looped, replayed

    def _grow_acceptance(self, log: MeasurementLog, budget: Budget, verify: list[dict]) -> list[str]:
        """Add prompts to every domain whose tokens per forward is not yet within ±half-width at the relevant D
        (95% bootstrap interval, every replayed drafter), until all are, the domain runs out of prompts, or the
        budget ends. This phase fills what is left of the budget: each round adds only as many prompts as the
        replay so far says fit in it (widest domains first), so it ends near the deadline, not a round past it.
        Returns the notes that say where it stopped."""
        target = self.s.acceptance_half_width
        units = [
            (name, fmt) for name, fmt in self.replay_units if fmt == "none"
        ]  # the FP8 / NVFP4 twins keep the starting set
        if not units or target <= 0:
            return []
        relevant = sorted(self._relevant_draft_lens(verify))
        s_per_prompt = self.trajectory_s_per_prompt + sum(self.unit_s_per_prompt.get(u, 0.0) for u in units)
        while True:
            widths = self._half_widths(relevant)
            wide = {d: w for d, w in widths.items() if w > target}
            self._tick("more prompts", len(widths) - len(wide), len(widths))
            if not wide:
                return [f"acceptance: tokens per forward within ±{target:.0%} (95%) in every domain at D = {relevant}"]
            unused = {
                d: [q for q in self.pool.prompts if q.domain == d and q.id in self.encoded and q not in self.used]
                for d in wide
            }
            spent = (
                [d for d in wide if not unused[d] and d not in self.second_turn_domains] if self.s.second_turns else []
            )
            if spent and budget.deadline - FINISH_RESERVE_S > time.monotonic():
                self._add_second_turns(spent)
                continue
            by_width = sorted(wide, key=wide.__getitem__, reverse=True)
            dealt = [
                unused[d][k] for k in range(max(map(len, unused.values()))) for d in by_width if k < len(unused[d])
            ]  # round-robin, widest first
            added = dealt[:GROWTH_ROUND_PROMPTS]
            left_s = budget.deadline - FINISH_RESERVE_S - time.monotonic()
            if s_per_prompt > 0:
                added = added[: int(left_s / s_per_prompt)]
            if not added or left_s <= 0:
                why = {
                    d: "the time budget ended" if unused[d] else "the profiling split has no more prompts for it"
                    for d in wide
                }
                return [
                    f"acceptance: {why[d]}; tokens per forward at D = {relevant} is {intervals.half_width_text(w)} "
                    f"for {d} ({sum(p.domain == d for p in self.used)} prompts), above the ±{target:.0%} target"
                    for d, w in sorted(wide.items())
                ]
            self._replay_prompts(log, added, units)

    def _add_second_turns(self, domains: list[str]) -> None:
        """The second turns of these domains' MT-Bench questions (profiles/second_turns.py), added to the pool."""
        self.second_turn_domains.update(domains)
        firsts = [p for p in self.pool.prompts if p.domain in domains]
        context = self.model.config.max_position_embeddings
        added = second_turns(
            self.target, firsts, context_tokens=context, stop_ids=self.stop_ids, batch=self.s.acceptance_batch
        )
        if not added:
            return
        self._tick("second turns", len(added), len(added))
        self.pool = type(self.pool)(self.pool.name, self.pool.prompts + tuple(added))
        self.encoded |= encode_fitting(
            self.target.tokenizer,
            type(self.pool)("second turns", tuple(added)),
            context_tokens=context,
            max_new_tokens=self.s.new_tokens,
            max_draft_tokens=self.s.max_draft_len or 0,
        )

    def _half_widths(self, relevant: list[int]) -> dict[str, float]:
        """Per domain, the largest relative half-width of tokens per forward over the relevant D and replayed
        drafters."""
        out: dict[str, float] = {}
        for (_, fmt), by_prompt in self.replayed.items():
            if fmt != "none":
                continue
            prompts = [p for p in self.used if p.id in by_prompt]
            sums = replay.per_prompt_rates([by_prompt[p.id] for p in prompts])
            domains = [p.domain for p in prompts]
            for d in dict.fromkeys(domains):
                figures = intervals.figures(sums, domains, {d: 1.0}, resamples=BOOTSTRAP_RESAMPLES, seed=self.s.seed)
                assert len(figures) == 4  # resampled: the figures and their intervals
                tpf, _, ci, _ = figures
                out[d] = max(out.get(d, 0.0), *((ci[D, 1] - ci[D, 0]) / 2 / tpf[D] for D in relevant if D < len(tpf)))
        return out
