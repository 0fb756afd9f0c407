"""The live loop: the asyncio shell around the pure scheduler core.

:class:`SchedulerService` turns MQTT telemetry, node state (the Last Will),
job exits and API calls into the core's events (``JobArrived``,
``NodeReport``, ``JobFinished``, ``JobCancelled``, ``PlacementFailed``,
``NodeLost``, ``Tick``), hands them to ``SchedulerState.handle`` in batches,
and carries the decisions out as node commands (``allocate``, ``run``,
``stop``, ``release``; QoS 1, replies correlated by command id).

Durability and replay: each batch of events is logged in SQLite together with
the decisions it produced, in one transaction, before any command leaves.  At
start the log is replayed into a fresh core (same events, same batches, same
decision ids); decisions the table marks as carried out are not sent again,
and those still pending are re-sent with their original command ids (the node
daemon answers a repeated id from its reply cache, so nothing applies twice).

The core places GPU jobs.  CPU-only jobs (``gpus = 0``: data preparation)
are admitted by :mod:`scheduler.service.cpu_jobs`, and their cores and memory
are withheld from what the core may hand out on that node.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nodesvc.bus import messages
from nodesvc.bus.messages import PayloadError
from scheduler import (
    Event, JobArrived, JobCancelled, JobFinished, JobSample, JobState, NodeLost, NodeReport, SchedulerState, Tick,
    Wakeup,
)
from scheduler.service import cpu_jobs
from scheduler.service.commands import NodeCommands
from scheduler.service.core_log import core_job
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.cpu_shell import CpuJobsShell
from scheduler.service.decisions import DecisionCarrier
from scheduler.service.models import TERMINAL_STATES
from scheduler.service.nodes import LiveNode, apply_telemetry, core_node
from scheduler.service.recovery import Recovery
from scheduler.service.store import JobRow, JobStore
from scheduler.service.views import cluster_view

if TYPE_CHECKING:  # pragma: no cover
    from nodesvc.bus.mqtt import Bus
    from scheduler.service.k8s import KubeBinder

log = logging.getLogger("dlshare.sched.live")

VANISHED_AFTER = 3  # telemetry reports in a row without a job we started before it counts as gone


class SchedulerService:
    """The live loop (see the module docstring).  Its parts, each an object it holds:
    ``commands`` (:class:`NodeCommands`, the command path to nodes), ``carrier``
    (:class:`DecisionCarrier`: feeds the core, logs and carries out its decisions),
    ``cpu`` (:class:`CpuJobsShell`: CPU-only jobs) and ``recovery`` (:class:`Recovery`:
    log replay at start, re-sending on reconnect).  They share ``store``, ``core`` and
    the node table ``nodes``; this class owns the MQTT connection, the API side and the loop."""

    def __init__(self, store: JobStore, profile: str = "dlshare", broker_url: str | None = None,
                 service_id: str = "sched", tick_s: float = 2.0, command_timeout_s: float = 10.0,
                 node_timeout_s: float = 30.0, report_s: float = 10.0,
                 clock: Callable[[], float] = time.time, core: SchedulerState | None = None,
                 predictors: Any = None) -> None:
        self.store = store
        self.core = core or SchedulerState(profile, predictors=predictors)
        self.profile = self.core.profile.name
        self.broker_url = broker_url
        self.service_id = service_id
        self.tick_s = tick_s
        self.command_timeout_s = command_timeout_s
        self.node_timeout_s = node_timeout_s
        self.report_s = report_s
        self.clock = clock
        self.nodes: dict[str, LiveNode] = {}  # the live node table, shared with every part
        self.aggregation: dict[str, dict[str, Any]] = {}  # aggregation server -> its last telemetry
        self.bus: Bus | None = None
        self.k8s_binder: KubeBinder | None = None
        self.k8s_hold_s = 120.0
        self.batch_window_s = 0.01  # gather the events of this long into one core batch under load
        self._wake = asyncio.Event()
        self._events: list[Event] = []  # for the core's next batch
        self._bus_stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._wakeup_at: float | None = None
        self._last_service = 0.0
        self._submissions: list[tuple[str | None, dict[str, Any], asyncio.Future]] = []
        self.commands = NodeCommands(command_timeout_s)
        self.carrier = DecisionCarrier(store, self.core, self.nodes, self.commands, clock, self.now, self.post)
        self.cpu = CpuJobsShell(store, self.nodes, self.commands, clock, self.carrier.backoff,
                                functools.partial(self._report, force=True), self.wake)
        self.recovery = Recovery(store, self.core, self.nodes, self.commands, self.carrier, self.cpu, self.now,
                                 self.post)
        self.recovery.replay()

    # --- time and events --------------------------------------------------------------------

    def now(self) -> float:
        return max(self.clock(), self.core.now)

    def post(self, ev: Event) -> None:
        """Queue a core event for the next batch."""
        self._events.append(ev)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # --- API side ---------------------------------------------------------------------------

    def submit(self, spec: dict[str, Any]) -> tuple[JobRow, bool]:
        """Persist a validated spec as a queued job; raises ConflictError for a clashing id."""
        job_id = spec.pop("id", None)
        row, created = self.store.add_job(job_id, spec)
        if created:
            self._accepted(row)
        return row, created

    async def submit_async(self, spec: dict[str, Any]) -> tuple[JobRow, bool]:
        """:meth:`submit` with group commit: submissions that arrive while one commit is being
        prepared share its transaction (and its fsync)."""
        fut = asyncio.get_running_loop().create_future()
        self._submissions.append((spec.pop("id", None), spec, fut))
        if len(self._submissions) == 1:
            asyncio.get_running_loop().call_soon(self._commit_submissions)
        res = await fut
        if isinstance(res, Exception):
            raise res
        return res

    def _commit_submissions(self) -> None:
        batch, self._submissions = self._submissions, []
        try:
            results = self.store.add_jobs([(jid, spec) for jid, spec, _ in batch])
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, _, fut), res in zip(batch, results):
            if not isinstance(res, Exception) and res[1]:
                self._accepted(res[0])
            if not fut.done():
                fut.set_result(res)

    def _accepted(self, row: JobRow) -> None:
        if int(row.spec.get("gpus", 0)) > 0:
            self.post(JobArrived(_eid(), self.now(), core_job(row, self.now())))
        else:
            self.cpu.enqueue(row)

    async def cancel(self, job_id: str) -> JobRow | None:
        job = self.store.get_job(job_id)
        if job is None:
            return None
        if job.state in TERMINAL_STATES:
            return job
        a = job.allocation
        self.cpu.waiting.pop(job_id, None)
        self.store.update_job(job_id, event="cancelled", node=a["node"] if a else None, state="cancelled",
                              reason="cancelled by user", finished_at=self.clock(), allocation=None, durable=True)
        rec = self.core.records.get(job_id)
        if rec is not None and rec.job.state.active:
            self.post(JobCancelled(_eid(), self.now(), job_id, "cancelled by user"))
        if a:
            nodes = list(dict.fromkeys([a["node"], *(sh["node"] for sh in a.get("shards") or [])]))
            for n in nodes:  # every node of a job spread over several
                view = self.nodes.get(n)
                if view is not None:
                    view.allocations.pop(job_id, None)
                self.commands.spawn(self.commands.stop_and_release(
                    job_id, n, f"{job_id}/cancel" + (f"/{n}" if n != a["node"] else "")))
        self.wake()
        return self.store.get_job(job_id)

    # --- MQTT -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.broker_url:
            from nodesvc.bus.mqtt import Bus

            self.bus = Bus(
                self.broker_url, f"dlshare-sched-{self.service_id}-{uuid.uuid4().hex[:6]}",
                subscriptions=[(messages.topic("node", "+", leaf), 1) for leaf in ("telemetry", "state", "reply", "events")]
                + [(messages.topic("agg", "+", "telemetry"), 0), (messages.topic("agg", "+", "state"), 1)],
                handler=self.on_message, on_connect=self._on_connect,
                will=(messages.topic("sched", self.service_id, "state"), messages.encode({"status": "offline"}), 1, True))
            self.commands.bus = self.bus
            self._bus_stop = asyncio.Event()
            self._tasks.append(asyncio.create_task(self.bus.run(self._bus_stop), name="sched-bus"))
        self._tasks.append(asyncio.create_task(self._loop(), name="sched-loop"))

    async def stop(self) -> None:
        if self.bus is not None and self._bus_stop is not None:
            await self.bus.publish(messages.topic("sched", self.service_id, "state"),
                                   messages.encode({"status": "offline", "ts": self.clock()}), 1, True)
            self._bus_stop.set()
        for t in self._tasks:
            t.cancel()
        await self.commands.close()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        self._tasks.clear()

    async def _on_connect(self, bus) -> None:
        await bus.publish(messages.topic("sched", self.service_id, "state"),
                          messages.encode({"status": "online", "ts": self.clock(), "profile": self.profile}), 1, True)
        self.recovery.resume()
        self.wake()

    async def on_message(self, topic: str, payload: bytes) -> None:
        try:
            kind, ident, leaf = messages.parse_topic(topic)
        except PayloadError as exc:
            log.warning("ignoring message: %s", exc)
            return
        try:
            if kind == "agg":
                if leaf == "telemetry":
                    self.aggregation[ident] = {**messages.decode(payload), "_seen": self.clock()}
                elif leaf == "state" and (not payload or messages.decode(payload).get("status") == "offline"):
                    self.aggregation.pop(ident, None)
            elif kind != "node":
                return
            elif leaf == "telemetry":
                self.on_telemetry(messages.parse_telemetry(payload))
            elif leaf == "state":
                self.on_node_state(ident, messages.decode(payload) if payload else {"status": "offline"})
            elif leaf == "reply":
                self.on_reply(messages.decode(payload))
            elif leaf == "events":
                ev = messages.decode(payload)
                if ev.get("event") == "job_exit" and isinstance(ev.get("job"), str):
                    code = ev.get("exit_code")
                    self.job_exited(ident, ev["job"], code if isinstance(code, int) and not isinstance(code, bool) else None,
                                    "oom-killed" if ev.get("oom_killed") else "")
        except PayloadError as exc:
            log.warning("bad %s payload from %s/%s: %s", leaf, kind, ident, exc)

    def on_telemetry(self, t: dict[str, Any]) -> None:
        node = self.nodes.setdefault(t["node"], LiveNode(id=t["node"]))
        was_online = node.status == "online"
        apply_telemetry(node, t, self.clock())
        if not was_online:
            self.store.log_event("node_online", node=node.id, data={"cpus": node.cpu_count, "gpus": len(node.gpus)})
        self._report(node, force=not was_online)
        for job in list(node.allocations):
            usage = node.job_usage.get(job)
            if usage is not None:
                node.missing.pop(job, None)
                if usage.get("state") == "exited":
                    code = usage.get("exit_code")
                    self.job_exited(node.id, job, code if isinstance(code, int) else None, "")
            elif node.allocations[job].get("acked"):
                node.missing[job] = node.missing.get(job, 0) + 1
                if node.missing[job] >= VANISHED_AFTER:
                    self.job_exited(node.id, job, None, "the node no longer reports the job")

    def _report(self, node: LiveNode, force: bool = False) -> None:
        """A NodeReport when the node's resources changed, or every ``report_s`` (predictor samples)."""
        cc, cm = cpu_jobs.withheld(node)
        n = core_node(node, cc, cm)
        key = (n.gpus, n.cores, n.memory_bytes, n.lendable_bytes >> 26)
        now = self.clock()
        if not force and key == node.reported and now - node.reported_at < self.report_s:
            return
        ns = self.core.nodes.get(node.id)
        if ns is not None and ns.node.gpus != n.gpus and ns.jobs:
            log.warning("node %s now reports %d GPUs while running jobs; keeping %d", node.id, n.gpus, ns.node.gpus)
            return
        node.reported, node.reported_at = key, now
        # Measured utilisation of each running GPU job (its GPUs' mean), for the predictors' online
        # update: the core learns a job type's solo utilisation from these samples.
        util = {g.index: (g.util_percent, g.memory_util_percent) for g in node.gpus}
        samples = {}
        for job, a in node.allocations.items():
            us = [util[g] for g in a.get("gpus") or [] if g in util and util[g][0] is not None]
            if us and job in self.core.running:
                mems = [m for _, m in us if m is not None]
                samples[job] = JobSample(sm_percent=sum(u for u, _ in us) / len(us),
                                         mem_percent=sum(mems) / len(mems) if mems else None)
        self.post(NodeReport(_eid(), self.now(), n, gpu_util=tuple(float(g.util_percent or 0.0) for g in node.gpus),
                             cpu_percent=node.cpu_percent, memory_available_bytes=node.memory_available_bytes,
                             jobs=samples))

    def on_node_state(self, node_id: str, state: dict[str, Any]) -> None:
        node = self.nodes.setdefault(node_id, LiveNode(id=node_id))
        status = state.get("status")
        if status == "offline" and node.status != "offline":
            self._node_lost(node, "went offline (its Last Will or its shutdown)")
        elif status == "online" and node.status == "offline":
            node.status = "unknown"  # back once its telemetry arrives

    def _node_lost(self, node: LiveNode, why: str) -> None:
        node.status = "offline"
        node.reported = None
        jobs = sorted(node.allocations)
        self.store.log_event("node_offline", node=node.id, data={"why": why, "jobs": jobs})
        log.warning("node %s %s; requeueing %d jobs", node.id, why, len(jobs))
        for job in jobs:
            node.allocations.pop(job, None)
            row = self.store.get_job(job)
            if row is not None and row.state == "running":
                self.store.update_job(job, event="requeued", node=node.id, state="queued",
                                      reason=f"node {node.id} {why}", allocation=None)
                if int(row.spec.get("gpus", 0)) == 0:
                    self.cpu.enqueue(row)
        self.cpu.dirty = True
        if node.id in self.core.nodes and self.core.nodes[node.id].alive:
            self.post(NodeLost(_eid(), self.now(), node.id))
        self.wake()

    def on_reply(self, r: dict[str, Any]) -> None:
        self.commands.resolve(r)

    def job_exited(self, node_id: str, job_id: str, code: int | None, why: str) -> None:
        node = self.nodes.get(node_id)
        if node is None or job_id not in node.allocations:
            return  # already handled: the event and the telemetry both report an exit
        node.allocations.pop(job_id, None)
        node.missing.pop(job_id, None)
        row = self.store.get_job(job_id)
        rec = self.core.records.get(job_id)
        if row is not None and row.state == "running":
            ok = code == 0
            reason = None if ok else (why or f"exited with code {code}")
            self.store.update_job(job_id, event="exited", node=node_id, event_data={"exit_code": code, "why": why},
                                  state="done" if ok else "failed", exit_code=code, finished_at=self.clock(),
                                  reason=reason, allocation=None, attained_service=self._service_of(row))
            if rec is not None and rec.job.state is JobState.RUNNING:
                self.post(JobFinished(_eid(), self.now(), job_id, failed=not ok, reason=reason or ""))
        self.commands.spawn(self.commands.release(job_id, node_id))
        self.cpu.dirty = True
        self.wake()

    # --- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            timeout = self.tick_s
            if self._wakeup_at is not None:
                timeout = max(0.0, min(timeout, self._wakeup_at - self.clock()))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
            if self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)  # one scheduling pass for a burst, not one per event
            self._wake.clear()
            try:
                self.round()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("scheduling round failed")

    def round(self) -> None:
        """One pass: stale nodes, due Tick, one core batch, CPU-only admissions, service accounting."""
        now = self.clock()
        for node in list(self.nodes.values()):
            if node.status == "online" and node.last_seen and now - node.last_seen > self.node_timeout_s:
                self._node_lost(node, f"sent no telemetry for {self.node_timeout_s:g}s")
        if self._wakeup_at is not None and now >= self._wakeup_at:
            self._wakeup_at = None
            self._events.append(Tick(_eid(), self.now()))
        if self._events:
            batch, self._events = self._events, []
            for d in self.carrier.run_batch(batch):
                if isinstance(d, Wakeup) and (self._wakeup_at is None or d.at < self._wakeup_at):
                    self._wakeup_at = d.at
        self.cpu.admit()
        if now - self._last_service >= 5.0:
            self._last_service = now
            self._account(now)
            self._expire_k8s_holds(now)

    # --- accounting and views ---------------------------------------------------------------

    def _service_of(self, r: JobRow) -> float:
        """GPU-seconds from the core (Tiresias's measure), CPU-seconds for CPU-only jobs."""
        now = self.now()
        rec = self.core.records.get(r.id)
        if rec is not None:
            return rec.service(now)
        if r.started_at is not None and r.allocation:
            return (r.allocation.get("cpus") or 0.0) * max(0.0, now - r.started_at)
        return r.attained_service

    def _account(self, now: float) -> None:
        """Attained service of running jobs into the table (for the API), from memory, no scan."""
        amounts: dict[str, float] = {}
        t = self.now()
        for node in self.nodes.values():
            for job, a in node.allocations.items():
                rec = self.core.records.get(job)
                if rec is not None:
                    amounts[job] = rec.service(t)
                elif a.get("started_at") is not None and not a.get("k8s"):
                    amounts[job] = (a.get("cpus") or 0.0) * max(0.0, t - a["started_at"])
        self.store.set_service(amounts)

    def _expire_k8s_holds(self, now: float) -> None:
        """A pod bound through the extender is held on its node until its usage shows in the
        node's measured figures; after ``k8s_hold_s`` the hold is dropped."""
        for node in self.nodes.values():
            for job in [j for j, a in node.allocations.items()
                        if a.get("k8s") and now - a.get("bound_at", now) > self.k8s_hold_s]:
                node.allocations.pop(job, None)
                self.cpu.dirty = True

    def cluster(self) -> dict[str, Any]:
        return cluster_view(self)


__all__ = ["SchedulerService"]
