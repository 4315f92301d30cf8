"""The throughput check of a plan profiled in this tool's loop: decode tokens/s at each bucket's batch with its D, on
this device, against the plan's prediction.

Each bucket decodes calibration prompts cut to the plan's context (the profile's dtype, every row decoding the full
length), its timed runs brought back to profile-time speed by the probes on either side of each (`DeviceSpeed`), and
the relative error per bucket is judged against the tolerance and the noise (`bucket_row`, `verdict`). Only the rounds
in which every row of the batch is still decoding count: the batch a continuously batched server keeps full.

Verdicts (`verdict`). A bucket's runs at profile-time speed give a 95% interval of its tokens/s
(`intervals.runs_interval`); the plan's margin at the bucket is the expected gap to its runner-up (the decision the plan
recorded), the tolerance where it recorded none.
    passed            the measured interval lies within the tolerance of the prediction
    failed            beyond the tolerance, and the measured and the predicted 95% intervals are apart
    inside the noise  beyond the tolerance, the intervals overlap, and the measured interval is narrower than the
                      plan's margin: the prediction's own interval holds the measurement, measured as finely as the
                      plan decides
    inconclusive      none of these: the runs are too spread to say
An open verdict measures the bucket again, up to `MORE_RUNS` times its runs and while the check's time for it lasts
(`MeasureSettings.recheck_s`, over all buckets), before it is called inconclusive; an inconclusive bucket is neither a
pass nor a failure (nothing is repaired or refused on it), and the check that holds one has not passed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from specdec_tune import SpecdecError
from specdec_tune.autotune.plan_schema import Bucket, Plan
from specdec_tune.pipeline.lossless import plan_drafter
from specdec_tune.profiles.fingerprint import device_fingerprint, resolve_device
from specdec_tune.profiles.intervals import runs_interval
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.prompts import cut_to_context, prompts_by_domain
from specdec_tune.profiles.schema import Profile
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.profiles.timing import is_out_of_memory
from specdec_tune.profiles.verify_curve import VerifyStep
from specdec_tune.settings import MeasureSettings

# timed calls of a speed probe (median): the gate scales its prediction by the ratio, so it gets more than a guard
PROBE_REPEATS = 5
WARMUP_TOKENS = 8  # a decode's warm-up: the first batch, this many tokens (allocator and caches; not timed)
T = TypeVar("T")


def context_prompts_by_domain(
    target, ctx: int, new_tokens: int, max_draft: int, split: str, whole: bool = False, spec: str = "default"
) -> list[tuple[list[int], str]]:
    """(ids, domain) of the calibration prompts at least ctx − new_tokens/2 tokens long, cut to that length from the
    left (the chat template's reply header stays last), so that the KV cache averages `ctx` over the decode. The
    length filter favours the domains of long prompts (HumanEval, extraction): the domains say what was decoded.
    `whole`: the prompts between half that length and all of it, uncut (`cut_to_context`). `spec`: the calibration
    set, as `--prompts` takes it."""
    every = prompts_by_domain(
        target.tokenizer, target.model.config.max_position_embeddings, 1000, new_tokens, max_draft, split, spec
    )
    return cut_to_context(every, ctx, new_tokens, whole)


def context_prompts(
    target, ctx: int, new_tokens: int, max_draft: int, split: str, spec: str = "default"
) -> list[list[int]]:
    return [ids for ids, _ in context_prompts_by_domain(target, ctx, new_tokens, max_draft, split, spec=spec)]


def measure_decode(
    target,
    drafter,
    ids: list[list[int]],
    D: int,
    new_tokens: int,
    repeats: int,
    seed: int = 0,
    batch_size: int | None = None,
    between: Callable[[], None] = lambda: None,
) -> dict:
    """Decode tokens/s over `ids` in batches of `batch_size` (default: one batch), median of `repeats` after a
    warm-up (the first batch, a few tokens), each run's figure, and the tokens per target forward of the last run.
    `between` is called before the first timed run and after each (`DeviceSpeed` probes the device there).

    Only the rounds in which all `batch_size` rows are still decoding count towards tokens/s: that is the
    batch a continuously batched server keeps full, and what the cost model predicts. A static batch's
    tail (rows that accepted more finish first and leave the rest running at a smaller batch) is dropped.
    """
    B = batch_size or len(ids)
    if len(ids) % B:
        raise SpecdecError(f"{len(ids)} prompts do not split into batches of {B}", "pass a multiple of the batch size")
    kwargs: dict[str, Any] = dict(
        drafter=drafter if D else None,
        num_draft_tokens=D,
        max_new_tokens=new_tokens,
        temperature=0.0,
        seed=seed,
        stop_token_ids=(),
    )
    generate(target.model, ids[:B], **(kwargs | {"max_new_tokens": min(new_tokens, WARMUP_TOKENS)}))  # warm-up
    rates = []
    between()
    for _ in range(repeats):
        counters: list[SpecCounters]
        tokens, seconds, counters = 0, 0.0, []
        for start in range(0, len(ids), B):
            out = generate(target.model, ids[start : start + B], **kwargs)
            tokens, seconds, counters = (
                tokens + out.full_batch_tokens,
                seconds + out.full_batch_s,
                counters + out.per_prompt,
            )
        rates.append(tokens / seconds)
        between()
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_range": [min(rates), max(rates)],
        "tokens_per_s_runs": rates,
        "tokens_per_forward": SpecCounters.total(counters).tokens_per_target_forward,
    }


MORE_RUNS = 3  # a bucket whose verdict is open is measured again, up to this many times its runs


class DeviceSpeed:
    """This device's speed now against profile time, probed between the timed runs of each measurement.

    The probe is one verify step (the bucket's batch, one token, `ctx` cached), a step the profile measured. A bucket
    that does not speculate is predicted from that very step (TPS(B, 0) = B / T_verif(B, 1)), so a measurement scaled by
    it would agree with the prediction whatever the step's profiled time: it is probed on the two-token step instead
    (`reference`), a cell its prediction does not read.
    It runs before a measurement's first timed run and after each run; a run's speed ratio is the mean of the
    probes on either side of it against the profile's figure for that step (the fitted curve's, which the
    prediction was built from): > 1 where the device runs slower now. Pairing each run with the probes next to
    it matters on a shared machine: there the speed moves by 20-30% within a minute, so a ratio probed once
    before and once after a 40-second measurement can disagree with the runs in between by as much. Shared
    machines drift with other tenants and clocks, and not by one factor: on a 2-core CPU the batch-1 step ran at
    x0.98-1.12 of its profile time while batches 4-16 ran 20-35% slower, so each batch is probed at its own size.
    """

    def __init__(self, target, profile, ctx: int, seed: int = 0) -> None:
        self.target, self.ctx, self.seed = target, ctx, seed
        self.profiled_ms: dict[tuple[int, int], float] = {
            (p.batch, p.tokens): p.median_ms
            for p in profile.verify
            if p.tokens in (1, 2) and p.ctx == ctx and p.source in ("measured", "fitted") and p.median_ms
        }
        one_token = any(t == 1 for _, t in self.profiled_ms)
        self.why = None if one_token else f"the profile has no measured verify step with one token at ctx {ctx}"
        self.probes: dict[tuple[int, int], Callable[[], float]] = {}
        self.last_probes: list[float] = []  # the last `measure`'s probes, each its ms over the profile's (in order)

    def probed_batch(self, batch: int, tokens: int = 1) -> int | None:
        """The batch whose profiled step of `tokens` stands for `batch`: itself where measured, else the nearest."""
        batches = [b for b, t in self.profiled_ms if t == tokens]
        return min(batches, key=lambda b: (abs(b - batch), b)) if batches else None

    def reference(self, batch: int, draft_len: int) -> tuple[int, int] | None:
        """(batch, tokens) of the step that probes a bucket's speed: the one-token step, or for a bucket that does not
        speculate the two-token step where the profile measured one (class docstring)."""
        tokens = 2 if draft_len == 0 and self.probed_batch(batch, 2) is not None else 1
        probed = self.probed_batch(batch, tokens)
        return None if probed is None else (probed, tokens)

    def measure(
        self, fn: Callable[[Callable[[], None]], T], batch: int = 1, draft_len: int = 1
    ) -> tuple[T, list[float]]:
        """(fn's result, the speed ratio now / at profile time of each of its timed runs, probed at the bucket's
        reference step, `reference`).

        `fn` receives `between`, to call before its first timed run and after each (as `measure_decode` does);
        a probe is added where it called fewer than two."""
        probed = self.reference(batch, draft_len)
        if probed is None:
            self.last_probes = []
            return fn(lambda: None), [1.0]
        if probed not in self.probes:
            step = VerifyStep(self.target.model, probed[0], self.ctx, probed[1], self.seed)

            def probe(step: VerifyStep = step, probed: tuple[int, int] = probed) -> float:
                timing = step.timing(probed[1], warmup=1, repeats=PROBE_REPEATS)
                if timing is None:  # the bucket is infeasible on this device now (`throughput_check` records it)
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory: the speed probe (batch {probed[0]}, {probed[1]} token(s))"
                    )
                return timing.median_ms

            self.probes[probed] = probe
        probes_ms: list[float] = []
        result = fn(lambda: probes_ms.append(self.probes[probed]()))
        while len(probes_ms) < 2:
            probes_ms.append(self.probes[probed]())
        self.last_probes = [ms / self.profiled_ms[probed] for ms in probes_ms]
        return result, [(a + b) / 2 / self.profiled_ms[probed] for a, b in zip(probes_ms, probes_ms[1:])]


def another_device(profiled: dict) -> str:
    """How this device differs from the profiled one in what sets its speed ('' when it is the same kind)."""
    here = device_fingerprint(
        resolve_device("cuda" if profiled.get("kind") == "cuda" and torch.cuda.is_available() else "cpu"), torch.float32
    )
    return "; ".join(
        f"{key} {profiled.get(key)!r} there, {here.get(key)!r} here"
        for key in ("kind", "name", "threads")
        if key in profiled and profiled.get(key) != here.get(key)
    )


def at_profile_speed_tokens_per_s(decoded: dict, ratios: list[float]) -> tuple[float, list[float]]:
    """A decode's tokens/s brought back to profile-time speed: (the median, each run's), each run's tokens/s times its
    own speed ratio (`DeviceSpeed.measure`). A measurement without its runs, or with another number of ratios than
    runs, is scaled by the median ratio."""
    measured = decoded["tokens_per_s"]
    runs = decoded.get("tokens_per_s_runs") or decoded.get("tokens_per_s_range") or [measured]
    if len(runs) != len(ratios):
        ratios = [statistics.median(ratios)] * len(runs)
    each = [r * ratio for r, ratio in zip(runs, ratios)]
    return (statistics.median(each) if "tokens_per_s_runs" in decoded else measured * ratios[0]), each


def margin_pct(bucket: Bucket, tolerance_pct: float) -> float:
    """The margin the plan decided a bucket on: the expected gap to its runner-up in percent (the plan's `decision`),
    the tolerance where it recorded none."""
    decision = bucket.rationale.decision
    return abs(decision.expected_gain_pct) if decision is not None else tolerance_pct


def verdict(
    predicted: float,
    predicted_interval: tuple[float, float],
    measured_interval: tuple[float, float],
    error_pct: float,
    tolerance_pct: float,
    margin: float,
) -> str:
    """A bucket's verdict from its prediction and its measured 95% interval (module docstring, "Verdicts"). The error is
    predicted / measured - 1, so the measurements within the tolerance t of a prediction p lie in [p / (1 + t),
    p / (1 - t)]."""
    (p_low, p_high), (low, high) = predicted_interval, measured_interval
    t = tolerance_pct / 100
    if predicted / (1 + t) <= low and (t >= 1 or high <= predicted / (1 - t)):
        return "passed"
    if abs(error_pct) <= tolerance_pct:
        return "inconclusive"
    if high < p_low or p_high < low:
        return "failed"
    centre = math.sqrt(low * high)
    return "inside the noise" if (high - low) / 2 <= margin / 100 * centre else "inconclusive"


def bucket_row(bucket: Bucket, decoded: dict, ratios: list[float], tolerance_pct: float) -> dict:
    """One bucket of the throughput check: its prediction against its measurement at profile-time speed.

    at profile speed   c_i = r_i x ratio_i  (run i's tokens/s r_i; ratio_i probed on either side of it)
    error              predicted / median_i(c_i) - 1,  the same as the prediction at the current speed
                       (predicted x m / median(c), m the median raw tokens/s) against m
    measured interval  `intervals.runs_interval` over the c_i
    verdict            `verdict`, against the plan's margin at the bucket (`margin_pct`)
    """
    figure = bucket.predicted.tokens_per_s
    predicted, measured = figure.value, decoded["tokens_per_s"]
    corrected, at_profile_speed = at_profile_speed_tokens_per_s(decoded, ratios)
    scale = measured / corrected  # the prediction at the current speed = predicted x scale
    low, high = figure.low or predicted, figure.high or predicted
    measured_interval = runs_interval(at_profile_speed)
    error_pct = 100 * (predicted / corrected - 1)
    margin = margin_pct(bucket, tolerance_pct)
    said = verdict(predicted, (low, high), measured_interval, error_pct, tolerance_pct, margin)
    return {
        "batch": bucket.batch,
        "draft_len": bucket.draft_len,
        "predicted_tokens_per_s": predicted,
        "predicted_source": figure.source,
        "device_speed_ratio": 1 / scale,
        "device_speed_ratio_runs": ratios,
        "predicted_at_current_speed_tokens_per_s": predicted * scale,
        "predicted_interval_tokens_per_s": [low, high],
        "predicted_interval_at_current_speed_tokens_per_s": [low * scale, high * scale],
        "measured_tokens_per_s": measured,
        "measured_range_tokens_per_s": decoded.get("tokens_per_s_range", [measured, measured]),
        "measured_at_profile_speed_range_tokens_per_s": [min(at_profile_speed), max(at_profile_speed)],
        "measured_at_profile_speed_interval_tokens_per_s": list(measured_interval),
        "runs": len(at_profile_speed),
        "raw_error_pct": 100 * (predicted - measured) / measured,
        "error_pct": error_pct,
        "margin_pct": margin,
        "verdict": said,
        "inside_noise": said == "inside the noise",
        "within": said in ("passed", "inside the noise"),
    }


def merged_decodes(first: dict, more: dict) -> dict:
    """Two measurements of one bucket as one: their runs together, the median and range over all of them."""
    runs = (first.get("tokens_per_s_runs") or [first["tokens_per_s"]]) + (
        more.get("tokens_per_s_runs") or [more["tokens_per_s"]]
    )
    return more | {
        "tokens_per_s": statistics.median(runs),
        "tokens_per_s_range": [min(runs), max(runs)],
        "tokens_per_s_runs": runs,
    }


def _close(kept: float | None, now: float) -> bool:
    return kept is not None and abs(kept - now) <= 0.01 * abs(now)


def throughput_check(
    plan: Plan,
    profile: Profile,
    s: MeasureSettings,
    on_row: Callable[[dict], None] | None = None,
    keep: dict[int, dict] | None = None,
) -> dict:
    """Measured decode tokens/s per bucket against the plan, at the plan's context length (this device); `on_row`
    receives each bucket's row as it is measured. `keep` maps a batch to a row of an earlier check that stands
    (a repair re-checks only what failed or was re-planned): it is kept where the bucket's D is the same and its
    prediction moved by less than 1%.

    Between the timed runs of each bucket the device's speed is probed against profile time (`DeviceSpeed`);
    the gate compares the prediction with the measurement brought back to profile-time speed run by run, so
    that a machine that is busier than when it was profiled does not fail a right plan. The raw error is kept
    beside it, and a drift beyond the tolerance is reported as a reason to re-profile.
    """
    if plan.projected:
        return {"checked": False, "why": f"the plan is for {plan.device.name} (modeled), not this device"}
    other = another_device(profile.device)
    if other:
        return {
            "checked": False,
            "why": f"the profile was measured on another device ({other}): throughput is checked where it was measured",
        }
    target = load_model(profile.target["path"], dtype=profile.device.get("dtype") or "auto")
    drafter = plan_drafter(plan, profile, target)
    pool = context_prompts(target, plan.ctx, s.new_tokens, plan.max_draft_len, "all")
    if not pool:
        return {"checked": False, "why": f"no calibration prompt reaches the plan's context of {plan.ctx} tokens"}
    speed = DeviceSpeed(target, profile, plan.ctx, s.seed)
    rows = []
    recheck_left_s = s.recheck_s
    for b in plan.buckets:
        B, D = b.batch, b.draft_len
        kept = (keep or {}).get(B)
        if (
            kept is not None
            and kept["draft_len"] == D
            and _close(kept.get("predicted_tokens_per_s"), b.predicted.tokens_per_s.value)
        ):
            rows.append(kept | {"kept_from_the_previous_check": True})
            continue
        n = B * -(-s.rows // B)  # small batches decode several batches, so that AL is not one or two prompts'
        try:

            def decode(between: Callable[[], None], n: int = n, D: int = D, B: int = B) -> dict:
                return measure_decode(
                    target,
                    drafter,
                    [pool[i % len(pool)] for i in range(n)],
                    D,
                    s.new_tokens,
                    s.repeats,
                    s.seed,
                    batch_size=B,
                    between=between,
                )

            started = time.perf_counter()
            decoded, ratios = speed.measure(decode, batch=B, draft_len=D)
            once_s = time.perf_counter() - started
            row = bucket_row(b, decoded, ratios, s.tolerance_pct)
            # measure until it can say, while the runs and the re-measuring time last
            while row["verdict"] == "inconclusive" and row["runs"] < MORE_RUNS * s.repeats:
                if once_s > recheck_left_s:
                    row["left_open"] = f"the check's {s.recheck_s:g} s for measuring open verdicts again ran out"
                    break
                started = time.perf_counter()
                more, more_ratios = speed.measure(decode, batch=B, draft_len=D)
                recheck_left_s -= time.perf_counter() - started
                decoded, ratios = merged_decodes(decoded, more), ratios + more_ratios
                row = bucket_row(b, decoded, ratios, s.tolerance_pct)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            rows.append({"batch": B, "draft_len": D, "infeasible": "out of memory on this device now"})
        else:
            reference = speed.reference(B, D)
            if reference is not None:
                row["speed_reference"] = {"batch": reference[0], "tokens": reference[1]}
            rows.append(row)
        if on_row:
            on_row(rows[-1])
    timed = [r for r in rows if "infeasible" not in r]
    if not timed:
        return {"checked": False, "why": "every bucket ran out of memory on this device", "buckets": rows}
    worst = max(timed, key=lambda r: abs(r["error_pct"]))
    drift = max(abs(r["device_speed_ratio"] - 1) for r in timed) * 100
    result = {
        "checked": True,
        "tolerance_pct": s.tolerance_pct,
        "new_tokens": s.new_tokens,
        "buckets": rows,
        "measured_rounds": "rounds with every row of the batch decoding (a continuously batched server's steady state)",
        "passed": all(r["within"] for r in timed),
        "failed": any(r["verdict"] == "failed" for r in timed),
        "inconclusive_batches": [r["batch"] for r in timed if r["verdict"] == "inconclusive"],
        "worst": {"batch": worst["batch"], "error_pct": worst["error_pct"]},
        "rule": (
            f"a bucket passes when the 95% interval of its runs at profile-time speed lies within {s.tolerance_pct:g}% "
            "of the prediction, or, beyond it, when that interval overlaps the prediction's and is narrower than the "
            "plan's margin at the bucket (inside the noise); it fails when the two intervals are apart beyond the "
            f"tolerance; otherwise it is measured again (up to {MORE_RUNS}x its runs, within {s.recheck_s:g} s over "
            "all buckets) and else inconclusive"
        ),
        "speed_scaling": (
            "each timed run's tokens/s times the speed ratio probed on either side of it (the probed step's time "
            "now over its profile time), median over the runs; a bucket that does not speculate is probed on the "
            "two-token step, which its prediction does not read"
        ),
        "device_drift_pct": drift,
    }
    if speed.why:
        result["device_speed"] = f"not probed: {speed.why}"
    if len(timed) < len(rows):
        result["infeasible_batches"] = [r["batch"] for r in rows if "infeasible" in r]
    if drift > s.tolerance_pct:
        result["warning"] = (
            f"this device runs the target {drift:.0f}% away from its speed at profile time: "
            "re-profile on a quiet machine before trusting absolute figures"
        )
    return result
