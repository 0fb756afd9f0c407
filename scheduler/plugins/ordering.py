"""Queue-sort plugins: FIFO, SRTF (oracle), LAS, 2D-LAS (Tiresias) and 2D-Gittins."""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

from scheduler.framework import Context, QueueSort, register
from scheduler.model import JobRecord, JobState
from scheduler.plugins.durations import GittinsTable, LearnedDurations
from scheduler.plugins.tail import BoostedArrival, ShareBound


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
    ``prior_jobs`` (> 0): learn the workload's distribution instead, with the prior counting as that
    many pseudo-jobs and the active jobs as censored observations (Kaplan-Meier;
    :class:`~scheduler.plugins.durations.LearnedDurations`); ``per_type`` then refines it per type
    with ``prior_weight`` pseudo-jobs of the workload's distribution.
    ``samples``: the run-time distribution given outright (seconds), in place of ``prior``: a
    benchmark's reference (``gittins-known`` in bench/sched_shapes.py: the trace's own run times), not
    something a live scheduler has.
    ``starve_factor``: Tiresias's starvation guard (0 = off).
    ``boost``: bound the tail with boosted arrival times
    (:mod:`scheduler.plugins.tail`): jobs run in order of arrival minus a head
    start that grows with their index, up to ``boost`` x the mean run time of
    finished jobs (0 = off: plain index order).
    ``preempt_margin`` (>= 1; 0 = off): a running job's index counts that many times over, so a
    waiting job displaces it only with an index at least that much better: a preemption costs a
    restart, and the index is an estimate (issue 23: the ``dlshare`` profile preempted 8.4 times
    a job on vc_0e4a51 without one).
    ``share_bound`` (> 0): bound every job's slowdown against an equal share of the cluster
    (:class:`~scheduler.plugins.tail.ShareBound`): a job that has had less than 1/``share_bound``
    of an equal share goes first, oldest first, until it has its whole share.
    """

    def __init__(self, prior: str = "philly", learn: bool = True, learn_weight: float = 50.0,
                 quantum_s: float = 360.0, starve_factor: float = 0.0, per_type: bool = False,
                 prior_weight: float = 20.0, boost: float = 0.0, prior_jobs: float = 0.0,
                 share_bound: float = 0.0, preempt_margin: float = 0.0,
                 samples: list[float] | None = None) -> None:
        super().__init__(quantum_s)
        if starve_factor < 0 or prior_weight <= 0 or learn_weight < 0 or boost < 0 or prior_jobs < 0 \
                or share_bound < 0:
            raise ValueError("starve_factor, learn_weight, boost, prior_jobs, share_bound must be >= 0 and "
                             "prior_weight > 0")
        if boost and share_bound:
            raise ValueError("boost and share_bound are two tail bounds: give one")
        self.starve_factor = float(starve_factor)
        if samples is not None:
            given = np.asarray(samples, dtype=float)
            if given.ndim != 1 or not given.size or not np.all(np.isfinite(given)) or np.any(given <= 0):
                raise ValueError("samples: a non-empty list of positive, finite run times in seconds")
            samples = given
        else:
            samples = _load_prior(prior)
        self.learned = LearnedDurations(samples, prior_jobs, prior_weight) if prior_jobs else None
        self.table = self.learned.table if self.learned is not None else GittinsTable(samples)
        self.boost = BoostedArrival(boost, float(np.mean(samples))) if boost else None
        self.bound = ShareBound(share_bound) if share_bound else None
        self._promoted: set[str] = set()  # jobs owed when last looked at (ShareBound)
        self.learn = learn
        self.learn_weight = float(learn_weight)
        self.per_type = per_type
        self.prior_weight = float(prior_weight)
        self.types: dict[tuple[str, int], GittinsTable] = {}
        self._pending: list[float] = []
        if preempt_margin and preempt_margin < 1:
            raise ValueError("preempt_margin must be >= 1 (or 0: off)")
        self.preempt_margin = float(preempt_margin)

    @staticmethod
    def _type(rec: JobRecord) -> tuple[str, int]:
        return (rec.job.job_type, rec.job.gpus)

    def observe_finished(self, rec: JobRecord, ctx: Context) -> None:
        self._promoted.discard(rec.job.id)
        run_time = rec.job.attained_service / _gpus(rec)
        if self.boost is not None:
            self.boost.observe(run_time)
        if self.learned is not None:
            self.learned.observe(self._type(rec), run_time)
            if self.learned.due():
                active = (*(ctx.running or {}).values(), *(ctx.waiting or {}).values())
                self.learned.rebuild((self._type(r), r.service(ctx.now) / _gpus(r)) for r in active
                                     if r is not rec and not r.job.cpu_only)
            return
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

    def _owed(self, rec: JobRecord, ctx: Context, t: float, tab: GittinsTable) -> bool:
        """The tail bound (:class:`~scheduler.plugins.tail.ShareBound`): owed when short of
        1/``share_bound`` of an equal share; a job promoted for it keeps the GPUs until it has its
        whole equal share (hysteresis: it is not swapped out again as soon as it is back at the bound)."""
        jid = rec.job.id
        if rec.run_since is not None and jid in self._promoted:
            if self.bound.caught_up(rec, ctx, t):
                self._promoted.discard(jid)
                return False
            return True
        owed = self.bound.owed(rec, ctx, max(t, tab.expected_total(0.0)))
        if owed:
            self._promoted.add(jid)
        else:
            self._promoted.discard(jid)
        return owed

    def _table(self, rec: JobRecord) -> GittinsTable:
        if not self.per_type:
            return self.table
        if self.learned is not None:
            return self.learned.for_type(self._type(rec))
        return self.types.get(self._type(rec), self.table)

    def key(self, rec: JobRecord, ctx: Context) -> Any:
        t = rec.service(ctx.now) / _gpus(rec)
        # Tiresias's starvation guard: a job that has waited longer than
        # starve_factor x its attained time (at least a round) goes to the head, oldest first.
        if (self.starve_factor and rec.run_since is None and t > 0
                and ctx.now - rec.queued_since > self.starve_factor * max(t, self.quantum_s)):
            return (-rec.job.priority, -math.inf, *_tiebreak(rec))
        tab = self._table(rec)
        rate = tab(t) / _gpus(rec)
        if self.preempt_margin and rec.run_since is not None:
            rate *= self.preempt_margin  # hysteresis: see the class docstring
        if self.bound is not None:
            if self._owed(rec, ctx, t, tab):
                return (-rec.job.priority, 0, rec.job.arrival, rec.job.id)
            return (-rec.job.priority, 1, -rate, rec.job.id)
        if self.boost is not None:
            return (-rec.job.priority, self.boost.rank(rec, rate), rec.job.id)
        return (-rec.job.priority, -rate, *_tiebreak(rec))


__all__ = ["Fifo", "Srtf", "Las", "Tiresias", "Gittins", "GittinsTable", "JobState"]
