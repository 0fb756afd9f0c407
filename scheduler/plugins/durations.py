"""Duration distributions for the duration-agnostic orders: the Gittins table and its online learning.

:class:`GittinsTable` turns a distribution of run times (a histogram on a log-spaced grid) into the
Gittins index the 2D-Gittins order ranks by (Tiresias, NSDI'19).

:class:`LearnedDurations` learns that distribution from the workload itself, as it runs:

* the prior (Philly's runtimes) counts as ``prior_jobs`` pseudo-jobs, so it only seeds the estimate:
  after a few dozen jobs have finished the workload's own run times dominate (a trace whose jobs
  run for hours is not ranked as if they ran for Philly's median 20 minutes);
* the jobs still running or preempted are *censored* observations (Kaplan-Meier): a job that has
  run 30 h without finishing says D > 30 h.  Without them the estimate learns from the jobs that
  finished first, which are the short ones, and ranks every long job as hopeless;
* per job type (model, batch size, GPUs) the same estimate is made again, with the workload's
  distribution as the prior (``type_prior_jobs`` pseudo-jobs) and the type's own jobs on top:
  history-based priors, never a job's own duration.

The estimate is rebuilt when a tenth more jobs have finished since the last rebuild (so n jobs cost
O(log n) rebuilds), from the finished jobs and the active ones at that moment.  Pure: no clock, no
randomness; every input comes from the core's records.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

import numpy as np


class GittinsTable:
    """Gittins index of a duration distribution on a log-spaced grid of attained time.

    index(a) = max over b > a of P(D <= b | D > a) / E[min(D, b) - a | D > a]:
    the best completion rate per unit of further service.  Built from weighted
    samples (a histogram), so finished jobs can be added online.
    """

    def __init__(self, samples: np.ndarray, lo: float = 1.0, hi: float = 3e7, bins: int = 160) -> None:
        self.grid = np.geomspace(lo, hi, bins)
        self.weights = np.zeros(bins)
        self._pending = 0.0  # weight added since the last build
        self._built_weight = 0.0  # total weight the last build saw
        self._index: list[float] | None = None  # the index per grid point, as a list (fast lookups)
        self.add(np.asarray(samples, dtype=float))

    def scaled(self, total_weight: float) -> "GittinsTable":
        """A copy whose distribution is the same but weighs ``total_weight`` in all."""
        t = GittinsTable.__new__(GittinsTable)
        t.grid = self.grid.copy()
        t.weights = self.weights * (total_weight / max(self.weights.sum(), 1e-12))
        t._pending, t._built_weight, t._index = 0.0, 0.0, None
        t._build()
        return t

    def set_mass(self, mass: np.ndarray) -> None:
        """Replace the distribution by per-bin ``mass`` (any scale) and rebuild the index now."""
        self.weights = np.asarray(mass, dtype=float).copy()
        self._build()

    def add(self, samples: np.ndarray, weight: float = 1.0) -> None:
        """Add samples; the index is rebuilt lazily, once the new weight reaches
        a tenth of what the last build saw (so n samples cost O(log n) builds)."""
        idx = np.clip(np.searchsorted(self.grid, np.maximum(samples, self.grid[0])), 0, len(self.grid) - 1)
        np.add.at(self.weights, idx, weight)
        self._pending += weight * len(idx)
        if self._index is None or self._pending >= 0.1 * self._built_weight:
            self._build()

    def _build(self) -> None:
        x, w = self.grid, self.weights
        n = len(x)
        if w.sum() <= 0:
            self.index = np.ones(n)
            self._grid, self._index = self.grid.tolist(), self.index.tolist()
            self._expected = self._grid
            return
        # tail[i] = weight of D in bins i..; cum_xw[i] = sum_{k<i} w_k x_k
        tail = np.concatenate([np.cumsum(w[::-1])[::-1], [0.0]])
        cum_xw = np.concatenate([[0.0], np.cumsum(w * x)])
        # Condition on D > a = x[i]: jobs in bin i finished at a, so survivors are
        # bins i+1..; stopping at b = x[j] (j > i) finishes bins i+1..j and costs
        # sum_{k=i+1..j} w_k (x_k - a) + tail[j+1] (b - a).  All (i, j) at once.
        i = np.arange(n)[:, None]
        j = np.arange(n)[None, :]
        done = tail[i + 1] - tail[j + 1]
        spent = (cum_xw[j + 1] - cum_xw[i + 1]) - x[i] * done + tail[j + 1] * (x[j] - x[i])
        valid = (j > i) & (spent > 1e-12 * max(1.0, float(w.sum())))
        rate = np.where(valid, done / np.where(valid, spent, 1.0), 0.0)
        index = rate.max(axis=1)
        dead = tail[1:] <= 0  # nobody survives past bin i: keep the last index
        for k in np.nonzero(dead)[0]:
            index[k] = index[k - 1] if k else 0.0
        self.index = index
        self._grid = self.grid.tolist()
        self._index = index.tolist()
        # E[D | D > x[i]] (the survivors are bins i+1..), for the tail bound's expected sizes.
        surv, surv_x = tail[1:], np.concatenate([np.cumsum((w * x)[::-1])[::-1][1:], [0.0]])
        self._expected = np.where(surv > 0, surv_x / np.where(surv > 0, surv, 1.0), x).tolist()
        self._built_weight = float(w.sum())
        self._pending = 0.0

    def __call__(self, attained: float) -> float:
        i = bisect.bisect_right(self._grid, attained) - 1
        return self._index[max(0, min(i, len(self._index) - 1))]

    def expected_total(self, attained: float) -> float:
        """E[D | D > attained]: the run time a job that has run ``attained`` is expected to reach."""
        i = bisect.bisect_right(self._grid, attained) - 1
        return max(attained, self._expected[max(0, min(i, len(self._expected) - 1))])

    def next_point(self, attained: float) -> float:
        i = int(np.searchsorted(self.grid, attained, side="right"))
        return float(self.grid[i]) if i < len(self.grid) else math.inf


def kaplan_meier(events: np.ndarray, censored: np.ndarray) -> np.ndarray:
    """Probability mass per bin of a duration from per-bin weights of finished (``events``) and
    censored observations (still running when seen): the Kaplan-Meier estimate.  A censored
    observation in bin i counts as at risk in bin i (it may still end there) and after it is gone.
    What survives the last observation is put in its bin (Efron's tail correction: the longest job
    seen ends where it was seen), not at the grid's end, which would make every job that outlived
    the others look endless."""
    ev = np.asarray(events, dtype=float)
    seen = ev + np.asarray(censored, dtype=float)
    at_risk = np.cumsum(seen[::-1])[::-1]
    hazard = np.where(at_risk > 0, ev / np.where(at_risk > 0, at_risk, 1.0), 0.0)
    surv = np.cumprod(1.0 - np.clip(hazard, 0.0, 1.0))
    mass = -np.diff(np.concatenate([[1.0], surv]))
    last = int(np.nonzero(seen > 0)[0][-1]) if seen.any() else len(mass) - 1
    mass[last] += surv[-1]
    return np.maximum(mass, 0.0)


class LearnedDurations:
    """Run-time distributions learned online, for the whole workload and per job type (see the
    module docstring).  ``prior``: run-time samples (seconds per GPU) the estimate starts from."""

    def __init__(self, prior: np.ndarray, prior_jobs: float = 20.0, type_prior_jobs: float = 20.0,
                 rebuild_fraction: float = 0.1) -> None:
        if not prior_jobs > 0 or not type_prior_jobs > 0 or not 0 < rebuild_fraction <= 1:
            raise ValueError("prior_jobs and type_prior_jobs must be > 0, rebuild_fraction in (0, 1]")
        self.table = GittinsTable(np.asarray(prior, dtype=float))
        grid = self.table.grid
        self.prior_mass = self.table.weights * (prior_jobs / max(self.table.weights.sum(), 1e-12))
        self.type_prior_jobs = float(type_prior_jobs)
        self.rebuild_fraction = float(rebuild_fraction)
        self.events = np.zeros(len(grid))  # finished jobs' run times, one per job
        self.type_events: dict[tuple[str, int], np.ndarray] = {}
        self.type_censored: dict[tuple[str, int], np.ndarray] = {}
        self.types: dict[tuple[str, int], GittinsTable] = {}
        self._stale: set[tuple[str, int]] = set()
        self.finished = 0
        self._built_at = 0  # jobs finished at the last rebuild
        self.version = 0  # rebuilds so far
        self.table.set_mass(self.prior_mass)

    def _bin(self, x: float) -> int:
        grid = self.table.grid
        return int(min(len(grid) - 1, np.searchsorted(grid, max(x, grid[0]))))

    def observe(self, job_type: tuple[str, int], run_time_s: float) -> None:
        """A job of ``job_type`` finished after ``run_time_s`` seconds (per GPU)."""
        i = self._bin(run_time_s)
        self.events[i] += 1.0
        ev = self.type_events.get(job_type)
        if ev is None:
            ev = self.type_events[job_type] = np.zeros(len(self.events))
        ev[i] += 1.0
        self.finished += 1
        self._stale.add(job_type)

    def due(self) -> bool:
        """Enough jobs finished since the last rebuild to rebuild (a tenth more)."""
        return self.finished - self._built_at >= max(1.0, self.rebuild_fraction * self._built_at)

    def rebuild(self, active: Iterable[tuple[tuple[str, int], float]]) -> None:
        """Rebuild the estimates from the finished jobs and ``active``: (type, seconds per GPU run
        so far) of every job that has run and not finished (censored observations)."""
        n = len(self.events)
        censored = np.zeros(n)
        per_type: dict[tuple[str, int], np.ndarray] = {}
        for jt, ran in active:
            if ran <= 0:
                continue  # D > 0 says nothing
            i = self._bin(ran)
            censored[i] += 1.0
            c = per_type.get(jt)
            if c is None:
                c = per_type[jt] = np.zeros(n)
            c[i] += 1.0
        self.table.set_mass(kaplan_meier(self.prior_mass + self.events, censored))
        self.type_censored = per_type
        self._stale = set(self.type_events) | set(self.types)
        self._built_at = self.finished
        self.version += 1

    def for_type(self, job_type: tuple[str, int]) -> GittinsTable:
        """The table of ``job_type``: the workload's distribution as its prior, plus the type's own
        finished and censored jobs; the workload's table for a type no job of which finished yet."""
        if job_type not in self.type_events:
            return self.table
        tab = self.types.get(job_type)
        if tab is None or job_type in self._stale:
            base = self.table.weights / max(self.table.weights.sum(), 1e-12) * self.type_prior_jobs
            mass = kaplan_meier(base + self.type_events[job_type],
                                self.type_censored.get(job_type, np.zeros(len(base))))
            if tab is None:
                tab = self.types[job_type] = GittinsTable.__new__(GittinsTable)
                tab.grid = self.table.grid
                tab._pending, tab._built_weight, tab._index = 0.0, 0.0, None
            tab.set_mass(mass)
            self._stale.discard(job_type)
        return tab


__all__ = ["GittinsTable", "LearnedDurations", "kaplan_meier"]
