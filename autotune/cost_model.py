"""The cost model, answered from a recorded profile (the `replay` backend).

    TPS(B, D)      = B · AL(D) / (T_verif(B, 1+D) + T_draft(B, D) + T_host(B, D))
    T_verif(B, 1+D) is the expected cost of the round's width: a batch verifies 1 + the longest proposal
    among its rows, and model-free drafters often propose fewer than D tokens. With P(L) the share of
    rounds that proposed L tokens at D_max (the profile's round histogram), a row's width is min(L, D) and
        E[T_verif] = Σ_w (F(w)^B − F(w−1)^B) · T_verif(B, 1+w),   F(w) = P(min(L, D) ≤ w),
    rows taken as independent. A drafter that always proposes D reduces to T_verif(B, 1+D).
    per-user rate  = TPS(B, D) / B
    speedup        = TPS(B, D) / TPS(B, 0),   TPS(B, 0) = B / (T_verif(B, 1) + T_host(B, 0))

AL(D) here is tokens emitted per target forward over all rounds (`tokens_per_forward` in the
profile), never vLLM's mean acceptance length.

A profile measured in the serving engine (backend "vllm") times whole rounds instead: T_round(B, D) is one engine
step with B requests decoding at draft length D (draft, verify and the engine's host work together, on real text, so
the spread of proposal lengths is in it), and T_round(B, 0) the engine's step without speculation. Then
    TPS(B, D) = B · AL(D) / T_round(B, D)
with T_round linear in B between batch buckets and in D between the draft lengths measured (interpolated), and the
verify, draft and host parts of the prediction left empty (None): the engine does not time them apart. A lookup
drafter proposes in some rounds only, and the timing prompts need not propose as often as the workload: each timed
cell carries its draft tokens per row k and the slope of a step's ms on k, and is moved to the workload's own k
(Σ_L L · P(L), the round histogram below) before it is interpolated.

Intervals (95%). A figure may carry [low, high]: AL(D) the profile's bootstrap over prompts, T_verif and
T_draft the interval of the cell's median (an interpolated cell interpolates its bounds; an extrapolated,
modeled one has none; a fitted cell's interval is stretched to hold its fitted value). Host time has none.
A prediction combines them conservatively, every input at the end that hurts or helps at once:
    TPS_low  = B · AL_low  / (T_verif_high + T_draft_high + T_host)
    TPS_high = B · AL_high / (T_verif_low  + T_draft_low  + T_host)
where E[T_verif]'s bounds are the expectation above over the cells' bounds. An input without an interval
enters at its value; a prediction none of whose inputs has one (a version-1 profile) has none.
    speedup_low, speedup_high = TPS_low / TPS(B, 0), TPS_high / TPS(B, 0)   (the baseline at its value)
The baseline is the one reference every D at a batch is divided by: its own spread moves all of them
together and cannot change which D wins, so it is left out of the speedup's interval (TPS(B, 0) keeps it).

Deciding under uncertainty (`draws`). A decision between two draft lengths at one batch is a question about how
likely each is to be faster, not about the two figures' intervals apart. The model is drawn `DRAWS` times, each draw
the whole profile at once:
    timing      every timed cell (a verify step, a draft point, an engine round) moved by one draw of its own error,
                value · exp(z · σ), z ~ N(0, 1), σ the log distance of its 95% interval's bound from its value / 1.96
                (the upper bound's for z > 0, the lower's for z < 0); every prediction of the draw reads the same
                moved cells, so two draft lengths whose rounds verify some of the same widths, and the baseline they
                are both divided by, move together as they do on the device; each batch's verify cells are then
                fitted non-decreasing in the tokens verified (`_increasing_in_tokens`), as a device's steps are
    acceptance  one paired bootstrap resample of the prompts (the "all" record's per-prompt counts, or the mix of
                domains), every D on the same prompts, widened about the resamples' median for the prompts' count
                (`intervals.widening`); a record without per-prompt counts moves every D by one z of its interval
Each draw is this model on those inputs (`CostModel.drawn`), so the formula is the same one as the point prediction's.
The search takes at each bucket the D with the highest expected speedup (the mean over the draws), and a shorter
draft over it only where its expected loss is below the stated tolerance; the plan records the expected gain over the
runner-up and the share of draws in which the choice beats it. The 95% interval of TPS(D) / TPS(D') is the draws'
2.5 and 97.5 percentiles of the ratio (`ratio`): the cells the two share cancel in it, where adding the two rounds'
intervals as independent errors would count them twice.

A mix of domains (`mix`, shares w_d of the requests, Σ w_d = 1). Let every request generate N tokens. A
request of domain d takes N / AL_d(D) rounds, so the mix emits N·Σ w_d tokens over N·Σ w_d / AL_d(D)
rounds of one row, and
    AL_mix(D) = 1 / Σ_d (w_d / AL_d(D))          (the weighted harmonic mean)
A row spends its rounds in domain d in proportion to w_d / AL_d(D): the round histogram P(L) of the mix is
each domain's normalised histogram weighted by that share. AL_mix's interval takes every domain at its low
bound (then every one at its high bound) at once: conservative, since the domains' prompts vary apart.

Every figure carries its source; a result is as weak as its weakest input, weakest last:
    measured < interpolated < fitted < emulated < modeled   (< infeasible: out of memory when profiled, or beyond the
                                                             memory model's budget: autotune/memory.py)
  measured      timed or counted here (acceptance: every D of a replay, D_max of a loop run)
  interpolated  linear between measured points
  fitted        a verify cell the monotone fit moved beyond its interval
  emulated      acceptance with fake-quantized (FP8 / NVFP4) drafter weights
  modeled       derived (AL below D_max from a loop run's rounds), extrapolated, or from the hardware table
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import math

import numpy as np

from specdec_tune import SpecdecError
from specdec_tune.autotune.memory import DEFAULT_FRACTION, MemoryModel, Need
from specdec_tune.profiles import intervals
from specdec_tune.profiles.schema import AcceptanceRecord, Profile, RoundPoint, Timed

SOURCES = ("measured", "interpolated", "fitted", "emulated", "modeled", "infeasible")  # weakest last
_RANK = {s: i for i, s in enumerate(SOURCES)}


@dataclasses.dataclass(frozen=True)
class Figure:
    value: float
    source: str  # one of SOURCES
    low: float | None = None  # 95% interval, where the inputs have one
    high: float | None = None

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    def bounds(self) -> tuple[float, float]:
        """(low, high), or (value, value) where there is no interval."""
        return (self.low, self.high) if self.has_interval else (self.value, self.value)  # type: ignore[return-value]


def bounded(value: float, source: str, low: float | None, high: float | None) -> Figure:
    """A figure whose interval, where it has one, holds its value."""
    if low is None or high is None:
        return Figure(value, source)
    return Figure(value, source, min(low, high, value), max(low, high, value))


def weakest(*sources: str) -> str:
    return max(sources, key=_RANK.__getitem__)


@dataclasses.dataclass(frozen=True)
class Prediction:
    batch: int
    draft_len: int
    mechanism: str
    quant: str
    tokens_per_s: Figure
    per_user_tokens_per_s: Figure
    speedup: Figure
    tokens_per_forward: Figure
    round_ms: Figure  # the whole round: verify + draft + host, or the engine's step
    verify_ms: Figure | None  # None where the engine timed whole rounds
    draft_ms: Figure | None
    host_ms: Figure | None


def _timed(p: Timed) -> Figure:
    return bounded(p.median_ms, p.source, p.ci_low_ms, p.ci_high_ms)  # type: ignore[arg-type]


def _on_line(a: Figure, b: Figure, t: float, source: str, with_bounds: bool) -> Figure:
    """a + t·(b − a), floored at 0; the bounds follow the same line where both ends have them and `with_bounds`."""
    value = max(a.value + (b.value - a.value) * t, 0.0)
    if not (with_bounds and a.has_interval and b.has_interval):
        return Figure(value, source)
    low = max(a.low + (b.low - a.low) * t, 0.0)  # type: ignore[operator]
    high = max(a.high + (b.high - a.high) * t, 0.0)  # type: ignore[operator]
    return bounded(value, source, low, high)


def _interp_in_batch(points: dict[int, Figure], batch: int) -> Figure:
    """Linear in B between measured buckets (interpolated, bounds too); beyond them, linear extrapolation (modeled, no
    interval)."""
    if batch in points:
        return points[batch]
    xs = sorted(points)
    if not xs:
        raise SpecdecError("the profile has no timing for this setting", "re-run `specdec-tune profile` with it")
    i = bisect.bisect_left(xs, batch)
    if i == 0:
        lo, hi, source = xs[0], xs[min(1, len(xs) - 1)], "modeled"
    elif i == len(xs):
        lo, hi, source = xs[max(len(xs) - 2, 0)], xs[-1], "modeled"
    else:
        lo, hi, source = xs[i - 1], xs[i], "interpolated"
    if lo == hi:
        return Figure(points[lo].value, "modeled")
    return _on_line(
        points[lo],
        points[hi],
        (batch - lo) / (hi - lo),
        weakest(source, points[lo].source, points[hi].source),
        with_bounds=source == "interpolated",
    )


def _interp_in_draft_len(points: dict[int, Figure], draft_len: int) -> Figure:
    """Linear in D between measured draft lengths (interpolated); beyond them, the nearest one (modeled)."""
    if draft_len in points:
        return points[draft_len]
    lens = sorted(points)
    below, above = [d for d in lens if d < draft_len], [d for d in lens if d > draft_len]
    if below and above:
        lo, hi = below[-1], above[0]
        return _on_line(
            points[lo],
            points[hi],
            (draft_len - lo) / (hi - lo),
            weakest("interpolated", points[lo].source, points[hi].source),
            with_bounds=True,
        )
    nearest = below[-1] if below else above[0]
    return Figure(points[nearest].value, weakest("modeled", points[nearest].source))


# ---------------------------------------------------------------------------------------------- acceptance


def acceptance_source(record: AcceptanceRecord, draft_len: int) -> str:
    """A replay counts every D exactly (measured); a loop run measures D_max and derives smaller D from its
    rounds (modeled, whether or not a direct check ran: the derived value is what is returned)."""
    exact = draft_len in (0, record.max_draft_len) or record.method == "replay"
    return weakest("measured" if exact else "modeled", record.quant_source)


def _record_tokens_per_forward(record: AcceptanceRecord, draft_len: int) -> Figure:
    ci = record.tokens_per_forward_ci[draft_len] if draft_len < len(record.tokens_per_forward_ci) else None
    low, high = (ci[0], ci[1]) if ci and len(ci) == 2 else (None, None)
    return bounded(record.tokens_per_forward[draft_len], acceptance_source(record, draft_len), low, high)


def _round_shares(record: AcceptanceRecord, max_draft_len: int, draft_len: int) -> list[float]:
    """P(L), L = 0..max_draft_len: the share of rounds at draft length D that proposed L tokens.

    The record keeps the rounds of D_max (all L = D_max where it kept none). At a shorter D a proposal of L
    tokens is one of min(L, D), and the share q of rounds that propose at all is D's own: a round with a draft
    emits vLLM's mean AL on average and one without emits one token, so tokens per forward = 1 + q (AL - 1) and
    q = (tpf(D) - 1) / (AL(D) - 1), both measured at D. (D_max's share would understate it: there a draft emits
    more, so the rounds that draft are fewer against the rounds that find nothing to propose.)
    """
    counts = [float(sum(row)) for row in record.rounds[: max_draft_len + 1]]
    total = sum(counts)
    if not total:
        return [0.0] * max_draft_len + [1.0]
    counts += [0.0] * (max_draft_len + 1 - len(counts))
    shares = [0.0] * (max_draft_len + 1)
    for L, c in enumerate(counts):
        shares[min(L, draft_len)] += c / total
    tpf, al = record.tokens_per_forward[draft_len], record.mean_al_vllm[draft_len]
    if draft_len < record.max_draft_len and al > 1 + 1e-9 and shares[0] < 1:
        q = min(1.0, max(0.0, (tpf - 1) / (al - 1)))
        shares = [1 - q] + [q * p / (1 - shares[0]) for p in shares[1:]]
    return shares


DRAWS = 200  # draws of the profile a decision averages over (module docstring, "Deciding")


def drawn_value(f: Figure, z: float) -> float:
    """A figure's value at one draw of its error: value · exp(z · σ), σ the log distance of the interval's bound on z's
    side / 1.96; the value itself where the figure has no interval (or cannot run)."""
    if not f.has_interval or not 0 < f.value < math.inf:
        return f.value
    low, high = f.bounds()
    bound = high if z > 0 else low
    if bound <= 0:
        return f.value
    return f.value * math.exp(z * abs(math.log(bound / f.value)) / intervals.Z95)


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """One drafter's acceptance over a workload: one profiled record, or a mix of domains (module docstring)."""

    parts: tuple[tuple[float, AcceptanceRecord], ...]  # (w_d, the domain's record); the w_d sum to 1
    # [R, D_max + 1] tokens per forward of R bootstrap resamples of the workload's prompts, every D on the same prompts
    # (`intervals.draws`); None where the profile kept no per-prompt counts
    paired_draws: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    paired_widening: float = 1.0  # `intervals.widening` for the prompts the draws resample
    drawn: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)  # [D_max + 1] at one draw

    def at_draw(self, index: int, z: float) -> Acceptance:
        """This acceptance at one draw (module docstring, "Deciding"): the `index`-th paired resample widened about the
        resamples' median, or, without per-prompt counts, every D moved by `z` of its interval."""
        n = self.max_draft_len
        if self.paired_draws is not None:
            rows = self.paired_draws[:, : n + 1]
            center = np.median(rows, axis=0)
            widen = self.paired_widening if math.isfinite(self.paired_widening) else 1.0
            row = np.maximum(center + widen * (rows[index % len(rows)] - center), 1.0)
        else:
            row = np.array([drawn_value(self.tokens_per_forward(D), z) for D in range(n + 1)])
        return dataclasses.replace(self, drawn=row)

    @property
    def max_draft_len(self) -> int:
        return min(r.max_draft_len for _, r in self.parts)

    def tokens_per_forward(self, draft_len: int) -> Figure:
        figures = [(w, _record_tokens_per_forward(r, draft_len)) for w, r in self.parts]
        if self.drawn is not None:
            return Figure(float(self.drawn[draft_len]), weakest(*(f.source for _, f in figures)))
        if len(figures) == 1:
            return figures[0][1]
        value = 1.0 / sum(w / f.value for w, f in figures)
        source = weakest(*(f.source for _, f in figures))
        if not all(f.has_interval for _, f in figures):
            return Figure(value, source)
        return bounded(
            value,
            source,
            1.0 / sum(w / f.bounds()[0] for w, f in figures),
            1.0 / sum(w / f.bounds()[1] for w, f in figures),
        )

    def round_shares(self, draft_len: int) -> list[float] | None:
        """P(L) of the workload's rounds at draft length D, L = 0..D_max (`_round_shares`; None where no record kept its
        rounds: every round drafts D)."""
        if not any(r.rounds for _, r in self.parts):
            return None
        n = self.max_draft_len
        rounds = [
            w / _record_tokens_per_forward(r, draft_len).value for w, r in self.parts
        ]  # a row's rounds in domain d ∝ w_d / AL_d
        total = sum(rounds)
        mixed = [0.0] * (n + 1)
        for (_, r), share in zip(self.parts, rounds):
            for L, p in enumerate(_round_shares(r, n, draft_len)):
                mixed[L] += share / total * p
        return mixed


