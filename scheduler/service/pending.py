"""The waiting jobs as launchers see them: why each waits, where it stands, when it should start.

:class:`PendingJobs` asks the core (on the loop's thread, never more often than ``reasons_s``):

* the queue in the profile's order and each job's :class:`~scheduler.waiting.WaitReason`
  (:func:`scheduler.waiting.explain_queue`, the first ``explain_limit`` jobs explained, those
  further back ``Priority``);
* every ``forecast_s`` (sooner when the queue changed), the start estimates:
  :class:`scheduler.forecast.Replay` replays the queue forward through a copy of the core, with
  running jobs ending when :class:`~scheduler.forecast.DurationPrior` expects them to (the Philly
  runtimes the Gittins order uses, and the run times of the jobs that finished here, per job type);
  the replay runs a slice per round of the loop (:meth:`PendingJobs.advance`, about 30 ms, ending after
  the core pass that spent it), so a long one holds telemetry and commands up for one pass at most
  (the copy of the core is taken in one go: 0.15-0.25 s with 1,000 nodes and 1,000-1,500 jobs waiting).

A job's reason goes into its row (so ``GET /v1/jobs`` and ``dlshare job list`` show it) and into a
``waiting`` event when its cause changes (its code, or its words beyond their numbers), at once; when
only its numbers move (``1 free`` -> ``4 free``: the cluster moving under it, at every pass on a busy
one), at most every ``event_gap_s``, the latest words always logged in the end (``kubectl describe``'s
events: a line per change, not one per refresh).
Position and estimate are kept in memory only: they move with every pass.  The maps the API reads
are replaced whole, never changed in place, so the API's thread reads them without a lock.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from scheduler import SchedulerState
from scheduler.forecast import DurationPrior, Replay, elapsed_of
from scheduler.waiting import explain_queue
from scheduler.service.store import JobStore

log = logging.getLogger("dlshare.sched.pending")


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _shape(reason: str) -> str:
    """A reason without its numbers: ``needs 8 GPUs on 2 nodes; 1 free`` and ``...; 4 free`` are the
    same cause, the cluster moving; ``behind 3 jobs of higher priority`` is another."""
    return _NUMBER.sub("#", reason)


def philly_prior() -> DurationPrior:
    """The Philly runtimes (the Gittins order's prior), or an empty prior without the shared data."""
    from scheduler import data

    try:
        # As the Gittins order learns (profiles/dlshare.toml: prior_weight 20, learn_weight 50): per job
        # type, the Philly runtimes weighing 20 samples in all and each run that finished here 2.5, so
        # the cluster's own run times soon count.  bench/forecast.py, FIFO, first 500 jobs: within
        # +-25% of the real wait for 37% (vc_103959) and 45% (vc_0e4a51) of the waits, against 28% and
        # 17% with the Philly runtimes at full weight and each finished run as 50 samples.
        return DurationPrior(data.philly_runtimes(), prior_weight=20.0, weight=2.5, per_type=True)
    except (OSError, ValueError) as exc:
        log.warning("start estimates: no duration prior (%s); a running job is expected to run as long again", exc)
        return DurationPrior([])


class PendingJobs:
    """See the module docstring.  ``prior``: makes the :class:`DurationPrior` (called once, on a
    thread of its own); ``explain_limit``: jobs explained one
    by one per refresh; ``horizon_s``/``max_batches``: how far a forecast replays."""

    def __init__(self, store: JobStore, reasons_s: float = 1.0, forecast_s: float = 10.0, explain_limit: int = 200,
                 event_gap_s: float = 300.0, prior: Callable[[], DurationPrior] = philly_prior,
                 horizon_s: float = 14 * 86400.0, max_batches: int = 6000) -> None:
        self.store = store
        self.reasons_s = reasons_s
        self.forecast_s = forecast_s
        self.explain_limit = explain_limit
        self.event_gap_s = event_gap_s
        self.horizon_s = horizon_s
        self.max_batches = max_batches
        self.board: dict[str, dict[str, Any]] = {}  # job -> code, reason, nodes, position, since
        self.estimates: dict[str, float] = {}  # job -> estimated start (the service's clock)
        self.estimated_at: float | None = None
        self.queue_length = 0
        self.forecast_seconds: float | None = None  # what the last forecast cost
        self.explain_seconds: float | None = None
        self._last_reasons = -math.inf
        self._last_forecast = -math.inf
        self._forecast_queue: frozenset[str] = frozenset()
        self._replay: Replay | None = None  # the forecast under way
        self._spent = 0.0  # its cost so far
        self._logged: dict[str, tuple[str, str, float]] = {}
        self._prior: DurationPrior | None = None
        self._finished: list[tuple[float, str]] = []  # (run time, job type) seen before the prior was ready
        # Loaded on a thread of its own the first time a job waits (reading the runtimes takes a while).
        self._prior_thread = threading.Thread(target=self._load_prior, args=(prior,), name="sched-prior", daemon=True)
        self._prior_lock = threading.Lock()

    def _start_prior(self) -> None:
        with self._prior_lock:
            if self._prior_thread.ident is None:
                self._prior_thread.start()

    def _load_prior(self, make: Callable[[], DurationPrior]) -> None:
        p = make()
        for d, kind in self._finished:
            p.add(d, kind)
        self._prior = p

    # --- fed by the live loop (its thread) ----------------------------------------------------

    def finished(self, rec: Any) -> None:
        """A job ended done: its run time teaches the prior."""
        d = elapsed_of(rec, rec.finished_at if rec.finished_at is not None else rec.job.arrival)
        if self._prior is not None:
            self._prior.add(d, rec.job.job_type)
        else:
            self._finished.append((d, rec.job.job_type))

    def refresh(self, core: SchedulerState, now: float, force: bool = False) -> None:
        """Reasons and positions (every ``reasons_s``), estimates (every ``forecast_s``, or when the
        queue changed); rows and events for the reasons that changed."""
        if not force and now - self._last_reasons < self.reasons_s:
            return
        self._last_reasons = now
        t0 = time.perf_counter()
        order, reasons = explain_queue(core, self.explain_limit)
        self.explain_seconds = time.perf_counter() - t0
        old = self.board
        board: dict[str, dict[str, Any]] = {}
        changes: list[tuple[str, str, dict[str, Any] | None]] = []
        for pos, jid in enumerate(order, 1):
            why = reasons[jid]
            prev = old.get(jid)
            since = prev["since"] if prev is not None and prev["code"] == why.code else now
            board[jid] = {"code": why.code, "reason": why.message, "nodes": why.nodes, "position": pos,
                          "since": since}
            logged = self._logged.get(jid)  # (code, reason, when) of its last waiting event
            event = logged is None or (logged[:2] != (why.code, why.message) and (
                logged[0] != why.code or _shape(logged[1]) != _shape(why.message)
                or now - logged[2] >= self.event_gap_s))
            if event or prev is None or prev["reason"] != why.message:
                data = None
                if event:
                    self._logged[jid] = (why.code, why.message, now)
                    data = {"code": why.code, "reason": why.message, "position": pos}
                    if why.nodes:
                        data["nodes"] = why.nodes
                changes.append((jid, why.message, data))
        for jid in old.keys() - board.keys():
            self._logged.pop(jid, None)
        try:
            self.store.set_reasons(changes)
        except Exception:  # noqa: BLE001 - a reason is a courtesy: never fail the loop for it
            log.exception("writing the waiting jobs' reasons failed")
        self.board = board
        self.queue_length = len(order)
        queue = frozenset(order)
        # A forecast runs on the loop's thread (the core and its predictors are the loop's alone), a
        # slice per round (advance): at most every forecast_s, sooner when the queue changed, and never
        # so often that forecasting takes more than 5% of the loop (20 x the last one's cost between two).
        gap = 20.0 * (self.forecast_seconds or 0.0)
        due = now - self._last_forecast >= max(self.forecast_s, gap) or (
            queue != self._forecast_queue and now - self._last_forecast >= gap)
        if not queue:
            self.estimates, self._forecast_queue, self._replay = {}, queue, None
        elif self._prior is None:
            self._start_prior()
        elif due and self._replay is None:
            self._last_forecast = now
            self._forecast_queue = queue
            t1 = time.perf_counter()
            try:
                self._replay = Replay(core, self._prior, horizon_s=self.horizon_s, max_batches=self.max_batches)
            except Exception:  # noqa: BLE001 - an estimate is a courtesy too
                log.exception("start estimates failed")
            self._spent = time.perf_counter() - t1

    @property
    def busy(self) -> bool:
        """A forecast is under way (the loop comes back soon to advance it)."""
        return self._replay is not None

    def advance(self, budget_s: float = 0.03) -> None:
        """Run the forecast under way for about ``budget_s`` (on the loop's thread, every round);
        when it is over, its starts become the estimates."""
        r = self._replay
        if r is None:
            return
        t0 = time.perf_counter()
        try:
            while not r.step(1) and time.perf_counter() - t0 < budget_s:
                pass
        except Exception:  # noqa: BLE001 - an estimate is a courtesy too
            log.exception("start estimates failed")
            self._replay = None
            return
        self._spent += time.perf_counter() - t0
        if r.done:
            self._replay = None
            self.forecast_seconds = self._spent
            f = r.result()
            # The replay starts at the core's time then; a start it puts there is "now".
            self.estimates = {j: max(t, f.at) for j, t in f.starts.items()}
            self.estimated_at = f.at

    # --- read by the API (any thread) ---------------------------------------------------------

    def info(self, job_id: str) -> dict[str, Any] | None:
        """The job's ``waiting`` block for the API (None when it does not wait)."""
        b = self.board.get(job_id)
        if b is None:
            return None
        est = self.estimates
        return {**b, "queue_length": self.queue_length, "estimated_start": est.get(job_id),
                "estimated_at": self.estimated_at if job_id in est else None}

    def by_code(self) -> dict[str, int]:
        """Waiting jobs per reason code."""
        out: dict[str, int] = {}
        for b in self.board.values():
            out[b["code"]] = out.get(b["code"], 0) + 1
        return out

    def wait_prior_ready(self, timeout: float) -> bool:
        """Load the duration prior now if nobody asked yet, and wait until it is ready."""
        self._start_prior()
        self._prior_thread.join(timeout)
        return self._prior is not None


__all__ = ["PendingJobs", "philly_prior"]
