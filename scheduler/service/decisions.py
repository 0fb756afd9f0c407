"""Carrying out the scheduler core's decisions: the jobs table, the node table and node commands.

:class:`DecisionCarrier` hands batches of events to the core
(``SchedulerState.handle``), logs each batch with the decisions it produced in
one transaction before anything leaves (the log the service replays at
start), and then carries the decisions out: a ``Place`` becomes the job's row
and a ``run`` command per shard (which applies the allocation and starts the
process group), a ``Preempt`` a ``stop`` and ``release``, an ``Allocate`` an
``allocate`` command, a ``Reject`` a failed row.  A start a node refuses goes
back to the core as ``PlacementFailed`` after a backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nodesvc.bus.rpc import CommandError
from scheduler import (
    Allocate, Decision, Event, JobState, Place, PlacementFailed, Preempt, Reject, SchedulerError, SchedulerState,
    Wakeup,
)
from scheduler.service.commands import NodeCommands
from scheduler.service.core_log import encode_event
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.nodes import LiveNode
from scheduler.service.store import DecisionRow, JobStore

log = logging.getLogger("dlshare.sched.live")


class DecisionCarrier:
    """Feeds the core and carries out its decisions (see the module docstring).

    ``now`` is the service's clock as the core sees it; ``post`` queues an event
    for the core's next batch."""

    def __init__(self, store: JobStore, core: SchedulerState, nodes: dict[str, LiveNode], commands: NodeCommands,
                 clock: Callable[[], float], now: Callable[[], float], post: Callable[[Event], None]) -> None:
        self.store = store
        self.core = core
        self.nodes = nodes
        self.commands = commands
        self.clock = clock
        self.now = now
        self.post = post
        self.batch = store.last_batch()  # the number of the last logged batch
        self.failures: dict[str, int] = {}  # job -> failed starts, for the retry backoff

    def handle(self, events: list[Event]) -> list[Decision]:
        """Feed the core, one event at a time where one is refused (its state is then unchanged)."""
        try:
            return self.core.handle(*events)
        except SchedulerError as exc:
            if len(events) == 1:
                log.warning("core refused event %s: %s", events[0].stimulus_id, exc)
                return []
        out: list[Decision] = []
        for ev in events:
            try:
                out += self.core.handle(ev)
            except SchedulerError as exc:
                log.warning("core refused event %s: %s", ev.stimulus_id, exc)
        return out

    @staticmethod
    def decision_id(d: Decision) -> str:
        """The decision's id in the decisions table and in its commands' ids: the same on a replay."""
        kind = type(d).__name__.lower()
        if isinstance(d, Allocate):
            return f"{d.stimulus_id}/{kind}/{d.job}/{d.node}"
        if isinstance(d, Wakeup):
            return f"{d.stimulus_id}/{kind}"
        return f"{d.stimulus_id}/{kind}/{d.job}"

    def run_batch(self, events: list[Event]) -> list[Decision]:
        """Hand ``events`` to the core as one batch, log them with the decisions in one
        transaction, then carry the decisions out.  Returns the decisions (the loop keeps
        the :class:`Wakeup` ones)."""
        decisions = self.handle(events)
        self.batch += 1
        # An Allocate for a job placed in this same batch travels inside its `run` command: it is
        # recorded as applied with the placement, never sent on its own.
        placed = {(s.node, d.job) for d in decisions if isinstance(d, Place) for s in d.shards}
        rows = [DecisionRow(id=self.decision_id(d), kind=type(d).__name__.lower(), job=getattr(d, "job", None),
                            node=getattr(d, "node", None) if not isinstance(d, Wakeup) else None,
                            data=_decision_data(d),
                            state="acked" if isinstance(d, Allocate) and (d.node, d.job) in placed else "pending")
                for d in decisions if not isinstance(d, Wakeup)]
        self.store.record_batch(self.batch, [(ev.stimulus_id, encode_event(ev)) for ev in events], rows)
        allocs = {(d.job, d.node): d for d in decisions if isinstance(d, Allocate)}
        for d in decisions:
            if isinstance(d, Reject):
                self.store.update_job(d.job, event="rejected", state="failed", reason=d.reason,
                                      finished_at=self.clock())
            elif isinstance(d, Place):
                self.mark_placed(d, allocs)
                self.commands.spawn(self.carry_out(d))
            elif isinstance(d, Preempt):
                self._mark_preempted(d)
                self.commands.spawn(self.carry_out(d))
            elif isinstance(d, Allocate):
                row = self.store.get_job(d.job)
                placed_now = any(isinstance(p, Place) and p.job == d.job for p in decisions)
                if not placed_now and row is not None and row.state == "running":
                    a = dict(row.allocation or {})
                    a.update(cpus=d.cpus, memory_bytes=d.memory_bytes)
                    self.store.update_job(d.job, allocation=a)
                    if d.node in self.nodes and d.job in self.nodes[d.node].allocations:
                        self.nodes[d.node].allocations[d.job].update(cpus=d.cpus, memory_bytes=d.memory_bytes)
                    self.commands.spawn(self.carry_out(d))
        return decisions

    def mark_placed(self, d: Place, allocs: dict) -> None:
        row = self.store.get_job(d.job)
        if row is None:
            return
        al = allocs.get((d.job, d.node))
        spec = row.spec
        alloc = {"node": d.node, "gpus": list(d.gpus), "cpus": al.cpus if al else float(spec.get("cpus") or 1.0),
                 "memory_bytes": al.memory_bytes if al else int(spec.get("memory_bytes") or 0), "cpuset": None,
                 "shards": [{"node": s.node, "gpus": list(s.gpus)} for s in d.shards],
                 "colocated_with": list(d.colocated_with), "acked": False,
                 "requested_cpus": float(spec.get("cpus") or 0.0),
                 "requested_memory_bytes": int(spec.get("memory_bytes") or 0)}
        for s in d.shards:
            self.nodes.setdefault(s.node, LiveNode(id=s.node)).allocations[d.job] = dict(alloc, node=s.node,
                                                                                          gpus=list(s.gpus))
        self.store.update_job(d.job, event="placed", node=d.node,
                              event_data={"gpus": list(d.gpus), "cpus": alloc["cpus"], "memory_bytes": alloc["memory_bytes"],
                                          "colocated_with": list(d.colocated_with), "resumed": d.resumed,
                                          "nodes": [s.node for s in d.shards],
                                          "decision": self.decision_id(d)},
                              state="running", allocation=alloc, started_at=self.clock(), attempts=row.attempts + 1,
                              reason=("co-located with " + ", ".join(d.colocated_with)) if d.colocated_with else None)

    def _mark_preempted(self, d: Preempt) -> None:
        row = self.store.get_job(d.job)
        if row is None or row.state != "running":
            return
        for node in self.nodes.values():
            node.allocations.pop(d.job, None)
        self.store.update_job(d.job, event="preempted", node=(row.allocation or {}).get("node"),
                              event_data={"why": d.reason}, state="preempted", reason=d.reason, allocation=None)

    async def carry_out(self, d: Any, replay: bool = False) -> None:
        did = self.decision_id(d)
        try:
            if isinstance(d, Place):
                await self._start_gpu_job(d, did, replay)
            elif isinstance(d, Preempt):
                placed = next((e for e in self.store.events(job=d.job)[::-1] if e["kind"] == "placed"), None)
                # A job spread over several nodes is stopped on every one of them.
                nodes = (placed["data"].get("nodes") or [placed["node"]]) if placed else []
                for node in dict.fromkeys(n for n in nodes if n):
                    await self.commands.stop_and_release(d.job, node, f"{did}/{node}" if len(nodes) > 1 else did)
            elif isinstance(d, Allocate):
                await self.commands.send(d.node, "allocate", {"job": d.job, "cpus": max(0.01, d.cpus),
                                                        "memory_bytes": max(1 << 20, d.memory_bytes)}, f"{did}/allocate")
            self.store.set_decision_state(did, "acked")
        except CommandError as exc:
            self.store.set_decision_state(did, "failed", {"error": str(exc)})
            log.warning("decision %s failed: %s", did, exc)
            if isinstance(d, Place):
                self._placement_failed(d.job, [s.node for s in d.shards], str(exc))

    async def _start_gpu_job(self, d: Place, did: str, replay: bool) -> None:
        row = self.store.get_job(d.job)
        if row is None or row.state != "running":
            return  # cancelled (or requeued) meanwhile
        if replay and self.core.records.get(d.job) is not None and self.core.records[d.job].shards != d.shards:
            return  # the core has since moved on
        a = row.allocation or {}
        for rank, s in enumerate(d.shards):
            # `run` with the allocation applies it (cgroups) and starts the process group in one command.
            env = {**(row.spec.get("env") or {}), "DLSHARE_JOB_ID": d.job, "DLSHARE_RANK": str(rank),
                   "DLSHARE_WORLD_SIZE": str(len(d.shards)), "CUDA_VISIBLE_DEVICES": ",".join(map(str, s.gpus))}
            run = {"job": d.job, "cpus": max(0.01, float(a.get("cpus") or 1.0)),
                   "memory_bytes": max(1 << 20, int(a.get("memory_bytes") or (1 << 20))),
                   "argv": row.spec["command"], "env": env, "gpus": list(s.gpus)}
            if row.spec.get("cwd"):
                run["cwd"] = row.spec["cwd"]
            await self.commands.send(s.node, "run", run, f"{did}/{s.node}/run")
            n = self.nodes.get(s.node)
            if n is not None and d.job in n.allocations:
                n.allocations[d.job]["acked"] = True
        self.store.log_event("started", job=d.job, node=d.node, data={"decision": did})

    def _placement_failed(self, job: str, nodes: list[str], why: str) -> None:
        for n in nodes:
            if n in self.nodes:
                self.nodes[n].allocations.pop(job, None)
            self.commands.spawn(self.commands.release(job, n))
        row = self.store.get_job(job)
        if row is not None and row.state == "running":
            self.store.update_job(job, event="placement_failed", event_data={"error": why}, state="queued",
                                  reason=f"placement failed: {why}", allocation=None)
        rec = self.core.records.get(job)
        if rec is not None and rec.job.state is JobState.RUNNING:
            # Tell the core after a backoff, so that a node refusing every start is not hammered in a loop;
            # meanwhile the GPUs stay held by the job.
            delay = self.backoff(job)
            loop = asyncio.get_running_loop()
            loop.call_later(delay, lambda: self.post(PlacementFailed(_eid(), self.now(), job, why)))

    def backoff(self, job: str) -> float:
        n = self.failures.get(job, 0)
        self.failures[job] = n + 1
        return min(30.0, 0.5 * 2 ** n)


def _decision_data(d: Any) -> dict[str, Any]:
    if isinstance(d, Place):
        return {"shards": [{"node": s.node, "gpus": list(s.gpus)} for s in d.shards],
                "colocated_with": list(d.colocated_with), "resumed": d.resumed}
    if isinstance(d, Allocate):
        return {"cpus": d.cpus, "memory_bytes": d.memory_bytes}
    return {"reason": getattr(d, "reason", "")}
