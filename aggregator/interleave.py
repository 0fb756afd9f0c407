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
A job counts as busy while one of its chunks is being received or one
arrived within ``idle_s``: a job that stops pushing (a slow rank, its compute
phase) never holds the others back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Round:
    round: int
    start: float
    last: float
    receiving: int = 0


class RoundOrder:
    def __init__(self, tie_s: float = 0.05, idle_s: float = 0.02) -> None:
        self.tie_s, self.idle_s = tie_s, idle_s
        self._jobs: dict[str, _Round] = {}

    def _round(self, job: str, rnd: int, now: float) -> _Round:
        r = self._jobs.get(job)
        if r is None or rnd > r.round:
            r = self._jobs[job] = _Round(rnd, now, now, 0 if r is None else r.receiving)
        return r

    def begin(self, job: str, rnd: int, now: float) -> None:
        """A chunk's header was read; its payload is about to be received."""
        r = self._round(job, rnd, now)
        r.receiving += 1
        r.last = now

    def end(self, job: str, now: float) -> None:
        """That payload is in (or the connection broke)."""
        r = self._jobs.get(job)
        if r is not None:
            r.receiving = max(0, r.receiving - 1)
            r.last = now

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def ahead(self, job: str, rnd: int, now: float) -> str | None:
        """A busy job whose round goes before round ``rnd`` of ``job``, or None: read now."""
        mine = self._jobs.get(job)
        start = mine.start if mine is not None and mine.round == rnd else now
        for other, r in self._jobs.items():
            if other == job or (r.receiving == 0 and now - r.last > self.idle_s):
                continue
            if r.start < start - self.tie_s or (abs(r.start - start) <= self.tie_s and other < job):
                return other
        return None
