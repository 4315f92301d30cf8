"""Proof that a bundle is right before it ships: configs against each engine's rules, the losslessness
gate, and predicted against measured throughput on the local device.

    configs     each engine document against the engine's own config classes where the engine is
                importable, else the versioned JSON Schema under schemas/ plus the engine's cross-field rules
    lossless    the plan's mechanism at each D > 0 of the schedule, on held-back prompts, fp32: greedy
                speculative output token for token equal to plain greedy output
    throughput  decode tokens/s at each bucket's batch with its D (the profile's dtype, every row decoding
                the full length), each timed run brought back to profile-time speed by the probes on either
                side of it (`DeviceSpeed`), against the plan's prediction; relative error per bucket
    repair      a failed throughput check names the verify cells its failing buckets' predictions rest on
                (`prediction_cells`); export re-measures them, re-plans and checks again (bundle.py), and
                refuses only when the disagreement survives (`throughput_refusal`)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import jsonschema
import torch

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.exporters.engine_checks import EngineMissing, Facts
from specdec_tune.exporters.engines import Engine, load_schema
from specdec_tune.profiles.calibration import select_prompts
from specdec_tune.profiles.decode_run import decode_prompts
from specdec_tune.profiles.drafters import create
from specdec_tune.profiles.fingerprint import device_fingerprint, resolve_device
from specdec_tune.profiles.models.loading import load_model
from specdec_tune.profiles.profiler import VerifyStep
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.profiles.timing import is_out_of_memory
from specdec_tune.settings import MeasureSettings


def check_document(engine: Engine, document: dict | None, version: str, folder: Path | None = None, facts: Facts | None = None) -> dict:
    """One engine's config: its JSON Schema and its rules at `version`, and, given the written files' folder and what
    they should run, the engine's own code where it runs here (engine_checks.py); the record says which ran."""
    if document is None:
        return {"engine": engine.name, "checked_with": "nothing to check (no config for this plan)", "errors": []}
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
              for e in jsonschema.Draft202012Validator(load_schema(engine)).iter_errors(document)]
    errors += engine.rules(document, version)
    record = {"engine": engine.name, "checked_with": f"JSON Schema {engine.schema} + the cross-field rules of {engine.name} {version}"}
    if engine.native_check is not None and folder is not None and facts is not None:
        try:
            native = engine.native_check(document, folder, facts)
        except EngineMissing as e:
            record["engine_code"] = f"not run: {e}"
        else:
            record["engine_code"] = native["checked_with"]
            errors += native["errors"]
            record |= {"engine_notes": native["notes"]} if native.get("notes") else {}
    return record | {"errors": errors}


PROBE_REPEATS = 5  # timed calls of a speed probe (median): the gate scales its prediction by the ratio, so it gets more than a guard
WARMUP_TOKENS = 8  # a decode's warm-up: the first batch, this many tokens (allocator and caches; not timed)


def _prompts_by_domain(target, n: int, new_tokens: int, max_draft: int, split: str = "held_back") -> list[tuple[list[int], str]]:
    """(token ids, domain) of the first n calibration prompts of a split."""
    return prompts_by_domain(target.tokenizer, target.model.config.max_position_embeddings, n, new_tokens, max_draft, split)


def prompts_by_domain(tokenizer, context_tokens: int, n: int, new_tokens: int, max_draft: int, split: str) -> list[tuple[list[int], str]]:
    chosen = select_prompts("default", split, n)
    ids = encode_prompts(tokenizer, chosen, context_tokens=context_tokens, max_new_tokens=new_tokens, max_draft_tokens=max_draft)
    return list(zip(ids, [p.domain for p in chosen.prompts]))


def _prompts(target, n: int, new_tokens: int, max_draft: int, split: str = "held_back") -> list[list[int]]:
    return [ids for ids, _ in _prompts_by_domain(target, n, new_tokens, max_draft, split)]


def plan_drafter(plan: dict, profile, target):
    info = next((d for d in profile.drafters if d.name == plan["mechanism"]), None)
    if info is None:
        raise SpecdecError(f"the profile has no drafter {plan['mechanism']!r}", "export with the profile the plan was searched on")
    options = {k: str(v) for k, v in info.options.items() if v not in ("", None)}
    drafter = create(plan["mechanism"], target, options)
    return drafter.with_quantized_weights(plan["quant"]) if plan["quant"] != "none" else drafter