def normalise_mix(profile: Profile, mix: dict[str, float]) -> dict[str, float]:
    """Domain shares of the requests, checked against the profile's domains and scaled to sum to 1."""
    known = list(profile.workload.domains)
    unknown = [d for d in mix if d not in known]
    if unknown:
        raise SpecdecError(
            f"--mix names {', '.join(repr(d) for d in unknown)}, which the profile has no acceptance for",
            f"use the profile's domains: {', '.join(known)}",
        )
    bad = [d for d, w in mix.items() if not (w > 0 and math.isfinite(w))]
    if bad or not mix:
        raise SpecdecError(
            f"--mix weights must be positive numbers ({', '.join(bad) or 'none given'})",
            "write it like --mix writing=0.5,coding=0.5",
        )
    total = sum(mix.values())
    return {d: w / total for d, w in mix.items()}


PAIRED_RESAMPLES = 1000


def _paired_draws(record: AcceptanceRecord | None, shares: dict[str, float]) -> dict:
    """`Acceptance.paired_draws` and `paired_widening` from the "all" record's per-prompt counts, for a domain, a mix or
    "all" (every domain weighted equally, as the record's own figures are); none where the record kept none."""
    sums = record.per_prompt if record is not None else None
    if sums is None:
        return {}
    weights = dict.fromkeys(sums.domains, 1.0) if set(shares) == {"all"} else shares
    if not any(d in weights for d in sums.domains):
        return {}
    tables = {k: np.asarray(getattr(sums, k), dtype=float) for k in ("emitted", "rounds", "accepted", "drafts")}
    return {
        "paired_draws": intervals.draws(tables, sums.domains, weights, resamples=PAIRED_RESAMPLES)[0],
        "paired_widening": intervals.widening(sums.domains, weights),
    }


