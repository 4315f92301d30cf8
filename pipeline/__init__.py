"""The loops that cross stages, above them all: export (render, prove on this machine, repair by measuring again and
planning again, write) and a bundle's validation. The checks that measure live here, apart from the exporters that
render; only the CLI imports this package.

Its entry points load on first use (`__getattr__`), so that importing the package costs nothing until one is called.
"""

from __future__ import annotations

import importlib

_ENTRY_POINTS = {"export": "export", "validate_bundle": "bundle_checks", "lossless_gate": "lossless", "throughput_check": "throughput_check",
                 "engine_throughput": "engine_check"}
__all__ = sorted(_ENTRY_POINTS)


def __getattr__(name: str):
    if name in _ENTRY_POINTS:
        return getattr(importlib.import_module(f"{__name__}.{_ENTRY_POINTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