def lossless_gate(plan: dict, profile, s: MeasureSettings) -> dict:
    """Greedy speculative output against plain greedy output at each D > 0 of the schedule.

    Returns {"applicable": True, "passed": bool, "runs": [...], ...}, or, for a plan that never speculates (D = 0 in
    every bucket: nothing to compare), {"applicable": False, "passed": None, "note": ...}: neither a pass nor a failure.
    """
    ds = sorted({b["draft_len"] for b in plan["buckets"] if b["draft_len"] > 0})
    if not ds:
        return {"applicable": False, "passed": None, "draft_lens": [], "note": "the plan never speculates"}
    target = load_model(profile.target["path"], dtype="float32")
    drafter = plan_drafter(plan, profile, target)
    ids = _prompts(target, s.prompts, s.new_tokens, max(ds))
    stop = list(target.model.config.eos_token_ids)
    kwargs = dict(max_new_tokens=s.new_tokens, temperature=0.0, seed=s.seed, stop_token_ids=stop)
    plain, _, _ = decode_prompts(target, ids, len(ids), **kwargs)
    runs = []
    for D in ds:
        spec, _, _ = decode_prompts(target, ids, len(ids), drafter=drafter, num_draft_tokens=D, **kwargs)
        same = sum(a == b for a, b in zip(spec, plain))
        runs.append({"draft_len": D, "prompts": len(ids), "identical": same})
    return {"applicable": True, "passed": all(r["identical"] == r["prompts"] for r in runs), "dtype": "float32", "split": "held_back",
            "runs": runs}


def context_prompts_by_domain(target, ctx: int, new_tokens: int, max_draft: int, split: str, whole: bool = False) -> list[tuple[list[int], str]]:
    """(ids, domain) of the calibration prompts at least ctx − new_tokens/2 tokens long, cut to that length from the
    left (the chat template's reply header stays last), so that the KV cache averages `ctx` over the decode. The
    length filter favours the domains of long prompts (HumanEval, extraction): the domains say what was decoded.
    `whole`: the prompts between half that length and all of it, uncut (`cut_to_context`)."""
    return cut_to_context(_prompts_by_domain(target, 1000, new_tokens, max_draft, split=split), ctx, new_tokens, whole)