# ---------------------------------------------------------------------------------------------- the model


class CostModel:
    """Predictions for (B, D, mechanism, quant) at one context bucket, temperature and workload (a domain or a mix)."""

    def __init__(
        self,
        profile: Profile,
        *,
        ctx: int | None = None,
        temperature: float = 0.0,
        domain: str = "all",
        mix: dict[str, float] | None = None,
        memory_fraction: float = DEFAULT_FRACTION,
        tensor_parallel: int | None = None,
    ) -> None:
        self.profile = profile
        tp = tensor_parallel or int(profile.engine.get("options", {}).get("tensor_parallel_size", 1))
        self.memory = (
            MemoryModel(profile.memory, fraction=memory_fraction, tensor_parallel=tp) if profile.memory else None
        )
        self._predictions: dict[tuple[int, int, str, str], Prediction] = {}
        self._ratios: dict[tuple[int, int, int, str, str], Figure | None] = {}
        self._draws: Draws | None = None
        self.ctx = ctx if ctx is not None else profile.workload.ctx_buckets[0]
        if self.ctx not in profile.workload.ctx_buckets:
            raise SpecdecError(
                f"context {self.ctx} is not a profiled bucket", f"use one of {profile.workload.ctx_buckets}"
            )
        self.max_draft_len = profile.workload.max_draft_len
        self._verify: dict[int, dict[int, Figure]] = {}  # tokens -> batch -> ms
        self._verify_tokens: set[int] = set()
        self._verify_infeasible: set[tuple[int, int]] = set()  # (batch, tokens) out of memory when profiled
        self._fit_moved: dict[tuple[int, int], tuple[float, float]] = {}  # (batch, tokens) -> (raw, fitted) ms
        for p in profile.verify:
            if p.ctx != self.ctx:
                continue
            self._verify_tokens.add(p.tokens)
            if p.median_ms is None:
                self._verify_infeasible.add((p.batch, p.tokens))
                continue
            self._verify.setdefault(p.tokens, {})[p.batch] = _timed(p)
            if p.fit_moved and p.raw_median_ms is not None:
                self._fit_moved[(p.batch, p.tokens)] = (p.raw_median_ms, p.median_ms)
        self._draft: dict[tuple[str, str, int], dict[int, Figure]] = {}  # (mechanism, quant, D) -> batch -> ms
        self._draft_infeasible: set[tuple[str, str, int, int]] = set()
        for dp in profile.draft:
            if dp.median_ms is None:
                self._draft_infeasible.add((dp.mechanism, dp.quant, dp.draft_len, dp.batch))
            else:
                self._draft.setdefault((dp.mechanism, dp.quant, dp.draft_len), {})[dp.batch] = _timed(dp)
        self._host: dict[str, dict[int, dict[int, Figure]]] = {}  # mechanism -> D -> batch -> ms per round
        for h in profile.host:
            self._host.setdefault(h.mechanism, {}).setdefault(h.draft_len, {})[h.batch] = Figure(
                h.host_ms_per_round, h.source
            )
        self._rounds: dict[
            tuple[str, str], dict[int, dict[int, RoundPoint]]
        ] = {}  # (mechanism, quant) -> D -> batch -> point
        self._rounds_infeasible: set[tuple[str, str, int, int]] = set()
        for r in profile.rounds:
            if r.ctx != self.ctx:
                continue
            if r.median_ms is None:
                self._rounds_infeasible.add((r.mechanism, r.quant, r.draft_len, r.batch))
            else:
                self._rounds.setdefault((r.mechanism, r.quant), {}).setdefault(r.draft_len, {})[r.batch] = r
        self.engine_rounds = bool(profile.rounds)  # the profile times whole engine rounds (module docstring)
        self.mix = normalise_mix(profile, mix) if mix else None
        self._al = self._acceptance(temperature, domain)
        if not self._al:
            what = f"every domain of the mix {', '.join(self.mix)}" if self.mix else f"domain {domain!r}"
            raise SpecdecError(
                f"the profile has no acceptance for {what} at temperature {temperature}",
                "profile that domain and temperature, or pick one it has",
            )

    def _acceptance(self, temperature: float, domain: str) -> dict[tuple[str, str], Acceptance]:
        records = {(a.mechanism, a.quant, a.domain): a for a in self.profile.acceptance if a.temperature == temperature}
        pairs = sorted({(m, q) for m, q, _ in records})
        shares = self.mix or {domain: 1.0}
        return {
            (m, q): Acceptance(
                tuple((w, records[(m, q, d)]) for d, w in shares.items()),
                **_paired_draws(records.get((m, q, "all")), shares),
            )
            for m, q in pairs
            if all((m, q, d) in records for d in shares)
        }

    @property
    def mechanisms(self) -> list[str]:
        return sorted({m for m, _ in self._al})

    def quants(self, mechanism: str) -> list[str]:
        return sorted(q for m, q in self._al if m == mechanism)

    def draft_len_limit(self, mechanism: str) -> int:
        """The longest D measured for this mechanism (a block drafter's block can cap it below the workload's D_max)."""
        lens = [a.max_draft_len for (m, _), a in self._al.items() if m == mechanism]
        return min(lens) if lens else self.max_draft_len

    # ------------------------------------------------------------------ draws of the profile's uncertainty

    @property
    def draws(self) -> Draws:
        """`DRAWS` draws of this model (module docstring, "Deciding"), made once and seeded: the same profile gives
        the same draws."""
        if self._draws is None:
            self._draws = Draws(self, DRAWS)
        return self._draws

    def drawn(self, index: int, rng: np.random.Generator) -> CostModel:
        """This model at one draw: every timed cell moved by one draw of its error, acceptance at the `index`-th paired
        resample (module docstring, "Deciding"). Its figures carry no intervals."""
        other = copy.copy(self)
        other._predictions, other._ratios, other._draws = {}, {}, None

        def moved(f: Figure) -> Figure:
            return Figure(drawn_value(f, float(rng.standard_normal())), f.source)

        other._verify = _increasing_in_tokens(
            {t: {B: moved(f) for B, f in by_batch.items()} for t, by_batch in self._verify.items()}, self._verify
        )
        other._draft = {key: {B: moved(f) for B, f in by_batch.items()} for key, by_batch in self._draft.items()}
        other._rounds = {
            key: {
                D: {
                    B: r.model_copy(update={"median_ms": moved(_timed(r)).value, "ci_low_ms": None, "ci_high_ms": None})
                    for B, r in by_batch.items()
                }
                for D, by_batch in by_len.items()
            }
            for key, by_len in self._rounds.items()
        }
        other._al = {key: a.at_draw(index, float(rng.standard_normal())) for key, a in self._al.items()}
        return other

    # ------------------------------------------------------------------ components

    def memory_need(self, batch: int, draft_len: int, mechanism: str = "none", quant: str = "none") -> Need | None:
        """What (B, D) holds in device memory at this context (autotune/memory.py); None for a profile without a
        record."""
        return self.memory.need(batch, self.ctx, draft_len, mechanism, quant) if self.memory else None

    def unplannable(self, batch: int) -> str | None:
        """Why batch `batch` cannot be served at this context (it does not fit in memory even without speculation, its
        one-token verify step ran out of memory or was never timed), or None where it can."""
        need = self.memory_need(batch, 0)
        if need is not None and not need.fits:
            return (
                f"batch {batch} at ctx {self.ctx} does not fit even without speculation: {need.text()} "
                "(lower the batch buckets or the context, or raise --memory-fraction)"
            )
        if self.engine_rounds:
            if ("none", "none", 0, batch) in self._rounds_infeasible:
                return f"batch {batch}: the engine's step without speculation failed at ctx {self.ctx} when profiled"
            return (
                None
                if batch in self._rounds.get(("none", "none"), {}).get(0, {})
                else f"batch {batch}: the profile has no engine step without speculation at ctx {self.ctx}"
            )
        if (batch, 1) in self._verify_infeasible:
            return f"batch {batch}: the one-token verify step at ctx {self.ctx} ran out of memory when profiled"
        if batch not in self._verify.get(1, {}):
            return f"batch {batch}: the profile has no one-token verify step at ctx {self.ctx}"
        return None

    def verify_ms(self, batch: int, tokens: int) -> Figure:
        if tokens not in self._verify_tokens:
            raise SpecdecError(f"1+D = {tokens} is beyond the profiled draft lengths", f"keep D ≤ {self.max_draft_len}")
        if (batch, tokens) in self._verify_infeasible:
            return Figure(math.inf, "infeasible")
        return _interp_in_batch(self._verify.get(tokens, {}), batch)

    def fit_moved(self, batch: int, tokens: int) -> tuple[float, float] | None:
        """(raw, fitted) ms of a verify cell the monotone fit moved beyond its interval; None for any other cell."""
        return self._fit_moved.get((batch, tokens))

    def draft_ms(self, mechanism: str, quant: str, batch: int, draft_len: int) -> Figure:
        if draft_len == 0:
            return Figure(0.0, "measured")
        if (mechanism, quant, draft_len, batch) in self._draft_infeasible:
            return Figure(math.inf, "infeasible")
        timed = self._draft.get((mechanism, quant, draft_len))
        if timed is None and quant != "none" and (mechanism, "none", draft_len) in self._draft:
            # Not run in this format here: the full-precision time stands in, labelled as a model
            # (the hardware table refines it for devices that run the format natively).
            base = _interp_in_batch(self._draft[(mechanism, "none", draft_len)], batch)
            return Figure(base.value, "modeled")
        if timed is None:
            raise SpecdecError(
                f"the profile has no draft time for {mechanism} (quant {quant}) at D={draft_len}",
                "re-run `specdec-tune profile` with that drafter",
            )
        return _interp_in_batch(timed, batch)

    def host_ms(self, mechanism: str, batch: int, draft_len: int) -> Figure:
        """Host time per round: at a measured D as measured (in B: interpolated between buckets), linear between
        measured D (interpolated), the nearest measured D beyond them (modeled). A mechanism without host points
        takes plain decoding's (modeled)."""
        by_len = self._host.get(mechanism)
        stand_in = not by_len
        by_len = by_len or self._host.get("plain")
        if not by_len:
            return Figure(0.0, "modeled")
        at = _interp_in_draft_len({D: _interp_in_batch(points, batch) for D, points in by_len.items()}, draft_len)
        return Figure(at.value, "modeled") if stand_in else at

    def engine_round_ms(self, mechanism: str, quant: str, batch: int, draft_len: int) -> Figure:
        """T_round(B, D) from the engine's timed rounds: linear in B between buckets, in D between measured lengths."""
        if draft_len == 0:
            mechanism, quant = "none", "none"
        if (mechanism, quant, draft_len, batch) in self._rounds_infeasible:
            return Figure(math.inf, "infeasible")
        by_len = self._rounds.get((mechanism, quant))
        if not by_len:
            raise SpecdecError(
                f"the profile has no engine rounds for {mechanism} with {quant} weights",
                "re-run `specdec-tune profile --engine vllm` with that drafter",
            )
        return _interp_in_draft_len(
            {
                D: _interp_in_batch(
                    {B: self._at_workload_drafting(r, mechanism, quant) for B, r in points.items()}, batch
                )
                for D, points in by_len.items()
            },
            draft_len,
        )

    def _at_workload_drafting(self, r: RoundPoint, mechanism: str, quant: str) -> Figure:
        """A timed round moved to this workload's drafting rate: T + slope · (k_workload − k_timed), k the draft tokens
        per row-round (the workload's: Σ_L L · P(L) at D from the acceptance records' round histogram). A round that
        always drafts D, or one timed without a slope, stays as measured."""
        timed = _timed(r)
        if not (
            r.draft_len
            and r.ms_per_draft_token
            and r.draft_tokens_per_row is not None
            and (mechanism, quant) in self._al
        ):
            return timed
        shares = self._al[(mechanism, quant)].round_shares(r.draft_len)
        k_workload = sum(L * p for L, p in enumerate(shares)) if shares else float(r.draft_len)
        shift = r.ms_per_draft_token * (k_workload - r.draft_tokens_per_row)
        if not timed.has_interval:
            return Figure(timed.value + shift, timed.source)
        low, high = timed.bounds()
        return bounded(timed.value + shift, timed.source, low + shift, high + shift)

    def round_verify_ms(self, mechanism: str, quant: str, batch: int, draft_len: int) -> Figure:
        """Expected verify time of a round at draft length D: the batch verifies its longest proposal."""
        acceptance = self._al.get((mechanism, quant))
        share = acceptance.round_shares(draft_len) if acceptance else None
        if share is None or share[draft_len] >= 1 - 1e-12:  # always the full draft: no spread to model
            return self.verify_ms(batch, 1 + draft_len)
        cdf = [sum(share[: min(w, len(share) - 1) + 1]) if w < draft_len else 1.0 for w in range(draft_len + 1)]
        value = low = high = previous = 0.0
        sources, bounds = [], False
        for w in range(draft_len + 1):
            p_max = cdf[w] ** batch - previous
            previous = cdf[w] ** batch
            if p_max > 1e-12:
                t = self.verify_ms(batch, 1 + w)
                t_low, t_high = t.bounds()
                value, low, high = value + p_max * t.value, low + p_max * t_low, high + p_max * t_high
                sources.append(t.source)
                bounds = bounds or t.has_interval
        source = weakest("modeled", *sources)
        return bounded(value, source, low, high) if bounds else Figure(value, source)

    def acceptance(self, mechanism: str, quant: str) -> Acceptance:
        record = self._al.get((mechanism, quant))
        if record is None:
            raise SpecdecError(
                f"the profile has no acceptance for {mechanism} with {quant} weights",
                f"profiled: {', '.join(f'{m}/{q}' for m, q in sorted(self._al))}",
            )
        return record

    def tokens_per_forward(self, mechanism: str, quant: str, draft_len: int) -> Figure:
        return self.acceptance(mechanism, quant).tokens_per_forward(draft_len)

    # ------------------------------------------------------------------ the formula

    def baseline_tokens_per_s(self, batch: int) -> Figure:
        if self.engine_rounds:
            step = self.engine_round_ms("none", "none", batch, 0)
            if math.isinf(step.value):
                raise SpecdecError(
                    f"batch {batch} failed in the engine when profiled (ctx {self.ctx})",
                    "plan only the batch buckets the profile could run",
                )
            return _tokens_per_s(batch, Figure(1.0, "measured"), step, step.source)
        verify, host = self.verify_ms(batch, 1), self.host_ms("plain", batch, 0)
        if math.isinf(verify.value):
            raise SpecdecError(
                f"batch {batch} ran out of memory when profiled (ctx {self.ctx})",
                "plan only the batch buckets the profile could run",
            )
        v_low, v_high = verify.bounds()
        source = weakest(verify.source, host.source)
        value = 1e3 * batch / (verify.value + host.value)
        return (
            bounded(value, source, 1e3 * batch / (v_high + host.value), 1e3 * batch / (v_low + host.value))
            if verify.has_interval
            else Figure(value, source)
        )

    def predict(self, batch: int, draft_len: int, mechanism: str, quant: str = "none") -> Prediction:
        """The figures of one operating point (remembered: the search asks for each many times)."""
        key = (batch, draft_len, mechanism, quant)
        if key not in self._predictions:
            self._predictions[key] = self._predict(batch, draft_len, mechanism, quant)
        return self._predictions[key]

    def _predict(self, batch: int, draft_len: int, mechanism: str, quant: str) -> Prediction:
        D = draft_len
        if D == 0:  # no speculation: the mechanism and its weights play no part
            mechanism, quant = "none", "none"
        tpf = self.tokens_per_forward(mechanism, quant, D) if D else Figure(1.0, "measured")
        if self.engine_rounds:
            verify = draft = host = None
            round_ = self.engine_round_ms(mechanism, quant, batch, D)
            source = weakest(tpf.source, round_.source)
        else:
            verify = self.round_verify_ms(mechanism, quant, batch, D) if D else self.verify_ms(batch, 1)
            draft = self.draft_ms(mechanism, quant, batch, D)
            host = self.host_ms(mechanism if D else "plain", batch, D)
            source = weakest(tpf.source, verify.source, draft.source, host.source)
            round_ = _sum(verify, draft, host)
        need = self.memory_need(batch, D, mechanism, quant) if D else None
        if need is not None and not need.fits:  # beyond the memory budget: it cannot run, whatever it would cost
            round_, source = Figure(math.inf, "infeasible"), "infeasible"
        tps = _tokens_per_s(batch, tpf, round_, source)
        base = self.baseline_tokens_per_s(batch)
        return Prediction(
            batch=batch,
            draft_len=D,
            mechanism=mechanism,
            quant=quant,
            tokens_per_s=tps,
            per_user_tokens_per_s=_scaled(tps, 1 / batch, tps.source),
            speedup=_scaled(tps, 1 / base.value, weakest(source, base.source)),
            tokens_per_forward=tpf,
            round_ms=round_,
            verify_ms=verify,
            draft_ms=draft,
            host_ms=host,
        )

    def best(self, batch: int, *, quant: str = "none") -> Prediction:
        """Exhaustive optimum over mechanism and D at one batch size (D = 0 means no speculation)."""
        candidates = [self.predict(batch, 0, "none")]
        candidates += [
            self.predict(batch, D, m, quant)
            for m in self.mechanisms
            if quant in self.quants(m)
            for D in range(1, self.draft_len_limit(m) + 1)
        ]
        return max(candidates, key=lambda p: (p.tokens_per_s.value, -p.draft_len))

    def ratio(self, batch: int, draft_len: int, other: int, mechanism: str, quant: str = "none") -> Figure | None:
        """TPS(B, D) / TPS(B, D') and the 95% interval of that ratio itself (module docstring, "Two draft lengths");
        None where the profile kept no per-prompt acceptance counts or either point cannot run. Remembered, as
        `predict`."""
        key = (batch, draft_len, other, mechanism, quant)
        if key not in self._ratios:
            self._ratios[key] = self._ratio(batch, draft_len, other, mechanism, quant)
        return self._ratios[key]

    def _ratio(self, batch: int, draft_len: int, other: int, mechanism: str, quant: str) -> Figure | None:
        a, b = self.predict(batch, draft_len, mechanism, quant), self.predict(batch, other, mechanism, quant)
        if min(a.tokens_per_s.value, b.tokens_per_s.value) <= 0:
            return None
        if draft_len == other:
            return Figure(1.0, a.tokens_per_s.source, 1.0, 1.0)
        value = a.tokens_per_s.value / b.tokens_per_s.value
        if not (a.tokens_per_s.has_interval or b.tokens_per_s.has_interval):
            return Figure(value, weakest(a.tokens_per_s.source, b.tokens_per_s.source))
        ratios = self.draws.tokens_per_s(batch, draft_len, mechanism, quant) / self.draws.tokens_per_s(
            batch, other, mechanism, quant
        )
        low, high = np.percentile(ratios, [2.5, 97.5])
        return bounded(value, weakest(a.tokens_per_s.source, b.tokens_per_s.source), float(low), float(high))


