"""report.md and its plots (PNG): the verify curve with tile steps, AL(D) per domain, predicted speedup
per bucket, the Pareto front. Every plotted figure keeps the label of where it came from."""

from __future__ import annotations

from pathlib import Path

from specdec_tune.autotune.plan_schema import Plan
from specdec_tune.exporters.memory_limits import limits_lines
from specdec_tune.exporters.safety import safety_lines
from specdec_tune.exporters.validation_text import (
    PROMPT_WAYS,
    describe_kv,
    describe_repair,
    describe_row,
    describe_throughput_row,
    lossless_text,
)
from specdec_tune.profiles.schema import Profile

PLOTS = ("verify_curve.png", "acceptance_by_domain.png", "speedup_by_bucket.png", "pareto_front.png")


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})  # no tool/version stamp: the same plan gives the same bytes
    plt.close(fig)


def plot_verify(profile: Profile, plan: Plan, path: Path) -> None:
    plt, fig, ax = _figure()
    ctx = profile.workload.ctx_buckets[0]
    for B in profile.workload.batch_buckets:
        if profile.rounds:  # engine rounds of the plan's mechanism (D = 0: the engine's step without speculation)
            pts = sorted(
                (1 + r.draft_len, r.median_ms, r.source)
                for r in profile.rounds
                if r.batch == B and r.ctx == ctx and r.median_ms and r.mechanism in (plan.mechanism, "none")
            )
        else:
            pts = sorted(
                (p.tokens, p.median_ms, p.source)
                for p in profile.verify
                if p.batch == B and p.ctx == ctx and p.median_ms
            )
        if pts:
            ax.plot([t for t, _, _ in pts], [m for _, m, _ in pts], marker="o", ms=3, label=f"B={B}")
    tile, group = plan.tile.rows, plan.tile.group
    if tile > 1:
        for k in range(1, 64):
            t = k * tile / group
            if t > profile.workload.max_draft_len + 1:
                break
            ax.axvline(t, color="grey", ls=":", lw=0.8)
        ax.set_title(f"T_verif(B, 1+D), ctx {ctx}; dotted: G·(1+D) at multiples of the {tile}-row tile")
    else:
        ax.set_title(f"T_verif(B, 1+D), ctx {ctx} (no attention tile on {plan.device.name})", fontsize=9)
    if profile.rounds:
        ax.set_title(
            f"{profile.backend} round T_round(B, D) of {plan.mechanism}, ctx {ctx}: draft + verify + host", fontsize=9
        )
    ax.set_xlabel("tokens verified per sequence (1+D)")
    ax.set_ylabel(f"ms ({plan.device.times})")
    ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_acceptance(profile: Profile, plan: Plan, path: Path) -> None:
    plt, fig, ax = _figure()
    for a in profile.acceptance:
        if a.mechanism == plan.mechanism and a.quant == plan.quant and a.temperature == 0.0:
            ax.plot(
                range(len(a.tokens_per_forward)),
                a.tokens_per_forward,
                lw=2.0 if a.domain == "all" else 0.8,
                label=a.domain,
                color="black" if a.domain == "all" else None,
            )
    ax.set_xlabel("draft length D")
    ax.set_ylabel("tokens per target forward (AL)")
    ax.set_title(f"{plan.mechanism}: AL(D) per domain, greedy (measured at D_max, derived below)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    _save(plt, fig, path)


def plot_speedup(plan: Plan, path: Path) -> None:
    plt, fig, ax = _figure()
    xs = list(range(len(plan.buckets)))
    ys = [b.predicted.speedup.value for b in plan.buckets]
    ax.bar(xs, ys, color=["tab:blue" if b.draft_len else "tab:grey" for b in plan.buckets])
    for x, b in zip(xs, plan.buckets):
        ax.text(
            x,
            b.predicted.speedup.value,
            f"D={b.draft_len}\n{b.predicted.speedup.source}",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(xs, [str(b.batch) for b in plan.buckets])
    ax.set_xlabel("batch size")
    ax.set_ylabel("predicted speedup over no speculation")
    ax.set_title(f"{plan.mechanism}: predicted speedup per batch bucket", fontsize=9)
    _save(plt, fig, path)


def plot_pareto(plan: Plan, path: Path) -> None:
    plt, fig, ax = _figure()
    front = plan.pareto.exact
    ax.plot(
        [p.tokens_per_s.value for p in front],
        [p.per_user_tokens_per_s.value for p in front],
        marker="o",
        label="exact front",
    )
    for p in front:
        ax.annotate(
            f"B={p.max_batch} D={p.draft_len}", (p.tokens_per_s.value, p.per_user_tokens_per_s.value), fontsize=6
        )
    if plan.pareto.study is not None:
        st = plan.pareto.study
        ax.scatter(
            [p.tokens_per_s.value for p in st],
            [p.per_user_tokens_per_s.value for p in st],
            marker="x",
            label="NSGA-II front",
        )
    ax.set_xlabel("tokens/s per device (predicted)")
    ax.set_ylabel("tokens/s per user (predicted)")
    ax.set_title("throughput vs per-user rate", fontsize=9)
    ax.legend(fontsize=7)
    _save(plt, fig, path)


def repairs_text(repairs: list[dict]) -> list[str]:
    """The rounds of repair before the throughput check passed: cells re-measured, schedule and worst error before and
    after."""
    if not repairs:
        return []
    lines = [
        f"- the first throughput check failed; it passed after {len(repairs)} round(s) of re-measuring the verify "
        "cells behind the failing buckets and re-planning (the plan shipped is the re-plan):"
    ]
    for record in repairs:
        headline, *details = describe_repair(record)
        lines += [f"  - {headline}", *(f"    - {line.strip()}" for line in details)]
    return lines


def write_report(folder: Path, plan: Plan, profile: Profile, engines: dict, validation: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    plot_verify(profile, plan, folder / PLOTS[0])
    plot_acceptance(profile, plan, folder / PLOTS[1])
    plot_speedup(plan, folder / PLOTS[2])
    plot_pareto(plan, folder / PLOTS[3])
    lines = [
        f"# Speculative decoding plan: {plan.mechanism} (weights {plan.quant})",
        "",
        f"Target `{plan.profile.target.path}` on {plan.device.name} (times {plan.device.times}); "
        f"objective {plan.objective.kind}; max batch {plan.max_batch}; tile policy {plan.tile.policy}.",
        "",
        "| batch | D | predicted speedup | tokens/s | tokens/s/user | source | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in plan.buckets:
        p = b.predicted
        lines.append(
            f"| {b.batch} | {b.draft_len} | {p.speedup.value:.2f}x | {p.tokens_per_s.value:.0f} | "
            f"{p.per_user_tokens_per_s.value:.1f} | {p.speedup.source} | {b.rationale.text} |"
        )
    single = plan.single_draft_len
    lines += [
        "",
        f"One D for every bucket would be D = {single.draft_len}: mean predicted speedup {single.mean_speedup:.3f}x "
        f"against {single.schedule_mean_speedup:.3f}x for the schedule.",
        "",
        "## Engines",
        "",
    ]
    for name, e in engines.items():
        lines.append(f"- **{name}** (version {e['version']}): " + "; ".join(e["decisions"]))
    lines += ["", "## Validation", ""]
    for c in validation["configs"]:
        lines.append(
            f"- {c['engine']}: checked with {c['checked_with']}: "
            + ("ok" if not c["errors"] else "; ".join(c["errors"]))
        )
    gate = validation.get("lossless")
    if gate and "skipped" in gate:
        lines.append(f"- lossless gate and throughput check skipped ({gate['skipped']})")
    elif gate:
        runs = ", ".join(f"D={r['draft_len']}: {r['identical']}/{r['prompts']} identical" for r in gate.get("runs", []))
        lines.append(f"- lossless (fp32 greedy, held-back prompts): {lossless_text(gate)} {runs}".rstrip())
    tp = validation.get("throughput")
    if tp and tp.get("checked") and tp.get("engine") == "vllm":
        lines.append(
            f"- in vLLM {tp.get('vllm_version')}, the bundle's own vllm/speculative_config.json with max_num_seqs "
            f"{tp.get('max_num_seqs')}, "
            f"held-back prompts {PROMPT_WAYS.get(tp.get('prompts'), 'cut to the context')} ({tp['rule']}):"
            if not tp.get("error")
            else f"- vLLM: {tp['error']}"
        )
        lines += [f"  - {describe_row(r)}" for r in tp["buckets"]]
        if tp.get("kv_capacity"):
            lines.append(f"  - {describe_kv(tp['kv_capacity'])}")
    elif tp and tp.get("checked"):
        lines.append(
            f"- predicted vs measured decode throughput (tolerance {tp['tolerance_pct']:g}%, {tp['measured_rounds']}):"
        )
        lines += [f"  - {describe_throughput_row(r)}" for r in tp["buckets"]]
        if tp.get("warning"):
            lines.append(f"  - warning: {tp['warning']}")
        lines += repairs_text(validation.get("repairs", []))
    elif tp and "why" in tp:
        lines.append(f"- throughput not measured: {tp['why']}")
    lines += ["", *[f"![{name}]({name})" for name in PLOTS], ""]
    (folder / "report.md").write_text("\n".join(lines))


def _figures_from(plan: Plan, engines: dict) -> str:
    engine = plan.device.engine
    if engine == "torch":
        return (
            "The figures come from this tool's own loop (`--engine torch`), not from a serving engine: every engine's "
            "files carry the same schedule, none of them was measured."
        )
    version = engines.get(engine, {}).get("version", "")
    return (
        f"The figures come from {engine} {version} (`--engine {engine}`): `{engine}/` is the primary config, the one "
        f"they were measured for and `validation.json` checked in {engine}; the other engines' files carry the same "
        "schedule, not measured there."
    )


def bundle_readme(plan: Plan, engines: dict, safety: dict) -> str:
    """The bundle's README: how each engine takes its files, and what it could not express."""
    schedule = ", ".join(f"B≤{b}: D={d}" for b, d in plan.schedule)
    out = [
        f"# Deployment bundle: {plan.mechanism} speculative decoding",
        "",
        f"Schedule ({plan.device.name}, times {plan.device.times}): {schedule}; max batch {plan.max_batch}.",
        "",
        _figures_from(plan, engines),
        "",
        *limits_lines(plan),
        "- `vllm/`: `sh vllm/serve.sh`, or "
        "`LLM(..., speculative_config=json.load(open('vllm/speculative_config.json')))`.",
        "- `trtllm/`: `trtllm-serve <model> --config trtllm/config.yaml`.",
        "- `sglang/`: `sh sglang/launch.sh`. For EAGLE-family drafters SGLang runs the per-batch draft lengths in one "
        "server: `sglang/adaptive.json` (the `--speculative-adaptive-config` file) keys one candidate step count by "
        "each band's lowest batch size, so the controller keeps the plan's D. Other algorithms get one server per "
        "concurrency band (`sglang/bands.json`; route each band's traffic to its server).",
        "- `speculators/`: `config.json` for a learned drafter's folder (absent for model-free drafters).",
        "- `kernels/`: Triton verification-attention and acceptance kernels for the plan's shapes: sources, the chosen "
        "configs (`kernel_table.json`: timed on a GPU, else chosen by the tile rules and labelled modeled) and cubins "
        "per architecture (`sm_90/`, `sm_100/`) listed in `kernels/manifest.json`; "
        "`specdec_tune.kernels.aot.Launcher` runs a shipped cubin and refuses one built for another architecture.",
        "- `drafter/` (drafters with a network of their own): the drafter as ONNX with dynamic batch and draft length, "
        "its onnxruntime parity in `export.json`, and the TensorRT engine or the `trtexec` command that builds it "
        "(`drafter/README.md`).",
        "- `report/report.md`: predictions, the reason for each D, plots; "
        "`validation.json`: what was checked and measured.",
        "- `manifest.json`: file hashes and the factors `specdec-tune check` compares (exit 3 when stale).",
        "",
        "## Decisions",
        "",
    ]
    for name, e in engines.items():
        out += [f"- {name} {e['version']}: {d}" for d in e["decisions"]]
    flagged = safety_lines(safety)
    if flagged:
        out += ["", "## Schedule safety", ""] + [f"- {line}" for line in flagged]
    deviations = {name: e["deviation"] for name, e in engines.items() if e.get("deviation")}
    if deviations:
        out += [
            "",
            "## Where an engine cannot run the plan's schedule",
            "",
            "Predicted tokens/s under what the engine runs instead, beside the plan's (same cost model and sources):",
            "",
        ]
        for name, record in deviations.items():
            out += [f"- {name}: {record['why']}"]
            out += [
                f"  - B≤{r['batch']}: D={r['draft_len']} (plan {r['plan_draft_len']})"
                + (
                    f": {r['tokens_per_s']['value']:.1f} tokens/s against {r['plan_tokens_per_s']['value']:.1f} "
                    f"({r['change_pct']:+.1f}%, {r['tokens_per_s']['source']})"
                    if "tokens_per_s" in r
                    else ""
                )
                for r in record["buckets"]
            ]
    return "\n".join(out) + "\n"
