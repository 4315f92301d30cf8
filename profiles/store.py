"""An append-only log of finished measurements, so a killed `profile` resumes where it stopped.

One JSON line per measurement, flushed and fsynced before the next one starts. The log's name
carries the run's fingerprint: a run with other settings never reads another's measurements.
A line torn by a kill (the last one) is ignored and measured again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MeasurementLog:
    def __init__(self, folder: Path, fingerprint: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"measurements-{fingerprint[:16]}.jsonl"
        self._done: dict[str, object] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self._done[entry["key"]] = entry["value"]
                except (ValueError, KeyError, TypeError):
                    continue  # a torn line from a killed run
        self.resumed = len(self._done)
        if self.path.exists() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            with open(self.path, "a") as f:  # a kill left a torn last line: later records start on a fresh one
                f.write("\n")

    def __contains__(self, key: str) -> bool:
        return key in self._done

    def get(self, key: str):
        return self._done.get(key)

    def items(self, prefix: str = "") -> list[tuple[str, Any]]:  # values as JSON parsed them
        """The logged (key, value) pairs whose key starts with `prefix`, in the order they were first logged."""
        return [(k, v) for k, v in self._done.items() if k.startswith(prefix)]

    def put(self, key: str, value) -> None:
        line = json.dumps({"key": key, "value": value}, sort_keys=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._done[key] = value

    def measure(self, key: str, fn):
        """The logged value for `key`, measuring (and logging) it first if this run has not yet."""
        if key not in self._done:
            self.put(key, fn())
        return self._done[key]
