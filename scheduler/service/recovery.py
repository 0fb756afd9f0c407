"""Restart: the core from its latest snapshot and the log after it, then the jobs table's word.

:meth:`Recovery.restore` builds the core before the broker connection:

1. the latest snapshot (:mod:`scheduler.snapshot`), when it was taken under the
   same profile and rules; else, when the log is whole (never compacted) and was
   written under them, a fresh core; else a **rebuild**: a fresh core, and every
   job that ran is stopped where it ran and queued again (a changed profile
   cannot replay a log that was cut short, and guessing would start jobs twice);
2. the batches logged after it, replayed through ``handle_batch``: the same
   events in the same batches give the same state and decisions (ids included).

:meth:`Recovery.reconcile` then squares the core with the jobs table: jobs
accepted but never logged arrive; jobs the table says ended (an exit, a cancel)
end; a placement logged whose row was never written gets its row.  The
decisions logged but never carried out to the end are collected, and
:meth:`Recovery.resume` (on every connect) carries them out again under their
original ids, so a node that already applied one answers from its reply cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from scheduler import (
    Decision, Event, JobArrived, JobCancelled, JobFinished, JobState, Place, SchedulerState, snapshot,
)
from scheduler.codec import CodecError, decision_from_dict
from scheduler.replay import replay
from scheduler.service.core_log import CoreLogError, core_job, decode_event
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.commands import NodeCommands
from scheduler.service.decisions import DecisionCarrier, decision_ids
from scheduler.service.journal import Journal
from scheduler.service.models import TERMINAL_STATES
from scheduler.service.store import JobStore
from scheduler.profile import Profile
from scheduler.watch import WatchRules

log = logging.getLogger("dlshare.sched.live")


class RecoveryHost(Protocol):
    """What recovery reads and sets of the service (the live service is one).  ``core`` is set by
    :meth:`Recovery.restore`; ``carrier`` exists by the time :meth:`Recovery.reconcile` runs."""

    store: JobStore
    journal: Journal
    profile_obj: Profile
    rules: WatchRules
    core: SchedulerState
    carrier: DecisionCarrier
    commands: NodeCommands

    def now(self) -> float: ...
    def post(self, ev: Event) -> None: ...


class Recovery:
    """Rebuilds the core at start and re-sends what was left unacknowledged (see the module docstring)."""

    def __init__(self, svc: RecoveryHost) -> None:
        self.svc = svc
        self.resend: list[tuple[str, Decision]] = []  # (id, decision) logged but never carried out to the end
        self.stops: list[tuple[str, str, str]] = []  # (job, node, command id) to stop after a rebuild
        self.report: dict[str, float | int | str] = {}

    def restore(self, fresh: Callable[[], SchedulerState]) -> SchedulerState:
        svc = self.svc
        t0 = time.perf_counter()
        journal = svc.journal
        fp = snapshot.fingerprint(svc.profile_obj, svc.rules)
        snap = journal.latest_snapshot()
        core, after, how = None, 0, ""
        if snap is not None:
            try:
                core = snapshot.load(snap.data, svc.profile_obj, svc.rules)
                after, how = snap.batch, f"snapshot after batch {snap.batch}"
            except snapshot.SnapshotError as exc:
                log.error("the core snapshot after batch %d is unusable: %s", snap.batch, exc)
        rebuild = False
        if core is None:
            first = journal.first_batch()
            whole = snap is None and (first is None or first == 1)
            if whole and journal.meta("core_fingerprint") in (None, fp):
                core, how = fresh(), "the whole log"
            else:
                core, how, rebuild = fresh(), "nothing: rebuilt from the jobs table", True
        replayed: dict[str, Decision] = {}
        n_batches = n_events = 0
        if not rebuild:
            for rb in replay(core, self._batches(after)):
                n_batches += 1
                for did, d in zip(decision_ids(rb.decisions), rb.decisions):
                    replayed[did] = d
            n_events = journal.events_after(after)
        journal.set_meta("core_fingerprint", fp)
        svc.core = core
        self.replayed = replayed
        self.rebuilt = rebuild
        self.report = {"from": how, "batches": n_batches, "events": n_events,
                       "seconds": round(time.perf_counter() - t0, 3)}
        log.info("core restored from %s; replayed %d batches (%d events) in %.2fs", how, n_batches, n_events,
                 time.perf_counter() - t0)
        return core

    def _batches(self, after: int):
        for n, payloads in self.svc.journal.batches(after):
            try:
                yield n, [decode_event(p) for p in payloads]
            except CoreLogError as exc:
                log.error("skipping an unreadable logged batch %d: %s", n, exc)

    def reconcile(self) -> None:
        """Square the restored core with the jobs table (see the module docstring)."""
        svc = self.svc
        core, store = svc.core, svc.store
        active = store.active_states()
        if self.rebuilt:
            for jid, state in active.items():
                j = store.get_job(jid)
                if state == "running" and j is not None and j.allocation is not None:
                    for n in j.allocation.nodes:
                        self.stops.append((jid, n, f"rebuild-{svc.carrier.batch}/{jid}/{n}"))
                    store.update_job(jid, event="requeued", event_data={"why": "the scheduler's core was rebuilt"},
                                     state="queued", reason="requeued: the scheduler's core was rebuilt",
                                     allocation=None, only_active=True)
        for jid in active:
            if jid not in core.records:  # accepted, never logged as arrived
                j = store.get_job(jid)
                if j is not None:
                    svc.post(JobArrived(_eid(), svc.now(), core_job(j, svc.now())))
        # Jobs ended in the table but still active in the core (a crash between the two).
        for jid, rec in list(core.records.items()):
            if not rec.job.state.active or rec.external or jid in active:
                continue
            row = store.get_job(jid)
            if row is None or row.state not in TERMINAL_STATES:
                continue
            if row.state in ("done", "failed") and row.exit_code is not None:
                svc.post(JobFinished(_eid(), svc.now(), jid, failed=row.state == "failed", reason=row.reason or ""))
            else:
                svc.post(JobCancelled(_eid(), svc.now(), jid, row.reason or row.state))
        # What was decided but never carried out to the end.
        resend: list[tuple[str, Decision]] = []
        for r in store.pending_decisions():
            d = self.replayed.get(r.id)
            if d is None:
                try:
                    d = decision_from_dict(r.data)
                except CodecError:
                    log.warning("cannot re-send decision %s: its row does not hold the decision", r.id)
                    continue
            resend.append((r.id, d))
        for did, d in resend:
            if isinstance(d, Place):
                rec, row = core.records.get(d.job), store.get_job(d.job)
                if (rec is not None and rec.job.state is JobState.RUNNING and rec.placed_by == d.stimulus_id
                        and row is not None and row.state in ("queued", "preempted")):
                    # Logged, then the service died before the job's row said so: finish that step.
                    svc.carrier.mark_placed(d, {})
        self.resend = resend
        if resend or self.stops:
            log.info("%d decisions to carry out again, %d stops after a rebuild", len(resend), len(self.stops))

    def resume(self) -> None:
        """Once connected (again): carry out what the log says was decided but never acknowledged."""
        svc = self.svc
        stops, self.stops = self.stops, []
        for job, node, cmd in stops:
            svc.commands.spawn(svc.commands.stop_and_release(job, node, cmd), key=job)
        resend, self.resend = self.resend, []
        for did, d in resend:
            log.info("re-sending decision %s (never acknowledged before the restart)", did)
            svc.commands.spawn(svc.carrier.carry_out(d, did, replay=True), key=getattr(d, "job", None))
