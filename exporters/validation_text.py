"""Validation records in words: the lines the CLI prints as each check ends and the bundle's report lists.

The records come from the checks that measure (pipeline/); rendering them is the exporters' job, so the report and the
CLI say a check's outcome alike."""

from __future__ import annotations

PROMPT_WAYS = {
    "whole": "whole (those that fit the context)",
    "cut": "cut to the context",
}  # the engine check's held-back prompts


def schedule_of(plan) -> dict:
    """A plan's mechanism, weight format and schedule, as a repair record keeps them before and after a re-plan."""
    return {"mechanism": plan.mechanism, "quant": plan.quant, "schedule": [list(bd) for bd in plan.schedule]}


def lossless_text(gate: dict | None) -> str:
    """The lossless gate's outcome in words: passed, FAILED, not applicable (a plan that never speculates has
    nothing to compare), or skipped."""
    if not gate:
        return "not run"
    if "skipped" in gate:
        return f"skipped ({gate['skipped']})"
    if gate.get("applicable") is False:
        return f"not applicable ({gate.get('note', 'the plan never speculates')})"
    return "passed" if gate["passed"] else "FAILED"


def throughput_text(tp: dict) -> str:
    """The throughput check's outcome in words (pipeline/throughput_check.py, "Verdicts"): passed, FAILED at the
    batches that failed, inconclusive at the batches it could not judge, not applicable (with why), or skipped."""
    if "skipped" in tp:
        return f"skipped ({tp['skipped']})"
    if tp.get("error"):
        return f"FAILED ({tp['error']})"
    if not tp.get("checked"):
        return f"not applicable ({tp.get('why', 'not run')})"
    failed = [r["batch"] for r in tp.get("buckets", []) if r.get("verdict") == "failed"]
    if failed or tp.get("failed") or not tp.get("passed", False) and not tp.get("inconclusive_batches"):
        return "FAILED" + (f" at batch {', '.join(map(str, failed))}" if failed else "")
    if tp.get("inconclusive_batches"):
        return f"inconclusive at batch {', '.join(map(str, tp['inconclusive_batches']))}"
    return "passed"


def tolerance_forgone(plan) -> dict | None:
    """What the tie tolerance (a shorter draft, a drafter listed first) gave up in the plan: the drafter and schedule
    every expected difference would decide and its expected gain in mean speedup (None where the tolerance changed
    nothing)."""
    untied, other = plan.study.untied_schedule, plan.study.untied_drafter
    if not untied or not other and [D for _, D in untied] == [D for _, D in plan.schedule]:
        return None
    return {
        "mechanism": (other or {}).get("mechanism", plan.mechanism),
        "schedule": [list(bd) for bd in untied],
        "expected_gain_pct": plan.study.untied_gain_pct,
    }


def summary_line(v: dict, where: str = "") -> str:
    """The export's one line: configs, how many buckets speculate, each gate's outcome, and what the shorter-draft
    tolerance gave up (the manifest's `validation`)."""
    batches = v.get("speculating_batches", [])
    speculates = (
        f"speculates at {len(batches)} of {v['buckets']} buckets (batch {', '.join(map(str, batches))})"
        if batches
        else f"speculates at none of {v.get('buckets', 0)} buckets: the bundle serves plain decoding"
    )
    worst, drift = v.get("throughput_worst_error_pct"), v.get("device_drift_pct")
    throughput = f"throughput{where} {v.get('throughput', 'not run')}"
    if worst is not None:
        throughput += f", worst error {worst:+.1f}%"
    if worst is not None and drift is not None:
        throughput += f" at the device's current speed ({drift:.1f}% from profile time)"
    forgone = v.get("tolerance_forgone")
    tie = (
        f"the tie tolerance gives up {forgone['expected_gain_pct']:+.1f}% expected mean speedup ("
        + (f"{forgone['mechanism']} " if forgone.get("mechanism") else "")
        + "D = "
        + ", ".join(str(D) for _, D in forgone["schedule"])
        + " without it)"
        if forgone
        else "no expected gain given up to the tie tolerance"
    )
    return f"validated: configs ok; {speculates}; lossless {v['lossless']}; {throughput}; {tie}"


