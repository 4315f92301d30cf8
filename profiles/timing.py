"""Timing a callable the way the profile reports it: warm-up, repeats, median and spread.

On CUDA, each repeat is bracketed by CUDA events (device time, no host sync inside the region);
on CPU, by `time.perf_counter`. Either way the numbers are milliseconds per call, and the median
carries its 95% interval (order statistics: `intervals.median_interval`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from specdec_tune.profiles.intervals import median_interval


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    repeats: int
    ci_low_ms: float
    ci_high_ms: float
    samples_ms: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, float | int]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "samples_ms"}

    @staticmethod
    def of(samples_ms: list[float]) -> Timing:
        """The summary of pooled samples (several visits of one cell)."""
        ordered = sorted(samples_ms)
        low, high = median_interval(ordered)
        return Timing(
            statistics.median(ordered),
            _quantile(ordered, 0.1),
            _quantile(ordered, 0.9),
            len(ordered),
            low,
            high,
            tuple(samples_ms),
        )


def _quantile(sorted_ms: list[float], q: float) -> float:
    if len(sorted_ms) == 1:
        return sorted_ms[0]
    return statistics.quantiles(sorted_ms, n=10, method="inclusive")[int(q * 10) - 1]


def time_call(
    fn: Callable[[], object],
    *,
    device: torch.device,
    warmup: int = 2,
    repeats: int = 7,
    min_total_ms: float = 0.0,
    max_total_ms: float = float("inf"),
) -> Timing:
    """Median over `repeats` calls after `warmup` calls; repeats grow until they span `min_total_ms`, and stop
    early (after at least 3) once they span `max_total_ms`: a call of seconds needs fewer repeats for a median."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    use_events = device.type == "cuda"
    if use_events:
        torch.cuda.synchronize(device)
    while (len(samples) < repeats or (sum(samples) < min_total_ms and len(samples) < 10 * repeats)) and not (
        len(samples) >= 3 and sum(samples) >= max_total_ms
    ):
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return Timing.of(samples)


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure (CUDA's own type, or the RuntimeError CPU and older backends raise)."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


@dataclasses.dataclass
class SpeedGuard:
    """Re-runs a measurement that a passing load on a shared machine spoiled.

    `probe()` times a fixed reference step (ms). Around each measurement the probe runs before and after;
    when either is more than `slack` above the device's quiet speed, the measurement is repeated (up to
    `attempts` times, keeping the last). The quiet speed is the lower quartile of the probes so far: their
    minimum is an extreme of the noise, not a speed (on a 2-core CPU, four probes in five land more than 10%
    above the minimum of thirty with nothing else running, and about one in thirty lands 30% above their
    lower quartile). What noise only adds time to is caught this way: a burst that starts and ends inside one
    measurement is left to that measurement's median.

    With `steady_only`, only a change of speed *during* the measurement (before and after probes more than
    `slack` apart) repeats it: for callers that scale by the probed speed themselves.
    """

    probe: Callable[[], float]
    slack: float = 1.30
    attempts: int = 3
    pause_s: float = 1.0
    steady_only: bool = False
    known_quiet_ms: float = float("inf")  # a quiet speed known beforehand; the probes' lower quartile otherwise
    probes_ms: list[float] = dataclasses.field(default_factory=list)
    repeated: int = 0  # measurements run again
    unsettled: int = 0  # measurements kept although the device never settled

    def quiet_ms(self) -> float:
        seen = sorted(self.probes_ms)
        return min(self.known_quiet_ms, seen[(len(seen) - 1) // 4] if seen else float("inf"))

    def run(self, measure: Callable[[], object]) -> tuple[object, float, float]:
        """(result, probe ms before, probe ms after) of the first run at the device's quiet speed."""
        for attempt in range(self.attempts):
            before = self.probe()
            result = measure()
            after = self.probe()
            self.probes_ms += [before, after]
            if max(before, after) <= self.slack * (min(before, after) if self.steady_only else self.quiet_ms()):
                return result, before, after
            if attempt + 1 < self.attempts:
                self.repeated += 1
                time.sleep(self.pause_s)
        self.unsettled += 1
        return result, before, after
