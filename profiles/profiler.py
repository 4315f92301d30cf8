"""`specdec-tune profile`: measure the target, its drafters and the device into `profile.json`.

Phases, most important first (a short --budget-minutes drops the tail and says so in `notes`):
  verify      T_verif(B, 1+D, ctx): adaptive in 1+D, bisecting where linear interpolation misses by > tol
  draft       T_draft(B, D) per mechanism, one propose() as it runs (serial steps / one pass / lookups)
  acceptance  per mechanism x domain x temperature at D_max; AL(D) for every D derived from the rounds
  checks      direct runs at smaller D against the derived figures (> 5% apart is flagged)
  host        loop time per round outside drafter and target, per batch bucket
  quantized   acceptance with FP8 / NVFP4 drafter weights (emulated where the device lacks the format)
  micro       attention vs G*(1+D) rows per KV head; linear layers vs M = B*(1+D)

Every measurement is appended to a log as soon as it finishes (`store.MeasurementLog`): a killed
run resumes where it stopped, and a finished profile with the same fingerprint is reused.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from pathlib import Path

import torch

from specdec_tune import SpecdecError, __version__
from specdec_tune.profiles import micro
from specdec_tune.profiles.calibration import CalibrationSet, load_calibration
from specdec_tune.profiles.drafters import Drafter, DraftRequest, create
from specdec_tune.profiles.fingerprint import device_factors, device_fingerprint, resolve_device
from specdec_tune.profiles.models.loading import LoadedModel, load_model, model_folder, weights_hash
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.records import sha256_json, write_json
from specdec_tune.profiles.schema import SCHEMA_VERSION, Profile, load_profile
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.profiles.store import MeasurementLog
from specdec_tune.profiles.timing import SpeedGuard, is_out_of_memory, time_call

FLAG_REL_DIFF = 0.05  # derived vs direct AL: flag differences above this


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    target: str = "smollm2-135m"
    drafters: tuple[str, ...] = ("ngram", "suffix", "draft_model")  # "name" or "name:key=value,key=value"
    prompts: str = "default"
    prompts_per_domain: int = 3
    new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 0.7)
    batch_buckets: tuple[int, ...] = ()  # () = 1..16 on CPU, 1..256 on a GPU (powers of two)
    ctx_buckets: tuple[int, ...] = (128, 512)
    max_draft_len: int = 15
    check_draft_lens: tuple[int, ...] = ()  # direct runs to check derived AL against; () = D_max/4 and D_max/2
    acceptance_batch: int = 8
    quant_formats: tuple[str, ...] = ("fp8", "nvfp4")
    interp_tolerance: float = 0.03  # bisect the verify curve where interpolation misses by more
    dtype: str = "auto"
    device: str = "auto"
    out_dir: Path = Path("artifacts/profile")
    budget_minutes: float = 15.0
    seed: int = 0
    force: bool = False
    trust_remote_code: bool = False

    @property
    def checks(self) -> tuple[int, ...]:
        D = self.max_draft_len
        return self.check_draft_lens or tuple(sorted({max(1, D // 4), max(1, D // 2)} - {D}))

    def validate(self) -> None:
        if self.max_draft_len < 1:
            raise SpecdecError(f"--max-draft-len {self.max_draft_len} must be at least 1", "use 1 or more (default 15)")
        for name, values in (("--batch", self.batch_buckets or (1,)), ("--ctx", self.ctx_buckets)):
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise SpecdecError(f"{name} buckets {list(values)} must be distinct increasing positive integers", f"e.g. {name} 1,2,4,8")
        if any(not 0 < d < self.max_draft_len for d in self.check_draft_lens):
            raise SpecdecError(f"check draft lengths {list(self.check_draft_lens)} must lie in 1..{self.max_draft_len - 1}", "pick smaller D than --max-draft-len")
        if self.prompts_per_domain < 1 or self.new_tokens < 2 or self.budget_minutes <= 0:
            raise SpecdecError("--prompts-per-domain, --new-tokens and --budget-minutes must be positive (new tokens ≥ 2)", "raise them")
        if any(t < 0 for t in self.temperatures):
            raise SpecdecError(f"temperatures {list(self.temperatures)} must be ≥ 0", "use 0 for greedy")


def parse_drafter_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'draft_model:layers=6,model=/x' -> ('draft_model', {'layers': '6', 'model': '/x'})."""
    name, _, rest = spec.partition(":")
    options = {}
    for pair in filter(None, rest.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SpecdecError(f"drafter option {pair!r} in {spec!r} is not KEY=VALUE", "write --drafter draft_model:layers=6")
        options[key] = value
    return name, options


class Budget:
    """Wall-clock budget; phases past the deadline are skipped and named in the profile's notes."""

    def __init__(self, minutes: float) -> None:
        self.deadline = time.monotonic() + 60 * minutes
        self.skipped: list[str] = []

    def allows(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.skipped.append(what)
        return False


# ---------------------------------------------------------------------------- verify curve


def adaptive_sample(measure, lo: int, hi: int, tolerance: float, seeds: list[int]) -> dict[int, float | None]:
    """Measure y(x) at `seeds`, then bisect each gap whose midpoint differs from the straight line by > tolerance.

    `measure(x)` returns milliseconds or None (infeasible: nothing larger is tried). Returns {x: y}.
    """
    ys: dict[int, float | None] = {}
    for x in sorted({lo, hi, *(s for s in seeds if lo <= s <= hi)}):
        ys[x] = measure(x)
        if ys[x] is None:
            return ys
    stack = [(a, b) for a, b in zip(sorted(ys), sorted(ys)[1:])]
    while stack:
        a, b = stack.pop()
        if b - a < 2:
            continue
        m = (a + b) // 2
        ys[m] = measure(m)
        if ys[m] is None:
            continue
        line = ys[a] + (ys[b] - ys[a]) * (m - a) / (b - a)
        if abs(ys[m] - line) > tolerance * ys[m]:
            stack += [(a, m), (m, b)]
    return ys


def fill_curve(measured: dict[int, float | None], xs: range) -> list[tuple[int, float | None, str]]:
    """(x, y, source) for every x: measured where measured, linear between measured neighbours, else infeasible."""
    ok = sorted(x for x, y in measured.items() if y is not None)
    out = []
    for x in xs:
        if x in measured:
            out.append((x, measured[x], "measured" if measured[x] is not None else "infeasible"))
            continue
        left = max((p for p in ok if p < x), default=None)
        right = min((p for p in ok if p > x), default=None)
        if left is None or right is None:
            out.append((x, None, "infeasible"))
        else:
            y = measured[left] + (measured[right] - measured[left]) * (x - left) / (right - left)
            out.append((x, y, "interpolated"))
    return out


def _remeasure_outliers(timings: dict[int, dict | None], measure, slack: float = 1.15) -> None:
    """Measure again, once, any point slower than a larger point by more than `slack`.

    More tokens never cost less, so such a point caught a transient (another process, a page fault);
    the second measurement replaces it.
    """
    xs = sorted(x for x, t in timings.items() if t is not None)
    for i, x in enumerate(xs[:-1]):
        later = min(timings[y]["median_ms"] for y in xs[i + 1 :])
        if timings[x]["median_ms"] > slack * later:
            measure(x)


def _time_unless_oom(fn, device: torch.device, warmup: int = 2) -> dict | None:
    """time_call's figures, or None when the call runs out of memory (recorded as infeasible)."""
    try:
        return time_call(fn, device=device, warmup=warmup, repeats=5).as_dict()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


class VerifyStep:
    """One target forward of B rows × t new tokens on a static KV cache already holding `ctx` random tokens,
    as a serving engine runs it: the verify curve's unit of measurement."""

    @torch.inference_mode()
    def __init__(self, model, batch: int, ctx: int, max_tokens: int, seed: int = 0, device: torch.device | None = None) -> None:
        self.model, self.batch = model, batch
        self.device = device or next(model.parameters()).device
        self.generator = torch.Generator().manual_seed(seed)
        self.start = torch.full((batch,), ctx, dtype=torch.long, device=self.device)
        try:
            self.cache = model.new_cache(batch, ctx + max_tokens + 1)
            prompt = torch.randint(0, model.config.vocab_size, (batch, ctx), generator=self.generator).to(self.device)
            model(prompt, self.cache, torch.zeros(batch, dtype=torch.long, device=self.device), logits="none")
            self.ready = True
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            self.ready = False  # infeasible at this batch and context

    @torch.inference_mode()
    def time(self, tokens: int) -> dict | None:
        ids = torch.randint(0, self.model.config.vocab_size, (self.batch, tokens), generator=self.generator).to(self.device)
        return _time_unless_oom(lambda: self.model(ids, self.cache, self.start), self.device)


def time_verify_step(model, batch: int, ctx: int, tokens: int, seed: int = 0) -> dict | None:
    """time_call's figures for one verify step (None when it does not fit in memory)."""
    step = VerifyStep(model, batch, ctx, tokens, seed)
    return step.time(tokens) if step.ready else None


class Profiler:
    def __init__(self, settings: ProfileSettings, progress=None) -> None:
        settings.validate()
        self.device = resolve_device(settings.device)
        if not settings.batch_buckets:
            largest = 256 if self.device.type == "cuda" else 16
            settings = dataclasses.replace(settings, batch_buckets=tuple(2**i for i in range(largest.bit_length())))
        self.s = settings
        self.progress = progress  # callable(phase: str, done: int, total: int) or None
        self.target = load_model(settings.target, dtype=settings.dtype, device=str(self.device), trust_remote_code=settings.trust_remote_code)
        self.model = self.target.model
        self.drafters: dict[str, Drafter] = {}
        for spec in settings.drafters:
            name, options = parse_drafter_spec(spec)
            if name in self.drafters:
                raise SpecdecError(f"drafter {name!r} is given twice", "profile each mechanism once")
            self.drafters[name] = create(name, self.target, options)
        self.calibration = load_calibration(settings.prompts)
        self.profile_split, _ = self.calibration.split()
        self.prompt_set = _per_domain(self.profile_split, settings.prompts_per_domain)
        self.prompt_ids = encode_prompts(self.target.tokenizer, self.prompt_set, context_tokens=self.model.config.max_position_embeddings,
                                         max_new_tokens=settings.new_tokens, max_draft_tokens=settings.max_draft_len)
        self.stop_ids = list(self.model.config.eos_token_ids)
        self.device_fp = device_fingerprint(self.device, self.model.dtype)
        self.fingerprint = sha256_json({
            "schema": SCHEMA_VERSION, "tool": __version__, "device": device_factors(self.device_fp),
            "target": dataclasses.asdict(self.target.ref), "drafters": self._drafter_infos(), "workload": self._workload(),
        })

    # ------------------------------------------------------------------ records

    def _workload(self) -> dict:
        s = self.s
        return {
            "calibration": self.calibration.name, "calibration_fingerprint": self.prompt_set.fingerprint(), "split": "profile",
            "domains": self.prompt_set.domains(), "prompts_per_domain": s.prompts_per_domain, "new_tokens": s.new_tokens,
            "temperatures": list(s.temperatures), "batch_buckets": list(s.batch_buckets), "ctx_buckets": list(s.ctx_buckets),
            "max_draft_len": s.max_draft_len, "acceptance_batch": s.acceptance_batch,
        }

    def _drafter_infos(self) -> list[dict]:
        infos = []
        for name, d in self.drafters.items():
            desc = d.describe()
            model = getattr(d, "model", None)
            ref = None
            if model is not None:
                ref = {"layers": len(model.layers), "shares_target_weights": model.embed_tokens is self.model.embed_tokens}
                if desc["options"].get("model"):  # its own checkpoint: its hash makes a bundle stale when it changes
                    ref["weights_hash"] = weights_hash(model_folder(desc["options"]["model"])[3])
            head = getattr(d, "head", None)
            if head is not None:  # a learned head over the target's hidden states (EAGLE-3, MTP, DFlash, DSpark)
                layers = len(getattr(head, "layers", None) or getattr(head, "mtp_layers", None) or [head])
                ref = {"layers": layers, "hidden_layers": list(d.hidden_layers), "shares_target_weights": head.embed_tokens is self.model.embed_tokens,
                       "weights_hash": getattr(d, "weights_hash", None)}
            infos.append({
                "name": name, "kind": desc["kind"], "options": desc["options"], "model": ref,
                "quant_formats": ["none", *self.s.quant_formats] if d.kind != "model_free" else ["none"],
                "draft_len_multiple": d.draft_len_multiple, "max_draft_len": d.max_draft_len,
            })
        return infos

    def d_max(self, drafter: Drafter) -> int:
        """The longest draft profiled for this drafter: the workload's D_max, or less where its block is shorter."""
        limit = drafter.max_draft_len
        return self.s.max_draft_len if limit is None else min(self.s.max_draft_len, limit)

    def _guarded(self, measure):
        """A timing cell measured at the device's quiet speed (SpeedGuard), re-run after a passing load."""
        return self.guard.run(measure)[0]

    # ------------------------------------------------------------------ run

    def run(self) -> Profile:
        out = self.s.out_dir / "profile.json"
        if out.exists() and not self.s.force:
            try:
                old = load_profile(out)
            except SpecdecError:
                old = None
            if old is not None and old.fingerprint == self.fingerprint:
                return old
        log = MeasurementLog(self.s.out_dir, self.fingerprint)
        budget = Budget(self.s.budget_minutes)
        probe = VerifyStep(self.model, 1, self.s.ctx_buckets[0], 1, self.s.seed, self.device)
        self.guard = SpeedGuard(probe=lambda: probe.time(1)["median_ms"])
        verify = self._verify_curve(log)
        draft = self._draft_costs(log, budget)
        acceptance = self._acceptance(log, budget)
        host = self._host(log, budget)
        micro_points = self._micro(log, budget)
        notes = [f"phase skipped for the time budget: {what}" for what in budget.skipped]
        notes += [f"derived AL differs from a direct run by more than {FLAG_REL_DIFF:.0%}: {a['mechanism']} D={c['draft_len']} "
                  f"(derived {c['derived']:.3f}, direct {c['direct']:.3f})" for a in acceptance for c in a["checks"] if c["flagged"]]
        if self.guard.repeated:
            notes.append(f"{self.guard.repeated} timing cells were measured again: the device ran more than "
                         f"{self.guard.slack - 1:.0%} below its quietest speed around them (a shared machine)")
        if self.guard.unsettled:
            notes.append(f"{self.guard.unsettled} timing cells were kept although the device never settled: their times may be inflated")
        if self.device.type == "cpu":
            load = os.getloadavg()[0]
            if load > 1.5 * os.cpu_count():
                notes.append(f"the CPU was busy while profiling (load {load:.1f} on {os.cpu_count()} cores): timings may be inflated")
        profile = Profile.model_validate({
            "schema_version": SCHEMA_VERSION, "tool_version": __version__,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": self.fingerprint, "backend": "torch", "device": self.device_fp,
            "target": dataclasses.asdict(self.target.ref),
            "timing_shapes": f"{self.target.ref.path} ({self.model.config.model_type}, {len(self.model.layers)} layers, hidden {self.model.config.hidden_size}, {self.target.ref.dtype}; real weights)",
            "drafters": self._drafter_infos(), "workload": self._workload(),
            "verify": verify, "draft": draft, "host": host, "acceptance": acceptance, "micro": micro_points, "notes": notes,
        })
        write_json(out, profile.model_dump(mode="json"))
        return profile

    def _tick(self, phase: str, done: int, total: int) -> None:
        if self.progress:
            self.progress(phase, done, total)

    # ------------------------------------------------------------------ verify

    def _verify_curve(self, log: MeasurementLog) -> list[dict]:
        s, points = self.s, []
        t_max = s.max_draft_len + 1
        seeds = [1, 2, 4, 8, 16, 32, 64]
        cells = [(ctx, B) for ctx in s.ctx_buckets for B in s.batch_buckets]
        for i, (ctx, B) in enumerate(cells):
            self._tick("verify", i, len(cells))
            measured = log.measure(f"verify/{B}/{ctx}", lambda: self._guarded(lambda: {str(t): v for t, v in self._verify_cell(B, ctx, t_max, seeds).items()}))
            timings = {int(t): v for t, v in measured.items()}
            for t, y, source in fill_curve({t: (v["median_ms"] if v else None) for t, v in timings.items()}, range(1, t_max + 1)):
                extra = timings.get(t) or {}
                points.append({"batch": B, "tokens": t, "ctx": ctx, "median_ms": y, "p10_ms": extra.get("p10_ms"),
                               "p90_ms": extra.get("p90_ms"), "repeats": extra.get("repeats", 0), "source": source})
        self._tick("verify", len(cells), len(cells))
        return points

    @torch.inference_mode()
    def _verify_cell(self, B: int, ctx: int, t_max: int, seeds: list[int]) -> dict[int, dict | None]:
        timings: dict[int, dict | None] = {}
        step = VerifyStep(self.model, B, ctx, t_max, self.s.seed, self.device)
        if not step.ready:
            return {1: None}

        def measure(t: int) -> float | None:
            timings[t] = step.time(t)
            return timings[t]["median_ms"] if timings[t] else None

        adaptive_sample(measure, 1, t_max, self.s.interp_tolerance, seeds)
        _remeasure_outliers(timings, measure)
        return timings

    # ------------------------------------------------------------------ draft cost

    def _draft_costs(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        s, points = self.s, []
        ctx = s.ctx_buckets[0]
        cells = [(name, B) for name in self.drafters for B in s.batch_buckets]
        for i, (name, B) in enumerate(cells):
            self._tick("draft", i, len(cells))
            if not budget.allows(f"draft cost {name} B={B}"):
                continue
            timings = log.measure(f"draft/{name}/{B}/{ctx}", lambda: self._guarded(lambda: {str(d): t for d, t in self._draft_cell(self.drafters[name], B, ctx).items()}))
            measured = {int(d): (t["median_ms"] if t else None) for d, t in timings.items()}
            for d, y, source in fill_curve(measured, range(1, self.d_max(self.drafters[name]) + 1)):
                t = timings.get(str(d)) or {}
                points.append({"mechanism": name, "batch": B, "draft_len": d, "ctx": ctx, "median_ms": y, "p10_ms": t.get("p10_ms"),
                               "p90_ms": t.get("p90_ms"), "repeats": t.get("repeats", 0), "source": source})
        self._tick("draft", len(cells), len(cells))
        return points

    def _context_rows(self, B: int, ctx: int) -> list[list[int]]:
        """B rows of real calibration tokens, each `ctx` long (prompts concatenated, rotated per row)."""
        flat = [t for ids in self.prompt_ids for t in ids]
        while len(flat) < ctx + B * 97:
            flat = flat + flat
        return [flat[b * 97 : b * 97 + ctx] for b in range(B)]

    @torch.inference_mode()
    def _context_states(self, drafter: Drafter, B: int, ctx: int) -> torch.Tensor | None:
        """The target's hidden states at the drafter's layers over `_context_rows` [B, ctx, W], or None when it reads none."""
        if not drafter.hidden_layers:
            return None
        rows = torch.tensor(self._context_rows(B, ctx), device=self.device)
        cache = self.model.new_cache(B, ctx)
        _, hidden = self.model.forward_capture(rows, cache, torch.zeros(B, dtype=torch.long, device=self.device),
                                               tuple(drafter.hidden_layers), logits="none")
        return hidden

    def _draft_cell(self, drafter: Drafter, B: int, ctx: int) -> dict[int, dict | None]:
        """Steady state of a fully rejected round: each call appends one token, then drafts D.

        A drafter that reads target hidden states gets them as the loop passes them: the context's (ctx - 1
        positions) with the untimed first call, then one verified position per call. Their values are the
        target's real states of the context (the timing does not depend on them; the shapes are the loop's)."""
        timings: dict[int, dict | None] = {}
        g = torch.Generator().manual_seed(self.s.seed)
        states = self._context_states(drafter, B, ctx)  # [B, ctx, W] or None

        def request(rows: list[list[int]], D: int, first: bool) -> DraftRequest:
            if states is None:
                return DraftRequest(rows, [D] * B, 0.0)
            hidden = states[:, : ctx - 1] if first else states[:, -1:]  # [B, n, W]
            return DraftRequest(rows, [D] * B, 0.0, hidden_states=hidden, num_hidden=[hidden.shape[1]] * B)

        def measure(D: int) -> float | None:
            rows = self._context_rows(B, ctx)
            drafter.start([list(r) for r in rows])
            drafter.propose(request(rows, D, first=True))  # catch up on the context, untimed

            def step():
                for r in rows:
                    r.append(int(torch.randint(0, 1000, (1,), generator=g)))
                drafter.propose(request(rows, D, first=False))

            timings[D] = _time_unless_oom(step, self.device, warmup=1)
            return timings[D]["median_ms"] if timings[D] else None

        adaptive_sample(measure, 1, self.d_max(drafter), self.s.interp_tolerance, [d for d in (1, 2, 4, 8) if d <= self.d_max(drafter)])
        return timings

    # ------------------------------------------------------------------ acceptance

    def run_counters(self, drafter: Drafter, D: int, temperature: float, log: MeasurementLog, key: str) -> list[SpecCounters]:
        """Per-prompt counters over the profiling prompts, one logged unit per batch."""
        out: list[SpecCounters] = []
        B = self.s.acceptance_batch
        for start in range(0, len(self.prompt_ids), B):
            def run_batch():
                res = generate(self.model, self.prompt_ids[start : start + B], drafter=drafter, num_draft_tokens=D,
                               max_new_tokens=self.s.new_tokens, temperature=temperature, seed=self.s.seed + start, stop_token_ids=self.stop_ids)
                return {"counters": [dataclasses.asdict(c) for c in res.per_prompt],
                        "draft_s": res.draft_s, "verify_s": res.verify_s, "total_s": res.total_s, "forwards": res.target_forwards}
            done = log.measure(f"{key}/batch{start}", run_batch)
            out += [SpecCounters(**c) for c in done["counters"]]
        return out

    def _acceptance(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        s, records = self.s, []
        units = [(name, "none", t) for t in s.temperatures for name in self.drafters]
        units += [(name, fmt, 0.0) for fmt in s.quant_formats for name, d in self.drafters.items() if d.kind != "model_free"]
        for i, (name, fmt, temp) in enumerate(units):
            self._tick("acceptance", i, len(units))
            label = f"acceptance {name} quant={fmt} T={temp}"
            if not budget.allows(label):
                continue
            drafter = self.drafters[name] if fmt == "none" else self.drafters[name].with_quantized_weights(fmt)
            key = f"acceptance/{name}/{fmt}/{temp}"
            per_prompt = self.run_counters(drafter, self.d_max(self.drafters[name]), temp, log, key)
            checks = []
            if fmt == "none" and temp == 0.0:
                for D in [D for D in s.checks if D < self.d_max(self.drafters[name])]:
                    if not budget.allows(f"AL check {name} D={D}"):
                        continue
                    direct = SpecCounters.total(self.run_counters(drafter, D, 0.0, log, f"check/{name}/{D}")).tokens_per_target_forward
                    derived = SpecCounters.total(per_prompt).derived_at(D)[0]
                    rel = (derived - direct) / direct
                    checks.append({"draft_len": D, "derived": derived, "direct": direct, "rel_diff": rel, "flagged": abs(rel) > FLAG_REL_DIFF})
            source = "measured" if fmt == "none" else "emulated"
            by_domain: dict[str, list[SpecCounters]] = {}
            for p, c in zip(self.prompt_set.prompts, per_prompt):
                by_domain.setdefault(p.domain, []).append(c)
            for domain, cs in [("all", per_prompt), *by_domain.items()]:
                records.append(self._acceptance_record(name, fmt, source, domain, temp, cs, checks if domain == "all" else []))
        self._tick("acceptance", len(units), len(units))
        return records

    def _acceptance_record(self, name, fmt, source, domain, temp, counters: list[SpecCounters], checks) -> dict:
        c = SpecCounters.total(counters)
        derived = [c.derived_at(D) for D in range(self.d_max(self.drafters[name]) + 1)]
        return {
            "mechanism": name, "quant": fmt, "quant_source": source, "domain": domain, "temperature": temp,
            "max_draft_len": self.d_max(self.drafters[name]), "prompts": len(counters), "new_tokens": self.s.new_tokens,
            "num_drafts": c.num_drafts, "num_draft_tokens": c.num_draft_tokens, "num_accepted_tokens": c.num_accepted_tokens,
            "num_accepted_tokens_per_pos": c.num_accepted_tokens_per_pos, "num_reached_per_pos": c.num_reached_per_pos,
            "num_rounds": c.num_rounds, "rounds": c.rounds, "conditional_acceptance": c.conditional_acceptance(),
            "tokens_per_forward": [d[0] for d in derived], "mean_al_vllm": [d[1] for d in derived], "checks": checks,
        }

    # ------------------------------------------------------------------ host overhead

    def _host(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        """Per batch bucket: a short real decode with each drafter; host = round - draft - verify."""
        points = []
        cells = [(name, B) for name in ("plain", *self.drafters) for B in self.s.batch_buckets]
        for i, (name, B) in enumerate(cells):
            self._tick("host", i, len(cells))
            if not budget.allows(f"host overhead {name} B={B}"):
                continue
            D = 0 if name == "plain" else min(3, self.d_max(self.drafters[name]))

            def run():
                ids = (self.prompt_ids * B)[:B]
                res = generate(self.model, ids, drafter=self.drafters.get(name), num_draft_tokens=D, max_new_tokens=16)
                return {"draft_s": res.draft_s, "verify_s": res.verify_s, "total_s": res.total_s, "forwards": res.target_forwards}

            r = log.measure(f"host/{name}/{B}", lambda: self._guarded(run))
            points.append({"mechanism": name, "batch": B, "draft_len": D, "rounds": r["forwards"],
                           "host_ms_per_round": 1e3 * (r["total_s"] - r["draft_s"] - r["verify_s"]) / r["forwards"],
                           "round_ms": 1e3 * r["total_s"] / r["forwards"], "source": "measured"})
        self._tick("host", len(cells), len(cells))
        return points

    # ------------------------------------------------------------------ micro-curves

    def _micro(self, log: MeasurementLog, budget: Budget) -> list[dict]:
        s, c = self.s, self.model.config
        points: list[dict] = []
        self._tick("micro", 0, 2)
        if budget.allows("attention micro-curve"):
            for ctx in s.ctx_buckets:
                points += log.measure(f"micro/attention/{ctx}", lambda: micro.attention_curve(
                    c, self.device, self.model.dtype, ctx_tokens=ctx, draft_lens=list(range(s.max_draft_len + 1))))
        if budget.allows("linear micro-curve"):
            m_values = micro.default_m_values(list(s.batch_buckets), s.max_draft_len + 1)
            points += log.measure("micro/linear", lambda: micro.linear_curve(c, self.device, self.model.dtype, m_values=m_values))
        self._tick("micro", 2, 2)
        return [{k: v for k, v in p.items() if k not in ("tokens", "gflop", "achieved_gflops")} for p in points]


def _per_domain(cal: CalibrationSet, n: int) -> CalibrationSet:
    """The first n prompts of each domain (in the set's order)."""
    picked, counts = [], {}
    for p in cal.prompts:
        if counts.get(p.domain, 0) < n:
            picked.append(p)
            counts[p.domain] = counts.get(p.domain, 0) + 1
    return CalibrationSet(f"{cal.name}[{n}/domain]", tuple(picked))


def summary(profile: Profile) -> dict:
    """The end-of-run facts: AL per mechanism x domain, the verify knee, the measured speedup bound per bucket."""
    D_max = profile.workload.max_draft_len
    ctx = profile.workload.ctx_buckets[0]
    verify = {(p.batch, p.tokens): p.median_ms for p in profile.verify if p.ctx == ctx}
    greedy = [a for a in profile.acceptance if a.temperature == 0.0 and a.quant == "none"]
    al = {(a.mechanism, a.domain): a.tokens_per_forward[-1] for a in greedy}  # at each drafter's longest D (a block caps it)
    bounds = {}
    for B in profile.workload.batch_buckets:
        if verify.get((B, 1)) is None:
            continue
        best = (1.0, 0, "-")
        for a in (a for a in greedy if a.domain == "all"):
            for D in range(1, a.max_draft_len + 1):
                t = verify.get((B, D + 1))
                if t:
                    bound = a.tokens_per_forward[D] * verify[(B, 1)] / t  # draft and host cost left out: an upper bound
                    best = max(best, (bound, D, a.mechanism))
        bounds[B] = best
    gemm = micro.linear_forward_curve([p.model_dump() for p in profile.micro if p.kind == "linear"], profile.target["num_layers"]) \
        if any(p.kind == "linear" for p in profile.micro) else []
    gemm_ms = {p["m"]: p["median_ms"] for p in gemm}
    gemm_share = {B: gemm_ms[B] / verify[(B, 1)] for B in profile.workload.batch_buckets if B in gemm_ms and verify.get((B, 1))}
    knees = {B: micro.knee([{"t": t, "ms": verify[(B, t)]} for t in range(1, D_max + 2) if verify.get((B, t))], "t", "ms")
             for B in profile.workload.batch_buckets}
    return {"al": al, "bounds": bounds, "knees": knees, "ctx": ctx, "gemm_share": gemm_share}
