"""The loops that cross stages, above them all: export (render, prove on this machine, repair by measuring again and
planning again, write) and a bundle's validation. The checks that measure live here, apart from the exporters that
render; only the CLI imports this package."""

from specdec_tune import lazy_entry_points

_ENTRY_POINTS = {
    "export": "export",
    "validate_bundle": "bundle_checks",
    "lossless_gate": "lossless",
    "throughput_check": "throughput_check",
    "engine_throughput": "engine_check",
    "repair_throughput": "repair",
}
__all__ = sorted(_ENTRY_POINTS)
__getattr__ = lazy_entry_points(__name__, _ENTRY_POINTS)
