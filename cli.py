"""The `specdec-tune` command line. `main()` is the one place errors become messages and exit codes:
0 success, 1 a handled error (one line: the problem and the fix), 2 bad usage, 130 interrupted.
Tracebacks appear only with --debug (or SPECDEC_TUNE_DEBUG=1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

# OpenMP threads that spin while they wait turn a second busy process into a 20x slower forward on a small CPU
# (measured: a batch-4, 16-token verify step of the demo target took 8.1 s with one other busy process on 2 cores,
# 0.40 s with passive waiting). Set before torch starts its threads; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer
from rich.console import Console
from rich.table import Table
from typer.exceptions import TyperException

from specdec_tune import SpecdecError, __version__
from specdec_tune.formats import get_format
from specdec_tune.progress import LogLines, Progress

if TYPE_CHECKING:
    from rich.progress import TaskID

    from specdec_tune.autotune.plan_schema import Figure, Plan
from specdec_tune.settings import (
    DEFAULT_GRID,
    DecodeSettings,
    ExportSettings,
    MeasureSettings,
    ProfileSettings,
    RefineSettings,
    SearchSettings,
    TrainSettings,
)

# Each command imports its stage inside its own body: the stages import torch (seconds on a small CPU), which
# `--help` and bad usage do not need.

# the defaults the options show, each written once (settings.py)
DECODE, PROFILE, TRAIN = DecodeSettings(), ProfileSettings(), TrainSettings()
SEARCH, MEASURE, EXPORT, REFINE = SearchSettings(), MeasureSettings(), ExportSettings(), RefineSettings()


def _csv(values) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


app = typer.Typer(
    name="specdec-tune",
    help="Ahead-of-time autotuner and deployment-config compiler for speculative decoding.\n\n"
    "Typical use:  specdec-tune profile && specdec-tune search && specdec-tune export",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
console = Console(stderr=False)
_state = {"debug": os.environ.get("SPECDEC_TUNE_DEBUG") == "1"}


def _version(value: bool) -> None:
    if value:
        console.print(f"specdec-tune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for handled errors.")] = False,
) -> None:
    _state["debug"] = _state["debug"] or debug


def _parse_kv(pairs: list[str], what: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecdecError(f"{what} {pair!r} is not KEY=VALUE", f"write it like {what} layers=10")
        out[key] = value
    return out


TargetOpt = Annotated[
    str,
    typer.Option(
        "--target", "-t", help="Target model: a Hugging Face folder, a .gguf file, or the default 'smollm2-135m'."
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype", help="auto (bf16 where the device computes it natively, else fp32), float32, bfloat16, float16."
    ),
]
PromptsOpt = Annotated[
    str,
    typer.Option(
        "--prompts",
        help="Calibration set: default, mtbench, humaneval, or a file of prompts or conversations (JSONL of "
        "{domain, prompt}, OpenAI chat 'messages' or ShareGPT 'conversations'; a .json array too; FILE:domain=NAME "
        "or FILE:domain_field=FIELD where records carry no 'domain'); comma-separate to combine.",
    ),
]
TrustOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Let the tokenizer run code shipped with the model (off by default)."),
]


@app.command(
    epilog="Examples:\n\n  specdec-tune decode --drafter ngram -D 3 --prompts humaneval\n\n"
    "  specdec-tune decode --drafter draft_model --drafter-option layers=10 -D 3 --batch-size 8 --check-lossless"
)
def decode(
    drafter: Annotated[
        str | None,
        typer.Option("--drafter", "-m", help="Draft mechanism (ngram, suffix, draft_model); omit for plain decoding."),
    ] = None,
    num_draft_tokens: Annotated[
        int, typer.Option("--num-draft-tokens", "-D", help="Draft length D per round.")
    ] = DECODE.num_draft_tokens,
    drafter_option: Annotated[
        list[str], typer.Option("--drafter-option", "-o", help="Drafter option KEY=VALUE (repeatable).")
    ] = [],  # noqa: B006
    target: TargetOpt = DECODE.target,
    prompts: PromptsOpt = DECODE.prompts,
    split: Annotated[
        str, typer.Option(help="Which part of the calibration set: profile, held_back or all.")
    ] = DECODE.split,
    num_prompts: Annotated[
        int, typer.Option("--num-prompts", "-n", help="Prompts to run (spread over domains).")
    ] = DECODE.num_prompts,
    batch_size: Annotated[
        int, typer.Option("--batch-size", "-b", help="Sequences decoded together.")
    ] = DECODE.batch_size,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = DECODE.max_new_tokens,
    temperature: Annotated[float, typer.Option(help="0 for greedy, > 0 for rejection sampling.")] = DECODE.temperature,
    seed: Annotated[int, typer.Option(help="Seed for sampling.")] = DECODE.seed,
    dtype: DtypeOpt = DECODE.dtype,
    check_lossless: Annotated[
        bool, typer.Option(help="Also decode plainly and require identical tokens (greedy, with a --drafter).")
    ] = DECODE.check_lossless,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    trust_remote_code: TrustOpt = DECODE.trust_remote_code,
) -> None:
    """Run the speculative decoding loop on calibration prompts and report acceptance (vLLM's counters)."""
    from specdec_tune.profiles import decode_run

    with _progress() if not as_json else contextlib.nullcontext(Progress()) as progress:
        result = decode_run.run(
            DecodeSettings(
                target=target,
                drafter=drafter,
                drafter_options=_parse_kv(drafter_option, "--drafter-option"),
                num_draft_tokens=num_draft_tokens,
                prompts=prompts,
                split=split,
                num_prompts=num_prompts,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=seed,
                dtype=dtype,
                check_lossless=check_lossless,
                trust_remote_code=trust_remote_code,
            ),
            progress,
        )
    if as_json:
        console.print_json(json.dumps(result))
        return
    table = Table(
        title=f"decode: {result['drafter'] or 'plain'}, D={result['num_draft_tokens']}, B={result['batch_size']} "
        "(measured)"
    )
    for col in ("domain", "prompts", "mean AL (vLLM)", "tokens/forward", "accept rate"):
        table.add_column(col, justify="right" if col != "domain" else "left")
    for domain, row in [*result["per_domain"].items(), ("all", result["all"])]:
        table.add_row(
            domain,
            str(row["prompts"]),
            f"{row['mean_acceptance_length']:.3f}",
            f"{row['tokens_per_target_forward']:.3f}",
            f"{row['acceptance_rate']:.3f}",
        )
    console.print(table)
    console.print(
        f"decode throughput: {result['all']['tokens_per_s']:.1f} tok/s (measured, {result['target']['dtype']}, "
        "this device)"
    )
    cond = ", ".join("-" if a is None else f"{a:.2f}" for a in result["all"]["conditional_acceptance"])
    console.print(f"per-position conditional acceptance a_k: [{cond}]")
    if check_lossless:
        console.print(
            f"lossless: {result['lossless']['identical_prompts']}/{result['lossless']['prompts']} prompts identical to "
            "plain greedy"
        )


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecdecError(
            f"{what} {text!r} is not a comma-separated list of integers", f"write it like {what} 1,2,4,8"
        ) from None


def _float_list(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecdecError(
            f"{what} {text!r} is not a comma-separated list of numbers", f"write it like {what} 0,0.7"
        ) from None


@app.command(
    epilog="Examples:\n\n  specdec-tune profile\n\n"
    "  specdec-tune profile --target ./my-model --drafter ngram --drafter draft_model:layers=6 --budget-minutes 30\n\n"
    "  specdec-tune profile --batch 1,4,16 --ctx 256,2048 --max-draft-len 7 --out artifacts/profile-h200\n\n"
    "  SPECDEC_TUNE_VLLM_PYTHON=/opt/vllm/bin/python specdec-tune profile --engine vllm "
    "--engine-option tensor_parallel_size=2"
)
def profile(
    target: TargetOpt = PROFILE.target,
    drafter: Annotated[
        list[str],
        typer.Option(
            "--drafter",
            "-m",
            help="Drafter to profile, NAME or NAME:KEY=VALUE,... (repeatable). Default: ngram, suffix, draft_model.",
        ),
    ] = [],  # noqa: B006
    prompts: PromptsOpt = PROFILE.prompts,
    prompts_per_domain: Annotated[
        int,
        typer.Option(
            help="Profiling prompts per domain to start greedy acceptance with (more are added until --half-width)."
        ),
    ] = PROFILE.prompts_per_domain,
    half_width: Annotated[
        float,
        typer.Option(
            "--half-width",
            help="Target relative half-width (95%) of tokens per forward per domain; prompts are added until it "
            "holds (0: none added).",
        ),
    ] = PROFILE.acceptance_half_width,
    second_turns: Annotated[
        bool,
        typer.Option(
            "--second-turns",
            help="Grow MT-Bench categories past their first turns with the second ones (the question, the target's "
            "own answer, the follow-up): acceptance of multi-turn chat, where lookup drafters copy from the answer.",
        ),
    ] = PROFILE.second_turns,
    acceptance: Annotated[
        str,
        typer.Option(
            help="Greedy acceptance: replay (from the target's trajectory, checked against the loop) or loop."
        ),
    ] = PROFILE.acceptance,
    verify_visits: Annotated[
        int,
        typer.Option(
            help="Most visits per verify cell (a warm-up and 3 timed calls each) while its median's 95% interval is "
            "wider than ±3%; the cells a choice of D rests on get up to 4x as many."
        ),
    ] = PROFILE.verify_visits,
    new_tokens: Annotated[
        int, typer.Option(help="Tokens generated per prompt in acceptance runs.")
    ] = PROFILE.new_tokens,
    temperatures: Annotated[
        str, typer.Option(help="Temperatures for acceptance, comma-separated (0 = greedy).")
    ] = _csv(PROFILE.temperatures),
    batch: Annotated[
        str,
        typer.Option(
            "--batch",
            help=f"Batch buckets, comma-separated (default 1..{DEFAULT_GRID['cpu'][0]} on CPU, "
            f"1..{DEFAULT_GRID['cuda'][0]} on a GPU).",
        ),
    ] = "",
    ctx: Annotated[str, typer.Option("--ctx", help="KV-cache length buckets, comma-separated.")] = _csv(
        PROFILE.ctx_buckets
    ),
    max_draft_len: Annotated[
        int | None,
        typer.Option(
            help=f"D_max: the longest draft measured (default {DEFAULT_GRID['cpu'][1]} on CPU, "
            f"{DEFAULT_GRID['cuda'][1]} on a GPU).",
            show_default=False,
        ),
    ] = None,
    quant: Annotated[
        str, typer.Option(help="Drafter weight formats to measure acceptance with (fp8, nvfp4; 'none' for neither).")
    ] = _csv(PROFILE.quant_formats),
    dtype: DtypeOpt = PROFILE.dtype,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = PROFILE.device,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for profile.json and the measurement log.")
    ] = PROFILE.out_dir,
    budget_minutes: Annotated[
        float, typer.Option(help="Wall-clock budget; the least important phases are skipped (and noted) past it.")
    ] = PROFILE.budget_minutes,
    seed: Annotated[int, typer.Option(help="Seed for sampled acceptance runs and synthetic inputs.")] = PROFILE.seed,
    force: Annotated[
        bool, typer.Option(help="Measure again even if a profile with the same fingerprint exists.")
    ] = PROFILE.force,
    trust_remote_code: TrustOpt = PROFILE.trust_remote_code,
    engine: Annotated[
        str,
        typer.Option(
            help="Where to measure: torch (this tool's own loop) or vllm (the serving engine; "
            "SPECDEC_TUNE_VLLM_PYTHON names its virtualenv where vllm does not import here)."
        ),
    ] = PROFILE.engine,
    engine_option: Annotated[
        list[str],
        typer.Option(
            "--engine-option",
            help="KEY=VALUE passed to the engine as it is (repeatable), e.g. "
            "tensor_parallel_size=2, quantization=fp8, max_model_len=8192.",
        ),
    ] = [],  # noqa: B006
) -> None:
    """Measure the target, its drafters and the device; writes OUT/profile.json (resumable: a killed run continues)."""
    started = time.monotonic()  # the budget counts from the command's start, its imports included
    from specdec_tune.profiles.backends import run_profile

    formats = tuple(f for f in quant.split(",") if f and f != "none")
    for f in formats:
        get_format(f)
    settings = ProfileSettings(
        target=target,
        drafters=tuple(drafter) or ProfileSettings.drafters,
        prompts=prompts,
        prompts_per_domain=prompts_per_domain,
        new_tokens=new_tokens,
        temperatures=_float_list(temperatures, "--temperatures"),
        batch_buckets=_int_list(batch, "--batch"),
        ctx_buckets=_int_list(ctx, "--ctx"),
        max_draft_len=max_draft_len,
        quant_formats=formats,
        dtype=dtype,
        device=device,
        out_dir=out,
        budget_minutes=budget_minutes,
        seed=seed,
        force=force,
        trust_remote_code=trust_remote_code,
        acceptance_half_width=half_width,
        second_turns=second_turns,
        acceptance=acceptance,
        verify_visits=verify_visits,
        engine=engine,
        engine_options=_key_values(engine_option, "--engine-option"),
    )
    with _progress(budget_minutes) as progress:
        result = run_profile(settings, progress=progress, started=started)
    _print_profile_summary(result, out / "profile.json")


def _key_values(pairs: list[str], option: str) -> tuple[tuple[str, object], ...]:
    """KEY=VALUE pairs; a value that reads as JSON (a number, true/false, a list) is that, any other a string."""
    out = []
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SpecdecError(f"{option} {pair!r} is not KEY=VALUE", f"write it like {option} tensor_parallel_size=2")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        out.append((key, value))
    return tuple(out)


class _Bars(Progress):
    """A terminal's progress: a bar per phase, notes printed above them."""

    def __init__(self, bar) -> None:
        self.bar = bar
        self.tasks: dict[str, TaskID] = {}

    def tick(self, phase: str, done: int, total: int, unit: str = "") -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done, total=total)

    def note(self, line: str) -> None:
        self.bar.console.print(line, markup=False)


