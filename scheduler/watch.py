"""What the core watches over time: start backoff, vanished jobs and bound pods' holds.

Live clusters need three rules that run on the clock, which the core keeps by
the ``now`` of the events it handles and by :class:`~scheduler.events.Wakeup`
decisions (the shell answers each with a :class:`~scheduler.events.Tick`), never
by reading a clock:

* **Backoff.**  A job whose start failed (:class:`~scheduler.events.PlacementFailed`)
  may not be placed again before ``backoff_s * 2**(failures - 1)`` (at most
  ``backoff_max_s``) has passed, so a node refusing every start is not hammered
  in a loop.  A confirmed start resets the count.
* **Vanished jobs.**  A job its node confirmed it started
  (:class:`~scheduler.events.JobStarted`) and that the node's reports
  (``NodeReport.running``) then leave out for ``vanish_after_s`` has vanished:
  it is failed and released.
* **Holds.**  A job another engine runs (:class:`~scheduler.events.JobBound`
  with ``hold_s``) is accounted for on its node until the hold ends.

It also remembers which jobs a node was told to stop because it ran them where
the core had not placed them (a node taken for lost that was not, a core rebuilt
after a restart), so each is released once, not at every report.

All rules are off by default (the simulator needs none); the live service turns
them on.  Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WatchRules:
    """``backoff_s``: the first delay after a failed start (0: none); it doubles per failure up
    to ``backoff_max_s``.  ``vanish_after_s``: how long a started job may be missing from its
    node's reports (``None``: never counted as vanished)."""

    backoff_s: float = 0.0
    backoff_max_s: float = 30.0
    vanish_after_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.backoff_s >= 0 and self.backoff_max_s >= 0):
            raise ValueError("backoff_s and backoff_max_s must be >= 0")
        if self.vanish_after_s is not None and not self.vanish_after_s > 0:
            raise ValueError("vanish_after_s must be > 0 (or None: off)")


class Watch:
    """The deadlines the core keeps (see the module docstring).  The state calls the
    ``on_*`` hooks while it applies events, :meth:`due` before each pass, and asks
    :meth:`next_deadline` for its next :class:`~scheduler.events.Wakeup`."""

    def __init__(self, rules: WatchRules | None = None) -> None:
        self.rules = rules or WatchRules()
        self.failures: dict[str, int] = {}  # job -> failed starts since its last confirmed start
        self.not_before: dict[str, float] = {}  # job -> earliest next placement
        self.started: dict[str, set[str]] = {}  # job -> nodes that confirmed its start
        self.missing_since: dict[tuple[str, str], float] = {}  # (job, node) -> first report without it
        self.holds: dict[str, float] = {}  # bound job -> when its hold ends
        self.orphans: dict[str, set[str]] = {}  # node -> jobs it runs unplaced there, already released
        self.asked: float | None = None  # the deadline last asked for with a Wakeup

    # ------------------------------------------------------------ hooks

    def on_placement_failed(self, job: str, now: float) -> None:
        n = self.failures.get(job, 0) + 1
        self.failures[job] = n
        if self.rules.backoff_s > 0:
            self.not_before[job] = now + min(self.rules.backoff_max_s, self.rules.backoff_s * 2 ** (n - 1))
        self.forget_run(job)

    def on_started(self, job: str, node: str) -> None:
        self.started.setdefault(job, set()).add(node)
        self.failures.pop(job, None)
        self.missing_since.pop((job, node), None)

    def on_report(self, node: str, running: tuple[str, ...] | None, jobs_here: dict[str, int], now: float) -> None:
        """A node listed the jobs it runs: started jobs of ours it left out go missing (or stay so)."""
        if running is None or self.rules.vanish_after_s is None:
            return
        listed = set(running)
        for job in jobs_here:
            if node not in self.started.get(job, ()):
                continue
            if job in listed:
                self.missing_since.pop((job, node), None)
            else:
                self.missing_since.setdefault((job, node), now)

    def orphans_to_release(self, node: str, running: tuple[str, ...], placed_here: set[str]) -> list[str]:
        """Jobs ``node`` lists as running that the core did not place there (``placed_here``: those it
        did), each returned once while the node goes on listing it."""
        listed = set(running)
        asked = self.orphans.setdefault(node, set())
        asked &= listed  # those it no longer lists have stopped
        new = [j for j in running if j not in placed_here and j not in asked]
        asked.update(new)
        if not asked:
            self.orphans.pop(node, None)
        return new

    def on_bound(self, job: str, now: float, hold_s: float | None) -> None:
        if hold_s is not None:
            self.holds[job] = now + hold_s

    def forget_run(self, job: str) -> None:
        """The job left its nodes (ended, preempted, requeued): nothing to watch for it there."""
        for node in self.started.pop(job, ()):
            self.missing_since.pop((job, node), None)
        self.holds.pop(job, None)

    def forget(self, job: str) -> None:
        """The job is over: drop everything about it."""
        self.forget_run(job)
        self.failures.pop(job, None)
        self.not_before.pop(job, None)

    # ------------------------------------------------------------ time

    def eligible(self, job: str, now: float) -> bool:
        """May ``job`` be placed at ``now`` (its backoff is over)?"""
        t = self.not_before.get(job)
        if t is None:
            return True
        if t <= now + 1e-9:
            del self.not_before[job]
            return True
        return False

    def due(self, now: float) -> tuple[list[tuple[str, str]], list[str]]:
        """(job, node) pairs that vanished by ``now``, and jobs whose hold ended."""
        vanished = []
        limit = self.rules.vanish_after_s
        if limit is not None:
            vanished = sorted(k for k, since in self.missing_since.items() if now - since >= limit - 1e-9)
        expired = sorted(j for j, until in self.holds.items() if until <= now + 1e-9)
        return vanished, expired

    def next_deadline(self, now: float) -> float | None:
        at = math.inf
        for t in self.not_before.values():
            if t > now:
                at = min(at, t)
        if self.rules.vanish_after_s is not None:
            for since in self.missing_since.values():
                at = min(at, since + self.rules.vanish_after_s)
        for t in self.holds.values():
            at = min(at, t)
        return None if at == math.inf else max(at, now + 1e-6)

    def wakeup(self, now: float) -> float | None:
        """The deadline to ask a Wakeup for, if it is not asked for already."""
        at = self.next_deadline(now)
        if at is None:
            return None
        if self.asked is None or self.asked <= now or at < self.asked - 1e-9:
            self.asked = at
            return at
        return None
