"""The live loop: MQTT telemetry and API calls in, node commands out.

:class:`SchedulerService` is the asyncio shell around a
:class:`~scheduler.service.engine.PlacementEngine` (the scheduler core).  It

- keeps a :class:`NodeState` per node from telemetry and the retained state
  topic (the node's Last Will flips it offline),
- runs a scheduling round whenever something changed (a submission, a job
  exit, a node joining or leaving) and on a timer,
- carries placements out as node commands (``allocate`` then ``run``, QoS 1,
  each with an id derived from the decision id, replies correlated by id),
- persists every decision before acting on it, so a replayed decision does not
  apply twice, and every event it reacts to, so a run can be followed,
- accounts attained service (GPU-seconds, CPU-seconds for CPU-only jobs) for LAS,
  and feeds measured utilisation back to the engine's predictors,
- requeues the jobs of a node that goes offline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from nodesvc import messages
from nodesvc.messages import PayloadError
from scheduler.service.engine import GpuState, NodeState, Placement, PlacementEngine, Preemption
from scheduler.service.store import ConflictError, DecisionRow, JobRow, JobStore

log = logging.getLogger("dlshare.sched.live")

TERMINAL = {"done", "failed", "cancelled"}
ACTIVE = {"running"}


class CommandFailed(RuntimeError):
    pass


class SchedulerService:
    def __init__(self, store: JobStore, engine: PlacementEngine, broker_url: str | None = None,
                 service_id: str = "sched", tick_s: float = 2.0, command_timeout_s: float = 10.0,
                 node_timeout_s: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.engine = engine
        self.broker_url = broker_url
        self.service_id = service_id
        self.tick_s = tick_s
        self.command_timeout_s = command_timeout_s
        self.node_timeout_s = node_timeout_s
        self.clock = clock
        self.nodes: dict[str, NodeState] = {}
        self.aggregation: dict[str, dict[str, Any]] = {}
        self.bus = None
        self._wake = asyncio.Event()
        self._pending: dict[str, asyncio.Future] = {}
        self._last_account = clock()
        self._tasks: list[asyncio.Task] = []
        self._inflight: set[str] = set()  # jobs whose placement commands are on their way
        self.decision_latency_s: list[float] = []  # submit -> running, for the benchmark
        self._restore()

    # --- restart --------------------------------------------------------------------------

    def _restore(self) -> None:
        """Rebuild allocations from the store after a restart."""
        rows, _ = self.store.list_jobs(states=["running"], limit=1_000_000)
        for j in rows:
            a = j.allocation
            if a and a.get("node"):
                node = self.nodes.setdefault(a["node"], NodeState(id=a["node"]))
                node.allocations[j.id] = a
        if rows:
            log.info("restored %d running jobs from %s", len(rows), self.store.path)

    # --- API side -----------------------------------------------------------------------

    def submit(self, spec: dict[str, Any]) -> tuple[JobRow, bool]:
        """Persist a validated spec as a queued job; raises ConflictError for a clashing id."""
        job_id = spec.pop("id", None)
        row, created = self.store.add_job(job_id, spec)
        if created:
            self.wake()
        return row, created

    async def cancel(self, job_id: str) -> JobRow | None:
        job = self.store.get_job(job_id)
        if job is None:
            return None
        if job.state in TERMINAL:
            return job
        if job.state == "running" and job.allocation:
            node = job.allocation["node"]
            self.store.update_job(job_id, event="cancel_requested", node=node, reason="cancelled by user")
            try:
                await self.command(node, "stop", {"job": job_id}, f"{job_id}:stop:{uuid.uuid4().hex[:8]}")
            except CommandFailed as exc:
                log.warning("stop of %s on %s failed: %s", job_id, node, exc)
            await self._release(job_id, node)
        self.store.update_job(job_id, event="cancelled", state="cancelled", reason="cancelled by user",
                              finished_at=self.clock(), allocation=None)
        self.wake()
        return self.store.get_job(job_id)

    def wake(self) -> None:
        self._wake.set()

    # --- MQTT -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.broker_url:
            from nodesvc.bus import Bus

            self.bus = Bus(
                self.broker_url, f"dlshare-sched-{self.service_id}-{uuid.uuid4().hex[:6]}",
                subscriptions=[(messages.topic("node", "+", leaf), 1) for leaf in ("telemetry", "state", "reply", "events")]
                + [(messages.topic("agg", "+", "telemetry"), 0)],
                handler=self.on_message, on_connect=self._on_connect,
                will=(messages.topic("sched", self.service_id, "state"),
                      messages.encode({"status": "offline"}), 1, True),
            )
            self._stop = asyncio.Event()
            self._tasks.append(asyncio.create_task(self.bus.run(self._stop), name="sched-bus"))
        self._tasks.append(asyncio.create_task(self._loop(), name="sched-loop"))

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.publish(messages.topic("sched", self.service_id, "state"),
                                   messages.encode({"status": "offline", "ts": self.clock()}), 1, True)
            self._stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        self._tasks.clear()

    async def _on_connect(self, bus) -> None:
        await bus.publish(messages.topic("sched", self.service_id, "state"),
                          messages.encode({"status": "online", "ts": self.clock(), "profile": self.engine.profile}),
                          1, True)
        # Commands whose reply we never saw are re-sent with the same ids (the node dedupes).
        self.wake()

    async def on_message(self, topic: str, payload: bytes) -> None:
        try:
            kind, ident, leaf = messages.parse_topic(topic)
        except PayloadError as exc:
            log.warning("ignoring message: %s", exc)
            return
        try:
            if kind == "agg":
                self.aggregation[ident] = {**messages.decode(payload), "_seen": self.clock()}
            elif leaf == "telemetry":
                self.on_telemetry(messages.parse_telemetry(payload))
            elif leaf == "state":
                await self.on_node_state(ident, messages.decode(payload) if payload else {"status": "offline"})
            elif leaf == "reply":
                self.on_reply(messages.decode(payload))
            elif leaf == "events":
                await self.on_node_event(ident, messages.decode(payload))
        except PayloadError as exc:
            log.warning("bad %s payload from %s/%s: %s", leaf, kind, ident, exc)

    def on_telemetry(self, t: dict[str, Any]) -> None:
        node = self.nodes.setdefault(t["node"], NodeState(id=t["node"]))
        was_new = node.status != "online"
        node.last_seen = self.clock()
        node.status = "online"
        cpu, mem, gpus = t["cpu"], t["memory"], t["gpus"]
        node.cpu_count = int(cpu.get("count") or 0)
        node.cpu_percent = cpu.get("percent")
        node.memory_total_bytes = int(mem["total_bytes"])
        node.memory_available_bytes = int(mem["available_bytes"])
        node.reserved_unused_bytes = int(mem.get("reserved_unused_bytes") or 0)
        node.promised_bytes = int(mem.get("promised_bytes") or 0)
        node.gpus = [GpuState(index=int(g.get("index", i)), name=str(g.get("name", "")),
                              util_percent=g.get("util_percent"), memory_used_bytes=g.get("memory_used_bytes"),
                              memory_total_bytes=g.get("memory_total_bytes"))
                     for i, g in enumerate(gpus.get("devices") or []) if isinstance(g, dict)]
        node.gpu_reason = gpus.get("reason")
        donor = t.get("donor") or {}
        if isinstance(donor, dict):
            node.lendable_bytes = int(donor.get("lendable_bytes") or donor.get("free_bytes") or 0)
            node.lent_bytes = int(donor.get("lent_bytes") or donor.get("used_bytes") or 0)
        jobs = t.get("jobs") or {}
        node.job_usage = {k: v for k, v in jobs.items() if isinstance(v, dict)} if isinstance(jobs, dict) else {}
        try:
            self.engine.observe(node, node.last_seen)
        except Exception:  # noqa: BLE001 - a predictor update never stops the loop
            log.exception("predictor update failed for node %s", node.id)
        for job, usage in node.job_usage.items():
            if usage.get("state") == "exited" and job in node.allocations:
                asyncio.get_running_loop().create_task(
                    self._job_exited(node.id, job, usage.get("exit_code"), "telemetry"))
        if was_new:
            self.store.log_event("node_online", node=node.id, data={"cpus": node.cpu_count, "gpus": len(node.gpus)})
            self.wake()

    async def on_node_state(self, node_id: str, state: dict[str, Any]) -> None:
        status = state.get("status")
        node = self.nodes.setdefault(node_id, NodeState(id=node_id))
        if status == "offline" and node.status != "offline":
            node.status = "offline"
            await self._node_lost(node, "went offline (Last Will)" if not state.get("ts") else "went offline")
        elif status == "online" and node.status != "online":
            node.status = "online"
            node.last_seen = self.clock()
            self.store.log_event("node_online", node=node_id, data={})
            self.wake()

    async def _node_lost(self, node: NodeState, why: str) -> None:
        jobs = list(node.allocations)
        self.store.log_event("node_offline", node=node.id, data={"why": why, "jobs": jobs})
        log.warning("node %s %s; requeueing %d jobs", node.id, why, len(jobs))
        for job in jobs:
            node.allocations.pop(job, None)
            row = self.store.get_job(job)
            if row is not None and row.state == "running":
                self.store.update_job(job, event="requeued", node=node.id, state="queued",
                                      reason=f"node {node.id} {why}", allocation=None)
        self.wake()

    def on_reply(self, r: dict[str, Any]) -> None:
        fut = self._pending.pop(str(r.get("id")), None)
        if fut is not None and not fut.done():
            fut.set_result(r)

    async def on_node_event(self, node_id: str, ev: dict[str, Any]) -> None:
        if ev.get("event") == "job_exit" and isinstance(ev.get("job"), str):
            code = ev.get("exit_code")
            await self._job_exited(node_id, ev["job"], code if isinstance(code, int) else None, "event")

    async def _job_exited(self, node_id: str, job_id: str, code: int | None, via: str) -> None:
        node = self.nodes.get(node_id)
        if node is None or job_id not in node.allocations:
            return  # already handled (the event and the telemetry both report an exit)
        node.allocations.pop(job_id, None)
        row = self.store.get_job(job_id)
        if row is not None and row.state == "running":
            state = "done" if code == 0 else "failed"
            self.store.update_job(job_id, event="exited", node=node_id, event_data={"exit_code": code, "via": via},
                                  state=state, exit_code=code, finished_at=self.clock(),
                                  reason=None if code == 0 else f"exited with code {code}")
        elif row is not None and row.state == "preempted":
            self.store.update_job(job_id, event="preempt_done", node=node_id, state="queued", allocation=None)
        await self._release(job_id, node_id)
        self.wake()

    async def command(self, node: str, op: str, args: dict[str, Any], cmd_id: str) -> dict[str, Any]:
        """Send one command (QoS 1) and wait for its reply; raises CommandFailed."""
        if self.bus is None:
            raise CommandFailed("no broker configured")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[cmd_id] = fut
        try:
            if not await self.bus.publish(messages.node_topic(node, "cmd"), messages.command(op, cmd_id, **args), 1):
                raise CommandFailed(f"broker not connected; {op} to {node} not sent")
            try:
                r = await asyncio.wait_for(fut, self.command_timeout_s)
            except TimeoutError:
                raise CommandFailed(f"{op} to {node}: no reply within {self.command_timeout_s}s") from None
        finally:
            self._pending.pop(cmd_id, None)
        if not r.get("ok"):
            raise CommandFailed(f"{op} on {node} refused: {r.get('error')}")
        return r.get("result") or {}

    async def _release(self, job_id: str, node: str) -> None:
        try:
            await self.command(node, "release", {"job": job_id}, f"{job_id}:release:{uuid.uuid4().hex[:8]}")
        except CommandFailed as exc:
            log.info("release of %s on %s: %s", job_id, node, exc)

    # --- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self._account()
                self._check_stale_nodes()
                await self.schedule_round()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("scheduling round failed")

    def _account(self) -> None:
        """Attained service since the last call: GPU-seconds, or CPU-seconds for CPU-only jobs."""
        now = self.clock()
        dt = max(0.0, now - self._last_account)
        self._last_account = now
        amounts = {}
        for node in self.nodes.values():
            if node.status == "offline":
                continue
            for job, a in node.allocations.items():
                amounts[job] = dt * (len(a.get("gpus") or []) or a.get("cpus", 1.0))
        self.store.add_service(amounts)

    def _check_stale_nodes(self) -> None:
        now = self.clock()
        for node in self.nodes.values():
            if node.status == "online" and node.last_seen and now - node.last_seen > self.node_timeout_s:
                node.status = "offline"
                asyncio.get_running_loop().create_task(
                    self._node_lost(node, f"sent no telemetry for {self.node_timeout_s:.0f}s"))

    async def schedule_round(self) -> int:
        """Ask the engine for decisions and carry them out; returns how many jobs were placed."""
        queued, _ = self.store.list_jobs(states=["queued"], limit=100_000)
        queued = [j for j in queued if j.id not in self._inflight]
        if not queued and not any(n.allocations for n in self.nodes.values()):
            return 0
        running, _ = self.store.list_jobs(states=["running"], limit=100_000)
        online = [n for n in self.nodes.values() if n.status == "online"]
        decisions = self.engine.decide([j.as_api() for j in queued], [j.as_api() for j in running], online,
                                       self.clock())
        placed = 0
        starts = []
        for d in decisions:
            if isinstance(d, Placement):
                if self._reserve(d):
                    starts.append(d)
            elif isinstance(d, Preemption):
                await self._preempt(d)
        if starts:
            results = await asyncio.gather(*(self._start(d) for d in starts))
            placed = sum(results)
        return placed

    def _reserve(self, d: Placement) -> bool:
        node = self.nodes.get(d.node)
        row = self.store.get_job(d.job)
        if node is None or node.status != "online" or row is None or row.state != "queued":
            return False
        node.allocations[d.job] = {"node": d.node, "gpus": list(d.gpus), "cpus": d.cpus,
                                   "memory_bytes": d.memory_bytes, "cpuset": d.cpuset}
        self._inflight.add(d.job)
        return True

    async def _start(self, d: Placement) -> bool:
        row = self.store.get_job(d.job)
        assert row is not None
        attempt = row.attempts + 1
        decision_id = f"{d.job}:place:{attempt}"
        alloc = {"node": d.node, "gpus": list(d.gpus), "cpus": d.cpus, "memory_bytes": d.memory_bytes,
                 "cpuset": d.cpuset}
        try:
            if not self.store.record_decision(DecisionRow(id=decision_id, kind="place", job=d.job, node=d.node,
                                                          data=alloc)):
                prior = self.store.decision(decision_id)
                if prior is not None and prior.state == "acked":
                    log.info("decision %s already applied; not sending it again", decision_id)
                    return False
            self.store.set_decision_state(decision_id, "sent")
            spec = row.spec
            args: dict[str, Any] = {"job": d.job, "cpus": d.cpus, "memory_bytes": d.memory_bytes,
                                    "decision": decision_id}
            if d.cpuset:
                args["cpuset"] = d.cpuset
            await self.command(d.node, "allocate", args, f"{decision_id}:allocate")
            env = dict(spec.get("env") or {})
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in d.gpus)
            env["DLSHARE_JOB_ID"] = d.job
            run_args = {**args, "argv": spec["command"], "env": env}
            if spec.get("cwd"):
                run_args["cwd"] = spec["cwd"]
            result = await self.command(d.node, "run", run_args, f"{decision_id}:run")
            self.store.set_decision_state(decision_id, "acked", result)
            now = self.clock()
            self.store.update_job(d.job, event="started", node=d.node, event_data={**alloc, "decision": decision_id,
                                                                                    "why": d.reason},
                                  state="running", allocation=alloc, started_at=now, attempts=attempt, reason=None)
            self.decision_latency_s.append(now - row.submitted_at)
            return True
        except CommandFailed as exc:
            self.store.set_decision_state(decision_id, "failed", {"error": str(exc)})
            node = self.nodes.get(d.node)
            if node is not None:
                node.allocations.pop(d.job, None)
            self.store.update_job(d.job, event="placement_failed", node=d.node, event_data={"error": str(exc)},
                                  reason=str(exc), attempts=attempt)
            await self._release(d.job, d.node)
            return False
        finally:
            self._inflight.discard(d.job)

    async def _preempt(self, p: Preemption) -> None:
        row = self.store.get_job(p.job)
        if row is None or row.state != "running" or not row.allocation:
            return
        node = row.allocation["node"]
        self.store.update_job(p.job, event="preempted", node=node, event_data={"why": p.reason}, state="preempted",
                              reason=p.reason)
        try:
            await self.command(node, "stop", {"job": p.job}, f"{p.job}:stop:{row.attempts}")
        except CommandFailed as exc:
            log.warning("preempting %s on %s: %s", p.job, node, exc)
        n = self.nodes.get(node)
        if n is not None:
            n.allocations.pop(p.job, None)
        await self._release(p.job, node)
        self.store.update_job(p.job, event="requeued", node=node, state="queued", allocation=None)

    # --- views ----------------------------------------------------------------------------

    def cluster(self) -> dict[str, Any]:
        now = self.clock()
        nodes = []
        for n in sorted(self.nodes.values(), key=lambda n: n.id):
            gj = n.gpu_jobs()
            nodes.append({
                "id": n.id, "status": n.status if n.status in ("online", "offline") else "unknown",
                "last_seen": n.last_seen, "cpu_count": n.cpu_count, "cpu_percent": n.cpu_percent,
                "cpus_allocated": n.cpus_allocated, "memory_total_bytes": n.memory_total_bytes,
                "memory_available_bytes": n.memory_available_bytes, "memory_allocated_bytes": n.memory_allocated_bytes,
                "reserved_unused_bytes": n.reserved_unused_bytes, "lendable_bytes": n.lendable_bytes,
                "lent_bytes": n.lent_bytes,
                "gpus": [{"index": g.index, "name": g.name, "util_percent": g.util_percent,
                          "memory_used_bytes": g.memory_used_bytes, "memory_total_bytes": g.memory_total_bytes,
                          "jobs": gj.get(g.index, [])} for g in n.gpus],
                "gpu_reason": n.gpu_reason, "jobs": sorted(n.allocations),
            })
        agg = [a for a in self.aggregation.values() if now - a.get("_seen", 0) < 60]
        online = [n for n in nodes if n["status"] == "online"]
        return {
            "ts": now, "nodes": nodes, "jobs_by_state": self.store.count_by_state(),
            "gpus_total": sum(len(n["gpus"]) for n in online),
            "gpus_allocated": sum(1 for n in online for g in n["gpus"] if g["jobs"]),
            "cpus_total": float(sum(n["cpu_count"] for n in online)),
            "cpus_allocated": float(sum(n["cpus_allocated"] for n in online)),
            "memory_lent_bytes": sum(n["lent_bytes"] for n in online),
            "memory_lendable_bytes": sum(n["lendable_bytes"] for n in online),
            "aggregation": {
                "servers": len(agg),
                "jobs": int(sum(_num(a.get("jobs")) for a in agg)),
                "cores_in_use": float(sum(_num(a.get("cores_in_use", a.get("workers"))) for a in agg)),
                "rounds_per_s": float(sum(_num(a.get("rounds_per_s")) for a in agg)),
            },
            "profile": self.engine.profile,
        }


def _num(v: Any) -> float:
    if isinstance(v, bool):
        return 0.0
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (list, dict)):
        return float(len(v))
    return 0.0


__all__ = ["SchedulerService", "CommandFailed", "ConflictError"]