def cut_to_context(prompts: list[tuple[list[int], str]], ctx: int, new_tokens: int, whole: bool = False) -> list[tuple[list[int], str]]:
    """The prompts of a decode at context `ctx`: each long enough cut to its last ctx − new_tokens/2 tokens, or (`whole`)
    only those between half that length and all of it, as they are. A cut drops text a lookup drafter would copy from
    (the document an extraction prompt asks about), while the profile measures acceptance on whole prompts; whole
    prompts keep that, at a KV cache a little shorter than `ctx`."""
    length = max(1, ctx - new_tokens // 2)
    if whole:
        return [(ids, domain) for ids, domain in prompts if length // 2 <= len(ids) <= length]
    return [(ids[-length:], domain) for ids, domain in prompts if len(ids) >= length]


def context_prompts(target, ctx: int, new_tokens: int, max_draft: int, split: str) -> list[list[int]]:
    return [ids for ids, _ in context_prompts_by_domain(target, ctx, new_tokens, max_draft, split)]


def measure_decode(target, drafter, ids: list[list[int]], D: int, new_tokens: int, repeats: int, seed: int = 0,
                   batch_size: int | None = None, between: Callable[[], None] = lambda: None) -> dict:
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
    kwargs = dict(drafter=drafter if D else None, num_draft_tokens=D, max_new_tokens=new_tokens, temperature=0.0, seed=seed, stop_token_ids=())
    generate(target.model, ids[:B], **(kwargs | {"max_new_tokens": min(new_tokens, WARMUP_TOKENS)}))  # warm-up
    rates = []
    between()
    for _ in range(repeats):
        tokens, seconds, counters = 0, 0.0, []
        for start in range(0, len(ids), B):
            out = generate(target.model, ids[start : start + B], **kwargs)
            tokens, seconds, counters = tokens + out.full_batch_tokens, seconds + out.full_batch_s, counters + out.per_prompt
        rates.append(tokens / seconds)
        between()
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_range": [min(rates), max(rates)], "tokens_per_s_runs": rates,
            "tokens_per_forward": SpecCounters.total(counters).tokens_per_target_forward}


class DeviceSpeed:
    """This device's speed now against profile time, probed between the timed runs of each measurement.

    The probe is one verify step (the bucket's batch, one token, `ctx` cached), a step the profile measured.
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
        self.profiled_ms = {p.batch: p.median_ms for p in profile.verify
                            if (p.tokens, p.ctx) == (1, ctx) and p.source in ("measured", "fitted") and p.median_ms}
        self.why = None if self.profiled_ms else f"the profile has no measured verify step with one token at ctx {ctx}"
        self.probes: dict[int, Callable[[], float]] = {}

    def probed_batch(self, batch: int) -> int | None:
        """The batch whose profiled step stands for `batch`: itself where measured, else the nearest measured one."""
        return min(self.profiled_ms, key=lambda b: (abs(b - batch), b)) if self.profiled_ms else None

    def measure(self, fn: Callable[[Callable[[], None]], object], batch: int = 1) -> tuple[object, list[float]]:
        """(fn's result, the speed ratio now / at profile time of each of its timed runs, probed at `batch`'s step).

        `fn` receives `between`, to call before its first timed run and after each (as `measure_decode` does);
        a probe is added where it called fewer than two."""
        probed = self.probed_batch(batch)
        if probed is None:
            return fn(lambda: None), [1.0]
        if probed not in self.probes:
            step = VerifyStep(self.target.model, probed, self.ctx, 1, self.seed)
            self.probes[probed] = lambda: step.timing(1, warmup=1, repeats=PROBE_REPEATS).median_ms
        probes_ms: list[float] = []
        result = fn(lambda: probes_ms.append(self.probes[probed]()))
        while len(probes_ms) < 2:
            probes_ms.append(self.probes[probed]())
        return result, [(a + b) / 2 / self.profiled_ms[probed] for a, b in zip(probes_ms, probes_ms[1:])]


def _another_device(profiled: dict) -> str:
    """How this device differs from the profiled one in what sets its speed ('' when it is the same kind)."""
    here = device_fingerprint(resolve_device("cuda" if profiled.get("kind") == "cuda" and torch.cuda.is_available() else "cpu"), torch.float32)
    return "; ".join(f"{key} {profiled.get(key)!r} there, {here.get(key)!r} here" for key in ("kind", "name", "threads")
                     if key in profiled and profiled.get(key) != here.get(key))


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


def bucket_row(bucket: dict, decoded: dict, ratios: list[float], tolerance_pct: float) -> dict:
    """One bucket of the throughput check: its prediction against its measurement at profile-time speed.

        at profile speed   c_i = r_i x ratio_i  (run i's tokens/s r_i; ratio_i probed on either side of it)
        error              predicted / median_i(c_i) - 1,  the same as the prediction at the current speed
                           (predicted x m / median(c), m the median raw tokens/s) against m
        inside the noise   the prediction's 95% interval overlaps [min_i c_i, max_i c_i]
    """
    figure = bucket["predicted"]["tokens_per_s"]
    predicted, measured = figure["value"], decoded["tokens_per_s"]
    corrected, at_profile_speed = at_profile_speed_tokens_per_s(decoded, ratios)
    scale = measured / corrected  # the prediction at the current speed = predicted x scale
    low, high = figure.get("low") or predicted, figure.get("high") or predicted
    inside_noise = low <= max(at_profile_speed) and min(at_profile_speed) <= high
    error_pct = 100 * (predicted / corrected - 1)
    return {"batch": bucket["batch"], "draft_len": bucket["draft_len"], "predicted_tokens_per_s": predicted, "predicted_source": figure["source"],
            "device_speed_ratio": 1 / scale, "device_speed_ratio_runs": ratios, "predicted_at_current_speed_tokens_per_s": predicted * scale,
            "predicted_interval_tokens_per_s": [low, high], "predicted_interval_at_current_speed_tokens_per_s": [low * scale, high * scale],
            "measured_tokens_per_s": measured,
            "measured_range_tokens_per_s": decoded.get("tokens_per_s_range", [measured, measured]),
            "measured_at_profile_speed_range_tokens_per_s": [min(at_profile_speed), max(at_profile_speed)],
            "raw_error_pct": 100 * (predicted - measured) / measured, "error_pct": error_pct, "inside_noise": inside_noise,
            "within": abs(error_pct) <= tolerance_pct or inside_noise}


def _close(kept: float | None, now: float) -> bool:
    return kept is not None and abs(kept - now) <= 0.01 * abs(now)


def throughput_check(plan: dict, profile, s: MeasureSettings, on_row: Callable[[dict], None] | None = None,
                     keep: dict[int, dict] | None = None) -> dict:
    """Measured decode tokens/s per bucket against the plan, at the plan's context length (this device); `on_row`
    receives each bucket's row as it is measured. `keep` maps a batch to a row of an earlier check that stands
    (a repair re-checks only what failed or was re-planned): it is kept where the bucket's D is the same and its
    prediction moved by less than 1%.

    Between the timed runs of each bucket the device's speed is probed against profile time (`DeviceSpeed`);
    the gate compares the prediction with the measurement brought back to profile-time speed run by run, so
    that a machine that is busier than when it was profiled does not fail a right plan. The raw error is kept
    beside it, and a drift beyond the tolerance is reported as a reason to re-profile.
    """
    if plan["device"].get("projected_from"):
        return {"checked": False, "why": f"the plan is for {plan['device']['name']} (modeled), not this device"}
    other = _another_device(profile.device)
    if other:
        return {"checked": False, "why": f"the profile was measured on another device ({other}): throughput is checked where it was measured"}
    target = load_model(profile.target["path"], dtype=profile.device.get("dtype", "auto"))
    drafter = plan_drafter(plan, profile, target)
    pool = context_prompts(target, plan["ctx"], s.new_tokens, plan["max_draft_len"], "all")
    if not pool:
        return {"checked": False, "why": f"no calibration prompt reaches the plan's context of {plan['ctx']} tokens"}
    speed = DeviceSpeed(target, profile, plan["ctx"], s.seed)
    rows = []
    for b in plan["buckets"]:
        B, D = b["batch"], b["draft_len"]
        kept = (keep or {}).get(B)
        if kept is not None and kept["draft_len"] == D and _close(kept.get("predicted_tokens_per_s"), b["predicted"]["tokens_per_s"]["value"]):
            rows.append(kept | {"kept_from_the_previous_check": True})
            continue
        n = B * -(-s.rows // B)  # small batches decode several batches, so that AL is not one or two prompts'
        try:
            decoded, ratios = speed.measure(lambda between: measure_decode(target, drafter, [pool[i % len(pool)] for i in range(n)], D,
                                                                           s.new_tokens, s.repeats, s.seed, batch_size=B, between=between),
                                            batch=B)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            rows.append({"batch": B, "draft_len": D, "infeasible": "out of memory on this device now"})
        else:
            rows.append(bucket_row(b, decoded, ratios, s.tolerance_pct))
        if on_row:
            on_row(rows[-1])
    timed = [r for r in rows if "infeasible" not in r]
    if not timed:
        return {"checked": False, "why": "every bucket ran out of memory on this device", "buckets": rows}
    worst = max(timed, key=lambda r: abs(r["error_pct"]))
    drift = max(abs(r["device_speed_ratio"] - 1) for r in timed) * 100
    result = {"checked": True, "tolerance_pct": s.tolerance_pct, "new_tokens": s.new_tokens, "buckets": rows,
              "measured_rounds": "rounds with every row of the batch decoding (a continuously batched server's steady state)",
              "passed": all(r["within"] for r in timed), "worst": {"batch": worst["batch"], "error_pct": worst["error_pct"]},
              "rule": f"a bucket passes when its error at the current speed is within {s.tolerance_pct:g}%, or when the prediction's "
                      "95% interval and the range of the timed runs at profile-time speed overlap (a difference inside the noise)",
              "speed_scaling": "each timed run's tokens/s times the speed ratio probed on either side of it (the probed step's time now "
                               "over its profile time), median over the runs",
              "device_drift_pct": drift}
    if speed.why:
        result["device_speed"] = f"not probed: {speed.why}"
    if len(timed) < len(rows):
        result["infeasible_batches"] = [r["batch"] for r in rows if "infeasible" in r]
    if drift > s.tolerance_pct:
        result["warning"] = (f"this device runs the target {drift:.0f}% away from its speed at profile time: "
                             "re-profile on a quiet machine before trusting absolute figures")
    return result


def describe_throughput_row(r: dict) -> str:
    """One bucket of the throughput check, as the report and the CLI print it."""
    if "infeasible" in r:
        return f"batch {r['batch']}, D={r['draft_len']}: infeasible ({r['infeasible']})"
    noise = ""
    if r.get("inside_noise"):
        (b_lo, b_hi), (m_lo, m_hi) = r["predicted_interval_tokens_per_s"], r["measured_at_profile_speed_range_tokens_per_s"]
        noise = f"; inside the noise (predicted [{b_lo:.1f}–{b_hi:.1f}], the runs at profile-time speed [{m_lo:.1f}–{m_hi:.1f}])"
    return (f"batch {r['batch']}, D={r['draft_len']}: predicted {r['predicted_tokens_per_s']:.0f} tokens/s ({r['predicted_source']}) "
            f"({r['predicted_at_current_speed_tokens_per_s']:.0f} at the device's current speed, x{1 / r['device_speed_ratio']:.3f}), "
            f"measured {r['measured_tokens_per_s']:.0f}: {r['error_pct']:+.1f}% ({r['raw_error_pct']:+.1f}% unscaled){noise}")


# ---------------------------------------------------------------------------- repair: the cells behind a failed check


def failing_rows(tp: dict) -> list[dict]:
    """The timed buckets of a throughput check outside its tolerance and outside the noise (none where the check did
    not run)."""
    if not tp.get("checked"):
        return []
    return [r for r in tp["buckets"] if "error_pct" in r and not r.get("within", abs(r["error_pct"]) <= tp["tolerance_pct"])]


def round_widths(cost, mechanism: str, quant: str, batch: int, draft_len: int) -> list[int]:
    """The round widths w (the batch verifies 1+w tokens) whose verify time the cost model weighs at this draft
    length: every w the batch's longest proposal takes with a share of the rounds (cost_model.py,
    `round_verify_ms`), or D alone where every round drafts D."""
    if draft_len == 0:
        return [0]
    shares = cost.acceptance(mechanism, quant).round_shares(draft_len)
    if shares is None or shares[-1] >= 1 - 1e-12:
        return [draft_len]
    widths, below = [], 0.0
    for w in range(draft_len + 1):
        at_most = sum(shares[: min(w, len(shares) - 1) + 1]) ** batch if w < draft_len else 1.0
        if at_most - below > 1e-12:
            widths.append(w)
        below = at_most
    return widths


def prediction_cells(plan: dict, profile, batch: int, draft_len: int) -> list[tuple[int, int, int]]:
    """The profile's verify cells (batch, tokens, ctx) a bucket's predicted tokens/s rests on, at the plan's context:
    one token (no speculation), 1+D, and 1+w for every round width w the prediction weighed. Cells that ran out of
    memory when profiled are left out (there is nothing to re-measure)."""
    ctx = plan["ctx"]
    tokens = {1, 1 + draft_len}
    if draft_len:
        cost = CostModel(profile, ctx=ctx, mix=plan.get("mix"))
        tokens |= {1 + w for w in round_widths(cost, plan["mechanism"], plan["quant"], batch, draft_len)}
    timed = {(p.batch, p.tokens) for p in profile.verify if p.ctx == ctx and p.median_ms is not None}
    return [(batch, t, ctx) for t in sorted(tokens) if (batch, t) in timed]


def cell_ms(profile, cell: tuple[int, int, int]) -> float | None:
    """A verify cell's time in the profile (its fitted median), None where it has none."""
    return next((p.median_ms for p in profile.verify if (p.batch, p.tokens, p.ctx) == cell), None)


def schedule_of(plan: dict) -> dict:
    return {"mechanism": plan["mechanism"], "quant": plan["quant"], "schedule": [[b["batch"], b["draft_len"]] for b in plan["buckets"]]}


def _worst_error_pct(tp: dict) -> float | None:
    return tp.get("worst", {}).get("error_pct") if tp.get("checked") else None


def _bucket_figures(r: dict) -> dict:
    return {"batch": r["batch"], "draft_len": r["draft_len"], "predicted_tokens_per_s": r["predicted_tokens_per_s"],
            "predicted_at_current_speed_tokens_per_s": r["predicted_at_current_speed_tokens_per_s"],
            "measured_tokens_per_s": r["measured_tokens_per_s"], "error_pct": r["error_pct"]}


def repair_record(round_number: int, plan_before: dict, tp_before: dict, cells: list[dict], plan_after: dict, tp_after: dict) -> dict:
    """One round of repair as validation.json keeps it: the buckets that failed, the cells re-measured (ms before and
    after), the schedule before and after the re-plan, and the worst error before and after."""
    return {"round": round_number, "failing": [_bucket_figures(r) for r in failing_rows(tp_before)], "cells": cells,
            "before": schedule_of(plan_before), "after": schedule_of(plan_after),
            "worst_error_pct_before": _worst_error_pct(tp_before), "worst_error_pct_after": _worst_error_pct(tp_after),
            "passed": bool(tp_after.get("checked") and tp_after.get("passed"))}


def schedule_text(s: dict) -> str:
    return f"{s['mechanism']}/{s['quant']} " + ", ".join(f"B={B}: D={D}" for B, D in s["schedule"])


def _cell_change_text(c: dict) -> str:
    return f"verify cell B={c['batch']}, 1+D={c['tokens']}, ctx {c['ctx']}: {_ms(c['before_ms'])} -> {_ms(c['after_ms'])} ms ({c['source']})"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "not measured" if value is None else f"{value:+.1f}%"


def describe_repair(record: dict) -> list[str]:
    """One round of repair as the CLI prints it and the report lists it: a headline, then what changed."""
    failing = "; ".join(f"batch {r['batch']}, D={r['draft_len']}: predicted {r['predicted_at_current_speed_tokens_per_s']:.1f} tokens/s, "
                        f"measured {r['measured_tokens_per_s']:.1f} ({r['error_pct']:+.1f}%)" for r in record["failing"])
    outcome = "passed" if record["passed"] else "still failing"
    lines = [f"repair round {record['round']}: re-measured the verify cells behind {failing}"]
    lines += [f"  {_cell_change_text(c)}" for c in record["cells"]]
    before, after = schedule_text(record["before"]), schedule_text(record["after"])
    lines.append(f"  schedule {before} -> {after}" if before != after else f"  schedule unchanged: {after}")
    lines.append(f"  worst error {_pct(record['worst_error_pct_before'])} -> {_pct(record['worst_error_pct_after'])} ({outcome})")
    return lines


def _first_before_ms(repairs: list[dict]) -> dict[tuple[int, int, int], float | None]:
    """Each re-measured cell's time before its first re-measurement."""
    first: dict[tuple[int, int, int], float | None] = {}
    for record in repairs:
        for c in record["cells"]:
            first.setdefault((c["batch"], c["tokens"], c["ctx"]), c["before_ms"])
    return first


def _cells_text(plan: dict, profile, r: dict, first_ms: dict) -> str:
    if plan["device"].get("projected_from"):
        return f"its verify times modeled for {plan['device']['name']}"
    cells = prediction_cells(plan, profile, r["batch"], r["draft_len"])
    parts = []
    for cell in cells:
        now = _ms(cell_ms(profile, cell))
        parts.append(f"1+D={cell[1]} {_ms(first_ms[cell])} -> {now} ms" if cell in first_ms else f"1+D={cell[1]} {now} ms")
    return f"verify cells at B={r['batch']}, ctx {plan['ctx']}: " + ", ".join(parts)


def throughput_refusal(plan: dict, profile, tp: dict, repairs: list[dict], not_repaired: str | None = None) -> SpecdecError:
    """The one-line error of a throughput check that still fails: each failing bucket with its predicted and measured
    tokens/s and the verify cells (ms) its prediction rests on, after how many rounds of re-measuring."""
    first_ms = _first_before_ms(repairs)
    buckets = "; ".join(f"batch {r['batch']}, D={r['draft_len']}: predicted {r['predicted_at_current_speed_tokens_per_s']:.1f} tokens/s, "
                        f"measured {r['measured_tokens_per_s']:.1f} ({r['error_pct']:+.1f}%), {_cells_text(plan, profile, r, first_ms)}"
                        for r in failing_rows(tp))
    if repairs:
        when = f"after {len(repairs)} round(s) of re-measuring the cells and re-planning"
        fix = ("the disagreement is not a slow spell in those cells: re-profile on a quiet machine (specdec-tune profile --force), "
               "or raise --tolerance; profile.json and plan.json keep the re-measured cells and the re-plan")
    else:
        when = f"not repaired: {not_repaired}" if not_repaired else "not repaired"
        fix = "re-profile on this machine, or raise --tolerance"
    return SpecdecError(f"throughput check failed (tolerance {tp['tolerance_pct']:g}%, {when}): {buckets}", fix)
