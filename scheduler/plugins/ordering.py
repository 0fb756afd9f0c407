"""Queue-sort plugins: FIFO, SRTF (oracle), LAS, 2D-LAS (Tiresias) and 2D-Gittins."""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

from scheduler.framework import Context, QueueSort, register
from scheduler.model import JobRecord, JobState
from scheduler.plugins.tail import BoostedArrival


def _tiebreak(rec: JobRecord) -> tuple[float, str]:
    return (rec.job.arrival, rec.job.id)


def _gpus(rec: JobRecord) -> int:
    """The GPU count service is divided by: a CPU-only job (0 GPUs, never any GPU service) counts as 1."""
    return max(1, rec.job.gpus)


@register("order", "fifo")
class Fifo(QueueSort):
    """Arrival order, higher ``priority`` first.  Never preempts."""

    preemptive = False

    def key(self, rec: JobRecord, ctx: Context) -> Any:
        return (-rec.job.priority, *_tiebreak(rec))


class _Preemptive(QueueSort):
    preemptive = True
    uniform_wakeup = True  # every running job's key may change at now + quantum

    def __init__(self, quantum_s: float = 360.0) -> None:
        # 360 s: Gavel's round length, the granularity its preemptive policies decide at.
        if quantum_s <= 0:
            raise ValueError("quantum_s must be > 0")
        self.quantum_s = float(quantum_s)

    def next_change(self, rec: JobRecord, ctx: Context) -> float | None:
        return ctx.now + self.quantum_s


@register("order", "srtf")
class Srtf(_Preemptive):
    """Shortest remaining time first, from the job's true ``duration`` (an oracle:
    for reference only; jobs without a duration go last)."""

    def key(self, rec: JobRecord, ctx: Context) -> Any:
        d = rec.job.duration
        rem = math.inf if d is None else d - rec.service(ctx.now) / _gpus(rec)
        return (-rec.job.priority, rem, *_tiebreak(rec))


@register("order", "las")
class Las(_Preemptive):
    """Least attained service (GPU-seconds) first, re-evaluated every quantum."""

    def key(self, rec: JobRecord, ctx: Context) -> Any:
        return (-rec.job.priority, rec.service(ctx.now), *_tiebreak(rec))


def _load_prior(prior: str) -> np.ndarray:
    if prior == "philly":
        from scheduler import data

        return data.philly_runtimes()
    raise ValueError(f"unknown duration prior {prior!r} (known: philly)")


@register("order", "tiresias")
class Tiresias(_Preemptive):
    """2D-LAS: discretised queues on attained GPU-time, FIFO inside a queue.

    ``thresholds`` (GPU-seconds) may be given; by default they come from the
    scale of the work itself: quantiles ``quantiles`` of the GPU-time of jobs
    that finished so far, starting from the Philly duration prior, so a trace of
    multi-day jobs does not collapse into one queue as Tiresias's fixed
    3,250/7,200/18,000 GPU-s do.
    """

    uniform_wakeup = False  # each job crosses its next threshold at its own time

    def __init__(self, thresholds: list[float] | None = None, quantiles: list[float] = (0.5, 0.8, 0.95),
                 prior: str = "philly", quantum_s: float = 360.0, min_samples: int = 20) -> None:
        super().__init__(quantum_s)
        self.fixed = thresholds is not None
        if thresholds is not None:
            if sorted(thresholds) != list(thresholds) or any(t <= 0 for t in thresholds):
                raise ValueError("thresholds must be positive and increasing")
            self.thresholds = [float(t) for t in thresholds]
        else:
            self.quantiles = [float(q) for q in quantiles]
            self.prior = np.sort(_load_prior(prior)) if prior else np.array([])
            self.seen: list[float] = []
            self.min_samples = min_samples
            self.thresholds = self._from(self.prior)

    def _from(self, sample: np.ndarray) -> list[float]:
        if len(sample) == 0:
            return [3600.0]
        qs = np.quantile(sample, self.quantiles)
        return sorted({max(1.0, float(q)) for q in qs})

    def observe_finished(self, rec: JobRecord, ctx: Context) -> None:
        if self.fixed:
            return
        bisect.insort(self.seen, rec.job.attained_service)
        if len(self.seen) >= self.min_samples:
            self.thresholds = self._from(np.asarray(self.seen))

    def queue_of(self, service: float) -> int:
        return bisect.bisect_right(self.thresholds, service)

    def key(self, rec: JobRecord, ctx: Context) -> Any:
        return (-rec.job.priority, self.queue_of(rec.service(ctx.now)), *_tiebreak(rec))

    def next_change(self, rec: JobRecord, ctx: Context) -> float | None:
        s = rec.service(ctx.now)
        q = self.queue_of(s)
        if q >= len(self.thresholds):
            return ctx.now + self.quantum_s
        return min(ctx.now + self.quantum_s, ctx.now + (self.thresholds[q] - s) / _gpus(rec) + 1e-6)


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
        self._built_weight = float(w.sum())
        self._pending = 0.0

    def __call__(self, attained: float) -> float:
        i = bisect.bisect_right(self._grid, attained) - 1
        return self._index[max(0, min(i, len(self._index) - 1))]

    def next_point(self, attained: float) -> float:
        i = int(np.searchsorted(self.grid, attained, side="right"))
        return float(self.grid[i]) if i < len(self.grid) else math.inf


