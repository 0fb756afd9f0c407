"""When each waiting job should start: the current queue replayed forward through the same core.

The core is pure, so the question "when would this job start?" has an exact answer for a given
guess of when the running jobs end: copy the core, feed the copy :class:`JobFinished` events at
those times and :class:`Tick` events where it asks for them (its own :class:`Wakeup` decisions),
and read the time of each :class:`Place`.  The copy runs the profile's own plugins (order, filters,
scores, allocation, fair share, quotas, backoff): the forecast has no scheduling policy of its own.

What it guesses is how long jobs run, which nobody knows (the policies that need it, Tiresias and
Gittins, do without).  :class:`DurationPrior` gives the expected remaining run time of a job that
has run ``a`` seconds from a sample of run times (the Philly runtimes the Gittins order uses, plus
the run times of jobs that finished here): the mean residual life ``E[D - a | D > a]``.  A job that
has outrun every sample is given as long again as it has run.

No job arrives in the forecast, so a later arrival that overtakes a waiting job (a higher
priority, a user under their fair share, a shorter job under LAS) makes the estimate early.
``bench/forecast.py`` measures how close the estimates come on traces.

Pure: the live core is only read (and deep-copied); the copy shares the predictors, which the
forecast never trains (it feeds no node reports).
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from scheduler.events import JobFinished, Place, Preempt, Reject, Release, Tick, Wakeup
from scheduler.model import JobRecord, JobState

if TYPE_CHECKING:  # pragma: no cover
    from scheduler.state import SchedulerState

MIN_REMAINING_S = 1.0  # a job is never expected to end sooner than this


class _Table:
    """Weighted run times and their suffix sums: the mean residual life in O(log n)."""

    def __init__(self, base: np.ndarray, base_weight: float) -> None:
        self.base, self.base_weight = base, base_weight
        self.extra: list[tuple[float, float]] = []  # (run time, weight)
        self._dirty = True
        self._xs = base
        self._sw = self._sx = np.zeros(1)

    def add(self, duration: float, weight: float) -> None:
        self.extra.append((duration, weight))
        self._dirty = True

    def _build(self) -> None:
        xs = np.concatenate([self.base, np.asarray([d for d, _ in self.extra], dtype=float)])
        w = np.concatenate([np.full(len(self.base), self.base_weight),
                            np.asarray([w for _, w in self.extra], dtype=float)])
        order = np.argsort(xs, kind="stable")
        self._xs, w = xs[order], w[order]
        # Suffix sums: the weight and the weighted sum of the samples from index i on.
        self._sw = np.concatenate([np.cumsum(w[::-1])[::-1], [0.0]])
        self._sx = np.concatenate([np.cumsum((w * self._xs)[::-1])[::-1], [0.0]])
        self._dirty = False

    def remaining(self, a: float) -> float:
        if self._dirty:
            self._build()
        i = int(np.searchsorted(self._xs, a, side="right"))
        w = float(self._sw[i]) if len(self._xs) else 0.0
        if w <= 0:
            return max(MIN_REMAINING_S, a)
        return max(MIN_REMAINING_S, float(self._sx[i]) / w - a)


class DurationPrior:
    """Expected remaining run time from a sample of run times (seconds, wall time per run).

    ``remaining(a)`` is the mean of ``d - a`` over the samples ``d > a`` (the mean residual
    life); past the largest sample it is ``a`` itself (a job that ran this long is expected to run
    as long again).  :meth:`add` takes the run time of a job that finished, so the prior moves
    towards the cluster's own jobs: each weighs ``weight`` samples, and the given ``samples`` weigh
    ``prior_weight`` in all (None: one each).  With ``per_type``, each job type (model and batch
    size) that has finished once gets a table of its own, the samples weighing ``prior_weight`` in
    it too, as the Gittins order learns per job type."""

    def __init__(self, samples: Iterable[float], weight: float = 1.0, prior_weight: float | None = None,
                 per_type: bool = False) -> None:
        xs = np.sort(np.asarray([float(x) for x in samples if x == x and 0 < x < math.inf], dtype=float))
        if weight <= 0 or (prior_weight is not None and prior_weight <= 0):
            raise ValueError("weight and prior_weight must be > 0")
        self.weight = float(weight)
        self.base_weight = 1.0 if prior_weight is None or not len(xs) else float(prior_weight) / len(xs)
        self.per_type = per_type
        self._base = xs
        self._all = _Table(xs, self.base_weight)
        self._types: dict[str, _Table] = {}
        self._count = len(xs)

    def __len__(self) -> int:
        return self._count

    def add(self, duration: float, job_type: str = "") -> None:
        """A job (of ``job_type``) ran ``duration`` seconds in all and finished."""
        if not (duration == duration and 0 < duration < math.inf):
            return
        self._count += 1
        self._all.add(float(duration), self.weight)
        if self.per_type and job_type:
            t = self._types.get(job_type)
            if t is None:
                t = self._types[job_type] = _Table(self._base, self.base_weight)
            t.add(float(duration), self.weight)

    def remaining(self, elapsed: float, job_type: str = "") -> float:
        """Expected seconds left for a job (of ``job_type``) that has run ``elapsed`` seconds."""
        a = max(0.0, float(elapsed))
        table = self._types.get(job_type) if self.per_type else None
        return (table or self._all).remaining(a)


@dataclass(frozen=True)
class Forecast:
    """``starts``: job -> the time the replay started it (only jobs waiting when it began; a job
    the replay never started within ``horizon_s`` or ``max_batches`` is absent); ``until``: the
    time the replay reached; ``complete``: every waiting job got a start; ``batches``: core calls."""

    at: float
    starts: dict[str, float] = field(default_factory=dict)
    until: float = 0.0
    complete: bool = True
    batches: int = 0


def elapsed_of(rec: JobRecord, now: float) -> float:
    """Seconds the job has run in all (its attained GPU-seconds over its GPUs; for a CPU-only job,
    its current run)."""
    if rec.job.gpus:
        return rec.service(now) / rec.job.gpus
    return max(0.0, now - rec.run_since) if rec.run_since is not None else 0.0


def clone(state: "SchedulerState") -> "SchedulerState":
    """A deep copy of the core that shares its predictors (read, never trained, by a forecast)."""
    memo = {id(state.predictors): state.predictors}
    return copy.deepcopy(state, memo)


class Replay:
    """A forecast that can be run a few batches at a time (:meth:`step`), so a live loop spreads
    it over its rounds instead of stalling on it; :func:`forecast` runs one to the end.  The copy
    of the core is taken when it is made: it answers for that moment, whatever the live core does
    meanwhile."""

    def __init__(self, state: "SchedulerState", prior: DurationPrior, *, horizon_s: float = 14 * 86400.0,
                 max_batches: int = 6000, remaining: Callable[[JobRecord, float], float] | None = None) -> None:
        self.now = state.now
        self.prior, self.remaining = prior, remaining
        self.max_batches = max_batches
        self.end = self.now + horizon_s
        self.sim = clone(state)
        self.sim.watch.missing_since.clear()  # running jobs are taken to run on until their expected end
        self.waiting = set(self.sim.waiting)
        self.starts: dict[str, float] = {}
        self.heap: list[tuple[float, int, str, int]] = []  # (time, seq, job or "" for a Tick, version)
        self.version: dict[str, int] = {}
        self.ticks: set[float] = set()
        self.seq = 0
        self.batches = 0
        self.t = self.now
        self.done = not self.waiting
        for rec in self.sim.running.values():
            if not rec.external:  # a bound pod ends with its hold (the core's own Wakeup), or never
                self._expect_end(rec, self.now)
        for at in (self.sim.passes.wakeup_at, self.sim.watch.next_deadline(self.now)):
            self._tick(at)

    def _push(self, t: float, job: str = "", ver: int = 0) -> None:
        heapq.heappush(self.heap, (t, self.seq, job, ver))
        self.seq += 1

    def _tick(self, at: float | None) -> None:
        if at is not None and at >= self.now and at not in self.ticks:
            self.ticks.add(at)
            self._push(at)

    def _expect_end(self, rec: JobRecord, t: float) -> None:
        v = self.version[rec.job.id] = self.version.get(rec.job.id, 0) + 1
        ran = elapsed_of(rec, t)
        if self.remaining is None:
            left = self.prior.remaining(ran, rec.job.job_type)
        else:
            left = max(MIN_REMAINING_S, self.remaining(rec, ran))
        self._push(t + left, rec.job.id, v)

    def step(self, batches: int = 1 << 30) -> bool:
        """Run at most ``batches`` more core batches; returns whether the replay is over."""
        sim, heap = self.sim, self.heap
        budget = batches
        while not self.done and budget > 0:
            if not heap or len(self.starts) >= len(self.waiting) or self.batches >= self.max_batches \
                    or heap[0][0] > self.end:
                self.done = True
                break
            t = self.t = heap[0][0]
            events = []
            while heap and heap[0][0] == t:
                _, _, jid, ver = heapq.heappop(heap)
                if not jid:
                    self.ticks.discard(t)
                    events.append(Tick(f"forecast:tick:{t:.6f}", t))
                elif self.version.get(jid) == ver and jid in sim.running:
                    self.version[jid] = ver + 1
                    events.append(JobFinished(f"forecast:end:{jid}", t, jid))
            if not events:
                continue
            decisions, _refused = sim.handle_batch(events)
            self.batches += 1
            budget -= 1
            for d in decisions:
                if isinstance(d, Place):
                    if d.job in self.waiting and d.job not in self.starts:
                        self.starts[d.job] = t
                    rec = sim.records.get(d.job)
                    if rec is not None and rec.job.state is JobState.RUNNING and not rec.external:
                        self._expect_end(rec, t)
                elif isinstance(d, (Preempt, Release, Reject)):
                    rec = sim.records.get(d.job)
                    if rec is None or rec.job.state is not JobState.RUNNING:
                        self.version[d.job] = self.version.get(d.job, 0) + 1  # its expected end no longer holds
                elif isinstance(d, Wakeup):
                    self._tick(d.at)
        return self.done

    def result(self) -> Forecast:
        return Forecast(self.now, dict(self.starts), self.t, len(self.starts) == len(self.waiting), self.batches)


def forecast(state: "SchedulerState", prior: DurationPrior, *, horizon_s: float = 14 * 86400.0,
             max_batches: int = 6000, remaining: Callable[[JobRecord, float], float] | None = None) -> Forecast:
    """Replay ``state``'s queue forward (see the module docstring) and return when each job
    waiting now starts.  ``state`` is not changed.  ``remaining(record, elapsed)``: the seconds a
    job is expected to run on, instead of the prior's guess (an oracle, for the benchmark)."""
    r = Replay(state, prior, horizon_s=horizon_s, max_batches=max_batches, remaining=remaining)
    r.step()
    return r.result()


__all__ = ["DurationPrior", "Forecast", "Replay", "clone", "elapsed_of", "forecast"]
