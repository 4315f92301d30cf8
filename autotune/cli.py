"""The `specdec-tune` command line. `main()` is the one place errors become messages and exit codes:
0 success, 1 a handled error (one line: the problem and the fix), 2 bad usage, 130 interrupted.
Tracebacks appear only with --debug (or SPECDEC_TUNE_DEBUG=1).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Optional

import typer
from typer.exceptions import TyperException
from rich.console import Console
from rich.table import Table

from specdec_tune import SpecdecError, __version__

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
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = None,
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


TargetOpt = Annotated[str, typer.Option("--target", "-t", help="Target model: a Hugging Face folder, a .gguf file, or the default 'smollm2-135m'.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bf16 where the device computes it natively, else fp32), float32, bfloat16, float16.")]
PromptsOpt = Annotated[str, typer.Option("--prompts", help="Calibration set: default, mtbench, humaneval, or a JSONL file of {domain, prompt}; comma-separate to combine.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Let the tokenizer run code shipped with the model (off by default).")]


@app.command(epilog="Examples:\n\n  specdec-tune decode --drafter ngram -D 3 --prompts humaneval\n\n"
             "  specdec-tune decode --drafter draft_model --drafter-option layers=10 -D 3 --batch-size 8 --check-lossless")
def decode(
    drafter: Annotated[Optional[str], typer.Option("--drafter", "-m", help="Draft mechanism (ngram, suffix, draft_model); omit for plain decoding.")] = None,
    num_draft_tokens: Annotated[int, typer.Option("--num-draft-tokens", "-D", help="Draft length D per round.")] = 3,
    drafter_option: Annotated[list[str], typer.Option("--drafter-option", "-o", help="Drafter option KEY=VALUE (repeatable).")] = [],  # noqa: B006
    target: TargetOpt = "smollm2-135m",
    prompts: PromptsOpt = "default",
    split: Annotated[str, typer.Option(help="Which part of the calibration set: profile, held_back or all.")] = "held_back",
    num_prompts: Annotated[int, typer.Option("--num-prompts", "-n", help="Prompts to run (spread over domains).")] = 16,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Sequences decoded together.")] = 1,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 for greedy, > 0 for rejection sampling.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed for sampling.")] = 0,
    dtype: DtypeOpt = "auto",
    check_lossless: Annotated[bool, typer.Option(help="Also decode plainly and require identical tokens (greedy only).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Run the speculative decoding loop on calibration prompts and report acceptance (vLLM's counters)."""
    from specdec_tune.profiles import decode_run

    result = decode_run.run(
        decode_run.DecodeSettings(
            target=target, drafter=drafter, drafter_options=_parse_kv(drafter_option, "--drafter-option"),
            num_draft_tokens=num_draft_tokens, prompts=prompts, split=split, num_prompts=num_prompts,
            batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
            dtype=dtype, check_lossless=check_lossless, trust_remote_code=trust_remote_code,
        )
    )
    if as_json:
        console.print_json(json.dumps(result))
        return
    table = Table(title=f"decode: {result['drafter'] or 'plain'}, D={result['num_draft_tokens']}, B={result['batch_size']} (measured)")
    for col in ("domain", "prompts", "mean AL (vLLM)", "tokens/forward", "accept rate"):
        table.add_column(col, justify="right" if col != "domain" else "left")
    for domain, row in [*result["per_domain"].items(), ("all", result["all"])]:
        table.add_row(domain, str(row["prompts"]), f"{row['mean_acceptance_length']:.3f}", f"{row['tokens_per_target_forward']:.3f}",
                      f"{row['acceptance_rate']:.3f}")
    console.print(table)
    console.print(f"decode throughput: {result['all']['tokens_per_s']:.1f} tok/s (measured, {result['target']['dtype']}, this device)")
    cond = ", ".join("-" if a is None else f"{a:.2f}" for a in result["all"]["conditional_acceptance"])
    console.print(f"per-position conditional acceptance a_k: [{cond}]")
    if check_lossless:
        console.print(f"lossless: {result['lossless']['identical_prompts']}/{result['lossless']['prompts']} prompts identical to plain greedy")


def _not_yet(stage: str) -> None:
    raise SpecdecError(f"`specdec-tune {stage}` is not available in this version", "use `specdec-tune decode` to measure acceptance for now")


@app.command(epilog="Example:\n\n  specdec-tune profile --target ./my-model --drafter ngram --drafter draft_model")
def profile() -> None:
    """Measure the target, its drafters and the device; writes artifacts/profile.json."""
    _not_yet("profile")


@app.command(epilog="Example:\n\n  specdec-tune search --profile artifacts/profile.json")
def search() -> None:
    """Choose mechanism, draft length per batch bucket, quantization and tile policy; writes plan.json."""
    _not_yet("search")


@app.command(epilog="Example:\n\n  specdec-tune export --plan artifacts/plan.json --out artifacts/bundle")
def export() -> None:
    """Write the deployment bundle: engine configs, kernels, manifest, report."""
    _not_yet("export")


@app.command(epilog="Example:\n\n  specdec-tune check artifacts/bundle")
def check() -> None:
    """Tell whether a bundle still matches the model, drafter, engine and GPU (exit 0 when fresh)."""
    _not_yet("check")


def _fail(line: str) -> None:
    print(line, file=sys.stderr)  # one unwrapped line, whatever the terminal width


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI and map failures to one line and an exit code."""
    try:
        app(args=argv, standalone_mode=False, prog_name="specdec-tune")
        return 0
    except SpecdecError as e:
        if _state["debug"]:
            raise
        _fail(f"error: {e}")
        return 1
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        _fail("interrupted")
        return 130
    except TyperException as e:  # bad usage: unknown option, missing argument, wrong type
        e.show()
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