@contextlib.contextmanager
def _progress(budget_minutes: float | None = None):
    """Where a long command reports (progress.Progress): bars on a terminal; elsewhere (a CI log) a line per unit of
    work with the elapsed time, what is left of the budget and an estimate of what the phase still needs, so that a
    long run is never silent."""
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as Bars

    if not console.is_terminal:
        yield LogLines(sys.stdout, budget_minutes)
        return
    columns = (
        TextColumn("{task.description:<12}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Bars(*columns, console=console, transient=False) as bar:
        yield _Bars(bar)


def _print_profile_summary(result, path: Path) -> None:
    from specdec_tune.profiles.profile_summary import summary

    facts = summary(result)
    D_max = result.workload.max_draft_len
    mechanisms = sorted({m for m, _ in facts["al"]})
    domains = ["all"] + [d for d in result.workload.domains]
    table = Table(
        title=f"tokens per target forward at D={D_max} (a block drafter: its block), greedy "
        "(measured; 95% interval over prompts)"
    )
    table.add_column("domain")
    table.add_column("prompts", justify="right")
    for m in mechanisms:
        table.add_column(m, justify="right")

    def cell(key) -> str:
        if key not in facts["al"]:
            return "-"
        lo_hi = facts["al_ci"].get(key)
        return f"{facts['al'][key]:.2f}" + (f" [{lo_hi[0]:.2f}–{lo_hi[1]:.2f}]" if lo_hi else "")

    for d in domains:
        n = sum(facts["prompts"].values()) if d == "all" else facts["prompts"].get(d)
        table.add_row(d, str(n or "-"), *[cell((m, d)) for m in mechanisms])
    console.print(table)
    engine = facts["engine_rounds"]
    bounds = Table(
        title=f"per batch bucket (ctx {facts['ctx']}; "
        f"measured {result.backend + ' engine rounds' if engine else 'verify times'})"
    )
    for col in (
        "batch",
        *(() if engine else ("verify knee 1+D",)),
        "speedup" if engine else "speedup bound",
        "at D",
        "mechanism",
    ):
        bounds.add_column(col, justify="right")
    for B, (bound, D, m) in facts["bounds"].items():
        bounds.add_row(str(B), *(() if engine else (str(facts["knees"].get(B)),)), f"{bound:.2f}x", str(D), m)
    console.print(bounds)
    console.print(
        "speedup = tokens per forward x T_round(B,0) / T_round(B,D), at the draft lengths the engine ran: draft "
        "and host included (tokens per forward below D_max derived from the D_max run: modeled)"
        if engine
        else "speedup bound = tokens per forward x T_verif(B,1) / T_verif(B,1+D): draft and host time left out"
    )
    for B, share in facts["gemm_share"].items():
        console.print(
            f"B={B}: the target's linear layers (measured micro-curve) are {share:.0%} of the measured one-token "
            "verify step"
        )
    memory = result.memory
    if memory:
        drafters = ", ".join(
            f"{name} {d['weights_bytes']['none'] / 1e9:.2f} GB + {d['kv_bytes_per_token'] / 1e3:.1f} kB/token"
            for name, d in memory["drafters"].items()
            if d["params"]
        )
        console.print(
            f"memory (computed from the configs, {memory['dtype']}): target weights "
            f"{memory['target']['weights_bytes']['none'] / 1e9:.2f} GB, "
            f"KV {memory['target']['kv_bytes_per_token'] / 1e3:.1f} kB/token"
            + (f"; drafters: {drafters}" if drafters else "")
            + f"; activations {sum(a['source'] == 'measured' for a in memory['activation'])} of "
            f"{len(memory['activation'])} (B, 1+D) "
            f"measured; device {memory['device']['usable_bytes'] / 1e9:.2f} GB ({memory['device']['source']})",
            markup=False,
        )
    if result.moe:
        woken = "; ".join(
            f"B={B}: " + ", ".join(f"{p['experts_woken']:.1f}" for p in result.moe["points"] if p["batch"] == B)
            for B in dict.fromkeys(p["batch"] for p in result.moe["points"])
        )
        console.print(
            f"mixture of experts (measured, ctx {result.moe['ctx']}): experts woken per MoE layer of "
            f"{result.moe['num_experts']} ({result.moe['experts_per_token']} per token) by a verify step of "
            f"1+D = 1..{result.workload.max_draft_len + 1} tokens: {woken}",
            markup=False,
        )
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    console.print(f"wrote {path}", markup=False)


@app.command(
    "train-drafter",
    epilog="Examples:\n\n  specdec-tune train-drafter --mechanism eagle3\n\n"
    "  specdec-tune train-drafter --mechanism mtp --budget-minutes 5 --out heads/mtp-demo\n\n"
    "  specdec-tune train-drafter --mechanism dspark --block-size 8 --markov-rank 64\n\n"
    "  specdec-tune decode --drafter eagle3 --drafter-option model=heads/eagle3-demo -D 3 --prompts mtbench",
)
def train_drafter(
    mechanism: Annotated[
        str, typer.Option("--mechanism", "-m", help="Head to train: eagle3, mtp, dflash or dspark.")
    ] = TRAIN.mechanism,
    target: TargetOpt = TRAIN.target,
    prompts: PromptsOpt = TRAIN.prompts,
    budget_minutes: Annotated[
        float, typer.Option(help="Optimisation wall time; data preparation and AL measurements are reported apart.")
    ] = TRAIN.budget_minutes,
    new_tokens: Annotated[
        int, typer.Option(help="Tokens the target continues each training prompt with (the text the head learns).")
    ] = TRAIN.new_tokens,
    max_prompts: Annotated[
        int, typer.Option(help="Training prompts from the profiling split (0 = all of them).")
    ] = TRAIN.max_prompts,
    package_tokens: Annotated[
        int,
        typer.Option(help="Tokens of prose and code from the installed packages, read by the target as is (0 = none)."),
    ] = TRAIN.package_tokens,
    draft_vocab: Annotated[
        int,
        typer.Option(
            help="Most frequent tokens: EAGLE-3's draft vocabulary and MTP's loss shortlist (0 = the full vocabulary)."
        ),
    ] = TRAIN.draft_vocab,
    ttt_steps: Annotated[
        int, typer.Option(help="EAGLE-3 / MTP: draft steps unrolled per position in training (training-time test).")
    ] = TRAIN.ttt_steps,
    block_size: Annotated[
        int, typer.Option(help="DFlash / DSpark: tokens per block (DFlash drafts block-1 of them, DSpark all).")
    ] = TRAIN.block_size,
    draft_layers: Annotated[int, typer.Option(help="DFlash / DSpark: decoder layers.")] = TRAIN.draft_layers,
    markov_rank: Annotated[int, typer.Option(help="DSpark: rank of the Markov logit bias.")] = TRAIN.markov_rank,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW, cosine over the budget).")] = TRAIN.lr,
    batch_tokens: Annotated[int, typer.Option(help="Padded tokens per optimizer step.")] = TRAIN.batch_tokens,
    eval_points: Annotated[
        int,
        typer.Option(
            help="AL measurements along the run on held-back MT-Bench prompts (the learning curve); 0 = none."
        ),
    ] = TRAIN.eval_points,
    eval_prompts: Annotated[
        int, typer.Option(help="Held-back MT-Bench prompts per AL measurement.")
    ] = TRAIN.eval_prompts,
    seed: Annotated[int, typer.Option(help="Seed for initialisation and batch order.")] = TRAIN.seed,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Folder for the head (speculators layout). Default: this target's cached head, "
            "the one --drafter eagle3 / mtp loads.",
        ),
    ] = TRAIN.out,
) -> None:
    """Distil an EAGLE-3, MTP, DFlash or DSpark head from the target on CPU and save it in the speculators layout."""
    from specdec_tune.profiles.train_drafter import train

    settings = TrainSettings(
        mechanism=mechanism,
        target=target,
        prompts=prompts,
        max_prompts=max_prompts,
        new_tokens=new_tokens,
        package_tokens=package_tokens,
        draft_vocab=draft_vocab,
        ttt_steps=ttt_steps,
        block_size=block_size,
        draft_layers=draft_layers,
        markov_rank=markov_rank,
        lr=lr,
        batch_tokens=batch_tokens,
        budget_minutes=budget_minutes,
        eval_points=eval_points,
        eval_prompts=eval_prompts,
        seed=seed,
        out=out,
    )
    record = train(settings, progress=lambda line: console.print(line, markup=False))
    curve = record["learning_curve"]
    if curve:
        table = Table(
            title=f"{mechanism} learning curve: AL at D={curve[0]['draft_len']} on held-back MT-Bench prompts "
            "(measured)"
        )
        for col in (
            "training tokens",
            "steps",
            "train s",
            "tokens/forward",
            "mean AL (vLLM)",
            "per-position acceptance",
        ):
            table.add_column(col, justify="right")
        for p in curve:
            table.add_row(
                str(p["training_tokens"]),
                str(p["steps"]),
                f"{p['train_s']:.0f}",
                f"{p['tokens_per_forward']:.3f}",
                f"{p['mean_al_vllm']:.3f}",
                " ".join(f"{a:.2f}" for a in p["per_position_acceptance"]),
            )
        console.print(table)
        domains = Table(title=f"after {curve[-1]['training_tokens']} tokens, per domain (measured)")
        for col in ("domain", "prompts", "tokens/forward", "per-position acceptance"):
            domains.add_column(col, justify="right")
        for d, r in curve[-1].get("by_domain", {}).items():
            domains.add_row(
                d,
                str(r["prompts"]),
                f"{r['tokens_per_forward']:.3f}",
                " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]),
            )
        console.print(domains)
    t = record["train"]
    console.print(
        f"trained {t['steps']} steps over {t['training_tokens']} tokens in {t['train_s']:.0f} s "
        f"(data prepared in {record['data']['prepare_s']:.0f} s)",
        markup=False,
    )
    console.print(f"wrote {record['folder']}", markup=False)