def describe_throughput_row(r: dict) -> str:
    """One bucket of the throughput check, as the report and the CLI print it."""
    if "infeasible" in r:
        return f"batch {r['batch']}, D={r['draft_len']}: infeasible ({r['infeasible']})"
    said = ""
    if r.get("verdict") in ("inside the noise", "inconclusive", "failed"):
        (b_lo, b_hi) = r["predicted_interval_tokens_per_s"]
        m_lo, m_hi = (
            r.get("measured_at_profile_speed_interval_tokens_per_s")
            or r["measured_at_profile_speed_range_tokens_per_s"]
        )
        said = (
            f"; {r['verdict']} (predicted [{b_lo:.1f}–{b_hi:.1f}], measured at profile-time speed [{m_lo:.1f}–"
            f"{m_hi:.1f}] over {r.get('runs', '?')} runs; the plan's margin here {r.get('margin_pct', 0):.1f}%"
            + (f"; left open: {r['left_open']})" if r.get("left_open") else ")")
        )
    return (
        f"batch {r['batch']}, D={r['draft_len']}: predicted {r['predicted_tokens_per_s']:.0f} tokens/s "
        f"({r['predicted_source']}) ({r['predicted_at_current_speed_tokens_per_s']:.0f} at the device's current speed, "
        f"x{1 / r['device_speed_ratio']:.3f}), measured {r['measured_tokens_per_s']:.0f}: {r['error_pct']:+.1f}% "
        f"({r['raw_error_pct']:+.1f}% unscaled){said}"
    )


def schedule_text(s: dict) -> str:
    return f"{s['mechanism']}/{s['quant']} " + ", ".join(f"B={B}: D={D}" for B, D in s["schedule"])


def _cell_change_text(c: dict) -> str:
    return (
        f"verify cell B={c['batch']}, 1+D={c['tokens']}, ctx {c['ctx']}: {ms_text(c['before_ms'])} -> "
        f"{ms_text(c['after_ms'])} ms ({c['source']})"
    )


def ms_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "not measured" if value is None else f"{value:+.1f}%"


def describe_repair(record: dict) -> list[str]:
    """One round of repair as the CLI prints it and the report lists it: a headline, then what changed."""
    failing = "; ".join(
        f"batch {r['batch']}, D={r['draft_len']}: predicted {r['predicted_at_current_speed_tokens_per_s']:.1f} "
        f"tokens/s, measured {r['measured_tokens_per_s']:.1f} ({r['error_pct']:+.1f}%)"
        for r in record["failing"]
    )
    outcome = "passed" if record["passed"] else "still failing" if record.get("failed", True) else "inconclusive"
    lines = [f"repair round {record['round']}: re-measured the verify cells behind {failing}"]
    lines += [f"  {_cell_change_text(c)}" for c in record["cells"]]
    before, after = schedule_text(record["before"]), schedule_text(record["after"])
    lines.append(f"  schedule {before} -> {after}" if before != after else f"  schedule unchanged: {after}")
    lines.append(
        f"  worst error {_pct(record['worst_error_pct_before'])} -> {_pct(record['worst_error_pct_after'])} ({outcome})"
    )
    return lines


def describe_kv(kv: dict) -> str:
    where = (
        f"its pool of {kv['pool_bytes'] / 2**30:g} GiB"
        if kv.get("pool_bytes")
        else "the memory budget less weights and activations"
    )
    return (
        f"KV cache: vLLM allocated {kv['num_blocks']} blocks x {kv['block_size']} = {kv['engine_tokens']} tokens; "
        f"the memory model predicts {kv['predicted_tokens']} ({where} over {kv['kv_bytes_per_token']:.0f} bytes per "
        f"token): {kv['error_pct']:+.1f}%" + ("" if kv["within"] else f" [beyond {kv['tolerance_pct']:g}%]")
    )


def describe_row(r: dict) -> str:
    if "error_pct" not in r:
        return f"batch {r['batch']}, D={r['draft_len']}: not measured ({r['error']})"
    applied = "" if r["draft_len_ok"] else f", but vLLM ran D={r['draft_len_applied']}"
    flag = "" if r["throughput_within"] else f" [throughput {r.get('verdict', 'beyond the tolerance and the noise')}]"
    return (
        f"batch {r['batch']}, D={r['draft_len']}{applied}{flag}: predicted {r['predicted_tokens_per_s']:.0f} tokens/s "
        f"({r['predicted_source']}), vLLM {r['measured_tokens_per_s']:.0f} "
        f"[{r['measured_interval_tokens_per_s'][0]:.0f}–{r['measured_interval_tokens_per_s'][1]:.0f}]: "
        f"{r['error_pct']:+.1f}%{' (inside the noise)' if r['inside_noise'] else ''}"
        + (
            ""
            if r.get("scaled_error_pct") is None
            else f", {r['scaled_error_pct']:+.1f}% at the profile's reference speed "
            f"(device x{r['device_speed_ratio']:.2f})"
        )
        + f"; tokens per round {r['tokens_per_round']:.3f} against {r['predicted_tokens_per_forward']:.3f} predicted"
    )
