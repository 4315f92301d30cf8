"""The torch backend of `specdec-tune profile`: this package's own loop measures the target, its drafters and the
device.

Phases, in order (the budget counts from the command's start, imports and model loading included; a short
--budget-minutes drops what is left and says so in `notes`):
  verify      T_verif(B, 1+D, ctx): every cell visited in shuffled rounds (seeds, bisection where a line misses by
              > tol, repeats until the median's 95% interval is tight), the device's drift taken out of every visit
              (profiles/drift.py), then fitted non-decreasing in 1+D, B and ctx
  draft       T_draft(B, D) per mechanism, one propose() as it runs (serial steps / one pass / lookups), on real text
  acceptance  greedy: replayed exactly at every D from the target's trajectories (profiles/replay.py), for every
              drafter in every weight format (FP8 / NVFP4 as fake-quantized weights: emulated)
  check       the loop against the replay on a sample: equal counters in fp32 (else the profile fails), the
              difference in the profile's dtype recorded
  host        loop time per round outside drafter and target, at the smallest and largest batch and the shortest
              and longest draft (interpolated between)
  micro       attention vs G*(1+D) rows per KV head; linear layers vs M = B*(1+D)
  loop        the speculative loop at D_max for temperatures > 0 (1 prompt per domain; with --acceptance loop, for
              everything), smaller D derived from its rounds
  refinement  the decision cells (per batch bucket: 1 and 1+D for the 3 D with the best speedup bound by the
              acceptance so far) get more visits until tight: a tenth of the budget left, and again whatever growth
              leaves
  more prompts  greedy acceptance grows per domain until tokens per forward is within ±half-width (95% bootstrap
              interval over prompts) at the D a plan could take, the split runs out, or the budget ends: it fills
              what the other phases left of the budget, adding only the prompts the replay's cost says fit

The acceptance phases (replay, check, loop, growth) are `torch_acceptance.AcceptancePhases`; the verify curve's
sampler and fit are `verify_curve`; resume, budget and the record's header are `profile_run.ProfileRun`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from specdec_tune import SpecdecError, __version__
from specdec_tune.profiles import intervals, micro, replay
from specdec_tune.profiles.calibration import CalibrationPrompt
from specdec_tune.profiles.drafters import Drafter, DraftRequest, create
from specdec_tune.profiles.fingerprint import device_factors, device_fingerprint
from specdec_tune.profiles.memory import allocator_peak_bytes, memory_record
from specdec_tune.profiles.models.folders import model_folder, weights_hash
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.profile_run import Budget, ProfileRun, drafter_specs, workload_record
from specdec_tune.profiles.prompts import encode_fitting, encode_prompts
from specdec_tune.profiles.schema import SCHEMA_VERSION
from specdec_tune.profiles.second_turns import SUFFIX as SECOND_TURN
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.profiles.store import MeasurementLog
from specdec_tune.profiles.timing import SpeedGuard
from specdec_tune.profiles.torch_acceptance import FINISH_RESERVE_S, FLAG_REL_DIFF, AcceptancePhases
from specdec_tune.profiles.train_drafter import cached_demo_head  # noqa: F401  (registers it: head drafters without model= load it)
from specdec_tune.profiles.verify_curve import (
    REFINE_BUDGET_SHARE,
    REFINE_CANDIDATES,
    REFINE_TARGET_REL_HALF_WIDTH,
    VERIFY_BUDGET_SHARE,
    VerifySampler,
    VerifyStep,
    adaptive_sample,
    fill_curve,
    time_unless_oom,
    visits_of,
)
from specdec_tune.progress import Progress
from specdec_tune.records import sha256_json
from specdec_tune.settings import ProfileSettings

if TYPE_CHECKING:
    from specdec_tune.profiles.models.generic import GenericCausalLM

DRAFT_CALLS_PER_POINT = 5 * 10  # time_call's repeats (at most 10x when they are short); the catch-up call warms up
HOST_NEW_TOKENS = 6  # the decode a host-overhead cell runs
HOST_PROMPT_TOKENS = (
    32  # of each prompt, its last: the host's work per round does not depend on the context (nor is the prefill timed)
)
# a draft-cost point stops repeating (after 3) once its calls span this: a serial draft of 7 steps at batch 8 takes half
# a second on a CPU
DRAFT_POINT_MAX_MS = 500.0


class TorchProfiler(AcceptancePhases, ProfileRun):
    """The phases of the module docstring, in that order, on this package's own loop."""

    backend = "torch"

    def __init__(
        self, settings: ProfileSettings, progress: Progress | None = None, started: float | None = None
    ) -> None:
        super().__init__(settings, progress, started)
        s = self.s
        assert s.max_draft_len is not None  # for_device filled it in
        self.target = load_model(
            s.target, dtype=s.dtype, device=str(self.device), trust_remote_code=s.trust_remote_code
        )
        self.model = self.target.model
        self.drafters: dict[str, Drafter] = {
            name: create(name, self.target, options) for name, options in drafter_specs(s.drafters)
        }
        self.prompt_set = self.pool.per_domain(s.prompts_per_domain)
        context = self.model.config.max_position_embeddings
        self.prompt_ids = encode_prompts(
            self.target.tokenizer,
            self.prompt_set,
            context_tokens=context,
            max_new_tokens=s.new_tokens,
            max_draft_tokens=s.max_draft_len,
        )
        self.encoded = {p.id: ids for p, ids in zip(self.prompt_set, self.prompt_ids)} | encode_fitting(
            self.target.tokenizer,
            self.pool,
            context_tokens=context,
            max_new_tokens=s.new_tokens,
            max_draft_tokens=s.max_draft_len,
        )
        self.sampled_prompts = list(self.prompt_set.per_domain(s.sampled_prompts_per_domain).prompts)
        self.stop_ids = list(self.model.config.eos_token_ids)
        # greedy acceptance by replay (profiles/replay.py) for the drafters that declare how, in every weight format
        self.replay_units = (
            []
            if s.acceptance == "loop"
            else [
                (name, fmt)
                for name, d in self.drafters.items()
                if d.replay
                for fmt in ("none", *(s.quant_formats if d.kind != "model_free" else ()))
            ]
        )
        self.used: list[CalibrationPrompt] = []  # prompts replayed so far, in order
        self.second_turn_domains: set[str] = set()  # domains whose MT-Bench second turns joined the pool
        # wall seconds per prompt so far (the slowest call): a trajectory, and each unit's replay; growth's cost
        # per prompt
        self.trajectory_s_per_prompt = 0.0
        self.unit_s_per_prompt: dict[tuple[str, str], float] = {}
        self.trajectory: dict[str, list[int]] = {}
        self.replayed: dict[
            tuple[str, str], dict[str, list[SpecCounters]]
        ] = {}  # (name, fmt) -> prompt id -> counters at D = 1..D_max
        self.looped: dict[tuple[str, str, float], tuple] = {}
        self.replay_checks: dict[str, list[dict]] = {}
        self.replay_exact: dict[str, dict] = {}
        self._quantized: dict[tuple[str, str], Drafter] = {}
        self.device_fp = device_fingerprint(self.device, self.model.dtype)
        self.fingerprint = sha256_json(
            {
                "schema": SCHEMA_VERSION,
                "tool": __version__,
                "device": device_factors(self.device_fp),
                "target": dataclasses.asdict(self.target.ref),
                "drafters": self._drafter_infos(),
                "workload": self._workload(),
                **({"second_turns": True} if s.second_turns else {}),  # other prompts than a first-turn profile's
            }
        )

    # ------------------------------------------------------------------ records

    def _workload(self) -> dict:
        return workload_record(self.s, self.calibration, self.pool, self.prompt_set.domains(), self.s.acceptance_batch)

    def _drafter_infos(self) -> list[dict]:
        infos = []
        for name, d in self.drafters.items():
            desc = d.describe()
            model = getattr(d, "model", None)
            ref: dict[str, Any] | None = None
            if model is not None:
                ref = {
                    "layers": len(model.layers),
                    "shares_target_weights": model.embed_tokens is self.model.embed_tokens,
                }
                if desc["options"].get("model"):  # its own checkpoint: its hash makes a bundle stale when it changes
                    ref["weights_hash"] = weights_hash(model_folder(desc["options"]["model"])[3])
            head = getattr(d, "head", None)
            if head is not None:  # a learned head over the target's hidden states (EAGLE-3, MTP, DFlash, DSpark)
                layers = len(getattr(head, "layers", None) or getattr(head, "mtp_layers", None) or [head])
                ref = {
                    "layers": layers,
                    "hidden_layers": list(d.hidden_layers),
                    "shares_target_weights": head.embed_tokens is self.model.embed_tokens,
                    "weights_hash": getattr(d, "weights_hash", None),
                    "draft_vocab_size": head.lm_head.weight.shape[0],  # [V_draft, H]: a LogitHead has no out_features
                }
            infos.append(
                {
                    "name": name,
                    "kind": desc["kind"],
                    "options": desc["options"],
                    "model": ref,
                    "quant_formats": ["none", *self.s.quant_formats] if d.kind != "model_free" else ["none"],
                    "draft_len_multiple": d.draft_len_multiple,
                    "max_draft_len": d.max_draft_len,
                }
            )
        return infos

    def d_max(self, drafter: Drafter) -> int:
        """The longest draft profiled for this drafter: the workload's D_max, or less where its block is shorter."""
        limit = drafter.max_draft_len
        assert self.s.max_draft_len is not None  # for_device filled it in
        return self.s.max_draft_len if limit is None else min(self.s.max_draft_len, limit)

    def _guarded(self, measure):
        """A timing cell measured at the device's quiet speed (SpeedGuard), re-run after a passing load."""
        return self.guard.run(measure)[0]

    # ------------------------------------------------------------------ run

    def measure(self, log: MeasurementLog, budget: Budget) -> dict:
        probe = VerifyStep(self.model, 1, self.s.ctx_buckets[0], 1, self.s.seed, self.device)

        def probe_ms() -> float:
            timing = probe.timing(1, warmup=1, repeats=3)
            if timing is None:
                raise SpecdecError(
                    f"the target does not fit on {self.device}: one token at batch 1 ran out of memory",
                    "profile on a device with more memory, or a smaller --ctx",
                )
            return timing.median_ms

        self.guard = SpeedGuard(probe=probe_ms)
        phase_s = {
            "load": time.monotonic() - self.started
        }  # measured wall seconds per phase (profile.json sorts the keys)

        def timed(phase: str, fn, *args):
            t0 = time.monotonic()
            out = fn(*args)
            phase_s[phase] = phase_s.get(phase, 0.0) + time.monotonic() - t0
            return out

        verify, verify_fit = timed("verify", self._verify_curve, log, budget)
        draft = timed("draft", self._draft_costs, log, budget)
        timed("acceptance replay", self._acceptance, log)
        timed("replay check", self._check_replay, log, budget)
        host = timed("host", self._host, log, budget)
        micro_points = timed("micro", self._micro, log, budget)
        timed("acceptance loop", self._acceptance_loops, log, budget)
        verify, verify_fit = timed(
            "verify refinement", self._refine_verify, budget, verify, verify_fit, REFINE_BUDGET_SHARE
        )
        growth_notes = timed("acceptance growth", self._grow_acceptance, log, budget, verify)
        verify, verify_fit = timed(
            "verify refinement", self._refine_verify, budget, verify, verify_fit, 1.0
        )  # what growth left
        acceptance = timed("acceptance records", self._acceptance_records)
        drafter_infos = self._drafter_infos()
        memory = timed("memory", self._memory, drafter_infos)
        moe = timed("moe", self._experts_woken)
        notes = self._notes(budget, growth_notes, acceptance, verify_fit)
        return {
            "target": dataclasses.asdict(self.target.ref),
            "timing_shapes": f"{self.target.ref.path} ({self.model.config.model_type}, "
            f"{len(self.model.layers)} layers, "
            f"hidden {self.model.config.hidden_size}, {self.target.ref.dtype}; real weights)",
            "drafters": drafter_infos,
            "memory": memory,
            "moe": moe,
            "workload": self._workload()
            | {
                "prompts_by_domain": self._prompts_by_domain(),
                "second_turns": sum(p.id.endswith(SECOND_TURN) for p in self.used),
            },
            "verify": verify,
            "draft": draft,
            "host": host,
            "acceptance": acceptance,
            "micro": micro_points,
            "notes": notes,
            "verify_fit": verify_fit,
            "phase_s": {k: round(v, 1) for k, v in phase_s.items()},
        }

    def _notes(self, budget: Budget, growth_notes: list[str], acceptance: list[dict], verify_fit: dict) -> list[str]:
        """What the profile's reader should know: phases skipped for the budget, where acceptance growth stopped, the
        replay's check, cells the fit moved, cells measured again or kept unsettled, a busy CPU."""
        skipped: dict[str, list[str]] = {}  # "host overhead" -> ["ngram B=1 D=1", ...]
        for what in budget.skipped:
            phase, _, cell = what.partition(" B=") if " B=" in what else (what, "", "")
            skipped.setdefault(phase, []).append(f"B={cell}" if cell else "")
        notes = [
            f"phase skipped for the time budget: {phase}"
            + (
                f" ({len(cells)} cells: {', '.join(cells[:4])}{', ...' if len(cells) > 4 else ''})"
                if any(cells)
                else ""
            )
            for phase, cells in skipped.items()
        ] + growth_notes
        notes += [
            f"{'replayed' if a['method'] == 'replay' else 'derived'} tokens per forward differs from a loop run in "
            f"{self.model.dtype} by more than {FLAG_REL_DIFF:.0%}: {a['mechanism']} D={c['draft_len']} "
            f"({c['derived']:.3f} against {c['direct']:.3f})"
            for a in acceptance
            for c in a["checks"]
            if c["flagged"]
        ]
        if self.replay_exact:
            notes.append(
                "acceptance replayed from the target's greedy trajectories for "
                + ", ".join(sorted(self.replay_exact))
                + "; the loop gave equal counters in fp32 on "
                + "; ".join(
                    f"{r['prompts']} prompts dealt over D = {r['draft_lens']}"
                    for r in list(self.replay_exact.values())[:1]
                )
            )
        if verify_fit.get("moved_beyond_interval"):
            notes.append(
                f"{len(verify_fit['moved_beyond_interval'])} verify cells disagreed with their neighbours "
                "beyond their 95% interval; the monotone fit moved them (source 'fitted'): "
                + ", ".join(
                    f"B={m['batch']} 1+D={m['tokens']} ctx={m['ctx']} {m['raw_ms']:.1f}->{m['fitted_ms']:.1f} ms"
                    for m in verify_fit["moved_beyond_interval"][:6]
                )
            )
        if self.guard.repeated:
            notes.append(
                f"{self.guard.repeated} timing cells were measured again: the device ran more than "
                f"{self.guard.slack - 1:.0%} slower than its quiet speed around them (a shared machine)"
            )
        if self.guard.unsettled:
            notes.append(
                f"{self.guard.unsettled} timing cells were kept although the device never settled: "
                "their times may be inflated"
            )
        if self.device.type == "cpu":
            load = os.getloadavg()[0]
            cores = os.cpu_count()  # None where the platform cannot tell: no note then
            if cores is not None and load > 1.5 * cores:
                notes.append(
                    f"the CPU was busy while profiling (load {load:.1f} on {cores} cores): timings may be inflated"
                )
        return notes

    def _memory(self, drafter_infos: list[dict]) -> dict:
        """The memory record (profiles/memory.py); on a GPU each (B, 1+D) verify step's activation peak is measured."""
        assert self.s.max_draft_len is not None  # for_device filled it in
        measured = {}
        if self.device.type == "cuda":
            ctx = max(self.s.ctx_buckets)
            for B in self.s.batch_buckets:
                step = VerifyStep(self.model, B, ctx, self.s.max_draft_len + 1, self.s.seed, self.device)
                for T in range(1, self.s.max_draft_len + 2):
                    if step.ready:
                        measured[(B, T)] = allocator_peak_bytes(
                            functools.partial(step.timing, T, warmup=0, repeats=1), self.device
                        )
                del step
        own = {
            i["name"]: model_folder(i["options"]["model"])[2]
            for i in drafter_infos
            if i["options"].get("model") and i["model"] and "hidden_layers" not in i["model"]
        }
        return memory_record(
            model_folder(self.s.target, self.s.trust_remote_code)[2],
            self.target.ref.dtype,
            drafter_infos,
            self.device_fp,
            list(self.s.batch_buckets),
            self.s.max_draft_len,
            own,
            measured_activation=measured,
        )

    @torch.inference_mode()
    def _experts_woken(self) -> dict:
        """For a mixture-of-experts target: per batch bucket and 1+D, the distinct experts a verify step's tokens wake,
        averaged over the MoE layers. Real calibration text (routing depends on it): `ctx` tokens of context, then the
        1+D tokens that follow. Counted once per cell (routing is deterministic); {} for a dense target."""
        moe = getattr(self.model, "moe", None)
        if moe is None:
            return {}
        model = cast("GenericCausalLM", self.model)  # only a transformers target has a mixture of experts
        assert self.s.max_draft_len is not None  # for_device filled it in
        ctx, t_max = self.s.ctx_buckets[0], self.s.max_draft_len + 1
        points = []
        for B in self.s.batch_buckets:
            rows = torch.tensor(self._context_rows(B, ctx, t_max), device=self.device)  # [B, ctx + t_max]
            cache = self.model.new_cache(B, ctx + t_max)
            self.model(rows[:, :ctx], cache, torch.zeros(B, dtype=torch.long, device=self.device), logits="none")
            start = torch.full((B,), ctx, dtype=torch.long, device=self.device)
            for T in range(1, t_max + 1):  # each step writes slots ctx..ctx+T-1 over the last one's: the context stays
                with model.count_experts() as woke:
                    self.model(rows[:, ctx : ctx + T], cache, start, logits="none")
                points.append({"batch": B, "tokens": T, "experts_woken": sum(woke) / len(woke), "source": "measured"})
        return {
            "num_experts": moe.num_experts,
            "experts_per_token": moe.experts_per_token,
            "ctx": ctx,
            "moe_layers": len(woke),
            "points": points,
        }

    def _prompts_by_domain(self) -> dict[str, int]:
        prompts = self.used or list(self.prompt_set.prompts)
        return {d: sum(p.domain == d for p in prompts) for d in dict.fromkeys(p.domain for p in prompts)}

    # ------------------------------------------------------------------ verify

    def _verify_curve(self, log: MeasurementLog, budget: Budget) -> tuple[list[dict], dict]:
        """T_verif(B, 1+D, ctx) over every cell, interleaved (`VerifySampler`), then fitted monotone (`fit_verify`)."""
        s = self.s
        assert s.max_draft_len is not None  # for_device filled it in
        sampler = VerifySampler(
            self.model, s, self.device, log, seeds=[1, 2, 4, 8, 16, 32, 64], t_max=s.max_draft_len + 1
        )
        deadline = time.monotonic() + VERIFY_BUDGET_SHARE * max(0.0, budget.deadline - time.monotonic())
        sampler.run(deadline)
        self.verify_sampler = sampler  # the decision cells get more visits once acceptance is known (`_refine_verify`)
        self._tick("verify", sampler.visits, sampler.visits)
        return sampler.fit()

    # ------------------------------------------------------------------ draft cost

    def _draft_costs(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        s, points = self.s, []
        ctx = s.ctx_buckets[0]
        cells = [(name, B) for name in self.drafters for B in s.batch_buckets]
        for i, (name, B) in enumerate(cells):
            self._tick("draft", i, len(cells))
            if not budget.allows(f"draft cost {name} B={B}"):
                continue
            drafter = self.drafters[name]
            cell = lambda drafter=drafter, B=B: {str(d): t for d, t in self._draft_cell(drafter, B, ctx).items()}  # noqa: E731
            # a lookup's draft costs a fraction of a millisecond, thousands of times less than a verify step: a slow
            # spell cannot move a decision through it, and guarding it would cost two probes per cell
            timings = log.measure(
                f"draft/{name}/{B}/{ctx}",
                cell if drafter.kind == "model_free" else lambda cell=cell: self._guarded(cell),
            )
            measured = {int(d): (t["median_ms"] if t else None) for d, t in timings.items()}
            for d, y, source in fill_curve(measured, range(1, self.d_max(self.drafters[name]) + 1)):
                t = timings.get(str(d)) or {}
                points.append(
                    {
                        "mechanism": name,
                        "batch": B,
                        "draft_len": d,
                        "ctx": ctx,
                        "median_ms": y,
                        "p10_ms": t.get("p10_ms"),
                        "p90_ms": t.get("p90_ms"),
                        "repeats": t.get("repeats", 0),
                        "source": source,
                        "ci_low_ms": t.get("ci_low_ms"),
                        "ci_high_ms": t.get("ci_high_ms"),
                    }
                )
        self._tick("draft", len(cells), len(cells))
        return points

    def _context_rows(self, B: int, ctx: int, extra: int = 0) -> list[list[int]]:
        """B rows of real calibration tokens, each `ctx + extra` long (prompts concatenated, rotated per row): the
        first `ctx` are the context, the rest the text that really follows it."""
        flat = [t for ids in self.prompt_ids for t in ids]
        while len(flat) < ctx + extra + B * 97:
            flat = flat + flat
        return [flat[b * 97 : b * 97 + ctx + extra] for b in range(B)]

    @torch.inference_mode()
    def _context_states(self, drafter: Drafter, B: int, ctx: int) -> torch.Tensor | None:
        """The target's hidden states at the drafter's layers over `_context_rows` [B, ctx, W], or None when it reads
        none."""
        if not drafter.hidden_layers:
            return None
        rows = torch.tensor(self._context_rows(B, ctx), device=self.device)
        cache = self.model.new_cache(B, ctx)
        _, hidden = self.model.forward_capture(
            rows,
            cache,
            torch.zeros(B, dtype=torch.long, device=self.device),
            tuple(drafter.hidden_layers),
            logits="none",
        )
        return hidden

    def _draft_cell(self, drafter: Drafter, B: int, ctx: int) -> dict[int, dict | None]:
        """Steady state of a fully rejected round: each call appends one token, then drafts D.

        The appended tokens are the calibration text that really follows each row's context, so lookups
        (n-gram, suffix) find the matches real text offers, not the near-none of random tokens.

        A drafter that reads target hidden states gets them as the loop passes them: the context's (ctx - 1
        positions) with the untimed first call, then one verified position per call. Their values are the
        target's real states of the context (the timing does not depend on them; the shapes are the loop's)."""
        timings: dict[int, dict | None] = {}
        states = self._context_states(drafter, B, ctx)  # [B, ctx, W] or None

        def request(rows: list[list[int]], D: int, first: bool) -> DraftRequest:
            if states is None:
                return DraftRequest(rows, [D] * B, 0.0)
            hidden = states[:, : ctx - 1] if first else states[:, -1:]  # [B, n, W]
            return DraftRequest(rows, [D] * B, 0.0, hidden_states=hidden, num_hidden=[hidden.shape[1]] * B)

        def measure(D: int) -> float | None:
            text = self._context_rows(B, ctx, extra=DRAFT_CALLS_PER_POINT)
            rows = [r[:ctx] for r in text]
            drafter.start([list(r) for r in rows])
            drafter.propose(request(rows, D, first=True))  # catch up on the context, untimed: the point's warm-up

            def step():
                for r, t in zip(rows, text):
                    r.append(t[len(r)])
                drafter.propose(request(rows, D, first=False))

            timings[D] = timing = time_unless_oom(step, self.device, warmup=0, max_total_ms=DRAFT_POINT_MAX_MS)
            return timing["median_ms"] if timing else None

        def noise(D: int) -> float:
            t = timings.get(D)
            return (t["ci_high_ms"] - t["ci_low_ms"]) / 2 if t else 0.0

        adaptive_sample(
            measure,
            1,
            self.d_max(drafter),
            self.s.interp_tolerance,
            [d for d in (1, 2, 4, 8) if d <= self.d_max(drafter)],
            noise,
        )
        return timings

    def _speedup_bounds(self, verify: list[dict]) -> dict[tuple[str, int], dict[int, float]]:
        """Per replayed drafter and batch bucket, the speedup bound of every D at the cost model's default context,
        tokens_per_forward(D) x T_verif(B, 1) / T_verif(B, 1+D) (draft and host cost left out; domains weighed
        alike)."""
        ctx = self.s.ctx_buckets[0]
        t_verif = {(p["batch"], p["tokens"]): p["median_ms"] for p in verify if p["ctx"] == ctx and p["median_ms"]}
        bounds = {}
        for (name, fmt), by_prompt in self.replayed.items():
            if fmt != "none":
                continue
            rows = [by_prompt[p.id] for p in self.used if p.id in by_prompt]
            figures = intervals.figures(
                replay.per_prompt_rates(rows),
                [p.domain for p in self.used if p.id in by_prompt],
                dict.fromkeys(self.pool.domains(), 1.0),
            )
            assert len(figures) == 2  # not resampled: the figures alone
            tpf, _ = figures
            for B in self.s.batch_buckets:
                if (B, 1) in t_verif:
                    bounds[(name, B)] = {
                        D: tpf[D] * t_verif[(B, 1)] / t_verif[(B, D + 1)]
                        for D in range(1, len(tpf))
                        if (B, D + 1) in t_verif
                    }
        return bounds

    def _relevant_draft_lens(self, verify: list[dict]) -> set[int]:
        """The D a plan could take: per batch bucket and replayed drafter, the D with the best speedup bound."""
        return {max(b, key=b.__getitem__) for b in self._speedup_bounds(verify).values() if b} or {1}

    def decision_cells(self, verify: list[dict]) -> list[tuple[int, int, int]]:
        """The verify cells (B, ctx, 1+D) each bucket's choice of D rests on: 1 and 1+D for the `REFINE_CANDIDATES`
        draft lengths with the best speedup bound, per replayed drafter, at the cost model's default context."""
        ctx = self.s.ctx_buckets[0]
        cells = {(B, ctx, 1) for B in self.s.batch_buckets}
        for (_, B), bound in self._speedup_bounds(verify).items():
            cells |= {(B, ctx, D + 1) for D in sorted(bound, key=bound.__getitem__, reverse=True)[:REFINE_CANDIDATES]}
        return sorted(cells)

    def _refine_verify(self, budget: Budget, verify: list[dict], fit: dict, share: float) -> tuple[list[dict], dict]:
        """`share` of the budget left (less the finishing reserve) for more visits to the decision cells, then the
        curve fitted again over every sample."""
        sampler = self.verify_sampler
        left_s = budget.deadline - FINISH_RESERVE_S - time.monotonic()
        if left_s <= 0 or not self.replayed:
            return verify, fit
        cells = self.decision_cells(verify)
        self._tick("verify refinement", 0, len(cells))
        sampler.refine(cells, time.monotonic() + share * left_s)
        self._tick("verify refinement", len(cells), len(cells))
        points, fit = sampler.fit()
        per_cell = {c: visits_of(sampler.timed, c) for c in cells}
        return points, fit | {
            "decision_cells": [
                {"batch": B, "ctx": ctx, "tokens": t, "visits": n} for (B, ctx, t), n in per_cell.items()
            ],
            "decision_cells_target_rel_half_width": REFINE_TARGET_REL_HALF_WIDTH,
        }

    # ------------------------------------------------------------------ host overhead

    def _host(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        """Per drafter, at the smallest and the largest batch bucket and the shortest and the longest draft: a short
        real decode; host = round - draft - verify. The host's work is per-row bookkeeping, linear in B: the cost
        model interpolates between the two batches (labelled so) and between the two draft lengths, and the
        decodes at the middle batches, which cost as much as a verify curve on a CPU, are not run."""
        points = []
        batches = sorted({min(self.s.batch_buckets), max(self.s.batch_buckets)})
        cells = [
            (name, B, D)
            for name in ("plain", *self.drafters)
            for B in batches
            for D in ([0] if name == "plain" else sorted({1, self.d_max(self.drafters[name])}))
        ]
        for i, (name, B, D) in enumerate(cells):
            self._tick("host", i, len(cells))
            if not budget.allows(f"host overhead {name} B={B} D={D}"):
                continue

            def run(B=B, name=name, D=D):
                ids = [
                    row[-HOST_PROMPT_TOKENS:] for row in (self.prompt_ids * B)[:B]
                ]  # short: the prefill is not what is timed
                res = generate(
                    self.model, ids, drafter=self.drafters.get(name), num_draft_tokens=D, max_new_tokens=HOST_NEW_TOKENS
                )
                return {
                    "draft_s": res.draft_s,
                    "verify_s": res.verify_s,
                    "total_s": res.total_s,
                    "forwards": res.target_forwards,
                }

            r = log.measure(f"host/{name}/{B}/{D}", lambda: self._guarded(run))
            points.append(
                {
                    "mechanism": name,
                    "batch": B,
                    "draft_len": D,
                    "rounds": r["forwards"],
                    "host_ms_per_round": max(0.0, 1e3 * (r["total_s"] - r["draft_s"] - r["verify_s"]) / r["forwards"]),
                    "round_ms": 1e3 * r["total_s"] / r["forwards"],
                    "source": "measured",
                }
            )
        self._tick("host", len(cells), len(cells))
        return points

    # ------------------------------------------------------------------ micro-curves

    def _micro(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        s, c = self.s, self.model.config
        assert s.max_draft_len is not None  # for_device filled it in
        points: list[dict] = []
        self._tick("micro", 0, 2)
        if budget.allows("attention micro-curve"):
            for ctx in s.ctx_buckets:
                points += log.measure(
                    f"micro/attention/{ctx}",
                    lambda ctx=ctx: micro.attention_curve(
                        c, self.device, self.model.dtype, ctx_tokens=ctx, draft_lens=list(range(s.max_draft_len + 1))
                    ),
                )
        if budget.allows("linear micro-curve"):
            m_values = micro.default_m_values(list(s.batch_buckets), s.max_draft_len + 1)
            points += log.measure(
                "micro/linear", lambda: micro.linear_curve(c, self.device, self.model.dtype, m_values=m_values)
            )
        self._tick("micro", 2, 2)
        return [{k: v for k, v in p.items() if k not in ("tokens", "gflop", "achieved_gflops")} for p in points]