def _refined(plan, profile, settings: RefineSettings, out: Path):
    """The plan after the measured refinement (pipeline/refine.py), rewritten in OUT/plan.json; as it was, with a note,
    where it cannot be refined here."""
    from specdec_tune.pipeline.refine import refine, refinement_lines, skipped
    from specdec_tune.records import write_json

    why = skipped(plan, profile)
    if why is None:
        plan = refine(plan, profile, settings, out, on_line=lambda line: console.print(line, markup=False))
        for line in refinement_lines(plan):
            console.print(line, markup=False)
    else:
        console.print(f"refine: skipped: {why}", markup=False)
        plan = plan.model_copy(update={"notes": [*plan.notes, f"measured refinement skipped: {why}"]})
    write_json(out / "plan.json", plan.to_json())
    return plan


@app.command(
    epilog="Examples:\n\n  specdec-tune search\n\n"
    "  specdec-tune search --profile artifacts/profile/profile.json --min-user-tps 30 --trials 500\n\n"
    "  specdec-tune search --objective throughput --min-user-tps 40   # most tokens/s per GPU at 40 tok/s per user\n\n"
    "  specdec-tune search --objective pareto                          # the throughput / per-user front (NSGA-II)\n\n"
    "  specdec-tune search --device h200                               # plan for a GPU you do not have (modeled)\n\n"
    "  specdec-tune search --mix writing=0.5,coding=0.3,humaneval=0.2  # weight the profile's domains by share of "
    "requests\n\n"
    "  specdec-tune search --storage journal:/shared/study.journal     # several workers, one study\n\n"
    "  specdec-tune search --no-refine                                 # the cost model's plan, nothing decoded"
)
def search(
    profile: Annotated[
        Path, typer.Option("--profile", "-p", help="profile.json written by `specdec-tune profile`.")
    ] = EXPORT.profile,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for plan.json (and the default study, study.journal).")
    ] = SEARCH.out_dir,
    objective: Annotated[
        str,
        typer.Option(
            help="speedup (mean over batch buckets), throughput (tokens/s per device at the chosen "
            "max batch), per-user (per-user tokens/s at it), or pareto (both, NSGA-II)."
        ),
    ] = SEARCH.objective,
    trials: Annotated[
        int,
        typer.Option(
            help="Optuna trials; 0 = the objective's default (the study is filled up to this count; reruns add only "
            "what is missing)."
        ),
    ] = SEARCH.trials,
    seed: Annotated[
        int, typer.Option(help="Sampler seed: the same profile and seed give the same plan.")
    ] = SEARCH.seed,
    min_user_tps: Annotated[
        float, typer.Option("--min-user-tps", help="Per-user rate floor (tokens/s).")
    ] = SEARCH.min_user_tokens_per_s,
    min_tps: Annotated[
        float, typer.Option("--min-tps", help="Tokens/s-per-device floor (per-user and pareto objectives).")
    ] = SEARCH.min_tokens_per_s,
    mechanism: Annotated[
        list[str], typer.Option("--mechanism", "-m", help="Only these mechanisms (repeatable); default: all profiled.")
    ] = [],  # noqa: B006
    tile_rows: Annotated[
        int, typer.Option("--tile-rows", help="Attention tile rows for the aligned tile policy; 0 = the device's.")
    ] = SEARCH.tile_rows,
    storage: Annotated[
        str | None,
        typer.Option(
            help="Optuna storage URL (sqlite:///..., postgresql://..., or a JournalStorage file via journal:PATH)."
        ),
    ] = SEARCH.storage,
    device: Annotated[
        str | None,
        typer.Option(
            help="Plan for this device from the hardware table (a100, h100, h200, b200, l40s, mi300x): times are "
            "modeled."
        ),
    ] = SEARCH.device,
    mix: Annotated[
        str | None,
        typer.Option(
            "--mix",
            help="Share of requests per profiled domain, DOMAIN=WEIGHT,... (normalised); default: the profile's 'all'.",
        ),
    ] = None,
    memory_fraction: Annotated[
        float,
        typer.Option(
            "--memory-fraction",
            help="Share of device memory the plan may fill (weights, KV cache, "
            "activations), as vLLM's gpu_memory_utilization; a draft length that does not fit is not planned.",
        ),
    ] = SEARCH.memory_fraction,
    tensor_parallel: Annotated[
        int,
        typer.Option(
            "--tensor-parallel",
            help="Devices one replica spans (weights and KV heads split over them); "
            "0 = the profile's engine option tensor_parallel_size, else 1.",
        ),
    ] = SEARCH.tensor_parallel,
    tie_tolerance: Annotated[
        float,
        typer.Option(
            "--tie-tolerance",
            help="Expected loss (a share, e.g. 0.005) up to which a shorter draft is taken over the bucket's best, "
            "and a drafter listed earlier in the profile over the best drafter; 0: every expected difference decides.",
        ),
    ] = SEARCH.tie_tolerance,
    refine: Annotated[
        bool,
        typer.Option(
            help="Decode the contenders of each bucket the model cannot decide (this device, the profiling split, the "
            "profile's engine: this tool's loop or vLLM) and keep the fastest; skipped for a --device projection or a "
            "profile from another device.",
        ),
    ] = True,
    refine_budget: Annotated[
        float,
        typer.Option(
            "--refine-budget",
            help="Seconds the refinement may decode; 0 = a sixth of what measuring every D of every bucket costs.",
        ),
    ] = REFINE.budget_s,
    refine_storage: Annotated[
        str | None,
        typer.Option(
            "--refine-storage",
            help="Optuna storage URL of the refinement's study (several workers may share one); default: "
            "OUT/refine.journal.",
        ),
    ] = REFINE.storage,
) -> None:
    """Choose the mechanism and draft length per batch bucket from a profile; writes OUT/plan.json."""
    from specdec_tune.autotune.search import search as run_search
    from specdec_tune.profiles.schema import load_profile
    from specdec_tune.records import sha256_file

    if not 0 < memory_fraction <= 1:
        raise SpecdecError(
            f"--memory-fraction {memory_fraction:g} is outside (0, 1]",
            "give the share of device memory to plan into, e.g. 0.9",
        )
    if not 0 <= tie_tolerance < 1:
        raise SpecdecError(
            f"--tie-tolerance {tie_tolerance:g} is outside [0, 1)", "give a share of the expected speedup, e.g. 0.005"
        )
    for name, value in (
        ("--trials", trials),
        ("--min-user-tps", min_user_tps),
        ("--min-tps", min_tps),
        ("--tile-rows", tile_rows),
        ("--tensor-parallel", tensor_parallel),
    ):
        if value < 0:
            raise SpecdecError(
                f"{name} {value:g} must not be negative", f"pass {name} 0 for the default, or a positive value"
            )
    loaded = load_profile(profile)
    settings = SearchSettings(
        objective=objective,
        trials=trials,
        seed=seed,
        min_user_tokens_per_s=min_user_tps,
        min_tokens_per_s=min_tps,
        mechanisms=tuple(mechanism),
        tile_rows=tile_rows,
        storage=storage,
        out_dir=out,
        device=device,
        mix=_mix_option(mix) if mix is not None else (),
        memory_fraction=memory_fraction,
        tensor_parallel=tensor_parallel,
        tie_tolerance=tie_tolerance,
    )
    if refine_budget < 0:
        raise SpecdecError(f"--refine-budget {refine_budget:g} must not be negative", "pass 0 for the default")
    plan = run_search(loaded, sha256_file(profile), settings)
    if refine:
        plan = _refined(plan, loaded, dataclasses.replace(REFINE, budget_s=refine_budget, storage=refine_storage), out)
    _print_plan_table(plan)
    console.print(
        "why: the guideline that set D (g1 compute-bound GEMMs, g2/g3 attention tile, g4 draft cost, schedule: "
        "D never rises with batch, memory: a longer draft does not fit in memory, refined: expected faster than the "
        "model's D once decoded); vs next D: the runner-up, the choice's expected gain over it and the share of draws "
        "of the profile in which the choice is faster (p), or for a refined bucket the model's D, the expected gain "
        "(the model and the measured groups together) and, after m, the measured one",
        markup=False,
    )
    console.print(
        "[low–high]: 95% interval of the prediction, from the acceptance bootstrap over prompts and the timing "
        "interval of the median, taken together at their worst and best; - where the profile has none. Each bucket "
        "takes the D with the highest expected speedup over draws of the profile's uncertainty (timing cells shared "
        "by every D, acceptance paired over the same prompts); a shorter draft only where its expected loss is within "
        f"{settings.tie_tolerance:.1%}",
        markup=False,
    )
    for line in _plan_findings(plan):
        console.print(line, markup=False)
    st = plan.study
    line = f"study: {st.trials} trials over a {st.space_size}-point space"
    if st.gap_pct is not None:
        line += f"; {st.gap_pct:.2f}% below the exhaustive optimum"
    if plan.pareto.study is not None:
        line += (
            f"; Pareto front: {len(plan.pareto.study)} points found, {plan.pareto.study_found} of the "
            f"{len(plan.pareto.exact)} exact"
        )
    console.print(line, markup=False)
    console.print(f"wrote {out / 'plan.json'}", markup=False)


