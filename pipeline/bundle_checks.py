"""`specdec-tune validate`: a written bundle checked again. Its files as the exporters read them (hashes, each engine's
config, the kernels: exporters/bundle.py `check_bundle_files`) and, with measuring on, the lossless gate and the
throughput check of its own inputs on this machine, by the backend its profile was measured with."""

from __future__ import annotations

from pathlib import Path

from specdec_tune.autotune.plan_schema import load_plan
from specdec_tune.exporters.bundle import check_bundle_files
from specdec_tune.pipeline.export import CHECKS
from specdec_tune.pipeline.lossless import lossless_failed, lossless_gate
from specdec_tune.profiles.schema import load_profile
from specdec_tune.settings import MeasureSettings


def validate_bundle(bundle: Path, measure: MeasureSettings | None) -> dict:
    """Hashes, engine configs again, and (with `measure`) the lossless gate and throughput on this machine."""
    result = check_bundle_files(bundle)
    if measure is not None:
        plan = load_plan(Path(bundle) / "inputs" / "plan.json")
        profile = load_profile(Path(bundle) / "inputs" / "profile.json")
        result["lossless"] = lossless_gate(plan, profile, measure)
        result["throughput"] = CHECKS[profile.backend].run(plan, profile, Path(bundle), measure, lambda line: None)
        tp = result["throughput"]  # an inconclusive bucket is reported, not failed (throughput_check.py, "Verdicts")
        failed = tp.get("failed", not tp.get("passed", True))
        result["passed"] = result["passed"] and not lossless_failed(result["lossless"]) and not failed
    return result
