"""specdec-tune: an ahead-of-time autotuner and deployment-config compiler for speculative decoding.

Every error the package raises on purpose is a `SpecdecError`: a one-line message that names the
problem, plus a `hint` that names the fix. The CLI (`specdec_tune.cli`) is the one place that
turns them into messages and exit codes.
"""

from __future__ import annotations

__version__ = "0.1.0"


class SpecdecError(Exception):
    """A handled failure: `message` says what is wrong, `hint` says how to fix it."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


__all__ = ["SpecdecError", "__version__"]