def _mix_option(text: str) -> tuple[tuple[str, float], ...]:
    """--mix DOMAIN=WEIGHT,...: the pairs as given (the search checks the domains and normalises the weights)."""
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        domain, _, weight = item.partition("=")
        try:
            pairs.append((domain.strip(), float(weight)))
        except ValueError:
            raise SpecdecError(
                f"--mix {item!r} is not DOMAIN=WEIGHT", "write it like --mix writing=0.5,coding=0.3,humaneval=0.2"
            ) from None
        if not domain.strip():
            raise SpecdecError(
                f"--mix {item!r} names no domain", "write it like --mix writing=0.5,coding=0.3,humaneval=0.2"
            )
    if not pairs:
        raise SpecdecError("--mix is empty", "write it like --mix writing=0.5,coding=0.3,humaneval=0.2")
    return tuple(pairs)


def _with_interval(figure: Figure, fmt: str, unit: str = "") -> str:
    """`1.30x [1.22–1.37]`, or `1.30x [-]` where the figure has no interval."""
    value = f"{format(figure.value, fmt)}{unit}"
    if figure.low is None or figure.high is None:
        return f"{value} [-]"
    return f"{value} [{format(figure.low, fmt)}–{format(figure.high, fmt)}]"


def plan_table(plan: Plan) -> Table:
    """The plan per bucket, as `search` prints it."""
    engine = plan.device.engine
    where = f"{plan.device.name} ({plan.device.times}{', measured in ' + engine if engine != 'torch' else ''})"
    mix = f", mix {', '.join(f'{d} {w:.0%}' for d, w in plan.mix.items())}" if plan.mix else ""
    table = Table(
        title=f"plan for {where}: {plan.mechanism} (weights {plan.quant}), max D {plan.max_draft_len}, "
        f"max batch {plan.max_batch}, tile policy {plan.tile.policy}{mix}"
    )
    for col in ("batch", "D", "speedup", "tok/s", "tok/s/user", "tok/fwd", "source", "why", "vs next D", "fits"):
        table.add_column(col, justify="right", no_wrap=True)
    for b in plan.buckets:
        pred, guideline = b.predicted, (b.rationale.model_extra or {}).get("guideline")
        table.add_row(
            str(b.batch),
            str(b.draft_len),
            _with_interval(pred.speedup, ".2f", "x"),
            _with_interval(pred.tokens_per_s, ".0f"),
            f"{pred.per_user_tokens_per_s.value:.1f}",
            f"{pred.tokens_per_forward.value:.3f}",
            pred.speedup.source,
            f"g{guideline}" if isinstance(guideline, int) else str(guideline),
            _vs_next_d(b),
            str(b.memory.max_concurrency) if b.memory else "-",
        )
    return table