class Draws:
    """`n` draws of a cost model (module docstring, "Deciding"), and each operating point's figures over them."""

    def __init__(self, cost: CostModel, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.models = [cost.drawn(i, rng) for i in range(n)]
        self._figures: dict[tuple[str, int, int, str, str], np.ndarray] = {}

    def _figure(self, name: str, batch: int, draft_len: int, mechanism: str, quant: str) -> np.ndarray:
        key = (name, batch, draft_len, mechanism, quant)
        if key not in self._figures:
            self._figures[key] = np.array(
                [getattr(m.predict(batch, draft_len, mechanism, quant), name).value for m in self.models]
            )
        return self._figures[key]

    def tokens_per_s(self, batch: int, draft_len: int, mechanism: str, quant: str = "none") -> np.ndarray:
        return self._figure("tokens_per_s", batch, draft_len, mechanism, quant)

    def speedup(self, batch: int, draft_len: int, mechanism: str, quant: str = "none") -> np.ndarray:
        """Each draw's TPS(B, D) / TPS(B, 0), the baseline drawn with it."""
        return self._figure("speedup", batch, draft_len, mechanism, quant)


def _increasing_in_tokens(
    drawn: dict[int, dict[int, Figure]], cells: dict[int, dict[int, Figure]]
) -> dict[int, dict[int, Figure]]:
    """A draw's verify cells made non-decreasing in the tokens verified at every batch: the weighted isotonic fit of
    each batch's line, weights 1 / σ² of the cells' own intervals (equal where a line has a cell without one). A step
    verifying more tokens is never cheaper, and cells drawn apart would otherwise make a longer draft look free."""
    fitted = {t: dict(by_batch) for t, by_batch in drawn.items()}
    for batch in {B for by_batch in drawn.values() for B in by_batch}:
        tokens = sorted(t for t in drawn if batch in drawn[t])
        sigmas = [_log_sigma(cells[t][batch]) for t in tokens]
        weights = np.array([1 / s**2 for s in sigmas] if all(sigmas) else [1.0] * len(tokens))
        line = intervals.isotonic_line(np.array([drawn[t][batch].value for t in tokens]), weights)
        for t, value in zip(tokens, line.tolist()):
            fitted[t][batch] = Figure(value, drawn[t][batch].source)
    return fitted


def _log_sigma(f: Figure) -> float:
    """The log-scale σ of a figure's 95% interval (its wider side), 0 where it has none."""
    if not f.has_interval or not 0 < f.low < f.value < f.high < math.inf:  # type: ignore[operator]
        return 0.0
    return max(math.log(f.high / f.value), math.log(f.value / f.low)) / intervals.Z95  # type: ignore[operator]


def _sum(*parts: Figure) -> Figure:
    """Verify + draft + host: the round, its bounds the parts' bounds added (a part without an interval at its
    value)."""
    value = sum(p.value for p in parts)
    source = weakest(*(p.source for p in parts))
    if not any(p.has_interval for p in parts):
        return Figure(value, source)
    return bounded(value, source, sum(p.bounds()[0] for p in parts), sum(p.bounds()[1] for p in parts))


def _tokens_per_s(batch: int, tpf: Figure, round_: Figure, source: str) -> Figure:
    """1e3·B·AL / round ms, with the conservative interval of the module docstring (0 where a step does not fit)."""
    value = 1e3 * batch * tpf.value / round_.value
    if not (tpf.has_interval or round_.has_interval):
        return Figure(value, source)
    (a_low, a_high), (r_low, r_high) = tpf.bounds(), round_.bounds()
    return bounded(value, source, 1e3 * batch * a_low / r_high, 1e3 * batch * a_high / r_low)


def _scaled(f: Figure, factor: float, source: str) -> Figure:
    if not f.has_interval:
        return Figure(f.value * factor, source)
    low, high = f.bounds()
    return Figure(f.value * factor, source, low * factor, high * factor)
