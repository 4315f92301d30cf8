"""The CLI boundary: --version, --help with examples, one-line errors and exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec_tune import __version__
from specdec_tune.cli import main

COMMANDS = ["decode", "profile", "search", "export", "check"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"specdec-tune {__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert f"specdec-tune {command}" in out and "Example" in out


def test_no_arguments_shows_usage(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "Usage" in out + err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["decode", "--drafter", "nope"], "unknown drafter mechanism 'nope'"),
        (["decode", "--drafter", "ngram", "-D", "0"], "draft length D = 0"),
        (["decode", "--target", "/does/not/exist"], "model path not found"),
        (["decode", "--split", "sideways"], "unknown split"),
        (["decode", "--drafter-option", "layers"], "not KEY=VALUE"),
        (["profile", "--batch", "1,x"], "comma-separated list of integers"),
        (["profile", "--quant", "int3"], "unknown quantization format"),
        (["profile", "--max-draft-len", "0"], "--max-draft-len 0"),
    ],
)
def test_handled_errors_are_one_line_and_exit_1(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 1
    assert err.startswith("error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [["decode", "--bogus"], ["decode", "-D", "x"], ["nope"]])
def test_usage_errors_exit_2(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and "Traceback" not in out + err


def test_debug_flag_shows_the_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_tune.cli", "--debug", "decode", "--drafter", "nope"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "SpecdecError" in proc.stderr


def test_console_script_is_installed():
    proc = subprocess.run(["specdec-tune", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and __version__ in proc.stdout