def _vs_next_d(b) -> str:
    """The table's `vs next D`: a refined bucket's model D and the measured gain over it; else the runner-up, the
    expected gain over it and the share of draws the choice wins; else the next best D's modeled loss."""
    r = b.refinement
    if r and (r.chosen_draft_len != r.model_draft_len or r.chosen_engine):
        chosen = next(c for c in r.contenders if c.draft_len == b.draft_len and c.engine == r.chosen_engine)
        if chosen.vs_model is None:
            return f"{r.model_draft_len}: model's D pruned"
        measured = f"{100 * (chosen.vs_model.value - 1):+.0f}%"
        e = chosen.expected_vs_model
        gain = f"{100 * (e.value - 1):+.1f}% (m {measured})" if e is not None else f"{measured} measured"
        return f"{r.model_draft_len}: {gain}"
    d, nxt = b.rationale.decision, (b.rationale.model_extra or {}).get("next_best")
    if d:
        return f"{d.runner_up_draft_len}: {d.expected_gain_pct:+.1f}%, p {d.p_beats_runner_up:.2f}"
    return f"{nxt['draft_len']} ({-nxt['loss_pct']:+.1f}%)" if nxt else "-"


def _print_plan_table(plan: Plan) -> None:
    """The plan table at its own width (a narrower terminal wraps lines, not cells)."""
    from rich.measure import Measurement

    table = plan_table(plan)
    width = Measurement.get(console, console.options.update_width(10_000), table).maximum
    Console(width=max(console.width, width)).print(table)


