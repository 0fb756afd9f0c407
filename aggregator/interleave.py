"""Which job's pushes a server reads first when several jobs' rounds overlap (pure: no clock, no I/O).

When two jobs push at once, TCP shares the server's link between them and each
round takes twice as long; jobs that started in step stay in step, and
neither gains from the other's compute time.  A server that instead reads the
round that started first (FIFO), and holds the other job's pushes in its
socket buffers meanwhile, finishes that round at full speed; its job goes
back to computing while the other job's round gets the whole link, and after
a step or two the jobs' rounds take turns on the servers.

Rounds that start within ``tie_s`` of each other go in job-name order, so every
server picks the same job (each server sees a slightly different start time,
and servers that picked differently would hold each job back on some server).
A job counts as busy while one of its chunks is being received (for at most
``stall_s`` a chunk) or one arrived within ``idle_s``: a job that stops pushing
(a slow rank, its compute phase, a peer stalled mid-chunk) never holds the
others back for long.  A push that waits does not make its own job busy, and a
push of a job's earlier round never waits (it started first), so no two jobs
can wait on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class _Job:
    round: int
    start: float
    last: float
    active: dict[Hashable, float] = field(default_factory=dict)  # receptions in progress -> when they began


class RoundOrder:
    def __init__(self, tie_s: float = 0.05, idle_s: float = 0.02, stall_s: float = 2.0) -> None:
        self.tie_s, self.idle_s, self.stall_s = tie_s, idle_s, stall_s
        self._jobs: dict[str, _Job] = {}

    def note(self, job: str, rnd: int, now: float) -> None:
        """A chunk header of round ``rnd`` was read: a later round than the job's current one starts now."""
        j = self._jobs.get(job)
        if j is None:
            self._jobs[job] = _Job(rnd, now, float("-inf"))  # noted, not yet receiving: not busy
        elif rnd > j.round:
            j.round, j.start = rnd, now

    def begin(self, job: str, token: Hashable, now: float) -> None:
        """The payload of a noted chunk is being received now (after :meth:`ahead` let it)."""
        j = self._jobs.get(job)
        if j is not None:
            j.active[token] = now
            j.last = now

    def end(self, job: str, token: Hashable, now: float) -> None:
        """That payload is in (or the connection broke)."""
        j = self._jobs.get(job)
        if j is not None:
            j.active.pop(token, None)
            j.last = now

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def _busy(self, j: _Job, now: float) -> bool:
        return now - j.last <= self.idle_s or any(now - t < self.stall_s for t in j.active.values())

    def ahead(self, job: str, rnd: int, now: float) -> str | None:
        """A busy job whose round goes before round ``rnd`` of ``job``, or None: read now."""
        mine = self._jobs.get(job)
        if mine is not None and rnd < mine.round:
            return None  # an earlier round of this job: it started before anything this job does now
        start = mine.start if mine is not None and mine.round == rnd else now
        for other, j in self._jobs.items():
            if other == job or not self._busy(j, now):
                continue
            if j.start < start - self.tie_s or (abs(j.start - start) <= self.tie_s and other < job):
                return other
        return None
