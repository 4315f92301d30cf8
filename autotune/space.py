"""The search space of `specdec-tune search` and the objectives over it, answered by the cost model.

A candidate deployment is one drafter (mechanism and weight format: one per deployment), a tile
policy, a serving cap `max_batch` (vLLM's `max_num_seqs`) and D per batch bucket up to the cap.
Physics and engine constraints are part of the space, not checked afterwards:
  - D never rises with batch. A larger batch makes the verify step's GEMMs compute-bound sooner
    (guideline 1) and every draft costlier, while acceptance does not depend on the batch, so where a
    larger batch's best D exceeds a smaller one's, noise decided one of them. The smallest bucket then
    carries the schedule's maximum, which TensorRT-LLM requires too (its `draft_len_schedule` value at
    the smallest key equals `max_draft_len`). A sampled schedule is repaired to satisfy both;
  - vLLM: ranges start at batch 1 and each K is capped at `num_speculative_tokens` (the maximum), which
    every schedule satisfies once the smallest bucket is 1;
  - MTP: K is a multiple of the checkpoint's layer count (`draft_len_multiple` of the drafter);
  - tile policy `aligned`: D > 0 only where G·(1+D), the query rows one KV head verifies, is a whole
    number of attention tiles (guideline 3); `free` takes any D.
SGLang has no per-batch table; the exporter turns the schedule into launch bands.

Objectives (all from predictions; each figure keeps its measured/interpolated/modeled source):
  speedup     mean predicted speedup over the buckets, with a per-user-rate floor in every bucket
  throughput  tokens/s per device at the cap, with the per-user-rate floor at the cap
  per-user    per-user tokens/s at the cap, with a tokens/s-per-device floor at the cap
  pareto      both of the last two at once (NSGA-II); the plan carries the front
A floor missed by a relative shortfall s costs SLO_PENALTY·s in the (unitless) objective.

Deciding (`bucket_score`, `bucket_value`). A bucket's score is its expected speedup under the profile's uncertainty:
the mean over the cost model's draws (cost_model.py, "Deciding": timing cells drawn once per draw and shared by every
draft length, acceptance resampled over the same prompts for all of them). The draft length with the highest
expected speedup wins the bucket. A shorter draft is preferred over it only where its expected loss is within the tie
tolerance (default 1%): the cheaper draft wastes less verify work where the served traffic accepts less than the
calibration set, and that is worth a loss this small, not more. A draft length that misses a floor the best meets is
never preferred over it. The plan reports, per bucket, the expected gain over the runner-up and the share of draws in
which the choice beats it, and what the tolerance cost against the strict optimum (every expected difference deciding).
Between drafters likewise (the speedup objective, `preferred`): where a drafter listed earlier in the profile (its
`--drafter` order; by default n-gram, then suffix, then the draft model) has a best schedule whose expected mean speedup
is within the tie tolerance of the best drafter's, the earlier one is taken: two drafters that close are a toss-up that
the profile's noise decides run by run, and the earlier one is the user's preference (by default the one no serving
engine needs another package for: vLLM's suffix decoding needs Arctic Inference).

Batch buckets the profile could not run (the one-token verify step out of memory, or never timed, at the
plan's context) are not in the space; the plan's notes name them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel, Prediction
from specdec_tune.autotune.hardware import find_device_spec
from specdec_tune.settings import OBJECTIVES

TILE_POLICIES = ("free", "aligned")
SLO_PENALTY = 10.0


@dataclasses.dataclass(frozen=True)
class Candidate:
    mechanism: str
    quant: str
    tile_policy: str
    max_batch: int  # the serving cap: buckets above it are not served
    schedule: tuple[int, ...]  # D per batch bucket up to the cap, in bucket order


def share_faster(a: np.ndarray, b: np.ndarray) -> float:
    """The share of paired draws in which a beats b (ties count half)."""
    return float(np.mean(a > b) + 0.5 * np.mean(a == b))


def attention_group(profile) -> int:
    """G, query heads per KV head, from the target's projection shapes in the linear micro-curve."""
    shapes = {p.layer: (p.in_features, p.out_features) for p in profile.micro if p.kind == "linear"}
    if "o" not in shapes or "qkv" not in shapes:
        return 1
    q_width = shapes["o"][0]
    kv_width = (shapes["qkv"][1] - q_width) // 2
    return max(1, q_width // kv_width) if kv_width > 0 else 1


def attention_tile_rows(profile) -> int:
    """The attention kernel's query tile on the profiled (or projected) device; 1 where there is none (CPU)."""
    device = profile.device
    if device.get("attention_tile_rows"):
        return int(device["attention_tile_rows"])
    spec = find_device_spec(str(device.get("name", ""))) if device.get("kind") != "cpu" else None
    return spec.attention_tile_rows if spec else 1


class Space:
    """The feasible choices and the objectives, over one cost model."""

    def __init__(self, cost: CostModel, settings) -> None:
        self.cost, self.s = cost, settings
        if settings.objective not in OBJECTIVES:
            raise SpecdecError(f"unknown objective {settings.objective!r}", f"use one of {', '.join(OBJECTIVES)}")
        profile = cost.profile
        self.excluded = {
            B: why for B in profile.workload.batch_buckets if (why := cost.unplannable(B))
        }  # batch -> why not planned
        self.buckets = [B for B in profile.workload.batch_buckets if B not in self.excluded]
        if not self.buckets:
            raise SpecdecError(
                f"no batch bucket can be planned: {'; '.join(self.excluded.values())}",
                "re-profile with smaller batch buckets or a shorter context (--batch, --ctx)",
            )
        known = cost.mechanisms
        for m in settings.mechanisms:
            if m not in known:
                raise SpecdecError(
                    f"mechanism {m!r} is not in the profile",
                    f"profiled: {', '.join(known)}; re-run profile with --drafter {m}",
                )
        self.mechanisms = list(settings.mechanisms) or known
        self.pairs = [(m, q) for m in self.mechanisms for q in settings.quant_formats if q in cost.quants(m)]
        if not self.pairs:
            raise SpecdecError(
                "no mechanism was profiled with the requested weight formats", "add --quant none or profile the formats"
            )
        self.tie_tolerance = settings.tie_tolerance
        listed = [d.name for d in profile.drafters] + self.mechanisms
        # the drafters in the order a tie between them is settled (`preferred`)
        self.listed = sorted(self.pairs, key=lambda mq: (listed.index(mq[0]), settings.quant_formats.index(mq[1])))
        self.strict = False  # True: no ties at all (the strict optimum)
        self.group = attention_group(profile)
        self.tile_rows = settings.tile_rows or attention_tile_rows(profile)
        self.multiple = {d.name: max(1, d.draft_len_multiple) for d in profile.drafters}
        self.policies = ["free"]
        if any(
            self.allowed(m, "aligned") != self.allowed(m, "free") and len(self.allowed(m, "aligned")) > 1
            for m, _ in self.pairs
        ):
            self.policies.append("aligned")
        self.caps = self.buckets if settings.objective != "speedup" else self.buckets[-1:]
        self._best: dict[tuple, tuple[float, int]] = {}  # (B, m, q, policy) -> (best score, its D)
        self._check_floors()

    # ------------------------------------------------------------------ constraints

    def allowed(self, mechanism: str, policy: str) -> list[int]:
        """The draft lengths this mechanism may use under this tile policy (0, no speculation, always)."""
        step = self.multiple.get(mechanism, 1)
        ds = [D for D in range(self.cost.draft_len_limit(mechanism) + 1) if D % step == 0]
        if policy == "aligned":
            ds = [D for D in ds if D == 0 or (self.group * (1 + D)) % self.tile_rows == 0]
        return ds

    def tiles(self, D: int) -> dict:
        rows = self.group * (1 + D)
        n = math.ceil(rows / self.tile_rows)
        return {"query_rows_per_kv_head": rows, "tiles": n, "fill": rows / (n * self.tile_rows)}

    def _check_floors(self) -> None:
        s, every = self.s, [(m, q, D) for m, q in self.pairs for D in self.allowed(m, "free")]
        if s.objective == "speedup" and s.min_user_tokens_per_s:
            for B in self.buckets:
                if (
                    max(self.cost.predict(B, D, m, q).per_user_tokens_per_s.value for m, q, D in every)
                    < s.min_user_tokens_per_s
                ):
                    raise SpecdecError(
                        f"no setting reaches {s.min_user_tokens_per_s:g} tokens/s per user at batch {B}",
                        "lower --min-user-tps or drop that batch bucket",
                    )
        if s.objective in ("throughput", "per-user", "pareto"):
            points = [self.cost.predict(B, D, m, q) for B in self.caps for m, q, D in every]
            feasible = [
                p
                for p in points
                if p.per_user_tokens_per_s.value >= s.min_user_tokens_per_s
                and p.tokens_per_s.value >= s.min_tokens_per_s
            ]
            if not feasible:
                raise SpecdecError(
                    f"no batch size and setting reach {s.min_user_tokens_per_s:g} tokens/s per user together with "
                    f"{s.min_tokens_per_s:g} tokens/s per device",
                    "lower --min-user-tps or --min-tps",
                )

    @staticmethod
    def repair(schedule: list[int]) -> tuple[int, ...]:
        """The smallest bucket carries the schedule's maximum, and no later bucket exceeds the one before it."""
        out = [max(schedule)]
        for D in schedule[1:]:
            out.append(min(out[-1], D))
        return tuple(out)

    def snap(self, D: int, mechanism: str, policy: str) -> int:
        """The largest allowed draft length not above D."""
        return max(d for d in self.allowed(mechanism, policy) if d <= D)

    # ------------------------------------------------------------------ objectives

    def floor_penalty(self, B: int, D: int, m: str, q: str) -> float:
        """SLO_PENALTY times the relative shortfall from the per-user-rate floor at one bucket."""
        floor = self.s.min_user_tokens_per_s
        return (
            SLO_PENALTY * max(0.0, floor - self.cost.predict(B, D, m, q).per_user_tokens_per_s.value) / floor
            if floor
            else 0.0
        )

    def bucket_score(self, B: int, D: int, m: str, q: str) -> float:
        """Expected speedup at one bucket (the mean over the cost model's draws), less the per-user-floor penalty."""
        return float(self.cost.draws.speedup(B, D, m, q).mean()) - self.floor_penalty(B, D, m, q)

    def served(self, cap: int) -> list[int]:
        return [B for B in self.buckets if B <= cap]

    def schedule_score(self, c: Candidate) -> float:
        """Mean speedup over the served buckets (the `speedup` objective), ties flattened (`bucket_value`)."""
        served = self.served(c.max_batch)
        return sum(
            self.bucket_value(B, D, c.mechanism, c.quant, c.tile_policy) for B, D in zip(served, c.schedule)
        ) / len(served)

    def at_cap(self, c: Candidate) -> Prediction:
        return self.cost.predict(c.max_batch, c.schedule[len(self.served(c.max_batch)) - 1], c.mechanism, c.quant)

    def cap_value(self, p: Prediction) -> float:
        """The single-objective value of an operating point, relative to plain decoding, less floor penalties."""
        s = self.s
        if s.objective == "per-user":
            value = (
                p.per_user_tokens_per_s.value / self.cost.baseline_tokens_per_s(self.buckets[0]).value * self.buckets[0]
            )
            floor, have = s.min_tokens_per_s, p.tokens_per_s.value
        else:
            value = p.tokens_per_s.value / self.cost.baseline_tokens_per_s(self.buckets[-1]).value
            floor, have = s.min_user_tokens_per_s, p.per_user_tokens_per_s.value
        return value - (SLO_PENALTY * max(0.0, floor - have) / floor if floor else 0.0)

    def cap_score(self, c: Candidate) -> float:
        return self.cap_value(self.at_cap(c))

    def score(self, c: Candidate) -> float:
        return self.schedule_score(c) if self.s.objective == "speedup" else self.cap_score(c)

    # ------------------------------------------------------------------ exact answers

    def fill(self, m: str, q: str, policy: str, cap: int, held: dict[int, int] | None = None) -> Candidate:
        """The best schedule up to `cap` for one drafter and policy, D non-increasing in batch, some buckets' D held.

        A dynamic program from the largest bucket down: `tail[d]` is the best (value, schedule) of the buckets
        from this one on when this one takes at most d. Equal values go to the shorter draft, bucket by bucket.
        """
        held = held or {}
        served = self.served(cap)
        allowed = self.allowed(m, policy)
        tail: dict[int, tuple[float, tuple[int, ...]]] = {d: (0.0, ()) for d in allowed}
        for B in reversed(served):
            options = [held[B]] if B in held else allowed
            here = {
                D: (self.bucket_value(B, D, m, q, policy) + tail[D][0], (D, *tail[D][1]))
                for D in options
                if tail[D][0] > -math.inf
            }
            best_up_to: tuple[float, tuple[int, ...]] = (-math.inf, ())
            tail = {}
            for d in allowed:  # ascending: a later d replaces the best only when strictly better
                if d in here and here[d][0] > best_up_to[0] + 1e-12:
                    best_up_to = here[d]
                tail[d] = best_up_to
        value, schedule = tail[allowed[-1]]
        assert value > -math.inf, "D = 0 is always allowed"
        return Candidate(m, q, policy, cap, schedule)

    def preferred(self, c: Candidate) -> Candidate:
        """The speedup objective's drafter tie (module docstring): the first listed drafter whose best schedule at c's
        policy and cap scores within the tie tolerance of c's score; c where none does (and always when strict)."""
        if self.strict or self.s.objective != "speedup":
            return c
        top = self.score(c)
        for m, q in self.listed:
            other = c if (m, q) == (c.mechanism, c.quant) else self.fill(m, q, c.tile_policy, c.max_batch)
            if self.score(other) >= top - self.tie_tolerance * abs(top):
                return other
        return c

    def schedule_draws(self, c: Candidate) -> np.ndarray:
        """Each draw's mean speedup over c's served buckets (the speedup objective draw by draw, floors aside)."""
        served = self.served(c.max_batch)
        return np.mean(
            [self.cost.draws.speedup(B, D, c.mechanism, c.quant) for B, D in zip(served, c.schedule)], axis=0
        )  # [draws]

    def drafter_runner_up(self, c: Candidate) -> Candidate | None:
        """The best other drafter's best schedule at c's policy and cap (None where c's is the only drafter)."""
        others = [
            self.fill(m, q, c.tile_policy, c.max_batch) for m, q in self.listed if (m, q) != (c.mechanism, c.quant)
        ]
        return max(others, key=self.rank) if others else None

    def bucket_best(self, B: int, m: str, q: str, policy: str = "free") -> tuple[float, int]:
        """(score, D) of the strictly best allowed draft length at one bucket (the shorter of equal ones)."""
        key = (B, m, q, policy)
        if key not in self._best:
            self._best[key] = max(
                ((self.bucket_score(B, d, m, q), d) for d in self.allowed(m, policy)), key=lambda sd: (sd[0], -sd[1])
            )
        return self._best[key]

    def tie_rule(self, B: int, D: int, other: int, m: str, q: str) -> str | None:
        """ "expected" where D is shorter than `other` and its expected loss against it is within the tie tolerance (and
        it meets the floors `other` meets), so that the shorter draft is taken; None otherwise (always when strict)."""
        if self.strict or D >= other:
            return None
        if self.floor_penalty(B, D, m, q) > self.floor_penalty(B, other, m, q) + 1e-12:
            return None
        score, top = self.bucket_score(B, D, m, q), self.bucket_score(B, other, m, q)
        return "expected" if score >= top - self.tie_tolerance * abs(top) else None

    def beats(self, B: int, D: int, other: int, m: str, q: str) -> float:
        """The share of the draws in which D's speedup beats `other`'s at one bucket (ties count half)."""
        return share_faster(self.cost.draws.speedup(B, D, m, q), self.cost.draws.speedup(B, other, m, q))

    def bucket_value(self, B: int, D: int, m: str, q: str, policy: str = "free") -> float:
        """The bucket's expected score, flattened to the best where D is a shorter draft within the tie tolerance of
        it (`tie_rule`), so that the shorter one wins."""
        top, top_D = self.bucket_best(B, m, q, policy)
        score = self.bucket_score(B, D, m, q)
        return top if D == top_D or self.tie_rule(B, D, top_D, m, q) else score

    def operating_points(self, caps: list[int] | None = None):
        """Every (drafter, policy, cap, D at the cap): the whole space of the cap objectives."""
        for m, q in self.pairs:
            for policy in self.policies:
                for cap in self.caps if caps is None else caps:
                    for D in self.allowed(m, policy):
                        yield m, q, policy, cap, D

    @contextlib.contextmanager
    def strictly(self):
        """No ties within this block: every predicted difference decides."""
        saved, self.strict = self.strict, True
        try:
            yield
        finally:
            self.strict = saved

    def strict_optimum(self) -> float:
        """The objective's exact maximum with no ties: what the tie rule costs is measured against it."""
        with self.strictly():
            return self.exhaustive()[1]

    def strict_score(self, c: Candidate) -> float:
        with self.strictly():
            return self.score(c)

    def exhaustive(self) -> tuple[Candidate, float]:
        if self.s.objective == "speedup":
            cands = [self.fill(m, q, policy, self.buckets[-1]) for m, q in self.pairs for policy in self.policies]
            best = self.preferred(max(cands, key=self.rank))
            return best, self.score(best)
        values = {op: self.cap_value(self.cost.predict(op[3], op[4], op[0], op[1])) for op in self.operating_points()}
        top = max(values.values())
        best = max(
            (
                self.fill(m, q, policy, cap, {cap: D})
                for (m, q, policy, cap, D), v in values.items()
                if v >= top - 1e-12
            ),
            key=self.rank,
        )
        return best, self.score(best)

    def rank(self, c: Candidate) -> tuple:
        """Order among candidates: the objective, then (for ties at the cap) the schedule below it, then
        the aligned policy (fewer kernel variants), then the shorter maximum draft."""
        return round(self.score(c), 12), self.schedule_score(c), c.tile_policy == "aligned", -max(c.schedule)

    def size(self) -> int:
        if (
            self.s.objective == "speedup"
        ):  # the non-increasing schedules: n buckets over k draft lengths, C(n + k - 1, n)
            return sum(
                math.comb(len(self.buckets) + len(self.allowed(m, p)) - 1, len(self.buckets))
                for m, _ in self.pairs
                for p in self.policies
            )
        return sum(1 for _ in self.operating_points())

    def pareto_front(self, caps: set[int] | None = None) -> list[Candidate]:
        """The exact front of (tokens/s per device, per-user tokens/s) over the operating points at these caps
        (default: every bucket), one candidate per point: the best-ranked of those that reach it."""
        points: dict[tuple[float, float], list[tuple]] = {}
        for m, q, policy, cap, D in self.operating_points(sorted(caps or self.buckets)):
            p = self.cost.predict(cap, D, m, q)
            points.setdefault((p.tokens_per_s.value, p.per_user_tokens_per_s.value), []).append((m, q, policy, cap, D))
        return [
            max((self.fill(m, q, policy, cap, {cap: D}) for m, q, policy, cap, D in points[xy]), key=self.rank)
            for xy in non_dominated(list(points))
        ]


def non_dominated(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(throughput, per-user rate) points no other point beats on both, by throughput descending."""
    front, best_user = [], float("-inf")
    for tps, user in sorted(points, key=lambda xy: (-xy[0], -xy[1])):
        if user > best_user:
            front.append((tps, user))
            best_user = user
    return front