def _plan_findings(plan: Plan) -> list[str]:
    """One line per excluded bucket, per tie taken, per flagged bucket and per bucket the mix's domains disagree on;
    what the ties gave up, and the drafter against the best other one."""
    from specdec_tune.autotune.plan import disagreement_line

    lines = [f"not planned: {row.why}" for row in plan.excluded_buckets]
    memory = plan.memory
    if memory:
        lines.append(
            f"memory (modeled from the configs): {memory.fraction:g} of {memory.device_bytes / 1e9:.2f} GB "
            f"({memory.device_source}"
            f"{', tensor parallel ' + str(memory.tensor_parallel) if memory.tensor_parallel > 1 else ''}); "
            f"target weights {memory.target_weights_bytes / 1e9:.2f} GB, "
            f"KV {memory.target_kv_bytes_per_token / 1e3:.1f} kB per token; "
            f"fits: the most requests at each bucket's D, ctx {memory.ctx}"
        )
    for b in plan.buckets:
        why = b.rationale.model_extra or {}
        if why.get("tie"):
            lines.append(f"batch {b.batch}: {why['tie']['text']}")
        lines += [f"flag: batch {b.batch} {flag}" for flag in b.flags]
        moe = why.get("moe")
        if moe and moe["why_speculation_loses"]:
            lines.append(f"batch {b.batch}: {moe['text']}")
    lines += [disagreement_line(row) for row in (plan.per_domain or {}).get("disagreeing_buckets", [])]
    untied, other = plan.study.untied_schedule, plan.study.untied_drafter
    if other:
        lines.append(
            f"{plan.mechanism} is taken over {other['mechanism']}, whose best schedule is expected within the "
            f"{plan.study.tie_tolerance:.1%} tie tolerance of it: the drafter listed first in the profile is preferred"
        )
    if untied and (other or [D for _, D in untied] != [d for _, d in plan.schedule]):
        lines.append(
            f"without the ties (every expected difference deciding) {(other or {}).get('mechanism', plan.mechanism)} "
            "would take D = "
            f"{', '.join(str(D) for _, D in untied)} at batch {', '.join(str(B) for B, _ in untied)}: "
            f"{plan.study.untied_gain_pct:+.1f}% expected mean speedup"
        )
    drafters = plan.study.drafter_decision
    if drafters:
        r = drafters.runner_up_vs_choice
        assert r.low is not None and r.high is not None  # quantiles of the draws
        lines.append(
            f"drafter: {plan.mechanism} over {drafters.runner_up} (at its best schedule, D = "
            f"{', '.join(str(D) for _, D in drafters.runner_up_schedule)}), expected at {r.value:.3f}x "
            f"{plan.mechanism}'s mean speedup (modeled, 95% {r.low:.3f}-{r.high:.3f}); {plan.mechanism} is faster "
            f"in {drafters.p_beats_runner_up:.0%} of the draws"
            + (": the profile cannot separate them, another profile may take either" if r.low <= 1 <= r.high else "")
        )
    return lines


VllmVersion = Annotated[str | None, typer.Option("--vllm-version", help="vLLM version targeted (default: the tool's).")]
TrtllmVersion = Annotated[str | None, typer.Option("--trtllm-version", help="TensorRT-LLM version targeted.")]
SglangVersion = Annotated[str | None, typer.Option("--sglang-version", help="SGLang version targeted.")]


def _version_overrides(vllm: str | None, trtllm: str | None, sglang: str | None) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in (("vllm", vllm), ("trtllm", trtllm), ("sglang", sglang)) if v)


def _measure_settings(prompts: int, new_tokens: int, tolerance: float, recheck_s: float) -> MeasureSettings:
    for name, value in (("--lossless-prompts", prompts), ("--new-tokens", new_tokens)):
        if value < 1:
            raise SpecdecError(f"{name} {value} must be at least 1", f"pass {name} 1 or more")
    if tolerance <= 0:
        raise SpecdecError(f"--tolerance {tolerance:g} must be positive", "pass a percentage such as --tolerance 15")
    if recheck_s < 0:
        raise SpecdecError(f"--recheck-s {recheck_s:g} must not be negative", "pass 0 to measure each bucket once")
    return MeasureSettings(prompts=prompts, new_tokens=new_tokens, tolerance_pct=tolerance, recheck_s=recheck_s)


LosslessPrompts = Annotated[int, typer.Option("--lossless-prompts", help="Held-back prompts for the lossless gate.")]
NewTokens = Annotated[
    int, typer.Option("--new-tokens", help="Tokens generated per prompt in the gate and the throughput check.")
]
Tolerance = Annotated[
    float, typer.Option("--tolerance", help="Largest relative error (%) of predicted against measured throughput.")
]
RecheckS = Annotated[
    float,
    typer.Option(
        "--recheck-s",
        help="Seconds the throughput check may spend measuring again the buckets it cannot judge yet (over all).",
    ),
]