@register("order", "gittins")
class Gittins(_Preemptive):
    """2D-Gittins (Tiresias): the Gittins index of the job's attained time under
    a duration prior (Philly runtimes), divided by its GPU count, so a job's
    service is counted in GPU-time.

    ``learn``: the prior absorbs the run times of jobs that finish
    (``learn_weight`` each).  ``per_type``: each job type (model, batch size,
    GPUs) gets its own distribution, the global one scaled to ``prior_weight``
    pseudo-jobs plus the run times of finished jobs of that type: history-based
    priors, learned online, never from a job's own duration.
    ``starve_factor``: Tiresias's starvation guard (0 = off).
    ``boost``: bound the tail with boosted arrival times
    (:mod:`scheduler.plugins.tail`): jobs run in order of arrival minus a head
    start that grows with their index, up to ``boost`` x the mean run time of
    finished jobs (0 = off: plain index order).
    """

    def __init__(self, prior: str = "philly", learn: bool = True, learn_weight: float = 50.0,
                 quantum_s: float = 360.0, starve_factor: float = 0.0, per_type: bool = False,
                 prior_weight: float = 20.0, boost: float = 0.0) -> None:
        super().__init__(quantum_s)
        if starve_factor < 0 or prior_weight <= 0 or learn_weight < 0 or boost < 0:
            raise ValueError("starve_factor, learn_weight, boost must be >= 0 and prior_weight > 0")
        self.starve_factor = float(starve_factor)
        samples = _load_prior(prior)
        self.table = GittinsTable(samples)
        self.boost = BoostedArrival(boost, float(np.mean(samples))) if boost else None
        self.learn = learn
        self.learn_weight = float(learn_weight)
        self.per_type = per_type
        self.prior_weight = float(prior_weight)
        self.types: dict[tuple[str, int], GittinsTable] = {}
        self._pending: list[float] = []

    @staticmethod
    def _type(rec: JobRecord) -> tuple[str, int]:
        return (rec.job.job_type, rec.job.gpus)

    def observe_finished(self, rec: JobRecord, ctx: Context) -> None:
        run_time = rec.job.attained_service / _gpus(rec)
        if self.boost is not None:
            self.boost.observe(run_time)
        if self.per_type:
            tab = self.types.get(self._type(rec))
            if tab is None:
                tab = self.types[self._type(rec)] = self.table.scaled(self.prior_weight)
            tab.add(np.asarray([run_time]), 1.0)
        if not self.learn:
            return
        self._pending.append(run_time)
        if len(self._pending) >= 10:
            self.table.add(np.asarray(self._pending), self.learn_weight)
            self._pending.clear()

    def key(self, rec: JobRecord, ctx: Context) -> Any:
        t = rec.service(ctx.now) / _gpus(rec)
        # Tiresias's starvation guard: a job that has waited longer than
        # starve_factor x its attained time (at least a round) goes to the head, oldest first.
        if (self.starve_factor and rec.run_since is None and t > 0
                and ctx.now - rec.queued_since > self.starve_factor * max(t, self.quantum_s)):
            return (-rec.job.priority, -math.inf, *_tiebreak(rec))
        tab = self.types.get(self._type(rec), self.table) if self.per_type else self.table
        if self.boost is not None:
            return (-rec.job.priority, self.boost.rank(rec, tab(t) / _gpus(rec)), rec.job.id)
        return (-rec.job.priority, -tab(t) / _gpus(rec), *_tiebreak(rec))


__all__ = ["Fifo", "Srtf", "Las", "Tiresias", "Gittins", "GittinsTable", "JobState"]
