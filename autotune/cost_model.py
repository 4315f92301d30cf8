"""The cost model of DESIGN.md §1, answered from a recorded profile (the `replay` backend).

    TPS(B, D)      = B · AL(D) / (T_verif(B, 1+D) + T_draft(B, D) + T_host(B, D))
    T_verif(B, 1+D) is the expected cost of the round's width: a batch verifies 1 + the longest proposal
    among its rows, and model-free drafters often propose fewer than D tokens. With P(L) the share of
    rounds that proposed L tokens at D_max (the profile's round histogram), a row's width is min(L, D) and
        E[T_verif] = Σ_w (F(w)^B − F(w−1)^B) · T_verif(B, 1+w),   F(w) = P(min(L, D) ≤ w),
    rows taken as independent. A drafter that always proposes D reduces to T_verif(B, 1+D).
    per-user rate  = TPS(B, D) / B
    speedup        = TPS(B, D) / TPS(B, 0),   TPS(B, 0) = B / (T_verif(B, 1) + T_host(B, 0))

AL(D) here is tokens emitted per target forward over all rounds (`tokens_per_forward` in the
profile), never vLLM's mean acceptance length. Every figure carries its source; a result is as weak
as its weakest input: measured < interpolated < modeled.
"""

from __future__ import annotations

import bisect
import dataclasses

from specdec_tune import SpecdecError
from specdec_tune.profiles.schema import Profile

_RANK = {"measured": 0, "interpolated": 1, "modeled": 2}


@dataclasses.dataclass(frozen=True)
class Figure:
    value: float
    source: str  # measured | interpolated | modeled


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
    verify_ms: Figure
    draft_ms: Figure
    host_ms: Figure


def _interp_in_batch(points: dict[int, Figure], batch: int) -> Figure:
    """Linear in B between measured buckets (interpolated); beyond the largest, linear extrapolation (modeled)."""
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
    y = points[lo].value + (points[hi].value - points[lo].value) * (batch - lo) / (hi - lo)
    return Figure(max(y, 0.0), weakest(source, points[lo].source, points[hi].source))