@app.command(
    epilog="Examples:\n\n  specdec-tune export\n\n"
    "  specdec-tune export --plan artifacts/plan.json --out artifacts/bundle --vllm-version 0.32.0\n\n"
    "  specdec-tune export --configs-only   # a plan for another device: configs and report, nothing measured here"
)
def export(
    plan: Annotated[Path, typer.Option("--plan", help="plan.json written by `specdec-tune search`.")] = EXPORT.plan,
    profile: Annotated[
        Path, typer.Option("--profile", "-p", help="The profile the plan was searched on.")
    ] = EXPORT.profile,
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle folder (replaced atomically).")] = EXPORT.out,
    engine_model: Annotated[
        str | None, typer.Option("--engine-model", help="The target as the engines load it (path or hub id).")
    ] = EXPORT.engine_model,
    vllm_version: VllmVersion = None,
    trtllm_version: TrtllmVersion = None,
    sglang_version: SglangVersion = None,
    configs_only: Annotated[
        bool, typer.Option("--configs-only", help="Skip the lossless gate and the throughput check.")
    ] = False,
    no_onnx: Annotated[
        bool,
        typer.Option("--no-onnx", help="Leave out the drafter's ONNX graph (drafters with a network of their own)."),
    ] = False,
    lossless_prompts: LosslessPrompts = MEASURE.prompts,
    new_tokens: NewTokens = MEASURE.new_tokens,
    tolerance: Tolerance = MEASURE.tolerance_pct,
    recheck_s: RecheckS = MEASURE.recheck_s,
    data_parallel: Annotated[
        int,
        typer.Option(
            "--data-parallel",
            help="The engines' data-parallel size: above 1 vLLM runs no per-batch table, so its config "
            "carries the plan's best static K.",
        ),
    ] = EXPORT.data_parallel,
    repair_rounds: Annotated[
        int,
        typer.Option(
            "--repair-rounds",
            help="A failed throughput check: rounds of re-measuring the verify cells "
            "behind it and re-planning (rewrites plan.json and profile.json) before "
            "refusing; 0 refuses at once.",
        ),
    ] = MEASURE.repair_rounds,
) -> None:
    """Write the deployment bundle: engine configs, manifest, report, validation (it must pass to be written)."""
    import dataclasses

    from specdec_tune.exporters.validation_text import describe_repair, summary_line
    from specdec_tune.pipeline.export import export as run_export

    if repair_rounds < 0:
        raise SpecdecError(
            f"--repair-rounds {repair_rounds} must not be negative",
            "pass --repair-rounds 0 to refuse without re-measuring",
        )
    if data_parallel < 1:
        raise SpecdecError(
            f"--data-parallel {data_parallel} must be at least 1", "pass the engines' data-parallel size"
        )
    measure = dataclasses.replace(
        _measure_settings(lossless_prompts, new_tokens, tolerance, recheck_s), repair_rounds=repair_rounds
    )
    settings = ExportSettings(
        plan=plan,
        profile=profile,
        out=out,
        versions=_version_overrides(vllm_version, trtllm_version, sglang_version),
        engine_model=engine_model,
        measure=measure,
        skip_measure=configs_only,
        onnx_drafter=not no_onnx,
        data_parallel=data_parallel,
    )

    def show_repair(record: dict) -> None:
        for line in describe_repair(record):
            console.print(line, markup=False)

    started = time.monotonic()

    def show_step(
        line: str,
    ) -> None:  # each check as it ends: a long export is never silent, on a terminal or in a CI log
        console.print(f"{line} [{(time.monotonic() - started) / 60:.1f} min]", markup=False, soft_wrap=True)

    manifest = run_export(settings, on_repair=show_repair, on_step=show_step)
    table = Table(title=f"bundle {out}: {manifest['plan']['mechanism']}, schedule {manifest['plan']['schedule']}")
    for col in ("engine", "version", "files", "decisions"):
        table.add_column(col)
    for name, e in manifest["engines"].items():
        table.add_row(name, e["version"], ", ".join(e["files"]) or "-", "; ".join(e["decisions"]))
    console.print(table)
    v = manifest["validation"]
    where = f" in {manifest['primary_engine']}" if manifest.get("primary_engine") else ""
    console.print(summary_line(v, where), markup=False)
    if v.get("repairs"):
        console.print(
            f"repaired in {len(v['repairs'])} round(s): rewrote {plan} (re-planned) and {profile} (re-measured cells)",
            markup=False,
        )
    console.print(f"wrote {out} ({len(manifest['files'])} files)", markup=False)


