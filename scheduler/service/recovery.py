"""Restart: replay the service's event log into the core, then reconcile with the jobs table.

A mixin of :class:`~scheduler.service.live.SchedulerService`.  ``_replay`` runs
before the broker connection (it rebuilds the core and the node views and
collects what was decided but never acknowledged); ``_resume_after_restart``
runs on (re)connect and carries those decisions out again under their
original ids, so a node that already applied one answers from its reply cache.
"""

from __future__ import annotations

import logging
from typing import Any

from scheduler import Allocate, JobArrived, JobCancelled, Place
from scheduler.service.core_log import CoreLogError, core_job, decode_event
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.models import TERMINAL_STATES
from scheduler.service.nodes import LiveNode

log = logging.getLogger("dlshare.sched.live")


class RecoveryShell:
    def _replay(self) -> None:
        n_batches = 0
        replayed: list[tuple[str, Any]] = []
        for _, payloads in self.store.core_batches():
            try:
                events = [decode_event(p) for p in payloads]
            except CoreLogError as exc:
                log.error("skipping an unreadable logged batch: %s", exc)
                continue
            for d in self._handle(events):
                replayed.append((self._decision_id(d), d))
            n_batches += 1
        rows, _ = self.store.list_jobs(states=["queued", "running", "preempted"], limit=1 << 30)
        states = self.store.decision_states()
        self._cpu_resend: list[tuple[str, str, dict, int]] = []
        for j in rows:
            if j.state == "running" and j.allocation:
                node = self.nodes.setdefault(j.allocation["node"], LiveNode(id=j.allocation["node"]))
                acked = True
                if int(j.spec.get("gpus", 0)) == 0 and states.get(f"{j.id}/cpu-place/{j.attempts}") != "acked":
                    # A CPU job whose `run` was never acknowledged before the crash: send it again (same
                    # command id, so a node that did start it answers from its reply cache).
                    acked = False
                    self._cpu_resend.append((j.id, j.allocation["node"], j.allocation, j.attempts))
                node.allocations[j.id] = {**j.allocation, "acked": acked}
            if int(j.spec.get("gpus", 0)) > 0 and j.id not in self.core.records:
                self.post(JobArrived(_eid(), self.now(), core_job(j, self.now())))
            elif int(j.spec.get("gpus", 0)) == 0 and j.state == "queued":
                self._cpu_waiting[j.id] = {"id": j.id, "spec": j.spec, "submitted_at": j.submitted_at}
        # GPU jobs ended in the table but still active in the core (a crash between the two).
        for jid, rec in self.core.records.items():
            row = self.store.get_job(jid)
            if row is not None and row.state in TERMINAL_STATES and rec.job.state.active:
                self.post(JobCancelled(_eid(), self.now(), jid, row.reason or row.state))
        self._resend = [d for did, d in replayed if states.get(did) in ("pending", "sent")]
        if n_batches:
            log.info("replayed %d logged batches; %d decisions still to carry out, %d active jobs",
                     n_batches, len(self._resend), len(rows))


    def _resume_after_restart(self) -> None:
        """Once connected again: carry out what the log says was decided but never acknowledged."""
        if self._resend:
            resend, self._resend = self._resend, []
            for d in resend:
                if isinstance(d, Place):
                    rec, row = self.core.records.get(d.job), self.store.get_job(d.job)
                    if (rec is not None and rec.shards == d.shards and row is not None
                            and row.state in ("queued", "preempted")):
                        # Logged, then the service died before the job's row said so: finish that step.
                        allocs = {(d.job, n): Allocate(d.stimulus_id, d.job, n, a.cpus, a.memory_bytes)
                                  for n, a in rec.allocation.items()}
                        self._mark_placed(d, allocs)
                    for sh in d.shards:  # not known to run until the node answers the re-sent command
                        a = self.nodes.get(sh.node, LiveNode(id=sh.node)).allocations.get(d.job)
                        if a is not None:
                            a["acked"] = False
                log.info("re-sending decision %s (never acknowledged before the restart)", self._decision_id(d))
                self._spawn(self._carry_out(d, replay=True))
        cpu_resend, self._cpu_resend = getattr(self, "_cpu_resend", []), []
        for job, node, alloc, attempt in cpu_resend:
            log.info("re-sending the start of CPU job %s (never acknowledged before the restart)", job)
            self._spawn(self._start_cpu_job(job, node, alloc, attempt))
