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
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from nodesvc.bus import messages
from nodesvc.bus.messages import PayloadError
from nodesvc.bus.rpc import CommandError, CommandNotSent, Correlator
from scheduler import (
    Allocate, JobArrived, JobCancelled, JobFinished, JobSample, JobState, NodeLost, NodeReport, Place,
    PlacementFailed, Preempt, Reject, SchedulerError, SchedulerState, Tick, Wakeup,
)
from scheduler.service import cpu_jobs
from scheduler.service.cpu_shell import CpuJobsShell
from scheduler.service.core_log import core_job, encode_event
from scheduler.service.core_log import new_event_id as _eid
from scheduler.service.recovery import RecoveryShell
from scheduler.service.nodes import LiveNode, apply_telemetry, core_node
from scheduler.service.models import TERMINAL_STATES
from scheduler.service.store import ConflictError, DecisionRow, JobRow, JobStore
from scheduler.service.views import cluster_view

log = logging.getLogger("dlshare.sched.live")

VANISHED_AFTER = 3  # telemetry reports in a row without a job we started before it counts as gone


class SchedulerService(CpuJobsShell, RecoveryShell):
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
        self.nodes: dict[str, LiveNode] = {}
        self.aggregation: dict[str, dict[str, Any]] = {}
        self.bus = None
        self.k8s_binder = None
        self.k8s_hold_s = 120.0
        self._wake = asyncio.Event()
        self._events: list[Any] = []
        self.commands = Correlator("sched", command_timeout_s)
        self._tasks: list[asyncio.Task] = []
        self._bg: set[asyncio.Task] = set()
        self._batch = store.last_batch()
        self._wakeup_at: float | None = None
        self._last_service = 0.0
        self._failures: dict[str, int] = {}  # job -> placement failures, for the retry backoff
        self._not_before: dict[str, float] = {}  # CPU-only job -> earliest next admission
        self._cpu_waiting: dict[str, dict[str, Any]] = {}  # queued CPU-only jobs: id -> {id, spec, submitted_at}
        self._cpu_dirty = True  # something changed that may let a waiting CPU-only job in
        self._submissions: list[tuple[str | None, dict[str, Any], asyncio.Future]] = []
        self.batch_window_s = 0.01  # gather the events of this long into one core batch under load
        self.decision_latency_s: list[float] = []  # submit -> run acked, for the benchmark
        self._replay()

    # --- time and events --------------------------------------------------------------------

    def now(self) -> float:
        return max(self.clock(), self.core.now)

    def post(self, ev: Any) -> None:
        """Queue a core event for the next batch."""
        self._events.append(ev)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _handle(self, events: list[Any]) -> list[Any]:
        """Feed the core, one event at a time where one is refused (its state is then unchanged)."""
        try:
            return self.core.handle(*events)
        except SchedulerError as exc:
            if len(events) == 1:
                log.warning("core refused event %s: %s", events[0].stimulus_id, exc)
                return []
        out: list[Any] = []
        for ev in events:
            try:
                out += self.core.handle(ev)
            except SchedulerError as exc:
                log.warning("core refused event %s: %s", ev.stimulus_id, exc)
        return out

    @staticmethod
    def _decision_id(d: Any) -> str:
        kind = type(d).__name__.lower()
        if isinstance(d, Allocate):
            return f"{d.stimulus_id}/{kind}/{d.job}/{d.node}"
        if isinstance(d, Wakeup):
            return f"{d.stimulus_id}/{kind}"
        return f"{d.stimulus_id}/{kind}/{d.job}"

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
            self._cpu_wait(row)

    async def cancel(self, job_id: str) -> JobRow | None:
        job = self.store.get_job(job_id)
        if job is None:
            return None
        if job.state in TERMINAL_STATES:
            return job
        a = job.allocation
        self._cpu_waiting.pop(job_id, None)
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
                self._spawn(self._stop_and_release(job_id, n, f"{job_id}/cancel" + (f"/{n}" if n != a["node"] else "")))
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
            self._stop = asyncio.Event()
            self._tasks.append(asyncio.create_task(self.bus.run(self._stop), name="sched-bus"))
        self._tasks.append(asyncio.create_task(self._loop(), name="sched-loop"))

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.publish(messages.topic("sched", self.service_id, "state"),
                                   messages.encode({"status": "offline", "ts": self.clock()}), 1, True)
            self._stop.set()
        for t in [*self._tasks, *self._bg]:
            t.cancel()
        for t in [*self._tasks, *self._bg]:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        self._tasks.clear()

    async def _on_connect(self, bus) -> None:
        await bus.publish(messages.topic("sched", self.service_id, "state"),
                          messages.encode({"status": "online", "ts": self.clock(), "profile": self.profile}), 1, True)
        self._resume_after_restart()
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
                    self._cpu_wait(row)
        self._cpu_dirty = True
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
        self._spawn(self._release(job_id, node_id))
        self._cpu_dirty = True
        self.wake()

    # --- commands ---------------------------------------------------------------------------

    async def command(self, node: str, op: str, args: dict[str, Any], cmd_id: str) -> dict[str, Any]:
        """Send one command (QoS 1) and wait for its reply; raises CommandError."""
        if self.bus is None:
            raise CommandNotSent("no broker configured")
        return await self.commands.call(self.bus.publish, node, op, args, cmd_id)

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _release(self, job_id: str, node: str) -> None:
        try:
            await self.command(node, "release", {"job": job_id}, f"{job_id}/release/{uuid.uuid4().hex[:8]}")
        except CommandError as exc:
            log.info("release of %s on %s: %s", job_id, node, exc)

    async def _stop_and_release(self, job_id: str, node: str, cmd_base: str) -> None:
        try:
            await self.command(node, "stop", {"job": job_id}, f"{cmd_base}/stop")
        except CommandError as exc:
            log.warning("stop of %s on %s: %s", job_id, node, exc)
        await self._release(job_id, node)

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
            self._run_batch(batch)
        self._admit_cpu_jobs()
        if now - self._last_service >= 5.0:
            self._last_service = now
            self._account(now)
            self._expire_k8s_holds(now)

    def _run_batch(self, events: list[Any]) -> None:
        decisions = self._handle(events)
        self._batch += 1
        # An Allocate for a job placed in this same batch travels inside its `run` command: it is
        # recorded as applied with the placement, never sent on its own.
        placed = {(s.node, d.job) for d in decisions if isinstance(d, Place) for s in d.shards}
        rows = [DecisionRow(id=self._decision_id(d), kind=type(d).__name__.lower(), job=getattr(d, "job", None),
                            node=getattr(d, "node", None) if not isinstance(d, Wakeup) else None,
                            data=_decision_data(d),
                            state="acked" if isinstance(d, Allocate) and (d.node, d.job) in placed else "pending")
                for d in decisions if not isinstance(d, Wakeup)]
        self.store.record_batch(self._batch, [(ev.stimulus_id, encode_event(ev)) for ev in events], rows)
        allocs = {(d.job, d.node): d for d in decisions if isinstance(d, Allocate)}
        for d in decisions:
            if isinstance(d, Wakeup):
                if self._wakeup_at is None or d.at < self._wakeup_at:
                    self._wakeup_at = d.at
            elif isinstance(d, Reject):
                self.store.update_job(d.job, event="rejected", state="failed", reason=d.reason,
                                      finished_at=self.clock())
            elif isinstance(d, Place):
                self._mark_placed(d, allocs)
                self._spawn(self._carry_out(d))
            elif isinstance(d, Preempt):
                self._mark_preempted(d)
                self._spawn(self._carry_out(d))
            elif isinstance(d, Allocate):
                row = self.store.get_job(d.job)
                placed_now = any(isinstance(p, Place) and p.job == d.job for p in decisions)
                if not placed_now and row is not None and row.state == "running":
                    a = dict(row.allocation or {})
                    a.update(cpus=d.cpus, memory_bytes=d.memory_bytes)
                    self.store.update_job(d.job, allocation=a)
                    if d.node in self.nodes and d.job in self.nodes[d.node].allocations:
                        self.nodes[d.node].allocations[d.job].update(cpus=d.cpus, memory_bytes=d.memory_bytes)
                    self._spawn(self._carry_out(d))

    def _mark_placed(self, d: Place, allocs: dict) -> None:
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
                                          "decision": self._decision_id(d)},
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

    async def _carry_out(self, d: Any, replay: bool = False) -> None:
        did = self._decision_id(d)
        try:
            if isinstance(d, Place):
                await self._start_gpu_job(d, did, replay)
            elif isinstance(d, Preempt):
                placed = next((e for e in self.store.events(job=d.job)[::-1] if e["kind"] == "placed"), None)
                # A job spread over several nodes is stopped on every one of them.
                nodes = (placed["data"].get("nodes") or [placed["node"]]) if placed else []
                for node in dict.fromkeys(n for n in nodes if n):
                    await self._stop_and_release(d.job, node, f"{did}/{node}" if len(nodes) > 1 else did)
            elif isinstance(d, Allocate):
                await self.command(d.node, "allocate", {"job": d.job, "cpus": max(0.01, d.cpus),
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
            await self.command(s.node, "run", run, f"{did}/{s.node}/run")
            n = self.nodes.get(s.node)
            if n is not None and d.job in n.allocations:
                n.allocations[d.job]["acked"] = True
        self.decision_latency_s.append(self.clock() - row.submitted_at)
        self.store.log_event("started", job=d.job, node=d.node, data={"decision": did})

    def _placement_failed(self, job: str, nodes: list[str], why: str) -> None:
        for n in nodes:
            if n in self.nodes:
                self.nodes[n].allocations.pop(job, None)
            self._spawn(self._release(job, n))
        row = self.store.get_job(job)
        if row is not None and row.state == "running":
            self.store.update_job(job, event="placement_failed", event_data={"error": why}, state="queued",
                                  reason=f"placement failed: {why}", allocation=None)
        rec = self.core.records.get(job)
        if rec is not None and rec.job.state is JobState.RUNNING:
            # Tell the core after a backoff, so that a node refusing every start is not hammered in a loop;
            # meanwhile the GPUs stay held by the job.
            delay = self._backoff(job)
            loop = asyncio.get_running_loop()
            loop.call_later(delay, lambda: self.post(PlacementFailed(_eid(), self.now(), job, why)))

    def _backoff(self, job: str) -> float:
        n = self._failures.get(job, 0)
        self._failures[job] = n + 1
        return min(30.0, 0.5 * 2 ** n)

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
                self._cpu_dirty = True

    def cluster(self) -> dict[str, Any]:
        return cluster_view(self)


def _decision_data(d: Any) -> dict[str, Any]:
    if isinstance(d, Place):
        return {"shards": [{"node": s.node, "gpus": list(s.gpus)} for s in d.shards],
                "colocated_with": list(d.colocated_with), "resumed": d.resumed}
    if isinstance(d, Allocate):
        return {"cpus": d.cpus, "memory_bytes": d.memory_bytes}
    return {"reason": getattr(d, "reason", "")}


__all__ = ["SchedulerService", "CommandError", "ConflictError", "core_job"]