class CostModel:
    """Predictions for (B, D, mechanism, quant) at one context bucket, temperature and domain."""

    def __init__(self, profile: Profile, *, ctx: int | None = None, temperature: float = 0.0, domain: str = "all") -> None:
        self.profile = profile
        self.ctx = ctx if ctx is not None else profile.workload.ctx_buckets[0]
        if self.ctx not in profile.workload.ctx_buckets:
            raise SpecdecError(f"context {self.ctx} is not a profiled bucket", f"use one of {profile.workload.ctx_buckets}")
        self.max_draft_len = profile.workload.max_draft_len
        self._verify: dict[int, dict[int, Figure]] = {}  # tokens -> batch -> ms
        for p in profile.verify:
            if p.ctx == self.ctx and p.median_ms is not None:
                self._verify.setdefault(p.tokens, {})[p.batch] = Figure(p.median_ms, p.source)
        self._draft: dict[tuple[str, str, int], dict[int, Figure]] = {}  # (mechanism, quant, D) -> batch -> ms
        for p in profile.draft:
            if p.median_ms is not None:
                self._draft.setdefault((p.mechanism, p.quant, p.draft_len), {})[p.batch] = Figure(p.median_ms, p.source)
        self._host: dict[str, dict[int, Figure]] = {}
        for h in profile.host:
            self._host.setdefault(h.mechanism, {})[h.batch] = Figure(h.host_ms_per_round, h.source)
        self._al = {(a.mechanism, a.quant): a for a in profile.acceptance if a.domain == domain and a.temperature == temperature}
        if not self._al:
            raise SpecdecError(f"the profile has no acceptance for domain {domain!r} at temperature {temperature}",
                               "profile that domain and temperature, or pick one it has")

    @property
    def mechanisms(self) -> list[str]:
        return sorted({m for m, _ in self._al})

    def quants(self, mechanism: str) -> list[str]:
        return sorted(q for m, q in self._al if m == mechanism)

    def draft_len_limit(self, mechanism: str) -> int:
        """The longest D measured for this mechanism (a block drafter's block can cap it below the workload's D_max)."""
        lens = [a.max_draft_len for (m, _), a in self._al.items() if m == mechanism]
        return min(lens) if lens else self.max_draft_len

    # ------------------------------------------------------------------ components

    def verify_ms(self, batch: int, tokens: int) -> Figure:
        if tokens not in self._verify:
            raise SpecdecError(f"1+D = {tokens} is beyond the profiled draft lengths", f"keep D ≤ {self.max_draft_len}")
        return _interp_in_batch(self._verify[tokens], batch)

    def draft_ms(self, mechanism: str, quant: str, batch: int, draft_len: int) -> Figure:
        if draft_len == 0:
            return Figure(0.0, "measured")
        timed = self._draft.get((mechanism, quant, draft_len))
        if timed is None and quant != "none" and (mechanism, "none", draft_len) in self._draft:
            # Not run in this format here: the full-precision time stands in, labelled as a model
            # (the hardware table refines it for devices that run the format natively).
            base = _interp_in_batch(self._draft[(mechanism, "none", draft_len)], batch)
            return Figure(base.value, "modeled")
        if timed is None:
            raise SpecdecError(f"the profile has no draft time for {mechanism} (quant {quant}) at D={draft_len}",
                               "re-run `specdec-tune profile` with that drafter")
        return _interp_in_batch(timed, batch)

    def host_ms(self, mechanism: str, batch: int) -> Figure:
        points = self._host.get(mechanism) or self._host.get("plain")
        return _interp_in_batch(points, batch) if points else Figure(0.0, "modeled")

    def round_verify_ms(self, mechanism: str, quant: str, batch: int, draft_len: int) -> Figure:
        """Expected verify time of a round at draft length D: the batch verifies its longest proposal."""
        record = self._al.get((mechanism, quant))
        if record is None or not record.rounds:
            return self.verify_ms(batch, 1 + draft_len)
        share = [sum(row) for row in record.rounds]  # rounds that proposed L tokens, L = 0..D_max
        total = sum(share)
        if total == 0 or share[-1] == total:  # always the full draft: no spread to model
            return self.verify_ms(batch, 1 + draft_len)
        cdf = [sum(share[: min(w, len(share) - 1) + 1]) / total if w < draft_len else 1.0 for w in range(draft_len + 1)]
        expected, previous = 0.0, 0.0
        sources = []
        for w in range(draft_len + 1):
            p_max = cdf[w] ** batch - previous
            previous = cdf[w] ** batch
            if p_max > 1e-12:
                t = self.verify_ms(batch, 1 + w)
                expected += p_max * t.value
                sources.append(t.source)
        return Figure(expected, weakest("modeled", *sources))

    def tokens_per_forward(self, mechanism: str, quant: str, draft_len: int) -> Figure:
        record = self._al.get((mechanism, quant))
        if record is None:
            raise SpecdecError(f"the profile has no acceptance for {mechanism} with {quant} weights",
                               f"profiled: {', '.join(f'{m}/{q}' for m, q in sorted(self._al))}")
        direct = {c.draft_len for c in record.checks}
        # D_max was run; smaller D are derived from its rounds (checked directly at a few D).
        source = "measured" if draft_len in (0, record.max_draft_len) or draft_len in direct else "modeled"
        if record.quant_source == "emulated":
            source = weakest(source, "interpolated")
        return Figure(record.tokens_per_forward[draft_len], source)

    # ------------------------------------------------------------------ the formula

    def baseline_tokens_per_s(self, batch: int) -> Figure:
        verify, host = self.verify_ms(batch, 1), self.host_ms("plain", batch)
        return Figure(1e3 * batch / (verify.value + host.value), weakest(verify.source, host.source))

    def predict(self, batch: int, draft_len: int, mechanism: str, quant: str = "none") -> Prediction:
        D = draft_len
        if D == 0:  # no speculation: the mechanism and its weights play no part
            mechanism, quant = "none", "none"
        tpf = self.tokens_per_forward(mechanism, quant, D) if D else Figure(1.0, "measured")
        verify = self.round_verify_ms(mechanism, quant, batch, D) if D else self.verify_ms(batch, 1)
        draft = self.draft_ms(mechanism, quant, batch, D)
        host = self.host_ms(mechanism if D else "plain", batch)
        round_ms = verify.value + draft.value + host.value
        source = weakest(tpf.source, verify.source, draft.source, host.source)
        tps = 1e3 * batch * tpf.value / round_ms
        base = self.baseline_tokens_per_s(batch)
        return Prediction(
            batch=batch, draft_len=D, mechanism=mechanism, quant=quant,
            tokens_per_s=Figure(tps, source), per_user_tokens_per_s=Figure(tps / batch, source),
            speedup=Figure(tps / base.value, weakest(source, base.source)),
            tokens_per_forward=tpf, verify_ms=verify, draft_ms=draft, host_ms=host,
        )

    def best(self, batch: int, *, quant: str = "none") -> Prediction:
        """Exhaustive optimum over mechanism and D at one batch size (D = 0 means no speculation)."""
        candidates = [self.predict(batch, 0, "none")]
        candidates += [self.predict(batch, D, m, quant) for m in self.mechanisms if quant in self.quants(m)
                       for D in range(1, self.draft_len_limit(m) + 1)]
        return max(candidates, key=lambda p: (p.tokens_per_s.value, -p.draft_len))
