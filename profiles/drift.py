"""The device's speed drift, taken out of timings measured in an interleaved order.

On a shared machine every forward's speed drifts together: a slow spell slows whatever cell is being timed. On the
2-core reference machine the level of one verify visit against its cell's median and that of the next visit (another
cell) correlate about 0.8, up to five visits apart. With cells visited in a shuffled order, a visit's neighbours in
time are other cells, and the drift is the part of its level they share. On log-timings, c the cell, v the visit,
i the sample,

    ln x_{v,i} = μ_c + δ_v + ε_{v,i}          δ_v the device's level at visit v, smooth in time

estimated by alternating (`ROUNDS` times, from δ = 0):
    μ_c = median over the cell's visits of (ln m_v − δ_v)          m_v the visit's median sample
    r_v = ln m_v − μ_c                                            the visit's level against its cell
    δ_v = median of r_u over the `WINDOW` informative visits of other cells either side of v
where a visit is informative when its cell has at least 2 visits (with one, r_v is 0 by construction). δ is then
shifted so that its median is 0: the corrected figures are at the device's typical speed over the measurement. Every
sample of visit v is divided by exp(δ_v). Its own cell's levels never enter its δ, so a cell slow in every visit (a
slow kernel shape) stays slow; what is removed is what the other cells timed around it share.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np

# informative visits either side (on the reference machine: ±2 to ±8 all take the within-cell sd 0.15 -> 0.06-0.07)
WINDOW = 4
ROUNDS = 5
MIN_INFORMATIVE_VISITS = 2 * WINDOW + 1  # fewer: no correction (the levels could not be told from the cells)


_Cell = TypeVar("_Cell", bound=Hashable)  # what a visit timed: verify_curve's (B, ctx, t)


@dataclasses.dataclass(frozen=True)
class Corrected(Generic[_Cell]):
    visits: dict[_Cell, list[list[float]]]  # per cell, each visit's samples divided by its level, in visit order
    levels: list[float]  # per visit, exp(δ_v): above 1 the device ran slower than typical
    applied: bool  # False where too few informative visits: samples unchanged, levels all 1

    @functools.cached_property
    def samples(self) -> dict[_Cell, list[float]]:
        """Per cell, every visit's samples pooled."""
        return {c: [x for v in vs for x in v] for c, vs in self.visits.items()}

    def summary(self) -> dict:
        """What profile.json records of the correction."""
        return {
            "method": "per visit, the median level of the visits either side of it (other cells) against their cells' "
            f"medians, alternated {ROUNDS}x with the cells' medians (profiles/drift.py); samples divided by it",
            "window_visits": WINDOW,
            "applied": self.applied,
            "level_range": [min(self.levels), max(self.levels)] if self.levels else None,
        }


def levels(visits: Sequence[tuple[Hashable, Sequence[float]]]) -> tuple[np.ndarray, bool]:
    """δ_v (natural log) per visit, in visit order, and whether the visits sufficed to estimate it."""
    cells = [c for c, _ in visits]
    log_m = np.array([math.log(statistics.median(s)) for _, s in visits])
    counts: dict[Hashable, int] = {}
    for c in cells:
        counts[c] = counts.get(c, 0) + 1
    informative = np.array([counts[c] >= 2 for c in cells])
    delta = np.zeros(len(visits))
    if informative.sum() < MIN_INFORMATIVE_VISITS:
        return delta, False
    neighbours = [_neighbours(cells, informative, v) for v in range(len(visits))]
    for _ in range(ROUNDS):
        by_cell: dict[Hashable, list[float]] = {}
        for c, y, d in zip(cells, log_m, delta):
            by_cell.setdefault(c, []).append(y - d)
        mu = {c: float(np.median(ys)) for c, ys in by_cell.items()}
        r = log_m - np.array([mu[c] for c in cells])
        delta = np.array([float(np.median(r[u])) if u else 0.0 for u in neighbours])
    return delta - np.median(delta), True


def _neighbours(cells: list, informative: np.ndarray, v: int) -> list[int]:
    """Up to `WINDOW` informative visits of other cells on either side of visit v, nearest first."""
    found = []
    for step in (-1, 1):
        u, taken = v + step, 0
        while 0 <= u < len(cells) and taken < WINDOW:
            if informative[u] and cells[u] != cells[v]:
                found.append(u)
                taken += 1
            u += step
    return found


def corrected(visits: Sequence[tuple[_Cell, Sequence[float]]]) -> Corrected[_Cell]:
    """Every visit's samples at the device's typical speed (module docstring), grouped by cell."""
    delta, applied = levels(visits) if visits else (np.zeros(0), False)
    by_visit: dict[_Cell, list[list[float]]] = {}
    for (c, s), d in zip(visits, delta):
        by_visit.setdefault(c, []).append([x / math.exp(d) for x in s])
    return Corrected(by_visit, [math.exp(d) for d in delta], applied)
