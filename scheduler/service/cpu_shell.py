"""The live loop's handling of CPU-only jobs (``gpus = 0``), as a part of
:class:`~scheduler.service.live.SchedulerService`.

The core places GPU jobs only; these jobs wait in an in-memory queue (rebuilt
from the jobs table at start), are admitted by :func:`scheduler.service.cpu_jobs.admit`
whenever something changed, and are started with one ``run`` command that
carries their allocation.  A start that fails is retried after a backoff.
"""

from __future__ import annotations

from typing import Any

from scheduler.service import cpu_jobs
from nodesvc.bus.rpc import CommandError
from scheduler.service.store import DecisionRow, JobRow


class CpuJobsShell:
    """Mixed into SchedulerService; uses its store, nodes, clock and command path."""

    def _cpu_wait(self, row: JobRow) -> None:
        self._cpu_waiting[row.id] = {"id": row.id, "spec": row.spec, "submitted_at": row.submitted_at}
        self._cpu_dirty = True
        self.wake()

    def _admit_cpu_jobs(self) -> None:
        now = self.clock()
        due = any(t <= now for j, t in self._not_before.items() if j in self._cpu_waiting)
        if not self._cpu_waiting or not (self._cpu_dirty or due):
            return
        self._cpu_dirty = False
        waiting = [j for j in self._cpu_waiting.values() if self._not_before.get(j["id"], 0) <= now]
        online = [n for n in self.nodes.values() if n.status == "online"]
        for job, node_id, alloc in cpu_jobs.admit(waiting, online):
            self._cpu_waiting.pop(job, None)
            self._not_before.pop(job, None)
            row = self.store.get_job(job)
            if row is None or row.state != "queued":
                continue
            node = self.nodes[node_id]
            alloc = {**alloc, "started_at": now}
            node.allocations[job] = {**alloc, "acked": False}
            self.store.update_job(job, event="placed", node=node_id, event_data={**alloc, "policy": "cpu_jobs"},
                                  state="running", allocation=alloc, started_at=now,
                                  attempts=row.attempts + 1, reason=None)
            self._report(node, force=True)
            self._spawn(self._start_cpu_job(job, node_id, alloc, (row.attempts if row else 0) + 1))

    async def _start_cpu_job(self, job: str, node: str, alloc: dict[str, Any], attempt: int) -> None:
        did = f"{job}/cpu-place/{attempt}"
        self.store.record_decision(DecisionRow(id=did, kind="cpu-place", job=job, node=node, data=alloc))
        row = self.store.get_job(job)
        try:
            base = {"job": job, "cpus": alloc["cpus"], "memory_bytes": alloc["memory_bytes"]}
            run = {**base, "argv": row.spec["command"], "env": {**(row.spec.get("env") or {}), "DLSHARE_JOB_ID": job}}
            if row.spec.get("cwd"):
                run["cwd"] = row.spec["cwd"]
            await self.command(node, "run", run, f"{did}/run")
            self.store.set_decision_state(did, "acked")
            if node in self.nodes and job in self.nodes[node].allocations:
                self.nodes[node].allocations[job]["acked"] = True
            self.decision_latency_s.append(self.clock() - row.submitted_at)
            self.store.log_event("started", job=job, node=node, data={"decision": did})
        except CommandError as exc:
            self.store.set_decision_state(did, "failed", {"error": str(exc)})
            if node in self.nodes:
                self.nodes[node].allocations.pop(job, None)
            cur = self.store.get_job(job)
            if cur is not None and cur.state == "running":
                self.store.update_job(job, event="placement_failed", node=node, event_data={"error": str(exc)},
                                      state="queued", reason=f"placement failed: {exc}", allocation=None)
                self._cpu_wait(cur)
            self._not_before[job] = self.clock() + self._backoff(job)
            await self._release(job, node)
