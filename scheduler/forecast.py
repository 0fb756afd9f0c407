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

import bisect
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


class DurationPrior:
    """Expected remaining run time from a sample of run times (seconds, wall time per run).

    ``remaining(a)`` is the mean of ``d - a`` over the samples ``d > a`` (the mean residual
    life); past the largest sample it is ``a`` itself (a job that ran this long is expected to run
    as long again).  :meth:`add` takes the run time of a job that finished, so the prior moves
    towards the cluster's own jobs (each weighs ``weight`` samples)."""

    def __init__(self, samples: Iterable[float], weight: float = 1.0) -> None:
        xs = np.asarray([float(x) for x in samples if x == x and 0 < x < math.inf], dtype=float)
        if weight <= 0:
            raise ValueError("weight must be > 0")
        self.weight = float(weight)
        self._base = np.sort(xs)
        self._extra: list[float] = []
        self._dirty = True
        self._xs = self._base
        self._w = np.ones(len(self._base))
        self._suffix_w = np.zeros(1)
        self._suffix_x = np.zeros(1)

    def __len__(self) -> int:
        return len(self._base) + len(self._extra)

    def add(self, duration: float) -> None:
        """A job ran ``duration`` seconds in all and finished."""
        if duration == duration and 0 < duration < math.inf:
            bisect.insort(self._extra, float(duration))
            self._dirty = True

    def _build(self) -> None:
        extra = np.asarray(self._extra, dtype=float)
        xs = np.concatenate([self._base, extra])
        w = np.concatenate([np.ones(len(self._base)), np.full(len(extra), self.weight)])
        order = np.argsort(xs, kind="stable")
        self._xs, self._w = xs[order], w[order]
        # Suffix sums: the weight and the weighted sum of the samples from index i on.
        self._suffix_w = np.concatenate([np.cumsum(self._w[::-1])[::-1], [0.0]])
        self._suffix_x = np.concatenate([np.cumsum((self._w * self._xs)[::-1])[::-1], [0.0]])
        self._dirty = False

    def remaining(self, elapsed: float) -> float:
        """Expected seconds left for a job that has run ``elapsed`` seconds."""
        if self._dirty:
            self._build()
        a = max(0.0, float(elapsed))
        i = int(np.searchsorted(self._xs, a, side="right"))
        w = float(self._suffix_w[i]) if len(self._xs) else 0.0
        if w <= 0:
            return max(MIN_REMAINING_S, a)
        return max(MIN_REMAINING_S, float(self._suffix_x[i]) / w - a)


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


def forecast(state: "SchedulerState", prior: DurationPrior, *, horizon_s: float = 7 * 86400.0,
             max_batches: int = 5000, remaining: Callable[[JobRecord, float], float] | None = None) -> Forecast:
    """Replay ``state``'s queue forward (see the module docstring) and return when each job
    waiting now starts.  ``state`` is not changed.  ``remaining(record, elapsed)``: the seconds a
    job is expected to run on, instead of the prior's guess (an oracle, for the benchmark)."""
    now = state.now
    sim = clone(state)
    sim.watch.missing_since.clear()  # running jobs are taken to run on until their expected end
    waiting = set(sim.waiting)
    starts: dict[str, float] = {}
    if not waiting:
        return Forecast(now, {}, now, True, 0)
    heap: list[tuple[float, int, str, int]] = []  # (time, seq, job or "" for a Tick, version)
    version: dict[str, int] = {}
    seq = 0

    def push(t: float, job: str = "", ver: int = 0) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, job, ver))
        seq += 1

    def expect_end(rec: JobRecord, t: float) -> None:
        v = version[rec.job.id] = version.get(rec.job.id, 0) + 1
        ran = elapsed_of(rec, t)
        left = prior.remaining(ran) if remaining is None else max(MIN_REMAINING_S, remaining(rec, ran))
        push(t + left, rec.job.id, v)

    for rec in sim.running.values():
        if not rec.external:  # a bound pod ends with its hold (the core's own Wakeup), or never
            expect_end(rec, now)
    ticks: set[float] = set()
    for at in (sim.passes.wakeup_at, sim.watch.next_deadline(now)):
        if at is not None and at >= now and at not in ticks:
            ticks.add(at)
            push(at)
    end = now + horizon_s
    batches = 0
    t = now
    while heap and len(starts) < len(waiting) and batches < max_batches:
        t = heap[0][0]
        if t > end:
            break
        events = []
        while heap and heap[0][0] == t:
            _, _, jid, ver = heapq.heappop(heap)
            if not jid:
                ticks.discard(t)
                events.append(Tick(f"forecast:tick:{t:.6f}", t))
            elif version.get(jid) == ver and jid in sim.running:
                version[jid] = ver + 1
                events.append(JobFinished(f"forecast:end:{jid}", t, jid))
        if not events:
            continue
        decisions, _refused = sim.handle_batch(events)
        batches += 1
        for d in decisions:
            if isinstance(d, Place):
                if d.job in waiting and d.job not in starts:
                    starts[d.job] = t
                rec = sim.records.get(d.job)
                if rec is not None and rec.job.state is JobState.RUNNING and not rec.external:
                    expect_end(rec, t)
            elif isinstance(d, (Preempt, Release, Reject)):
                rec = sim.records.get(d.job)
                if rec is None or rec.job.state is not JobState.RUNNING:
                    version[d.job] = version.get(d.job, 0) + 1  # its expected end no longer holds
            elif isinstance(d, Wakeup) and d.at not in ticks:
                ticks.add(d.at)
                push(d.at)
    return Forecast(now, starts, t, len(starts) == len(waiting), batches)


__all__ = ["DurationPrior", "Forecast", "clone", "elapsed_of", "forecast"]
