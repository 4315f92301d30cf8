"""How a long run says how far it is: one small interface for every stage, rendered by the CLI.

A stage calls `tick(phase, done, total, unit)` after each unit of work and `note(line)` for a statement of its own
(what its required work will cost, say). `Progress` itself is silent (tests, library use); `LogLines` prints a line
per unit of work for a log (a CI job's stdout): the unit, the elapsed time, what is left of the budget and an estimate
of what the phase still needs, so that a slow run can be told from a hung one. Torch-free.
"""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """The silent default: stages report to it whether or not anyone listens."""

    def tick(self, phase: str, done: int, total: int, unit: str = "") -> None:
        """`done` of `total` units of `phase` are finished; `unit` names the one that just ended."""

    def note(self, line: str) -> None:
        """A line the run wants read as it happens."""


class LogLines(Progress):
    """A line per finished unit of work, and one when a phase ends:

        [  4.2 min] engine units 5/15 (ngram D=7 pass 2): 1.8 min of the budget left, about 9.1 min to go in this phase

    The estimate is the phase's elapsed time per finished unit times the units left. Lines for one phase come at most
    every `every_s` seconds (a sampler's hundreds of short visits would drown a log), but the phase's last always does.
    """

    def __init__(self, out: TextIO, budget_minutes: float | None = None, every_s: float = 10.0) -> None:
        self.out, self.budget_minutes, self.every_s = out, budget_minutes, every_s
        self.started = time.monotonic()
        self.phase_started: dict[str, tuple[float, int]] = {}  # phase -> (when its first tick came, units done then)
        self.last_line: dict[str, float] = {}
        self.finished: set[str] = set()

    def _elapsed_text(self) -> str:
        return f"[{(time.monotonic() - self.started) / 60:6.1f} min]"

    def _budget_text(self) -> str:
        if not self.budget_minutes:
            return ""
        left_min = max(0.0, self.budget_minutes - (time.monotonic() - self.started) / 60)
        return f"{left_min:.1f} min of the budget left"

    def tick(self, phase: str, done: int, total: int, unit: str = "") -> None:
        now = time.monotonic()
        if phase in self.finished:
            if done >= total:
                return
            self.finished.discard(phase)  # the phase runs again (a second round of refinement): a fresh estimate
            del self.phase_started[phase]
        first_at, first_done = self.phase_started.setdefault(phase, (now, done))
        if done >= total:
            self.finished.add(phase)
            self._print(", ".join(filter(None, [f"{phase}: done ({total} units)", self._budget_text()])))
            return
        if done == first_done or now - self.last_line.get(phase, -self.every_s) < self.every_s:
            return
        self.last_line[phase] = now
        to_go_min = (now - first_at) / (done - first_done) * (total - done) / 60
        head = f"{phase} {done}/{total}" + (f" ({unit})" if unit else "")
        self._print(
            f"{head}: "
            + ", ".join(filter(None, [self._budget_text(), f"about {to_go_min:.1f} min to go in this phase"]))
        )

    def note(self, line: str) -> None:
        self._print(line)

    def _print(self, text: str) -> None:
        print(f"{self._elapsed_text()} {text}", file=self.out, flush=True)
