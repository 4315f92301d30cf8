"""Measure: the device's fingerprint, model loading, the drafters, the speculative loop and its replay, calibration
sets, and the two measurement backends that write profile.json (profiles/backends.py)."""

from specdec_tune import lazy_entry_points

_ENTRY_POINTS = {
    "run_profile": "backends",
    "backend_of": "backends",
    "Profile": "schema",
    "load_profile": "schema",
    "summary": "profile_summary",
    "remeasure": "verify_curve",
    "load_calibration": "calibration",
}
__all__ = sorted(_ENTRY_POINTS)
__getattr__ = lazy_entry_points(__name__, _ENTRY_POINTS)
