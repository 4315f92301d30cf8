"""Render and check: a plan into every engine's files (one module per engine, the mechanism registry, release lines),
the bundle's manifest, report and staleness factors, and reading a bundle back. Measures nothing (pipeline/ does)."""

from specdec_tune import lazy_entry_points

_ENTRY_POINTS = {
    "stage": "bundle",
    "write_bundle": "bundle",
    "read_manifest": "bundle",
    "check_bundle": "bundle",
    "check_bundle_files": "bundle",
    "serving_engines": "engines",
    "STALE_EXIT_CODE": "staleness",
}
__all__ = sorted(_ENTRY_POINTS)
__getattr__ = lazy_entry_points(__name__, _ENTRY_POINTS)