@app.command(
    epilog="Examples:\n\n  specdec-tune validate artifacts/bundle\n\n"
    "  specdec-tune validate artifacts/bundle --configs-only"
)
def validate(
    bundle: Annotated[Path, typer.Argument(help="The bundle folder.")] = EXPORT.out,
    configs_only: Annotated[
        bool, typer.Option("--configs-only", help="Hashes and engine configs only; nothing measured.")
    ] = False,
    lossless_prompts: LosslessPrompts = MEASURE.prompts,
    new_tokens: NewTokens = MEASURE.new_tokens,
    tolerance: Tolerance = MEASURE.tolerance_pct,
    recheck_s: RecheckS = MEASURE.recheck_s,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Check a bundle again: file hashes, engine configs, lossless gate, predicted vs measured throughput."""
    from specdec_tune.exporters.validation_text import describe_row, describe_throughput_row, lossless_text
    from specdec_tune.pipeline.bundle_checks import validate_bundle

    result = validate_bundle(
        bundle, None if configs_only else _measure_settings(lossless_prompts, new_tokens, tolerance, recheck_s)
    )
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        console.print(result["hashes"], markup=False)
        for c in result["configs"]:
            console.print(
                f"{c['engine']}: {c['checked_with']}: {'ok' if not c['errors'] else '; '.join(c['errors'])}",
                markup=False,
            )
        k = result["kernels"]
        console.print(
            f"kernels: {k['checked']} cubins checked against their manifest: "
            + ("ok" if not k["errors"] else "; ".join(k["errors"][:3])),
            markup=False,
        )
        if "lossless" in result:
            console.print(f"lossless: {lossless_text(result['lossless'])}", markup=False)
        tp = result.get("throughput", {})
        for r in tp.get("buckets", []):
            console.print(
                f"vLLM {describe_row(r)}" if tp.get("engine") == "vllm" else describe_throughput_row(r), markup=False
            )
        if tp.get("error") or tp.get("why"):
            console.print(f"throughput: {tp.get('error') or 'not checked: ' + tp['why']}", markup=False)
        if tp.get("warning"):
            console.print(f"warning: {tp['warning']}", markup=False)
    if not result["passed"]:
        raise SpecdecError(f"bundle {bundle} fails validation", "see the lines above; re-profile and re-export")


@app.command(
    epilog="Examples:\n\n  specdec-tune check artifacts/bundle\n\n"
    "  specdec-tune check artifacts/bundle --json --vllm-version 0.33.0\n\n"
    "  specdec-tune check artifacts/bundle --metrics http://localhost:8000/metrics --window 10m\n\n"
    "  specdec-tune check artifacts/bundle --metrics start.prom --metrics end.prom --window 10m\n\n"
    "Exit codes: 0 fresh, 3 stale (each changed factor or drifted workload figure is named), 1 error."
)
def check(
    bundle: Annotated[Path, typer.Argument(help="The bundle folder.")] = Path("artifacts/bundle"),
    target: Annotated[
        str | None,
        typer.Option(
            "--target", "-t", help="Where the target model is on this machine (default: the path the bundle records)."
        ),
    ] = None,
    vllm_version: VllmVersion = None,
    trtllm_version: TrtllmVersion = None,
    sglang_version: SglangVersion = None,
    metrics: Annotated[
        list[str] | None,
        typer.Option(
            "--metrics",
            help="The serving engine's Prometheus metrics over a window: two scrape files or more (start ... end), a "
            "folder of them, or a running server's /metrics URL (with --window).",
        ),
    ] = None,
    window: Annotated[
        str | None,
        typer.Option("--window", help="The window: how long to scrape a URL, or the time between scrape files."),
    ] = None,
    interval: Annotated[str, typer.Option("--interval", help="Seconds between a URL's scrapes.")] = "2s",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON (for CI).")] = False,
) -> None:
    """Tell whether a bundle still matches the model, drafter, engine and GPU, or with --metrics whether the live
    workload is still the one it was tuned for (exit 0 fresh, 3 stale)."""
    from specdec_tune.exporters.bundle import check_bundle
    from specdec_tune.exporters.staleness import STALE_EXIT_CODE

    if metrics:  # the workload alone: a job that reads production metrics runs away from the serving machine
        from specdec_tune.pipeline.serving_metrics import duration_s, read_scrapes, window_figures
        from specdec_tune.pipeline.workload_check import workload_check

        window_s = duration_s(window, "--window") if window else None
        scrapes = read_scrapes(metrics, window_s, duration_s(interval, "--interval"))
        workload = workload_check(bundle, window_figures(scrapes, window_s))
        if as_json:
            print(json.dumps({"bundle": str(bundle), "fresh": workload["fresh"], "workload": workload}, indent=2))
        else:
            for line in workload_lines(workload):
                console.print(line, markup=False)
            console.print(f"{bundle}: workload {'fresh' if workload['fresh'] else 'stale'}", markup=False)
        if not workload["fresh"]:
            raise typer.Exit(STALE_EXIT_CODE)
        return
    result = check_bundle(
        bundle, target=target, versions=_version_overrides(vllm_version, trtllm_version, sglang_version)
    )
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for c in result["changed"]:
            console.print(f"stale: {c['factor']}: {c['was']} -> {c['now']}", markup=False)
        for u in result["unverified"]:
            console.print(f"not checked: {u['factor']}: {u['why']}", markup=False)
        console.print(f"{bundle}: {'fresh' if result['fresh'] else 'stale'}", markup=False)
    if not result["fresh"]:
        raise typer.Exit(STALE_EXIT_CODE)


def workload_lines(w: dict) -> list[str]:
    """`check --metrics` as text: each drifted factor, the figures behind each verdict, what the drift costs."""
    a, c, win = w["acceptance"], w["concurrency"], w["window"]
    lines = [f"stale: {text}" for text in w["drifted"]]
    span = f" over {win['window_s']:.0f} s" if win.get("window_s") else ""
    lines.append(
        f"window: {win['engine']}, {win['scrapes']} scrapes{span}, {win['generated_tokens']:.0f} tokens generated, "
        f"{win['finished_requests']:.0f} requests finished"
    )
    if a.get("live") is not None:
        lo, hi = a["live_interval"]
        plo, phi = a["profiled_interval"]
        lines.append(
            f"acceptance ({a['figure']}): {a['verdict']}: {a['live']:.3f} live [{lo:.3f}-{hi:.3f}] over "
            f"{a['rounds']:.0f} rounds (measured) vs {a['profiled']:.3f} [{plo:.3f}-{phi:.3f}] profiled at K = "
            f"{a['at']}"
        )
        for p in a.get("per_position", []):
            had = f", profiled {p['profiled']:.3f}" if p["profiled"] is not None else ""
            lines.append(f"  position {p['position']}: accepted in {p['live']:.3f} of the rounds live{had}")
    else:
        lines.append(f"acceptance: not judged: {a['why']}")
    if c["verdict"] == "not judged":
        lines.append(f"concurrency: not judged: {c['why']}")
    else:
        bands = ", ".join(
            f"<= {b['batch']} (K={b['draft_len']}): {100 * b['share']:.0f}%"
            for b in c["bands"]
            if b["share"] is not None
        )
        above = f"; above {c['largest_bucket']}: {100 * c['share_above']:.0f}%" if c["share_above"] is not None else ""
        little = f"; Little's mean {c['little_mean']:.2f}" if c.get("little_mean") is not None else ""
        lines.append(f"concurrency: {c['verdict']}: {c['busy_samples']} busy scrapes: {bands}{above}{little}")
    t = w.get("throughput")
    if t:
        for r in t["buckets"]:
            lines.append(
                f"  batch {r['batch']}, K={r['draft_len']}: predicted {r['planned_tokens_per_s']:.1f} tokens/s as "
                f"planned, {r['live_acceptance_tokens_per_s']:.1f} at the live acceptance (modeled)"
            )
        over = t.get("over_live_concurrency")
        if over:
            lines.append(
                f"over the live concurrency: {over['planned_tokens_per_s']:.1f} tokens/s as planned, "
                f"{over['live_acceptance_tokens_per_s']:.1f} at the live acceptance (modeled)"
            )
    if w.get("engine_note"):
        lines.append(f"note: {w['engine_note']}")
    if w.get("retune"):
        lines.append(f"re-tune: {w['retune']}")
    return lines


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as shells report it


def _fail(line: str) -> None:
    print(line, file=sys.stderr)  # one unwrapped line, whatever the terminal width


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI and map failures to one line and an exit code."""
    try:
        code = app(args=argv, standalone_mode=False, prog_name="specdec-tune")
        code = code if isinstance(code, int) else 0  # typer.Exit(n) comes back as n without standalone mode
        if code == INTERRUPTED_EXIT_CODE:  # Ctrl-C, which typer turns into this code itself
            _fail("interrupted")
        return code
    except SpecdecError as e:
        if _state["debug"]:
            raise
        _fail(f"error: {e}")
        return 1
    except OSError as e:  # a full disk, a permission, a vanished folder: name it, no traceback
        if _state["debug"]:
            raise
        where = f" ({e.filename})" if e.filename else ""
        _fail(
            f"error: {e.strerror or e}{where} (check the path, its permissions and the free disk space; "
            "completed measurements are kept)"
        )
        return 1
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        _fail("interrupted")
        return INTERRUPTED_EXIT_CODE
    except TyperException as e:  # bad usage: unknown option, missing argument, wrong type
        e.show()  # type: ignore[attr-defined]  # typer raises only its click exceptions, each with show()
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
