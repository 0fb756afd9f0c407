"""Restart: replay the service's event log into the core, then reconcile with the jobs table.

:class:`Recovery` is an object the service holds.  :meth:`Recovery.replay` runs
before the broker connection: it rebuilds the core and the node table from the
log and the jobs table, and collects what was decided but never acknowledged.
:meth:`Recovery.resume` runs on (re)connect and carries those decisions out
again under their original ids, so a node that already applied one answers
from its reply cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from scheduler import Allocate, Decision, Event, JobArrived, JobCancelled, Place, SchedulerState
from scheduler.service.core_log import CoreLogError, core_job, decode_event
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.commands import NodeCommands
from scheduler.service.cpu_shell import CpuJobsShell
from scheduler.service.decisions import DecisionCarrier
from scheduler.service.models import TERMINAL_STATES
from scheduler.service.nodes import LiveNode
from scheduler.service.store import JobStore

log = logging.getLogger("dlshare.sched.live")


class Recovery:
    """Replays the log at start and re-sends what was left unacknowledged (see the module docstring)."""

    def __init__(self, store: JobStore, core: SchedulerState, nodes: dict[str, LiveNode], commands: NodeCommands,
                 carrier: DecisionCarrier, cpu: CpuJobsShell, now: Callable[[], float],
                 post: Callable[[Event], None]) -> None:
        self.store = store
        self.core = core
        self.nodes = nodes
        self.commands = commands
        self.carrier = carrier
        self.cpu = cpu
        self.now = now
        self.post = post
        self.resend: list[Decision] = []  # logged decisions never acknowledged, to carry out again

    def replay(self) -> None:
        n_batches = 0
        replayed: list[tuple[str, Decision]] = []
        for _, payloads in self.store.core_batches():
            try:
                events = [decode_event(p) for p in payloads]
            except CoreLogError as exc:
                log.error("skipping an unreadable logged batch: %s", exc)
                continue
            for d in self.carrier.handle(events):
                replayed.append((self.carrier.decision_id(d), d))
            n_batches += 1
        rows, _ = self.store.list_jobs(states=["queued", "running", "preempted"], limit=1 << 30)
        states = self.store.decision_states()
        self.cpu.resend = []
        for j in rows:
            if j.state == "running" and j.allocation:
                node = self.nodes.setdefault(j.allocation["node"], LiveNode(id=j.allocation["node"]))
                acked = True
                if int(j.spec.get("gpus", 0)) == 0 and states.get(f"{j.id}/cpu-place/{j.attempts}") != "acked":
                    # A CPU job whose `run` was never acknowledged before the crash: send it again (same
                    # command id, so a node that did start it answers from its reply cache).
                    acked = False
                    self.cpu.resend.append((j.id, j.allocation["node"], j.allocation, j.attempts))
                node.allocations[j.id] = {**j.allocation, "acked": acked}
            if int(j.spec.get("gpus", 0)) > 0 and j.id not in self.core.records:
                self.post(JobArrived(_eid(), self.now(), core_job(j, self.now())))
            elif int(j.spec.get("gpus", 0)) == 0 and j.state == "queued":
                self.cpu.waiting[j.id] = {"id": j.id, "spec": j.spec, "submitted_at": j.submitted_at}
        # GPU jobs ended in the table but still active in the core (a crash between the two).
        for jid, rec in self.core.records.items():
            row = self.store.get_job(jid)
            if row is not None and row.state in TERMINAL_STATES and rec.job.state.active:
                self.post(JobCancelled(_eid(), self.now(), jid, row.reason or row.state))
        self.resend = [d for did, d in replayed if states.get(did) in ("pending", "sent")]
        if n_batches:
            log.info("replayed %d logged batches; %d decisions still to carry out, %d active jobs",
                     n_batches, len(self.resend), len(rows))

    def resume(self) -> None:
        """Once connected again: carry out what the log says was decided but never acknowledged."""
        resend, self.resend = self.resend, []
        for d in resend:
            if isinstance(d, Place):
                rec, row = self.core.records.get(d.job), self.store.get_job(d.job)
                if (rec is not None and rec.shards == d.shards and row is not None
                        and row.state in ("queued", "preempted")):
                    # Logged, then the service died before the job's row said so: finish that step.
                    allocs = {(d.job, n): Allocate(d.stimulus_id, d.job, n, a.cpus, a.memory_bytes)
                              for n, a in rec.allocation.items()}
                    self.carrier.mark_placed(d, allocs)
                for sh in d.shards:  # not known to run until the node answers the re-sent command
                    a = self.nodes.get(sh.node, LiveNode(id=sh.node)).allocations.get(d.job)
                    if a is not None:
                        a["acked"] = False
            log.info("re-sending decision %s (never acknowledged before the restart)", self.carrier.decision_id(d))
            self.commands.spawn(self.carrier.carry_out(d, replay=True))
        self.cpu.resume()
