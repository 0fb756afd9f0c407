"""The live loop's handling of CPU-only jobs (``gpus = 0``), an object the service holds.

The core places GPU jobs only; these jobs wait in an in-memory queue (rebuilt
from the jobs table at start), are admitted by :func:`scheduler.service.cpu_jobs.admit`
whenever something changed, and are started with one ``run`` command that
carries their allocation.  A start that fails is retried after a backoff.
(A stopgap beside the core: CPU-only jobs are to become core jobs.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from nodesvc.bus.rpc import CommandError
from scheduler.service import cpu_jobs
from scheduler.service.commands import NodeCommands
from scheduler.service.nodes import LiveNode
from scheduler.service.store import DecisionRow, JobRow, JobStore

log = logging.getLogger("dlshare.sched.live")


class CpuJobsShell:
    """Admits and starts CPU-only jobs.  ``report(node)`` tells the core a node's resources
    changed (its CPU-only jobs are withheld from what the core hands out); ``backoff(job)``
    is the delay before a failed start is tried again; ``wake()`` asks the loop for a round."""

    def __init__(self, store: JobStore, nodes: dict[str, LiveNode], commands: NodeCommands,
                 clock: Callable[[], float], backoff: Callable[[str], float],
                 report: Callable[[LiveNode], None], wake: Callable[[], None]) -> None:
        self.store = store
        self.nodes = nodes
        self.commands = commands
        self.clock = clock
        self.backoff = backoff
        self.report = report
        self.wake = wake
        self.waiting: dict[str, dict[str, Any]] = {}  # queued CPU-only jobs: id -> {id, spec, submitted_at}
        self.not_before: dict[str, float] = {}  # job -> earliest next admission (after a failed start)
        self.dirty = True  # something changed that may let a waiting job in
        self.resend: list[tuple[str, str, dict[str, Any], int]] = []  # starts unacknowledged at a restart

    def enqueue(self, row: JobRow) -> None:
        self.waiting[row.id] = {"id": row.id, "spec": row.spec, "submitted_at": row.submitted_at}
        self.dirty = True
        self.wake()

    def admit(self) -> None:
        now = self.clock()
        due = any(t <= now for j, t in self.not_before.items() if j in self.waiting)
        if not self.waiting or not (self.dirty or due):
            return
        self.dirty = False
        waiting = [j for j in self.waiting.values() if self.not_before.get(j["id"], 0) <= now]
        online = [n for n in self.nodes.values() if n.status == "online"]
        for job, node_id, alloc in cpu_jobs.admit(waiting, online):
            self.waiting.pop(job, None)
            self.not_before.pop(job, None)
            row = self.store.get_job(job)
            if row is None or row.state != "queued":
                continue
            node = self.nodes[node_id]
            alloc = {**alloc, "started_at": now}
            node.allocations[job] = {**alloc, "acked": False}
            self.store.update_job(job, event="placed", node=node_id, event_data={**alloc, "policy": "cpu_jobs"},
                                  state="running", allocation=alloc, started_at=now,
                                  attempts=row.attempts + 1, reason=None)
            self.report(node)
            self.commands.spawn(self.start(job, node_id, alloc, (row.attempts if row else 0) + 1))

    async def start(self, job: str, node: str, alloc: dict[str, Any], attempt: int) -> None:
        did = f"{job}/cpu-place/{attempt}"
        self.store.record_decision(DecisionRow(id=did, kind="cpu-place", job=job, node=node, data=alloc))
        row = self.store.get_job(job)
        try:
            base = {"job": job, "cpus": alloc["cpus"], "memory_bytes": alloc["memory_bytes"]}
            run = {**base, "argv": row.spec["command"], "env": {**(row.spec.get("env") or {}), "DLSHARE_JOB_ID": job}}
            if row.spec.get("cwd"):
                run["cwd"] = row.spec["cwd"]
            await self.commands.send(node, "run", run, f"{did}/run")
            self.store.set_decision_state(did, "acked")
            if node in self.nodes and job in self.nodes[node].allocations:
                self.nodes[node].allocations[job]["acked"] = True
            self.store.log_event("started", job=job, node=node, data={"decision": did})
        except CommandError as exc:
            self.store.set_decision_state(did, "failed", {"error": str(exc)})
            if node in self.nodes:
                self.nodes[node].allocations.pop(job, None)
            cur = self.store.get_job(job)
            if cur is not None and cur.state == "running":
                self.store.update_job(job, event="placement_failed", node=node, event_data={"error": str(exc)},
                                      state="queued", reason=f"placement failed: {exc}", allocation=None)
                self.enqueue(cur)
            self.not_before[job] = self.clock() + self.backoff(job)
            await self.commands.release(job, node)

    def resume(self) -> None:
        """Once connected again after a restart: send the starts never acknowledged before it
        (same command ids, so a node that did start one answers from its reply cache)."""
        resend, self.resend = self.resend, []
        for job, node, alloc, attempt in resend:
            log.info("re-sending the start of CPU job %s (never acknowledged before the restart)", job)
            self.commands.spawn(self.start(job, node, alloc, attempt))
