"""Tail bounds for the duration-agnostic orders: a slowdown bound against an equal share
(:class:`ShareBound`, the ``dlshare`` profile's), and boosted arrival times (:class:`BoostedArrival`).

:class:`ShareBound` (issue 23).  Every active job has an *equal-share clock*: the progress (seconds of
its run time) it would have made had the cluster's GPUs been split max-min fairly between the
active jobs since it arrived: each entitled to the same number of GPUs, a job asking for fewer
getting what it asks for and the rest shared among the others, and a job of g GPUs given L of them
running min(1, L / g) of the time (Gavel's max-min fairness with time-slicing, and the "independent"
share of Themis's finish-time fairness).  The core keeps one clock per job size
(``Context.share_clock(gpus)`` now, ``JobRecord.share_start`` at arrival; scheduler.ledger.ShareClock).
A job is *owed* when that clock passed ``factor`` x what it has run, counting at least
the mean run time of the workload's jobs: it has had less than 1/``factor`` of an equal share (and,
a newcomer, it has waited long enough that an equal share would have finished a typical job
``factor`` times over).  Owed jobs go before the others, oldest first, and keep the GPUs until they
have run their whole equal share (so a promoted job is not swapped out again as soon as it is back
at the bound: a restart each time).  So no job falls below 1/``factor`` of an equal share for long,
whatever the stream of newcomers; the rest is the Gittins order that minimises the mean.  The
clock slows when the cluster is crowded (an equal share is small then), so the bound costs little
in a backlog, and needs no time scale: it is in the job's own run time.  It is checked at every
pass (each Tick), like the order's other keys.

(Tried first: owed when the clock passed ``factor`` x E[D | D > attained], the run time the job is
expected to reach.  Under heavy-tailed run times that expectation grows with the attained time, so
a long job that had run a while was never owed: it left the p99 where it was.)

Boosted arrival times (the fixed ``boost = 10`` of issue 13, kept for reference):

Size-based orders (LAS, 2D-LAS, Gittins) win the mean by running what looks
short first.  Long jobs pay: every newcomer overtakes them, for as long as
newcomers keep coming, so their completion time has no bound (on Philly
vc_103959, 4-GPU jobs of 20-70 h waited up to 1,200 h under 2D-Gittins while
FIFO's p99 was 230 h).

:class:`BoostedArrival` anchors the order on arrival time instead, as FIFO
does, and lets a job that looks short move ahead by a bounded *boost*
(after Yu and Scully's gamma-Boost, SIGMETRICS 2024: FCFS on "boosted arrival
times" keeps FCFS's tail and recovers most of SRPT's mean)::

    rank = arrival - B,   B = T * ln(1 + T * rate)

``rate`` is the job's Gittins index divided by its GPU count (completions
per GPU-second of further service, from the duration prior and the job's
attained time), so ``1 / rate`` is the GPU-time it is expected to need.
A job expected to need far less than ``T`` gains ``T * ln(T * rate)``; one
expected to need more than ``T`` gains less than ``T * ln 2`` and keeps its
place in arrival order.  A job can therefore only be overtaken by jobs that
arrived at most ``B_max`` after it, so its wait is FIFO's wait plus a bounded
amount, whatever the stream of newcomers; between those, the order is still
the Gittins order that minimises the mean.

``T`` is ``scale`` x the mean run time of the jobs that finished so far (the
duration prior's mean until ``min_samples`` have), so the rank adapts to the
workload's time scale and needs no unit.  Lower ranks run first.
"""

from __future__ import annotations

import math
from typing import Any

from scheduler.model import JobRecord


class BoostedArrival:
    """Ranks jobs by boosted arrival time (see the module docstring)."""

    def __init__(self, scale: float, prior_mean_s: float, min_samples: int = 20) -> None:
        if not scale > 0 or not prior_mean_s > 0 or min_samples < 1:
            raise ValueError("boost scale and prior mean must be > 0, min_samples >= 1")
        self.scale = float(scale)
        self.prior_mean_s = float(prior_mean_s)
        self.min_samples = int(min_samples)
        self._sum = 0.0
        self._n = 0

    @property
    def horizon_s(self) -> float:
        """``T``: the time scale of the boost, in seconds."""
        mean = self._sum / self._n if self._n >= self.min_samples else self.prior_mean_s
        return self.scale * mean

    def observe(self, run_time_s: float) -> None:
        """A job finished after running ``run_time_s`` seconds (per GPU)."""
        if run_time_s >= 0:
            self._sum += run_time_s
            self._n += 1

    def boost(self, rate: float) -> float:
        """Seconds of head start for a job whose completion rate per GPU-second is ``rate``."""
        t = self.horizon_s
        return t * math.log1p(t * max(rate, 0.0))

    def rank(self, rec: JobRecord, rate: float) -> float:
        return rec.job.arrival - self.boost(rate)


class ShareBound:
    """Owed jobs: their equal-share clock passed ``factor`` x what they have run, at least the
    workload's mean run time (see the module docstring)."""

    def __init__(self, factor: float) -> None:
        if not factor > 0:
            raise ValueError("share_bound must be > 0")
        self.factor = float(factor)

    def owed(self, rec: JobRecord, ctx: Any, ran_s: float) -> bool:
        """Whether ``rec``, having run ``ran_s`` seconds (the order passes at least the mean run
        time), is owed at ``ctx.now``."""
        if rec.share_start is None:  # not counted by the core (a bound pod): never owed
            return False
        return ctx.share_clock(rec.job.gpus) - rec.share_start > self.factor * ran_s

    def caught_up(self, rec: JobRecord, ctx: Any, ran_s: float) -> bool:
        """``rec`` has run at least its whole equal share (``ran_s`` seconds of run time)."""
        return rec.share_start is None or ran_s >= ctx.share_clock(rec.job.gpus) - rec.share_start
