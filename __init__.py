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


__all__ = ["SpecdecError", "__version__", "lazy_entry_points"]


def lazy_entry_points(package: str, entry_points: dict[str, str]):
    """A package's `__getattr__` that loads each public entry point (name -> the module under `package` defining it) on
    first use: a stage's `__all__` names what it offers without importing torch for a caller that needs one record. A
    name that is also its module's (`search`) is the module, as Python's import makes it once the module is loaded."""
    import importlib

    def __getattr__(name: str):
        if name in entry_points:
            module = importlib.import_module(f"{package}.{entry_points[name]}")
            return module if entry_points[name] == name else getattr(module, name)  # a module's own name is the module
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
