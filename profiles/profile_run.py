"""What both measurement backends share: the run around the measuring (profiles/backends.py).

    settings    checked, and the device's default grid filled in (`ProfileSettings.for_device`)
    drafters    `--drafter NAME:KEY=VALUE,...` parsed, each mechanism once
    prompts     the calibration set and its profiling split (acceptance grows into it, never the held-back part)
    budget      wall-clock, counted from the command's start (imports and model loading included)
    resume      a finished profile with the same fingerprint is reused; otherwise every measurement is appended to a
                log as it finishes (`store.MeasurementLog`), so a killed run resumes where it stopped
    record      the fields every profile has (schema, tool, time, fingerprint, backend, device), the backend's own
                measured fields beside them, validated (`schema.Profile`) and written atomically

A backend subclasses `ProfileRun`, sets `fingerprint`, `device_fp` and `backend` in its constructor and implements
`measure(log, budget)`.
"""

from __future__ import annotations

import datetime
import time

from specdec_tune import SpecdecError, __version__
from specdec_tune.profiles.calibration import load_calibration
from specdec_tune.profiles.fingerprint import resolve_device
from specdec_tune.profiles.schema import SCHEMA_VERSION, Profile, finished_profile
from specdec_tune.profiles.store import MeasurementLog
from specdec_tune.progress import Progress
from specdec_tune.records import write_json
from specdec_tune.settings import ProfileSettings


def parse_drafter_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'draft_model:layers=6,model=/x' -> ('draft_model', {'layers': '6', 'model': '/x'})."""
    name, _, rest = spec.partition(":")
    options = {}
    for pair in filter(None, rest.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SpecdecError(
                f"drafter option {pair!r} in {spec!r} is not KEY=VALUE", "write --drafter draft_model:layers=6"
            )
        options[key] = value
    return name, options


def drafter_specs(specs: tuple[str, ...]) -> list[tuple[str, dict[str, str]]]:
    """Every `--drafter` parsed, a mechanism named twice refused."""
    parsed = [parse_drafter_spec(spec) for spec in specs]
    names = [name for name, _ in parsed]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise SpecdecError(f"drafter {twice!r} is given twice", "profile each mechanism once")
    return parsed


class Budget:
    """Wall-clock budget; phases past the deadline are skipped and named in the profile's notes."""

    def __init__(self, minutes: float, started: float | None = None) -> None:
        self.deadline = (time.monotonic() if started is None else started) + 60 * minutes
        self.skipped: list[str] = []

    def allows(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.skipped.append(what)
        return False

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def workload_record(s: ProfileSettings, calibration, pool, domains: list[str], acceptance_batch: int) -> dict:
    """The profile's `workload`: what was measured, on which prompts (both backends)."""
    return {
        "calibration": calibration.name,
        "calibration_fingerprint": pool.fingerprint(),
        "split": "profile",
        "domains": domains,
        "prompts_per_domain": s.prompts_per_domain,
        "new_tokens": s.new_tokens,
        "temperatures": list(s.temperatures),
        "batch_buckets": list(s.batch_buckets),
        "ctx_buckets": list(s.ctx_buckets),
        "max_draft_len": s.max_draft_len,
        "acceptance_batch": acceptance_batch,
        "acceptance_half_width": s.acceptance_half_width,
    }


class ProfileRun:
    """The run every backend shares (module docstring); a backend fills in `measure`."""

    backend: str = ""
    fingerprint: str = ""
    device_fp: dict = {}

    def __init__(
        self, settings: ProfileSettings, progress: Progress | None = None, started: float | None = None
    ) -> None:
        # the budget counts from `started` (time.monotonic(); default: now): loading the models is part of the
        # profile's time
        self.started = time.monotonic() if started is None else started
        settings.validate()
        self.device = resolve_device(settings.device)
        self.s = settings.for_device(self.device.type)
        self.progress = progress or Progress()
        self.calibration = load_calibration(self.s.prompts)
        self.pool, _ = (
            self.calibration.split()
        )  # the profiling split: acceptance grows into it, never the held-back part

    def _tick(self, phase: str, done: int, total: int, unit: str = "") -> None:
        self.progress.tick(phase, done, total, unit)

    def measure(self, log: MeasurementLog, budget: Budget) -> dict:
        """The backend's own fields of the profile record (everything but `record_header`'s)."""
        raise NotImplementedError

    def record_header(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "tool_version": __version__,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": self.fingerprint,
            "backend": self.backend,
            "device": self.device_fp,
        }

    def run(self) -> Profile:
        """OUT/profile.json: the finished one with this fingerprint where there is one, else measured (resuming the
        log)."""
        out = self.s.out_dir / "profile.json"
        old = None if self.s.force else finished_profile(out, self.fingerprint)
        if old is not None:
            return old
        fields = self.measure(
            MeasurementLog(self.s.out_dir, self.fingerprint), Budget(self.s.budget_minutes, self.started)
        )
        profile = Profile.model_validate(self.record_header() | fields)
        write_json(out, profile.model_dump(mode="json"))
        return profile
